"""Block kernels for the float, legacy, K, ternary and FP4 types, bit-exact with gguf-py 0.19.

Each kernel maps uint8 blocks [n_blocks, type_size] to float32 [n_blocks, block_size] and writes into
`out` when given (the entry point passes a slice of the caller's buffer, so the result lands there
with no extra temporary). Byte layouts and the order of float operations follow
`gguf.quants.<TYPE>.dequantize_blocks` (kept bit-exact with ggml-quants.c by llama.cpp):

- every float16 scale is widened to float32 first, then all arithmetic is float32;
- a sub-block scale is one product (`d * sc`, `dmin * m`), rounded, then each value is one more
  product (`scale * q`) and, for types with a minimum, one add/subtract: two or three roundings in
  gguf-py's order. Each is its own torch op; where torch evaluates `a + alpha * b` as one fused
  operation, alpha is -1 or a power of two and b an integer, so the fused result is the same;
- integer work (nibble unpacking, offsets such as `q - 8`) is done on uint8 with wrap-around and
  reinterpreted as int8, or added in float where every value is a small integer: exact either way,
  so the quant equals gguf-py's `astype(np.float32)` of it.

IEEE multiplication is commutative, so `out *= d` equals gguf-py's `d * q`. The result is bit-exact
for every input whose scales are finite; with a NaN scale both sides give NaN, but for Q4_1/Q5_1
(`d * q + m` with d and m both NaN) which NaN payload survives may differ.

Speed (CPU): torch's loops are fast on contiguous or 2-D [rows, contiguous inner] operands and slow
on broadcasts or strides that do not flatten to two dimensions, and every row of a 2-D op costs a few
ns. So every op here is kept 1-D or 2-D, fields of the small legacy blocks are split on the whole
chunk at once, and temporaries come from `scratch` (reused per thread). Kernels never write to
`blocks` (it may be a read-only file mapping).
"""

from __future__ import annotations

import functools

import gguf.quants as gq
import torch
from gguf import GGMLQuantizationType as T

from .dequant import register, scratch as _scratch


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
    if torch.isnan(out.sum()):  # any NaN (a fast test: torch's isnan is ~15x slower than sum)
        # clear the quiet bit (bit 22) where the input's (bit 9) was clear
        quiet = h.view(torch.int16) & 0x0200
        signalling = torch.isnan(out).logical_and_(quiet == 0).int().bitwise_left_shift_(22)
        out.view(torch.int32).bitwise_and_(signalling.bitwise_not_())
    return out


@register(T.BF16)
def bf16(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    out = _out(blocks, 1, out)
    bits = out.view(torch.int32)
    bits.copy_(_view(blocks, torch.int16))  # sign-extends, as gguf-py's int16 -> int32
    bits.bitwise_left_shift_(16)
    return out


# ---------------------------------------------------------------- shared steps


def _scaled(out: torch.Tensor, q: torch.Tensor, offset: int, scale: torch.Tensor, run: int) -> torch.Tensor:
    """out = scale * float(int8(q - offset)), one scale per `run` consecutive values.

    q: uint8 scratch in out's element order (modified); scale: float32 [out.numel() / run, 1].
    """
    if offset:
        q.sub_(offset)  # wraps mod 256: the int8 view is q - offset
    out.copy_(q.view(torch.int8).view(out.shape))
    out.view(-1, run).mul_(scale)
    return out


# ---------------------------------------------------------------- legacy 32-element blocks
# Many small blocks: every op on a field (16 bytes of every 18-24) pays a per-row cost for every block,
# so the nibbles are split on the whole chunk at once and each field is gathered once, as bytes.


def _nibble_planes(blocks: torch.Tensor) -> torch.Tensor:
    """uint8 [2, n, type_size]: the low and the high nibble of every byte of the chunk."""
    flat = blocks.reshape(-1)
    planes = _scratch("planes", (2, *blocks.shape), torch.uint8, blocks.device)
    torch.bitwise_and(flat, 15, out=planes[0].view(-1))
    torch.bitwise_right_shift(flat, 4, out=planes[1].view(-1))
    return planes


def _legacy_q(blocks: torch.Tensor, qs_start: int) -> torch.Tensor:
    """uint8 [n, 32]: j < 16 the low nibble of qs[j], j >= 16 the high nibble of qs[j - 16]."""
    planes = _nibble_planes(blocks)
    q = _scratch("q", (blocks.shape[0], 32), torch.uint8, blocks.device)
    q[:, :16].copy_(planes[0, :, qs_start : qs_start + 16])
    q[:, 16:].copy_(planes[1, :, qs_start : qs_start + 16])
    return q


@functools.lru_cache(maxsize=None)
def _bit_bytes_table(set_: int, clear: int, device: torch.device) -> torch.Tensor:
    """complex128 [65536] (16 bytes an entry, only as a carrier of bits): entry v + 32768 for the
    int16 v holds 16 bytes, byte k = `set_` if bit k of v's 16 bits is set else `clear`."""
    u = (torch.arange(65536) - 32768) & 0xFFFF
    bits = (u.unsqueeze(1) >> torch.arange(16)) & 1  # [65536, 16]
    table = torch.where(bits == 1, set_, clear).to(torch.uint8)
    return table.view(torch.complex128).view(65536).to(device)


def _q5_high_bits(q: torch.Tensor, blocks: torch.Tensor, qh_start: int, offset: int) -> torch.Tensor:
    """q[:, j] += 16 * (bit j of the little-endian uint32 qh at byte `qh_start`) - offset, mod 256.

    q: uint8 [n, 32]. Each 16-bit half of qh covers 16 consecutive values, so a 65536-entry table
    spreads it into those 16 bytes of q, with `offset` (0 or 16) folded in: one gather, one add
    (measured faster than a 256-entry table on bytes: the [n, 4] byte-to-index copy costs more).
    """
    n = q.shape[0]
    halves = _view(blocks[:, qh_start : qh_start + 4], torch.int16)  # [n, 2]
    idx = _scratch("idx", (n, 2), torch.int32, q.device)
    for h in range(2):  # 1-D copies: several times faster than one [n, 2] copy
        idx[:, h].copy_(halves[:, h])
    idx.add_(32768)
    table = _bit_bytes_table(16 - offset, (-offset) % 256, q.device)
    high = _scratch("high", (n * 2,), torch.complex128, q.device)
    torch.index_select(table, 0, idx.view(-1), out=high)
    return q.add_(high.view(torch.uint8).view(n, 32))


@register(T.Q8_0)
def q8_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: d f16 | qs int8[32]
    # The whole chunk (scale bytes too) is widened in one flat pass, then one 2-D op scales the quant
    # columns into `out`: two per-block row loops (copy, then multiply) would cost more than the
    # extra 2 of every 34 values widened.
    out = _out(blocks, 32, out)
    wide = _scratch("wide", tuple(blocks.shape), torch.float32, blocks.device)  # [n, 34]
    wide.view(-1).copy_(blocks.reshape(-1).view(torch.int8))
    return torch.mul(wide[:, 2:], _f16(blocks, 0), out=out)


@register(T.Q4_0)
def q4_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: d f16 | qs[16]; value d * (q - 8)
    out = _out(blocks, 32, out)
    return _scaled(out, _legacy_q(blocks, 2), 8, _f16(blocks, 0), 32)


@register(T.Q4_1)
def q4_1(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: d f16 | m f16 | qs[16]; value d * q + m
    out = _out(blocks, 32, out)
    _scaled(out, _legacy_q(blocks, 4), 0, _f16(blocks, 0), 32)
    return out.add_(_f16(blocks, 2))


@register(T.Q5_0)
def q5_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: d f16 | qh[4] | qs[16]; value d * (q - 16), q = nibble + 16 * bit
    out = _out(blocks, 32, out)
    q = _q5_high_bits(_legacy_q(blocks, 6), blocks, 2, 16)  # q - 16, as int8
    return _scaled(out, q, 0, _f16(blocks, 0), 32)


@register(T.Q5_1)
def q5_1(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: d f16 | m f16 | qh[4] | qs[16]; value d * q + m
    out = _out(blocks, 32, out)
    q = _q5_high_bits(_legacy_q(blocks, 8), blocks, 4, 0)
    _scaled(out, q, 0, _f16(blocks, 0), 32)
    return out.add_(_f16(blocks, 2))


# ---------------------------------------------------------------- K-quants (256-element super-blocks)
# Every op is kept 2-D ([rows, contiguous inner]): torch's CPU loops are fast there, but slow on
# broadcasts or strides they cannot flatten to two dimensions.


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K sub-block (scale, min) as float32 [n * 8, 1] each: d * sc and dmin * m, one
    rounding each, from d, dmin (float16 at bytes 0, 2) and the 6-bit pairs packed in bytes 4-15.

    Bytes 4-7 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 8-11 the same for
    the mins; bytes 12-15 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    Unpacked four bytes at a time as little-endian int32 words with per-byte masks (bits shifted in
    from a neighbour byte, or from the sign, always land on masked-out positions), scales and mins
    together: the op count, not the data, is the cost here.
    """
    n, dev = blocks.shape[0], blocks.device
    words = _view(blocks[:, 4:16], torch.int32)  # [n, 3]
    low, packed = words[:, :2], words[:, 2:]  # [n, 2] (scales, mins), [n, 1]
    six = torch.empty(n, 2, 2, dtype=torch.int32, device=dev)  # [n, scale/min, values 0-3/4-7]
    torch.bitwise_and(low, 0x3F3F3F3F, out=six[:, :, 0])
    high = torch.bitwise_right_shift(packed, _const((0, 4), torch.int32, dev)).bitwise_and_(0x0F0F0F0F)
    torch.bitwise_or(high, (low >> 2).bitwise_and_(0x30303030), out=six[:, :, 1])
    d = torch.empty(2, n, 1, dtype=torch.float32, device=dev)  # d, dmin
    d.view(2, n).copy_(_view(blocks[:, :4], torch.float16).t())  # n-long rows (faster than [n, 2] in an ad hoc timing)
    prod = torch.empty(2, n, 8, dtype=torch.float32, device=dev)
    torch.mul(d, six.view(torch.uint8).view(n, 2, 8).transpose(0, 1), out=prod)
    return prod[0].view(-1, 1), prod[1].view(-1, 1)


def _sub_block_scale(d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """float32 [n * k, 1]: d [n, 1] times the integer sub-block scales sc [n, k], one rounding each."""
    return (d * sc.float()).view(-1, 1)


def _words(field: torch.Tensor) -> torch.Tensor:
    """int32 [n, k / 4]: a contiguous copy of the uint8 field [n, k] (k a multiple of 4), as words.

    Bit fields are then unpacked four bytes per element with per-byte masks; bits shifted in from
    the neighbouring byte (or from the sign) always land on masked-out positions. Ops go to contiguous
    temporaries and are then copied into place: torch's copy handles strided destinations well, its
    bitwise ops do not.
    """
    words = _scratch("words", tuple(field.shape), torch.uint8, field.device)
    words.copy_(field)
    return words.view(torch.int32)


def _spread_fields(field: torch.Tensor, q: torch.Tensor, bits: int, shift: int, width: int) -> torch.Tensor:
    """Unpack `bits`-wide fields of the uint8 field [n, k] into q [n, k * 8 / bits]: for each run of
    `width` bytes, the field at bit 0 of each byte, then at bit `bits`, ...; each shifted left by `shift`.
    q may be float (the final copy widens the bytes)."""
    words = _words(field)
    tmp = _scratch("field", tuple(words.shape), torch.int32, field.device)
    mask = ((1 << bits) - 1) * 0x01010101 << shift
    runs = q.view(-1, 8 // bits, width)  # [n * k / width, 8 / bits, width]
    for j in range(8 // bits):
        move = bits * j - shift  # field j to bit `shift`: within its byte either way
        if move >= 0:
            torch.bitwise_right_shift(words, move, out=tmp)
        else:
            torch.bitwise_left_shift(words, -move, out=tmp)
        runs[:, j].copy_(tmp.bitwise_and_(mask).view(torch.uint8).view(-1, width))
    return q


def _spread_nibbles(qs: torch.Tensor, q: torch.Tensor, width: int) -> torch.Tensor:
    """For each run of `width` bytes of qs [n, k], its low nibbles then its high nibbles, into q [n, 2k]."""
    return _spread_fields(qs, q, 4, 0, width)


@register(T.Q2_K)
def q2_k(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: scales[16] (low nibble scale, high nibble min) | qs[64] | d f16 | dmin f16
    out = _out(blocks, 256, out)
    scales = blocks[:, :16]
    scale = _sub_block_scale(_f16(blocks, 80), scales & 0x0F)  # [n * 16, 1]
    minimum = _sub_block_scale(_f16(blocks, 82), scales >> 4)
    q = _scratch("q", (blocks.shape[0], 256), torch.uint8, blocks.device)
    _spread_fields(blocks[:, 16:80], q, 2, 0, 32)  # element 128h + 32s + i: (qs[32h + i] >> 2s) & 3
    _scaled(out, q, 0, scale, 16)
    out.view(-1, 16).sub_(minimum)
    return out


@register(T.Q3_K)
def q3_k(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: hmask[32] | qs[64] | scales[12] (16 x 6 bits) | d f16
    out = _out(blocks, 256, out)
    n, dev = blocks.shape[0], blocks.device
    sc = torch.empty(n, 16, dtype=torch.uint8, device=dev)
    _spread_nibbles(blocks[:, 96:104], sc, 8)  # scale j's low 4 bits: low nibbles of bytes 0-7, then high
    high = torch.empty(n, 16, dtype=torch.uint8, device=dev)
    _spread_fields(blocks[:, 104:108], high, 2, 4, 4)  # its top 2 bits: byte 8 + j % 4, bits 2 * (j // 4)
    sc.bitwise_or_(high).sub_(32)
    scale = _sub_block_scale(_f16(blocks, 108), sc.view(torch.int8))  # [n * 16, 1]
    q = _scratch("q", (n, 256), torch.uint8, dev)
    _spread_fields(blocks[:, 32:96], q, 2, 0, 32)  # element 32b + i, b = 4h + s
    hbit = _scratch("hbit", (n, 256), torch.uint8, dev)
    _spread_fields(blocks[:, :32], hbit, 1, 2, 32)  # element 32b + i: bit b of hmask[i], times 4
    q.bitwise_or_(hbit)  # q + 4 * bit, minus 4 below: q - 4 where the hmask bit is clear
    return _scaled(out, q, 4, scale, 16)


def _q4_k_like(blocks: torch.Tensor, out: torch.Tensor | None, qh_start: int | None) -> torch.Tensor:
    """Q4_K, and Q5_K with its fifth bits at `qh_start`: (d * sc) * q - (dmin * m) per 32 values.
    Q4_K's nibbles are widened straight into `out` (no uint8 copy of the quants)."""
    out = _out(blocks, 256, out)
    n, dev = blocks.shape[0], blocks.device
    scale, minimum = _k_scales(blocks)  # [n * 8, 1] each
    qs_start = 16 if qh_start is None else qh_start + 32
    qs = blocks[:, qs_start : qs_start + 128]
    if qh_start is None:
        _spread_nibbles(qs, out, 32)  # element 64c + 32 * nibble + i
        out.view(-1, 32).mul_(scale)
    else:
        q = _scratch("q", (n, 256), torch.uint8, dev)
        _spread_nibbles(qs, q, 32)
        hbit = _scratch("hbit", (n, 256), torch.uint8, dev)
        _spread_fields(blocks[:, qh_start : qh_start + 32], hbit, 1, 4, 32)  # bit b of qh[i] -> 32b + i
        _scaled(out, q.bitwise_or_(hbit), 0, scale, 32)
    out.view(-1, 32).sub_(minimum)
    return out


@register(T.Q4_K)
def q4_k(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: d f16 | dmin f16 | scales[12] | qs[128]
    return _q4_k_like(blocks, out, None)


@register(T.Q5_K)
def q5_k(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
    return _q4_k_like(blocks, out, 16)


@register(T.Q6_K)
def q6_k(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: ql[128] | qh[64] | scales int8[16] | d f16
    out = _out(blocks, 256, out)
    n, dev = blocks.shape[0], blocks.device
    scale = _sub_block_scale(_f16(blocks, 208), blocks[:, 192:208].view(torch.int8))  # [n * 16, 1]
    q = _scratch("q", (n, 256), torch.uint8, dev)
    _spread_nibbles(blocks[:, :128], q, 64)  # element 128h + 64 * nibble + i
    high = _scratch("hbit", (n, 256), torch.uint8, dev)
    _spread_fields(blocks[:, 128:192], high, 2, 4, 32)  # element 128h + 32s + i
    q.bitwise_or_(high)
    return _scaled(out, q, 32, scale, 16)


# ---------------------------------------------------------------- ternary


@register(T.TQ1_0)
def tq1_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Base-3 digits: byte x times 3^k (wrapping mod 256), then digit = (x * 3) >> 8, value digit - 1."""
    # block: qs[48] (32 + 16 bytes of 5 digits) | qh[4] (4 digits) | d f16
    out = _out(blocks, 256, out)
    n, dev = blocks.shape[0], blocks.device
    x = _scratch("q", (n, 256), torch.uint8, dev)
    # element order: 32 bytes x 5 powers, then 16 bytes x 5 powers, then 4 bytes x 4 powers
    for start, width, powers, at in ((0, 32, 5, 0), (32, 16, 5, 160), (48, 4, 4, 240)):
        for k in range(powers):
            dst = x[:, at + k * width : at + (k + 1) * width]
            torch.mul(blocks[:, start : start + width], 3**k, out=dst)
    digit = x.to(torch.int16).mul_(3).bitwise_right_shift_(8)
    x.copy_(digit)
    return _scaled(out, x, 1, _f16(blocks, 52), 256)


@register(T.TQ2_0)
def tq2_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: qs[64] (2-bit digits) | d f16
    out = _out(blocks, 256, out)
    q = _scratch("q", (blocks.shape[0], 256), torch.uint8, blocks.device)
    _spread_fields(blocks[:, :64], q, 2, 0, 32)  # element 128h + 32s + i
    return _scaled(out, q, 1, _f16(blocks, 64), 256)


# ---------------------------------------------------------------- FP4


def _fp4_out(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, run: int) -> torch.Tensor:
    """out = scale * kvalues[q] per `run` values; kvalues is gguf-py's doubled E2M1 table.
    q: uint8 codes in out's element order."""
    kvalues = _const(tuple(float(v) for v in gq.MXFP4.kvalues), torch.float32, q.device)
    codes = _scratch("codes", tuple(q.shape), torch.int32, q.device)
    codes.copy_(q)
    torch.index_select(kvalues, 0, codes.view(-1), out=out.view(-1))
    out.view(-1, run).mul_(scale)
    return out


@register(T.MXFP4)
def mxfp4(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Scale: E8M0 exponent e decoded as 2^(e-128) (half the OCP value, matching the doubled table),
    built from the bits as ggml_e8m0_to_fp32_half does (subnormal for e < 2)."""
    # block: e u8 | qs[16]; codes in Q4_0's order
    out = _out(blocks, 32, out)
    e = blocks[:, :1].int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return _fp4_out(_legacy_q(blocks, 1), bits.view(torch.float32), out, 32)


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
    d = torch.where((x == 0) | (x == 0x7F), 0.0, d * 0.5).view(-1, 1)  # [n * 4, 1]
    planes = _nibble_planes(blocks)
    q = _scratch("q", (blocks.shape[0], 64), torch.uint8, out.device)
    runs = q.view(-1, 8, 8)  # run 2s + p: nibble p of the 8 bytes of sub-block s (2-D copies only)
    for s in range(4):
        for p in range(2):
            runs[:, 2 * s + p].copy_(planes[p, :, 4 + 8 * s : 12 + 8 * s])
    return _fp4_out(q, d, out, 16)
