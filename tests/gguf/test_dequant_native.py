"""The fused C kernels (gguf/_dequant_native.c through gguf/dequant_native.py).

Their bit-exactness with gguf-py is tested with the torch kernels' tests (test_dequant.py and
test_dequant_iq.py run both); here: that the README's install built them, that they are the ones the
CPU path picks, edge scales, the layout guard, and the fallback when they cannot load.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bitcheck import assert_bits_equal, bits_equal
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from llmdoctor import native
from llmdoctor.gguf import dequant, dequant_native
from llmdoctor.gguf.dequant import dequantize

NATIVE_TYPES = list(dequant_native._FUNCTIONS)
QUANT_TYPES = [q for q in NATIVE_TYPES if q != T.F32]  # F32's kernel is a byte copy: no scales
# Byte offsets of the float16 fields of each block (d, and dmin or m where the type has one).
F16_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.IQ4_NL: (0,),
              T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,)}
# +-0, smallest and largest subnormal, 1, -2, largest finite, +-inf, quiet and signalling NaN.
EDGE_F16 = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x3C00, 0xC000, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0x7C01],
                    dtype=np.uint16)


def test_the_install_built_the_native_kernels():
    ok, why = dequant_native.available()
    assert ok, why


def test_the_cpu_path_picks_the_native_kernel_for_each_type_it_has():
    assert set(QUANT_TYPES) == set(F16_FIELDS)
    cpu = torch.device("cpu")
    for q in NATIVE_TYPES:
        assert dequant._kernel(q, cpu)[1].__name__ == f"native_{q.name.lower()}"
        assert dequant._kernel(q, cpu, native=False)[1].__name__ != f"native_{q.name.lower()}"
    assert not dequant._kernel(T.IQ2_XXS, cpu)[1].__name__.startswith("native")


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_edge_scales_bit_exact_with_the_torch_kernels(qtype):
    """Every edge float16 in every float16 field, against the torch kernels (themselves tested
    against gguf-py); NaN payloads included, since both follow numpy's conversion."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    n = len(EDGE_F16) ** len(F16_FIELDS[qtype])
    blocks = rng.integers(0, 256, size=(n, type_size), dtype=np.uint8)
    grids = np.meshgrid(*[EDGE_F16] * len(F16_FIELDS[qtype]), indexing="ij")
    for off, bits in zip(F16_FIELDS[qtype], grids):
        blocks[:, off : off + 2] = bits.reshape(-1).view(np.uint8).reshape(n, 2)
    raw = torch.from_numpy(blocks.reshape(-1))
    ours = dequantize(raw, qtype, (n, block_size))
    assert_bits_equal(ours, dequantize(raw, qtype, (n, block_size), native=False), qtype.name)


def test_a_layout_mismatch_disables_the_native_kernels(monkeypatch):
    """If gguf ever changed a block size, the C kernels (written for today's) must not run."""
    monkeypatch.setitem(dequant_native.GGML_QUANT_SIZES, T.Q4_K, (256, 146))
    lib, why = dequant_native._load()
    assert lib is None and "Q4_K" in why and "rebuild" in why


def test_a_stale_build_is_refused(monkeypatch):
    """An editable install does not rebuild the C file: a library of another interface must not be
    called with the wrong arguments."""
    monkeypatch.setattr(dequant_native, "_ABI", dequant_native._ABI + 1)
    lib, why = dequant_native._load()
    assert lib is None and "stale build" in why and "rebuild" in why


def test_without_the_library_the_reason_is_given(monkeypatch):
    monkeypatch.setattr(native.importlib.util, "find_spec", lambda name: None)
    lib, why = dequant_native._load()
    assert lib is None and "not built" in why


def test_f32_is_every_stored_bit(monkeypatch):
    """The F32 kernel copies the stored bytes (NaN payloads, signalling or not, and -0 included) as
    the torch kernel does, for lengths around its 4-value steps, from a source at an odd byte offset,
    streamed or not, on 1 and 2 threads, into an aligned output and one 4 bytes off."""
    rng = np.random.default_rng(5)
    words = rng.integers(0, 2**32, 3 * 65536 + 5, dtype=np.uint64).astype(np.uint32)
    words[:6] = [0x7F800001, 0xFFC00001, 0x7FC00000, 0x80000000, 0x7F800000, 0x00000001]
    data = np.concatenate([np.zeros(1, np.uint8), words.view(np.uint8)])  # the source at offset 1
    before = torch.get_num_threads()
    try:
        for stream_bytes in (dequant._STREAM_BYTES, 0):
            monkeypatch.setattr(dequant, "_STREAM_BYTES", stream_bytes)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for n in (1, 3, 4, 5, 7, 8, 9, 4096 + 3, 3 * 65536 + 5):  # the last: several chunks of the C pool
                    raw = torch.from_numpy(data[1 : 1 + 4 * n])
                    want = words[:n]
                    buf = torch.empty(n + 1)
                    for start in (0, 1):
                        out = buf[start : start + n]
                        got = dequantize(raw, T.F32, (n,), out=out)
                        assert np.array_equal(got.numpy().view(np.uint32), want), (n, start, threads, stream_bytes)
                    assert np.array_equal(dequantize(raw, T.F32, (n,), native=False).numpy().view(np.uint32), want)
    finally:
        torch.set_num_threads(before)


def test_non_contiguous_or_wrong_blocks_are_refused_by_the_block_kernel():
    kernel = dequant._kernel(T.Q8_0, torch.device("cpu"))[1]
    with pytest.raises(ValueError, match="expected CPU uint8 blocks"):
        kernel(torch.zeros(4, 33, dtype=torch.uint8))
    blocks = torch.zeros(4, 68, dtype=torch.uint8)[:, :34]  # strided rows: copied, then decoded
    assert torch.equal(kernel(blocks), torch.zeros(4, 32))


def _q4k_case(seed: int, n_blocks: int) -> tuple[torch.Tensor, np.ndarray]:
    """(raw bytes, gguf-py's float32 values) for random Q4_K blocks with finite scales."""
    import gguf.quants as gq

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, 144), dtype=np.uint8)
    for off in (0, 2):
        blocks[:, off : off + 2] = rng.uniform(-1, 1, n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(-1)), gq.dequantize(blocks, T.Q4_K).reshape(-1)


def test_the_c_pool_gives_exact_results_to_concurrent_callers(monkeypatch):
    """Two Python threads at once: one gets the pool, the other runs on its own thread; both exact,
    over many calls (each a new pool job) with a short last chunk."""
    import threading

    monkeypatch.setattr(dequant, "_NATIVE_CHUNK", 256 * 7)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    cases = [_q4k_case(seed, 50 + seed) for seed in range(2)]
    errors: list[str] = []

    def work(raw: torch.Tensor, want: np.ndarray) -> None:
        for _ in range(200):
            got = dequantize(raw, T.Q4_K, (want.size,)).numpy()
            if not bits_equal(got, want, nan_equal=False):
                errors.append("differs")
                return

    try:
        threads = [threading.Thread(target=work, args=case) for case in cases]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a dequantize call hung"
    finally:
        torch.set_num_threads(before)
    assert not errors


def _dequantize_in_child(conn) -> None:  # runs in a forked child
    torch.set_num_threads(2)
    raw, want = _q4k_case(3, 400)
    got = dequantize(raw, T.Q4_K, (want.size,)).numpy()
    # numpy, not bitcheck: torch ops in a forked child can wait forever on the parent's OpenMP pool
    conn.send(bool(np.array_equal(got.view(np.uint32), want.view(np.uint32))))


def test_a_forked_child_can_use_the_c_pool(monkeypatch):
    """The parent's helper threads do not exist in a fork: the child's calls must still complete
    (its caller claims every chunk no helper takes), exactly."""
    import multiprocessing as mp

    monkeypatch.setattr(dequant, "_NATIVE_CHUNK", 256 * 7)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        raw, want = _q4k_case(4, 400)
        dequantize(raw, T.Q4_K, (want.size,))  # the parent's pool is running now
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_dequantize_in_child, args=(child,))
        proc.start()
        proc.join(timeout=60)
        hung = proc.is_alive()
        if hung:
            proc.kill()
        assert not hung, "the forked child hung in the C pool"
        assert proc.exitcode == 0 and parent.recv() is True
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", NATIVE_TYPES, ids=lambda q: q.name)
def test_streamed_output_is_the_same(monkeypatch, qtype):
    """Non-temporal stores (used for huge outputs; here forced for every size) write the same bits,
    into an aligned buffer and into one that starts 4 bytes off alignment (regular stores then)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.random.default_rng(int(qtype) + 7).integers(0, 256, size=(300, type_size), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype, ()):
        blocks[:, off : off + 2] = np.array([0.25], dtype=np.float16).view(np.uint8)
    raw = torch.from_numpy(blocks.reshape(-1))
    want = dequantize(raw, qtype, (300, block_size)).numpy()
    monkeypatch.setattr(dequant, "_STREAM_BYTES", 0)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            buf = torch.empty(300 * block_size + 1)
            for start in (0, 1):
                out = buf[start : start + 300 * block_size].view(300, block_size)
                got = dequantize(raw, qtype, (300, block_size), out=out)
                assert_bits_equal(got, want, f"{threads} threads, out at +{start}", nan_equal=False)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q5_0, T.Q6_K], ids=lambda q: q.name)
def test_nan_scales_give_gguf_pys_nan_bits(qtype):
    """Signalling and quiet NaN scales, either sign: every output bit as gguf-py's (numpy keeps a
    signalling NaN signalling when it widens the scale; the product then quiets it on both sides)."""
    import gguf.quants as gq

    block_size, type_size = GGML_QUANT_SIZES[qtype]
    nans = np.array([0x7C01, 0xFC01, 0x7E00, 0xFE3F, 0x7D55], dtype=np.uint16)
    blocks = np.random.default_rng(3).integers(0, 256, size=(len(nans), type_size), dtype=np.uint8)
    off = F16_FIELDS[qtype][0]
    blocks[:, off : off + 2] = nans.view(np.uint8).reshape(-1, 2)
    got = dequantize(torch.from_numpy(blocks.reshape(-1)), qtype, (len(nans), block_size))
    with np.errstate(invalid="ignore"):
        want = gq.dequantize(blocks, qtype).reshape(len(nans), block_size)
    assert np.isnan(want).any()
    assert_bits_equal(got, want, qtype.name, nan_equal=False)
