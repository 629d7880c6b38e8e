"""The decode path: does an engine generate what its own prefill computes?

An engine generates n tokens greedily after a prompt of P tokens (Engine.generate): step 0's distribution
comes out of the prompt's prefill, steps 1..n-1 out of decode steps over its KV cache (other kernels, other
shapes: one row). The reference teacher-forces prompt + the engine's continuation; the engine's own prefill
of that same sequence is the control. Three distributions of the same positions P..P+n-2 (the decode
steps' rows), each judged against the reference with prefill's criteria (layers.py `distribution_criteria`:
against the spread of randomized draws of the same rows where given, else the emulated run's noise):

    decode    the engine's decode steps          a fault only here is the decode path's
    control   the engine's prefill, same tokens   a fault here is the prefill's (not reported as decode)

Which generated step goes wrong first (for the report, not the verdict): with draws, the first decode step whose KL
is beyond the per-position allowance of the draws' KL there (the kl_position criterion's), or whose top-1 flip is
beyond the noise. Without draws, the first whose KL exceeds K times the larger of two healthy draws at that
position, the emulated run's and the engine's own prefill's (K and FLOOR as layers.py). One position's KL is a
noisy measure (on the demo in llama.cpp, healthy, a decode step's KL reaches 3.2x the emulated run's at
its position and the control's 5.4x): the larger of the two draws absorbs that, and a fault stays far
beyond it (a KV entry of another token: 38x at the first decode step; RoPE at p-1: 6x from the second).

Where the engine exposes its decode steps' activations (llama.cpp's graph nodes, transformers' hidden states) and the
model makes no discrete choices (so that the reference's activations are those of the engine's own path), the decode
steps' activations are judged too, point by point as the prompt's are (layers.py `error_curve`, each point against
the draws' spread at the same positions, the threshold set for the whole diagnosis), with the engine's prefill of
the same tokens as their control (`judge_points`). A fault can move the activations well beyond the noise and the
distributions not: measured on the demo in llama.cpp, 7 decode steps rotated at p-1 put kqv_out-2 at 6.3x the draws'
RMS error there while the decode steps' mean KL stays within its allowance (bench/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import metrics
from .layers import FLOOR, K, Criterion, PointError, distribution_criteria, error_curve, first_divergent_layer


@dataclass
class DecodeJudgement:
    decode: list[Criterion]  # the decode steps against the reference
    control: list[Criterion]  # the engine's prefill of the same tokens against the reference (none: not judged)
    steps: list[dict]  # per generated step (0: from the prompt's prefill): KL, its bound, top-1s
    first_wrong: int | None  # the first decode step (0-based) beyond its bound, or None

    @property
    def decode_ok(self) -> bool:
        return all(c.ok for c in self.decode)

    @property
    def control_ok(self) -> bool:
        return all(c.ok for c in self.control)


def judge(generated: Any, control: Any, ref: Any, budget: Any, ids: list[int], draws: list | None = None,
          cols: Any = None, family: int | None = None, unseen: bool = False) -> DecodeJudgement:
    """generated, control, ref, budget: logits [n, V] of the n generated steps (row i: the distribution
    that chose ids[i]); row 0 comes from the prompt's prefill and is shown, not judged. `control` None: no
    control is judged (its criteria are none, and a step's bound is the emulated run's alone). With `draws`
    (allowance.DrawSummary of the same n rows, kept at `cols` [n, C]) every criterion is judged against the draws'
    spread, set for a diagnosis of `family` items (layers.py `drawn_criteria`), and a step is beyond its bound where
    its KL is beyond the per-position allowance of the draws' KL there. `unseen`: the engine's discrete choices
    are not replayed (layers.py `drawn_criteria`)."""
    got, want, emu = (torch.as_tensor(x).to(torch.float64) for x in (generated, ref, budget))
    tokens = list(ids)
    steps_only = dict(draws=[d.rows(slice(1, None)) for d in draws], cols=cols[1:], family=family,
                      unseen=unseen) if draws else {}
    decode = distribution_criteria(got[1:], want[1:], emu[1:], tokens[:-1], **steps_only)
    kl, kl_noise = (metrics.kl_divergence(x, want) for x in (got, emu))  # [n]
    if control is None:
        control_crit, kl_ctl = [], torch.zeros_like(kl)
    else:
        ctl = torch.as_tensor(control).to(torch.float64)
        control_crit = distribution_criteria(ctl[1:], want[1:], emu[1:], tokens[:-1], **steps_only)
        kl_ctl = metrics.kl_divergence(ctl, want)
    per_position = next((c.allowance for c in decode if c.name == "kl_position"), None)
    if per_position:  # sqrt(KL / the draws' mean KL) within the per-position threshold (layers.py drawn_criteria)
        kl_d = torch.stack([d.kl for d in draws]).to(torch.float64).mean(0)  # [n]
        bound = per_position["threshold"] ** 2 * (kl_d + FLOOR ** 2)
    else:
        bound = K * torch.maximum(kl_noise, kl_ctl) + FLOOR  # [n]
    beyond_top1 = {r["position"] + 1 for c in decode if c.name == "top1" for r in c.evidence if r["beyond_noise"]}
    steps, first = [], None
    for i in range(got.shape[0]):
        wrong = i > 0 and (not bool(kl[i] <= bound[i]) or i in beyond_top1)
        if wrong and first is None:
            first = i
        steps.append({"step": i + 1, "token": tokens[i], "source": "prefill" if i == 0 else "decode",
                      "kl": float(kl[i]), "kl_noise": float(kl_noise[i]),
                      "kl_control": None if control is None else float(kl_ctl[i]),
                      "bound": float(bound[i]), "reference_top1": int(want[i].argmax()), "beyond": wrong})
    return DecodeJudgement(decode, control_crit, steps, first)


@dataclass
class PointsJudgement:
    """The decode steps' activations against the reference's at the same positions, and the engine's prefill of the
    same tokens' (the control), each point against its noise (layers.py `error_curve`)."""

    decode: list[PointError]  # every (layer, point) the decode steps, the reference and the emulated run all hold
    control: list[PointError]  # the same points of the engine's prefill of the same tokens
    layer: int | None  # the decode steps' first persistently divergent layer, or None
    point: PointError | None  # its first divergent point
    control_layer: int | None  # the control's first persistently divergent layer, or None
    first_step: int | None  # the first decode step (0-based, as DecodeJudgement) whose own error at `point` is
    #                         beyond that point's limit: for the report, not the verdict

    @property
    def decode_ok(self) -> bool:
        return self.layer is None

    @property
    def control_ok(self) -> bool:
        return self.control_layer is None


def judge_points(engine: dict, control: dict, ref: dict, budget: dict, n_layer: int, draws: list | None = None,
                 family: int | None = None) -> PointsJudgement:
    """engine, control, ref, budget: captures {"point-layer": [n-1, D]} at the positions of decode steps 1..n-1 (row
    i-1: step i); `control` holds the engine's prefill of the same tokens at the same positions. With `draws`
    (allowance.DrawSummary whose points were measured at those positions) every point is judged against the draws'
    spread, set for a diagnosis of `family` items; without, the single-run rule (layers.py)."""
    from .layers import CURVE_POINTS

    curve = error_curve(ref, budget, engine, n_layer, points=CURVE_POINTS, draws=draws, family=family)
    held = {k: v for k, v in control.items() if k in engine}  # like with like: the points the decode steps show
    ctl = error_curve(ref, budget, held, n_layer, points=CURVE_POINTS, draws=draws, family=family)
    layer, point = first_divergent_layer(curve)
    first = None
    if point is not None:
        name = f"{point.point}-{point.layer}"
        rows = [metrics.rel_l2(g, w) for g, w in zip(engine[name], ref[name])]  # each decode step's own error
        first = next((i + 1 for i, e in enumerate(rows) if not e <= point.limit), None)
    return PointsJudgement(curve, ctl, layer, point, first_divergent_layer(ctl)[0], first)
