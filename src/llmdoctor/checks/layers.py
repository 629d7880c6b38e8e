"""Layer localization: where does an engine's computation leave the reference?

For every layer i and capture point p, three activations of the same prompt are compared:

    ref[p-i]     the reference in float32 (or float64)
    budget[p-i]  the reference run with the engine's arithmetic emulated (reference/emulate.py):
                 a healthy engine is as far from `ref` as this run is, give or take
    engine[p-i]  what the engine computed

error = rel_l2(engine, ref) and noise = rel_l2(budget, ref). A healthy engine and the emulation are
two independent draws of the same rounding noise, so their errors are of the same size: on the demo
model in llama.cpp the ratio error/noise stays within 0.85..1.3 over all 18 layers (measured,
tests/test_layers_llama_cpp.py). A point is *divergent* when error > K * noise + FLOOR, with K = 3
(more than twice the largest healthy ratio seen) and FLOOR = 1e-6 (float32 round-off of a
normalized activation, so that a bit-exact budget of 0 does not turn noise into an alarm).

The first divergent layer is the first layer with a divergent point whose divergence persists
(the next layer is divergent too, or it is the last layer): a fault propagates down the residual
stream, a one-off excursion that heals is reported but not named as the cause.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from . import metrics

K = 3.0
FLOOR = 1e-6
# Points compared per layer, in graph order.
POINTS = ("attn_norm", "kqv_out", "ffn_inp", "ffn_out", "l_out")
# Engine node names that differ from the reference's capture names (llama.cpp graph builders).
LLAMA_CPP_ALIASES = {"sa_out": "ffn_inp"}


def engine_names_to_reference(captures: Mapping[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """Rename engine nodes `alias-i` to the reference's `name-i`; other names pass through."""
    out = {}
    for name, value in captures.items():
        base, sep, idx = name.rpartition("-")
        out[f"{aliases.get(base, base)}{sep}{idx}" if sep and base in aliases else name] = value
    return out


@dataclass
class PointError:
    layer: int
    point: str
    error: float  # rel_l2(engine, ref)
    noise: float  # rel_l2(budget, ref)

    @property
    def limit(self) -> float:
        return K * self.noise + FLOOR

    @property
    def divergent(self) -> bool:
        # a non-finite error (inf/NaN in the engine where the reference is finite) always diverges,
        # even when the emulated run overflows too: the budget explains noise, not a blow-up
        return not (math.isfinite(self.error) and self.error <= self.limit)

    def as_dict(self) -> dict:
        return {"layer": self.layer, "point": self.point, "error": self.error, "noise": self.noise,
                "limit": self.limit, "divergent": self.divergent}


def error_curve(ref: Mapping[str, Any], budget: Mapping[str, Any], engine: Mapping[str, Any],
                n_layer: int, points: tuple[str, ...] = POINTS) -> list[PointError]:
    """Every (layer, point) present in all three captures, in graph order."""
    curve = []
    for il in range(n_layer):
        for p in points:
            name = f"{p}-{il}"
            if name in ref and name in budget and name in engine:
                curve.append(PointError(il, p, metrics.rel_l2(engine[name], ref[name]),
                                        metrics.rel_l2(budget[name], ref[name])))
    return curve


def first_divergent_layer(curve: list[PointError]) -> tuple[int | None, PointError | None]:
    """(layer, first divergent point) of the first persistently divergent layer, or (None, None)."""
    layers = sorted({p.layer for p in curve})
    bad = {p.layer for p in curve if p.divergent}
    for i, il in enumerate(layers):
        if il in bad and (i + 1 == len(layers) or layers[i + 1] in bad):
            return il, next(p for p in curve if p.layer == il and p.divergent)
    return None, None


def routing_disagreement(want: Any, got: Any) -> float:
    """Fraction of positions whose chosen expert SET differs (order within top-k is irrelevant).
    want, got: int [T, k]."""
    import numpy as np

    a = np.sort(np.asarray(want, dtype=np.int64), -1)
    b = np.sort(np.asarray(got, dtype=np.int64), -1)
    if a.shape != b.shape:
        return 1.0
    return float((a != b).any(-1).mean()) if a.size else 0.0


def selection_disagreement(scores: Any, selected: Any, top_k: int, rel_tol: float = 1e-5) -> float:
    """Fraction of queries whose selection is not a top-k set of the reference's own scores. A row
    agrees when its distinct, in-range, visible picks are min(k, visible keys) many, include every
    visible key scoring above the k-th best and none scoring below it (by more than `rel_tol` of the
    row's largest |score|): keys tied with the k-th best (ReLU index scores are often exactly 0) may be
    picked either way. Duplicates, padding indices, future keys and short rows therefore disagree.
    scores: float [T, S] (the reference's index scores, -inf where not visible); selected: int [T, k']."""
    import numpy as np

    sc = np.asarray(scores, dtype=np.float64)
    sel = np.asarray(selected, dtype=np.int64)
    t_n, s_n = sc.shape
    k = min(top_k, s_n)
    if sel.ndim != 2 or sel.shape[0] != t_n or sel.shape[1] != k:
        return 1.0
    finite = np.where(np.isfinite(sc), sc, -np.inf)
    n_visible = np.isfinite(finite).sum(axis=1)  # [T]
    kth = -np.sort(-finite, axis=1)[:, k - 1]  # [T]: the k-th best visible score (-inf if fewer)
    tol = rel_tol * np.max(np.abs(np.where(np.isfinite(sc), sc, 0.0)), axis=1)  # [T]
    bad = np.zeros(t_n, dtype=bool)
    for t in range(t_n):
        picks = {int(j) for j in sel[t] if 0 <= j < s_n and np.isfinite(finite[t, j])}
        if len(picks) != min(k, int(n_visible[t])):
            bad[t] = True
            continue
        above = np.nonzero(finite[t] > kth[t] + tol[t])[0]
        bad[t] = any(int(j) not in picks for j in above) or any(finite[t, j] < kth[t] - tol[t] for j in picks)
    return float(bad.mean()) if t_n else 0.0


def routing_limit(noise: float, n_positions: int) -> float:
    """Most disagreement a healthy engine shows: its own arithmetic flips near-tied routing decisions
    as often as the emulated run does (`noise`), give or take three binomial standard errors (with
    at least one flip's worth of rate, so a noiseless emulation does not demand perfection)."""
    p = max(noise, 1.0 / max(n_positions, 1))
    return noise + 3 * math.sqrt(p * (1 - p) / max(n_positions, 1))
