"""Dense attention math and rotary embeddings: small pure functions, float64-capable.

Shapes: q [T, H, D], k [S, Hk, D], v [S, Hk, Dv]; H is a multiple of Hk (MHA: Hk == H, GQA: Hk < H,
MQA: Hk == 1); query head h reads kv head h // (H // Hk) (llama.cpp's ggml broadcast and
transformers' `repeat_kv` both group consecutive query heads).

Positions: the T queries are the LAST T of the S keys (bottom-right causal alignment, as llama.cpp's
KV-cache mask and flash-attention's causal=True for q_len < k_len): query i sits at position
q_offset + i with q_offset = S - T by default, and sees key j iff j <= q_offset + i and, with a sliding
window W, q_offset + i - j < W (llama.cpp LLAMA_SWA_TYPE_STANDARD; transformers'
`sliding_window_overlay`).

Scores are accumulated in float32, or float64 when the inputs are float64 (what engines do for half
precision inputs: fp32 accumulation and softmax); the output is cast back to q's dtype.
"""

from __future__ import annotations

from typing import Callable

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def visible(t: int, s: int, *, window: int | None = None, q_offset: int | None = None,
            k_offset: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """bool [t, s]: query i (position q_offset + i) may attend key j (position k_offset + j)."""
    q_offset = s + k_offset - t if q_offset is None else q_offset
    qp = torch.arange(t, device=device)[:, None] + q_offset  # [t, 1]
    kp = torch.arange(s, device=device)[None, :] + k_offset  # [1, s]
    ok = kp <= qp
    if window is not None:
        ok &= (qp - kp) < window
    return ok


def scores(q: torch.Tensor, k: torch.Tensor, *, scale: float, softcap: float | None = None) -> torch.Tensor:
    """Scaled (and soft-capped) logits [H, T, S] in the accumulation dtype; GQA by head groups."""
    t, h, d = q.shape
    s, hk, _ = k.shape
    if h % hk:
        raise ValueError(f"query heads {h} not a multiple of kv heads {hk}")
    acc = acc_dtype(q.dtype)
    qg = q.to(acc).reshape(t, hk, h // hk, d).permute(1, 2, 0, 3)  # [Hk, G, T, D]
    kg = k.to(acc).permute(1, 2, 0)[:, None]  # [Hk, 1, D, S]
    x = torch.matmul(qg, kg).reshape(h, t, s) * scale  # [H, T, S]
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    return x


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, *,
                      scale: float, softcap: float | None = None,
                      p_dtype: torch.dtype | Callable[[torch.Tensor], torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one block of keys: (out [T, H, Dv] in the accumulation dtype, lse [T, H]).

    `allowed` is bool [T, S]. A query with no visible key in the block gets out 0 and lse -inf, so
    blocks merge with `merge` regardless of how the keys were split. `p_dtype` rounds the
    probabilities before P·V, as an engine that multiplies V in half precision does (a dtype, or a
    rounding function: TF32, reference/emulate.py).
    """
    t, h, _ = q.shape
    s, hk, dv = v.shape
    x = scores(q, k, scale=scale, softcap=softcap)  # [H, T, S]
    x = x.masked_fill(~allowed[None], float("-inf"))
    lse = torch.logsumexp(x, dim=-1)  # [H, T]
    p = torch.exp(x - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])  # [H, T, S]
    if callable(p_dtype):
        p = p_dtype(p)
    elif p_dtype is not None:
        p = p.to(p_dtype).to(x.dtype)
    vg = v.to(x.dtype).permute(1, 0, 2)[:, None]  # [Hk, 1, S, Dv]
    out = torch.matmul(p.reshape(hk, h // hk, t, s), vg).reshape(h, t, dv)  # [H, T, Dv]
    return out.permute(1, 0, 2), lse.transpose(0, 1)


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-block partial results by log-sum-exp: out = sum_b exp(lse_b - lse) out_b."""
    lse = torch.logsumexp(torch.stack(lses), dim=0)  # [T, H]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = sum(torch.exp(l - safe)[..., None] * o for o, l in zip(outs, lses))
    return out, lse


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
              window: int | None = None, softcap: float | None = None, q_offset: int | None = None,
              kv_chunk: int | None = None, q_chunk: int | None = None,
              p_dtype: torch.dtype | Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention. q [T, H, D], k [S, Hk, D], v [S, Hk, Dv] -> [T, H, Dv] in q's dtype.

    With `kv_chunk`, the keys are processed in blocks and merged by log-sum-exp; with `q_chunk`, the
    queries in blocks (chunked prefill: each block sits at its own offset). Memory is then bounded by
    [H, q_chunk, kv_chunk] scores at a time; the result equals the one-block computation up to rounding.
    """
    t, s = q.shape[0], k.shape[0]
    q_offset = s - t if q_offset is None else q_offset
    if q_chunk and t > q_chunk:
        return torch.cat([attention(q[i:i + q_chunk], k, v, scale=scale, window=window, softcap=softcap,
                                    q_offset=q_offset + i, kv_chunk=kv_chunk, p_dtype=p_dtype)
                          for i in range(0, t, q_chunk)])
    step = kv_chunk or s
    outs, lses = [], []
    for j in range(0, s, step):
        kb, vb = k[j:j + step], v[j:j + step]
        allowed = visible(t, kb.shape[0], window=window, q_offset=q_offset, k_offset=j, device=q.device)
        if not allowed.any():
            continue
        o, l = partial_attention(q, kb, vb, allowed, scale=scale, softcap=softcap, p_dtype=p_dtype)
        outs.append(o)
        lses.append(l)
    out, _ = merge(outs, lses)
    return out.to(q.dtype)


# ---- rotary position embeddings ------------------------------------------------------------------

def rope_cos_sin(positions: torch.Tensor, dim: int, base: float, *, pos_scale: float = 1.0,
                 freq_factors: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, dim/2] for theta_i = pos * pos_scale * base^(-2i/dim) / freq_factors[i].

    Computed in float64 and cast to `dtype` (the angles of long positions lose digits in float32).
    `pos_scale` is llama.cpp's freq_scale (linear scaling), `freq_factors` its rope_freqs tensor.
    """
    inv = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)  # [dim/2]
    if freq_factors is not None:
        inv = inv / freq_factors.to(torch.float64)
    ang = positions.to(torch.float64)[:, None] * pos_scale * inv[None, :]  # [T, dim/2]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, neox: bool) -> torch.Tensor:
    """Rotate the first 2*cos.shape[1] dims of x [T, H, D]; the rest pass through.

    neox=True pairs dim i with i + n/2 (llama.cpp ROPE_TYPE_NEOX, transformers' rotate_half);
    neox=False pairs dims 2i and 2i+1 (llama.cpp's default "NORM" rope, used for llama GGUFs whose
    Q/K rows the converter permuted).
    """
    n = 2 * cos.shape[1]
    xr, rest = x[..., :n], x[..., n:]
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)  # [T, 1, n/2]
    if neox:
        a, b = xr[..., : n // 2], xr[..., n // 2:]
        rot = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    else:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    return torch.cat([rot, rest], dim=-1) if rest.shape[-1] else rot
