"""A case put to a subject: the contract's arguments from the case's inputs in the dtype under test, and a
chunked case's calls merged by the subject's own LSE, through the `AttentionKernel` the caller opened."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ...outcomes import AttentionReply
from ...reference import attention_cases as ref
from .attention_inputs import FP8
from .attention_reference import chunk_calls
from .attention_shapes import Shape
from .attention_suite import Case


class AttentionKernel(Protocol):
    """What a check needs of a subject: one contract call (subjects.attention.IsolatedAttention.call)."""

    def call(self, contract: str, args: list[Any], kwargs: dict[str, Any], out_shape: tuple[int, ...],
             lse_shape: tuple[int, ...]) -> AttentionReply: ...


def run_case(kernel: AttentionKernel, shape: Shape, case: Case, x: dict[str, torch.Tensor],
             dtype: torch.dtype) -> AttentionReply:
    """Call the subject on a case (several calls, merged by its LSE, for a chunked case)."""
    c = {n: (v.to(dtype) if v.is_floating_point() else v) for n, v in x.items()}
    kw: dict[str, Any] = {}
    if case.window:
        kw["window_left"] = case.window - 1
    if case.softcap:
        kw["softcap"] = case.softcap
    if case.fp8_cache:  # x's cache is already fp8-representable at this scale: the conversion is exact
        c["kv_cache"] = (x["kv_cache"] / x["kv_scale"]).to(FP8)
        kw["kv_scale"] = float(x["kv_scale"])
    h, tq = shape.n_head, case.total_q
    if case.contract == "prefill":
        def one(k, v, cu_k, causal):
            lens = (cu_k[1:] - cu_k[:-1]).tolist() or [0]
            return kernel.call("prefill", [c["q"], k, v, c["cu_q"], cu_k, max(t for t, _ in case.seqs), max(lens),
                                           shape.scale, causal], kw, (tq, h, shape.head_dim_v), (h, tq))

        if not case.chunk:
            return one(c["k"], c["v"], c["cu_k"], case.causal)
        parts = [one(k, v, cu_k, causal) for k, v, cu_k, causal in chunk_calls(case, c)]
        bad = next((p for p in parts if p.status != "ok"), None)
        if bad:
            return bad
        if any(p.lse is None for p in parts):
            return AttentionReply("unsupported", "returns no lse: chunked prefill cannot merge its partial results")
        out, lse = ref.merge_chunks([p.out.double() for p in parts], [p.lse.double() for p in parts])
        return AttentionReply("ok", out=out.to(dtype), lse=lse, seconds=sum(p.seconds for p in parts))
    r = shape.mla.kv_lora_rank
    common = [c["q"], c["kv_cache"], c["block_table"]]
    if case.contract == "mla-decode":
        args = common + [c["seq_lens"], shape.scale, r]
    elif case.contract == "mla-sparse-decode":
        args = common + [c["seq_lens"], c["topk"], shape.scale, r]
    else:
        args = common + [c["cu_q"], c["seq_lens"], c["topk"], shape.scale, r]
    return kernel.call(case.contract, args, kw, (tq, h, r), (h, tq))
