"""Block-scale statistics of weight forensics: where each quant type keeps its per-block scales (d, dmin,
m; gguf/block_layout.py), their codes decoded, and the streamed distribution of one scale field over a
tensor's blocks (signs, zeros, subnormals, non-finite, a 1/16-binade histogram of log2 |s|, the jitter of
adjacent blocks)."""

from __future__ import annotations

import ctypes
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from ...gguf.block_layout import BLOCKS, Field
from . import forensics_native as fx_native  # its NATIVE read at each call: tests switch it off

# ---- where the block scales live ----------------------------------------------------------------


def _fields(qtype: QT) -> tuple[Field, ...]:
    """The scalar scale fields of `qtype`'s block in byte order (gguf/block_layout.py): "d" (the block or
    super-block scale; MXFP4's E8M0 exponent e too), "dmin" (K-quant minimum scale), "m" (legacy
    minimum). Empty for float types, IQ1_M (its scale is spread over the sub-block scales) and NVFP4 (four
    UE4M3 scales)."""
    lay = BLOCKS.get(qtype)
    if lay is None:
        return ()
    return tuple(dataclasses.replace(f, name="d") if f.name == "e" else f for f in lay.fields if f.encoding)


SCALE_FIELDS: dict[QT, tuple[Field, ...]] = {q: _fields(q) for q in QT if q in GGML_QUANT_SIZES}


def scale_codes(blocks: np.ndarray, f: Field) -> np.ndarray:
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


def scale_values(blocks: np.ndarray, f: Field) -> np.ndarray:
    """float32 [n]: field `f` of each block of uint8 blocks [n, type_size]."""
    return decode_codes(scale_codes(blocks, f), f.encoding)


# ---- one scale field's distribution over a tensor (streamed) -------------------------------------

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
CODE_TABLES = {e: _CodeTable.build(e) for e in ("f16", "e8m0")}


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

    def add_blocks(self, blocks: np.ndarray, f: Field) -> None:
        """Field `f` of consecutive raw blocks (uint8 [n, type_size]): float16 fields in C where it is
        built (no copy of the codes; the jumps added in block order, not numpy's pairwise order: the
        same sum to ~1e-16 relative), else add(scale_codes(...))."""
        if fx_native.NATIVE is None or f.encoding != "f16" or not blocks.flags.c_contiguous:
            self.add(scale_codes(blocks, f))
            return
        if not blocks.shape[0]:
            return
        if self.counts is None:
            self.counts = np.zeros(65536, np.int64)
        lg = CODE_TABLES["f16"].lg
        state = (ctypes.c_double * 3)(math.nan, 0.0, 0.0)
        fx_native.NATIVE.llmd_fx_codes16(blocks.ctypes.data + f.offset, blocks.shape[0], blocks.shape[1],
                                         lg.ctypes.data, self.counts.ctypes.data, state)
        first = float(lg[int(blocks[0, f.offset]) | int(blocks[0, f.offset + 1]) << 8])
        self.pieces.append((first, state[0], state[1], int(state[2])))

    def add_pieces(self, blocks: np.ndarray, f: Field, piece_blocks: int) -> None:
        """add_blocks of each piece of piece_blocks consecutive blocks in turn (uint8 [n, type_size],
        C-contiguous, the native library built): one native call for a float16 field."""
        n_blocks = blocks.shape[0]
        if f.encoding != "f16":
            for b0 in range(0, n_blocks, piece_blocks):
                self.add(scale_codes(blocks[b0:b0 + piece_blocks], f))
            return
        if self.counts is None:
            self.counts = np.zeros(65536, np.int64)
        res = np.empty((-(-n_blocks // piece_blocks), 4))
        fx_native.NATIVE.llmd_fx_codes16_pieces(blocks.ctypes.data + f.offset, n_blocks, blocks.shape[1],
                                                CODE_TABLES["f16"].lg.ctypes.data, self.counts.ctypes.data,
                                                piece_blocks, res.ctypes.data)
        self.pieces += [(a, b, c, int(d)) for a, b, c, d in res.tolist()]

    def add(self, codes: np.ndarray) -> None:
        """codes: the field's raw codes of consecutive blocks (scale_codes)."""
        if not codes.size:
            return
        tab = CODE_TABLES[self.encoding]
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
        tab = CODE_TABLES[self.encoding]
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

