"""Block kernels for the float, legacy, K, ternary and FP4 types, bit-exact with gguf-py 0.19.

Each kernel maps uint8 blocks [n_blocks, type_size] to float32 [n_blocks, block_size] and writes into
`out` when given (the entry point passes a slice of the caller's buffer, so the result lands there
with no extra temporary). Byte layouts and the order of float operations follow
`gguf.quants.<TYPE>.dequantize_blocks` (kept bit-exact with ggml-quants.c by llama.cpp):

- every float16 scale is widened to float32 first, then all arithmetic is float32;
- a sub-block scale is one product (`d * sc`, `dmin * m`), rounded, then each value is one more
  product (`scale * q`) and, for types with a minimum, one add/subtract — two or three roundings,
  never fused (torch runs each op as its own kernel, so nothing becomes an FMA);
- integer work (nibble unpacking, offsets such as `q - 8`) is done on uint8 with wrap-around and
  reinterpreted as int8, which is exact, so `float(int8)` equals gguf-py's `astype(np.float32)`.

Multiplication is commutative in IEEE arithmetic, so `out *= d` equals gguf-py's `d * q`.
Kernels never write to `blocks` (it may be a read-only file mapping).
"""

from __future__ import annotations

import functools

import gguf.quants as gq
import torch
from gguf import GGMLQuantizationType as T

from .dequant import register


@functools.lru_cache(maxsize=None)
def _const(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant tensor, built once per device (no host-to-device copy per call)."""
    return torch.tensor(values, dtype=dtype, device=device)


def _out(blocks: torch.Tensor, block_size: int, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        out = torch.empty(blocks.shape[0], block_size, dtype=torch.float32, device=blocks.device)
    return out


def _view(field: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret the bytes of a [n, k] uint8 field as `dtype` (copying when unaligned)."""
    try:
        return field.view(dtype)
    except RuntimeError:  # stride or storage offset not a multiple of the item size
        return field.contiguous().view(dtype)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """float32 [n_blocks, 1]: the float16 at byte `start` of each block, widened (as gguf-py does first)."""
    return _view(blocks[:, start : start + 2], torch.float16).float()


def _nibbles(qs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Low nibbles into out[..., 0, :], high nibbles into out[..., 1, :]. qs: uint8 [..., k]; out: [..., 2, k]."""
    torch.bitwise_and(qs, 15, out=out.select(-2, 0))
    torch.bitwise_right_shift(qs, 4, out=out.select(-2, 1))
    return out


def _crumbs(qs: torch.Tensor, device: torch.device) -> torch.Tensor:
    """2-bit fields: uint8 [..., 4, k] with [..., s, i] = (qs[..., i] >> 2s) & 3. qs: uint8 [..., k]."""
    shifts = _const((0, 2, 4, 6), torch.uint8, device).view(4, 1)
    return torch.bitwise_right_shift(qs.unsqueeze(-2), shifts).bitwise_and_(3)


def _bits(qh: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Bit planes: uint8 [..., 8, k] with [..., b, i] = (qh[..., i] >> b) & 1. qh: uint8 [..., k]."""
    shifts = _const(tuple(range(8)), torch.uint8, device).view(8, 1)
    return torch.bitwise_right_shift(qh.unsqueeze(-2), shifts).bitwise_and_(1)


def _scale_out(out: torch.Tensor, q_u8: torch.Tensor, offset: int, scale: torch.Tensor) -> None:
    """out = scale * float(int8(q - offset)); q_u8 is a uint8 scratch (modified), scale broadcasts."""
    if offset:
        q_u8.sub_(offset)  # wraps mod 256: the int8 view is q - offset
    out.copy_(q_u8.view(torch.int8).view(out.shape))
    out.mul_(scale)


# ---------------------------------------------------------------- float types


@register(T.F32)
def f32(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    out = _out(blocks, 1, out)
    out.view(torch.uint8).copy_(blocks)  # [n, 4] bytes: a plain copy, any alignment
    return out


@register(T.F16)
def f16(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Widened as numpy does: signalling NaNs keep their payload and stay signalling (the hardware
    conversion torch uses sets the quiet bit; those elements are rebuilt from the bits)."""
    out = _out(blocks, 1, out)
    h = _view(blocks, torch.float16)  # [n, 1]
    out.copy_(h)
    nan = torch.isnan(out)
    if nan.any():
        bits = h.view(torch.int16).int()
        exact = ((bits & 0x8000) << 16) | 0x7F800000 | ((bits & 0x3FF) << 13)
        out.view(torch.int32)[nan] = exact[nan]
    return out


@register(T.BF16)
def bf16(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    out = _out(blocks, 1, out)
    bits = out.view(torch.int32)
    bits.copy_(_view(blocks, torch.int16))  # sign-extends, as gguf-py's int16 -> int32
    bits.bitwise_left_shift_(16)
    return out


# ---------------------------------------------------------------- legacy 32-element blocks


@register(T.Q8_0)
def q8_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: d f16 | qs int8[32]
    out = _out(blocks, 32, out)
    out.copy_(blocks[:, 2:].view(torch.int8))
    out.mul_(_f16(blocks, 0))
    return out


def _q4(blocks: torch.Tensor, qs_start: int) -> torch.Tensor:
    """uint8 [n, 2, 16]: element j < 16 is the low nibble of qs[j], j >= 16 the high nibble of qs[j-16]."""
    q = torch.empty(blocks.shape[0], 2, 16, dtype=torch.uint8, device=blocks.device)
    return _nibbles(blocks[:, qs_start : qs_start + 16], q)


def _q5(blocks: torch.Tensor, qh_start: int) -> torch.Tensor:
    """uint8 [n, 2, 16]: 5-bit values, bit 4 of element j being bit j of the little-endian uint32 qh."""
    q = _q4(blocks, qh_start + 4)
    high = _bits(blocks[:, qh_start : qh_start + 4], blocks.device)  # [n, 8, 4]: bit b of byte k
    q.view(-1, 4, 8).bitwise_or_(high.transpose(1, 2).bitwise_left_shift(4))  # element 8k + b
    return q


@register(T.Q4_0)
def q4_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: d f16 | qs[16]
    out = _out(blocks, 32, out)
    _scale_out(out, _q4(blocks, 2), 8, _f16(blocks, 0))
    return out


@register(T.Q4_1)
def q4_1(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: d f16 | m f16 | qs[16]
    out = _out(blocks, 32, out)
    _scale_out(out, _q4(blocks, 4), 0, _f16(blocks, 0))
    out.add_(_f16(blocks, 2))
    return out


@register(T.Q5_0)
def q5_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: d f16 | qh[4] | qs[16]
    out = _out(blocks, 32, out)
    _scale_out(out, _q5(blocks, 2), 16, _f16(blocks, 0))
    return out


@register(T.Q5_1)
def q5_1(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: d f16 | m f16 | qh[4] | qs[16]
    out = _out(blocks, 32, out)
    _scale_out(out, _q5(blocks, 4), 0, _f16(blocks, 0))
    out.add_(_f16(blocks, 2))
    return out


# ---------------------------------------------------------------- K-quants (256-element super-blocks)


def _k_scale_min(blocks: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit (scale, min) pairs of Q4_K/Q5_K, packed in 12 bytes at `start`: two uint8 [n, 8].

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for the
    mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    """
    s = blocks[:, start : start + 12].view(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]  # [n, 4] each
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _k_min_out(blocks: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: out = (d * sc) * q - (dmin * m) per 32-element sub-block. q: uint8 [n, 8, 32]."""
    sc, mn = _k_scale_min(blocks, 4)
    scale = (_f16(blocks, 0) * sc.float()).unsqueeze(-1)  # [n, 8, 1]
    minimum = (_f16(blocks, 2) * mn.float()).unsqueeze(-1)
    o = out.view(-1, 8, 32)
    o.copy_(q)
    o.mul_(scale)
    o.sub_(minimum)
    return out


@register(T.Q2_K)
def q2_k(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: scales[16] (low nibble scale, high nibble min) | qs[64] | d f16 | dmin f16
    out = _out(blocks, 256, out)
    scales = blocks[:, :16]
    scale = (_f16(blocks, 80) * (scales & 0x0F).float()).unsqueeze(-1)  # [n, 16, 1]
    minimum = (_f16(blocks, 82) * (scales >> 4).float()).unsqueeze(-1)
    q = _crumbs(blocks[:, 16:80].view(-1, 2, 32), blocks.device)  # [n, 2, 4, 32]: element 128h + 32s + i
    o = out.view(-1, 16, 16)
    o.copy_(q.view(-1, 16, 16))
    o.mul_(scale)
    o.sub_(minimum)
    return out


@register(T.Q3_K)
def q3_k(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: hmask[32] | qs[64] | scales[12] (16 x 6 bits) | d f16
    out = _out(blocks, 256, out)
    dev = blocks.device
    low = torch.empty(blocks.shape[0], 2, 8, dtype=torch.uint8, device=dev)
    _nibbles(blocks[:, 96:104], low)  # [n, 2, 8]: scale j's low 4 bits
    high = _crumbs(blocks[:, 104:108], dev)  # [n, 4, 4]: scale j's top 2 bits
    sc = low.view(-1, 16) | (high.view(-1, 16) << 4)
    sc = sc.sub_(32).view(torch.int8).float()
    scale = (_f16(blocks, 108) * sc).unsqueeze(-1)  # [n, 16, 1]
    q = _crumbs(blocks[:, 32:96].view(-1, 2, 32), dev).view(-1, 8, 32)  # element 32b + i, b = 4h + s
    # q - 4 where the hmask bit is clear: q | (bit << 2), minus 4
    q.bitwise_or_(_bits(blocks[:, :32], dev).bitwise_left_shift_(2))
    o = out.view(-1, 16, 16)
    _scale_out(o, q.view(-1, 16, 16), 4, scale)
    return out


@register(T.Q4_K)
def q4_k(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: d f16 | dmin f16 | scales[12] | qs[128]
    out = _out(blocks, 256, out)
    q = torch.empty(blocks.shape[0], 4, 2, 32, dtype=torch.uint8, device=blocks.device)
    _nibbles(blocks[:, 16:144].view(-1, 4, 32), q)  # element 64c + 32 * nibble + i
    return _k_min_out(blocks, q.view(-1, 8, 32), out)


@register(T.Q5_K)
def q5_k(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
    out = _out(blocks, 256, out)
    q = torch.empty(blocks.shape[0], 4, 2, 32, dtype=torch.uint8, device=blocks.device)
    _nibbles(blocks[:, 48:176].view(-1, 4, 32), q)
    q = q.view(-1, 8, 32)
    q.bitwise_or_(_bits(blocks[:, 16:48], blocks.device).bitwise_left_shift_(4))  # bit b of qh[i] -> 32b + i
    return _k_min_out(blocks, q, out)


@register(T.Q6_K)
def q6_k(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: ql[128] | qh[64] | scales int8[16] | d f16
    out = _out(blocks, 256, out)
    scale = (_f16(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()).unsqueeze(-1)  # [n, 16, 1]
    q = torch.empty(blocks.shape[0], 2, 2, 64, dtype=torch.uint8, device=blocks.device)
    _nibbles(blocks[:, :128].view(-1, 2, 64), q)  # element 128h + 64 * nibble + i
    high = _crumbs(blocks[:, 128:192].view(-1, 2, 32), blocks.device)  # element 128h + 32s + i
    q.view(-1, 256).bitwise_or_(high.view(-1, 256).bitwise_left_shift_(4))
    _scale_out(out.view(-1, 16, 16), q.view(-1, 16, 16), 32, scale)
    return out


# ---------------------------------------------------------------- ternary


@register(T.TQ1_0)
def tq1_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Base-3 digits: byte x times 3^k (wrapping mod 256), then digit = (x * 3) >> 8, value digit - 1."""
    # block: qs[48] (32 + 16 bytes of 5 digits) | qh[4] (4 digits) | d f16
    out = _out(blocks, 256, out)
    dev = blocks.device
    pow3 = _const((1, 3, 9, 27, 81), torch.uint8, dev).view(5, 1)
    x = torch.empty(blocks.shape[0], 256, dtype=torch.uint8, device=dev)
    torch.mul(blocks[:, None, 0:32], pow3, out=x[:, :160].view(-1, 5, 32))
    torch.mul(blocks[:, None, 32:48], pow3, out=x[:, 160:240].view(-1, 5, 16))
    torch.mul(blocks[:, None, 48:52], pow3[:4], out=x[:, 240:].view(-1, 4, 4))
    digit = x.to(torch.int16).mul_(3).bitwise_right_shift_(8).to(torch.uint8)
    _scale_out(out, digit, 1, _f16(blocks, 52))
    return out


@register(T.TQ2_0)
def tq2_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: qs[64] (2-bit digits) | d f16
    out = _out(blocks, 256, out)
    q = _crumbs(blocks[:, :64].view(-1, 2, 32), blocks.device)  # element 128h + 32s + i
    _scale_out(out, q, 1, _f16(blocks, 64))
    return out


# ---------------------------------------------------------------- FP4


def _fp4_out(codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = scale * kvalues[code], kvalues being gguf-py's doubled E2M1 table. codes: uint8, out's shape."""
    kvalues = _const(tuple(float(v) for v in gq.MXFP4.kvalues), torch.float32, codes.device)
    torch.index_select(kvalues, 0, codes.reshape(-1).int(), out=out.view(-1))
    out.mul_(scale)
    return out


@register(T.MXFP4)
def mxfp4(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Scale: E8M0 exponent e decoded as 2^(e-128) (half the OCP value, matching the doubled table),
    built from the bits as ggml_e8m0_to_fp32_half does (subnormal for e < 2)."""
    # block: e u8 | qs[16]
    out = _out(blocks, 32, out)
    e = blocks[:, :1].int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    codes = _q4(blocks, 1)
    return _fp4_out(codes.view(-1, 32), bits.view(torch.float32), out)


@register(T.NVFP4)
def nvfp4(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Four 16-element sub-blocks with an unsigned E4M3 scale each (bias 7, times 0.5 for the doubled
    table; 0x00 and 0x7F decode to 0). Every decoded scale is exact in float32, so building it from
    bits gives gguf-py's value."""
    # block: d ue4m3[4] | qs[4][8]
    out = _out(blocks, 64, out)
    x = blocks[:, :4]
    exp = (x >> 3).bitwise_and_(0x0F).int()
    man = (x & 7).float()
    pow2 = ((exp + (127 - 7)) << 23).view(torch.float32)  # 2^(exp-7) for exp >= 1
    d = torch.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * pow2)
    d = torch.where((x == 0) | (x == 0x7F), 0.0, d * 0.5).unsqueeze(-1)  # [n, 4, 1]
    codes = torch.empty(blocks.shape[0], 4, 2, 8, dtype=torch.uint8, device=blocks.device)
    _nibbles(blocks[:, 4:36].view(-1, 4, 8), codes)  # sub-block s: low nibbles, then high nibbles
    return _fp4_out(codes.view(-1, 4, 16), d, out.view(-1, 4, 16)).view(-1, 64)
