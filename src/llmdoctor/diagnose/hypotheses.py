"""The hypotheses of a diagnosis, one small function each: gather the session's evidence, ask the check
in checks/ that judges it, and say the answer as findings. The plan (plan.py) orders them and says what
each needs; a hypothesis that cannot run raises Skip with the reason."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..checks.base import Finding
from ..checks.compute.allowance import SETTLE, marginal, times
from ..checks.compute.layers import off_by
from ..subjects.engines.base import EngineError, torch_dtype_name
from .session import Session, Skip
from .substitute import held_weights, substitutions

FP16_MAX = 65504.0


def _finding(check: str, subject: str, target: str, status: str, **kw: Any) -> Finding:
    return Finding(check=check, subject=subject, target=target, status=status, **kw)


# ---- judgements several hypotheses share, each made once per diagnosis from the session's evidence ----------
def draw_columns(s: Session) -> torch.Tensor:
    """[T, C]: the tokens whose logits each randomized draw keeps (checks/compute/allowance.py `columns`: the
    reference's top tokens and the engine's top-1)."""
    from ..checks.compute.allowance import columns

    return s.once("draw-columns", lambda: columns(s.reference("float32")[0], torch.as_tensor(s.engine_run().logits)))


def draws(s: Session) -> list:
    """The session's n_draws randomized draws of the engine's arithmetic (Session.draw), each summarized against the
    float32 reference (allowance.summarize): the allowances of engine-vs-reference and layer-localization."""
    from ..checks.compute.allowance import summarize

    if not s.n_draws:
        return []
    ref, ref_caps, _ = s.reference("float32")
    cols = draw_columns(s)
    return [s.draw(i, lambda logits, caps: summarize(logits, caps, ref, ref_caps, cols)) for i in range(s.n_draws)]


def draws_on(s: Session, tokens: list[int], rows: slice, replay: bool = True, more: int = 1,
             point_rows: slice | None = None) -> tuple[list, Any]:
    """(summaries, cols): the session's randomized draws of the engine's arithmetic on other `tokens` (the decode
    steps' prompt + continuation, a configured request), each summarized at `rows` against the float32 reference of
    the same tokens under the same choice set (`replay`, Session.reference), keeping the reference's top tokens
    (the engine that will be judged is not known when they are made: several configurations' runs share them).
    `more` times the session's number of draws: the decode steps ask twice as many (a step is one position, judged
    against its own spread: t_16's quantile at a diagnosis's level is 6.7 where t_8's is 10.6, so a single wrong
    step stands out; few rows make them cheap). `point_rows`: each draw's activations are measured too, at those
    positions (the decode steps' points, decode.py). The prompt's own draws where they are the same. ([], None)
    without draws."""
    from ..checks.compute.allowance import columns, summarize

    if not s.n_draws:
        return [], None
    ids = list(tokens)
    if ids == s.tokens() and replay and more == 1 and range(*rows.indices(len(ids))) == range(len(ids)):
        return draws(s), draw_columns(s)
    ref_all, ref_caps, _ = s.reference("float32", tokens=ids, replay=replay)
    ref, cols = ref_all[rows], columns(ref_all[rows])
    key = f"-rows-{rows.start}-{rows.stop}"
    at = {}
    if point_rows is not None:
        at = {k: v[point_rows] for k, v in ref_caps.items() if getattr(v, "ndim", 0) and v.shape[0] == len(ids)}
        key += f"-points-{point_rows.start}-{point_rows.stop}"

    def summary(logits, caps):
        return summarize(logits[rows], {k: caps[k][point_rows] for k in at if k in caps}, ref, at, cols)

    return [s.draw(i, summary, tokens=ids, replay=replay, key=key) for i in range(more * s.n_draws)], cols


def family(s: Session) -> int:
    """How many items the diagnosis judges against the draws (allowance.py sets every threshold for all of them):
    two per position (top-1, KL), the mean KL, and every layer point the engine and the reference both captured;
    two per decode step and the mean KL, for the decode steps and for the engine's prefill of them, and where the
    decode path judges their activations (`decode_points_judged`) every point the decode steps expose, twice;
    the configured deployment's own requests (configured.py `planned_items`); two per indexer layer whose
    selection dsa-selection judges (its queries and its keys) and one per MoE layer whose routing the engine
    exposes (moe-routing)."""
    from ..checks.compute.layers import CURVE_POINTS
    from .requests import planned_items

    def make() -> int:
        engine_caps, (_, ref_caps, _) = s.engine_run().captures, s.reference("float32")
        points = sum(f"{p}-{il}" in engine_caps and f"{p}-{il}" in ref_caps
                     for il in range(s.config().n_layer) for p in CURVE_POINTS)
        steps = max(s.inputs.generate - 1, 0)
        decode = 2 * (2 * steps + 1) if steps else 0
        if steps and decode_points_judged(s):
            try:
                shown = s.generation(captures=True).captures
            except Skip:  # no generation: no decode point is judged
                shown = {}
            decode += 2 * sum(f"{p}-{il}" in shown and f"{p}-{il}" in ref_caps
                              for il in range(s.config().n_layer) for p in CURVE_POINTS)
        moe = sum(f"ffn_moe_topk-{il}" in engine_caps for il in range(s.config().n_layer))
        choices = 2 * len(indexer_layers(s)) + moe
        return 2 * len(s.tokens()) + 1 + points + decode + planned_items(s) + choices

    return s.once("family", make)


def decode_points_judged(s: Session) -> bool:
    """Whether the decode path judges the decode steps' activations (decode.py `decode_points`): the engine's
    generation exposes them, and the model makes no discrete choice (the reference's activations are then those of
    the engine's own path; a model with choices has its decode steps' activations compared only to localize a fault
    its distributions show)."""
    from . import replay

    return s.engine().traits.decode_captures is not None and not replay.has_choices(s.config())


def indexer_layers(s: Session) -> list[int]:
    """The layers whose DSA key selection dsa-selection judges: the engine exposes it, and the prompt is longer
    than the indexer's top k (else every query keeps every key it sees)."""
    m = s.config().mla
    if m is None or m.indexer is None or len(s.tokens()) <= m.indexer.top_k:
        return []
    caps = s.engine_run().captures
    return [il for il in range(s.config().n_layer) if f"top_k-{il} (view)" in caps or f"top_k-{il}" in caps]


def prefill_criteria(s: Session) -> list:
    """The engine's next-token distributions of the prompt against the reference's, each criterion against the
    spread of the randomized draws of the engine's arithmetic, set for the whole diagnosis (checks/compute/layers.py
    `distribution_criteria`): engine-vs-reference reports them, the decode path asks whether the prefill already
    disagrees (float64 over [T, V]: seconds, so made once)."""
    from ..checks.compute.layers import distribution_criteria

    return s.once("prefill-criteria", lambda: distribution_criteria(
        torch.as_tensor(s.engine_run().logits), s.reference("float32")[0], s.budget_reference()[0], s.tokens(),
        draws=draws(s), cols=draw_columns(s), family=family(s), unseen=s.choices_unseen()))


def divergence(s: Session):
    """(error curve, first divergent layer or None, its point) of the engine's activations against the
    reference, each point against its spread over the randomized draws (checks/compute/layers.py): made once,
    for dsa-selection, moe-routing and layer-localization."""
    def make():
        from ..checks.compute.layers import CURVE_POINTS, error_curve, first_divergent_layer

        engine_caps = s.engine_run().captures
        _, ref_caps, _ = s.reference("float32")
        _, emu_caps, _ = s.budget_reference()
        curve = error_curve(ref_caps, emu_caps, engine_caps, s.config().n_layer, points=CURVE_POINTS,
                            draws=draws(s), family=family(s))
        return (curve, *first_divergent_layer(curve)) if curve else (curve, None, None)

    return s.once("divergence", make)


def layer_curve(s: Session, findings: list[Finding]) -> list[dict]:
    """The report's layer curve: every point of the divergence, where layer-localization judged it."""
    if not any(f.step == "layer-localization" and f.status != "skip" for f in findings):
        return []
    return [p.as_dict() for p in divergence(s)[0]]


def h_file_integrity(s: Session) -> list[Finding]:
    """The file parses under the hardened reader, every weight decodes to finite numbers, and no tensor
    stands out from its role siblings (checks/file/forensics.py: block scales and weight statistics). When
    the reference reads this same file, one more finding says what that cannot see."""
    from ..checks.file import forensics
    from ..checks.file.tensor_stats import tensor_stats
    from ..gguf import GGUFError

    try:
        g = s.gguf()
    except GGUFError as e:
        at = f" at offset {e.offset}" if e.offset is not None else ""
        return [_finding("file-integrity", "gguf", str(s.inputs.gguf), "fail", reason=str(e),
                         hypothesis="the model file is intact", confidence="high",
                         metrics={"problem": e.problem, "offset": e.offset},
                         explanation=f"the model file is broken: {e.problem}{at} (no engine can load it correctly)")]
    s.progress(f"decoding all {len(g.tensors)} tensors (finite values, block-scale forensics)")
    # decoded once, reused by the reference runs (a model whose metadata is inconsistent is not built); a
    # tensor too large for the device budget whole (--max-gpu-memory) is decoded chunk by chunk on the CPU
    weights = s.model(path=s.gguf_path()).weights if s.inconsistency() is None else None
    held = lambda name: weights is not None and weights.has(name) and getattr(weights, "fits", bool)(name)  # noqa: E731
    stats = [tensor_stats(t, weights.get(t.name) if held(t.name) else None)
             for t in g.tensors if t.supported]
    found = forensics.compare(stats, file=s.inputs.gguf)
    # a sub-block finding (codes a quantizer never writes) or a sibling outlier is not a non-finite weight
    nonfinite = [f for f in found if f.status == "fail" and "outliers" not in f.metrics and "subblocks" not in f.metrics]
    out = [_finding(
        "file-integrity", "gguf", str(s.inputs.gguf), "fail" if nonfinite else "pass", confidence="high",
        hypothesis="the model file is intact: it parses and every weight is finite",
        metrics={"tensors": len(g.tensors), "values": sum(st.n_values for st in stats),
                 "tensors_with_non_finite": len(nonfinite)},
        evidence=[{"tensor": f.target, "problem": f.explanation} for f in nonfinite[:5]],
        explanation=(nonfinite[0].explanation + (f" (and {len(nonfinite) - 1} more tensors)" if len(nonfinite) > 1
                                                 else "") if nonfinite
                     else f"{len(g.tensors)} tensors parse and decode to finite values"))]
    for f in found:  # sibling outliers are this step's suspects too (ranked with it: Finding.step), as forensics
        if f.status == "fail" and "outliers" in f.metrics:
            f.confidence = "medium"
        elif f.status == "fail" and "subblocks" in f.metrics:  # an exact rule of llama.cpp's quantizer broken
            f.confidence = "high"
        if not any(f is n for n in nonfinite):
            out.append(f)
    if (s.inputs.engine is not None or s.inputs.endpoint is not None) and s.inputs.engine_gguf is None \
            and s.inputs.hf is None and s.inputs.manifest is None:
        out.append(_finding(
            "file-provenance", "reference", str(s.inputs.gguf), "skip", hypothesis="the file is the model that was published",
            reason="the reference reads the deployment's own file: a corrupted or mis-converted file misleads engine "
                   "and reference alike, so their agreement cannot see it (only the forensics above look at the "
                   "file itself). Close it with --hf DIR (the original checkpoint), --manifest m.json (hashes of a "
                   "known-good copy) or `llmdoctor diff FILE KNOWN_GOOD.gguf`"))
    return out + _manifest_findings(s, g)


def _manifest_findings(s: Session, g: Any) -> list[Finding]:
    """With --manifest: every tensor and metadata key that differs from the known-good copy's manifest."""
    if s.inputs.manifest is None:
        return []
    from ..checks.file.manifest import compare

    s.progress("hashing every tensor against the manifest")
    return compare(g, s.inputs.manifest)


def h_engine_file(s: Session) -> list[Finding]:
    """When the engine loads another file than the reference: does it describe the same model?"""
    from ..gguf import open_gguf

    other = s.inputs.engine_gguf

    g = s.gguf()
    diffs = []
    with open_gguf(other) as e:
        for key, f in g.fields.items():
            ef = e.fields.get(key)
            if ef is None or _meta_value(ef.value) != _meta_value(f.value):
                diffs.append({"key": key, "reference": _meta_value(f.value), "engine": None if ef is None
                              else _meta_value(ef.value)})
        changed = [t.name for t in g.tensors if not e.has_tensor(t.name)
                   or bytes(e.tensor(t.name).data) != bytes(t.data)]
    status = "fail" if diffs or changed else "pass"
    what = [f"metadata {d['key']}: {d['reference']} -> {d['engine']}" for d in diffs[:3]]
    what += [f"tensor {n} bytes differ" for n in changed[:3]]
    return [_finding("engine-file", s.inputs.engine, str(other), status, confidence="high",
                     hypothesis="the engine's model file is the reference file",
                     metrics={"metadata_diffs": len(diffs), "tensors_changed": len(changed)},
                     evidence=diffs[:5] + [{"tensor": n} for n in changed[:5]],
                     explanation=("the engine's model file differs from the reference: " + "; ".join(what))
                     if what else "same metadata and tensor bytes")]


def _meta_value(v: Any) -> Any:
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, list) and len(v) > 64:
        return f"<array of {len(v)}>"
    return v


def h_metadata(s: Session) -> list[Finding]:
    """Metadata plausibility (checks/file/plausibility.py): hard inconsistencies between the hyperparameters
    and the tensors (the steps that need a consistent model are then skipped), and advisories for values
    far from the architecture's published configs; then the front end the file carries
    (checks/frontend/audit.py): chat template, vocab, and llama.cpp's decoding of a sample of tokens."""
    from ..checks.frontend import audit as frontend
    from ..checks.file import plausibility
    from ..subjects.engines import gguf_pieces

    g = s.gguf()
    out = plausibility.run(g, s.inputs.gguf)
    with gguf_pieces(s.inputs.gguf) as pieces:
        fe = frontend.run(g, s.inputs.gguf, pieces, sample=frontend.PARITY_SAMPLE)
    for f in fe:  # a front-end fault ranks with this step (Finding.step), under its own check
        f.confidence = f.confidence or "high"
    return out + fe


def h_mapping(s: Session) -> list[Finding]:
    """GGUF<->HF names, shapes, quant types and metadata semantics (checks/layout/mapping.py); with --hf DIR
    also each tensor's numbers. The passing numeric findings are summarized in one."""
    from ..checks.layout import mapping
    from ..subjects.engines import engine_class

    s.progress("name map, shapes and metadata vs " + (str(s.inputs.hf) if s.inputs.hf else "the file's own metadata"))
    consumer = s.inputs.engine
    res = mapping.run(s.inputs.gguf, s.inputs.hf, consumer=consumer,
                      quantized_indexer=consumer is not None and engine_class(consumer).traits.quantized_indexer)
    config_only = s.inputs.hf is not None and Path(s.inputs.hf).is_file()
    out, numeric = [], []
    for f in res.findings:
        f.confidence = "high"
        if config_only and f.target == "numeric":
            continue  # a config.json asks for names, shapes and metadata only: no numbers were requested
        (numeric if f.status == "pass" and f.target.startswith("numeric/") else out).append(f)
    if numeric:
        worst = max(numeric, key=lambda f: f.metrics["rel_l2"] / f.budget["rel_l2_max"])
        out.append(_finding("mapping", "gguf<->hf", "numeric", "pass", confidence="high",
                            metrics={"tensors": len(numeric), "worst": worst.target,
                                     "worst_ratio": worst.metrics["rel_l2"] / worst.budget["rel_l2_max"]},
                            explanation=f"the file's tensors match the HF checkpoint within their quantization "
                                        f"band ({len(numeric)} tensors; worst {worst.target})"))
    return out


def _fold(findings: list[Finding], hypothesis: str, none_compared: str,
          most: int = 8) -> tuple[list[Finding], list[Finding]]:
    """A sub-check's findings as diagnose sees them: (its first `most` failures, answering `hypothesis`, the
    passes). Nothing compared at all is a Skip with the sub-check's reasons."""
    failed = [f for f in findings if f.status == "fail"][:most]
    for f in failed:
        f.confidence, f.hypothesis = "high", hypothesis
    compared = [f for f in findings if f.status == "pass"]
    if not failed and not compared:
        reasons = sorted({f.reason for f in findings if f.status == "skip"})
        raise Skip(f"{none_compared}: " + "; ".join(reasons[:2]))
    return failed, compared


DEQUANT_BLOCKS = 32  # blocks compared per tensor: first, last and 30 seeded ones


def h_dequant(s: Session) -> list[Finding]:
    """The engine's dequant kernel against the reference, on every tensor of the file."""
    from ..checks.kernels import dequant
    from ..subjects.kernels import IsolatedKernel

    kernel = s.dequant_kernel()
    s.progress(f"dequant kernel {kernel!r} vs the reference")
    res = dequant.run(s.inputs.gguf, IsolatedKernel, kernel=kernel, blocks=DEQUANT_BLOCKS, seed=s.inputs.seed)
    failed, compared = _fold(res.findings, f"the dequant kernel {kernel!r} is right",
                             f"kernel {kernel!r} compared no tensor")
    if failed:
        return failed
    g = s.gguf()
    types = sorted({g.tensor(f.target).type.name for f in compared if g.has_tensor(f.target)})
    return [_finding("dequant", kernel, f"{len(compared)} tensors", "pass", confidence="high",
                     hypothesis=f"the dequant kernel {kernel!r} is right",
                     metrics={"tensors_compared": len(compared), "types": types,
                              "tensors_skipped": len(res.findings) - len(compared),
                              "blocks_per_tensor": DEQUANT_BLOCKS, "seconds": round(res.seconds, 1)},
                     explanation=f"bit-exact on {len(compared)} tensors ({', '.join(types)})")]


def h_fp16_overflow(s: Session) -> list[Finding]:
    """Would float16 overflow? Margin of the float32 reference's max |activation| to 65504, per layer."""
    _, _, stats = s.reference("float32")
    peak = max(stats, key=lambda st: st["max_abs"])
    over = [st for st in stats if st["max_abs"] > FP16_MAX]
    first = over[0] if over else None
    dtype = (s.inputs.engine_dtype or "").lower()
    margins = [{"layer": st["layer"], "max_abs": st["max_abs"], "margin": FP16_MAX / st["max_abs"]
                if st["max_abs"] else math.inf} for st in stats]
    metrics = {"peak_abs": peak["max_abs"], "peak_layer": peak["layer"], "peak_at": peak["max_at"],
               "first_overflow_layer": first["layer"] if first else None, "engine_dtype": dtype or None}
    if first is None:
        return [_finding("fp16-overflow", "reference", "activations", "pass", confidence="high",
                         hypothesis="activations fit in float16", metrics=metrics, evidence=margins,
                         explanation=f"activations fit in float16: peak |activation| {peak['max_abs']:.4g} at "
                                     f"{peak['max_at']}, margin x{FP16_MAX / peak['max_abs']:.2f}")]
    msg = (f"the float32 residual stream reaches {first['max_abs']:.4g} at layer {first['layer']} "
           f"({first['max_at']}), beyond float16's 65504")
    if dtype in ("float16", "fp16", "half"):
        # confirm: the reference itself in float16 turns inf/NaN where predicted
        _, _, stats16 = s.reference("float16")
        nonfinite = next((st for st in stats16 if st["n_inf"] or st["n_nan"]), None)
        metrics["fp16_first_nonfinite_layer"] = nonfinite["layer"] if nonfinite else None
        return [_finding("fp16-overflow", s.inputs.engine or "deployment", "activations", "fail",
                         confidence="high" if nonfinite else "medium",
                         hypothesis="the deployment's float16 arithmetic overflows", metrics=metrics,
                         evidence=margins,
                         explanation=msg + (f"; the reference run in float16 turns inf/NaN at layer "
                                            f"{nonfinite['layer']} ({nonfinite['first_nonfinite']})"
                                            if nonfinite else "") +
                         ". Run the model in bfloat16 (same range as float32) instead of float16.")]
    return [_finding("fp16-overflow", "reference", "activations", "pass", confidence="high",
                     hypothesis="the deployment's arithmetic does not overflow (it does not run in float16)",
                     metrics={**metrics, "advisory": True},
                     evidence=margins,
                     explanation=f"advisory: {msg}. Harmless unless the deployment runs in float16 "
                                 f"(deployment precision: {dtype or 'unknown'}); use bfloat16 there.")]


def h_engine_finite(s: Session) -> list[Finding]:
    """inf/NaN in the engine's logits or captured activations where the reference's are finite: their own
    finding in words (checks/compute/finite.py), never a "KL nan" or an "off by nan"."""
    from ..checks.compute import finite

    ran = s.engine_run()
    ref, ref_caps, _ = s.reference("float32")
    out = [finite.logits_finding(s.inputs.engine, ran.logits, ref)]
    if (acts := finite.captures_finding(s.inputs.engine, ran.captures, ref_caps)) is not None:
        out.append(acts)
    return out


def h_engine_vs_reference(s: Session) -> list[Finding]:
    """The engine's next-token distributions match the reference within the engine's own noise: every
    criterion (finite logits, KL, top-1) against what the emulated run's arithmetic explains
    (checks/compute/layers.py `distribution_criteria`); the failing criteria are named."""
    from ..checks import metrics as M

    ref, _, _ = s.reference("float32")
    got = torch.as_tensor(s.engine_run().logits)
    crit = prefill_criteria(s)
    failed = [c for c in crit if not c.ok]
    by = {c.name: c for c in crit}
    metrics: dict[str, Any] = {}  # the numbers first: the terminal shows the first few
    budget: dict[str, Any] = {}
    if "kl" in by:
        top1 = M.top1_agreement(got, ref)
        worst = by["kl"].evidence[0]  # the position of the largest KL
        metrics.update(kl_mean=by["kl"].value, kl_max=worst["kl"], top1_agreement=top1,
                       top1_flips_beyond_noise=int(by["top1"].value), worst_position=worst["position"])
        budget.update(kl_mean_limit=by["kl"].limit, kl_noise_mean=by["kl"].noise,
                      top1_flips_allowed=int(by["top1"].limit))
    budget["arithmetic"] = s.budget().words  # whose noise: what the emulated run reproduces of the engine
    budget["allowances"] = {c.name: c.allowance for c in crit if c.allowance}
    metrics.update(positions=got.shape[0], failed_criteria=[c.name for c in failed],
                   reference_reads=str(s.reference_path()), criteria_ratio={c.name: c.times for c in crit},
                   marginal=[c.name for c in crit if c.marginal])
    edge = max((c for c in crit if c.ok), key=lambda c: c.times, default=None)
    return [_finding(
        "engine-vs-reference", s.inputs.engine, "next-token distributions", "fail" if failed else "pass",
        confidence="medium" if failed and all(c.marginal for c in failed) else "high",
        hypothesis="the engine computes the model's distribution", metrics=metrics,
        budget=budget, evidence=[c.as_dict() for c in crit],
        explanation=("the engine's next-token distributions differ from the model's beyond its own noise: "
                     + "; ".join(f"the {c.name} criterion fails: {c.reason}" for c in failed) if failed else
                     f"KL {by['kl'].value:.3g} (noise {by['kl'].noise:.3g}), top-1 {top1:.0%}: every top-1 flip "
                     "and the KL within the engine's noise" + (f"; closest to its allowance: {edge.name}, "
                                                                f"{times(edge.times)}" if edge else "")
                     + "".join(f"; {c.name}: {int(c.value)} position(s) beyond their draws' spread, "
                               f"within the {c.allowance['unseen_choices']['allowed']} that near-ties taken the "
                               "other way explain (the engine exposes its expert or key choices to no replay)"
                               for c in crit if c.value and (c.allowance or {}).get("unseen_choices")))
        + f" (the engine's arithmetic: {budget['arithmetic']})",
    )]


def h_engine_backends(s: Session) -> list[Finding]:
    """Which attention backends the engine (vLLM) selects for this model, dtype and platform, asked of its
    own selection code in the deployment's interpreter, against the backends the running engine built
    (checks/compute/backends.py). The finding lists what each backend setting would select instead."""
    from ..checks.compute.backends import mismatches

    engine = s.engine()
    try:  # the run asks the selection under the config the engine was built with
        info = s.engine_run().info
        built, explained = info.backends, info.explained
    except Skip as e:  # ask the selection alone: the engine's own reason the model cannot run
        built, ran = None, str(e)
        try:
            s.progress(f"{engine.title}'s own attention-backend selection")
            explained = engine.explain_backends()
        except EngineError as e:
            raise Skip(f"{ran}; {engine.title}'s backend selection could not run either: {e}") from None
    sel = explained["selected"]
    metrics = {"kind": explained["kind"], "selected": sel, "built": built, "knobs": explained["knobs"],
               "env": explained["env"], "vllm": explained["vllm"], "platform": explained["platform"]}
    if built is None:
        raise Skip(f"{ran}; {engine.title}'s own selection for this model: "
                   + (sel["error"] if sel.get("error") else f"{sel['decode']} (prefill {sel['prefill']})"))
    wrong = mismatches(built, explained)
    what = f"{sel['decode']}" + (f", prefill {sel['prefill']}" if explained["kind"] == "mla" else "")
    fixed = sorted(set((built.get("fixed") or {}).values()))  # caches whose backend the model names itself
    fixed_words = (f"; {len(built['fixed'])} cache layers with the backend their model class names, not selected: "
                   f"{', '.join(fixed)}") if fixed else ""
    return [_finding("engine-backends", engine.name, f"{explained['kind']} attention", "fail" if wrong else "pass",
                     confidence="high",
                     hypothesis=f"the engine runs the attention backends {engine.title} selects for this model",
                     metrics=metrics, evidence=[{"mismatch": w} for w in wrong[:5]],
                     explanation=(f"the engine built other backends than {engine.title}'s selection ({what}): {wrong[0]}"
                                  if wrong else f"{engine.title} {explained['vllm']} on {explained['platform']} selects "
                                  f"{what} for {explained['dtype']}, head size {explained['head_size']}, and built it in "
                                  f"every layer; settings that change it: {', '.join(sorted(explained['knobs'])) or 'none'}")
                     + fixed_words)]


def h_dsa_selection(s: Session) -> list[Finding]:
    """Per layer with a DSA indexer (GLM-5 glm-dsa): whether the keys the engine's indexer selects for
    each query (`top_k-{i}`) are among the reference's top k by the reference's own index scores (ties
    at the k-th score may go either way), against what the engine's own arithmetic explains (the
    emulated run's; checks/compute/routing.py), per query and per key (the picks far below the k-th score,
    which stand out where the FP8 indexer makes exact top-k sets rare). A wrong indexer (rope on the wrong
    dims, a missing weight, the wrong scale) shows here before the attention output does."""
    from ..checks.compute.allowance import FAMILY_LEVEL
    from ..checks.compute.routing import dsa_misses, dsa_rows

    m = s.config().mla
    if len(s.tokens()) <= m.indexer.top_k:
        raise Skip(f"{len(s.tokens())} tokens, top-k {m.indexer.top_k}: every query selects every key it sees "
                   "(give a longer prompt to test the indexer)")
    engine_caps = s.engine_run().captures
    _, ref_caps, _ = s.reference("float32")
    _, emu_caps, _ = s.budget_reference()
    rows = dsa_rows(s.config().n_layer, m.indexer.top_k, ref_caps, emu_caps, engine_caps,
                    FAMILY_LEVEL / family(s))
    if not rows:
        raise Skip("the engine exposed no indexer selections (top_k)")
    bad = [r for r in rows if dsa_misses(r)]
    if not bad:
        return [_finding("dsa-selection", s.inputs.engine, f"{len(rows)} indexer layers", "pass", confidence="high",
                         hypothesis="the engine's indexer selects the reference's keys",
                         metrics={"layers": len(rows), "max_disagreement": max(r["disagreement"] for r in rows),
                                  "max_wrong_picks": max(r["keys"]["wrong"] for r in rows)},
                         evidence=rows, explanation=f"the indexer selects keys the reference's scores allow in "
                                                    f"{len(rows)} indexer layers (at most "
                                                    f"{max(r['keys']['wrong'] for r in rows)} picks far below the "
                                                    "k-th score in a layer, within the engine's score error's "
                                                    "allowance)")]
    first = bad[0]
    _, layer, point = divergence(s)
    if layer is not None and (layer < first["layer"] or layer == first["layer"] and point.point == "attn_norm"):
        raise Skip(f"the indexer's inputs already differ: the engine diverges at {point.point}-{layer}, upstream of "
                   f"the first layer whose key selection differs ({first['layer']})")
    return [_finding("dsa-selection", s.inputs.engine, f"layer {first['layer']}", "fail", confidence="high",
                     hypothesis="the engine's indexer selects the reference's keys",
                     metrics={"first_layer": first["layer"], **first}, evidence=rows,
                     explanation=f"the sparse-attention indexer selects other keys from layer {first['layer']}: "
                                 f"{dsa_misses(first)}; check the indexer's rope dims and order, k norm, head weights "
                                 "and scale")]


def h_moe_routing(s: Session) -> list[Finding]:
    """Per MoE layer: whether the experts the engine chose (`ffn_moe_topk-{i}`) are a top-k choice the
    reference's selection scores allow, within what the engine's own arithmetic moves a score (the
    emulated run's score error, checks/compute/routing.py). Every reference run takes the engine's choices
    (replay.py), so a near-tie flip is neither a routing fault nor a divergence
    downstream. A missing score-correction bias, a wrong grouped top-k or a wrong gating function
    chooses experts the scores do not allow."""
    from ..checks.compute.allowance import FAMILY_LEVEL
    from ..checks.compute.routing import moe_rows, router_inputs_differ

    engine_caps = s.engine_run().captures
    _, ref_caps, _ = s.reference("float32")
    _, emu_caps, _ = s.budget_reference()
    rows = moe_rows(s.config().n_layer, s.config().moe, ref_caps, emu_caps, engine_caps,
                    FAMILY_LEVEL / family(s))
    if not rows:
        raise Skip("the engine exposed no routing decisions (ffn_moe_topk)")
    curve, _, _ = divergence(s)
    diverged = {(p.layer, p.point) for p in curve if p.divergent}
    for r in rows:  # the first MoE layer whose routing is wrong given the same inputs
        if not r["disagreement"]:
            continue
        il = r["layer"]
        upstream = router_inputs_differ(il, engine_caps, ref_caps, emu_caps, diverged)
        if upstream:
            raise Skip(f"the router's inputs already differ at layer {il} ({upstream}); routing there "
                       f"({r['disagreement']:.0%} of positions chose other experts) cannot be judged apart from "
                       "that divergence")
        return [_finding("moe-routing", s.inputs.engine, f"layer {il}", "fail", confidence="high",
                         hypothesis="the engine routes tokens to the reference's experts",
                         metrics={"first_layer": il, **r}, evidence=rows,
                         explanation=f"MoE routing differs from layer {il}: {r['disagreement']:.0%} of positions "
                                     f"chose experts the router's scores do not allow (positions {r['positions']}; "
                                     f"near-ties within {r['tolerance']:.2g} may go either way): check the "
                                     "score-correction bias, grouped top-k and gating function")]
    return [_finding("moe-routing", s.inputs.engine, f"{len(rows)} MoE layers", "pass", confidence="high",
                     hypothesis="the engine routes tokens to the reference's experts",
                     metrics={"layers": len(rows), "max_disagreement": max(r["disagreement"] for r in rows),
                              "near_ties_taken": sum(r["near_ties_taken"] for r in rows)},
                     evidence=rows, explanation=f"expert choices are ones the router's scores allow in "
                                                f"{len(rows)} MoE layers ({sum(r['near_ties_taken'] for r in rows)} "
                                                "near-ties taken the other way, which rounding may do)")]


def h_layer_localization(s: Session) -> list[Finding]:
    """Where the engine's activations leave the reference (noise-aware, layer by layer)."""
    curve, layer, point = divergence(s)
    if not curve:
        raise Skip("the engine exposed no activations that map onto the reference's capture points")
    if layer is None:
        worst = max(curve, key=lambda p: p.error / p.limit)
        return [_finding("layer-localization", s.inputs.engine, "layers", "pass", confidence="high",
                         hypothesis="every layer stays within the engine's noise",
                         metrics={"points": len(curve), "worst_ratio": worst.error / worst.limit,
                                  "worst": f"{worst.point}-{worst.layer}", "marginal": marginal(worst.ratio),
                                  "allowance": worst.allowance, "draws": worst.draws},
                         explanation=f"{len(curve)} points within budget; worst {worst.point}-{worst.layer} "
                                     f"at {worst.error / worst.limit:.2f} of its limit"
                                     + (f" (marginal: {SETTLE})" if marginal(worst.ratio) else ""))]
    swaps = substitutions(s, point)
    confirmed = [w for w in swaps if w["reproduces"]]
    pattern = _error_pattern(s, point)
    held = held_weights(s, point)
    held_differ = held.get("differ", [])[:2]
    causes = [f"the engine holds {w['tensor']} as {w['words']}" for w in held_differ if w.get("reproduces")]
    causes += [w["swap"] for w in confirmed]
    return [_finding("layer-localization", s.inputs.engine, f"layer {layer}", "fail",
                     confidence="medium" if marginal(point.ratio) else "high",
                     hypothesis="every layer stays within the engine's noise",
                     metrics={"first_divergent_layer": layer, "point": point.point, "error": point.error,
                              "noise": point.noise, "limit": point.limit, "ratio": point.ratio,
                              "marginal": marginal(point.ratio), "allowance": point.allowance, "draws": point.draws,
                              "cause": causes[0] if causes else None,
                              "substitutions": swaps, "error_pattern": pattern.as_dict() if pattern else None,
                              "engine_weights": held},
                     evidence=[p.as_dict() for p in curve if p.layer in (layer - 1, layer, layer + 1)],
                     explanation=_localization_words(layer, point, swaps, pattern, held, held_differ))]


# The capture points in a user's words (reference/points.py names them).
POINT_WORDS = {"attn_norm": "the attention's normed input", "q_pe": "the rope part of q after RoPE",
               "k_pe": "the rope part of k after RoPE", "Qcur": "q after RoPE", "Kcur": "k after RoPE",
               "kqv_out": "the attention output", "ffn_inp": "the residual stream after attention",
               "ffn_out": "the feed-forward output", "l_out": "the layer's output"}


def _localization_words(layer: int, point, swaps: list[dict], pattern, held: dict, held_differ: list[dict]) -> str:
    """The layer-localization sentence: the cause in words first where one is known (a held weight or an
    arithmetic swap that alone reproduces the divergence, confirmed by substitution, or the RoPE variant the
    error pattern's experiment reproduces), else what leaves the reference where; then the numbers, what does
    not reproduce it, the error's pattern and the held weights' other news."""
    at = f"{point.point}-{layer}"
    held_cause = [w for w in held_differ if w.get("reproduces")]
    confirmed = [w for w in swaps if w["reproduces"]]
    causes = [f"the cause: the engine holds {w['tensor']} as {w['words']}; swapped into the reference it alone "
              "reproduces the divergence" for w in held_cause]
    if confirmed:
        causes.append(f"the cause: {confirmed[0]['swap']}; swapping it into the reference alone reproduces it")
    if pattern is not None and pattern.cause:
        causes.append(pattern.cause)
    lead = "; ".join(causes) or (f"the engine computes {POINT_WORDS.get(point.point, at)} of layer {layer} "
                                 "unlike the model")
    words = f"{lead} (first divergent layer {layer}: {at} {off_by(point)})"
    if swaps and not confirmed:
        words += f"; no {'arithmetic' if held_cause else 'single'} swap into the reference reproduces it"
    if pattern and pattern.kind != "none" and pattern.words not in pattern.cause:
        words += f"; its error: {pattern.words}"
    if held.get("unread"):
        words += f"; the weights it loaded were not compared ({held['skipped']})"
    for w in (w for w in held_differ if not w.get("reproduces")):
        stays = w.get("swap_error") is not None and w["swap_error"] < point.limit  # None: the swap could not run
        effect = f"{at} stays as the reference's" if stays else f"it does not reproduce {at}"
        words += f"; the engine {'also ' if held_cause else ''}holds {w['tensor']} as {w['words']} " \
                 f"(swapped in alone, {effect})"
    return words


def _error_pattern(s: Session, point):
    """The spread of the engine's error at its first divergent point over positions, heads and channels
    (checks/compute/error_pattern.py), with the RoPE experiment at a point right after RoPE; None when that
    point is not finite or not in every run."""
    from ..checks.compute.error_pattern import error_pattern

    name = f"{point.point}-{point.layer}"
    engine, ref, emu = s.engine_run().captures, s.reference("float32")[1], s.budget_reference()[1]
    if not math.isfinite(point.error) or not all(name in c for c in (engine, ref, emu)):
        return None
    return error_pattern(engine[name], ref[name], emu[name], rope=rope_at(s.config(), point, len(s.tokens())),
                         point=name)


def rope_at(cfg, point, n_tokens: int):
    """The reference's RoPE (model config `cfg`) at `point` (a PointError) of a prompt of n_tokens positions from 0,
    when that point is right after RoPE (checks/compute/error_pattern.Rope), else None: dense q/k
    (Qcur/Kcur) rotate the first rope_dim channels of each head, MLA's q_pe/k_pe every channel and its
    Qcur/Kcur the last qk_rope (after the latent). Its angles per position are read from the reference's own
    tables at positions 0 and 1 (reference/forward.py rope_qk, reference/mla.py rope_tables): every pair turns
    by less than pi per position, and position 0's cosine is YaRN's magnitude."""
    import numpy as np

    from ..checks.compute.error_pattern import Rope
    from ..reference import attention as attn, mla as mla_ref

    m = cfg.mla
    if point.point not in ("Qcur", "Kcur", "q_pe", "k_pe"):
        return None
    base, two = cfg.layer_rope_base(point.layer), torch.arange(2)
    if m is None:
        ff = None if cfg.rope_freq_factors is None else torch.tensor(cfg.rope_freq_factors, dtype=torch.float64)

        def tables(b: float):
            return attn.rope_cos_sin(two, cfg.rope_dim, b, pos_scale=cfg.rope_scale, freq_factors=ff)

        dim, start, neox = cfg.rope_dim, 0, cfg.rope_neox
    else:
        def tables(b: float):
            return mla_ref.rope_tables(two, m, b, torch.float64)

        dim, neox = m.qk_rope, False  # reference/mla.py rope_pairs
        start = 0 if point.point in ("q_pe", "k_pe") else m.kv_lora_rank
    cos, sin = tables(base)
    return Rope(dim, neox, torch.atan2(sin[1], cos[1]).numpy(), np.arange(n_tokens), start=start,
                attn_factor=float(cos[0, 0]), base=base,
                inv_for=lambda b: torch.atan2(tables(b)[1][1], tables(b)[0][1]).numpy())


def h_attention(s: Session) -> list[Finding]:
    """`check attention` of the given kernel on this model's attention shape (checks/kernels/attention.py)."""
    from ..checks.kernels import attention
    from ..checks.kernels.attention_shapes import shape_from_config
    from ..subjects.attention import IsolatedAttention

    shape = shape_from_config(s.config(), Path(s.reference_path()).name)
    dtype = torch_dtype_name(s.inputs.engine_dtype) if s.inputs.engine_dtype else "float32"
    res = attention.run(shape, [(s.inputs.attention_impl, s.inputs.attention_contract)], IsolatedAttention,
                        dtypes=(dtype,), seed=s.inputs.seed, on_step=s.progress)
    failed, compared = _fold(res.findings, "the attention kernel computes the reference's attention",
                             "the attention kernel compared no case")
    if failed:
        return failed
    return [_finding("attention", s.inputs.attention_impl, f"{len(compared)} cases", "pass", confidence="high",
                     hypothesis="the attention kernel computes the reference's attention",
                     metrics={"cases_passed": len(compared),
                              "cases_skipped": sum(f.status == "skip" for f in res.findings), "dtype": dtype},
                     explanation=f"the attention kernel computes the reference's attention in {len(compared)} cases "
                                 f"within the {dtype} budget (float32: the any-order rounding bound; half precision: "
                                 "4x the noise floor)")]


def h_symptom_bisection(s: Session) -> list[Finding]:
    """Black-box probes of the endpoint (checks/endpoint/probes.py), against the reference when --gguf is given."""
    from ..checks.endpoint.probes import probe
    from ..subjects.endpoint import Endpoint
    from ..subjects.engines.endpoint import EndpointEngine

    with Endpoint(s.inputs.endpoint) as ep:
        rep = probe(ep, EndpointEngine.over(ep), gguf=s.inputs.gguf, seed=s.inputs.seed, progress=s.progress)
    if rep.verdict == "inconclusive" and not any(f.status == "fail" for f in rep.findings):
        raise Skip(f"the endpoint probes were inconclusive: {', '.join(rep.symptoms) or 'no evidence'}")
    for f in rep.findings:  # each probe's finding ranks with this step (Finding.step), under its own check
        f.confidence = f.confidence or "medium"
    return rep.findings


def h_front_end(s: Session) -> list[Finding]:
    """The deployment's own tokenization of a fixed set of prompts and a chat against the reference's
    (checks/frontend/engine.py). Where they differ, the compute runs twice on the first differing prompt,
    the engine on its own tokens (what users get) and on the reference's (the compute alone), each against
    the reference on the reference's tokens at the last position (the next token a user sees), so that the
    report can tell a front-end fault from a layer's."""
    from ..checks.frontend import engine as fe

    from ..errors import InputError

    def reference_front_end() -> fe.ReferenceFrontEnd:
        if s.checkpoint() is not None or s.inputs.gguf is None:
            return fe.ReferenceFrontEnd(s.reference_path())
        from ..reference.tokenizer import Tokenizer

        tok = s.once("gguf-tokenizer", lambda: Tokenizer.from_gguf(s.gguf()))  # the one Session.tokens() uses
        return fe.ReferenceFrontEnd(s.gguf_path(), tokenizer=tok)

    engine = s.engine()
    try:
        ref = s.once("reference-front-end", reference_front_end)
    except InputError as e:  # a model file without a tokenizer (diagnosed from --token-ids)
        raise Skip(f"no front end to compare against: {e}") from None
    try:
        rows = fe.compare(engine, ref, s.inputs.prompt, s.progress)
    except EngineError as e:
        raise Skip(f"the engine's front end could not run: {e}") from None
    f = fe.finding(engine, ref, rows)
    if f.status == "skip":
        raise Skip(f.reason)
    if f.status == "fail":
        row = next(r for r in rows if r.differs())
        runs = _front_end_compute(s, ref, row)
        f.metrics["compute_runs"] = runs
        own, alone = runs.get("engine_tokens"), runs.get("reference_tokens")
        if own and alone and "kl" in own and "kl" in alone:
            f.explanation += (f". On its own tokens the engine's next token is {own['engine_next']!r} (the reference's "
                              f"{own['reference_next']!r}, KL {own['kl']:.3g}); on the reference's tokens "
                              f"{alone['engine_next']!r} (KL {alone['kl']:.3g})")
            if alone["top1_agrees"] and alone["kl"] < own["kl"]:
                f.explanation += ": the front end is the cause; the compute agrees on the reference's tokens " \
                                 "(engine-vs-reference judges the layers)"
    return [f]


def _front_end_compute(s: Session, ref, row) -> dict[str, Any]:
    """The engine's last-position distribution on its own tokens of `row`'s prompt and on the reference's,
    each against the float32 reference on the reference's tokens: KL (checks/metrics.py) and next tokens."""
    from ..checks import metrics as M

    out: dict[str, Any] = {"prompt_label": row.label, "position": "the last (the next token a user gets)"}
    try:
        want = s.reference_logits_on(row.reference)[-1]
    except Skip as e:
        return {**out, "skipped": str(e)}
    for key, ids in (("engine_tokens", row.engine), ("reference_tokens", row.reference)):
        try:
            got = torch.as_tensor(s.engine_run_on(ids).logits[-1])
        except Skip as e:
            out[key] = {"skipped": str(e)}
            continue
        out[key] = {"tokens": len(ids), "kl": float(M.kl_divergence(got, want)),
                    "top1_agrees": int(got.argmax()) == int(want.argmax()),
                    "engine_next": ref.piece(int(got.argmax())), "reference_next": ref.piece(int(want.argmax()))}
    return out
