"""Batched attention as kernels are called: varlen (packed) prefill, paged latent caches, chunked
context, DSA sparse selection. Thin wrappers over `reference.attention` (the dense math) and
`reference.mla` (the latent MQA); float64 in, float64 out when given float64.

The conventions of the kernel contracts of `llmdoctor check attention`, each with the kernels that
share it (a convention no real kernel shares is not judged by any case):
- varlen: sequence b owns rows cu_q[b]:cu_q[b+1] of q and cu_k[b]:cu_k[b+1] of k/v (flash-attn's
  `flash_attn_varlen_func`, vLLM's FlashAttention backend, FlashInfer's ragged prefill indptr).
- causal is bottom-right: the queries are the last q_len of the k_len positions (flash-attn >= 2.1,
  FlashInfer's causal mask, llama.cpp's KV-cache mask by position); `top_left=True` gives the other
  alignment (SDPA's `is_causal`), used only to recognise that bug.
- GQA: query head h reads kv head h // (H // Hk) (flash-attn, FlashInfer, llama.cpp's broadcast).
- a row with no visible key has out 0 (flash-attn 2 and 3, FlashInfer); its lse is an infinity whose
  sign kernels do not share (flash-attn 2 returns +inf, flash-attn 3 -inf: vLLM's merge_attn_states
  reads +inf as -inf), so the check accepts either and merges chunks reading +inf as -inf.
- sliding window W counts the query's own key: window_left = W - 1 (flash-attn, FlashInfer
  `window_left`, llama.cpp's n_swa, vLLM passes sliding_window - 1); softcap is c·tanh(s/c) of the
  scaled score (flash-attn `softcap`, FlashInfer `logits_soft_cap`, llama.cpp's Gemma-2 graph).
- paged: position p of sequence b lives in kv_cache[block_table[b, p // bs], p % bs] (vLLM's block
  tables, FlashMLA's page blocks); positions >= seq_len (the last page's tail, unused pages) carry no
  weight. FlashMLA never reads them (its tests fill them with NaN); flash-attn's paged kernels may read
  them at zero weight (their tests fill caches with finite values; vLLM and llama.cpp zero-fill their
  caches), so NaN there reaching the output is information, not a fault. seq_lens include the current
  token (FlashMLA's cache_seqlens, vLLM's seq_lens).
- latent cache rows are [latent (R), k_pe (Dr)]; the MQA key is the whole row, the value its first R
  (FlashMLA: head_dim_k 576, head_dim_v 512; vLLM's MLA backends; llama.cpp's MLA path).
- `topk` rows are what DSA indexers emit: distinct positions local to the sequence, at most the
  query's own position (vLLM's indexer: torch.topk over the causal range, made request-relative),
  padded with -1 (vLLM's indexer masks out-of-range picks to -1; FlashMLA: "set invalid indices to
  -1"). Kernels apply no causal mask of their own there (vLLM's FlashMLA-sparse backend: "causality
  comes from the indexer's top-k indices"). A duplicate is undefined: a kernel that iterates the
  list (FlashMLA's kv[indices]) counts it as often as it is listed, a mask-based one (llama.cpp's
  DSA mask) once; `duplicates="each"` computes the former, the default the latter.
- lse is [H, total_q] in natural log (flash-attn's softmax_lse; FlashInfer's is log2 and
  [q, H], FlashMLA's sparse prefill log2: their adapters convert).
"""
from __future__ import annotations

from typing import Callable

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
           top_left: bool = False, p_dtype: torch.dtype | None = None,
           op: Callable = attn.partial_attention) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed variable-length attention: q [Tq, H, Dqk], k [Tk, Hk, Dqk], v [Tk, Hk, Dv], cu_* [B+1]
    -> (out [Tq, H, Dv], lse [H, Tq]), in the accumulation dtype. `op` is the per-sequence block
    computation (`partial_attention`'s signature; a rounding bound has the same)."""
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
        o, l = op(q[sq], k[sk], v[sk], allowed, scale=scale, softcap=softcap, p_dtype=p_dtype)
        out[sq], lse[:, sq] = o, l.transpose(0, 1)
    return out, lse


def gather_pages(kv_cache: torch.Tensor, block_row: torch.Tensor, n: int) -> torch.Tensor:
    """The first n cache rows of one sequence: kv_cache [num_blocks, bs, D], block_row [max_blocks] -> [n, D]."""
    bs = kv_cache.shape[1]
    pages = block_row[: -(-n // bs)].long()
    return kv_cache[pages].reshape(-1, kv_cache.shape[2])[:n]


def selection(topk: torch.Tensor, t: int, s: int) -> torch.Tensor:
    """bool [t, s]: the keys named in topk [t, K] (local positions, -1 ignored, duplicates once),
    intersected with bottom-right causality (a no-op on what indexers emit)."""
    return (hits(topk, s) > 0) & attn.visible(t, s, device=topk.device)


def hits(topk: torch.Tensor, s: int) -> torch.Tensor:
    """int32 [t, s]: how many times each key is named in topk [t, K] (-1 and positions >= s ignored)."""
    valid = (topk >= 0) & (topk < s)  # [t, K]
    n = torch.zeros(topk.shape[0], s, dtype=torch.int32, device=topk.device)
    if s:
        n.scatter_add_(1, topk.long().clamp(0, s - 1), valid.to(torch.int32))
    return n


def latent_mqa(q: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor, *, scale: float, kv_lora_rank: int,
               p_dtype: torch.dtype | None = None, v_from: int = 0,
               op: Callable = attn.partial_attention) -> tuple[torch.Tensor, torch.Tensor]:
    """MQA over latent cache rows: q [T, H, R+Dr], rows [S, R+Dr], allowed [T, S] -> (out [T, H, R],
    lse [T, H]). The value is rows[:, v_from:v_from+R]; v_from=0 is the contract (the latent)."""
    v = rows[:, v_from:v_from + kv_lora_rank]
    return op(q, rows[:, None, :], v[:, None, :], allowed, scale=scale, p_dtype=p_dtype)


def mla_paged(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cu_q: torch.Tensor,
              seq_lens: torch.Tensor, *, scale: float, kv_lora_rank: int, topk: torch.Tensor | None = None,
              top_left: bool = False, p_dtype: torch.dtype | None = None, v_from: int = 0,
              duplicates: str = "once", op: Callable = attn.partial_attention) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA over a paged latent cache for q [Tq, H, R+Dr] (the queries of sequence b are rows
    cu_q[b]:cu_q[b+1], the last of its seq_lens[b] positions), optional topk [Tq, K]
    -> (out [Tq, H, R], lse [H, Tq]). Decode is cu_q = arange(B+1). duplicates="each": every query
    attends to its listed rows one entry at a time (kv[indices]: a duplicate counts as often as listed)."""
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
        kw = dict(scale=scale, kv_lora_rank=kv_lora_rank, p_dtype=p_dtype, v_from=v_from, op=op)
        if topk is not None and duplicates == "each":
            for r in range(sq.start, sq.stop):
                listed = topk[r][(topk[r] >= 0) & (topk[r] < s)].long()  # [n] in list order
                one = torch.ones(1, len(listed), dtype=torch.bool, device=q.device)
                o, l = latent_mqa(q[r:r + 1], rows[listed], one, **kw)
                out[r], lse[:, r] = o[0], l[0]
            continue
        allowed = causal_mask(t, s, top_left=top_left, device=q.device)
        if topk is not None:
            allowed = allowed & selection(topk[sq], t, s)
        o, l = latent_mqa(q[sq], rows, allowed, **kw)
        out[sq], lse[:, sq] = o, l.transpose(0, 1)
    return out, lse


def merge_chunks(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial results out [Tq, H, Dv], lse [H, Tq] of the same queries over disjoint key
    chunks (chunked prefill: context chunks + the causal new-token part) by log-sum-exp. An empty
    chunk's lse +inf (flash-attn 2) is read as -inf (flash-attn 3), as vLLM's merge_attn_states does."""
    lses = [l.masked_fill(l == float("inf"), float("-inf")).transpose(0, 1) for l in lses]
    out, lse = attn.merge(outs, lses)  # lse [Tq, H]
    return out, lse.transpose(0, 1)
