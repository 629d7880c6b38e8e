"""`llmdoctor check attention`: attention kernels against the float64 reference, case by case.

Each subject, opened by the caller (`open_subject`: subjects.attention.IsolatedAttention, a child
process), takes every case of the model's attention shape (attention_shapes, attention_suite) on fresh
inputs (attention_inputs) in each dtype; a subject taking `out=` gets a NaN-filled buffer. Each answer
is judged against the reference within the case's budget (attention_verdicts, attention_budgets), a
failure explained by signature and pattern (attention_explanations), and a subject with several
contracts checked against itself (attention_consistency).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ...errors import InputError
from ...outcomes import LoadFailed
from ..base import Finding, count
from .attention_budgets import Floor, noise_floor
from .attention_calls import run_case
from .attention_consistency import consistency
from .attention_explanations import subject_patterns
from .attention_inputs import case_seed, fp8_cache, make_inputs, stale_unused_rows
from .attention_shapes import Shape
from .attention_suite import cases, shape_for
from .attention_verdicts import CHECK, judge, unused_rows_verdict

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class Result:
    shape: Shape
    device: str
    findings: list[Finding] = field(default_factory=list)
    patterns: dict[str, list[str]] = field(default_factory=dict)
    subjects: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0


def run(shape: Shape, subjects: list[tuple[str, Optional[str]]], open_subject: Callable[..., Any], *,
        device: str = "cpu", dtypes: tuple[str, ...] = DTYPES, timeout: float = 300.0, seed: int = 0,
        only: Optional[set[str]] = None, on_step: Optional[Callable[[str], None]] = None) -> Result:
    """Run every case of `shape` through each (spec, contract or None) subject. `open_subject(spec, contract,
    device=, timeout=)` gives the subject as a context manager with `start()` (raises LoadFailed), `call`
    (attention_calls.AttentionKernel) and `restarts`: subjects.attention.IsolatedAttention."""
    if device not in ("cpu", "cuda"):
        raise InputError(f"--device {device!r}: expected cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device cuda: CUDA is not available here (torch {torch.__version__})")
    for d in dtypes:
        if d not in DTYPES:
            raise InputError(f"--dtype {d!r}: expected one of {', '.join(DTYPES)}")
    res = Result(shape, device)
    t0 = time.perf_counter()
    all_cases = [c for c in cases(shape) if only is None or c.name in only]
    floors: dict[tuple[str, str], Optional[Floor]] = {}
    dev = "cuda" if device == "cuda" else "cpu"
    shapes = {c.name: shape_for(shape, c) for c in all_cases}
    inputs = {c.name: make_inputs(shapes[c.name], c, case_seed(seed, c), dev) for c in all_cases}
    inputs |= {c.name: fp8_cache(inputs[c.name]) for c in all_cases if c.fp8_cache}
    for spec, contract in subjects:
        label = spec if contract is None else f"{spec} ({contract})"
        st = time.perf_counter()
        found: list[Finding] = []
        with open_subject(spec, contract, device=device, timeout=timeout) as kernel:
            try:
                kernel.start()
            except LoadFailed as e:
                if e.kind == "InputError":
                    raise InputError(str(e)) from None
                res.findings.append(Finding(CHECK, label, "load", "skip", reason=f"{label} could not run: {e}"))
                res.subjects[label] = {"loaded": False, "reason": str(e)}
                continue
            mine = [c for c in all_cases if contract is None or c.contract == contract]
            has: set[str] = set()
            for dname in dtypes:
                dtype = getattr(torch, dname)
                for case in mine:
                    if on_step:
                        on_step(f"{label}: {case.name} {dname}")
                    key, sh = (case.name, dname), shapes[case.name]
                    if key not in floors:  # float32 is judged by its derived bound, not an emulated floor
                        floors[key] = None if dtype == torch.float32 else noise_floor(sh, case, dtype, dev)
                    got = run_case(kernel, sh, case, inputs[case.name], dtype)
                    f = judge(sh, case, inputs[case.name], got, floors[key], dname, label)
                    if case.contract != "prefill" and f.status == "fail" and f.metrics.get("nonfinite_where_finite"):
                        x2 = stale_unused_rows(inputs[case.name], case_seed(seed, case) + 1)
                        f = unused_rows_verdict(f, judge(sh, case, x2, run_case(kernel, sh, case, x2, dtype),
                                                         floors[key], dname, label))
                    if not case.probe and (f.status != "skip" or "has no" not in f.reason):
                        has.add(case.contract)
                    found.append(f)
                if only is None:
                    found += consistency(kernel, shape, dtype, dname, label, has, seed, dev)
            res.subjects[label] = {"loaded": True, "restarts": kernel.restarts, "seconds": time.perf_counter() - st}
        res.findings += found
        pats = subject_patterns(found)
        if pats:
            res.patterns[label] = pats
    res.seconds = time.perf_counter() - t0
    return res


def count_line(findings: list[Finding]) -> str:
    c = count(findings)
    return f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
