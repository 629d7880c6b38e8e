"""The sibling-outlier comparison of weight forensics: each tensor's statistics against its role siblings'
(blk.N.attn_output against every other blk.M.attn_output): a robust z of each metric from the siblings'
median and MAD, with a floor under the spread and a Bonferroni limit over every test."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

from .block_scales import HUGE_BINADES
from .tensor_stats import TensorStats

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

