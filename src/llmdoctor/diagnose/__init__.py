"""`llmdoctor diagnose`: the elimination plan over the layers of a deployment.

One way: inputs -> the engine's runs -> the reference (replaying the engine's choices) -> checks -> verdict ->
report, each step reading only what the steps before it produced.

    inputs.py      what is examined, and the command line's policy (resolved once)
    session.py     the evidence, computed once and lazily (the file, the engine's runs through the engine
                   interface, subjects/engines, the reference's runs); it judges nothing
    replay.py      the named step between them: what the reference takes from the engine's runs (the model it
                   ran, its MoE/DSA choices)
    hypotheses.py  one small function per hypothesis: evidence -> a check in checks/ -> findings (decode.py: the
                   decode path's); substitute.py: op substitution, one routine and one rule
    plan.py        the ordered table of hypotheses, what each needs (the skip reasons) and README's table
    verdict.py     suspects ranked by stack order (each finding's plan step), the verdict and the exit code
"""

from __future__ import annotations

import time
from typing import Callable

from ..checks.base import Finding
from ..errors import GGUFError
from ..reference.stages import Stages, stage
from .inputs import DEFAULT_PROMPT, Inputs
from .hypotheses import layer_curve
from .plan import PLAN, Hypothesis
from .session import NO_GGUF, Session, Skip
from .verdict import Diagnosis, judge

__all__ = ["DEFAULT_PROMPT", "NO_GGUF", "PLAN", "Diagnosis", "Hypothesis", "Inputs", "Session", "Skip", "run"]


def run(inputs: Inputs, progress: Callable[[str], None] = lambda s: None) -> Diagnosis:
    """Every hypothesis of the plan, in order, on one session's evidence; then the verdict."""
    if inputs.engine is not None:
        from ..subjects.engines import engine_class

        engine_class(inputs.engine)  # an unknown engine is bad input
    s = Session(inputs, progress)
    try:
        findings: list[Finding] = []
        timings: dict[str, float] = {}
        with Stages() as stages:
            for hyp in PLAN:
                progress(hyp.question)
                t0 = time.perf_counter()
                with stage("read" if hyp.key in READING else "judging"):
                    findings.extend(_findings(hyp, s))
                timings[hyp.key] = round(time.perf_counter() - t0, 2)
            with stage("judging"):
                suspects, ruled_out, verdict, code = judge(findings, inputs)
        return Diagnosis(findings, suspects, ruled_out, verdict, code, layer_curve(s, findings), timings, s.threads,
                         engine_run=s.engine_info(), stages={k: round(v, 3) for k, v in stages.seconds.items()},
                         device=_device_report(s))
    finally:
        s.close()


# The hypotheses that only read the file (parse, hash, forensics); the decoding, reference and engine work they
# start is counted to those stages (reference/stages.py), the rest of every other hypothesis is judging.
READING = ("file-integrity", "engine-file", "metadata")


def _device_report(s: Session) -> dict:
    """Where the reference ran, its device budget's counts, and CUDA's own peak where CUDA ran."""
    import torch

    out = {"device": s.inputs.device, **s.device_budget.as_dict()}
    if s.inputs.device.startswith("cuda"):
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(torch.device(s.inputs.device))
    return out


def _findings(hyp: Hypothesis, s: Session) -> list[Finding]:
    """One hypothesis's findings, each marked with it (Finding.step; a sub-check's keep their own check): skipped
    with the first missing need, or run (a Skip it raises on the way, or a model file that cannot be read, is a
    skip with that reason)."""
    def skip(reason: str) -> list[Finding]:
        return [Finding(check=hyp.key, subject=s.inputs.engine or "-", target="-", status="skip", reason=reason,
                        hypothesis=hyp.question, step=hyp.key)]

    try:
        if (why := hyp.missing(s)) is not None:
            return skip(why)
        fs = hyp.run(s)
    except Skip as e:
        return skip(str(e))
    except GGUFError as e:  # the file-integrity finding already names the problem
        return skip(f"the model file cannot be read: {e.problem}")
    for f in fs:
        f.hypothesis, f.step = f.hypothesis or hyp.question, hyp.key
    return fs
