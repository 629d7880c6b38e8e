"""Block kernels for the IQ (importance-matrix) types, bit-exact with gguf-py 0.19 (registered in dequant.py).

Each kernel maps uint8 [n_blocks, type_size] -> float32 [n_blocks, block_size] with device-agnostic torch
ops. Byte layouts and the float operation order follow `gguf.quants.<TYPE>.dequantize_blocks` (which
llama.cpp keeps bit-exact with `dequantize_row_<type>` in ggml-quants.c); every scale is decoded from
float16 to float32 and all arithmetic is float32, as there.

The grids, sign table, IQ4 codebook and IQ1 delta are gguf-py's own (`gguf.quants.IQ2_XXS.ksigns`,
`<TYPE>.init_grid()`/`.grid`, `IQ4_NL.kvalues`, `IQ1_S.delta`), converted once per device. Signs are
applied to the grid rows before the scale (in product tables, or by multiplying gathered rows): that is
exact, because a sign is +-1 and round-to-nearest is symmetric, so db * (g * s) == (db * g) * s bit for
bit, the order gguf-py uses. This holds for every input, non-finite scales included; on x86 CPUs even
the NaN bit patterns match, but GPU arithmetic need not keep NaN payloads, so tests compare any NaN
as equal to any NaN.

Speed (CPU, measured in bench/bench_dequant_iq.py): a kernel is a few small integer ops on the index
fields, one table gather into a reused scratch buffer and one multiply into `out`. index_select costs
about the same per gathered row whatever its width, so tables hold rows of 8 values, or 16-byte
units of 4 values (complex128 used purely as a bit container) that a 1-D index_select copies
element-wise, about 3x faster than rows of 4.
"""

from __future__ import annotations

import functools

import gguf.quants as gq
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from .dequant import register, scratch

# ---------------------------------------------------------------- gguf-py tables, once per device


def _np_grid(qtype: T) -> np.ndarray:
    """gguf-py's decoded grid of `qtype`: float32 [rows, cols]."""
    cls = getattr(gq, qtype.name)
    cls.init_grid()
    return cls.grid.reshape(cls.grid_shape)


def _np_bit_signs() -> np.ndarray:
    """float32 [256, 8]: row b, column j is -1 where bit j of byte b is set, else +1 (gguf-py's unpacking)."""
    bits = (np.arange(256, dtype=np.uint8)[:, None] >> np.arange(8, dtype=np.uint8)) & 1
    return np.where(bits == 0, np.float32(1), np.float32(-1))


def _np_ksigns() -> np.ndarray:
    """float32 [128, 8]: the 7-bit sign index expanded through gguf-py's `IQ2_XXS.ksigns` table."""
    return _np_bit_signs()[np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8)]


def _np_signed_grid_iq2_xxs() -> np.ndarray:
    """float32 [256 * 128, 8]: row g * 128 + s = grid[g] * ksigns[s]."""
    return (_np_grid(T.IQ2_XXS)[:, None, :] * _np_ksigns()[None, :, :]).reshape(-1, 8)


def _np_signed_grid_iq2_xs() -> np.ndarray:
    """float32 [65536, 8]: row q = grid[q & 511] * ksigns[q >> 9], q being IQ2_XS's raw uint16."""
    return (_np_ksigns()[:, None, :] * _np_grid(T.IQ2_XS)[None, :, :]).reshape(-1, 8)


def _np_signed_grid_iq3_xxs() -> np.ndarray:
    """float32 [256 * 128 * 2, 4]: row g << 8 | s << 1 | h = grid[g] * ksigns[s][4h : 4h + 4]
    (a 7-bit sign index covers two grid rows of 4: h picks the half)."""
    return (_np_grid(T.IQ3_XXS)[:, None, None, :] * _np_ksigns().reshape(1, 128, 2, 4)).reshape(-1, 4)


def _np_signed_grid_iq3_s() -> np.ndarray:
    """float32 [512 * 16, 4]: row g * 16 + k = grid[g] * signs of the 4 bits of nibble k."""
    return (_np_grid(T.IQ3_S)[:, None, :] * _np_bit_signs()[None, :16, :4]).reshape(-1, 4)


def _np_iq1_grid() -> np.ndarray:
    """float32 [4096, 8]: rows 0..2047 = grid + delta, rows 2048.. = grid - delta (IQ1_S and IQ1_M share both)."""
    grid, delta = _np_grid(T.IQ1_S), gq.IQ1_S.delta
    return np.concatenate([grid + delta, grid + -delta])


def _np_byte_fields(width: int, shift: int = 0) -> np.ndarray:
    """int32 [256, 8 // width]: the `width`-bit fields of byte b, lowest first, each shifted left by `shift`."""
    b = np.arange(256, dtype=np.int32)[:, None]
    return ((b >> (width * np.arange(8 // width, dtype=np.int32))) & ((1 << width) - 1)) << shift


def _np_iq4_quads() -> np.ndarray:
    """float32 [65536, 4]: key k -> the codebook values of k's four nibbles, lowest first (`IQ4_NL.kvalues`, int8)."""
    kvalues = np.array(gq.IQ4_NL.kvalues, dtype=np.int8).astype(np.float32)
    k = np.arange(1 << 16)
    return np.stack([kvalues[(k >> shift) & 15] for shift in (0, 4, 8, 12)], axis=-1)


def _packed4(rows: np.ndarray) -> np.ndarray:
    """float32 [R, 4] -> complex128 [R], each row one 16-byte unit: a 1-D index_select copies units
    (about 3x faster on CPU than gathering rows of 4). The bits are only copied, never computed with."""
    return np.ascontiguousarray(rows, dtype=np.float32).view(np.complex128).reshape(-1)


_TABLES = {
    "bit_signs": _np_bit_signs,
    "iq2_xxs": _np_signed_grid_iq2_xxs,
    "iq2_xs": _np_signed_grid_iq2_xs,
    "iq2_s": lambda: _np_grid(T.IQ2_S),
    "iq3_xxs": lambda: _packed4(_np_signed_grid_iq3_xxs()),
    "iq3_s": lambda: _packed4(_np_signed_grid_iq3_s()),
    "iq1": _np_iq1_grid,
    "iq4": lambda: _packed4(_np_iq4_quads()),
    # int32 pairs (low, high nibble) packed in one int64, so that a 1-D gather yields them interleaved
    "nibbles": lambda: _np_byte_fields(4).view(np.int64).reshape(256),
    "bits_12": lambda: _np_byte_fields(1, 12),  # IQ3_S: the 8 high index bits of a byte, at bit 12
    "crumbs_8": lambda: _np_byte_fields(2, 8),  # IQ2_S: the 4 two-bit high index parts of a byte, at bit 8
}


@functools.lru_cache(maxsize=None)
def _table(name: str, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(_TABLES[name]())).to(device)


# ---------------------------------------------------------------- field helpers


def _rows(table: torch.Tensor, idx: torch.Tensor, slot: str) -> torch.Tensor:
    """table [R, *C], idx int [...] -> table rows [..., *C], gathered into the per-thread scratch `slot`.
    (A 1-D table gathers element-wise: much faster than rows of one.)"""
    rows = scratch(slot, (idx.numel(), *table.shape[1:]), table.dtype, table.device)
    torch.index_select(table, 0, idx.reshape(-1), out=rows)
    return rows.view(*idx.shape, *table.shape[1:])


def _scaled(v: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """v float32 [n, S, R], scale float32 [n, S] -> out [n, S * R] = v * scale, one scale per R values
    (IEEE products commute: equal to gguf-py's scale * v). `out` is written when given, else fresh."""
    n, s, r = v.shape
    if out is None:
        out = torch.empty(n, s * r, dtype=torch.float32, device=v.device)
    torch.mul(v, scale[..., None], out=out.view(n, s, r))
    return out


def _field(blocks: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes [start, stop) of each block reinterpreted (little-endian) as `dtype`: [n, (stop - start) / size].
    A fresh contiguous copy, so the reinterpretation never depends on the alignment of `blocks`."""
    return blocks[:, start:stop].clone(memory_format=torch.contiguous_format).view(dtype)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of each block, as float32 [n, 1]."""
    return _field(blocks, start, start + 2, torch.float16).float()


def _u16(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Little-endian uint16 fields in bytes [start, stop) -> int32 [n, (stop - start) // 2]."""
    return _field(blocks, start, stop, torch.int16).int() & 0xFFFF


def _u32(blocks: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Little-endian uint32 fields in bytes [start, stop) -> int32 [n, (stop - start) // 4] (same bits;
    callers shift and mask, so the sign of the int32 never matters)."""
    return _field(blocks, start, stop, torch.int32)


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., k] -> int32 [..., 2k]: low then high nibble of each byte, interleaved per byte (one
    element-wise gather: torch's broadcast shifts over a short inner dimension are several times slower)."""
    pairs = _table("nibbles", b.device).index_select(0, b.int().reshape(-1))  # int64 [numel]
    return pairs.view(torch.int32).view(*b.shape[:-1], 2 * b.shape[-1])


def _byte_fields(b: torch.Tensor, name: str) -> torch.Tensor:
    """uint8 [..., k] -> int32 [..., k, F]: row b of the byte-field table `name` for each byte."""
    table = _table(name, b.device)
    return table.index_select(0, b.int().reshape(-1)).view(*b.shape, table.shape[1])


@functools.lru_cache(maxsize=None)
def _shifts(device: torch.device, *s: int) -> torch.Tensor:
    """int32 [len(s)] on `device` (cached: no host-to-device copy per call)."""
    return torch.tensor(s, dtype=torch.int32, device=device)


# ---------------------------------------------------------------- kernels
# Each gathers (signed) grid rows into a reused scratch buffer, then writes rows * scale into `out`
# (a slice of the caller's buffer when the entry point passes one).


@register(T.IQ2_XXS)
def iq2_xxs(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """66 bytes: d f16, 8 x (4 grid-index bytes, uint32 of 4 x 7-bit sign indices + 4-bit scale)."""
    n = blocks.shape[0]
    d = _f16(blocks, 0)  # [n, 1]
    aux = _u32(blocks, 2, 66).view(n, 8, 2)[..., 1]  # [n, 8]
    db = d * (0.5 + ((aux >> 28) & 15).float()) * 0.25  # [n, 8]
    grid_idx = blocks[:, 2:66].view(n, 8, 8)[..., :4].int()  # [n, 8, 4]
    sign_idx = (aux[..., None] >> _shifts(blocks.device, 0, 7, 14, 21)) & 127  # [n, 8, 4]
    v = _rows(_table("iq2_xxs", blocks.device), grid_idx * 128 + sign_idx, "iq_rows")  # [n, 8, 4, 8]
    return _scaled(v.view(n, 8, 32), db, out)


@register(T.IQ2_XS)
def iq2_xs(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """74 bytes: d f16, 32 x uint16 (9-bit grid index | 7-bit sign index << 9), 16 x 4-bit scales."""
    n = blocks.shape[0]
    d = _f16(blocks, 0)  # [n, 1]
    db = d * (0.5 + _nibbles(blocks[:, 66:74]).float()) * 0.25  # [n, 16]
    v = _rows(_table("iq2_xs", blocks.device), _u16(blocks, 2, 66), "iq_rows")  # [n, 32, 8]
    return _scaled(v.view(n, 16, 16), db, out)


@register(T.IQ2_S)
def iq2_s(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """82 bytes: d f16, 32 grid-index low bytes, 32 sign bytes, 8 bytes of 2-bit index highs, 16 x 4-bit scales."""
    n, dev = blocks.shape[0], blocks.device
    d = _f16(blocks, 0)  # [n, 1]
    db = d * (0.5 + _nibbles(blocks[:, 74:82]).float()) * 0.25  # [n, 16]
    high = _byte_fields(blocks[:, 66:74], "crumbs_8")  # [n, 8, 4]: index bits 8-9, in place
    grid_idx = blocks[:, 2:34].int() | high.view(n, 32)  # [n, 32]
    v = _rows(_table("iq2_s", dev), grid_idx, "iq_rows")  # [n, 32, 8]
    v.mul_(_rows(_table("bit_signs", dev), blocks[:, 34:66].int(), "iq_signs"))
    return _scaled(v.view(n, 16, 16), db, out)


@register(T.IQ3_XXS)
def iq3_xxs(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """98 bytes: d f16, 64 grid-index bytes (4 values each), 8 x uint32 (4 x 7-bit sign indices + 4-bit scale)."""
    n, dev = blocks.shape[0], blocks.device
    d = _f16(blocks, 0)  # [n, 1]
    aux = _u32(blocks, 66, 98)  # [n, 8]
    db = d * (0.5 + ((aux >> 28) & 15).float()) * 0.5  # [n, 8]
    sign_idx = (aux[..., None] >> _shifts(dev, 0, 7, 14, 21)) & 127  # [n, 8, 4]
    grid_idx = blocks[:, 2:66].view(n, 8, 4, 2).int()  # [n, 8, 4, 2]: each sign index covers 2 grid rows
    idx = (grid_idx << 8) | ((sign_idx << 1)[..., None] | _shifts(dev, 0, 1))
    units = _rows(_table("iq3_xxs", dev), idx, "iq_rows")  # complex128 [n, 8, 4, 2]: 4 values each
    return _scaled(units.view(torch.float32).view(n, 8, 32), db, out)


@register(T.IQ3_S)
def iq3_s(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """110 bytes: d f16, 64 grid-index low bytes, 8 bytes of 1-bit index highs, 32 sign bytes, 8 x 4-bit scales."""
    n, dev = blocks.shape[0], blocks.device
    d = _f16(blocks, 0)  # [n, 1]
    db = d * (1 + 2 * _nibbles(blocks[:, 106:110])).float()  # [n, 8]
    high = _byte_fields(blocks[:, 66:74], "bits_12").view(n, 64)  # [n, 64]: index bit 8, at bit 12
    idx = (blocks[:, 2:66].int() << 4) | high | _nibbles(blocks[:, 74:106])  # grid index * 16 + sign nibble
    units = _rows(_table("iq3_s", dev), idx, "iq_rows")  # complex128 [n, 64]: 4 values each
    return _scaled(units.view(torch.float32).view(n, 8, 32), db, out)


def _iq1_values(
    dl: torch.Tensor, grid_idx: torch.Tensor, negative_delta: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor:
    """dl [n, S] float32, grid_idx / negative_delta int [n, S, k] -> dl * (grid + -+delta): [n, S * k * 8]."""
    v = _rows(_table("iq1", dl.device), grid_idx | (negative_delta << 11), "iq_rows")  # [n, S, k, 8]
    n, s = dl.shape
    return _scaled(v.view(n, s, -1), dl, out)


@register(T.IQ1_S)
def iq1_s(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """50 bytes: d f16, 32 grid-index low bytes, 8 x uint16 (4 x 3-bit index highs, 3-bit scale, delta sign)."""
    n, dev = blocks.shape[0], blocks.device
    d = _f16(blocks, 0)  # [n, 1]
    qh = _u16(blocks, 34, 50)  # [n, 8]
    dl = d * (2 * ((qh >> 12) & 7) + 1).float()  # [n, 8]
    high = (qh[..., None] >> _shifts(dev, 0, 3, 6, 9)) & 7  # [n, 8, 4]
    grid_idx = blocks[:, 2:34].view(n, 8, 4).int() | (high << 8)  # [n, 8, 4]
    return _iq1_values(dl, grid_idx, (qh[..., None] >> 15) & 1, out)


@register(T.IQ1_M)
def iq1_m(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """56 bytes: 32 grid-index low bytes, 32 nibbles (3-bit index high, delta sign), 4 x uint16 holding
    16 x 3-bit scales and, in their top nibbles, the float16 d."""
    n, dev = blocks.shape[0], blocks.device
    sc = _u16(blocks, 48, 56)  # [n, 4]
    d_bits = ((sc & 0xF000) >> _shifts(dev, 12, 8, 4, 0)).sum(-1, keepdim=True)  # [n, 1], disjoint bits
    d = ((d_bits ^ 0x8000) - 0x8000).to(torch.int16).view(torch.float16).float()  # [n, 1]
    scales = ((sc[..., None] >> _shifts(dev, 0, 3, 6, 9)) & 7).view(n, 16)  # [n, 16]
    dl = d * (2 * scales + 1).float()  # [n, 16]
    nib = _nibbles(blocks[:, 32:48]).view(n, 16, 2)  # [n, 16, 2]
    grid_idx = blocks[:, 0:32].view(n, 16, 2).int() | ((nib & 7) << 8)  # [n, 16, 2]
    return _iq1_values(dl, grid_idx, nib >> 3, out)


def _iq4_values(dl: torch.Tensor, qs: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """dl float32 [n, S], qs uint8 [n, S, 16] -> dl * kvalues: [n, S * 32], per S: 16 low nibbles, 16 high.
    Outputs 4j..4j+3 of each half come from bytes 4j..4j+3: the key is their four low (or high) nibbles,
    packed from the bytes read as one little-endian uint32 (whole-word ops, no strided ones)."""
    n, s = dl.shape
    word = _field(qs.reshape(n, s * 16), 0, s * 16, torch.int32).view(n, s, 1, 4)
    x = torch.cat((word, word >> 4), dim=2) & 0x0F0F0F0F  # [n, S, 2, 4]: nibbles at bits 0, 8, 16, 24
    x = (x | (x >> 4)) & 0x00FF00FF
    keys = (x | (x >> 8)) & 0xFFFF  # the four nibbles at bits 0, 4, 8, 12
    units = _rows(_table("iq4", dl.device), keys, "iq_rows")  # complex128 [n, S, 2, 4]: 4 values each
    return _scaled(units.view(torch.float32).view(n, s, 32), dl, out)


@register(T.IQ4_NL)
def iq4_nl(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """18 bytes: d f16, 16 bytes: low nibbles are values 0..15, high nibbles 16..31 (codebook indices)."""
    return _iq4_values(_f16(blocks, 0), blocks[:, None, 2:18], out)


@register(T.IQ4_XS)
def iq4_xs(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """136 bytes: d f16, uint16 of 8 x 2-bit scale highs, 8 x 4-bit scale lows, 8 x 16 bytes of nibbles
    (per 32 values: low nibbles first, then high), scale = 6 bits - 32."""
    n, dev = blocks.shape[0], blocks.device
    d = _f16(blocks, 0)  # [n, 1]
    high = (_u16(blocks, 2, 4) >> _shifts(dev, 0, 2, 4, 6, 8, 10, 12, 14)) & 3  # [n, 8]
    dl = d * ((_nibbles(blocks[:, 4:8]) | (high << 4)) - 32).float()  # [n, 8]
    return _iq4_values(dl, blocks[:, 8:136].view(n, 8, 16), out)
