"""Weight forensics: what a lone GGUF file betrays about its own weights.

Per tensor, from its quantized blocks and its dequantized values (the statistics `verify` gathers in
its one streaming pass), then each tensor against its role siblings (blk.N.attn_output against every
other blk.M.attn_output). With no second copy of the model the only yardstick is the model itself:
the layers of one network were trained alike and quantized alike, so a tensor whose statistics stand
far outside its siblings' spread was changed after the fact.

Streaming API (verify calls it per chunk):

    acc = Accumulator(name, qtype)              # one per tensor
    acc.add(blocks, values)                     # blocks: uint8 [n, type_size]; values: float32, any shape
    stats = acc.finish()                        # TensorStats
    findings = compare(all_stats, file=path)    # absolute rules + the sibling outlier rule

`analyze(path)` does all of it for a file (diagnose's file-integrity step and the tests).

What the statistics can see (tests/test_forensics.py plants each): non-finite scales or weights
(absolute rule); block scales multiplied by noise (signs, the spread of |scale| in binades); a Q4_K tensor
whose d and dmin were exchanged (dmin/d ratio, mean/RMS, RMS). Inside K-quant blocks, the sub-block
scale and min codes are held to where llama.cpp's quantizer always puts the block's extreme sub-block
(SUBBLOCKS, below; tests/test_forensics_subblocks.py plants changed code bytes).
What they cannot see: two layers' tensors exchanged, or one tensor's rows permuted; every statistic
here is invariant under both (a tensor's statistics move with it; a permutation of rows keeps every
value). Those need a second copy: `diff`, `--manifest`, or `--hf`.
"""

from __future__ import annotations

import ctypes
import functools
import math
import re
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf.constants import QK_K
from gguf.quants import Q4_K

from ...native import load_extension
from ..base import Finding

CHECK = "forensics"

# ---- where the block scales live ----------------------------------------------------------------


@dataclass(frozen=True)
class ScaleField:
    """One per-block scale: its name, byte offset inside the block, and encoding."""

    name: str  # "d" (the block or super-block scale), "dmin" (K-quant minimum scale), "m" (legacy minimum)
    offset: int
    encoding: str = "f16"  # "f16" or "e8m0" (MXFP4's power-of-two exponent)


def _fields(qtype: QT) -> tuple[ScaleField, ...]:
    """The scale fields of `qtype`'s block, in the byte order of gguf.quants.<TYPE>.dequantize_blocks
    (which follows ggml-common.h's block structs). Offsets at the end of a block are taken from
    gguf-py's GGML_QUANT_SIZES so no struct size is restated here."""
    size = GGML_QUANT_SIZES[qtype][1]
    first = (QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S, QT.IQ1_S,
             QT.IQ4_NL, QT.IQ4_XS)
    if qtype in first:  # d, then the quants
        return (ScaleField("d", 0),)
    if qtype in (QT.Q4_1, QT.Q5_1):  # d, m (the block minimum, signed), quants
        return ScaleField("d", 0), ScaleField("m", 2)
    if qtype in (QT.Q4_K, QT.Q5_K):  # d, dmin, 6-bit sub-block scales and mins, quants
        return ScaleField("d", 0), ScaleField("dmin", 2)
    if qtype == QT.Q2_K:  # sub-block scales, quants, d, dmin
        return ScaleField("d", size - 4), ScaleField("dmin", size - 2)
    if qtype in (QT.Q3_K, QT.Q6_K, QT.TQ1_0, QT.TQ2_0):  # ..., d last
        return (ScaleField("d", size - 2),)
    if qtype == QT.MXFP4:  # e (E8M0: 2^(e - 127)), quants
        return (ScaleField("d", 0, "e8m0"),)
    return ()  # float types, IQ1_M (scale spread over the sub-block scales), NVFP4 (four UE4M3 scales)


SCALE_FIELDS: dict[QT, tuple[ScaleField, ...]] = {q: _fields(q) for q in QT if q in GGML_QUANT_SIZES}


def scale_codes(blocks: np.ndarray, f: ScaleField) -> np.ndarray:
    """The raw code of field `f` in each block of uint8 blocks [n, type_size]: uint16 [n] (the float16's
    bits) or uint8 [n] (the E8M0 exponent byte)."""
    if f.encoding == "e8m0":
        return blocks[:, f.offset]
    return np.ascontiguousarray(blocks[:, f.offset:f.offset + 2]).view("<u2")[:, 0]


def decode_codes(codes: np.ndarray, encoding: str) -> np.ndarray:
    """float32 values of scale codes (uint16 float16 bits, or uint8 E8M0 exponents: 2^(e - 127), 255 NaN)."""
    if encoding == "e8m0":
        e = codes.astype(np.int32)
        with np.errstate(over="ignore"):  # e = 255 (NaN) overflows ldexp before the where drops it
            return np.where(e == 255, np.float32(np.nan), np.ldexp(np.float32(1), e - 127)).astype(np.float32)
    return codes.astype("<u2").view("<f2").astype(np.float32)


def scale_values(blocks: np.ndarray, f: ScaleField) -> np.ndarray:
    """float32 [n]: field `f` of each block of uint8 blocks [n, type_size]."""
    return decode_codes(scale_codes(blocks, f), f.encoding)


# ---- per-tensor statistics (streaming) ----------------------------------------------------------

F16_MIN_NORMAL = 2.0 ** -14  # IEEE binary16: smaller nonzero magnitudes are subnormal
HUGE_BINADES = 8  # "huge": a scale more than 2^8 times the tensor's median |scale| (see ScaleStats)
BIN = 1 / 16  # the exponent histogram's bin, in binades (quantiles are exact to 1/16 binade)
_LO, _HI = -40, 40  # binades covered; scales outside are counted in the end bins


@dataclass(frozen=True)
class _CodeTable:
    """Everything ScaleStats needs of a scale, precomputed once for each of its encoding's codes (65536
    float16 bit patterns, 256 E8M0 bytes): a chunk then costs a bincount of its codes and a gather,
    and the statistics are exactly those of the per-value arithmetic (the same float32 ops, once per code)."""

    negative: np.ndarray  # bool [K]
    zero: np.ndarray
    subnormal: np.ndarray
    nonfinite: np.ndarray
    ok: np.ndarray  # finite and nonzero: enters the histogram and the jumps
    bin: np.ndarray  # int64 [K]: the histogram bin of log2 |s| (0 where not ok)
    lg: np.ndarray  # float64 [K]: log2 |s| computed in float32 (NaN where not ok)

    @staticmethod
    def build(encoding: str) -> "_CodeTable":
        s = decode_codes(np.arange(256 if encoding == "e8m0" else 65536), encoding)  # float32 [K]
        a = np.abs(s)
        finite = np.isfinite(s)
        ok = finite & (a > 0)
        lg = np.log2(np.where(ok, a, np.float32(1.0)))  # float32
        b = np.clip(np.floor((lg - _LO) / np.float32(BIN)), 0, _N_BINS - 1).astype(np.int64)
        return _CodeTable(s < 0, s == 0, (a > 0) & (a < F16_MIN_NORMAL), ~finite, ok, np.where(ok, b, 0),
                          np.where(ok, lg, np.float32(np.nan)).astype(np.float64))


_N_BINS = int((_HI - _LO) / BIN) + 1
_TABLES = {e: _CodeTable.build(e) for e in ("f16", "e8m0")}


@dataclass
class ScaleStats:
    """Distribution of one scale field over a tensor's blocks, streamed: how often each code occurs
    (from which the signs, zero / subnormal / non-finite counts and a histogram of log2 |s| in
    1/16-binade bins follow; quantiles and the median from the histogram), and the mean jump of
    log2 |s| between adjacent blocks (`jitter`: neighbours in a row see similar weights, so their
    scales are close; the demo's tensors jump 0.19..0.95 binades on average). `huge` counts scales
    more than 2^HUGE_BINADES times the tensor's median |scale|: a block 8 binades above its tensor's
    typical block has weights ~256x larger than its neighbours', which trained weights do not produce
    but a flipped exponent bit does."""

    encoding: str = "f16"
    counts: np.ndarray | None = None  # int64 [K]: blocks per code
    # One entry per add (a piece of consecutive blocks), in file order: (log2 |s| of its first block, of
    # its last, the sum of |log2 |s_i| - log2 |s_i+1|| over its adjacent blocks, how many; NaN: zero or
    # non-finite). The jitter folds them in order at the end, adding the jumps across pieces, so that it
    # is the same number however the pieces were grouped into chunks, and on whichever threads
    # (verify's workers each gather a chunk's pieces; merge() joins them).
    pieces: list[tuple[float, float, float, int]] = field(default_factory=list)

    def add_blocks(self, blocks: np.ndarray, f: ScaleField) -> None:
        """Field `f` of consecutive raw blocks (uint8 [n, type_size]): float16 fields in C where it is
        built (no copy of the codes; the jumps added in block order, not numpy's pairwise order: the
        same sum to ~1e-16 relative), else add(scale_codes(...))."""
        if _NATIVE is None or f.encoding != "f16" or not blocks.flags.c_contiguous:
            self.add(scale_codes(blocks, f))
            return
        if not blocks.shape[0]:
            return
        if self.counts is None:
            self.counts = np.zeros(65536, np.int64)
        lg = _TABLES["f16"].lg
        state = (ctypes.c_double * 3)(math.nan, 0.0, 0.0)
        _NATIVE.llmd_fx_codes16(blocks.ctypes.data + f.offset, blocks.shape[0], blocks.shape[1],
                                lg.ctypes.data, self.counts.ctypes.data, state)
        first = float(lg[int(blocks[0, f.offset]) | int(blocks[0, f.offset + 1]) << 8])
        self.pieces.append((first, state[0], state[1], int(state[2])))

    def add(self, codes: np.ndarray) -> None:
        """codes: the field's raw codes of consecutive blocks (scale_codes)."""
        if not codes.size:
            return
        tab = _TABLES[self.encoding]
        c = np.bincount(codes, minlength=tab.ok.size)
        self.counts = c if self.counts is None else self.counts + c
        lg = tab.lg[codes]  # float64 [n]
        steps = np.abs(np.diff(lg))
        steps = steps[np.isfinite(steps)]
        self.pieces.append((float(lg[0]), float(lg[-1]), float(steps.sum()), int(steps.size)))

    def merge(self, o: "ScaleStats") -> None:
        """self := self followed by o (the blocks right after self's)."""
        if o.counts is not None:
            self.counts = o.counts.copy() if self.counts is None else self.counts + o.counts
        self.pieces += o.pieces

    def jitter(self) -> float | None:
        """The mean |jump| of log2 |s| between adjacent blocks, folded over the pieces in file order."""
        total, jumps, last = 0.0, 0, math.nan
        for first, end, s, n in self.pieces:
            step = abs(first - last)
            if math.isfinite(step):
                total += step
                jumps += 1
            total += s
            jumps += n
            last = end
        return total / jumps if jumps else None

    def _binade(self, i: int) -> float:
        return _LO + (i + 0.5) * BIN  # the bin's center

    def summary(self) -> dict[str, Any]:
        tab = _TABLES[self.encoding]
        c = self.counts if self.counts is not None else np.zeros(tab.ok.size, np.int64)
        blocks = int(c.sum())
        n = max(blocks, 1)
        out: dict[str, Any] = {"blocks": blocks, "negative": int(c[tab.negative].sum()) / n,
                               "zero": int(c[tab.zero].sum()) / n, "subnormal": int(c[tab.subnormal].sum()) / n,
                               "nonfinite": int(c[tab.nonfinite].sum()) / n}
        hist = np.zeros(_N_BINS, np.int64)
        np.add.at(hist, tab.bin[tab.ok], c[tab.ok])
        nz = int(hist.sum())
        if nz:
            cdf = np.cumsum(hist) / nz
            q = {p: int(np.searchsorted(cdf, p)) for p in (0.01, 0.5, 0.99)}
            used = np.flatnonzero(hist)
            out.update(log2_min=self._binade(used[0]), log2_max=self._binade(used[-1]),
                       log2_p01=self._binade(q[0.01]), log2_median=self._binade(q[0.5]),
                       log2_p99=self._binade(q[0.99]),
                       huge=float(hist[q[0.5] + int(HUGE_BINADES / BIN) + 1:].sum()) / n)
        jitter = self.jitter()
        if jitter is not None:
            out["jitter"] = jitter
        return out


# ---- sub-block scales inside K-quant blocks ------------------------------------------------------------
# A K-quant super-block of QK_K values holds, besides d (and dmin), one small integer code per sub-block
# that multiplies d (and one per sub-block that multiplies dmin). llama.cpp's quantizer (ggml-quants.c:
# quantize_row_q*_K_ref without an importance matrix, quantize_row_q*_K_impl with one) fits each
# sub-block's scale first and then chooses d so that the block's extreme sub-block lands on the end of
# the code range. That end is in every block it writes, so a block without it was written by something
# else: the bytes were changed after quantization. Per type, from the source (names as in ggml-quants.c):
#   Q6_K  int8 codes; iscale = -128 / max_scale (the signed sub-block scale of largest |.|), each code
#         nearest_int(iscale * scale_j) capped at 127: the extreme's code is exactly -128, with or without
#         an importance matrix (both paths share that step). A block whose sub-blocks are all zero is
#         written as zero bytes.
#   Q3_K  6-bit codes stored with +32 (code - 32 is the signed scale). Without an importance matrix:
#         iscale = -32 / max_scale, the extreme's code is -32 + 32 = 0. With one: make_qx_quants(nmax 32)
#         tries iscale = -(32 + 0.1 k) / max for k in -9..9, so the extreme's l = nearest_int(-(32 + 0.1 k))
#         clamped to [-32, 31] is -32 or -31: its code is 0 or 1. Rule: the smallest code is 0 or 1.
#   Q4_K, Q5_K  6-bit scale codes and 6-bit min codes; without an importance matrix inv_scale =
#         63 / max_scale and inv_min = 63 / max_min, so the largest scale code and the largest min code
#         are exactly 63 (all codes 0 where max_scale, or max_min, is 0).
#   Q2_K  4-bit scale and min codes (low and high nibble); likewise 15 / max_scale and 15 / max_min:
#         the largest of each is exactly 15.
# With an importance matrix Q2_K, Q4_K and Q5_K fit their codes by make_qp_quants, whose refinement
# may lower the extreme's code (measured on llama.cpp's own quantizer: the largest scale code 58..63,
# the largest min code down to 42 on data of one sign), so for those three types the rule is exact
# only for files quantized without one; for the others the share of blocks off the end is compared
# among role siblings instead (see compare). Corrupted codes are seen only where they move the extreme:
# a random byte in a block's scales breaks the rule when it hits the extreme sub-block's code (about one
# block in 8 to 16, by type: tests/test_forensics_subblocks.py measures it), so one damaged block in a
# tensor may go unseen while tens of them are found with certainty.


@dataclass(frozen=True)
class CodeFamily:
    """One kind of sub-block code of a K-quant block, and where llama.cpp's quantizer pins it."""

    name: str  # "scales" (multiply d) or "mins" (multiply dmin)
    reduce: str  # "max" or "min": the end of a block's codes that its extreme sub-block takes
    pinned: tuple[int, ...]  # the values that end takes in every block the quantizer writes
    lo: int  # the code range (histogram bins), inclusive
    hi: int
    every_path: bool  # pinned with and without an importance matrix (else: only without one)


@dataclass(frozen=True)
class SubBlockLayout:
    """Where a K-quant block keeps its packed sub-block codes (ggml-common.h's block structs, in the
    byte order of gguf.quants.<TYPE>.dequantize_blocks), and the code families unpacked from them."""

    offset: int
    size: int
    families: tuple[CodeFamily, ...]
    kind: int  # the packing's number in _forensics_native.c's llmd_fx_subblocks


_SIX_BIT = dict(lo=0, hi=63)
SUBBLOCKS: dict[QT, SubBlockLayout] = {
    QT.Q2_K: SubBlockLayout(0, QK_K // 16, (CodeFamily("scales", "max", (15,), 0, 15, False),
                                            CodeFamily("mins", "max", (15,), 0, 15, False)), 2),
    QT.Q3_K: SubBlockLayout(QK_K // 8 + QK_K // 4, 12,
                            (CodeFamily("scales", "min", (0, 1), every_path=True, **_SIX_BIT),), 3),
    QT.Q4_K: SubBlockLayout(4, 12, (CodeFamily("scales", "max", (63,), every_path=False, **_SIX_BIT),
                                    CodeFamily("mins", "max", (63,), every_path=False, **_SIX_BIT)), 4),
    QT.Q6_K: SubBlockLayout(QK_K // 2 + QK_K // 4, QK_K // 16,
                            (CodeFamily("scales", "min", (-128,), -128, 127, True),), 6),
}
SUBBLOCKS[QT.Q5_K] = SUBBLOCKS[QT.Q4_K]  # the same 12 bytes after d and dmin


def subblock_codes(blocks: np.ndarray, qtype: QT) -> dict[str, np.ndarray]:
    """The sub-block codes of K-quant blocks uint8 [n, type_size]: family name -> int16 [n, sub-blocks]
    (Q3_K's as stored, 0..63; Q6_K's signed)."""
    lay = SUBBLOCKS[qtype]
    s = blocks[:, lay.offset:lay.offset + lay.size]  # [n, size] packed codes
    if qtype == QT.Q2_K:  # scale in the low nibble, min in the high
        return {"scales": (s & 0xF).astype(np.int16), "mins": (s >> 4).astype(np.int16)}
    if qtype == QT.Q6_K:
        return {"scales": s.view(np.int8).astype(np.int16)}
    if qtype == QT.Q3_K:  # low 4 bits: bytes 0..7 (j < 8 low nibble, j >= 8 high); high 2 bits: bytes 8..11
        low = np.concatenate([s[:, :8] & 0xF, s[:, :8] >> 4], axis=1)  # [n, 16]
        high = (s[:, None, 8:12] >> np.array([0, 2, 4, 6], np.uint8)[None, :, None]) & 3  # [n, j // 4, j % 4]
        return {"scales": (low | (high.reshape(-1, 16) << 4)).astype(np.int16)}
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(s))  # Q4_K, Q5_K: [n, 8] each
    return {"scales": sc.astype(np.int16), "mins": m.astype(np.int16)}


_BINS = 256  # histogram bins per family: every code of a byte (Q6_K's signed ones shifted by 128)


@functools.cache
def _pinned(layout: SubBlockLayout) -> np.ndarray:
    """uint8 [2, _BINS]: 1 where a family's extreme (as a bin: code - lo) is where the quantizer pins it."""
    out = np.zeros((2, _BINS), np.uint8)
    for i, fam in enumerate(layout.families):
        out[i, np.asarray(fam.pinned) - fam.lo] = 1
    return out


class SubBlockStats:
    """Per code family of one K-quant tensor, streamed: a histogram of each block's extreme code (its
    largest or smallest, CodeFamily.reduce; bin = code - lo) over blocks whose codes are not all zero,
    the number of all-zero blocks (what the quantizer writes for a block of zeros), and the first block
    whose extreme is not where the quantizer pins it. Counted in C where it is built (numpy's unpacking
    costs several times the moment passes: bench/bench_forensics_subblocks.py), else with numpy."""

    def __init__(self, qtype: QT):
        self.qtype, self.layout = qtype, SUBBLOCKS[qtype]
        self.blocks = 0
        self.hist = np.zeros((2, _BINS), np.int64)  # [family, bin]
        self.zero = np.zeros(2, np.int64)
        self.first_off: dict[str, tuple[int, int]] = {}  # family -> (block, its extreme code)

    def add(self, blocks: np.ndarray) -> None:
        """blocks: consecutive raw blocks of the tensor, uint8 [n, type_size]."""
        lay, pinned = self.layout, _pinned(self.layout)
        first = np.full(2, -1, np.int64)  # the chunk's first off block per family
        if _NATIVE is not None and blocks.flags.c_contiguous:
            _NATIVE.llmd_fx_subblocks(blocks.ctypes.data + lay.offset, blocks.shape[0], blocks.shape[1], lay.kind,
                                      pinned.ctypes.data, self.hist.ctypes.data, self.zero.ctypes.data,
                                      first.ctypes.data)
        else:
            codes = subblock_codes(blocks, self.qtype)
            for i, fam in enumerate(lay.families):
                c = codes[fam.name]  # [n, sub-blocks]
                nonzero = c.any(1)
                e = _extreme(fam, c)[nonzero] - fam.lo  # [n nonzero] bins
                self.hist[i] += np.bincount(e, minlength=_BINS)
                self.zero[i] += int((~nonzero).sum())
                off = np.flatnonzero(nonzero)[pinned[i, e] == 0]
                first[i] = off[0] if off.size else -1
        for i, fam in enumerate(lay.families):
            if first[i] >= 0 and fam.name not in self.first_off:
                b = int(first[i])
                code = int(_extreme(fam, subblock_codes(blocks[b:b + 1], self.qtype)[fam.name])[0])
                self.first_off[fam.name] = (self.blocks + b, code)
        self.blocks += blocks.shape[0]

    def merge(self, o: "SubBlockStats") -> None:
        """self := self followed by o (the blocks right after self's)."""
        self.hist += o.hist
        self.zero += o.zero
        for fam, (b, code) in o.first_off.items():
            self.first_off.setdefault(fam, (self.blocks + b, code))
        self.blocks += o.blocks

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"blocks": self.blocks}
        pinned = _pinned(self.layout)
        for i, fam in enumerate(self.layout.families):
            h = self.hist[i]
            first = self.first_off.get(fam.name)
            out[fam.name] = {"reduce": fam.reduce, "pinned": list(fam.pinned), "every_path": fam.every_path,
                             "zero_blocks": int(self.zero[i]), "off_blocks": int(h[pinned[i] == 0].sum()),
                             "extreme_codes": {int(b) + fam.lo: int(n) for b, n in enumerate(h) if n},
                             "first_off_block": None if first is None else first[0],
                             "first_off_code": None if first is None else first[1]}
        return out


def _extreme(fam: CodeFamily, codes: np.ndarray) -> np.ndarray:
    """Each block's extreme code: int [n] of codes [n, sub-blocks]."""
    return codes.max(1) if fam.reduce == "max" else codes.min(1)


@dataclass
class TensorStats:
    """One tensor's statistics: per scale field, and of its dequantized (finite) values."""

    name: str
    qtype: str
    n_values: int
    nonfinite: int
    rms: float
    mean: float
    max_abs: float
    kurtosis: float  # E[(w - mean)^4] / var^2 (3 for a Gaussian)
    scales: dict[str, dict[str, Any]] = field(default_factory=dict)
    scale_medians: dict[str, float] = field(default_factory=dict)  # log2 of the median |s| per field
    first_nonfinite_block: int | None = None
    subblocks: dict[str, Any] = field(default_factory=dict)  # K-quants: SubBlockStats.summary()

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("name", "qtype", "n_values", "nonfinite", "rms", "mean", "max_abs",
                                              "kurtosis", "scales", "first_nonfinite_block", "subblocks")}


# ---- the moments of the values, chunk by chunk ------------------------------------------------------
# Cost: this runs on every decoded value of a `verify` pass, so it is two reads of each chunk by the C
# routines of _forensics_native.c (a scan: min, max, sum; then the centered sums), or where that is not
# built, a few float32 torch passes over the chunk in reused buffers, on one torch thread (the calling
# thread's count is set to 1 for the chunk and restored: torch's intra-op threads wait on each other
# for every ~1M-value op, 20-60x slower on a busy 2-core host; verify.py measured it); never a float64
# copy of the values. Both compute the same quantities in rows of ROW values, so the bound below holds
# for either; each is bit-reproducible (the C one for any build: its summation order is fixed in the
# source). Per chunk of n values w:
#   max |w| and finiteness      a min and a max (the C scan flags inf / NaN; in torch they make the min or
#                               max non-finite); only then are the finite values picked out, exactly
#   the chunk mean m            float32 sums of ROW consecutive values, those added in float64
#   d = w - m32 (m rounded to float32), and S_k = sum of d^k for k = 2, 3, 4 the same way
# and the chunk's central moments (about its own mean) are merged into the tensor's in float64 with
# the pairwise update of Pebay (Sandia SAND2008-6212, eqs. 2.1-2.3; Chan, Golub and LeVeque 1979 for
# k = 2). Centering on the chunk's own mean avoids the cancellation of raw moments
# (E[w^4] - 4 E[w] E[w^3] + ...), which loses every digit of the kurtosis of a tensor whose mean is
# large against its spread (a norm weight near 1).
#
# Rounding bound (u = 2^-24, float32's unit roundoff; first order in u): d carries one rounding, and
# d^2, d^3, d^4 another 1, 2, 3 multiplications, so each term d^k is within (k + k')u of the exact
# (w - m32)^k (k' = 1, 2, 3); a float32 sum of ROW terms in any order is within (ROW - 1)u of
# sum |terms| (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 4.4), whatever
# order torch's kernel adds them in; the float64 sums and merges after it add ~2^-53 per operation. So
#   |S_k - exact| <= (ROW + 6) u sum |d|^k = 6.2e-5 sum |d|^k          (ROW = 1024)
#   |chunk mean - exact| <= (ROW - 1) u mean |w| = 6.1e-5 mean |w|,
# and from these (a chunk mean's error also enters M2 through the spread of chunk means, at most
# 2 x 6.1e-5 E|w| sigma): E[w^2] within 3.1e-4 E[w^2], so rms within 1.6e-4 relative and mean / rms
# within 2.2e-4 absolute; the kurtosis (reported, not compared) within ~1e-3 relative where |mean| is
# at most the spread sigma (a factor E|w| / sigma more where the mean dominates). The sibling rule
# works on log2 rms and mean / rms with floors of log2(1.12) = 0.16 binades and 0.12 (below): its
# median, MAD and each value moving by those amounts move a robust z by at most
# (2 + z x 2 x 1.4826) x shift / floor, under 0.03 at the limit (~4.4). Only a tensor within 0.03 of
# the limit could change its verdict; the demo's largest z is 0.3 under it (tests/test_forensics.py
# checks both, and the statistics against float64: there they agree to ~1e-7). The scale statistics
# are exact (counts of codes). Every sum is in a fixed order (rows of ROW values, then those in
# order), so the numbers are the same run to run and for any torch thread count.
# Range: w^4 overflows float32 from |w| ~ 2^32 and loses its precision in subnormals below 2^-31, so a
# chunk with max |w| outside [2^-20, 2^20] is scaled by a power of two (exact) to max |w| in [1, 2)
# first; terms under 2^-31 max |w| may still lose digits, but they add at most n 2^-126 to a sum of
# at least max |d|^4 (a relative error under 2^-40 for any chunk whose spread is not below 2^-20 of
# its magnitude).
ROW = 1024  # the C file's ROW too
_SAFE = (2.0 ** -20, 2.0 ** 20)
_scratch = threading.local()
_NATIVE_ABI = 4  # llmd_fx_abi() of the C code this module calls


def _load_native() -> ctypes.CDLL | None:
    """The C passes (built by setup.py as an optional extension), or None: then the torch passes."""
    lib, _ = load_extension("llmdoctor.checks.file._forensics_native", "llmd_fx_abi", _NATIVE_ABI)
    if lib is None:
        return None
    lib.llmd_fx_scan.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.llmd_fx_central.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]
    lib.llmd_fx_codes16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_void_p]
    lib.llmd_fx_subblocks.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.llmd_fx_codes16_pieces.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.llmd_fx_pieces.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_double, ctypes.c_double,
                                   ctypes.c_void_p]
    for f in ("llmd_fx_scan", "llmd_fx_central", "llmd_fx_codes16", "llmd_fx_subblocks", "llmd_fx_codes16_pieces",
              "llmd_fx_pieces"):
        getattr(lib, f).restype = None
    return lib


_NATIVE = _load_native()


def native_decoding(qtype: QT | int) -> tuple[int, int] | None:
    """The C kernel (address, table) that Accumulator.add_decoded decodes `qtype` with, or None where
    the native libraries (forensics', dequantization's) do not both have it."""
    if _NATIVE is None:
        return None
    from ...gguf import dequant_native

    return dequant_native.kernel_address(qtype)


def _buffers(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two float32 [n] scratch buffers, reused per thread and device (grown, never shrunk)."""
    key = str(device)
    bufs = getattr(_scratch, "bufs", {})
    _scratch.bufs = bufs
    b = bufs.get(key)
    if b is None or b[0].numel() < n:
        b = bufs[key] = (torch.empty(n, dtype=torch.float32, device=device),
                         torch.empty(n, dtype=torch.float32, device=device))
    return b[0][:n], b[1][:n]


def _min_max(x: torch.Tensor) -> tuple[float, float]:
    """(min, max) of float32 x [n >= 1]; NaN when x holds a NaN. On the CPU numpy's (0.1 ms per 1M
    values against torch.aminmax's 0.16 on this machine's AMD EPYC: it is one of the passes)."""
    if x.device.type == "cpu":
        a = x.numpy()
        return float(a.min()), float(a.max())
    return tuple(float(y) for y in torch.aminmax(x))  # type: ignore[return-value]


def _scan(x: torch.Tensor) -> tuple[float, float, float | None, bool]:
    """(min, max, sum or None, every value finite) of float32 x [n >= 1] (contiguous); the sum only
    from the C scan (the torch path sums later, when it knows the chunk needs no scaling)."""
    if _NATIVE is not None and x.device.type == "cpu":
        out = (ctypes.c_double * 4)()
        _NATIVE.llmd_fx_scan(x.data_ptr(), x.numel(), out)
        return out[0], out[1], out[2], out[3] == 0.0
    lo, hi = _min_max(x)
    return lo, hi, None, math.isfinite(lo) and math.isfinite(hi)


def _sum(x: torch.Tensor) -> float:
    """sum of float32 x [n]: float32 sums of ROW consecutive values, added in float64 (see above)."""
    k = x.numel() - x.numel() % ROW
    s = float(x[:k].view(-1, ROW).sum(1).sum(dtype=torch.float64)) if k else 0.0
    return s + float(x[k:].sum()) if k < x.numel() else s


@dataclass
class Moments:
    """Count, mean and central moment sums M_k = sum (w - mean)^k (k = 2, 3, 4) of the values seen."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    m3: float = 0.0
    m4: float = 0.0

    def merge(self, o: "Moments") -> None:
        """Pebay's pairwise update: self := self united with o."""
        na, nb = self.n, o.n
        if nb == 0:
            return
        if na == 0:
            self.n, self.mean, self.m2, self.m3, self.m4 = o.n, o.mean, o.m2, o.m3, o.m4
            return
        n = na + nb
        dl = o.mean - self.mean
        m4 = (self.m4 + o.m4 + dl ** 4 * na * nb * (na * na - na * nb + nb * nb) / n ** 3
              + 6 * dl * dl * (na * na * o.m2 + nb * nb * self.m2) / n ** 2 + 4 * dl * (na * o.m3 - nb * self.m3) / n)
        m3 = self.m3 + o.m3 + dl ** 3 * na * nb * (na - nb) / n ** 2 + 3 * dl * (na * o.m2 - nb * self.m2) / n
        self.m2 += o.m2 + dl * dl * na * nb / n
        self.mean += dl * nb / n
        self.m3, self.m4, self.n = m3, m4, n

    @staticmethod
    def of(w: torch.Tensor, max_abs: float, total: float | None = None) -> "Moments":
        """The moments of finite float32 w [n] (contiguous) whose largest |w| is max_abs; `total`: its
        sum in the order of _sum, when the scan has it."""
        n = w.numel()
        if n == 0:
            return Moments()
        scale = 1.0
        native = _NATIVE is not None and w.device.type == "cpu"
        if max_abs > 0 and not _SAFE[0] <= max_abs <= _SAFE[1]:
            scale = 2.0 ** (math.frexp(max_abs)[1] - 1)  # w / scale: max |w| in [1, 2), exactly
            w = torch.div(w, scale, out=_buffers(n, w.device)[0])
            total = None
        mean = (total if total is not None else _sum(w)) / n
        m32 = float(np.float32(mean))
        if native:
            out = (ctypes.c_double * 3)()
            _NATIVE.llmd_fx_central(w.data_ptr(), n, m32, out)
            s2, s3, s4 = out
        else:
            d, d2 = _buffers(n, w.device)
            torch.sub(w, m32, out=d)  # d: [n] w - m32 (w may be d itself: elementwise, in place)
            s2 = _sum(torch.mul(d, d, out=d2))
            s3 = _sum(d.mul_(d2))
            s4 = _sum(d2.mul_(d2))
        return Moments.of_sums(n, mean, s2, s3, s4, scale)

    @staticmethod
    def of_sums(n: int, mean: float, s2: float, s3: float, s4: float, scale: float = 1.0) -> "Moments":
        """The moments of n values (divided by `scale`) whose mean is `mean`, from their sums S_k of
        (w - m32)^k, m32 the mean rounded to float32."""
        r = mean - float(np.float32(mean))  # the mean's offset from the center the float32 terms are taken about
        # central sums about the chunk mean m32 + r from the sums about m32
        m2 = s2 - n * r * r
        m3 = s3 - 3 * r * s2 + 2 * n * r ** 3
        m4 = s4 - 4 * r * s3 + 6 * r * r * s2 - 3 * n * r ** 4
        return Moments(n, mean * scale, m2 * scale ** 2, m3 * scale ** 3, m4 * scale ** 4)


class Accumulator:
    """Gathers one tensor's statistics chunk by chunk, in file order (see the moments' notes above);
    merge() joins the accumulators of consecutive runs of blocks, as gathered on different threads."""

    def __init__(self, name: str, qtype: QT | int):
        self.name, self.qtype = name, QT(qtype)
        self.fields = SCALE_FIELDS.get(self.qtype, ())
        self.scales = {f.name: ScaleStats(f.encoding) for f in self.fields}
        self.subblocks = SubBlockStats(self.qtype) if self.qtype in SUBBLOCKS else None
        # of the finite values, one entry per add (a piece), folded in file order by finish(): the same
        # numbers however the pieces were grouped into the accumulators that merge() joined
        self.moments: list[Moments] = []
        self.n = self.nonfinite = 0
        self.max_abs = 0.0
        self._blocks_seen = 0
        self.first_nonfinite_block: int | None = None

    def add(self, blocks: np.ndarray | None, values: torch.Tensor | np.ndarray) -> bool:
        """One chunk: its raw blocks (uint8 [n, type_size]; None for float types) and its dequantized
        values (float32, n * block_size of them, in block order; a torch tensor on any device, or numpy).
        Its two halves (add_blocks, add_values) touch disjoint state: two threads may feed one each.
        Returns add_values's answer: whether every value is finite."""
        if blocks is not None:
            self.add_blocks(blocks)
        return self.add_values(values)

    def add_blocks(self, blocks: np.ndarray) -> None:
        """The raw blocks' half of add: block scales and sub-block codes."""
        for f in self.fields:
            self.scales[f.name].add_blocks(blocks, f)
        if self.subblocks is not None:
            self.subblocks.add(blocks)

    def add_values(self, values: torch.Tensor | np.ndarray) -> bool:
        """The decoded values' half of add: finiteness, max |w|, moments. Returns whether every value
        is finite (from the scan the moments need anyway: verify's check of the piece reuses it)."""
        v = torch.as_tensor(values).detach().reshape(-1)  # [n]
        if v.dtype != torch.float32 or not v.is_contiguous():
            v = v.to(torch.float32).contiguous()
        threads = torch.get_num_threads()  # this thread's; verify's statistics thread already runs on one
        if threads > 1 and v.device.type == "cpu":
            torch.set_num_threads(1)
        try:
            return self._values(v)
        finally:
            if threads > 1 and v.device.type == "cpu":
                torch.set_num_threads(threads)

    def _values(self, v: torch.Tensor) -> bool:
        bs = GGML_QUANT_SIZES[self.qtype][0]
        bad, w = 0, v
        if v.numel():
            lo, hi, total, ok = _scan(v)
            if not ok:  # NaN or inf somewhere: the exact count
                finite = torch.isfinite(v)
                bad = v.numel() - int(finite.sum())
                if self.first_nonfinite_block is None:
                    self.first_nonfinite_block = self._blocks_seen + int((~finite).nonzero()[0, 0]) // bs
                w = v[finite]
                lo, hi, total, _ = _scan(w) if w.numel() else (0.0, 0.0, 0.0, True)
            self.max_abs = max(self.max_abs, -lo, hi)
            self.moments.append(Moments.of(w, max(-lo, hi), total))
        self._blocks_seen += v.numel() // bs
        self.n += v.numel()
        self.nonfinite += bad
        return bad == 0

    def add_blocks_in_pieces(self, blocks: np.ndarray, piece_blocks: int) -> None:
        """add_blocks of each piece of piece_blocks consecutive blocks in turn (uint8 [n, type_size]): to
        the bit the same, in one native call per float16 scale field where the library is built."""
        n_blocks = blocks.shape[0]
        if _NATIVE is None or not blocks.flags.c_contiguous:
            for b0 in range(0, n_blocks, piece_blocks):
                self.add_blocks(blocks[b0:b0 + piece_blocks])
            return
        for f in self.fields:
            st = self.scales[f.name]
            if f.encoding != "f16":
                for b0 in range(0, n_blocks, piece_blocks):
                    st.add(scale_codes(blocks[b0:b0 + piece_blocks], f))
                continue
            if st.counts is None:
                st.counts = np.zeros(65536, np.int64)
            res = np.empty((-(-n_blocks // piece_blocks), 4))
            _NATIVE.llmd_fx_codes16_pieces(blocks.ctypes.data + f.offset, n_blocks, blocks.shape[1],
                                           _TABLES["f16"].lg.ctypes.data, st.counts.ctypes.data, piece_blocks,
                                           res.ctypes.data)
            st.pieces += [(a, b, c, int(d)) for a, b, c, d in res.tolist()]
        if self.subblocks is not None:
            self.subblocks.add(blocks)

    def add_decoded(self, blocks: np.ndarray, decoder: tuple[int, int], piece_blocks: int, out: torch.Tensor) -> list[int]:
        """A chunk of consecutive raw blocks (uint8 [n, type_size], C-contiguous) decoded here, piece by
        piece (piece_blocks at a time), by the C kernel `decoder` (gguf.dequant_native.kernel_address)
        into `out` (float32, CPU, >= piece_blocks * block_size values): the statistics of add() of each
        piece in turn, to the bit, in one native call for the values and one per float16 scale field.
        A piece the C pass leaves (a value inf or NaN, or max |w| outside the range its sums take) is
        decoded again and added by _values. Returns the pieces (indices in the chunk) that hold a
        value that is inf or NaN. Needs the native library (native_decoding())."""
        n_blocks, bs = blocks.shape[0], GGML_QUANT_SIZES[self.qtype][0]
        n_pieces = -(-n_blocks // piece_blocks)
        self.add_blocks_in_pieces(blocks, piece_blocks)
        fn, table = decoder
        res = np.empty((n_pieces, 7))
        _NATIVE.llmd_fx_pieces(fn, table or None, blocks.ctypes.data, n_blocks, blocks.shape[1], bs, piece_blocks,
                               out.data_ptr(), _SAFE[0], _SAFE[1], res.ctypes.data)
        bad = []
        for p, (lo, hi, total, nonfinite, s2, s3, s4) in enumerate(res.tolist()):
            b0 = p * piece_blocks
            n = min(piece_blocks, n_blocks - b0) * bs
            if math.isnan(s2):  # left to the per-piece path: decode it again
                piece = blocks[b0:b0 + piece_blocks]
                _NATIVE.llmd_fx_pieces(fn, table or None, piece.ctypes.data, piece.shape[0], blocks.shape[1], bs,
                                       piece_blocks, out.data_ptr(), _SAFE[0], _SAFE[1], (ctypes.c_double * 7)())
                self._values(out[:n])
                if nonfinite:
                    bad.append(p)
                continue
            self.max_abs = max(self.max_abs, -lo, hi)
            self.moments.append(Moments.of_sums(n, total / n, s2, s3, s4))
            self._blocks_seen += n // bs
            self.n += n
        return bad

    def merge(self, o: "Accumulator") -> None:
        """self := self followed by o, an accumulator of the same tensor's next blocks (both halves: a
        half o was not fed is empty and changes nothing)."""
        for name, st in o.scales.items():
            self.scales[name].merge(st)
        if self.subblocks is not None and o.subblocks is not None:
            self.subblocks.merge(o.subblocks)
        if self.first_nonfinite_block is None and o.first_nonfinite_block is not None:
            self.first_nonfinite_block = self._blocks_seen + o.first_nonfinite_block
        self.moments += o.moments
        self.max_abs = max(self.max_abs, o.max_abs)
        self.n += o.n
        self.nonfinite += o.nonfinite
        self._blocks_seen += o._blocks_seen

    def finish(self) -> TensorStats:
        m = Moments()
        for piece in self.moments:
            m.merge(piece)
        k = max(m.n, 1)
        var = m.m2 / k
        summaries = {n: s.summary() for n, s in self.scales.items()}
        return TensorStats(self.name, self.qtype.name, self.n, self.nonfinite, math.sqrt(var + m.mean * m.mean),
                           m.mean, self.max_abs, m.m4 / k / (var * var) if var > 0 else math.nan, summaries,
                           {n: s["log2_median"] for n, s in summaries.items() if "log2_median" in s},
                           self.first_nonfinite_block, self.subblocks.summary() if self.subblocks is not None else {})


CHUNK_VALUES = 1 << 20  # values per chunk (verify's chunk): two float32 scratch buffers of 4 MiB


def tensor_stats(t: Any, values: torch.Tensor | None = None) -> TensorStats:
    """Statistics of a whole tensor (a reader TensorInfo), chunk by chunk; `values` when already
    dequantized (float32, any shape, block order)."""
    from ...gguf import dequantize

    acc = Accumulator(t.name, t.type)
    bs, ts = t.block_size, t.type_size
    blocks = t.data.reshape(-1, ts)  # [n_blocks, type_size]
    step = max(CHUNK_VALUES // bs, 1)
    flat = values.reshape(-1) if values is not None else None
    for b0 in range(0, blocks.shape[0], step):
        chunk = blocks[b0:b0 + step]
        v = flat[b0 * bs:(b0 + chunk.shape[0]) * bs] if flat is not None else \
            dequantize(chunk.reshape(-1), int(t.type), (chunk.shape[0] * bs,))
        acc.add(chunk if acc.fields else None, v)
    return acc.finish()


# ---- the sibling comparison --------------------------------------------------------------------

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def role(name: str) -> str | None:
    """blk.7.attn_output.weight -> attn_output.weight; None for tensors outside the blocks."""
    m = _BLOCK.match(name)
    return m.group(2) if m else None


@dataclass(frozen=True)
class Metric:
    """A per-tensor number compared across siblings, and the floor under its spread (`kind`)."""

    key: str
    words: str
    kind: str  # "fraction" (a share of n blocks), "binades" (a log2 distance), "log2" (a magnitude)
    by_type: bool  # compared only among siblings of the same quant type (scale encodings differ by type)


# Compared across siblings. Also gathered and reported, but not compared, because layers of a healthy
# model differ in them by more than any fault here moves them (measured on the demo, Gemma 3 270M):
# the share of zero and subnormal block scales (0.1% .. 6% among the Q4_K attn_output), and the
# kurtosis of the weights (3.6 .. 35 among attn_k; block-scale noise multiplies it by E[u^4]/E[u^2]^2
# = 1.8, well inside that range).
METRICS = (
    Metric("d_negative", "of block scales negative", "fraction", True),
    Metric("dmin_negative", "of block minimum scales negative", "fraction", True),
    Metric("d_huge", f"of block scales over 2^{HUGE_BINADES} x the median", "fraction", True),
    Metric("d_spread", "binades between the 1st and 99th percentile |block scale|", "binades", True),
    Metric("d_jitter", "binades between adjacent blocks' scales (mean)", "log2", True),
    Metric("dmin_over_d", "binades of median dmin over median d", "binades", True),
    Metric("rms", "RMS of the weights", "log2", False),
    Metric("mean_over_rms", "mean / RMS of the weights", "plain", False),
    # only where the sub-block rule is not exact (an importance matrix was, or may have been, used)
    Metric("scales_off", "of blocks whose extreme sub-block scale code is off the quantizer's end", "fraction", True),
    Metric("mins_off", "of blocks whose largest sub-block min code is off the quantizer's end", "fraction", True),
)

# A role needs this many tensors before its median and MAD mean anything: with 4, one outlier leaves a
# majority of 3 that fixes the median and the MAD (the estimators' breakdown point is 50%).
MIN_SIBLINGS = 4
FAMILY_FALSE_ALARM = 0.01  # chance that a healthy file shows any sibling outlier (Bonferroni, below)
MAD_TO_SIGMA = 1.4826  # MAD of a normal sample x 1.4826 estimates its standard deviation
# Floors on the spread, so that identical siblings (a robust spread of 0, as in small test models)
# do not turn a legitimate difference into an outlier:
# - fraction: the binomial sampling sd of a share p of n blocks, sqrt(p (1 - p) / n), p at least 1/n;
# - binades: 1 binade. Scales are floats: a quantile of |scale| moves by a binade when a layer's
#   weights are twice as wide, which trained layers are (the demo's Q4_K attn_output 1%..99% spans
#   are 1..3 binades). Noise U(-2, 2) on the scales stretches the span by log2 of |u|'s 99%/1%
#   quantiles ratio, log2(1.98 / 0.02) = 6.6 binades; exchanging d and dmin flips the dmin/d ratio's
#   sign (3 binades on the demo -> -3). The noise also adds log2|u1| - log2|u2| to each adjacent
#   jump, a Laplace variable of scale 1/ln 2 (log2 of a uniform is an exponential): the mean jump grows
#   by about 1/ln 2 = 1.44 binades, which finds noise on types whose scales are signed anyway
#   (Q5_0, Q6_K: their d takes the sign of the block's extreme weight);
# - log2 (RMS, and the jitter of adjacent block scales, compared as magnitudes): the change a
#   legitimately different quantization of the same weights makes: a role
#   stored at two types (llama.cpp's Q4_K_M puts some ffn_down / attn_v at Q6_K) sees its RMS move by
#   the coarser type's relative error, <= 0.12 for 4-bit types (the mapping check's band), i.e.
#   log2(1.12) = 0.16 binades;
# - plain (mean / RMS): the same 0.12, in units of the RMS.
BINADE_FLOOR = 1.0
LOG2_FLOOR = math.log2(1.12)
PLAIN_FLOOR = 0.12
_FLOORS = {"binades": BINADE_FLOOR, "log2": LOG2_FLOOR, "plain": PLAIN_FLOOR}


def metric_values(st: TensorStats) -> dict[str, tuple[float, int]]:
    """metric key -> (value, the number of samples behind it: blocks for scale metrics)."""
    out: dict[str, tuple[float, int]] = {}
    for fname, s in st.scales.items():
        n = s["blocks"]
        if fname in ("d", "dmin"):
            out[f"{fname}_negative"] = (s["negative"], n)
        if fname == "d" and "log2_p99" in s:
            out["d_huge"] = (s["huge"], n)
            out["d_spread"] = (s["log2_p99"] - s["log2_p01"], n)
        if fname == "d" and s.get("jitter"):
            out["d_jitter"] = (s["jitter"], n)
    if "d" in st.scale_medians and "dmin" in st.scale_medians:
        out["dmin_over_d"] = (st.scale_medians["dmin"] - st.scale_medians["d"], st.n_values)
    for fam, sb in st.subblocks.items():
        if isinstance(sb, dict) and sb.get("rule") == "siblings":
            out[f"{fam}_off"] = (sb["off_blocks"] / st.subblocks["blocks"], st.subblocks["blocks"])
    if st.rms > 0:
        out["rms"] = (st.rms, st.n_values)
        out["mean_over_rms"] = (st.mean / st.rms, st.n_values)
    return out


def threshold(n_tests: int) -> float:
    """The robust-z limit: two-sided normal quantile at FAMILY_FALSE_ALARM / n_tests (Bonferroni over
    every tensor x metric compared), so a healthy file raises no outlier with probability >= 99%
    when siblings scatter normally around their median. ~4.4 for 300 tests."""
    return NormalDist().inv_cdf(1 - FAMILY_FALSE_ALARM / (2 * max(n_tests, 1)))


def _spread(metric: Metric, values: list[float], counts: list[int]) -> tuple[float, float]:
    """(center, spread) of siblings in the metric's comparison space: median and max(1.4826 MAD, floor).
    A fraction's floor is its binomial sampling sd at the median share (at least 1 of n blocks)."""
    x = np.asarray(values, dtype=np.float64)
    center = float(np.median(x))
    mad = MAD_TO_SIGMA * float(np.median(np.abs(x - center)))
    if metric.kind == "fraction":
        n = float(np.median(counts))
        p = min(max(center, 1.0 / n), 0.5)
        floor = math.sqrt(p * (1 - p) / n)
    else:
        floor = _FLOORS[metric.kind]
    return center, max(mad, floor)


def _fmt(metric: Metric, v: float) -> str:
    if metric.kind == "fraction":
        return f"{v:.1%}" if v else "0%"
    if metric.kind == "log2":
        return f"{2 ** v:.4g}"
    if metric.kind == "binades":
        return f"{v:.2f}"
    return f"{v:.3g}"


def outliers(stats: list[TensorStats]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Sibling outliers: (one record per (tensor, metric) beyond the limit, a summary of what was compared)."""
    groups: dict[tuple[str, str | None], list[TensorStats]] = defaultdict(list)
    for st in stats:
        r = role(st.name)
        if r is None:
            continue
        groups[(r, None)].append(st)
        groups[(r, st.qtype)].append(st)
    tests = []  # (metric, group key, members, values, counts)
    too_few = set()
    for (r, qtype), members in groups.items():
        for m in METRICS:
            if m.by_type != (qtype is not None):
                continue
            vals = [(st, metric_values(st).get(m.key)) for st in members]
            vals = [(st, v) for st, v in vals if v is not None]
            if not vals:
                continue
            if len(vals) < MIN_SIBLINGS:
                too_few.add(r)
                continue
            tests.append((m, r, qtype, vals))
    limit = threshold(sum(len(v) for *_, v in tests))
    found = []
    for m, r, qtype, vals in tests:
        xs = [math.log2(v) if m.kind == "log2" else v for _, (v, _) in vals]
        center, spread = _spread(m, xs, [n for _, (_, n) in vals])
        for (st, _), x in zip(vals, xs):
            z = abs(x - center) / spread
            if z > limit:
                found.append({"tensor": st.name, "metric": m.key, "value": x, "siblings_median": center,
                              "spread": spread, "robust_z": z, "limit": limit, "siblings": len(vals) - 1,
                              "qtype": st.qtype, "role": r,
                              "words": f"{st.name}: {_fmt(m, x)} {m.words}; its {len(vals) - 1} siblings"
                                       f"{' of type ' + qtype if qtype else ''}: {_fmt(m, center)} (median), "
                                       f"{z:.0f} spreads out (limit {limit:.1f})"})
    roles = {r for _, r, _, _ in tests}
    return found, {"roles_compared": len(roles), "tests": sum(len(v) for *_, v in tests), "limit": limit,
                   "roles_too_few_siblings": sorted(too_few - roles)}


IMATRIX_KEYS = "quantize.imatrix."  # llama-quantize records the importance matrix it used under these keys


def _imatrix_recorded(file: str | Path) -> bool:
    """Whether the file's metadata says an importance matrix was used (False where there is no file)."""
    if not file or not Path(file).is_file():
        return False
    from ...gguf import open_gguf

    with open_gguf(file) as g:
        return any(k.startswith(IMATRIX_KEYS) for k in g.fields)


def subblock_rules(stats: list[TensorStats], file: str | Path = "") -> dict[str, Any]:
    """Decide, for the code families pinned only without an importance matrix (Q2_K, Q4_K, Q5_K), whether
    the exact rule holds in this file, and write each family's rule ("exact" or "siblings") into its
    tensor's summary. Not exact when the metadata records an importance matrix, or when the file bears
    its mark without the record (the library call llama_model_quantize writes none): more than half of
    at least MIN_SIBLINGS such tensors with blocks off the end. Damage that reaches most tensors of a
    file is then compared among siblings instead; corruption of a few tensors leaves the majority exact."""
    partial = [st for st in stats if st.subblocks and not all(
        f.every_path for f in SUBBLOCKS[QT[st.qtype]].families)]
    off = sum(any(st.subblocks[f.name]["off_blocks"] for f in SUBBLOCKS[QT[st.qtype]].families) for st in partial)
    # the metadata is read only when it matters (some block off the end): a clean file is not reopened
    recorded = _imatrix_recorded(file) if off else None
    marked = len(partial) >= MIN_SIBLINGS and off > len(partial) / 2
    exact = not (recorded or marked)
    for st in stats:
        for f in SUBBLOCKS[QT[st.qtype]].families if st.subblocks else ():
            st.subblocks[f.name]["rule"] = "exact" if f.every_path or exact else "siblings"
    return {"tensors": sum(1 for st in stats if st.subblocks), "partial_rule_exact": exact,
            "imatrix_recorded": recorded, "partial_tensors_off": off, "partial_tensors": len(partial)}


def _subblock_finding(st: TensorStats, file: str | Path) -> Finding | None:
    """A fail finding for a tensor whose blocks break an exact sub-block rule, else None."""
    sb = st.subblocks
    bad = [(n, v) for n, v in sb.items() if isinstance(v, dict) and v.get("rule") == "exact" and v["off_blocks"]]
    if not bad:
        return None
    words = []
    for name, v in bad:
        end = " or ".join(str(c) for c in v["pinned"])
        words.append(f"{v['off_blocks']} of {sb['blocks']} {st.qtype} blocks have their {v['reduce']} sub-block "
                     f"{name[:-1]} code off {end} (first: block {v['first_off_block']}, {v['reduce']} "
                     f"{v['first_off_code']})")
    return Finding(CHECK, "gguf", st.name, "fail", id=f"{CHECK}/subblocks/{st.name}",
                   hypothesis=SUBBLOCK_HYPOTHESIS, confidence="high",
                   metrics={"subblocks": sb, "off_blocks": sum(v["off_blocks"] for _, v in bad)},
                   budget={"off_blocks_max": 0},
                   explanation=f"{st.name}: " + "; ".join(words) + ": llama.cpp's quantizer puts the block's "
                               "extreme sub-block there in every block it writes, so sub-block scale bytes "
                               "were changed after quantization",
                   evidence=[{"tensor": st.name, "file": str(file), "family": n, **{k: v[k] for k in (
                       "first_off_block", "first_off_code", "extreme_codes")}} for n, v in bad])


def _subblock_words(rules: dict[str, Any]) -> str:
    if not rules["tensors"]:
        return ""
    how = "" if rules["partial_rule_exact"] else \
        " (Q2_K/Q4_K/Q5_K compared among siblings: " + ("the metadata records an importance matrix)"
                                                        if rules["imatrix_recorded"] else
                                                        "most of their tensors bear an importance matrix's mark)")
    return f"{rules['tensors']} K-quant tensors' sub-block codes end where llama.cpp's quantizer puts them{how}; "


SUBBLOCK_HYPOTHESIS = "every K-quant block's sub-block codes end where llama.cpp's quantizer puts them"


def compare(stats: list[TensorStats], *, file: str | Path = "") -> list[Finding]:
    """The findings: one per tensor with non-finite scales or weights, one per tensor whose K-quant
    sub-block codes break an exact rule, one per sibling outlier tensor (its worst metrics side by
    side with its siblings'), then one pass or skip summary."""
    out: list[Finding] = []
    rules = subblock_rules(stats, file)
    for st in stats:
        bad_scales = {f: s["nonfinite"] for f, s in st.scales.items() if s["nonfinite"]}
        if st.nonfinite or bad_scales:
            what = [f"{round(v * st.scales[f]['blocks'])} non-finite block scale(s) {f}" for f, v in bad_scales.items()]
            if st.nonfinite:
                what.append(f"{st.nonfinite} non-finite weights (first in block {st.first_nonfinite_block})")
            out.append(Finding(CHECK, "gguf", st.name, "fail", metrics=st.as_dict(), hypothesis=HYPOTHESIS,
                               explanation=f"{st.name}: " + ", ".join(what) + ": the tensor is corrupted",
                               evidence=[{"tensor": st.name, "file": str(file)}]))
    out += [f for f in (_subblock_finding(st, file) for st in stats) if f is not None]
    found, summary = outliers(stats)
    summary["subblocks"] = rules
    by_tensor: dict[str, list[dict]] = defaultdict(list)
    for o in found:
        by_tensor[o["tensor"]].append(o)
    for name, rows in by_tensor.items():
        rows.sort(key=lambda o: -o["robust_z"])
        out.append(Finding(CHECK, "gguf", name, "fail", hypothesis=HYPOTHESIS,
                           metrics={"outliers": rows, "worst_metric": rows[0]["metric"], "robust_z": rows[0]["robust_z"]},
                           budget={"robust_z_max": summary["limit"]},
                           explanation="; ".join(o["words"] for o in rows[:2]) +
                                       ": it stands out from its role siblings (changed after quantization?)",
                           evidence=rows))
    if not out:
        n = summary["roles_compared"]
        if n == 0:
            out.append(Finding(CHECK, "gguf", "siblings", "skip", hypothesis=HYPOTHESIS,
                               reason=f"no tensor role has {MIN_SIBLINGS} or more layers to compare "
                                      f"(only the absolute rules ran: {len(stats)} tensors finite; "
                                      f"{_subblock_words(rules).rstrip('; ') or 'no K-quant tensor'})",
                               metrics=summary))
        else:
            out.append(Finding(CHECK, "gguf", "siblings", "pass", hypothesis=HYPOTHESIS, metrics=summary,
                               budget={"robust_z_max": summary["limit"]},
                               explanation=f"{len(stats)} tensors finite; {_subblock_words(rules)}"
                                           f"{summary['tests']} statistics in {n} roles within "
                                           f"{summary['limit']:.1f} robust spreads of their siblings"))
    return out


HYPOTHESIS = "every tensor's block scales and weights look like its role siblings'"


def analyze(path: str | Path, weights: Any = None) -> tuple[list[Finding], list[TensorStats]]:
    """Every tensor of the file: statistics and findings. `weights`: an optional cache with
    has(name) / get(name) of already dequantized tensors (the reference's), reused."""
    from ...gguf import open_gguf

    with open_gguf(path) as g:
        stats = [tensor_stats(t, weights.get(t.name) if weights is not None and weights.has(t.name) else None)
                 for t in g.tensors if t.supported]
    return compare(stats, file=path), stats

