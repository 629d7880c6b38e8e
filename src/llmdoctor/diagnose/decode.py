"""The decode-path hypothesis: the engine generates greedily from the prompt through its KV cache, the
reference teacher-forces prompt + that continuation, and the engine's own prefill of the same tokens is the
control (checks/compute/decode.py judges). A divergence only in the decode steps is the decode path's, named with
the first generated step that goes wrong and, where the engine exposes the decode steps' activations, the
layer and op; a divergence the prefill shows too is the prefill's (engine-vs-reference), not reported twice.

A model with discrete choices (MoE experts, DSA keys) is judged under two choice sets (StepsJudgement): the choices of
the engine's prefill of the same tokens, replayed, and where the steps disagree under those, the reference's own.
The engine's decode steps may take a router's near-tie other than its prefill (measured: vLLM for CPU on a tiny
DeepSeek-V3 in bfloat16, one decode step KL 0.213 against the prefill's choices, 0.000276 under the reference's own),
and no engine here exposes its decode steps' choices; steps that agree under either set are no fault."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..checks.base import Finding
from ..checks.compute.layers import off_by
from ..subjects.engines.base import Generation
from .hypotheses import prefill_criteria
from .session import Session, Skip

HYPOTHESIS = "the engine's decode path (KV cache, decode kernels) computes what its prefill computes"


@dataclass
class StepsJudgement:
    """An engine's generated steps against the reference teacher-forcing prompt + continuation, under each set of
    discrete choices (MoE experts, DSA keys) the reference may take, the float32 run and the emulated run always
    taking the same set:

        prefill  the choices of the engine's own prefill of the same tokens, replayed (replay.py): the engine's
                 decode steps may take a near-tie other than its prefill, and no engine here exposes the choices of
                 its decode steps, so these stand for them
        own      the reference's own choices (the model as specified), judged only where the first set disagrees
                 and the reference replays anything (a dense model has one set)

    The steps agree when they agree under either set: agreeing under its own choices, the engine computed the
    model's distribution; under the prefill's, it computed it for choices its prefill made."""

    ids: list[int]
    prompt_len: int
    prefill: Any  # checks/compute/decode.py DecodeJudgement, with the control where one was asked
    own: Any | None  # the same without the control, or None where not judged
    ref_caps: dict
    emu_caps: dict
    points: Any | None = None  # checks/compute/decode.py PointsJudgement of the decode steps' activations, or None
    points_skip: str | None = None  # why the activations were not judged where `decode_points_judged` says they are

    @property
    def by_own(self) -> bool:
        """Whether the steps agree only under the reference's own choices."""
        return not self.prefill.decode_ok and self.own is not None and self.own.decode_ok

    @property
    def decisive(self) -> Any:
        return self.own if self.by_own else self.prefill

    @property
    def ok(self) -> bool:
        return self.decisive.decode_ok and (self.points is None or self.points.decode_ok)

    def choice_sets(self) -> dict[str, Any]:
        """Each judged choice set's decode criteria (kl, top1) and first wrong step, for the metrics."""
        out = {}
        for name, j in (("engine_prefill", self.prefill), ("reference_own", self.own)):
            if j is not None:
                out[name] = {**{c.name: c.value for c in j.decode if c.name != "finite"}, "ok": j.decode_ok,
                             "first_wrong_step": None if j.first_wrong is None else j.first_wrong + 1}
        return out


def judge_steps(s: Session, gen: Generation, budget: Any, control: bool = True) -> StepsJudgement:
    """The judgement of `gen`'s decode steps (checks/compute/decode.py) under each choice set (StepsJudgement),
    with the engine's own prefill of the same tokens as the control where `control` (the decode path asks it;
    the configured ladder's rungs judge the steps alone). One judgement for the decode-path finding and the
    configured deployment's generated request, so that the two cannot disagree."""
    from ..checks.compute import decode
    from .hypotheses import decode_points_judged, draws_on, family

    p = len(s.tokens())
    full = s.tokens() + gen.ids[:-1]  # the last generated token is chosen, never fed
    rows = slice(p - 1, p - 1 + len(gen.ids))  # the positions whose next token was generated
    ref, ref_caps, _ = s.reference("float32", tokens=full)
    emu, emu_caps, _ = s.reference(budget.dtype, budget.emulate, tokens=full)
    ctl = s.engine_run_on(full).logits[rows] if control else None
    judged = control and decode_points_judged(s)
    draws, cols = draws_on(s, full, rows, more=2, point_rows=slice(p, p - 1 + len(gen.ids)) if judged else None)
    first = decode.judge(gen.logits, ctl, ref[rows], emu[rows], gen.ids, draws, cols, family(s), s.choices_unseen(full))
    points, points_skip = None, None
    if judged:
        try:
            points = decode_points(s, gen.ids, ref_caps, emu_caps, draws, family(s))
        except Skip as e:
            points_skip = str(e)
    own = None
    if not first.decode_ok and s.replays(full):
        ref_own = s.reference("float32", tokens=full, replay=False)[0]
        emu_own = s.reference(budget.dtype, budget.emulate, tokens=full, replay=False)[0]
        own = decode.judge(gen.logits, None, ref_own[rows], emu_own[rows], gen.ids, *draws_on(s, full, rows, False, 2),
                           family(s))
    return StepsJudgement(list(gen.ids), p, first, own, ref_caps, emu_caps, points, points_skip)


def decode_points(s: Session, ids: list[int], ref_caps: dict, emu_caps: dict, draws: list | None = None,
                  family: int | None = None, start: int = 1) -> Any:
    """The decode steps' activations judged point by point (checks/compute/decode.py `judge_points`): the engine
    generates once more with them captured (the same tokens, or a Skip saying otherwise), against the reference's
    and the emulated run's activations at the same positions (`ref_caps`, `emu_caps`: of prompt + continuation),
    with the engine's prefill of the same tokens as the control; `draws` measured there (hypotheses.py `draws_on`
    with `point_rows`) or none (the single-run rule: localization only, of the decode steps from `start` on)."""
    from ..checks.compute.decode import judge_points

    again = s.generation(captures=True)
    if again.ids != ids:
        raise Skip("the engine generated other tokens when its decode steps were captured")
    if not again.captures:
        raise Skip("the engine exposes no activations of its decode steps")
    p, full = len(s.tokens()), s.tokens() + ids[:-1]
    rows = slice(p + start - 1, p + len(ids) - 1)  # positions of decode steps start .. n-1 (step i at p + i - 1)

    def at(caps: dict) -> dict:
        return {k: v[rows] for k, v in caps.items() if getattr(v, "ndim", 0) and v.shape[0] == len(full)}

    engine = {k: v[start - 1:] for k, v in again.captures.items()}  # row i-1: step i
    got = judge_points(engine, at(s.engine_run_on(full).captures), at(ref_caps), at(emu_caps), s.config().n_layer,
                       draws, family)
    if not got.decode:
        raise Skip("no decode-step activation maps onto the reference's capture points")
    if got.first_step is not None:
        got.first_step += start - 1
    return got


def _choices(s: Session) -> str:
    """What the model chooses, in words."""
    cfg = s.config()
    dsa = cfg.mla is not None and cfg.mla.indexer is not None
    return " and ".join(w for w, has in (("expert", cfg.moe is not None), ("sparse-attention key", dsa)) if has) + " choices"


def h_decode_path(s: Session) -> list[Finding]:
    n = s.inputs.generate
    if n < 2:
        raise Skip(f"--generate {n}: no decode step to judge (the first generated token comes out of the prefill)")
    if not all(c.ok for c in prefill_criteria(s)):
        raise Skip("the engine's prefill of the prompt already disagrees with the reference (engine-vs-reference): "
                   "the decode path is not judged apart from it")
    gen = s.generation()
    if gen.logits is None:
        raise Skip("the engine shows the generated ids only, not their distributions")
    p = len(s.tokens())
    steps = judge_steps(s, gen, s.budget())
    j, d = steps.prefill, steps.decisive
    metrics: dict[str, Any] = {  # the numbers first: the terminal shows the first few
        **{f"decode_{c.name}": c.value for c in d.decode if c.name != "finite"},
        **{f"control_{c.name}": c.value for c in j.control if c.name != "finite"},
        "first_wrong_step": None if d.first_wrong is None else d.first_wrong + 1, "generated": len(gen.ids),
        "prompt_tokens": p, "generated_ids": gen.ids, "engine": {k: v for k, v in gen.info.as_dict().items() if k != "engine"}}
    if steps.own is not None:
        metrics["choices"] = "reference_own" if steps.by_own else "neither"
        metrics["choice_sets"] = steps.choice_sets()
    pts = steps.points
    if pts is not None:
        worst = max(pts.decode, key=lambda q: q.ratio)
        metrics["decode_points"] = {"points": len(pts.decode), "first_divergent_layer": pts.layer,
                                    "control_first_divergent_layer": pts.control_layer,
                                    "worst": f"{worst.point}-{worst.layer}", "worst_ratio": worst.ratio}
    elif steps.points_skip:
        metrics["decode_points"] = {"skipped": steps.points_skip}
    budget = {f"{c.name}_limit": c.limit for c in d.decode if c.name != "finite"}
    evidence = [{"decode": [c.as_dict() for c in j.decode], "control": [c.as_dict() for c in j.control]}, *j.steps]
    if pts is not None:
        evidence.append({"decode_points": [q.as_dict() for q in pts.decode],
                         "control_points": [q.as_dict() for q in pts.control]})
    if steps.own is not None:
        evidence.append({"choices": "the reference's own", "decode": [c.as_dict() for c in steps.own.decode],
                         "steps": steps.own.steps})

    def finding(status: str, explanation: str, **more: Any) -> list[Finding]:
        return [Finding(check="decode-path", subject=s.inputs.engine, target=f"{len(gen.ids)} generated steps",
                        status=status, confidence="high", hypothesis=HYPOTHESIS, metrics={**metrics, **more},
                        budget=budget, evidence=evidence, explanation=explanation)]

    if not j.control_ok or (pts is not None and not pts.control_ok):
        failed = [c.reason for c in j.control if not c.ok]
        if pts is not None and not pts.control_ok:
            q = next(x for x in pts.control if x.layer == pts.control_layer and x.divergent)
            failed.append(f"its activations leave the reference from layer {q.layer}: {q.point}-{q.layer} {off_by(q)}")
        return finding("fail", "the engine's prefill of the prompt and its own continuation disagrees with the "
                               f"reference at the generated positions ({'; '.join(failed)}): a prefill fault beyond "
                               "the prompt, not the decode path's")
    kl = next(c for c in d.decode if c.name == "kl")
    first = j.first_wrong if j.first_wrong is not None else max(range(1, len(j.steps)),
                                                               key=lambda i: j.steps[i]["kl"] / j.steps[i]["bound"])
    at = (f"first wrong at generated step {first + 1} (position {p + first - 1})" if j.first_wrong is not None else
          f"no single step beyond its own bound, the worst generated step {first + 1} (position {p + first - 1})")
    if steps.by_own:
        kl_prefill = next(c for c in j.decode if c.name == "kl")
        return finding("pass", f"{len(gen.ids) - 1} decode steps agree with the reference under its own {_choices(s)} "
                               f"(KL {kl.value:.3g}, noise {kl.noise:.3g}) and the engine's prefill of the same tokens "
                               f"agrees; against the choices of that prefill they differ ({at}: KL {kl_prefill.value:.3g},"
                               f" noise {kl_prefill.noise:.3g}): the decode steps took a near-tie the other way from the "
                               "prefill (their own choices are not exposed), which is no fault")
    if j.decode_ok and (pts is None or pts.decode_ok):
        within = f" and their activations within it at {len(pts.decode)} points" if pts is not None else ""
        unjudged = f"; their activations not judged: {steps.points_skip}" if steps.points_skip else ""
        return finding("pass", f"{len(gen.ids) - 1} decode steps within the engine's noise (KL {kl.value:.3g}, noise "
                               f"{kl.noise:.3g}){within}; its prefill of the same tokens agrees{unjudged}")
    if j.decode_ok:  # the distributions within the noise, the activations not
        q, step = pts.point, pts.first_step
        at = (f"first wrong at generated step {step + 1} (position {p + step - 1})" if step is not None else
              f"no single step beyond the limit of {q.point}-{q.layer} alone")
        return finding("fail", f"decode path: {at}, prefill of the same tokens agrees; the decode steps' activations "
                               f"leave the reference: first divergent layer {pts.layer}: {q.point}-{q.layer} {off_by(q)}"
                               f" in the decode steps, while their next-token distributions stay within the noise (KL "
                               f"{kl.value:.3g}, {kl.ratio:.2g} of its allowance)",
                       first_wrong_step=None if step is None else step + 1, localization=_where(pts))
    failed = [c for c in j.decode if not c.ok]
    kl = next(c for c in j.decode if c.name == "kl")
    m = s.config().mla
    if m is not None and m.indexer is not None and not any(k.startswith("top_k-") for k in gen.captures):
        # measured: transformers' GLM-DSA on a tiny random model, KL 0.1 from step 2 while its prefill of the same
        # tokens agrees with the reference to 2e-13; its index scores are ReLU zeros for many keys
        raise Skip(f"the decode steps differ from the engine's own prefill of the same tokens ({at}: KL {kl.value:.3g}, "
                   f"noise {kl.noise:.3g}), but the keys its sparse-attention indexer picked in those steps are not "
                   "exposed: exact ties of the index scores (ReLU zeros) may go either way in a decode and a prefill, "
                   "so this cannot be told from a legitimate tie-break and is not judged a fault")
    neither = ""
    if steps.own is not None:
        own_kl = next(c for c in steps.own.decode if c.name == "kl")
        neither = (f"; neither the {_choices(s)} of the engine's prefill of the same tokens nor the reference's own "
                   f"explain it (under its own: KL {own_kl.value:.3g}, noise {own_kl.noise:.3g})")
    where = _where(pts) if pts is not None else _localize(s, gen.ids, steps, first)
    return finding("fail", f"decode path: {at}, prefill of the same tokens agrees; "
                           + "; ".join(f"the {c.name} criterion fails: {c.reason}" for c in failed) + neither
                           + (f"; {where['words']}" if where.get("words") else ""),
                   localization=where)


def _where(pts: Any) -> dict[str, Any]:
    """The localization of the decode steps' activations (a PointsJudgement): the first divergent layer and op."""
    if pts.layer is None:
        return {"layer": None, "points": len(pts.decode), "words": "every decode-step activation within the noise"}
    q = pts.point
    return {"layer": pts.layer, "point": q.point, "error": q.error, "noise": q.noise, "limit": q.limit,
            "ratio": q.ratio, "words": f"first divergent layer {pts.layer}: {q.point}-{pts.layer} {off_by(q)} in the "
                                      "decode steps",
            "curve": [x.as_dict() for x in pts.decode if x.layer in (pts.layer - 1, pts.layer, pts.layer + 1)]}


def _localize(s: Session, ids: list[int], steps: StepsJudgement, first: int) -> dict[str, Any]:
    """Where the decode steps whose distributions fail leave the reference, where their activations were not judged
    (a model with discrete choices: compared under the choices of the engine's prefill, with the single-run rule):
    the decode steps' activations from the first wrong step on, as `decode_points` compares them."""
    try:
        pts = decode_points(s, ids, steps.ref_caps, steps.emu_caps, start=first)
    except Skip as e:
        return {"skipped": str(e)}
    return _where(pts)
