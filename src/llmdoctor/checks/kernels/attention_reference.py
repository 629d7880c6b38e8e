"""The float64 reference of a case (reference/attention_cases.py's varlen and paged wrappers), also with
its inputs, P and output rounded to a dtype (the noise floor's emulation), with one named mistake applied
(a failure's signature), or with a per-block bound in place of the math (the float32 budget)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...reference import attention as attn
from ...reference import attention_cases as ref
from .attention_shapes import Shape
from .attention_suite import Case


@dataclass(frozen=True)
class Variant:
    """A reference computed with one named mistake (None fields: the contract's own semantics)."""

    scale: Optional[float] = None
    top_left: bool = False
    v_from: int = 0


def reference(shape: Shape, case: Case, x: dict[str, torch.Tensor], *, p_dtype: Optional[torch.dtype] = None,
              out_dtype: Optional[torch.dtype] = None, variant: Variant = Variant(), duplicates: str = "once",
              op: Callable = attn.partial_attention) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse [H, Tq]) in float64 of a case on inputs x; with out_dtype, each kernel call's output
    is rounded to it (its lse to float32), as a kernel writes them. `op` replaces the per-block math
    (`rounding_bound` gives the float32 bound of each call instead; chunked cases: `f32_budget`)."""
    scale = variant.scale or shape.scale

    def rnd(o: torch.Tensor, l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if out_dtype is None:
            return o.double(), l.double()
        return o.to(out_dtype).to(torch.float64), l.to(torch.float32).to(torch.float64)

    if case.contract != "prefill":
        topk = x.get("topk")
        return rnd(*ref.mla_paged(x["q"], x["kv_cache"], x["block_table"], x["cu_q"], x["seq_lens"], scale=scale,
                                  kv_lora_rank=shape.mla.kv_lora_rank, topk=topk, top_left=variant.top_left,
                                  p_dtype=p_dtype, v_from=variant.v_from, duplicates=duplicates, op=op))
    kw = dict(scale=scale, window=case.window, softcap=case.softcap, top_left=variant.top_left, p_dtype=p_dtype,
              op=op)
    if not case.chunk:
        return rnd(*ref.varlen(x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"], causal=case.causal, **kw))
    pieces = [rnd(*ref.varlen(x["q"], k, v, x["cu_q"], cu_k, causal=causal, **kw))
              for k, v, cu_k, causal in chunk_calls(case, x)]
    out, lse = ref.merge_chunks([o for o, _ in pieces], [l for _, l in pieces])
    return rnd(out, lse)


def chunk_calls(case: Case, x: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]:
    """The prefill calls of a chunked case: (k, v, cu_k, causal) per call — context chunks of
    `case.chunk` keys per sequence (kv_len 0 where a sequence's context is shorter), then the causal
    call over each sequence's own new tokens."""
    ctx = [s - t for t, s in case.seqs]
    n_chunks = max(-(-c // case.chunk) for c in ctx) if any(ctx) else 0
    cu = x["cu_k"].tolist()
    calls = []

    def gather(spans: list[tuple[int, int]], causal: bool) -> None:
        idx = torch.cat([torch.arange(a, b) for a, b in spans]) if spans else torch.zeros(0, dtype=torch.int64)
        lens = torch.tensor([b - a for a, b in spans])
        cu_k = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
        calls.append((x["k"][idx], x["v"][idx], cu_k, causal))

    for c in range(n_chunks):
        gather([(cu[b] + min(c * case.chunk, ctx[b]), cu[b] + min((c + 1) * case.chunk, ctx[b]))
                for b in range(len(ctx))], False)
    gather([(cu[b] + ctx[b], cu[b + 1]) for b in range(len(ctx))], True)
    return calls
