"""Triton CUDA block kernels, bit-exact with gguf-py (registered in dequant.py for the CUDA device).

Each kernel maps uint8 [n_blocks, type_size] -> float32 [n_blocks, block_size], like the torch block
kernels. Byte layouts and the float operation order follow `gguf.quants.<TYPE>.dequantize_blocks`
(gguf-py 0.19, which llama.cpp keeps bit-exact with `dequantize_row_<type>` in ggml-quants.c).

Bit-exactness: every scale is decoded float16 -> float32 (exact), every quant integer -> float32
(exact), and each float32 multiply or add of gguf-py is one rounded operation here, in the same
order. Kernels are compiled with `enable_fp_fusion=False`: otherwise `d * q - m` may become one
fused multiply-add that rounds once instead of twice and differs from gguf-py in the last bit.
Where a scale is inf or NaN, both sides give NaN but not the same NaN bits: NumPy keeps NaN payloads
(and gives 0 * inf the x86 default NaN 0xffc00000), the GPU returns its canonical NaN 0x7fffffff
(measured on an H200, notes/device-dequant.md). Every non-NaN output is bit-exact.

Speed: one program dequantizes BB blocks. Quants are loaded and results stored as tiles
[BB, C, L] whose last axis is a run of L consecutive input bytes and of L consecutive output floats,
so both are vectorized (no byte gathers for the quants, 16-byte stores). A type whose output run
comes from several bit fields of the same bytes (the two nibbles of Q4_K, the four 2-bit fields of
Q6_K's high bits) loads those bytes once and stores one tile per field ("plane"). Scales are
loaded and combined in tiles of rank one or two ([BB], [BB, C]) and broadcast afterwards; they hit
L1. Program offsets are int64, so tensors past 2**31 bytes or elements index correctly. BB and
num_warps per type were tuned on an H200 (notes/device-dequant.md).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import IQ4_NL

from .dequant import register

Q = GGMLQuantizationType


@triton.jit
def _f16(ptr):
    """float16 at byte address `ptr` (even) -> float32 (exact)."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _u16(ptr):
    """uint16 at byte address `ptr` (even) -> int32."""
    return tl.load(ptr.to(tl.pointer_type(tl.uint16))).to(tl.int32)


@triton.jit
def _program(raw, out, n_blocks, TS: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr):
    """This program's blocks: their byte addresses blk: [BB], output base pointer (int64 offsets),
    local ids b: [BB] and which of them exist (the last program may have fewer than BB)."""
    pid = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, BB)
    ok = b < n_blocks - pid * BB
    b = tl.where(ok, b, 0)  # a missing block recomputes block 0 of this program; its stores are masked
    return raw + pid * (BB * TS) + b * TS, out + pid * (BB * QK), b, ok


# Scales are loaded and combined in tiles of rank one or two ([BB] or [BB, C]) and only then broadcast
# against the quant tile: a load of a [BB, C, 1] tile is repeated for every lane of the vector each
# thread stores (seen in the PTX: 4x the scale loads).

# ---- 32-element blocks: Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL (two nibble planes [BB, 16]) and Q8_0 ----


@triton.jit
def _k_legacy(raw, out, n_blocks, kv, BB: tl.constexpr, TS: tl.constexpr, HAS_M: tl.constexpr,
              QH: tl.constexpr, LUT: tl.constexpr):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL. Layout: d f16 [, m f16] [, qh u32] , qs [16].

    Element j = 16 h + k takes nibble h of qs[k]; with qh its bit j is bit 4 (gguf-py: qs >> [0, 4],
    qh >> arange(32)). Value: d * (q - offset) [+ m], or d * kvalues[q] for IQ4_NL.
    """
    blk, dst, b, ok = _program(raw, out, n_blocks, TS, 32, BB)
    QS: tl.constexpr = 2 + 2 * HAS_M + 4 * QH  # byte offset of qs
    OFF: tl.constexpr = 8 + 8 * QH  # signed types: Q4_0 q - 8, Q5_0 q - 16
    k = tl.arange(0, 16)[None, :]  # [1, 16]
    d = _f16(blk)[:, None]  # [BB, 1]
    if HAS_M:
        m = _f16(blk + 2)[:, None]
    if QH:
        qh = (_u16(blk + QS - 4) | (_u16(blk + QS - 2) << 16))[:, None]  # [BB, 1]; only 2-byte aligned
    qs = tl.load(blk[:, None] + QS + k).to(tl.int32)  # [BB, 16]
    for h in tl.static_range(2):
        q = (qs >> (4 * h)) & 15
        if QH:
            q = q | (((qh >> (16 * h + k)) & 1) << 4)
        if LUT:
            y = d * tl.load(kv + q)
        elif HAS_M:
            y = d * q.to(tl.float32) + m
        else:
            y = d * (q - OFF).to(tl.float32)
        tl.store(dst + b[:, None] * 32 + 16 * h + k, y, mask=ok[:, None])


@triton.jit
def _k_q8_0(raw, out, n_blocks, kv, BB: tl.constexpr):
    """Q8_0: d f16, qs int8 [32]; value qs * d."""
    blk, dst, b, ok = _program(raw, out, n_blocks, 34, 32, BB)
    k = tl.arange(0, 32)[None, :]
    d = _f16(blk)[:, None]
    x = tl.load((blk[:, None] + 2 + k).to(tl.pointer_type(tl.int8))).to(tl.float32)
    tl.store(dst + b[:, None] * 32 + k, x * d, mask=ok[:, None])


# ---- 256-element K-quant blocks ----


@triton.jit
def _k_scale_min(sp, s):
    """6-bit (scale, min) of sub-block s (0..7) from the 12 packed bytes at sp (gguf-py Q4_K.get_scale_min)."""
    j = s & 3
    a = tl.load(sp + j).to(tl.int32)
    m = tl.load(sp + j + 4).to(tl.int32)
    c = tl.load(sp + j + 8).to(tl.int32)
    lo = s < 4
    sc = tl.where(lo, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(lo, m & 63, (c >> 4) | ((m >> 6) << 4))
    return sc, mn


@triton.jit
def _k_q45_k(raw, out, n_blocks, kv, BB: tl.constexpr, TS: tl.constexpr, HIGH: tl.constexpr):
    """Q4_K (HIGH=0) / Q5_K (HIGH=1). Layout: d, dmin f16, scales [12], [qh [32],] qs [128].

    Element j = 64 c + 32 h + l takes nibble h of qs[32 c + l] (gguf-py: qs.reshape(n, 4, 1, 32) >>
    [0, 4]); Q5_K adds bit (2 c + h) of qh[l] as bit 4. Sub-block s = 2 c + h.
    Value: (d * sc) * q - dmin * m.
    """
    blk, dst, b, ok = _program(raw, out, n_blocks, TS, 256, BB)
    c = tl.arange(0, 4)  # [4]
    l = tl.arange(0, 32)[None, None, :]  # [1, 1, 32]
    QS: tl.constexpr = 16 + 32 * HIGH
    d = _f16(blk)[:, None]  # [BB, 1]
    dmin = _f16(blk + 2)[:, None]
    blk3 = blk[:, None, None]
    c3 = c[None, :, None]
    qs = tl.load(blk3 + QS + 32 * c3 + l).to(tl.int32)  # [BB, 4, 32]
    if HIGH:
        # qh[l] is the same for every c, but loaded as a full [BB, 4, 32] tile: then it shares the
        # layout of qs and of the stores (a [BB, 1, 32] load costs two layout conversions through
        # shared memory; the repeated bytes are L1 hits)
        qh = tl.load(blk3 + 16 + 0 * c3 + l).to(tl.int32)  # [BB, 4, 32]
    for h in tl.static_range(2):
        sc, mn = _k_scale_min(blk[:, None] + 4, 2 * c[None, :] + h)  # [BB, 4]
        dl = (d * sc.to(tl.float32))[:, :, None]  # [BB, 4, 1]
        ml = (dmin * mn.to(tl.float32))[:, :, None]
        q = (qs >> (4 * h)) & 15
        if HIGH:
            q = q | (((qh >> (2 * c3 + h)) & 1) << 4)
        y = dl * q.to(tl.float32) - ml
        tl.store(dst + b[:, None, None] * 256 + 64 * c3 + 32 * h + l, y, mask=ok[:, None, None])


# Q2_K, Q3_K and Q6_K have one scale per 16 elements. Their element j = 128 c + 32 s + 16 g + k is
# tiled [BB, 4 (r = 2 c + g), 16 (k)] per plane s (0..3): scale index j // 16 = 8 c + 2 s + g.


@triton.jit
def _k_q6_k(raw, out, n_blocks, kv, BB: tl.constexpr):
    """Q6_K. Layout: ql [128], qh [64], scales int8 [16], d f16.

    Low 4 bits: nibble (s // 2) of ql[64 c + 32 (s % 2) + l], high 2 bits (qh[32 c + l] >> 2 s) & 3,
    l = 16 g + k (gguf-py: ql.reshape(n, 2, 1, 64) >> [0, 4], qh.reshape(n, 2, 1, 32) >> [0, 2, 4, 6]).
    Value: (d * scale) * (q - 32).
    """
    blk, dst, b, ok = _program(raw, out, n_blocks, 210, 256, BB)
    r = tl.arange(0, 4)  # [4]
    c, g = r >> 1, r & 1
    k = tl.arange(0, 16)[None, None, :]  # [1, 1, 16]
    d = _f16(blk + 208)[:, None]  # [BB, 1]
    blk3 = blk[:, None, None]
    l3 = (16 * g)[None, :, None] + k  # [1, 4, 16]
    c3 = c[None, :, None]
    qh = tl.load(blk3 + 128 + 32 * c3 + l3).to(tl.int32)  # [BB, 4, 16]
    for half in tl.static_range(2):
        ql = tl.load(blk3 + 64 * c3 + 32 * half + l3).to(tl.int32)  # [BB, 4, 16]
        for nib in tl.static_range(2):
            s = 2 * nib + half
            sc = tl.load((blk[:, None] + 192 + (8 * c + 2 * s + g)[None, :]).to(tl.pointer_type(tl.int8)))
            dl = (d * sc.to(tl.float32))[:, :, None]  # [BB, 4, 1]
            q = ((ql >> (4 * nib)) & 15) | (((qh >> (2 * s)) & 3) << 4)
            y = dl * (q - 32).to(tl.float32)
            tl.store(dst + b[:, None, None] * 256 + 128 * c3 + 32 * s + l3, y, mask=ok[:, None, None])


@triton.jit
def _k_q23_k(raw, out, n_blocks, kv, BB: tl.constexpr, TS: tl.constexpr, Q3: tl.constexpr):
    """Q2_K (Q3=0) / Q3_K (Q3=1). The 2-bit quant is bits 2 s of qs[32 c + l], l = 16 g + k
    (gguf-py: qs.reshape(n, 2, 1, 32) >> [0, 2, 4, 6]).

    Q2_K layout: scales [16], qs [64], d, dmin f16. Value: (d * (sc & 15)) * q - dmin * (sc >> 4).
    Q3_K layout: hmask [32], qs [64], scales [12], d f16. q -= 4 unless bit (4 c + s) of hmask[l];
    6-bit scale i: low nibble (i // 8) of scales[i % 8], 2 bits (i // 4) of scales[8 + i % 4], minus 32.
    Value: (d * scale) * q.
    """
    blk, dst, b, ok = _program(raw, out, n_blocks, TS, 256, BB)
    r = tl.arange(0, 4)  # [4]
    c, g = r >> 1, r & 1
    k = tl.arange(0, 16)[None, None, :]  # [1, 1, 16]
    blk3 = blk[:, None, None]
    l3 = (16 * g)[None, :, None] + k  # [1, 4, 16]
    c3 = c[None, :, None]
    QS: tl.constexpr = 32 if Q3 else 16
    qs = tl.load(blk3 + QS + 32 * c3 + l3).to(tl.int32)  # [BB, 4, 16]
    if Q3:
        d = _f16(blk + 108)[:, None]  # [BB, 1]
        hm = tl.load(blk3 + l3).to(tl.int32)  # [BB, 4, 16]
    else:
        d = _f16(blk + 80)[:, None]
        dmin = _f16(blk + 82)[:, None]
    for s in tl.static_range(4):
        q = (qs >> (2 * s)) & 3
        i = (8 * c + 2 * s + g)[None, :]  # [1, 4]
        if Q3:
            lo = (tl.load(blk[:, None] + 96 + (i & 7)).to(tl.int32) >> (4 * (i >> 3))) & 15  # [BB, 4]
            hi = (tl.load(blk[:, None] + 104 + (i & 3)).to(tl.int32) >> (2 * (i >> 2))) & 3
            dl = (d * ((lo | (hi << 4)) - 32).to(tl.float32))[:, :, None]  # [BB, 4, 1]
            q = q - ((((hm >> (4 * c3 + s)) & 1) ^ 1) << 2)
            y = dl * q.to(tl.float32)
        else:
            sc = tl.load(blk[:, None] + i).to(tl.int32)  # [BB, 4]
            dl = (d * (sc & 15).to(tl.float32))[:, :, None]
            ml = (dmin * (sc >> 4).to(tl.float32))[:, :, None]
            y = dl * q.to(tl.float32) - ml
        tl.store(dst + b[:, None, None] * 256 + 128 * c3 + 32 * s + l3, y, mask=ok[:, None, None])


@triton.jit
def _k_iq4_xs(raw, out, n_blocks, kv, BB: tl.constexpr):
    """IQ4_XS. Layout: d f16, scales_h u16, scales_l [4], qs [128].

    Element j = 32 i + 16 h + k takes nibble h of qs[16 i + k] (gguf-py: qs.reshape(n, 8, 1, 16) >>
    [0, 4]); sub-block i's 6-bit scale: nibble (i % 2) of scales_l[i // 2], bits 2 i of scales_h,
    minus 32. Value: (d * scale) * kvalues[q].
    """
    blk, dst, b, ok = _program(raw, out, n_blocks, 136, 256, BB)
    i = tl.arange(0, 8)[None, :]  # [1, 8]
    k = tl.arange(0, 16)[None, None, :]  # [1, 1, 16]
    blk2 = blk[:, None]
    d = _f16(blk2)  # [BB, 1]
    lo = (tl.load(blk2 + 4 + (i >> 1)).to(tl.int32) >> (4 * (i & 1))) & 15  # [BB, 8]
    hi = (_u16(blk2 + 2) >> (2 * i)) & 3
    dl = (d * ((lo | (hi << 4)) - 32).to(tl.float32))[:, :, None]  # [BB, 8, 1]
    i3 = i[:, :, None]
    qs = tl.load(blk[:, None, None] + 8 + 16 * i3 + k).to(tl.int32)  # [BB, 8, 16]
    for h in tl.static_range(2):
        y = dl * tl.load(kv + ((qs >> (4 * h)) & 15))
        tl.store(dst + b[:, None, None] * 256 + 32 * i3 + 16 * h + k, y, mask=ok[:, None, None])


# ---- launch and registration ----

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_KV: dict[torch.device, torch.Tensor] = {}


def _kvalues(device: torch.device) -> torch.Tensor:
    """gguf-py's IQ4 codebook as float32 on `device` (cached)."""
    if device not in _KV:
        _KV[device] = torch.tensor(IQ4_NL.kvalues, dtype=torch.float32, device=device)
    return _KV[device]


# qtype -> (kernel, its type-specific constexpr arguments, (BB, num_warps)). BB and num_warps were picked
# from a sweep on an H200 (notes/device-dequant.md). Most K-quants ran best at BB=8 with 8 warps
# (8 output elements per thread), where Triton gives the quant loads and the stores one layout (no
# conversion through shared memory); differences under 2% between configurations are run-to-run noise.
_SPECS: dict[GGMLQuantizationType, tuple] = {
    Q.Q4_0: (_k_legacy, dict(TS=18, HAS_M=0, QH=0, LUT=0), (32, 4)),
    Q.Q4_1: (_k_legacy, dict(TS=20, HAS_M=1, QH=0, LUT=0), (32, 4)),
    Q.Q5_0: (_k_legacy, dict(TS=22, HAS_M=0, QH=1, LUT=0), (32, 4)),
    Q.Q5_1: (_k_legacy, dict(TS=24, HAS_M=1, QH=1, LUT=0), (32, 4)),
    Q.IQ4_NL: (_k_legacy, dict(TS=18, HAS_M=0, QH=0, LUT=1), (128, 8)),
    Q.Q8_0: (_k_q8_0, {}, (32, 4)),
    Q.Q2_K: (_k_q23_k, dict(TS=84, Q3=0), (8, 8)),
    Q.Q3_K: (_k_q23_k, dict(TS=110, Q3=1), (8, 8)),
    Q.Q4_K: (_k_q45_k, dict(TS=144, HIGH=0), (8, 8)),
    Q.Q5_K: (_k_q45_k, dict(TS=176, HIGH=1), (16, 8)),
    Q.Q6_K: (_k_q6_k, {}, (8, 8)),
    Q.IQ4_XS: (_k_iq4_xs, {}, (16, 8)),
}


def launch(blocks: torch.Tensor, qtype: GGMLQuantizationType, bb: int | None = None,
           num_warps: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize blocks: uint8 [n_blocks, type_size] -> float32 [n_blocks, block_size].

    `bb`/`num_warps` override the tuned launch configuration (the benchmark sweeps them); `out`, a
    float32 [n_blocks, block_size] on the same device, receives the result and is returned.
    """
    kernel, consts, (tuned_bb, tuned_warps) = _SPECS[qtype]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = blocks.contiguous().view(-1, type_size)  # uint8 [n_blocks, type_size]
    n = blocks.shape[0]
    dst = out if out is not None and out.is_contiguous() else None
    if dst is None:
        dst = torch.empty((n, block_size), dtype=torch.float32, device=blocks.device)
    bb = bb or tuned_bb
    if n and _INTERPRET:
        kernel[(triton.cdiv(n, bb),)](blocks, dst, n, _kvalues(blocks.device), BB=bb, **consts)
    elif n:
        with torch.cuda.device(blocks.device):  # Triton launches on the current device
            kernel[(triton.cdiv(n, bb),)](blocks, dst, n, _kvalues(blocks.device), BB=bb, **consts,
                                          num_warps=num_warps or tuned_warps, enable_fp_fusion=False)
    if out is not None and dst is not out:
        out.copy_(dst)
    return out if out is not None else dst


def _register(qtype: GGMLQuantizationType) -> None:
    def kernel(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return launch(blocks, qtype, out=out)

    kernel.__name__ = kernel.__qualname__ = f"triton_{qtype.name.lower()}"
    register(qtype, device="cuda")(kernel)


for _q in _SPECS:
    _register(_q)
