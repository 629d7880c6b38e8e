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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import metrics
from .layers import FLOOR, K, Criterion, distribution_criteria


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
