"""The IQ dequant kernels against gguf-py's numpy `gguf.quants.dequantize`: float32 bits must match."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from bitcheck import assert_bits_equal

from llmdoctor.errors import InputError
from llmdoctor.gguf import dequantize

IQ_TYPES = [T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS]
# Hand-picked float16 scales: +-0, smallest subnormal, largest subnormal, 1, -2, largest finite.
EDGE_F16 = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x3C00, 0xC000, 0x7BFF, 0xFBFF], dtype=np.uint16)


def _random_finite_f16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    inf_or_nan = (bits & 0x7C00) == 0x7C00
    bits[inf_or_nan] &= np.uint16(~0x4000 & 0xFFFF)  # exponent 31 -> 15: finite
    return bits


def _set_scale(blocks: np.ndarray, qtype: T, bits: np.ndarray) -> None:
    """Write float16 bit patterns `bits` [n] as the super-block scale d of `blocks` [n, type_size]."""
    if qtype == T.IQ1_M:  # d is spread over the top nibbles of the 4 uint16 at bytes 48..55, low nibble first
        sc = blocks[:, 48:56].copy().view(np.uint16)  # [n, 4]
        nib = (bits[:, None] >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 0xF
        blocks[:, 48:56] = ((sc & 0x0FFF) | (nib << 12)).astype(np.uint16).view(np.uint8)
    else:
        blocks[:, 0:2] = bits.view(np.uint8).reshape(-1, 2)


def _random_blocks(qtype: T, n_blocks: int, seed: int, finite: bool = True) -> np.ndarray:
    """uint8 [n_blocks, type_size]: random bytes; with `finite`, d is a random finite float16."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n_blocks, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    if finite:
        _set_scale(blocks, qtype, _random_finite_f16_bits(rng, n_blocks))
    return blocks


def _ours_and_ref(qtype: T, blocks: np.ndarray, rows: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(ours, gguf-py). For the IQ4 types, which also have fused C kernels, ours runs both the C
    and the torch kernel, which must agree bit for bit (NaNs included)."""
    block_size = GGML_QUANT_SIZES[qtype][0]
    shape = (rows, blocks.shape[0] * block_size // rows)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = gguf_dequantize(blocks.reshape(rows, -1), qtype)
    raw = torch.from_numpy(blocks.reshape(-1).copy())
    got = dequantize(raw, qtype, shape)
    assert got.dtype == torch.float32 and tuple(got.shape) == shape
    if qtype in (T.IQ4_NL, T.IQ4_XS):
        torch_kernels = dequantize(raw, qtype, shape, native=False).numpy()
        assert_bits_equal(torch_kernels, got.numpy())
    return got.numpy(), ref


@pytest.mark.parametrize("n_blocks", [1, 3, 1000])
@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda q: q.name)
def test_bit_exact_random_blocks(qtype: T, n_blocks: int) -> None:
    got, ref = _ours_and_ref(qtype, _random_blocks(qtype, n_blocks, seed=int(qtype) * 1000 + n_blocks))
    assert np.isfinite(ref).all()
    assert_bits_equal(got, ref)


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda q: q.name)
def test_bit_exact_across_chunks(qtype: T) -> None:
    """2^18 values and one block more: the entry point splits this into several chunks (per worker)."""
    n_blocks = (1 << 18) // GGML_QUANT_SIZES[qtype][0] + 1
    assert_bits_equal(*_ours_and_ref(qtype, _random_blocks(qtype, n_blocks, seed=5)))


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda q: q.name)
def test_bit_exact_edge_scales_and_rows(qtype: T) -> None:
    """Signed zeros, subnormal and extreme scales, a 2-D shape with several blocks per row."""
    blocks = _random_blocks(qtype, 2 * len(EDGE_F16), seed=int(qtype))
    _set_scale(blocks, qtype, np.tile(EDGE_F16, 2))
    assert_bits_equal(*_ours_and_ref(qtype, blocks, rows=4))


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda q: q.name)
def test_non_finite_scales_match_nan_aware(qtype: T) -> None:
    """Unrestricted bytes (d may be inf or NaN): inf and NaN land where gguf-py puts them."""
    blocks = _random_blocks(qtype, 64, seed=7 + int(qtype), finite=False)
    _set_scale(blocks, qtype, np.resize(np.array([0x7C00, 0xFC00, 0x7E00, 0x7C01], dtype=np.uint16), 64))
    got, ref = _ours_and_ref(qtype, blocks)
    assert not np.isfinite(ref).all()
    assert_bits_equal(got, ref)


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda q: q.name)
def test_wrong_byte_count_is_a_clear_error(qtype: T) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = torch.zeros(2 * type_size - 1, dtype=torch.uint8)
    with pytest.raises(InputError, match=rf"{qtype.name}: {2 * type_size - 1} bytes .* expected {2 * type_size}"):
        dequantize(raw, qtype, (2 * block_size,))


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda q: q.name)
def test_unaligned_raw_view(qtype: T) -> None:
    """raw may be a view at an odd byte offset: fields are reinterpreted from copies, not in place."""
    blocks = _random_blocks(qtype, 3, seed=11)
    buf = torch.zeros(blocks.size + 1, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(blocks.reshape(-1))
    got = dequantize(buf[1:], qtype, (3 * GGML_QUANT_SIZES[qtype][0],))
    assert_bits_equal(got.numpy(), gguf_dequantize(blocks.reshape(1, -1), qtype).reshape(-1))


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda q: q.name)
def test_kernel_without_out_returns_fresh_result(qtype: T) -> None:
    """Called directly (no `out=`), a block kernel returns a new float32 [n, block_size] tensor."""
    from llmdoctor.gguf.dequant import _kernel

    blocks = _random_blocks(qtype, 5, seed=3)
    got = _kernel(qtype, torch.device("cpu"))[1](torch.from_numpy(blocks))
    assert got.shape == (5, GGML_QUANT_SIZES[qtype][0])
    assert_bits_equal(got.numpy(), gguf_dequantize(blocks, qtype))
