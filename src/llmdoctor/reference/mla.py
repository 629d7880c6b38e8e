"""Multi-head latent attention (DeepSeek-V2/V3 MLA), YaRN with mscale, and GLM-5's DSA indexer.

Pure functions on torch tensors; the block that wires them to a GGUF is reference/arch_deepseek.py.

Shapes (torch order, slowest first): T queries, S keys, H heads, R = kv_lora_rank, Dn = qk_nope_head_dim,
Dr = qk_rope_head_dim, Dv = v_head_dim. Weights are in the GGUF's layout as torch sees it:
    k_b  [H, R, Dn]   (GGUF attn_k_b, ne = (Dn, R, H): convert_hf_to_gguf.py transposes HF's k half)
    v_b  [H, Dv, R]   (GGUF attn_v_b, ne = (R, Dv, H))
    kv_b [H*(Dn+Dv), R] (legacy unsplit GGUF attn_kv_b = HF kv_b_proj: per head Dn key rows then Dv value rows)

Conventions and sources:
- MLA: q = q_b(rms_norm(q_a(x))) or q = wq(x) ("lite" models without q_lora_rank); kv_a_mqa(x) gives the
  latent [R] (then RMSNorm) and one shared k_pe [Dr]; the rope part sits after the nope part in each q head
  (transformers DeepseekV3Attention, llama.cpp src/models/deepseek2.cpp).
- Rope on q_pe/k_pe rotates adjacent pairs (llama.cpp LLAMA_ROPE_TYPE_NORM for deepseek2 and glm-dsa;
  transformers' `rope_interleave=True` path, the layout DeepSeek's checkpoints ship).
- Naive MLA decompresses the latent into per-head K/V with kv_b (transformers' expand_kv; llama.cpp's
  non-MLA path). Absorbed MLA folds k_b into q and runs MQA over [latent, k_pe] with the latent as the
  value, then applies v_b per head (llama.cpp's is_mla path: `build_attn(..., wv_b)`). Both are exact
  rewrites of the same bilinear form, equal up to rounding.
- YaRN: inverse frequencies blend interpolation (1/factor) and extrapolation with a linear ramp between
  the correction dims of beta_fast and beta_slow, floor/ceil-truncated (transformers
  `_compute_yarn_parameters`, ggml `ggml_rope_yarn_corr_dims` / `rope_yarn_ramp`: the same formula).
  cos/sin are multiplied by `attn_factor` (GGUF rope.scaling.yarn_attn_factor, default 1: DeepSeek's
  mscale == mscale_all_dim makes transformers' attention_factor 1). The softmax scale is
  mscale^2 / sqrt(Dn + Dr) with mscale = 0.1 * mscale_all_dim * ln(factor) + 1 (transformers
  `yarn_get_mscale`; llama.cpp deepseek2.cpp kq_scale, where the GGUF's yarn_log_multiplier holds
  0.1 * mscale_all_dim and the loader divides the 0.1 back out, [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]).
- DSA indexer (GLM-5 glm-dsa, DeepSeek-V3.2): iq = wq_b(q_resid) per indexer head, ik = LayerNorm(wk(x))
  (one shared key head), rope on the first Dr dims of both (adjacent pairs); score[t, s] =
  sum_h w[t, h] * relu(iq[t, h] . ik[s]) / sqrt(D_idx * H_idx) with w = weights_proj(x); causal mask;
  the top-k keys per query are the only keys the attention sees (transformers GlmMoeDsaIndexer,
  llama.cpp src/models/glm-dsa.cpp; llama.cpp's Hadamard rotation of iq/ik is orthogonal and leaves the
  dot products unchanged). "shared" indexer layers reuse the previous full layer's selection.
  The rope part of iq/ik comes first, the rest after it, as in transformers' GlmMoeDsaIndexer
  ([q_rot, q_pass]); convert_hf_to_gguf.py's GlmMoeDsaModel copies the indexer tensors unchanged.
  Measured against llama-cpp-python 0.3.36 on GLM-DSA fixtures: its selections agree with this up to
  ties; a reference roping the last Dr dims instead disagreed on 82% of queries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from . import attention as attn

# gguf 0.19 has no constant for this key. llama.cpp reads it as LLM_KV_ATTENTION_INDEXER_TYPES
# ("%s.attention.indexer.types", src/llama-arch.cpp; glm-dsa load_arch_hparams), one bool per layer,
# true = "full" (the layer runs its own indexer), false = "shared"; convert_hf_to_gguf.py writes it from
# the HF config's `indexer_types` (GlmMoeDsaModel.set_gguf_parameters). Absent: every layer is full
# (llama.cpp's backward-compatible default for GLM-5 / 5.1 files).
INDEXER_TYPES_KEY = "{arch}.attention.indexer.types"


@dataclass(frozen=True)
class Yarn:
    """YaRN rope scaling as stored in GGUF metadata (rope.scaling.*)."""

    factor: float
    orig_ctx: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale_all_dim: float = 0.0  # GGUF yarn_log_multiplier / 0.1
    attn_factor: float = 1.0  # cos/sin multiplier (GGUF rope.scaling.yarn_attn_factor)


@dataclass(frozen=True)
class Indexer:
    """The DSA lightning indexer's shape and the per-layer full/shared pattern."""

    n_head: int
    head_dim: int
    top_k: int
    full: tuple[bool, ...]  # per layer: runs its own indexer
    k_norm_eps: float = 1e-6  # transformers GlmMoeDsaIndexer: nn.LayerNorm(head_dim, eps=1e-6)


@dataclass(frozen=True)
class MLA:
    """MLA dimensions (GGUF attention.q_lora_rank / kv_lora_rank / key_length_mla / value_length_mla)."""

    q_lora_rank: int  # 0: plain wq (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_dim: int
    yarn: Yarn | None = None
    indexer: Indexer | None = None

    @property
    def qk_dim(self) -> int:
        return self.qk_nope + self.qk_rope


# ---- YaRN ------------------------------------------------------------------------------------------

def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """0.1 * mscale * ln(factor) + 1 for factor > 1, else 1 (DeepSeek's YaRN magnitude correction)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_freq_factors(dim: int, base: float, y: Yarn) -> torch.Tensor:
    """float64 [dim/2] divisors of the plain inverse frequencies that give YaRN's blended ones.

    inv_yarn[i] = inv[i] * ((1 - r[i]) / factor + r[i]), r = extrapolation weight (1 for the fast
    dims before `low`, 0 after `high`, linear between), low/high = floor/ceil of the correction dims
    dim * ln(orig_ctx / (2 pi beta)) / (2 ln base), clamped to [0, dim - 1].
    """
    def corr(beta: float) -> float:
        return dim * math.log(y.orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(y.beta_fast)), 0)
    high = min(math.ceil(corr(y.beta_slow)), dim - 1)
    i = torch.arange(dim // 2, dtype=torch.float64)
    ramp = ((i - low) / max(high - low, 0.001)).clamp(0, 1)  # 0 -> extrapolate, 1 -> interpolate
    r = 1.0 - ramp  # extrapolation weight
    return 1.0 / ((1.0 - r) / y.factor + r)


def kq_scale(m: MLA) -> float:
    """Softmax scale of MLA attention: mscale^2 / sqrt(Dn + Dr) (1 / sqrt(Dn + Dr) without YaRN)."""
    ms = yarn_get_mscale(m.yarn.factor, m.yarn.mscale_all_dim) if m.yarn and m.yarn.mscale_all_dim else 1.0
    return ms * ms / math.sqrt(m.qk_dim)


def rope_tables(positions: torch.Tensor, m: MLA, base: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, Dr/2] for the rope part, with YaRN frequencies and attn_factor when configured."""
    ff = yarn_freq_factors(m.qk_rope, base, m.yarn).to(positions.device) if m.yarn else None
    cos, sin = attn.rope_cos_sin(positions, m.qk_rope, base, freq_factors=ff, dtype=torch.float64)
    if m.yarn:
        cos, sin = cos * m.yarn.attn_factor, sin * m.yarn.attn_factor
    return cos.to(dtype), sin.to(dtype)


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Adjacent-pair rope on the first 2*cos.shape[1] dims of x [T, H, D] (llama.cpp ROPE_TYPE_NORM)."""
    return attn.apply_rope(x, cos, sin, neox=False)


# ---- MLA ---------------------------------------------------------------------------------------------

def decompress(latent: torch.Tensor, k_b: torch.Tensor, v_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [S, R] -> per-head k_nope [S, H, Dn] and v [S, H, Dv]."""
    k_nope = torch.einsum("sr,hrn->shn", latent, k_b)
    v = torch.einsum("sr,hvr->shv", latent, v_b)
    return k_nope, v


def mla_naive(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
              k_b: torch.Tensor, v_b: torch.Tensor, allowed: torch.Tensor, *, scale: float) -> torch.Tensor:
    """MLA as MHA over decompressed keys/values.

    q_nope [T, H, Dn], q_pe [T, H, Dr] (roped), latent [S, R] (normed), k_pe [S, Dr] (roped),
    allowed bool [T, S] -> out [T, H, Dv] (before the output projection).
    """
    k_nope, v = decompress(latent, k_b, v_b)  # [S, H, Dn], [S, H, Dv]
    h = q_nope.shape[1]
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, h, -1)], dim=-1)  # [S, H, Dn+Dr]
    q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, Dn+Dr]
    out, _ = attn.partial_attention(q, k, v, allowed, scale=scale)
    return out.to(q.dtype)


def absorb_q(q_nope: torch.Tensor, q_pe: torch.Tensor, k_b: torch.Tensor) -> torch.Tensor:
    """Queries of the absorbed form [T, H, R+Dr]: q_nope k_b^T per head, then the roped part
    (llama.cpp's Qcur of the MLA path)."""
    return torch.cat([torch.einsum("thn,hrn->thr", q_nope, k_b), q_pe], dim=-1)


def mqa_keys(latent: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """The single key head of the absorbed form [S, 1, R+Dr] (llama.cpp's Kcur of the MLA path)."""
    return torch.cat([latent, k_pe], dim=-1)[:, None, :]


def latent_attention(q_abs: torch.Tensor, k_cat: torch.Tensor, latent: torch.Tensor, v_b: torch.Tensor,
                     allowed: torch.Tensor, *, scale: float, p_dtype: torch.dtype | None = None,
                     v_b_input: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """MQA over the latent (values = latent [S, R]), then v_b per head -> [T, H, Dv]. `p_dtype` rounds
    the probabilities before P·V; `v_b_input` maps the latent output [T, H, R] before the v_b product
    (both for emulating an engine's arithmetic)."""
    o_lat, _ = attn.partial_attention(q_abs, k_cat, latent[:, None, :], allowed, scale=scale,
                                      p_dtype=p_dtype)  # [T, H, R]
    o_lat = o_lat.to(q_abs.dtype)
    if v_b_input is not None:
        o_lat = v_b_input(o_lat)
    return torch.einsum("thr,hvr->thv", o_lat, v_b)


def mla_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                 k_b: torch.Tensor, v_b: torch.Tensor, allowed: torch.Tensor, *, scale: float) -> torch.Tensor:
    """MLA as MQA over the latent: keys [latent, k_pe], values = latent, q with k_b folded in, v_b
    applied after. Same arguments and result as `mla_naive`."""
    return latent_attention(absorb_q(q_nope, q_pe, k_b), mqa_keys(latent, k_pe), latent, v_b, allowed, scale=scale)


# ---- DSA indexer -------------------------------------------------------------------------------------

def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim (torch.nn.LayerNorm; llama.cpp LLM_NORM with weight and bias)."""
    acc = attn.acc_dtype(x.dtype)
    xf = x.to(acc)
    y = (xf - xf.mean(-1, keepdim=True)) * torch.rsqrt(xf.var(-1, unbiased=False, keepdim=True) + eps) * w.to(acc)
    return (y + b.to(acc) if b is not None else y).to(x.dtype)


def indexer_scores(x: torch.Tensor, q_resid: torch.Tensor, wq_b: torch.Tensor, wk: torch.Tensor,
                   k_norm_w: torch.Tensor, k_norm_b: torch.Tensor | None, w_proj: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, ix: Indexer,
                   linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                   quant: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
                   ) -> torch.Tensor:
    """Index scores [T, S] (S = T, causal: -inf above the diagonal) in the accumulation dtype.

    x [T, n_embd] (the attention's normed input), q_resid [T, q_lora_rank] (normed q_a output),
    wq_b [H_idx*D_idx, q_lora_rank], wk [D_idx, n_embd], w_proj [H_idx, n_embd], cos/sin [T, Dr/2].
    `quant`: q and k (after their rotary) as an emulated engine's indexer rounds them before the dot.
    """
    t = x.shape[0]
    acc = attn.acc_dtype(x.dtype)
    lin = linear or (lambda a, w: a @ w.t())  # `linear`: the three projections as an emulated engine runs them
    iq = lin(q_resid, wq_b).view(t, ix.n_head, ix.head_dim)  # [T, Hi, Di]
    ik = layer_norm(lin(x, wk), k_norm_w, k_norm_b, ix.k_norm_eps)[:, None, :]  # [T, 1, Di]
    iq, ik = rope_pairs(iq, cos, sin), rope_pairs(ik, cos, sin)[:, 0]  # [T, Hi, Di], [T, Di]
    if quant is not None:
        iq, ik = quant(iq, ik)
    iq, ik = iq.to(acc), ik.to(acc)
    w = lin(x, w_proj).to(acc) / math.sqrt(ix.head_dim * ix.n_head)  # [T, Hi]
    s = torch.relu(torch.einsum("thd,sd->ths", iq, ik))  # [T, Hi, S]
    score = torch.einsum("th,ths->ts", w, s)  # [T, S]
    return score.masked_fill(~attn.visible(t, t, device=x.device), float("-inf"))


def topk_indices(score: torch.Tensor, top_k: int) -> torch.Tensor:
    """Indices [T, min(top_k, S)] of each query's highest index scores, best first; among equal scores the
    lower position first, on every device. (torch.topk breaks ties one way on the CPU and another on CUDA:
    an indexer's ReLU gives many keys a score of exactly 0, and the reference must not depend on where it
    runs. Engines' own tie order is unspecified, so comparisons with them allow ties: tests/test_reference_mla.)"""
    return score.sort(dim=-1, descending=True, stable=True).indices[:, : min(top_k, score.shape[-1])]


def selection_mask(idx: torch.Tensor, s: int) -> torch.Tensor:
    """bool [T, S] with the selected keys of each query, intersected with causality. Indices outside
    [0, S) (an engine's padding of its KV cache) select nothing."""
    t = idx.shape[0]
    idx = idx.long()
    valid = ((idx >= 0) & (idx < s)).to(torch.int32)
    hits = torch.zeros(t, s, dtype=torch.int32, device=idx.device).scatter_add_(1, idx.clamp(0, s - 1), valid)
    return (hits > 0) & attn.visible(t, s, device=idx.device)
