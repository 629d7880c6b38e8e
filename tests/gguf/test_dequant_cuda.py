"""The Triton block kernels (gguf/dequant_cuda.py) are bit-exact with gguf-py's dequantize.

Runs on a CUDA GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1); skipped otherwise
(CI has neither a GPU nor Triton).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from bitcheck import assert_bits_equal
from gguf.quants import dequantize as gguf_dequantize

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Under the interpreter these are CPU tests, which conftest's gpu-skip must not catch.
pytestmark = [] if INTERPRET else pytest.mark.gpu

triton = pytest.importorskip("triton", reason="Triton is not installed")
if torch.cuda.is_available():
    DEVICE = "cuda"
elif INTERPRET:
    DEVICE = "cpu"  # Triton's interpreter runs the kernels on CPU tensors
else:
    pytest.skip("no CUDA device (and TRITON_INTERPRET is not 1)", allow_module_level=True)

from llmdoctor.gguf import dequant, dequant_cuda  # noqa: E402

Q = GGMLQuantizationType

# Byte offsets of the float16 scale fields in each type's block (gguf-py quants.py layouts); random
# blocks get finite values there, so both sides compute on finite numbers.
F16_FIELDS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.IQ4_NL: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_XS: (0,),
}


def random_blocks(qtype: Q, n_blocks: int, seed: int) -> np.ndarray:
    """uint8 [n_blocks, type_size] of random bytes whose float16 fields are finite (any sign, subnormals too)."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        h = blocks[:, off : off + 2].copy().view(np.uint16)
        inf_or_nan = (h & 0x7C00) == 0x7C00
        h[inf_or_nan] &= np.uint16(0xBFFF)  # clear the top exponent bit: finite
        blocks[:, off : off + 2] = h.view(np.uint8)
    return blocks


def assert_flat_bits_equal(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    """Every bit equal, NaN payloads included, comparing the values in row-major order."""
    assert_bits_equal(got.reshape(-1), np.asarray(want, dtype=np.float32).reshape(-1), what, nan_equal=False)


@pytest.mark.parametrize("qtype", sorted(dequant_cuda._SPECS, key=int), ids=lambda q: q.name)
def test_random_blocks_bit_exact(qtype: Q) -> None:
    # 67 blocks: not a multiple of any BB, so the tail program's masked stores are exercised too.
    blocks = random_blocks(qtype, 67, seed=int(qtype))
    want = gguf_dequantize(blocks, qtype)
    out = torch.full((67, GGML_QUANT_SIZES[qtype][0]), float("nan"), device=DEVICE)  # poisoned
    got = dequant_cuda.launch(torch.from_numpy(blocks).to(DEVICE), qtype, out=out)
    assert_flat_bits_equal(got, want, qtype.name)


@pytest.mark.parametrize("bb", [1, 4, 16])
def test_program_sizes_agree(bb: int) -> None:
    """Every BB computes the same function (the benchmark sweeps BB; a tail of 1..bb-1 blocks)."""
    for qtype in (Q.Q4_K, Q.Q6_K, Q.Q5_0):
        blocks = random_blocks(qtype, 2 * bb + 1, seed=bb)
        got = dequant_cuda.launch(torch.from_numpy(blocks).to(DEVICE), qtype, bb=bb)
        assert_flat_bits_equal(got, gguf_dequantize(blocks, qtype), f"{qtype.name} BB={bb}")


def test_registered_for_cuda() -> None:
    for qtype in dequant_cuda._SPECS:
        assert dequant._CUDA_KERNELS[qtype].__name__ == f"triton_{qtype.name.lower()}"


@pytest.mark.skipif(DEVICE != "cuda", reason="the entry point sends CUDA tensors to these kernels only")
def test_entry_point_uses_kernels_on_demo_tensors() -> None:
    """Every tensor of the demo file of a type we have a kernel for, through `dequantize(..., device='cuda')`."""
    from llmdoctor.demo import model_path
    from llmdoctor.errors import InputError
    from llmdoctor.gguf import open_gguf

    try:
        path = model_path()
    except InputError as e:
        pytest.skip(f"demo model unavailable: {e}")
    f = open_gguf(path)
    n = 0
    for t in f.tensors:
        if t.type not in dequant_cuda._SPECS:
            continue
        got = dequant.dequantize(t.data, t.type, t.shape, device="cuda")
        assert_flat_bits_equal(got, gguf_dequantize(np.asarray(t.data), t.type), t.name)
        n += 1
    assert n > 0


@pytest.mark.skipif(DEVICE != "cuda", reason="the entry point sends CUDA tensors to these kernels only")
@pytest.mark.parametrize("qtype", sorted(dequant_cuda._SPECS, key=int), ids=lambda q: q.name)
def test_entry_point_on_cuda(qtype: Q) -> None:
    """`dequantize(raw, qtype, shape, device='cuda')` reaches the Triton kernel and stays bit-exact."""
    block_size, _ = GGML_QUANT_SIZES[qtype]
    blocks = random_blocks(qtype, 3 * 41, seed=7)
    got = dequant.dequantize(blocks.reshape(-1), qtype, (3, 41 * block_size), device="cuda")
    assert got.is_cuda and tuple(got.shape) == (3, 41 * block_size)
    assert_flat_bits_equal(got, gguf_dequantize(blocks, qtype), qtype.name)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs 11 GB of GPU memory")
def test_offsets_past_2_31() -> None:
    """A tensor of more than 2**31 input bytes and output elements: its last blocks land right (the
    kernels index with int64; int32 offsets would wrap)."""
    qtype = Q.Q8_0
    n = (1 << 31) // 32 + 5  # 34 bytes and 32 output elements per block: both past 2**31
    if torch.cuda.mem_get_info()[0] < n * (34 + 4 * 32) * 1.1:
        pytest.skip("not enough free GPU memory")
    ends = random_blocks(qtype, 128, seed=31)
    raw = torch.zeros((n, 34), dtype=torch.uint8, device="cuda")
    raw[:64] = torch.from_numpy(ends[:64]).cuda()
    raw[-64:] = torch.from_numpy(ends[64:]).cuda()
    out = torch.full((n, 32), float("nan"), device="cuda")  # poisoned
    dequant_cuda.launch(raw, qtype, out=out)
    want = gguf_dequantize(ends, qtype)
    assert_flat_bits_equal(out[:64], want[:64], "first blocks")
    assert_flat_bits_equal(out[-64:], want[64:], "last blocks")


def assert_same_up_to_nan_bits(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    """Bit-exact except that a NaN may have other bits (payload, sign) than gguf-py's NaN there."""
    got = got.cpu().numpy().reshape(-1)
    want = want.astype(np.float32).reshape(-1)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"{what}: NaN at other positions"
    assert_flat_bits_equal(torch.from_numpy(got[~nan]), want[~nan], what)


@pytest.mark.skipif(DEVICE != "cuda", reason="tests the torch kernels on CUDA")
def test_types_without_triton_kernel_on_cuda() -> None:
    """The other types reach CUDA through the device-agnostic torch block kernels: also exact there.
    Random bytes (scales may be inf/NaN, hence NaN bits are not compared)."""
    rng = np.random.default_rng(5)
    others = [q for q in dequant.supported_types() if q not in dequant_cuda._SPECS]
    assert others
    for qtype in others:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, size=(97, type_size), dtype=np.uint8)
        got = dequant.dequantize(blocks.reshape(-1), qtype, (97 * block_size,), device="cuda")
        with np.errstate(all="ignore"):
            want = gguf_dequantize(blocks.reshape(-1), qtype)
        assert_same_up_to_nan_bits(got, want, qtype.name)
