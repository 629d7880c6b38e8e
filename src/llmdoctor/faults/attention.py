"""Planted attention kernels for `llmdoctor check attention`: one correct eager torch kernel for all
four contracts, and faulty twins, one per bug the check must name (issue 6): softmax scale from the
wrong dim, top-left causal alignment, LSE in log2, V not taken from the latent, a batch-offset bug
(only sequences after the first), an empty-key-range bug (only kv_len 0), out= rows left unwritten,
NaN leaking from unused cache pages, a float16-only dtype-dispatch bug (named by the subject-level
pattern, not by one case), and a prefill kernel that attends only to the last 1024 keys (issue 16).

Correct kernels of other summation orders, which every budget must pass (issue 18): `prefill_blocked`
(keys in tiles of 64 with online softmax, lse +inf for an empty row as flash-attn 2 writes it) and
`mla_sparse_decode_iterating` (walks the top-k list one entry at a time, as sparse MLA kernels do).
`mla_decode_zero_weight_tail` reads the last page whole and masks the rows past seq_len, which then
enter P·V at weight 0, as flash-attn 3's MLA decode does on the H200: NaN there reaches its output, and
the check reports that as information, not a fault.

Each fault's `build()` returns {"impl": "llmdoctor.faults.attention:<function>", "contract": name};
`expect` is a substring the check's explanation must contain. Written independently of the
reference wrappers (reference/attention_cases.py), computing in float32 like a kernel.
"""

from __future__ import annotations

import math
import torch

from . import register

_SPEC = "llmdoctor.faults.attention:"


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
            bug: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """q [t, H, D], k [s, Hk, D], v [s, Hk, Dv], allowed bool [t, s] -> out [t, H, Dv] (q's dtype), lse [H, t]."""
    h, hk = q.shape[1], k.shape[1]
    kf = k.float().repeat_interleave(h // hk, 1)  # [s, H, D]
    vf = v.float().repeat_interleave(h // hk, 1)  # [s, H, Dv]
    x = torch.einsum("thd,shd->hts", q.float(), kf) * scale  # [H, t, s]
    x = x.masked_fill(~allowed[None], float("-inf"))
    if bug == "kv0-nan":  # the textbook softmax: 0/0 on an empty row
        m = x.amax(-1, keepdim=True) if x.shape[-1] else torch.zeros(*x.shape[:2], 1, device=x.device)
        e = torch.exp(x - m)
        p = e / e.sum(-1, keepdim=True)
        lse = torch.log(e.sum(-1)) + m[..., 0]
        out = torch.einsum("hts,shd->thd", p, vf) if x.shape[-1] else torch.full(
            (q.shape[0], h, v.shape[2]), float("nan"), device=q.device)
        return out.to(q.dtype), lse
    lse = torch.logsumexp(x, -1)  # [H, t]
    p = torch.exp(x - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    out = torch.einsum("hts,shd->thd", p, vf)
    return out.to(q.dtype), (lse / math.log(2) if bug == "lse-log2" else lse)


def _causal(t: int, s: int, top_left: bool, device: torch.device) -> torch.Tensor:
    off = 0 if top_left else s - t
    return torch.arange(s, device=device)[None, :] <= torch.arange(t, device=device)[:, None] + off


def _attend_online(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
                   tile: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-attention order: keys in tiles, a running max m, sum l and output, rescaled when m grows.
    q [t, H, D], k [s, Hk, D], v [s, Hk, Dv], allowed [t, s] -> out [t, H, Dv], lse [H, t] (+inf: no key)."""
    h, hk, t = q.shape[1], k.shape[1], q.shape[0]
    m = torch.full((h, t), float("-inf"), device=q.device)
    l = torch.zeros(h, t, device=q.device)
    acc = torch.zeros(h, t, v.shape[2], device=q.device)  # [H, t, Dv]
    for j in range(0, k.shape[0], tile):
        kb = k[j:j + tile].float().repeat_interleave(h // hk, 1)  # [tile, H, D]
        vb = v[j:j + tile].float().repeat_interleave(h // hk, 1)
        x = torch.einsum("thd,shd->hts", q.float(), kb) * scale
        x = x.masked_fill(~allowed[None, :, j:j + tile], float("-inf"))
        m_new = torch.maximum(m, x.amax(-1))
        base = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        r = torch.exp(m - base)  # 0 while m is -inf
        p = torch.exp(x - base[..., None])
        l = l * r + p.sum(-1)
        acc = acc * r[..., None] + torch.einsum("hts,shd->htd", p, vb)
        m = m_new
    has = l > 0
    out = torch.where(has[..., None], acc / torch.where(has, l, torch.ones_like(l))[..., None], torch.zeros_like(acc))
    lse = torch.where(has, m + torch.log(torch.where(has, l, torch.ones_like(l))), torch.full_like(l, float("inf")))
    return out.permute(1, 0, 2).to(q.dtype), lse


def _prefill(q, k, v, cu_q, cu_k, scale, causal, bug: str = ""):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    for b in range(len(cq) - 1):
        a = max(ck[b] - (1 if bug == "batch-offset" and b > 0 else 0), 0)  # reads one row of the previous sequence
        t, s = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        allowed = (_causal(t, s, bug == "top-left", q.device) if causal
                   else torch.ones(t, s, dtype=torch.bool, device=q.device))
        if bug == "last-1024":  # keys before the last 1024 of the sequence are never read
            allowed[:, : max(s - 1024, 0)] = False
        if bug == "blocked":  # not a bug: the online-softmax order
            o, l = _attend_online(q[cq[b]:cq[b + 1]], k[a:a + s], v[a:a + s], allowed, scale)
        else:
            o, l = _attend(q[cq[b]:cq[b + 1]], k[a:a + s], v[a:a + s], allowed, scale, bug)
        out[cq[b]:cq[b + 1]], lse[:, cq[b]:cq[b + 1]] = o, l
    return out, lse


def _latent(q, kv_cache, block_table, cu_q, seq_lens, topk, scale, r, bug: str = ""):
    bs, width = kv_cache.shape[1], kv_cache.shape[2]
    if bug == "scale-576":
        scale = 1.0 / math.sqrt(width)  # from q's full width R + Dr, not from qk_nope + qk_rope
    out = torch.zeros(q.shape[0], q.shape[1], r, dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    for b, s in enumerate(seq_lens.tolist()):
        n = -(-s // bs)
        rows = kv_cache[block_table[b, :n].long()].reshape(-1, width)  # [n*bs, R+Dr]
        whole = bug in ("page-tail", "zero-weight-tail")  # read the whole last page, unused slots included
        if not whole:
            rows = rows[:s]
        t = cu_q[b + 1] - cu_q[b]
        allowed = _causal(t, s, False, q.device)
        if bug == "page-tail":  # the bug: attend them
            allowed = torch.ones(t, rows.shape[0], dtype=torch.bool, device=q.device)
        if bug == "zero-weight-tail":  # correct: mask their scores, so they enter P·V at weight 0 (0 x NaN)
            allowed = torch.nn.functional.pad(allowed, (0, rows.shape[0] - s))
        if topk is not None:
            sel = torch.zeros(t, rows.shape[0], dtype=torch.bool, device=q.device)
            for i in range(t):
                pos = topk[cu_q[b] + i]
                pos = pos[(pos >= 0) & (pos < s)].long()
                sel[i, pos] = True
            allowed &= sel
        v = rows[:, width - r:] if bug == "v-rope" else rows[:, :r]  # v-rope: cache[..., Dr:]
        o, l = _attend(q[cu_q[b]:cu_q[b + 1]], rows[:, None], v[:, None], allowed, scale)
        out[cu_q[b]:cu_q[b + 1]], lse[:, cu_q[b]:cu_q[b + 1]] = o, l
    return out, lse


# ----------------------------------------------------------------------------- contract entry points

def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    """Correct eager prefill kernel (float32 math), returns (out, lse)."""
    return _prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)


def mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale, kv_lora_rank):
    """Correct eager MLA decode over the paged latent cache."""
    return _latent(q, kv_cache, block_table, list(range(q.shape[0] + 1)), seq_lens, None, softmax_scale,
                   kv_lora_rank)


def mla_sparse_decode(q, kv_cache, block_table, seq_lens, topk_indices, softmax_scale, kv_lora_rank):
    return _latent(q, kv_cache, block_table, list(range(q.shape[0] + 1)), seq_lens, topk_indices, softmax_scale,
                   kv_lora_rank)


def mla_sparse_prefill(q, kv_cache, block_table, cu_seqlens_q, seq_lens, topk_indices, softmax_scale,
                       kv_lora_rank):
    return _latent(q, kv_cache, block_table, cu_seqlens_q.tolist(), seq_lens, topk_indices, softmax_scale,
                   kv_lora_rank)


def mla_sparse_decode_iterating(q, kv_cache, block_table, seq_lens, topk_indices, softmax_scale, kv_lora_rank):
    """Correct sparse MLA decode written as sparse kernels are: each query walks its top-k list one entry
    at a time (online softmax), skipping -1; a listed duplicate (an input indexers never give) counts twice."""
    bs = kv_cache.shape[1]
    dev = q.device
    out = torch.zeros(q.shape[0], q.shape[1], kv_lora_rank, dtype=q.dtype, device=dev)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=dev)
    for b in range(q.shape[0]):
        qf = q[b].float()  # [H, R+Dr]
        m = torch.full((q.shape[1],), float("-inf"), device=dev)
        l = torch.zeros(q.shape[1], device=dev)
        acc = torch.zeros(q.shape[1], kv_lora_rank, device=dev)
        for idx in topk_indices[b].tolist():
            if idx < 0:
                continue
            row = kv_cache[int(block_table[b, idx // bs]), idx % bs].float()  # [R+Dr]
            x = (qf @ row) * softmax_scale  # [H]
            m_new = torch.maximum(m, x)
            r, p = torch.exp(m - m_new), torch.exp(x - m_new)
            l = l * r + p
            acc = acc * r[:, None] + p[:, None] * row[:kv_lora_rank]
            m = m_new
        if (l > 0).all():
            out[b], lse[:, b] = (acc / l[:, None]).to(q.dtype), m + torch.log(l)
    return out, lse


def prefill_out_unwritten(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                          out=None):
    """Writes into the caller's out= but skips sequences with no keys (an uninitialized workspace row)."""
    res, lse = _prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        if ck[b + 1] > ck[b]:
            out[cq[b]:cq[b + 1]] = res[cq[b]:cq[b + 1]]
    return out, lse


def prefill_fp16_as_bf16(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    """A dtype-dispatch bug: float16 inputs take a bfloat16 path (8 fewer mantissa bits); others are right."""
    dtype = q.dtype
    if dtype == torch.float16:
        q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    out, lse = _prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    return out.to(dtype), lse


def _prefill_bug(bug: str):
    def fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        return _prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, bug)
    return fn


def _decode_bug(bug: str):
    def fn(q, kv_cache, block_table, seq_lens, softmax_scale, kv_lora_rank):
        return _latent(q, kv_cache, block_table, list(range(q.shape[0] + 1)), seq_lens, None, softmax_scale,
                       kv_lora_rank, bug)
    return fn


prefill_blocked = _prefill_bug("blocked")  # correct: another summation order
prefill_last_1024 = _prefill_bug("last-1024")
prefill_top_left = _prefill_bug("top-left")
prefill_lse_log2 = _prefill_bug("lse-log2")
prefill_batch_offset = _prefill_bug("batch-offset")
prefill_kv0_nan = _prefill_bug("kv0-nan")
mla_decode_scale_576 = _decode_bug("scale-576")
mla_decode_v_rope = _decode_bug("v-rope")
mla_decode_page_tail = _decode_bug("page-tail")
mla_decode_zero_weight_tail = _decode_bug("zero-weight-tail")  # correct on finite caches, as flash-attn's MLA


def _fault(name: str, fn: str, contract: str, description: str, expect: str) -> None:
    register(name, "kernel", description, expect)(lambda: {"impl": _SPEC + fn, "contract": contract})


_fault("attn-top-left", "prefill_top_left", "prefill",
       "prefill kernel aligning causal top-left (SDPA's is_causal) instead of bottom-right", "top-left causal")
_fault("attn-lse-log2", "prefill_lse_log2", "prefill", "prefill kernel returning lse in log2", "LSE in log2")
_fault("attn-batch-offset", "prefill_batch_offset", "prefill",
       "prefill kernel reading the keys of sequences after the first one row early", "only sequences after the first")
_fault("attn-kv0-nan", "prefill_kv0_nan", "prefill",
       "prefill kernel whose softmax divides 0/0 for an empty key range", "only sequences with kv_len 0")
_fault("attn-out-unwritten", "prefill_out_unwritten", "prefill",
       "prefill kernel leaving the out= rows of kv_len-0 sequences unwritten", "only sequences with kv_len 0")
_fault("attn-fp16-as-bf16", "prefill_fp16_as_bf16", "prefill",
       "prefill kernel sending float16 inputs down a bfloat16 path", "only dtype float16 fails")
_fault("attn-last-1024", "prefill_last_1024", "prefill",
       "prefill kernel attending only to the last 1024 keys of a sequence (no window set)",
       "keys beyond a limit dropped")
_fault("attn-scale-576", "mla_decode_scale_576", "mla-decode",
       "MLA decode using 1/sqrt(R+Dr) = 1/sqrt(576) instead of the given scale", "softmax scale from the wrong dim")
_fault("attn-v-rope", "mla_decode_v_rope", "mla-decode",
       "MLA decode taking V from cache[..., Dr:] instead of the latent", "V not taken from the latent")
_fault("attn-page-tail", "mla_decode_page_tail", "mla-decode",
       "MLA decode attending the unused (NaN) tail of the last page", "read beyond seq_len")
