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
whose d and dmin were exchanged (dmin/d ratio, mean/RMS, RMS). What they cannot see: two layers'
tensors exchanged, or one tensor's rows permuted; every statistic here is invariant under both (a
tensor's statistics move with it; a permutation of rows keeps every value). Those need a second copy:
`diff`, `--manifest`, or `--hf`.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from .base import Finding

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


def scale_values(blocks: np.ndarray, f: ScaleField) -> np.ndarray:
    """float32 [n]: field `f` of each block of uint8 blocks [n, type_size]."""
    if f.encoding == "e8m0":
        e = blocks[:, f.offset].astype(np.int32)
        return np.where(e == 255, np.float32(np.nan), np.ldexp(np.float32(1), e - 127)).astype(np.float32)
    return np.ascontiguousarray(blocks[:, f.offset:f.offset + 2]).view("<f2")[:, 0].astype(np.float32)


# ---- per-tensor statistics (streaming) ----------------------------------------------------------

F16_MIN_NORMAL = 2.0 ** -14  # IEEE binary16: smaller nonzero magnitudes are subnormal
HUGE_BINADES = 8  # "huge": a scale more than 2^8 times the tensor's median |scale| (see ScaleStats)
BIN = 1 / 16  # the exponent histogram's bin, in binades (quantiles are exact to 1/16 binade)
_LO, _HI = -40, 40  # binades covered; scales outside are counted in the end bins


@dataclass
class ScaleStats:
    """Distribution of one scale field over a tensor's blocks, streamed: counts and a histogram of
    log2 |s| in 1/16-binade bins (quantiles and the median from it), and the mean jump of log2 |s|
    between adjacent blocks (`jitter`: neighbours in a row see similar weights, so their scales are
    close; the demo's tensors jump 0.19..0.95 binades on average). `huge` counts scales more than
    2^HUGE_BINADES times the tensor's median |scale|: a block 8 binades above its tensor's typical
    block has weights ~256x larger than its neighbours', which trained weights do not produce but a
    flipped exponent bit does."""

    n: int = 0
    negative: int = 0
    zero: int = 0
    subnormal: int = 0
    nonfinite: int = 0
    hist: np.ndarray = field(default_factory=lambda: np.zeros(int((_HI - _LO) / BIN) + 1, np.int64))
    jump_sum: float = 0.0  # sum over adjacent blocks (file order) of |log2 |s_i| - log2 |s_i+1||
    jumps: int = 0
    _last: float = math.nan  # log2 |s| of the previous chunk's last block (NaN: none, zero or non-finite)

    def add(self, s: np.ndarray) -> None:
        a = np.abs(s)
        finite = np.isfinite(s)
        self.n += s.size
        self.negative += int((s < 0).sum())
        self.zero += int((s == 0).sum())
        self.subnormal += int(((a > 0) & (a < F16_MIN_NORMAL)).sum())
        self.nonfinite += int((~finite).sum())
        ok = finite & (a > 0)
        lg = np.log2(np.where(ok, a, 1.0))
        i = np.clip(np.floor((lg[ok] - _LO) / BIN), 0, len(self.hist) - 1).astype(np.int64)
        self.hist += np.bincount(i, minlength=len(self.hist))
        lg = np.where(ok, lg, np.nan)
        steps = np.abs(np.diff(np.concatenate(([self._last], lg))))
        steps = steps[np.isfinite(steps)]
        self.jump_sum += float(steps.sum())
        self.jumps += steps.size
        self._last = float(lg[-1]) if lg.size else self._last

    def _binade(self, i: int) -> float:
        return _LO + (i + 0.5) * BIN  # the bin's center

    def summary(self) -> dict[str, Any]:
        n = max(self.n, 1)
        nz = int(self.hist.sum())
        out: dict[str, Any] = {"blocks": self.n, "negative": self.negative / n, "zero": self.zero / n,
                               "subnormal": self.subnormal / n, "nonfinite": self.nonfinite / n}
        if nz:
            cdf = np.cumsum(self.hist) / nz
            q = {p: int(np.searchsorted(cdf, p)) for p in (0.01, 0.5, 0.99)}
            used = np.flatnonzero(self.hist)
            out.update(log2_min=self._binade(used[0]), log2_max=self._binade(used[-1]),
                       log2_p01=self._binade(q[0.01]), log2_median=self._binade(q[0.5]),
                       log2_p99=self._binade(q[0.99]),
                       huge=float(self.hist[q[0.5] + int(HUGE_BINADES / BIN) + 1:].sum()) / n)
        if self.jumps:
            out["jitter"] = self.jump_sum / self.jumps
        return out


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

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("name", "qtype", "n_values", "nonfinite", "rms", "mean", "max_abs",
                                              "kurtosis", "scales", "first_nonfinite_block")}


class Accumulator:
    """Gathers one tensor's statistics chunk by chunk, in file order (float64 sums of the values)."""

    def __init__(self, name: str, qtype: QT | int):
        self.name, self.qtype = name, QT(qtype)
        self.fields = SCALE_FIELDS.get(self.qtype, ())
        self.scales = {f.name: ScaleStats() for f in self.fields}
        self._m = np.zeros(4)  # sums of w, w^2, w^3, w^4 (finite values)
        self.n = self.nonfinite = 0
        self.max_abs = 0.0
        self._blocks_seen = 0
        self.first_nonfinite_block: int | None = None

    def add(self, blocks: np.ndarray | None, values: torch.Tensor | np.ndarray) -> None:
        """One chunk: its raw blocks (uint8 [n, type_size]; None for float types) and its dequantized
        values (float32, n * block_size of them, in block order)."""
        if blocks is not None:
            for f in self.fields:
                self.scales[f.name].add(scale_values(blocks, f))
        # numpy, single-threaded: torch's intra-op threads spin for ~1M-element reductions on a busy host
        v = (values.detach().to("cpu", torch.float32).numpy() if isinstance(values, torch.Tensor)
             else np.asarray(values, dtype=np.float32)).reshape(-1)
        finite = np.isfinite(v)
        bad = v.size - int(np.count_nonzero(finite))
        bs = GGML_QUANT_SIZES[self.qtype][0]
        if bad and self.first_nonfinite_block is None:
            self.first_nonfinite_block = self._blocks_seen + int(np.argmin(finite)) // bs
        self._blocks_seen += v.size // bs
        w = v[finite] if bad else v
        if w.size:
            self.max_abs = max(self.max_abs, float(np.abs(w).max()))
        if self.max_abs > 1e9:  # w^4 would overflow float32
            w = w.astype(np.float64)
        w2 = w * w  # float32 powers (relative error 1e-7 each), summed in float64
        self._m += [float(w.sum(dtype=np.float64)), float(w2.sum(dtype=np.float64)),
                    float((w2 * w).sum(dtype=np.float64)), float((w2 * w2).sum(dtype=np.float64))]
        self.n += v.size
        self.nonfinite += bad

    def finish(self) -> TensorStats:
        k = max(self.n - self.nonfinite, 1)
        e1, e2, e3, e4 = self._m / k
        var = max(e2 - e1 * e1, 0.0)
        c4 = e4 - 4 * e1 * e3 + 6 * e1 * e1 * e2 - 3 * e1 ** 4
        summaries = {n: s.summary() for n, s in self.scales.items()}
        return TensorStats(self.name, self.qtype.name, self.n, self.nonfinite, math.sqrt(max(e2, 0.0)), e1,
                           self.max_abs, c4 / (var * var) if var > 0 else math.nan, summaries,
                           {n: s["log2_median"] for n, s in summaries.items() if "log2_median" in s},
                           self.first_nonfinite_block)


CHUNK_VALUES = 1 << 20  # values per chunk: float64 temporaries of 8 MiB


def tensor_stats(t: Any, values: torch.Tensor | None = None) -> TensorStats:
    """Statistics of a whole tensor (a reader TensorInfo), chunk by chunk; `values` when already
    dequantized (float32, any shape, block order)."""
    from ..gguf import dequantize

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


def compare(stats: list[TensorStats], *, file: str | Path = "") -> list[Finding]:
    """The findings: one per tensor with non-finite scales or weights, one per sibling outlier tensor
    (its worst metrics side by side with its siblings'), then one pass or skip summary."""
    out: list[Finding] = []
    for st in stats:
        bad_scales = {f: s["nonfinite"] for f, s in st.scales.items() if s["nonfinite"]}
        if st.nonfinite or bad_scales:
            what = [f"{round(v * st.scales[f]['blocks'])} non-finite block scale(s) {f}" for f, v in bad_scales.items()]
            if st.nonfinite:
                what.append(f"{st.nonfinite} non-finite weights (first in block {st.first_nonfinite_block})")
            out.append(Finding(CHECK, "gguf", st.name, "fail", metrics=st.as_dict(), hypothesis=HYPOTHESIS,
                               explanation=f"{st.name}: " + ", ".join(what) + ": the tensor is corrupted",
                               evidence=[{"tensor": st.name, "file": str(file)}]))
    found, summary = outliers(stats)
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
                                      f"(only the absolute rules ran: {len(stats)} tensors finite)",
                               metrics=summary))
        else:
            out.append(Finding(CHECK, "gguf", "siblings", "pass", hypothesis=HYPOTHESIS, metrics=summary,
                               budget={"robust_z_max": summary["limit"]},
                               explanation=f"{len(stats)} tensors finite; {summary['tests']} statistics in {n} "
                                           f"roles within {summary['limit']:.1f} robust spreads of their siblings"))
    return out


HYPOTHESIS = "every tensor's block scales and weights look like its role siblings'"


def analyze(path: str | Path, weights: Any = None) -> tuple[list[Finding], list[TensorStats]]:
    """Every tensor of the file: statistics and findings. `weights`: an optional cache with
    has(name) / get(name) of already dequantized tensors (the reference's), reused."""
    from ..gguf import open_gguf

    with open_gguf(path) as g:
        stats = [tensor_stats(t, weights.get(t.name) if weights is not None and weights.has(t.name) else None)
                 for t in g.tensors if t.supported]
    return compare(stats, file=path), stats

