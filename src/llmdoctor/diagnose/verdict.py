"""The verdict of a diagnosis: its findings ranked into suspects (stack order of the plan step each answers,
Finding.step, then confidence), what was ruled out, one sentence and the exit code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..checks.base import Finding, count
from .inputs import Inputs
from .plan import order

CONFIDENCE_ORDER = {"high": 0, "medium": 1, "low": 2, "": 3}


@dataclass
class Diagnosis:
    findings: list[Finding]
    suspects: list[Finding]
    ruled_out: list[Finding]
    verdict: str
    exit_code: int
    curve: list[dict] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    reference_threads: int | None = None  # torch's thread count in every reference run (Session.threads)
    # what the engine said of itself when it ran: its versions as its own environment has them (vLLM's
    # driver reports the deployment's vLLM, torch and transformers; env.engines is llmdoctor's environment)
    engine_run: dict[str, Any] | None = None
    # seconds by stage (read, decode, reference, engine, judging: reference/stages.py), each exclusive of the others
    stages: dict[str, float] = field(default_factory=dict)
    device: dict[str, Any] | None = None  # where the reference ran and what its weights held there (device_cache.py)

    def to_dict(self) -> dict[str, Any]:
        return {
            "suspects": [f.id for f in self.suspects],
            "ruled_out": [f.id for f in self.ruled_out],
            "layer_curve": self.curve,
            "engine_run": self.engine_run,
            "reference_threads": self.reference_threads,
            "timings_s": self.timings,
            "stages_s": self.stages,
            "device": self.device,
        }


def named_subjects(inputs: Inputs) -> set[str]:
    """Hypotheses whose subject the user named explicitly: if one cannot run, nothing healthy can be
    concluded about it (exit 2), unlike a hypothesis merely implied by the plan."""
    named = set()
    if inputs.dequant_kernel:
        named.add("dequant")
    if inputs.attention_impl:
        named.add("attention")
    if inputs.endpoint:
        named.add("symptom-bisection")
    if inputs.hf and inputs.gguf is not None:  # an HF checkpoint alone is the reference's model, not a mapping
        named.add("mapping")
    if inputs.engine:
        named.add("engine-vs-reference")
    if inputs.tokenizer:
        named.add("front-end")
    return named


def judge(findings: list[Finding], inputs: Inputs) -> tuple[list[Finding], list[Finding], str, int]:
    """(suspects, ruled out, verdict sentence, exit code)."""
    rank = order()
    suspects = sorted((f for f in findings if f.status == "fail"),
                      key=lambda f: (rank.get(f.step, 99), CONFIDENCE_ORDER.get(f.confidence, 3)))
    ruled_out = [f for f in findings if f.status == "pass"]
    c = count(findings)
    if suspects:
        # the option whose reversal makes the engine agree is the most specific cause: it leads where it is named
        option = next((f for f in suspects if f.step == "configured-ladder"), None)
        verdict, code = f"fault found: {(option or suspects[0]).explanation}", 1
        if option is not None and suspects[0] is not option:
            verdict += f"; {suspects[0].explanation}"
        layer = next((f for f in suspects if f.step == "layer-localization"), None)
        if layer is not None and suspects[0] is not layer:
            cause = layer.metrics.get("cause")
            rope = (layer.metrics.get("error_pattern") or {}).get("cause")  # the RoPE variant it reproduces
            verdict += f" (first divergent layer: {layer.metrics['first_divergent_layer']}" \
                       + (f"; confirmed by substitution: {cause})" if cause else f"; {rope})" if rope else ")")
    elif missing := [f for f in findings if f.status == "skip" and f.step in named_subjects(inputs)
                     and not any(g.step == f.step and g.status != "skip" for g in findings)]:
        verdict, code = f"could not diagnose: {missing[0].step} could not run: {missing[0].reason}", 2
    elif c["passed"] == 0 or not any(f.step in ("engine-vs-reference", "layer-localization")
                                     and f.status == "pass" for f in findings) and inputs.engine:
        verdict, code = "could not diagnose: nothing was compared", 2
    else:
        verdict, code = "healthy", 0
    return suspects, ruled_out, verdict, code
