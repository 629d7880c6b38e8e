"""Layer localization: where does an engine's computation leave the reference?

For every layer i and capture point p, three activations of the same prompt are compared:

    ref[p-i]     the reference in float32 (or float64)
    budget[p-i]  the reference run with the engine's arithmetic emulated (reference/emulate.py):
                 a healthy engine is as far from `ref` as this run is, give or take
    engine[p-i]  what the engine computed

error = rel_l2(engine, ref) and noise = rel_l2(budget, ref). A healthy engine and the emulation are
two independent draws of the same rounding noise, so their errors are of the same size: on the demo
model in llama.cpp the ratio error/noise stays within 0.85..1.3 over all 18 layers (measured,
tests/checks/compute/test_layers_llama_cpp.py). A point is *divergent* when error > K * noise + FLOOR, with K = 3
(more than twice the largest healthy ratio seen) and FLOOR = 1e-6 (float32 round-off of a
normalized activation, so that a bit-exact budget of 0 does not turn noise into an alarm).

The first divergent layer is the first layer with a divergent point whose divergence persists
(the next layer is divergent too, or it is the last layer): a fault propagates down the residual
stream, a one-off excursion that heals is reported but not named as the cause.

The next-token distributions (`distribution_criteria`, diagnose's engine-vs-reference) are judged by
the same noise model: each criterion compares the engine with the reference against what the
emulated run's own arithmetic explains, scaled by the same K.

With several randomized draws of the engine's arithmetic (reference/draws.py; `draws`), every point and
criterion is judged instead against its own spread over the draws, with the threshold set for the whole
diagnosis (checks/compute/allowance.py): a point's noise is the draws' RMS error there and its multiplier
the family's (K_MODEL = K where the draws agree); the distributions gain a per-position KL criterion, and a
top-1 flip is judged against that token pair's spread. Each verdict carries its ratio to the allowance and
a marginal flag (within 2x either way). The decode steps and the configured deployment's requests are judged the
same way, against draws of their own tokens (diagnose/hypotheses.py `draws_on`). Without draws (a session of stand-in runs) the
single-run rule above holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .. import metrics
from . import allowance as A

K = 3.0
FLOOR = 1e-6
# Points compared per layer, in graph order.
POINTS = ("attn_norm", "kqv_out", "ffn_inp", "ffn_out", "l_out")
# diagnose's layer curve: these plus q and k after RoPE where an engine exposes them (vLLM; MLA: the rope
# parts q_pe and k_pe), so a divergence inside attention is named to the op.
CURVE_POINTS = ("attn_norm", "q_pe", "k_pe", "Qcur", "Kcur", "kqv_out", "ffn_inp", "ffn_out", "l_out")


@dataclass
class PointError:
    layer: int
    point: str
    error: float  # rel_l2(engine, ref)
    noise: float  # rel_l2(budget, ref); with draws, their RMS
    allowance: float = K  # the noise multiplier: K, or the family's from the draws (allowance.py)
    draws: int = 1  # how many runs measured the noise

    @property
    def limit(self) -> float:
        return self.allowance * self.noise + FLOOR

    @property
    def ratio(self) -> float:
        """error over its limit (inf when the error is not finite)."""
        return self.error / self.limit if math.isfinite(self.error) else math.inf

    @property
    def divergent(self) -> bool:
        # a non-finite error (inf/NaN in the engine where the reference is finite) always diverges,
        # even when the emulated run overflows too: the budget explains noise, not a blow-up
        return not (math.isfinite(self.error) and self.error <= self.limit)

    def as_dict(self) -> dict:
        return {"layer": self.layer, "point": self.point, "error": self.error, "noise": self.noise,
                "limit": self.limit, "divergent": self.divergent, "ratio": self.ratio,
                "marginal": A.marginal(self.ratio), "allowance": self.allowance, "draws": self.draws}


def error_curve(ref: Mapping[str, Any], budget: Mapping[str, Any], engine: Mapping[str, Any],
                n_layer: int, points: tuple[str, ...] = POINTS, draws: "list[A.DrawSummary] | None" = None,
                family: int | None = None) -> list[PointError]:
    """Every (layer, point) present in all three captures, in graph order. With `draws` (at least
    MIN_DRAWS), a point every draw measured takes the draws' RMS as its noise and the multiplier set for a
    diagnosis of `family` judged items (default: the curve's points)."""
    curve = []
    for il in range(n_layer):
        for p in points:
            name = f"{p}-{il}"
            if name in ref and name in budget and name in engine:
                curve.append(PointError(il, p, metrics.rel_l2(engine[name], ref[name]),
                                        metrics.rel_l2(budget[name], ref[name])))
    if draws and len(draws) >= A.MIN_DRAWS:
        _drawn_noise(curve, draws, family)
    return curve


def _drawn_noise(curve: list[PointError], draws: "list[A.DrawSummary]", family: int | None) -> None:
    """Each point of `curve` every draw measured: noise = the draws' RMS error, allowance = the family's."""
    judged = [p for p in curve if all(f"{p.point}-{p.layer}" in d.points for d in draws)]
    if not judged:
        return
    err = torch.tensor([[d.points[f"{p.point}-{p.layer}"] for p in judged] for d in draws],
                       dtype=torch.float64)  # [N, M]
    sq = err.nan_to_num(math.inf) ** 2
    null = err / A.loo_scale(sq)  # [N, M]: each draw against the others
    allow = A.magnitude_allowance(null, len(judged), family or len(judged), len(draws))
    for p, rms in zip(judged, sq.mean(0).sqrt().tolist()):
        p.noise, p.allowance, p.draws = rms, allow.threshold, len(draws)


def first_divergent_layer(curve: list[PointError]) -> tuple[int | None, PointError | None]:
    """(layer, first divergent point) of the first persistently divergent layer, or (None, None)."""
    layers = sorted({p.layer for p in curve})
    bad = {p.layer for p in curve if p.divergent}
    for i, il in enumerate(layers):
        if il in bad and (i + 1 == len(layers) or layers[i + 1] in bad):
            return il, next(p for p in curve if p.layer == il and p.divergent)
    return None, None


def off_by(p: PointError) -> str:
    """How far a capture point is from the reference, in words; a non-finite error is said as such
    (never "off by nan")."""
    if not math.isfinite(p.error):
        return "is not finite in the engine (inf/NaN) where the reference is finite"
    return f"is off by {p.error:.3g} (rel. L2) where the engine's noise is {p.noise:.3g}: {A.times(p.ratio)}"


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
    ratio: float | None = None  # the worst item over its allowance; None: value / limit
    allowance: dict | None = None  # how the draws set the threshold (allowance.Allowance.as_dict)

    @property
    def times(self) -> float:
        """How far the criterion is from its allowance: > 1 beyond it."""
        if self.ratio is not None:
            return self.ratio
        if not math.isfinite(self.value):
            return math.inf
        return self.value / self.limit if self.limit > 0 else (math.inf if self.value > 0 else 0.0)

    @property
    def marginal(self) -> bool:
        return A.marginal(self.times)

    def as_dict(self) -> dict:
        return {"criterion": self.name, "value": self.value, "limit": self.limit, "noise": self.noise,
                "ok": self.ok, "reason": self.reason, "evidence": self.evidence, "ratio": self.times,
                "marginal": self.marginal, "allowance": self.allowance}


def distribution_criteria(engine: Any, ref: Any, budget: Any, tokens: list[int] | None = None,
                          draws: "list[A.DrawSummary] | None" = None, cols: torch.Tensor | None = None,
                          family: int | None = None, unseen: bool = False) -> list[Criterion]:
    """The engine's next-token distributions against the reference's, every criterion noise-aware.
    engine, ref, budget: logits [T, V] (budget: the reference run with the engine's arithmetic). With
    `draws` (at least MIN_DRAWS randomized runs summarized at `cols`, allowance.columns(ref, engine)) the
    criteria after `finite` are `drawn_criteria`'s, set for a diagnosis of `family` judged items (`unseen`: the
    engine's discrete choices are not replayed, see there).

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
    if draws and len(draws) >= A.MIN_DRAWS:
        return out + drawn_criteria(got[keep], want[keep], keep, draws, cols[keep], family, tokens, unseen)
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


def drawn_criteria(got: torch.Tensor, want: torch.Tensor, keep: torch.Tensor, draws: "list[A.DrawSummary]",
                   cols: torch.Tensor, family: int | None, tokens: list[int] | None = None,
                   unseen: bool = False) -> list[Criterion]:
    """kl, kl_position and top1 of the finite positions `keep` (got, want: their logits [T', V]; cols [T', C])
    against the draws' spread (allowance.py), each threshold set for `family` judged items (default: these).

    - kl: the mean KL over positions against the draws' RMS of theirs, times the magnitude allowance.
    - kl_position: every position's sqrt(KL) against the RMS of the draws' sqrt(KL) there (a signed-noise
      statistic: KL is half the P-weighted variance of the logit errors), at the family's t threshold.
    - top1: a flip from the reference's top-1 a to the engine's b is beyond the noise when the engine's error
      on the pair difference, (E_a - E_b) - (R_a - R_b), exceeds the family's t threshold times that pair's
      spread: the RMS of the draws' error on the same pair, pooled half and half with the draws' vocabulary-
      averaged pair noise there (a pair seen in N draws alone is a poor scale), plus PAIR_FLOOR of the
      logits' spread; a pair the draws did not keep (the engine's top-1 is not among `cols`) has the
      vocabulary-averaged pair noise alone. The tail is measured on the pair every position could flip to, the
      reference's top-2.

    `unseen`: the model makes discrete choices (MoE experts, DSA keys) the engine exposes none of, so no run
    replays another's and each takes its own near-ties. kl_position and top1 then count the positions beyond
    their threshold against the count a healthy engine's unseen choices explain (allowance.unseen_choices, from
    the draws' own leave-one-out counts at the same threshold), each count at its positions' share of the level.
    """
    n_draws, t_n = len(draws), got.shape[0]
    family = family or 2 * t_n + 1
    position = keep.tolist()
    at = lambda x: x[keep] if x.shape[0] != t_n else x  # noqa: E731  (a summary of all positions, or of these)
    kl_d = torch.stack([at(d.kl) for d in draws]).to(torch.float64)  # [N, T']
    pn_d = torch.stack([at(d.pair_noise) for d in draws]).to(torch.float64)  # [N, T']
    delta_d = torch.stack([at(d.delta) for d in draws]).to(torch.float64)  # [N, T', C]
    kl = metrics.kl_divergence(got, want)  # [T']
    out = []

    # the mean KL: a pooled magnitude
    mean_d = kl_d.mean(1)  # [N]
    allow = A.magnitude_allowance(mean_d / A.loo_scale(mean_d ** 2), 1, family, n_draws)
    noise = float((mean_d ** 2).mean().sqrt())
    limit, value = allow.threshold * noise + FLOOR, float(kl.mean())
    worst = int(kl.argmax())
    out.append(Criterion("kl", value, limit, noise, value <= limit,
                         f"KL {value:.3g} against the draws' {noise:.3g} (limit {allow.threshold:.3g}x + {FLOOR:g} = "
                         f"{limit:.3g}, {n_draws} draws): {A.times(value / limit)}",
                         [{"position": position[worst], "kl": float(kl[worst]),
                           "kl_noise": float(kl_d[:, worst].mean())}], value / limit, allow.as_dict()))

    # every position's KL: signed noise sqrt(KL)
    floor = FLOOR ** 2
    z = (kl.clamp_min(0) / (kl_d.mean(0) + floor)).sqrt()  # [T']
    null = kl_d.clamp_min(0).sqrt() / (A.loo_scale(kl_d) ** 2 + floor).sqrt()  # [N, T']
    allow = A.signed_allowance(null, t_n, family, n_draws)
    bad = (~(z <= allow.threshold)).nonzero().flatten().tolist()
    worst = int(z.argmax())
    at_worst = float(z[worst]) / allow.threshold
    choices = A.unseen_choices(~(null <= allow.threshold), t_n * allow.level) if unseen else None
    ok, ratio, more = _counted(len(bad), at_worst, choices)
    out.append(Criterion(
        "kl_position", float(len(bad)), float(choices.allowed if choices else 0), float(kl_d.mean()), ok,
        f"{len(bad)} of {t_n} positions' KL beyond their draws' spread{more}; the worst, position {position[worst]}, "
        f"KL {float(kl[worst]):.3g} where the draws' is {float(kl_d[:, worst].mean()):.3g}: {A.times(at_worst)}",
        [{"position": position[i], "kl": float(kl[i]), "kl_draws": float(kl_d[:, i].mean()), "z": float(z[i])}
         for i in sorted(range(t_n), key=lambda i: -float(z[i]))[:5]], ratio,
        {**allow.as_dict(), **({"unseen_choices": choices.as_dict()} if choices else {})}))

    # top-1 flips against their own pair's spread
    spread2 = (A.PAIR_FLOOR * metrics.logit_pair_noise(torch.zeros_like(want), want)) ** 2  # [T']
    e_null = delta_d[..., 0] - delta_d[..., 1]  # [N, T']: the draws' error on (top-1, top-2) of the reference
    loo = (0.5 * (A.loo_scale(e_null ** 2) ** 2 + A.loo_scale(pn_d ** 2) ** 2) + spread2).sqrt()
    allow = A.signed_allowance(e_null.abs() / loo, t_n, family, n_draws)
    margin = metrics.top1_margin(got, want)  # [T']
    g_top = got.argmax(-1, keepdim=True)  # [T', 1]
    a = cols[:, :1]  # [T', 1]: the reference's top-1
    kept = (cols == g_top).any(-1)  # [T']: the draws kept the engine's top-1
    j = (cols == g_top).to(torch.int8).argmax(-1, keepdim=True)  # [T', 1]: the engine's top-1 among the columns
    e_eng = ((got.gather(-1, a) - got.gather(-1, g_top)) - (want.gather(-1, a) - want.gather(-1, g_top)))[:, 0].abs()
    e_d = delta_d[..., 0] - delta_d.gather(-1, j.expand(n_draws, -1, -1))[..., 0]  # [N, T']
    pair2 = torch.where(kept, (e_d ** 2).mean(0), (pn_d ** 2).mean(0))  # [T']: that pair's own, else the average
    scale = (0.5 * (pair2 + (pn_d ** 2).mean(0)) + spread2).sqrt()  # [T']
    z_pair = torch.where(scale > 0, e_eng / scale, torch.full_like(scale, math.inf))  # [T']
    rows, beyond = [], []
    for i in (margin > 0).nonzero().flatten().tolist():
        zi = float(z_pair[i])
        if not zi <= allow.threshold:
            beyond.append(i)
        rows.append({"position": position[i], "reference_top1": int(a[i, 0]), "engine_top1": int(g_top[i, 0]),
                     "reference_margin": float(margin[i]), "pair_error": float(e_eng[i]), "pair_spread": float(scale[i]),
                     "z": zi, "noise_bound": allow.threshold * float(scale[i]), "beyond_noise": not zi <= allow.threshold})
    if tokens is not None:
        for r in rows:
            r["context_token"] = int(tokens[r["position"]])
    rows.sort(key=lambda r: -r["z"])
    at_worst = rows[0]["z"] / allow.threshold if rows else 0.0
    # a draw flips to the reference's top-2 where its error on (top-1 - top-2) takes the reference's whole margin
    choices = A.unseen_choices((-e_null > margin_2(want)) & ~(e_null.abs() / loo <= allow.threshold),
                               t_n * allow.level) if unseen else None
    ok, ratio, more = _counted(len(beyond), at_worst, choices)
    first = (f": at position {rows[0]['position']} the engine's error on the reference's top-1 vs its own is "
             f"{rows[0]['pair_error']:.3g} where that pair's spread over {n_draws} draws is {rows[0]['pair_spread']:.3g} "
             f"(allowance {allow.threshold:.3g}x): {A.times(at_worst)}") if rows else ""
    out.append(Criterion(
        "top1", float(len(beyond)), float(choices.allowed if choices else 0), 0.0, ok,
        f"{len(rows)} of {t_n} top-1 flips, {len(beyond)} beyond their pair's spread over the draws{more}{first}",
        rows[:5], ratio, {**allow.as_dict(), **({"unseen_choices": choices.as_dict()} if choices else {})}))
    return out


def margin_2(want: torch.Tensor) -> torch.Tensor:
    """[T]: the reference's logit margin of its top-1 over its top-2 (want: logits [T, V])."""
    top = want.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def _counted(beyond: int, worst_ratio: float, choices: "A.UnseenChoices | None") -> tuple[bool, float, str]:
    """(ok, ratio, words) of a per-position criterion with `beyond` positions beyond their threshold: none may be
    (`choices` None or allowing none: the ratio is the worst position's), or up to choices.allowed (the ratio is
    the count over that; with none beyond, the worst position's ratio over it)."""
    if choices is None:
        return not beyond, worst_ratio, ""
    a = choices.allowed
    ratio = worst_ratio if not a else (beyond / a if beyond else worst_ratio / a)
    return beyond <= a, ratio, f" ({choices.words()})"
