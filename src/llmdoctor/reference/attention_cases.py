"""Batched attention as kernels are called: varlen (packed) prefill, paged latent caches, chunked
context, DSA sparse selection. Thin wrappers over `reference.attention` (the dense math) and
`reference.mla` (the latent MQA); float64 in, float64 out when given float64.

Conventions are those of the kernel contracts of `llmdoctor check attention` (issue 6):
- varlen: sequence b owns rows cu_q[b]:cu_q[b+1] of q and cu_k[b]:cu_k[b+1] of k/v (flash-attn's
  `flash_attn_varlen_func`); causal is bottom-right (the queries are the last q_len of the k_len
  positions), `top_left=True` gives the other alignment (what SDPA's `is_causal` means), used only
  to recognise that bug.
- a row with no visible key has out 0 and lse -inf (so chunks merge by log-sum-exp);
- paged: position p of sequence b lives in kv_cache[block_table[b, p // bs], p % bs];
- latent cache rows are [latent (R), k_pe (Dr)]; the MQA key is the whole row, the value its first R
  (llama.cpp's MLA path and vLLM's MLA backends store the cache this way);
- `topk` rows hold positions local to the sequence; -1 is ignored, a duplicate counts once, the
  selection is intersected with the causal range (vLLM's sparse MLA indexer output, made local).
- lse is [H, total_q] in natural log (flash-attn's softmax_lse layout).
"""

from __future__ import annotations

import torch

from . import attention as attn


def _span(cu: torch.Tensor, b: int) -> slice:
    return slice(int(cu[b]), int(cu[b + 1]))


def causal_mask(t: int, s: int, *, causal: bool = True, window: int | None = None,
                top_left: bool = False, device: torch.device | str | None = None) -> torch.Tensor:
    """bool [t, s]: which keys each of the t queries sees. `window` counts the query's own key
    (window_left + 1 in flash-attn's terms)."""
    if not causal:
        return torch.ones(t, s, dtype=torch.bool, device=device)
    return attn.visible(t, s, window=window, q_offset=0 if top_left else s - t, device=device)


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, *,
           scale: float, causal: bool, window: int | None = None, softcap: float | None = None,
           top_left: bool = False, p_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed variable-length attention: q [Tq, H, Dqk], k [Tk, Hk, Dqk], v [Tk, Hk, Dv], cu_* [B+1]
    -> (out [Tq, H, Dv], lse [H, Tq]), in the accumulation dtype."""
    h, dv = q.shape[1], v.shape[2]
    acc = attn.acc_dtype(q.dtype)
    out = torch.zeros(q.shape[0], h, dv, dtype=acc, device=q.device)  # [Tq, H, Dv]
    lse = torch.full((h, q.shape[0]), float("-inf"), dtype=acc, device=q.device)  # [H, Tq]
    for b in range(len(cu_q) - 1):
        sq, sk = _span(cu_q, b), _span(cu_k, b)
        t, s = sq.stop - sq.start, sk.stop - sk.start
        if t == 0 or s == 0:
            continue
        allowed = causal_mask(t, s, causal=causal, window=window, top_left=top_left, device=q.device)
        o, l = attn.partial_attention(q[sq], k[sk], v[sk], allowed, scale=scale, softcap=softcap, p_dtype=p_dtype)
        out[sq], lse[:, sq] = o, l.transpose(0, 1)
    return out, lse


def gather_pages(kv_cache: torch.Tensor, block_row: torch.Tensor, n: int) -> torch.Tensor:
    """The first n cache rows of one sequence: kv_cache [num_blocks, bs, D], block_row [max_blocks] -> [n, D]."""
    bs = kv_cache.shape[1]
    pages = block_row[: -(-n // bs)].long()
    return kv_cache[pages].reshape(-1, kv_cache.shape[2])[:n]


def selection(topk: torch.Tensor, t: int, s: int) -> torch.Tensor:
    """bool [t, s]: the keys named in topk [t, K] (local positions, -1 ignored, duplicates once),
    intersected with bottom-right causality."""
    valid = (topk >= 0) & (topk < s)  # [t, K]
    hits = torch.zeros(t, s, dtype=torch.int32, device=topk.device)
    if s:
        hits.scatter_add_(1, topk.long().clamp(0, s - 1), valid.to(torch.int32))
    return (hits > 0) & attn.visible(t, s, device=topk.device)


def latent_mqa(q: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor, *, scale: float, kv_lora_rank: int,
               p_dtype: torch.dtype | None = None, v_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """MQA over latent cache rows: q [T, H, R+Dr], rows [S, R+Dr], allowed [T, S] -> (out [T, H, R],
    lse [T, H]). The value is rows[:, v_from:v_from+R]; v_from=0 is the contract (the latent)."""
    v = rows[:, v_from:v_from + kv_lora_rank]
    return attn.partial_attention(q, rows[:, None, :], v[:, None, :], allowed, scale=scale, p_dtype=p_dtype)


def mla_paged(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cu_q: torch.Tensor,
              seq_lens: torch.Tensor, *, scale: float, kv_lora_rank: int, topk: torch.Tensor | None = None,
              top_left: bool = False, p_dtype: torch.dtype | None = None,
              v_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA over a paged latent cache for q [Tq, H, R+Dr] (the queries of sequence b are rows
    cu_q[b]:cu_q[b+1], the last of its seq_lens[b] positions), optional topk [Tq, K]
    -> (out [Tq, H, R], lse [H, Tq]). Decode is cu_q = arange(B+1)."""
    h = q.shape[1]
    acc = attn.acc_dtype(q.dtype)
    out = torch.zeros(q.shape[0], h, kv_lora_rank, dtype=acc, device=q.device)  # [Tq, H, R]
    lse = torch.full((h, q.shape[0]), float("-inf"), dtype=acc, device=q.device)  # [H, Tq]
    for b in range(len(seq_lens)):
        sq, s = _span(cu_q, b), int(seq_lens[b])
        t = sq.stop - sq.start
        if t == 0 or s == 0:
            continue
        rows = gather_pages(kv_cache, block_table[b], s)  # [S, R+Dr]
        allowed = causal_mask(t, s, top_left=top_left, device=q.device)
        if topk is not None:
            allowed = allowed & selection(topk[sq], t, s)
        o, l = latent_mqa(q[sq], rows, allowed, scale=scale, kv_lora_rank=kv_lora_rank, p_dtype=p_dtype,
                          v_from=v_from)
        out[sq], lse[:, sq] = o, l.transpose(0, 1)
    return out, lse


def merge_chunks(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial results out [Tq, H, Dv], lse [H, Tq] of the same queries over disjoint key
    chunks (chunked prefill: context chunks + the causal new-token part) by log-sum-exp."""
    out, lse = attn.merge(outs, [l.transpose(0, 1) for l in lses])  # lse [Tq, H]
    return out, lse.transpose(0, 1)
