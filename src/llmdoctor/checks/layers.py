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

The next-token distributions (`distribution_criteria`, diagnose's engine-vs-reference) are judged by
the same noise model: each criterion compares the engine with the reference against what the
emulated run's own arithmetic explains, scaled by the same K.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

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


def routing_tolerance(ref_scores: Any, emu_scores: Any) -> float:
    """How far apart two experts' selection scores may be and still swap places in a healthy engine: the
    emulated run's largest score error (its arithmetic on the same routing), counted for both experts
    of a comparison, times the layer budget's K, plus a few float32 roundings of the largest score."""
    import numpy as np

    ref, emu = np.asarray(ref_scores, dtype=np.float64), np.asarray(emu_scores, dtype=np.float64)
    d = float(np.max(np.abs(emu - ref))) if ref.size else 0.0
    return K * 2 * d + 8 * 2.0**-24 * float(np.max(np.abs(ref), initial=0.0))


def routing_inadmissible(scores: Any, chosen: Any, k: int, tol: float, n_group: int = 1,
                         topk_group: int = 1) -> Any:
    """bool [T]: positions whose chosen experts are no top-k choice the reference's selection scores
    allow within `tol` (routing_tolerance). Ungrouped: every chosen expert scores at least the best
    unchosen one minus tol. Grouped (DeepSeek-V3's n_group / topk_group): the chosen experts' groups,
    filled up with the best other groups, are a top-topk_group set of group scores within 2 tol (a group
    score sums two experts', reference/arch_deepseek.group_scores), and the experts are a top-k set within
    those groups. Duplicates, out-of-range ids and a wrong count are inadmissible.
    scores: float [T, E]; chosen: int [T, k]."""
    import numpy as np
    import torch

    from ..reference.arch_deepseek import group_scores

    sc = np.asarray(scores, dtype=np.float64)
    sel = np.asarray(chosen, dtype=np.int64)
    t_n, e_n = sc.shape
    if sel.ndim != 2 or sel.shape != (t_n, k):
        return np.ones(t_n, dtype=bool)
    grouped = n_group > 1 and e_n % n_group == 0
    gs = group_scores(torch.from_numpy(sc), n_group).numpy() if grouped else None  # [T, G]
    per = e_n // n_group if grouped else e_n
    bad = np.zeros(t_n, dtype=bool)
    for t in range(t_n):
        picks = {int(j) for j in sel[t]}
        if len(picks) != k or not all(0 <= j < e_n for j in picks):
            bad[t] = True
            continue
        pool = np.arange(e_n)
        if grouped:
            mine = {j // per for j in picks}
            rest = [g for g in np.argsort(-gs[t], kind="stable") if g not in mine]
            keep = sorted(mine | set(rest[: max(topk_group - len(mine), 0)]))
            out = [g for g in range(n_group) if g not in keep]
            if len(mine) > topk_group or (out and gs[t, keep].min() < gs[t, out].max() - 2 * tol):
                bad[t] = True
                continue
            pool = np.concatenate([np.arange(g * per, (g + 1) * per) for g in keep])
        unchosen = [j for j in pool if j not in picks]
        bad[t] = bool(unchosen) and sc[t, sorted(picks)].min() < sc[t, unchosen].max() - tol
    return bad


def routing_limit(noise: float, n_positions: int) -> float:
    """Most disagreement a healthy engine shows in a discrete choice (the DSA indexer's key selections):
    its own arithmetic flips near-tied decisions as often as the emulated run does (`noise`), give or
    take three binomial standard errors (with at least one flip's worth of rate, so a noiseless
    emulation does not demand perfection)."""
    p = max(noise, 1.0 / max(n_positions, 1))
    return noise + 3 * math.sqrt(p * (1 - p) / max(n_positions, 1))


# ---- the next-token distributions ---------------------------------------------------------------

@dataclass
class Criterion:
    """One criterion of the engine-vs-reference comparison: `value` against `limit`, and why."""

    name: str
    value: float
    limit: float
    noise: float  # the emulated run's own value of the same measure
    ok: bool
    reason: str  # one line: what was measured, against which budget
    evidence: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"criterion": self.name, "value": self.value, "limit": self.limit, "noise": self.noise,
                "ok": self.ok, "reason": self.reason, "evidence": self.evidence}


def distribution_criteria(engine: Any, ref: Any, budget: Any, tokens: list[int] | None = None) -> list[Criterion]:
    """The engine's next-token distributions against the reference's, every criterion noise-aware.
    engine, ref, budget: logits [T, V] (budget: the reference run with the engine's arithmetic).

    - finite: no inf/NaN logit where the reference is finite (no rounding noise explains one). The
      other criteria judge the finite positions only (a KL over NaN is NaN, which says nothing).
    - kl: mean KL(ref || engine) <= K · mean KL(ref || budget) + FLOOR.
    - top1: the engine's top-1 token may differ from the reference's only where the reference's own
      preference between the two (its logit margin, metrics.top1_margin) is within the engine's noise
      at that position: K times the emulated run's RMS error on the difference of two logits there
      (metrics.logit_pair_noise), plus FLOOR relative to the logits' own spread (float32 round-off, for
      a bit-exact emulation). A flip beyond that is a disagreement; the engine may have as many as the
      emulated run itself has beyond the same bound (usually none). Measured on the demo model in
      llama.cpp, healthy and with blk.3.attn_output's d/dmin exchanged or its block scales noised (the
      engine loading the same file): the engine's error on the reference's top-1/top-2 difference is
      at most 1.9x that noise over 3 x 54 positions, as the layer errors are at most 1.3x theirs.
    """
    got, want, emu = (torch.as_tensor(x).to(torch.float64) for x in (engine, ref, budget))
    n = got.shape[0]
    nonfinite = (~torch.isfinite(got) & torch.isfinite(want)).any(-1)  # [T]
    bad = nonfinite.nonzero().flatten().tolist()
    emu_bad = float((~torch.isfinite(emu) & torch.isfinite(want)).any(-1).sum())
    out = [Criterion("finite", float(len(bad)), 0.0, emu_bad, not bad,
                     f"{len(bad)} of {n} positions have inf/NaN logits where the reference is finite"
                     if bad else "every logit is finite", [{"position": t} for t in bad[:5]])]
    keep = (~nonfinite).nonzero().flatten()  # [T']: the positions the other criteria judge
    if not len(keep):
        return out
    got, want, emu = got[keep], want[keep], emu[keep]
    position = keep.tolist()  # index among the judged -> position
    kl, kl_noise = metrics.kl_divergence(got, want), metrics.kl_divergence(emu, want)  # [T']
    kl_limit = K * float(kl_noise.mean()) + FLOOR
    kl_mean = float(kl.mean())
    worst = int(kl.argmax())
    out.append(Criterion("kl", kl_mean, kl_limit, float(kl_noise.mean()), kl_mean <= kl_limit,
                         f"KL {kl_mean:.3g} against the engine's noise {float(kl_noise.mean()):.3g} "
                         f"(limit {K:g}x + {FLOOR:g} = {kl_limit:.3g})" + (f" over {len(keep)} finite positions"
                                                                           if bad else ""),
                         [{"position": position[worst], "kl": float(kl[worst]), "kl_noise": float(kl_noise[worst])}]))
    spread = metrics.logit_pair_noise(torch.zeros_like(want), want)  # [T']: sqrt(2)·std of the logits
    bound = K * metrics.logit_pair_noise(emu, want) + FLOOR * spread  # [T']
    margin, emu_margin = metrics.top1_margin(got, want), metrics.top1_margin(emu, want)  # [T']
    flipped = (margin > 0).nonzero().flatten().tolist()
    beyond = [i for i in flipped if not margin[i] <= bound[i]]
    allowed = int((~(emu_margin <= bound) & (emu_margin > 0)).sum())
    g_top, w_top = got.argmax(-1), want.argmax(-1)
    rows = [{"position": position[i], "reference_top1": int(w_top[i]), "engine_top1": int(g_top[i]),
             "reference_margin": float(margin[i]), "noise_bound": float(bound[i]), "beyond_noise": i in beyond}
            for i in flipped]
    if tokens is not None:
        for r in rows:
            r["context_token"] = int(tokens[r["position"]])
    first = (f": at position {position[beyond[0]]} the reference prefers its token by {float(margin[beyond[0]]):.3g} "
             f"where the noise explains {float(bound[beyond[0]]):.3g}") if beyond else ""
    out.append(Criterion(
        "top1", float(len(beyond)), float(allowed), float(allowed), len(beyond) <= allowed,
        f"{len(flipped)} of {len(keep)} top-1 flips, {len(beyond)} beyond the engine's noise (the emulated run has "
        f"{allowed}){first}", sorted(rows, key=lambda r: -r["reference_margin"] / r["noise_bound"])[:5]))
    return out
