"""Planted faulty dequant kernels: one per named layout bug, plus kernels that crash, hang, raise,
break the contract or return NaN, and correct half-precision kernels.

Each fault's `build()` returns a `--kernel` spec ("llmdoctor.faults.kernels:<function>"); `expect`
is what the `check dequant` report must contain; `DEMO_TARGET[name]` is an `--only` glob of demo-model
tensors on which the fault shows.

The layout bugs are written independently of `checks/layout/layout_bugs.py`: small torch decoders of the
demo model's types (Q8_0, Q5_0, Q4_K, Q6_K; block structs of ggml-common.h) with a switch per bug,
evaluated in the same float32 operation order as gguf-py so that the correct path is bit-exact.
The same decoders evaluated in float16 are the correct half-precision kernels.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Optional

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants

from . import register

_SPEC = "llmdoctor.faults.kernels:"
DEMO_TARGET: dict[str, str] = {}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 2] little-endian float16 -> float32 [n, 1]."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor, swap: bool) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = qs & 0x0F, qs >> 4
    return (hi, lo) if swap else (lo, hi)


def _q8_0(b: torch.Tensor, bug: str, ct: torch.dtype) -> torch.Tensor:
    d = _f16(b[:, 0:2]).to(ct)  # [n, 1]
    q = b[:, 2:34] if bug == "unsigned" else b[:, 2:34].view(torch.int8)  # [n, 32]
    return q.to(ct) * d


def _q5_0(b: torch.Tensor, bug: str, ct: torch.dtype) -> torch.Tensor:
    d = _f16(b[:, 0:2]).to(ct)  # [n, 1]
    qh = b[:, 2:6].to(torch.int64)
    qh = qh[:, 0] | qh[:, 1] << 8 | qh[:, 2] << 16 | qh[:, 3] << 24  # [n] uint32 value
    if bug == "qh":  # high bits of the two halves exchanged
        qh = (qh >> 16) | ((qh & 0xFFFF) << 16)
    hb = (qh[:, None] >> torch.arange(32)) & 1  # [n, 32]
    lo, hi = _nibbles(b[:, 6:22], bug == "nibble")
    q = torch.cat([lo, hi], dim=1).to(torch.int64) | (hb << 4)  # [n, 32] in 0..31
    if bug != "unsigned":
        q = q - 16
    return d * q.to(ct)


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K 12 packed bytes -> 6-bit scales, mins [n, 8] (ggml-quants.c get_scale_min_k4)."""
    s = s.to(torch.int64)
    sc = torch.empty(s.shape[0], 8, dtype=torch.int64)
    mn = torch.empty_like(sc)
    for j in range(4):
        sc[:, j] = s[:, j] & 63
        mn[:, j] = s[:, j + 4] & 63
        sc[:, j + 4] = (s[:, j + 8] & 0x0F) | ((s[:, j] >> 6) << 4)
        mn[:, j + 4] = (s[:, j + 8] >> 4) | ((s[:, j + 4] >> 6) << 4)
    return sc, mn


def _q4_k(b: torch.Tensor, bug: str, ct: torch.dtype) -> torch.Tensor:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # [n, 1]
    if bug == "dmin":
        d, dmin = dmin, d
    if bug == "sign":
        d = -d
    sc, mn = _k4_scales(b[:, 4:16])  # [n, 8]
    if bug == "scale_min":
        sc, mn = mn, sc
    if bug == "subblock":
        sc, mn = sc.flip(1), mn.flip(1)
    qs = b[:, 16:144].reshape(-1, 4, 32)  # 4 groups of 32 bytes: sub-blocks 2g (low), 2g+1 (high)
    lo, hi = _nibbles(qs, bug == "nibble")
    q = torch.stack([lo, hi], dim=2).reshape(-1, 8, 32).to(ct)  # [n, 8, 32]
    dl = (d.to(ct) * sc.to(ct))[:, :, None]
    ml = (dmin.to(ct) * mn.to(ct))[:, :, None]
    return (dl * q - ml).reshape(-1, 256)


def _q6_k(b: torch.Tensor, bug: str, ct: torch.dtype) -> torch.Tensor:
    ql, qh = b[:, 0:128].to(torch.int64), b[:, 128:192].to(torch.int64)
    sc = b[:, 192:208].contiguous().view(torch.int8)  # [n, 16]
    if bug == "subblock":
        sc = sc.flip(1)
    d = _f16(b[:, 208:210])
    if bug == "sign":
        d = -d
    out = []
    for half in range(2):  # 128 elements each: four runs of 32
        l, h = ql[:, 64 * half:64 * half + 64], qh[:, 32 * half:32 * half + 32]
        runs = [(l[:, :32] & 15), (l[:, 32:] & 15), (l[:, :32] >> 4), (l[:, 32:] >> 4)]
        out += [r | (((h >> (2 * i)) & 3) << 4) for i, r in enumerate(runs)]
    q = (torch.cat(out, dim=1) - 32).reshape(-1, 16, 16).to(ct)  # [n, 16 sub-blocks, 16]
    return ((d.to(ct) * sc.to(ct))[:, :, None] * q).reshape(-1, 256)


_DECODERS = {T.Q8_0: _q8_0, T.Q5_0: _q5_0, T.Q4_K: _q4_k, T.Q6_K: _q6_k}


def _decode(raw: torch.Tensor, qtype: int, shape: tuple[int, ...], bug: str = "",
            ct: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode with our small decoders (the bug switched on), computing in `ct`; others via gguf-py."""
    q = T(qtype)
    raw = raw.cpu()
    if q in _DECODERS:
        _, ts = GGML_QUANT_SIZES[q]
        return _DECODERS[q](raw.view(-1, ts), bug, ct).reshape(shape)
    if q == T.F32:
        return raw.view(torch.float32).to(ct).reshape(shape)
    return torch.from_numpy(quants.dequantize(raw.numpy(), q)).reshape(shape).to(ct)


def _bug_kernel(name: str, bug: str, target: str, expect: str, description: str) -> None:
    def kernel(raw: torch.Tensor, qtype: int, shape: tuple[int, ...], dtype: Optional[torch.dtype] = None):
        out = _decode(raw, qtype, shape, bug)
        return out if dtype is None else out.to(dtype)

    kernel.__name__ = kernel.__qualname__ = name
    globals()[name] = kernel  # a module attribute, so that "llmdoctor.faults.kernels:<name>" resolves
    register(name, "kernel", description, expect)(lambda: _SPEC + name)
    DEMO_TARGET[name] = target


_bug_kernel("nibble_swap", "nibble", "blk.0.attn_[kq].weight", "nibble order swapped",
            "Q5_0/Q4_K: the high nibble is taken for the first half of each run")
_bug_kernel("qh_misplaced", "qh", "blk.0.attn_k.weight", "high bits (qh) misplaced",
            "Q5_0: the 5th bit of element j is read from bit j±16 of qh")
_bug_kernel("scale_min_swap", "scale_min", "blk.0.attn_output.weight", "scale and min swapped",
            "Q4_K: the 6-bit sub-block scale and min are exchanged")
_bug_kernel("subblock_order", "subblock", "blk.0.ffn_down.weight", "sub-block scale order",
            "Q4_K/Q6_K: the sub-block scales are applied in reverse order")
_bug_kernel("d_sign", "sign", "blk.0.attn_output.weight", "sign of d",
            "Q4_K/Q6_K: the super-block scale d is negated")
_bug_kernel("dmin_half", "dmin", "blk.0.attn_output.weight", "d/dmin from the wrong half",
            "Q4_K: d is read from dmin's half of the header and dmin from d's")
_bug_kernel("unsigned_quants", "unsigned", "blk.0.attn_v.weight", "signed/unsigned quants",
            "Q8_0/Q5_0: the quants are read unsigned (int8 as uint8, the -16 offset dropped)")


# ----------------------------------------------------------------------------- output-side bugs

def _reference(raw: torch.Tensor, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    return _decode(raw, qtype, shape)


def transposed(raw, qtype, shape, dtype=None):
    out = _reference(raw, qtype, shape)
    if out.dim() == 2:
        out = out.t().contiguous().view(shape)  # [cols, rows] written, read back as [rows, cols]
    return out if dtype is None else out.to(dtype)


def rows_shifted(raw, qtype, shape, dtype=None):
    out = _reference(raw, qtype, shape)
    if out.dim() == 2:
        out = torch.roll(out, shifts=-1, dims=0)  # row r gets row r+1 (off by one in the row index)
    return out if dtype is None else out.to(dtype)


def rows_wrapped(raw, qtype, shape, dtype=None):
    """A 16-bit row index: rows past 65535 repeat the first ones. Decodes only what it reads."""
    if len(shape) != 2 or shape[0] <= 1 << 16:
        out = _reference(raw, qtype, shape)
    else:
        bs, ts = GGML_QUANT_SIZES[T(qtype)]
        row_bytes = shape[1] // bs * ts
        head = _reference(raw[: row_bytes << 16], qtype, (1 << 16, shape[1]))
        out = head.repeat(-(-shape[0] // (1 << 16)), 1)[: shape[0]]
    return out if dtype is None else out.to(dtype)


def tail_unwritten(raw, qtype, shape, dtype=None):
    bs = GGML_QUANT_SIZES[T(qtype)][0]
    out = _reference(raw, qtype, shape).reshape(-1)
    out[-bs:] = 0  # the last block is never written (grid rounds down)
    out = out.reshape(shape)
    return out if dtype is None else out.to(dtype)


def wrong_type(raw, qtype, shape, dtype=None):
    """Decodes every 32-element type as Q4_0 (18-byte blocks)."""
    q = T(qtype)
    if GGML_QUANT_SIZES[q][0] == 32 and q != T.Q4_0:
        n = int(np.prod(shape)) // 32
        raw = raw[: n * 18]
        out = torch.from_numpy(quants.dequantize(raw.cpu().numpy(), T.Q4_0)).reshape(shape)
    else:
        out = _reference(raw, qtype, shape)
    return out if dtype is None else out.to(dtype)


for _name, _target, _expect, _desc in [
    ("transposed", "blk.0.attn_output.weight", "output transposed", "writes the [cols, rows] transpose"),
    ("rows_shifted", "blk.0.attn_k.weight", "rows shifted by +1", "row r holds row r+1"),
    ("rows_wrapped", "token_embd.weight", "rows wrapped past 2^16", "a 16-bit row index"),
    ("tail_unwritten", "blk.0.attn_v.weight", "tail block unwritten", "the last block stays zero"),
    ("wrong_type", "blk.0.attn_k.weight", "wrong type assumed (Q4_0)", "Q5_0 decoded as Q4_0"),
]:
    register(_name, "kernel", _desc, _expect)(lambda _n=_name: _SPEC + _n)
    DEMO_TARGET[_name] = _target


# ----------------------------------------------------------------------------- faults of the subject

def raises(raw, qtype, shape, dtype=None):
    raise RuntimeError("planted failure")


def segfault(raw, qtype, shape, dtype=None):
    ctypes.string_at(0)  # null pointer read: SIGSEGV


def aborts(raw, qtype, shape, dtype=None):
    os.abort()


def hangs(raw, qtype, shape, dtype=None):
    time.sleep(3600)


def wrong_shape(raw, qtype, shape, dtype=None):
    return _reference(raw, qtype, shape).reshape(-1)


def returns_nan(raw, qtype, shape, dtype=None):
    out = _reference(raw, qtype, shape).reshape(-1)
    out[out.numel() // 2 + 3] = float("nan")  # one element inside the tensor, likely not sampled
    out = out.reshape(shape)
    return out if dtype is None else out.to(dtype)


def half_precision(raw, qtype, shape, dtype=None):
    """Correct, but computes d*q+m in float16 and returns float16 (as vLLM's GGUF kernels do)."""
    return _decode(raw, qtype, shape, ct=torch.float16)


def half_precision_f32_out(raw, qtype, shape, dtype=None):
    """Correct, computes d*q+m in float16, returns float32; plain float types have no arithmetic to
    do in float16 and are converted exactly (rounding them would be a loss, not reduced precision)."""
    plain = T(qtype) in (T.F32, T.F16, T.BF16)
    out = _decode(raw, qtype, shape, ct=torch.float32 if plain else torch.float16).float()
    return out if dtype is None else out.to(dtype)


for _name, _expect, _desc in [
    ("raises", "kernel raised", "raises RuntimeError"),
    ("segfault", "kernel crashed", "reads a null pointer (SIGSEGV)"),
    ("aborts", "kernel crashed", "calls abort() (SIGABRT)"),
    ("hangs", "kernel hung", "never returns"),
    ("wrong_shape", "contract violation", "returns the flattened tensor"),
    ("returns_nan", "non-finite", "one NaN in the middle of the tensor"),
    ("half_precision", "reduced-precision arithmetic", "correct, float16 arithmetic and output"),
    ("half_precision_f32_out", "reduced-precision arithmetic", "correct, float16 arithmetic, float32 output"),
]:
    register(_name, "kernel", _desc, _expect)(lambda _n=_name: _SPEC + _n)
    DEMO_TARGET[_name] = "blk.0.attn_[kv].weight"
