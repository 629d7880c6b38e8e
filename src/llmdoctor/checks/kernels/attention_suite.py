"""The cases of `check attention`: call patterns of a model's attention shape.

Lengths are scaled down to stay fast (the bugs hunted live in the batch structure): batch 1 and ragged
batches, q_len 1, q_len < k_len, a context chunk in which a sequence has kv_len 0, lengths that are not
multiples of the cache block size, a long sequence, sliding window / softcap when the model has them, paged
latent caches with unused pages full of NaN, DSA top-k rows as indexers emit them; and long-key cases (up to
4100 keys, few queries, few kv heads for prefill) crossing the tile / page / window boundaries of 64 to
4096. Every case relies only on conventions real kernels share (reference/attention_cases.py names the
source of each); an input real engines never give (a duplicated top-k entry) is a `probe` case, reported
as information, never judged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .attention_shapes import Shape


@dataclass(frozen=True)
class Case:
    """One call pattern. seqs: (q_len, kv_len) per sequence (MLA: kv_len = seq_len, the query
    tokens being its last q_len positions). `chunk`: run as chunked prefill (context chunks of this
    many keys, non-causal, then the causal new-token part, merged by the subject's LSE)."""

    name: str
    contract: str
    seqs: tuple[tuple[int, int], ...]
    causal: bool = True
    window: Optional[int] = None
    softcap: Optional[float] = None
    block_size: int = 16
    top_k: int = 0
    chunk: int = 0
    fp8_cache: bool = False  # the latent cache in float8_e4m3fn with a per-tensor scale (kv_scale=)
    n_head_kv: int = 0  # prefill: this many kv heads (and their query groups) instead of the model's (long cases)
    probe: str = ""  # an input real engines never give, probed on purpose: reported as information, not judged

    @property
    def total_q(self) -> int:
        return sum(t for t, _ in self.seqs)


# Scaled-down stand-ins: a long sequence of 300 keys, windows and top-k of ~1/8 of the lengths.
LONG, WINDOW, TOPK = 300, 13, 24
# Long-key cases (issue 16): kernels split keys in tiles, pages and windows of 64 to 4096, so these cross
# every power-of-two boundary up to 4096 (4100 = 4096 + 4, 1100 > 1024, 700 > 512) with few queries;
# the prefill ones keep LONG_HEADS_KV kv heads (and their query groups) so the float64 reference stays
# cheap (the latent MLA cache is one head: those keep the model's heads).
LONG_KEYS, LONG_HEADS_KV = 4100, 2


def cases(shape: Shape) -> list[Case]:
    out = [
        Case("batch1", "prefill", ((37, 37),)),
        Case("ragged", "prefill", ((5, 5), (1, 19), (7, 40), (16, 16))),
        Case("decode-batch", "prefill", ((1, 33), (1, 1), (1, 64))),
        Case("context-chunk-kv0", "prefill", ((4, 16), (3, 0), (5, 9)), causal=False),
        Case("long", "prefill", ((9, LONG),)),
        Case("long-keys", "prefill", ((3, LONG_KEYS), (2, 1100), (4, 700)), n_head_kv=LONG_HEADS_KV),
        Case("chunked", "prefill", ((4, 20), (3, 3), (6, 45)), chunk=16),
    ]
    if shape.window:
        out.append(Case("sliding-window", "prefill", ((6, 40), (17, 17)), window=min(shape.window, WINDOW)))
        w = shape.window  # the model's own window, crossed by a long sequence
        out.append(Case("long-window", "prefill", ((3, w + 600), (2, max(w // 2, 1))), window=w,
                        n_head_kv=LONG_HEADS_KV))
    if shape.softcap:
        out.append(Case("softcap", "prefill", ((6, 40), (17, 17)), softcap=shape.softcap))
    if shape.mla:
        out += [
            Case("mla-decode-b1", "mla-decode", ((1, 37),)),
            Case("mla-decode-ragged", "mla-decode", ((1, 1), (1, 17), (1, 64), (1, 100))),
            Case("mla-decode-long", "mla-decode", ((1, LONG),), block_size=64),
            Case("mla-decode-long-keys", "mla-decode", ((1, LONG_KEYS), (1, 1100)), block_size=64),
            Case("mla-decode-fp8", "mla-decode", ((1, 37), (1, 64)), fp8_cache=True),
        ]
    if shape.top_k:
        k = min(shape.top_k, TOPK)
        out += [
            Case("sparse-decode", "mla-sparse-decode", ((1, 37), (1, 9), (1, 100)), top_k=k),
            Case("sparse-prefill", "mla-sparse-prefill", ((5, 20), (1, 9), (12, 12), (7, 70)), top_k=k),
            Case("sparse-decode-long-keys", "mla-sparse-decode", ((1, LONG_KEYS), (1, 1100)), top_k=shape.top_k,
                 block_size=64),
            Case("sparse-prefill-long-keys", "mla-sparse-prefill", ((2, LONG_KEYS),), top_k=shape.top_k,
                 block_size=64),
            Case("sparse-decode-duplicates", "mla-sparse-decode", ((1, 37), (1, 9), (1, 100)), top_k=k,
                 probe="duplicates"),
        ]
    return out


def shape_for(shape: Shape, case: Case) -> Shape:
    """The shape a case runs at: the model's, or for a long prefill case LONG_HEADS_KV kv heads with the
    model's query group size."""
    if not case.n_head_kv or case.contract != "prefill" or shape.n_head_kv <= case.n_head_kv:
        return shape
    group = shape.n_head // shape.n_head_kv
    return dataclasses.replace(shape, n_head=case.n_head_kv * group, n_head_kv=case.n_head_kv)


def case_dims(shape: Shape, case: Case) -> dict[str, int]:
    """Head sizes of a case (what 'only one head size fails' is judged on)."""
    if case.contract == "prefill":
        return {"dqk": shape.head_dim, "dv": shape.head_dim_v}
    return {"dqk": shape.mla.kv_lora_rank + shape.mla.qk_rope, "dv": shape.mla.kv_lora_rank}
