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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .. import metrics

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


def off_by(p: PointError) -> str:
    """How far a capture point is from the reference, in words; a non-finite error is said as such
    (never "off by nan")."""
    if not math.isfinite(p.error):
        return "is not finite in the engine (inf/NaN) where the reference is finite"
    return f"is off by {p.error:.3g} (rel. L2) where the engine's noise is {p.noise:.3g}"


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
