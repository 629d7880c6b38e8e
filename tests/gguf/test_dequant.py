"""Our dequantizer against gguf-py's numpy `gguf.quants.dequantize`: float32 bit for bit.

Scope: the float, legacy, K, ternary and FP4 types (the IQ types are tested in test_dequant_iq.py).
Tests marked with the `native` parameter run twice: with the fused C kernels where a type has one
(the default on the CPU) and with the torch kernels (`native=False`).
Equality is on the float32 bit patterns; two NaNs count as equal whatever their payloads
(`bitcheck.assert_bits_equal`).
"""

from __future__ import annotations

import gguf.quants as gq
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from bitcheck import assert_bits_equal, bits_equal

from llmdoctor.errors import InputError
from llmdoctor.gguf import open_gguf
from llmdoctor.gguf.dequant import dequantize, dequantize_blocks, dequantize_tensor, supported_types

# Byte offsets of the float16 scale fields in each block (from the block layouts in gguf-py's
# dequantize_blocks); random bytes there are replaced by random finite float16.
F16_FIELDS = {
    T.F16: (0,),
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.TQ1_0: (52,),
    T.TQ2_0: (64,),
}
# Types with no float16 field: F32/BF16 have no scale (random bits, NaNs included, are the values);
# MXFP4 (E8M0 exponent) and NVFP4 (UE4M3) scales are finite for every byte.
NO_F16_FIELDS = (T.F32, T.BF16, T.MXFP4, T.NVFP4)
TYPES = list(F16_FIELDS) + list(NO_F16_FIELDS)


def reference(blocks: np.ndarray, qtype: T) -> np.ndarray:
    """gguf-py's float32 [n_blocks, block_size] for uint8 blocks [n_blocks, type_size]."""
    with np.errstate(over="ignore", invalid="ignore"):  # inf/NaN scales: in gguf-py as in ours
        if qtype in (T.F32, T.F16):  # gguf-py's dequantize views these; give it one row of bytes
            return gq.dequantize(blocks.reshape(-1), qtype).reshape(blocks.shape[0], -1)
        return gq.dequantize(blocks, qtype)


def random_blocks(qtype: T, n: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, type_size]: random bytes, float16 scale fields random finite of varied magnitude."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n, type_size), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype, ()):
        bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
        bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # exponent 31 (inf/NaN) -> 15: every exponent else kept
        blocks[:, off : off + 2] = bits.view(np.uint8).reshape(n, 2)
    return blocks


def test_supported_types_cover_every_non_iq_type_gguf_py_can_dequantize():
    ours = set(supported_types())
    for q in TYPES:
        assert q in ours, q.name
    assert T.Q1_0 not in gq._type_traits  # gguf 0.19 cannot dequantize Q1_0: nothing to be exact with


NATIVE = pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])


@NATIVE
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_random_blocks_bit_exact(qtype, native):
    rng = np.random.default_rng(int(qtype))
    blocks = random_blocks(qtype, 3000, rng)
    block_size, _ = GGML_QUANT_SIZES[qtype]
    want = reference(blocks, qtype)
    got = dequantize(blocks.reshape(-1), qtype, (blocks.shape[0] * block_size,), native=native)
    assert_bits_equal(got.view(blocks.shape[0], block_size), want, qtype.name)
    if native:
        assert_bits_equal(dequantize_blocks(blocks, qtype), want, qtype.name + " (dequantize_blocks)")


@NATIVE
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_non_finite_scales_match_up_to_nan_payloads(qtype, native):
    """Unforced random bytes (inf/NaN/subnormal float16 scales included): same bits, NaN for NaN."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.random.default_rng(100 + int(qtype)).integers(0, 256, size=(2000, type_size), dtype=np.uint8)
    got = dequantize(blocks.reshape(-1), qtype, (2000, block_size), native=native)
    assert_bits_equal(got, reference(blocks, qtype), qtype.name)


@pytest.mark.parametrize("qtype", [T.F16, T.BF16, T.F32], ids=lambda q: q.name)
def test_float_types_every_bit_pattern_including_nan_payloads(qtype):
    """Every float16/bfloat16 pattern (and a sample of float32 ones) converts exactly, NaN payload
    and signalling bit included."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    if type_size == 2:
        blocks = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.uint8).reshape(-1, 2)
    else:
        special = np.array([0x7F800001, 0x7FC00001, 0xFF800001, 0x7F800000, 0x80000000, 1], dtype=np.uint32)
        rand = np.random.default_rng(0).integers(0, 1 << 32, size=10_000, dtype=np.uint32)
        blocks = np.concatenate([special, rand]).view(np.uint8).reshape(-1, 4)
    want = reference(blocks, qtype)
    got = dequantize_blocks(blocks, qtype)
    assert bits_equal(got, want, nan_equal=False)


@pytest.mark.slow
@NATIVE
def test_demo_file_every_tensor_bit_exact(demo_path, native):
    f = open_gguf(demo_path)
    buf = torch.empty(max(t.n_elements for t in f.tensors))
    for t in f.tensors:
        out = buf[: t.n_elements].view(t.shape)
        got = dequantize_tensor(t, out=out) if native else dequantize(t.data, t.type, t.shape, out=out, native=False)
        want = gq.dequantize(t.data.reshape(t.shape[:-1] + (-1,)), t.type)
        assert_bits_equal(got, want.reshape(t.shape), t.name)


@NATIVE
@pytest.mark.parametrize("threads", [1, 2])
def test_chunked_output_matches_one_piece(monkeypatch, threads, native):
    """Several chunks with a short last one, run inline (1 thread) or on the chunk workers (2),
    give the same bits as gguf-py, for float32 and a reduced dtype."""
    from llmdoctor.gguf import dequant

    monkeypatch.setitem(dequant._CHUNK_ELEMENTS, "cpu", 1000)  # 3 blocks of 256 per chunk
    monkeypatch.setattr(dequant, "_MIN_PARALLEL_CHUNK", 1000)
    monkeypatch.setattr(dequant, "_NATIVE_CHUNK", 1000)  # the native kernels' chunks
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        blocks = random_blocks(T.Q4_K, 10, np.random.default_rng(1))
        raw = torch.from_numpy(blocks.reshape(-1))
        want = reference(blocks, T.Q4_K).reshape(5, 512)
        assert_bits_equal(dequantize(raw, T.Q4_K, (5, 512), native=native), want, "Q4_K chunked")
        half = dequantize(raw, T.Q4_K, (5, 512), dtype=torch.bfloat16, native=native)
        assert torch.equal(half, torch.from_numpy(want).to(torch.bfloat16))
    finally:
        torch.set_num_threads(before)


def test_inference_mode_out_written_from_the_chunk_workers(monkeypatch):
    """An `out` created under inference mode can only be written under it: the workers must inherit it."""
    from llmdoctor.gguf import dequant

    monkeypatch.setitem(dequant._CHUNK_ELEMENTS, "cpu", 1000)
    monkeypatch.setattr(dequant, "_MIN_PARALLEL_CHUNK", 1000)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        blocks = random_blocks(T.Q8_0, 100, np.random.default_rng(4))
        with torch.inference_mode():
            out = torch.empty(100, 32)
            dequantize(torch.from_numpy(blocks.reshape(-1)), T.Q8_0, (100, 32), out=out)
        assert_bits_equal(out, reference(blocks, T.Q8_0), "Q8_0 in inference mode")
    finally:
        torch.set_num_threads(before)


@NATIVE
def test_out_and_dtype(native):
    blocks = random_blocks(T.Q6_K, 8, np.random.default_rng(2))
    raw = torch.from_numpy(blocks.reshape(-1))
    want = torch.from_numpy(reference(blocks, T.Q6_K).reshape(4, 512))

    out = torch.full((4, 512), 7.0)
    assert dequantize(raw, T.Q6_K, (4, 512), out=out, native=native) is out
    assert torch.equal(out, want)

    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        got = dequantize(raw, T.Q6_K, (4, 512), dtype=dtype, native=native)
        assert got.dtype == dtype and torch.equal(got, want.to(dtype))
        out = torch.empty(4, 512, dtype=dtype)
        assert dequantize(raw, T.Q6_K, (4, 512), dtype=dtype, out=out, native=native) is out
        assert torch.equal(out, want.to(dtype))

    strided = torch.empty(512, 4).t()  # a non-contiguous out is filled too
    assert dequantize(raw, T.Q6_K, (4, 512), out=strided, native=native) is strided
    assert torch.equal(strided, want)

    with pytest.raises(InputError, match="out must be"):
        dequantize(raw, T.Q6_K, (4, 512), out=torch.empty(4, 512, dtype=torch.float16))
    with pytest.raises(InputError, match="out must be"):
        dequantize(raw, T.Q6_K, (4, 512), out=torch.empty(2, 1024))
    with pytest.raises(InputError, match="floating"):
        dequantize(raw, T.Q6_K, (4, 512), dtype=torch.int32)


def test_read_only_input_is_not_copied_or_written():
    blocks = random_blocks(T.Q8_0, 4, np.random.default_rng(3)).reshape(-1)
    before = blocks.copy()
    blocks.flags.writeable = False
    got = dequantize(blocks, T.Q8_0, (128,))
    assert np.array_equal(blocks, before)
    assert_bits_equal(got, reference(blocks.reshape(4, -1), T.Q8_0).reshape(-1), "read-only Q8_0")


def test_bad_input_is_a_clear_input_error():
    raw = torch.zeros(34 * 4, dtype=torch.uint8)
    with pytest.raises(InputError, match=r"Q8_0: 135 bytes for shape \(128,\), expected 136"):
        dequantize(raw[:-1], T.Q8_0, (128,))
    with pytest.raises(InputError, match="multiple of 32"):
        dequantize(raw, T.Q8_0, (4, 31))
    with pytest.raises(InputError, match="unknown GGML type 99"):
        dequantize(raw, 99, (128,))
    with pytest.raises(InputError, match="no dequantizer for Q1_0"):
        dequantize(raw, T.Q1_0, (128,))
    with pytest.raises(InputError, match="uint8"):
        dequantize(raw.float(), T.Q8_0, (128,))
    with pytest.raises(InputError, match="blocks have 33 bytes"):
        dequantize_blocks(raw.view(4, 34)[:, :33], T.Q8_0)
