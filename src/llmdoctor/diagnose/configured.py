"""The deployment as its users configured it (issue 34): requests that reach the code its `vllm serve` options
turn on, each judged against the reference, and the ladder that puts one option back at a time.

The prompt (engine-vs-reference) and the generated steps (decode-path) already run on the configured engine.
Two more requests reach what they cannot:

    chunked-prefill  a prompt longer than the scheduler's token budget (max_num_batched_tokens), so its prefill
                     runs in chunks: the user's prompt when it is that long, else the prompt repeated to one
                     budget plus a quarter; judged per position like the prompt, with its positions grouped by
                     chunk in the evidence (a fault after the first chunk boundary reads as one)
    prefix-cache     a second request sharing the first request's leading full KV blocks, then a full block
                     of other tokens: vLLM reads the shared blocks from its prefix cache (its count of cached
                     tokens is evidence: more than the shared prefix is a hit on another block); its generated
                     steps are judged, and the engine's own uncached prefill of the same tokens is the control
                     (vLLM never reads the prefix cache for a request that asks prompt logprobs)

The ladder (`h_configured_ladder`) runs when one of these requests, the prompt or the generated steps disagree: the
engine starts again with one option put back at a time, in the order of the issue (CUDA graphs, torch.compile, the
KV-cache dtype, prefix caching, chunked prefill, the attention backend the deployment chose), in the same driver
process (vLLM frees one engine before the next loads), and the first option whose reversal makes every failing
request agree is named. Each rung is judged with its own noise budget (its own arithmetic: an fp8 cache put back is
no longer emulated). The fault, named or in every configuration (no rung agrees), is then localized to a layer and
op in a configuration that keeps it (`localize_failing`): forward hooks fire neither in a compiled graph nor under
CUDA-graph replay, so a compiled configuration is captured eagerly with vLLM's custom ops in their native forms
(the code torch.compile traces); where that configuration agrees, the words say the fault lives only in code no
hook sees.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..checks.base import Finding
from ..subjects.engines.base import Engine
from .requests import PREFIX_STEPS, configured_engine, long_prompt, prefix_requests, resolved
from .session import Session, Skip

REQUESTS_HYPOTHESIS = "the engine computes the model's distribution in the code its configuration turns on"
LADDER_HYPOTHESIS = "no single option of the deployment's configuration breaks the engine"

# the ladder's rungs in order: option -> (applies to this resolved configuration, the cause in words)
RUNGS: dict[str, tuple[Callable[[dict], bool], str]] = {
    "cudagraphs": (lambda c: str(c.get("cudagraph_mode") or "NONE") != "NONE",
                   "with CUDA graphs off the engine agrees: the captured-graph path is the cause"),
    "compilation": (lambda c: str(c.get("compilation_mode") or "NONE") != "NONE",
                    "with torch.compile off the engine agrees: the compiled path (Inductor's fused kernels, the "
                    "custom ops' native forms) is the cause"),
    "kv_cache_dtype": (lambda c: str(c.get("kv_cache_dtype") or "auto") != "auto",
                       "with the KV cache in the model's dtype the engine agrees: the quantized KV cache is the cause"),
    "prefix_caching": (lambda c: bool(c.get("prefix_caching")),
                       "with prefix caching off the engine agrees: the prefix cache is the cause"),
    "chunked_prefill": (lambda c: bool(c.get("chunked_prefill")),
                        "with chunked prefill off the engine agrees: chunked prefill is the cause"),
    "attention_backend": (lambda c: c.get("attention_backend") is not None or bool(c.get("backend_env")),
                          "with vLLM's own attention backend the engine agrees: the backend the deployment chose is "
                          "the cause"),
}


@dataclass
class Judged:
    """One request on one engine against the reference: its criteria (layers.py) and what else it showed."""

    request: str
    criteria: list
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.criteria)

    def failed(self) -> str:
        return "; ".join(f"the {c.name} criterion fails: {c.reason}" for c in self.criteria if not c.ok)

    def as_dict(self) -> dict[str, Any]:
        return {"request": self.request, "ok": self.ok, **self.facts, "criteria": [c.as_dict() for c in self.criteria]}


# ---- the requests ----------------------------------------------------------------------------------------------
def _criteria(s: Session, engine_logits: Any, tokens: list[int], rows: slice, budget) -> list:
    """The distribution criteria of `engine_logits` [n, V] against the reference's rows of `tokens`, each against the
    spread of the randomized draws of the engine's arithmetic on the same tokens, set for the whole diagnosis
    (hypotheses.py `draws_on`, `family`); the float32 run, the emulated run and the draws always under one set of
    discrete choices (MoE experts, DSA keys): those of the engine's run of the same tokens, replayed, and where the
    rows disagree under those, the reference's own (the model as specified: agreeing with it is no fault; decode.py
    StepsJudgement says why). The first set's criteria where neither agrees. A dense model has one set."""
    from ..checks.compute.layers import distribution_criteria
    from .hypotheses import draws_on, family

    got = torch.as_tensor(engine_logits)
    first = None
    for replay in (True, False):
        if not replay and not s.replays(tokens):
            break
        ref = s.reference("float32", tokens=tokens, replay=replay)[0][rows]
        emu = s.reference(budget.dtype, budget.emulate, tokens=tokens, replay=replay)[0][rows]
        draws, cols = draws_on(s, tokens, rows, replay)
        crit = distribution_criteria(got, ref, emu, tokens[rows], draws=draws, cols=cols, family=family(s),
                                     unseen=replay and s.choices_unseen(tokens))
        if all(c.ok for c in crit):
            return crit
        first = first or crit
    return first


def judge_chunked(s: Session, engine: Engine, cfg: dict[str, Any], budget) -> Judged:
    tokens = long_prompt(s, cfg)
    ran = s.engine_run() if engine is s.engine() and tokens == s.tokens() else engine.run(tokens, s.given_config())
    crit = _criteria(s, ran.logits, tokens, slice(0, len(tokens)), budget)
    chunk = int(cfg["max_num_batched_tokens"])
    return Judged("chunked-prefill", crit, {"tokens": len(tokens), "chunk_tokens": chunk,
                                            "chunks": -(-len(tokens) // chunk), "by_chunk": by_chunk(crit, chunk)})


def by_chunk(crit: list, chunk: int) -> list[dict[str, Any]]:
    """Where the judged positions beyond the noise fall, chunk by chunk (the top-1 flips beyond the noise)."""
    top1 = next((c for c in crit if c.name == "top1"), None)
    beyond = [r["position"] for r in (top1.evidence if top1 else []) if r.get("beyond_noise")]
    out: dict[int, int] = {}
    for p in beyond:
        out[p // chunk] = out.get(p // chunk, 0) + 1
    return [{"chunk": k, "from_position": k * chunk, "flips_beyond_noise": v} for k, v in sorted(out.items())]


def judge_prefix(s: Session, engine: Engine, cfg: dict[str, Any], budget) -> Judged:
    first, second, shared = prefix_requests(s, cfg)
    gen = engine.generate_after([first], second, PREFIX_STEPS)
    full = second + gen.ids[:-1]
    rows = slice(len(second) - 1, len(second) - 1 + len(gen.ids))
    crit = _criteria(s, gen.logits, full, rows, budget)
    cached = gen.info.details.get("cached_tokens")
    facts: dict[str, Any] = {"first_tokens": len(first), "second_tokens": len(second), "shared_tokens": shared,
                             "cached_tokens": cached, "generated_ids": gen.ids}
    if not all(c.ok for c in crit):  # the control: the engine's own prefill of the same tokens reads no cache
        control = engine.run(full, s.given_config())
        facts["control"] = [c.as_dict() for c in _criteria(s, control.logits[rows], full, rows, budget)]
        facts["control_ok"] = all(c["ok"] for c in facts["control"])
    return Judged("prefix-cache", crit, facts)


def judge_prompt(s: Session, engine: Engine, cfg: dict[str, Any], budget) -> Judged:
    tokens = s.tokens()
    ran = s.engine_run() if engine is s.engine() else engine.run(tokens, s.given_config())
    return Judged("prompt", _criteria(s, ran.logits, tokens, slice(0, len(tokens)), budget))


def judge_generated(s: Session, engine: Engine, cfg: dict[str, Any], budget) -> Judged:
    """The generated steps, judged as the decode-path finding judges them (decode.py `judge_steps`, without its
    control: a rung is not the engine whose prefill would be the control)."""
    from .decode import judge_steps

    n = s.inputs.generate
    if n < 2:
        raise Skip(f"--generate {n}: no decode step")
    gen = s.generation() if engine is s.engine() else engine.generate(s.tokens(), n)
    steps = judge_steps(s, gen, budget, control=False)
    facts: dict[str, Any] = {"generated_ids": gen.ids}
    if steps.own is not None:
        facts["choices"] = "reference_own" if steps.by_own else "neither"
        facts["choice_sets"] = steps.choice_sets()
    return Judged("generated", steps.decisive.decode, facts)


JUDGES = {"prompt": judge_prompt, "generated": judge_generated, "chunked-prefill": judge_chunked,
          "prefix-cache": judge_prefix}


def judged(s: Session, request: str) -> Judged:
    """A request on the configured engine, judged once per diagnosis; a Skip saying why it cannot run."""
    def make():
        cfg = resolved(s)
        try:
            return JUDGES[request](s, s.engine(), cfg, s.budget())
        except Skip as e:
            return e

    got = s.once(f"configured-{request}", make)
    if isinstance(got, Skip):
        raise got
    return got


# ---- the hypotheses --------------------------------------------------------------------------------------------
def h_configured_requests(s: Session) -> list[Finding]:
    """The chunked-prefill and prefix-cache requests on the configured engine, each a finding."""
    configured_engine(s)
    out = []
    for request, target in (("chunked-prefill", "a prompt longer than the token budget"),
                            ("prefix-cache", "a request reading another's blocks from the prefix cache")):
        try:
            j = judged(s, request)
        except Skip as e:
            out.append(Finding(check="configured-requests", subject=s.inputs.engine, target=target, status="skip",
                               reason=str(e), hypothesis=REQUESTS_HYPOTHESIS))
            continue
        out.append(Finding(check="configured-requests", subject=s.inputs.engine, target=target,
                           status="pass" if j.ok else "fail", confidence="high", hypothesis=REQUESTS_HYPOTHESIS,
                           metrics={**{f"{c.name}": c.value for c in j.criteria}, **_scalars(j.facts)},
                           evidence=[j.as_dict()], explanation=_words(j)))
    return out


def _scalars(facts: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in facts.items() if isinstance(v, (int, float, str)) or v is None}


def _words(j: Judged) -> str:
    f = j.facts
    if j.request == "chunked-prefill":
        where = f"{f['tokens']} tokens in {f['chunks']} chunks of {f['chunk_tokens']}"
        if j.ok:
            return f"chunked prefill agrees with the reference ({where}): every position within the engine's noise"
        chunks = f["by_chunk"]
        first = (f"; the flips beyond the noise start in chunk {chunks[0]['chunk']} (position {chunks[0]['from_position']} "
                 f"on)" + (": the first chunk agrees, the positions after a chunk boundary do not" if chunks[0]["chunk"] > 0
                           else "")) if chunks else ""
        return f"chunked prefill disagrees with the reference ({where}){first}; {j.failed()}"
    hit = f"{f['cached_tokens']} of its {f['second_tokens']} prompt tokens read from the prefix cache, {f['shared_tokens']} " \
          "shared with the first request"
    if j.ok:
        return f"a prefix-cache hit agrees with the reference ({hit})"
    extra = ""
    if isinstance(f["cached_tokens"], int) and f["cached_tokens"] > f["shared_tokens"]:
        extra = ": it read more tokens from the cache than it shares, so a cached block of another request served it"
    elif f.get("control_ok"):
        extra = ": the engine's own uncached prefill of the same tokens agrees, so the cache hit is the cause"
    return f"a prefix-cache hit disagrees with the reference ({hit}){extra}; {j.failed()}"


def failing_requests(s: Session) -> list[Judged]:
    """The requests that disagree on the configured engine (the prompt, the generated steps, chunked prefill, the
    prefix-cache hit); those that cannot run are left out."""
    out = []
    for request in JUDGES:
        try:
            j = judged(s, request)
        except Skip:
            continue
        if not j.ok:
            out.append(j)
    return out


def h_configured_ladder(s: Session) -> list[Finding]:
    """One option put back at a time; the first whose reversal makes every failing request agree is named."""
    engine = configured_engine(s)
    cfg = resolved(s)  # a Skip when the configured engine cannot run at all
    failing = failing_requests(s)
    if not failing:
        raise Skip("every request agrees with the reference as the deployment is configured: no option to name")
    names = [j.request for j in failing]
    rungs, cause = [], None
    for option, (applies, words) in RUNGS.items():
        if not applies(cfg):
            continue
        s.progress(f"configured ladder: {option} put back ({', '.join(names)})")
        t0 = time.perf_counter()
        rung = engine.reverted(option)
        try:
            ran = rung.run(s.tokens(), s.given_config())
            budget = rung.noise_budget(ran)
            got = [JUDGES[r](s, rung, cfg, budget) for r in names]
        except Exception as e:  # vLLM's refusal of the rung (an option it cannot put back here) is evidence
            rungs.append({"option": option, "ran": False, "error": f"{type(e).__name__}: {e}"})
            continue
        agrees = all(j.ok for j in got)
        rungs.append({"option": option, "ran": True, "agrees": agrees,
                      "set": (ran.info.details.get("engine_config") or {}).get("llmdoctor_sets", {}).get("revert"),
                      # the rung's cost in the resident driver: its engine's load, and the rung in all
                      "load_s": ran.info.details.get("load_s"), "seconds": round(time.perf_counter() - t0, 2),
                      "requests": [j.as_dict() for j in got]})
        if agrees:
            cause = (option, words)
            break
    tried = ", ".join(r["option"] for r in rungs) or "none applies"
    metrics = {"failing_requests": names, "options_tried": [r["option"] for r in rungs],
               "option": cause[0] if cause else None}
    # where no option is the cause the fault runs in every configuration, the capturing one too: localize it either way
    where = localize_failing(s, engine, cfg, failing)
    metrics["localized"] = {k: v for k, v in where.items() if k != "curve"}
    if cause is None:
        return [Finding(check="configured-ladder", subject=s.inputs.engine, target="the deployment's options",
                        status="pass", confidence="medium", hypothesis=LADDER_HYPOTHESIS, metrics=metrics,
                        evidence=[*rungs, {"localization": where}],
                        explanation=f"no single option's reversal makes the engine agree (tried: {tried}; failing: "
                                    f"{', '.join(names)}): the fault is in the path every configuration runs; "
                                    f"{where['words']}")]
    return [Finding(check="configured-ladder", subject=s.inputs.engine, target=f"option {cause[0]}", status="fail",
                    confidence="high", hypothesis=LADDER_HYPOTHESIS, metrics=metrics, evidence=[*rungs, {"localization": where}],
                    explanation=f"{cause[1]} ({', '.join(names)} disagreed as configured; tried in order: {tried}); "
                                f"{where['words']}")]


def _eager(cfg: dict[str, Any]) -> bool:
    return all(str(cfg.get(k) or "NONE") == "NONE" for k in ("compilation_mode", "cudagraph_mode"))


def localize_failing(s: Session, engine: Engine, cfg: dict[str, Any], failing: list[Judged]) -> dict[str, Any]:
    """The first divergent layer and op of a failing request (the prompt, else the chunked-prefill request) in a
    configuration that keeps the fault: the configured engine when it runs eagerly, else the same made eager with
    vLLM's custom ops in their native forms (the code torch.compile traces), since forward hooks fire neither in a
    compiled graph nor under CUDA-graph replay. That configuration's own logits say whether it kept the fault;
    where it did not, the fault lives only in code no hook sees, and the words say so."""
    from ..checks.compute.layers import CURVE_POINTS, error_curve, first_divergent_layer, off_by

    names = [j.request for j in failing]
    request = next((r for r in ("prompt", "chunked-prefill") if r in names), None)
    if request is None:
        return {"localized": False, "words": f"not localized to a layer: only the {' and the '.join(names)} request "
                                             "disagrees, and its activations are not captured (a request read from the "
                                             "prefix cache or a decode step runs through generation)"}
    tokens = s.tokens() if request == "prompt" else long_prompt(s, cfg)
    eager = _eager(cfg)
    what = "as configured" if eager else "made eager with vLLM's custom ops in their native forms"
    capturer = engine if eager else engine.reverted("eager_native")
    s.progress(f"configured ladder: localizing the {request} {what}")
    ran = s.engine_run() if capturer is s.engine() and tokens == s.tokens() else capturer.run(tokens, s.given_config())
    budget = capturer.noise_budget(ran)
    out: dict[str, Any] = {"localized": False, "request": request, "configuration": what}
    if all(c.ok for c in _criteria(s, ran.logits, tokens, slice(0, len(tokens)), budget)):
        return {**out, "kept_fault": False,
                "words": f"not localized to a layer: {what} the engine agrees on the {request}, so the fault lives only "
                         "in code forward hooks cannot see (a compiled graph, CUDA-graph replay)"}
    ref_caps = s.reference("float32", tokens=tokens)[1]
    emu_caps = s.reference(budget.dtype, budget.emulate, tokens=tokens)[1]
    curve = error_curve(ref_caps, emu_caps, ran.captures, s.config().n_layer, points=CURVE_POINTS)
    layer, point = first_divergent_layer(curve) if curve else (None, None)
    if point is None:
        why = "every captured activation is within its noise" if curve else "the engine exposed no activations"
        return {**out, "kept_fault": True, "points": len(curve),
                "words": f"not localized to a layer: {what} the {request} still disagrees, but {why}"}
    return {**out, "localized": True, "kept_fault": True, "layer": layer, "point": point.point, "error": point.error,
            "limit": point.limit, "curve": [q.as_dict() for q in curve if q.layer in (layer - 1, layer, layer + 1)],
            "words": f"{what} the {request} still disagrees: first divergent layer {layer}, {point.point}-{layer} "
                     f"{off_by(point)}"}
