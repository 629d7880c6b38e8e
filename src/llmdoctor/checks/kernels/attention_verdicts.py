"""One case's finding from what the subject answered: metrics, the budget's verdict, and for a failure its
pattern and signature (attention_explanations); a `probe` case reported as information, never judged."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch

from ...outcomes import AttentionReply
from .. import metrics
from ..base import Finding
from .attention_budgets import K_FLOOR, Floor, budget
from .attention_explanations import seq_pattern, signature
from .attention_reference import reference
from .attention_shapes import Shape
from .attention_suite import Case, case_dims

CHECK = "attention"
LN2 = math.log(2.0)


def _seq_spans(case: Case) -> list[slice]:
    spans, at = [], 0
    for t, _ in case.seqs:
        spans.append(slice(at, at + t))
        at += t
    return spans


DUPLICATES = ("a top-k row naming one position twice, which no indexer emits (vLLM's indexer: torch.topk gives "
              "distinct positions); kernels differ there")


def probe(shape: Shape, case: Case, x: dict[str, torch.Tensor], got: AttentionReply, dtype: torch.dtype, fl: Optional[Floor],
          subject: str, target: str, info: dict[str, Any]) -> Finding:
    """An undefined input probed on purpose: what the kernel did, as information (status pass, never a fault)."""
    note = {"informational": True, "probe": case.probe}
    if got.status != "ok":
        return Finding(CHECK, subject, target, "pass", metrics={**info, **note},
                       reason=f"information, not judged: on {DUPLICATES}, the kernel {got.status}: {got.message}")
    out = got.out.double()
    said = []
    for how, words in (("each", "counts a duplicate as often as it is listed (as kernels that iterate the list, "
                                "e.g. FlashMLA's kv[indices])"),
                       ("once", "counts a duplicate once (as mask-based kernels, e.g. llama.cpp's DSA mask)")):
        want, _ = reference(shape, case, x, duplicates=how)
        note[f"max_abs_diff_{how}"] = metrics.max_abs_diff(out, want)
        if budget(shape, case, x, dtype, fl).within(out, want):
            said.append(words)
    what = " and ".join(said) or "matches neither way of counting it"
    return Finding(CHECK, subject, target, "pass", reason=f"information, not judged: on {DUPLICATES}, the kernel {what}",
                   metrics={**info, **note})


def judge(shape: Shape, case: Case, x: dict[str, torch.Tensor], got: AttentionReply, fl: Optional[Floor], dtype_name: str,
          subject: str) -> Finding:
    """One case's finding: metrics, budget, per-sequence pattern and signature."""
    target = f"{case.name}/{dtype_name}"
    dims = case_dims(shape, case)
    dtype = getattr(torch, dtype_name)
    info = {"contract": case.contract, "dtype": dtype_name, "seqs": [list(s) for s in case.seqs],
            "chunked": bool(case.chunk), "heads": [shape.n_head, shape.n_head_kv], **dims}
    if case.probe:
        return probe(shape, case, x, got, dtype, fl, subject, target, info)
    if got.status in ("unsupported", "transport"):  # transport: llmdoctor's own bytes changed, no verdict
        return Finding(CHECK, subject, target, "skip", reason=got.message, metrics=info)
    if got.status != "ok":
        what = {"raised": "kernel raised", "crashed": "kernel crashed", "timeout": "kernel hung",
                "contract": "contract violation"}.get(got.status, got.status)
        return Finding(CHECK, subject, target, "fail", reason=f"{what}: {got.message}", metrics=info,
                       explanation=f"{what} on case {case.name} ({dtype_name}); the check went on")
    want, want_lse = reference(shape, case, x)
    out = got.out.double()
    bud = budget(shape, case, x, dtype, fl)
    mets = {**info, "max_abs_diff": metrics.max_abs_diff(out, want), "rel_l2": metrics.rel_l2(out, want),
            "nonfinite": int((~torch.isfinite(out)).sum()), "kernel_seconds": got.seconds}
    if isinstance(bud.out, torch.Tensor):  # how much of the per-element bound the worst element uses
        err = metrics.abs_diff(out, want)
        lim = bud.out.detach().to("cpu", torch.float64).reshape(-1)  # abs_diff's values are on the CPU
        used = err[lim > 0] / lim[lim > 0]
        mets["bound_used"] = float(used.max()) if used.numel() else 0.0
    per_seq = [bud.within(out[sp], want[sp], sp) for sp in _seq_spans(case)]
    lse_ok = True
    if got.lse is not None:
        lg = got.lse.double()
        fin = torch.isfinite(want_lse)
        mets["lse_max_abs_diff"] = metrics.max_abs_diff(lg[fin], want_lse[fin])
        lse_ok = bud.lse_within(lg, want_lse)
    mets["failing_sequences"] = [b for b, ok in enumerate(per_seq) if not ok]
    out_ok = all(per_seq) and bud.within(out, want)
    if out_ok and lse_ok:
        return Finding(CHECK, subject, target, "pass", reason="within budget", metrics=mets, budget=bud.info)
    if out_ok:
        log2 = bud.lse_within(got.lse.double(), want_lse / LN2, 1 / LN2)
        sig = "LSE in log2 instead of natural log: lse equals the reference's / ln 2" if log2 else ""
        return Finding(CHECK, subject, target, "fail", reason=f"lse wrong{': ' + sig if sig else ''}", metrics=mets,
                       budget=bud.info, explanation=sig or "the output is right but the returned lse is not",
                       evidence=[{"signature": sig}] if sig else [])
    pattern = seq_pattern(case, per_seq)
    sig = signature(shape, case, x, out, fl, dtype)
    nan = bool(mets["nonfinite"] and metrics.nonfinite_where_finite(out, want).any())
    mets["nonfinite_where_finite"] = nan
    over = (f"error {mets['max_abs_diff']:.3g} beyond the float32 rounding bound (worst element at "
            f"{mets['bound_used']:.3g} x its bound)" if "bound_used" in mets else
            f"error {mets['max_abs_diff']:.3g} > {K_FLOOR:g} x floor {fl.out_max:.3g}")
    reason = "; ".join(filter(None, ["NaN/inf in the output where the reference is finite" if nan else over,
                                     pattern, sig]))
    expl = sig or pattern or "unexplained: no named signature reproduces the output"
    if nan and not sig:
        expl = "NaN/inf where the reference is finite: " + (pattern or (
            "unused cache pages and out= buffers are NaN here, so the kernel read beyond seq_len or left "
            "elements unwritten"))
    return Finding(CHECK, subject, target, "fail", reason=reason, metrics=mets, budget=bud.info, explanation=expl,
                   evidence=[{"pattern": pattern, "signature": sig}])


def unused_rows_verdict(first: Finding, follow: Finding) -> Finding:
    """A paged case whose output had NaN where the reference is finite, judged again with its unused cache
    rows finite (`stale_unused_rows`). Within budget then: the kernel weighs the rows past seq_len by zero
    and NaN there reaches the output (0 x NaN), as flash-attn's paged kernels may (their tests fill caches
    with finite values; engines zero-fill theirs): information, not judged. Still failing: the first
    verdict stands, with what the follow-up saw."""
    if follow.status == "pass":
        return dataclasses.replace(
            follow, reason=("within budget with finite rows past seq_len (a reused page's); information, not judged: "
                            f"with NaN there the output has {first.metrics['nonfinite']} NaN/inf: the kernel weighs "
                            "rows past seq_len by zero (0 x NaN), as flash-attn's paged kernels may; engines "
                            "zero-fill their caches"),
            metrics={**follow.metrics, "unused_rows": "weighed by zero: NaN there reaches the output",
                     "nonfinite_with_nan_unused_rows": first.metrics["nonfinite"]})
    return dataclasses.replace(first, explanation=f"{first.explanation}; with finite rows past seq_len it still "
                                                  f"fails: {follow.reason}")
