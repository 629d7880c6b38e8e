"""A failing case explained twice: by signature (the output equals the reference with one named mistake
applied: softmax scale from the wrong dim, top-left causal alignment, V read from the wrong part of the
latent cache row; LSE in log2 is named by attention_verdicts.judge) and by pattern (which sequences of the
case fail; across cases, which dtype / head size / contract / chunked mode alone fails)."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from .. import metrics
from ..base import Finding
from .attention_budgets import K_FLOOR, Budget, Floor, budget
from .attention_inputs import rounded
from .attention_reference import Variant, reference
from .attention_shapes import Shape
from .attention_suite import Case, case_dims


def _scale_candidates(shape: Shape, case: Case) -> dict[str, float]:
    """Softmax scales a kernel might wrongly use, by the dim they come from."""
    d = case_dims(shape, case)
    cands = {f"1/sqrt({d['dqk']}) (q's full width)": d["dqk"] ** -0.5,
             f"1/sqrt({d['dv']}) (the value dim)": d["dv"] ** -0.5}
    if shape.mla:
        m = shape.mla
        cands[f"1/sqrt({m.qk_nope}+{m.qk_rope}) without the YaRN mscale^2"] = m.qk_dim ** -0.5
        cands[f"1/sqrt({m.qk_nope}) (qk_nope only)"] = m.qk_nope ** -0.5
    return {k: v for k, v in cands.items() if not math.isclose(v, shape.scale, rel_tol=1e-9)}


def signature(shape: Shape, case: Case, x: dict[str, torch.Tensor], got: torch.Tensor, fl: Optional[Floor],
              dtype: torch.dtype) -> str:
    """The named mistake whose reference the output matches, or ''. The match budget is the variant's own:
    float32 its rounding bound; otherwise K_FLOOR x the larger of the case's floor and the variant's own
    rounding error on these inputs (P and output rounded to the dtype): a variant's output can be larger
    than the contract's (top-left rows see few keys), and so are its roundings."""
    variants: dict[str, Variant] = {}
    for what, s in _scale_candidates(shape, case).items():
        variants[f"softmax scale from the wrong dim: the output equals attention with scale {what} = {s:.6g} "
                 f"instead of the contract's {shape.scale:.6g}"] = Variant(scale=s)
    if case.causal and any(t < s for t, s in case.seqs):
        variants["top-left causal alignment: the queries were placed at the FIRST q_len positions "
                 "(SDPA's is_causal) instead of the last (bottom-right)"] = Variant(top_left=True)
    if shape.mla and case.contract != "prefill":
        m = shape.mla
        variants[f"V not taken from the latent: the output equals V = cache[..., {m.qk_rope}:] instead of the "
                 f"latent cache[..., :{m.kv_lora_rank}]"] = Variant(v_from=m.qk_rope)
    for name, v in variants.items():
        want, _ = reference(shape, case, x, variant=v)
        if dtype == torch.float32:
            own = budget(shape, case, x, dtype, None, v)
        else:
            emu, _ = reference(shape, case, rounded(x, dtype), p_dtype=dtype, out_dtype=dtype, variant=v)
            own = Budget(K_FLOOR * max(fl.out_max, metrics.max_abs_diff(emu, want)), 0.0,
                         K_FLOOR * max(fl.out_rel, metrics.rel_l2(emu, want)), {})
        if own.within(got, want):
            return name
    return ""


def seq_pattern(case: Case, per_seq: list[bool]) -> str:
    """Which sequences of a batch fail, in words ('' when it says nothing more than 'all').

    A predicate is reported when it separates the failing sequences from the passing ones exactly.
    Sequences with at most one key are left out of the passing side except for the kv_len-0
    predicate: one key makes the softmax 1 whatever the scale, mask or offset, so they pass even
    under most bugs and would blur every other pattern."""
    bad = [b for b, ok in enumerate(per_seq) if not ok]
    if not bad or len(per_seq) == 1:
        return ""
    paged = case.contract != "prefill"
    attrs: list[tuple[str, Callable[[int], bool]]] = [
        ("only sequences with kv_len 0 fail (an empty key range must give out 0 and an infinite lse)",
         lambda b: case.seqs[b][1] == 0),
        ("only sequences with q_len < k_len fail", lambda b: case.seqs[b][0] < case.seqs[b][1] and not paged),
        ("only sequences whose length is not a multiple of the block size fail (the last page's unused tail?)",
         lambda b: paged and case.seqs[b][1] % case.block_size != 0),
        ("only sequences with q_len 1 fail", lambda b: case.seqs[b][0] == 1 and not paged),
        ("only sequences after the first fail (per-sequence offsets?)", lambda b: b > 0),
    ]
    good_keys = [case.seqs[b][1] for b, ok in enumerate(per_seq) if ok and case.seqs[b][1] > 1]
    if good_keys:
        attrs.append((f"only sequences with more than {max(good_keys)} keys fail (keys beyond a limit dropped?)",
                      lambda b: case.seqs[b][1] > max(good_keys)))
    for i, (words, pred) in enumerate(attrs):
        good = [b for b, ok in enumerate(per_seq) if ok and (i == 0 or case.seqs[b][1] > 1)]
        if good and all(pred(b) for b in bad) and not any(pred(b) for b in good):
            return words
    return "" if len(bad) == len(per_seq) else f"sequences {bad} of {len(per_seq)} fail"


def subject_patterns(findings: list[Finding]) -> list[str]:
    """Across a subject's cases: a failure confined to one dtype, head size, contract or chunked mode."""
    judged = [f for f in findings if f.status != "skip" and "contract" in f.metrics]
    bad = [f for f in judged if f.status == "fail"]
    if not bad or len(bad) == len(judged):
        return []
    out = []
    for key, words in (("dtype", "only dtype {} fails"), ("dqk", "only head size {} fails"),
                       ("contract", "only the {} contract fails"), ("chunked", "only chunked mode fails")):
        vals = {f.metrics.get(key) for f in bad}
        others = {f.metrics.get(key) for f in judged if f.status == "pass"}
        if len(vals) == 1 and others and not (vals & others):
            v = vals.pop()
            if key == "chunked" and not v:
                continue
            out.append(words.format(v))
    return out
