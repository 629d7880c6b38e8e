"""DeepSeek-V2/V3 (GGUF `deepseek2`) and GLM-5 (`glm-dsa`): config parsing, MoE routing, the block.

Registered into reference/config.py (GGUF and HF config parsers) and reference/forward.py (the block).
The attention math is reference/mla.py.

MoE conventions (llama.cpp `build_moe_ffn`, transformers DeepseekV3TopkRouter / DeepseekV3MoE):
router logits = ffn_gate_inp(x); probabilities = sigmoid (V3, GLM-5) or softmax over all experts (V2);
the expert-score correction bias (exp_probs_b) is added only for *choosing* experts; with n_group > 1
the experts are chosen inside the topk_group groups with the highest sum of their two best scores
(DeepSeek-V3's rule; llama.cpp applies it to every file with expert_group_count > 1, DeepSeek-V2's
too, whose group_limited_greedy ranked groups by their single best score);
the chosen experts' unbiased probabilities are the weights, normalized to sum 1 when
expert_weights_norm, then multiplied by expert_weights_scale (routed_scaling_factor); SwiGLU experts;
the shared expert is a plain SwiGLU FFN added to the routed sum; the first leading_dense_block_count
layers have a dense FFN instead.

Capture points of the MLA block, in addition to forward.py's common ones (attn_norm, ffn_inp,
ffn_norm, ffn_out, l_out, kqv_out [T, H*Dv], attn_out); names follow llama.cpp's deepseek2.cpp /
glm-dsa.cpp callbacks, shapes are those of its absorbed (is_mla) path:
    kv_cmpr-{i}        [T, R]          the MLA latent after its RMSNorm
    q_pe-{i}, k_pe-{i} [T, H, Dr], [T, Dr]  the roped parts
    Qcur-{i}           [T, H, R+Dr]    q_nope absorbed through k_b, then q_pe
    Kcur-{i}           [T, 1, R+Dr]    latent, then k_pe (one key head)
    Vcur-{i}           [T, 1, R]       the latent
    indexer_score-{i}  [T, T]          DSA index scores, -inf above the diagonal (full indexer layers)
    top_k-{i}          [T, k]          the keys each query attends (glm-dsa)
    ffn_moe_topk-{i}, ffn_moe_weights-{i}  [T, n_used]  chosen experts and their weights
    ffn_moe_scores-{i} [T, E]          the scores experts are chosen by (gate probabilities + correction bias)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from gguf import MODEL_TENSOR, ExpertGatingFuncType, Keys

from ..errors import InputError
from ..gguf.layout import kv_b_split
from . import attention as attn
from . import mla
from .config import ModelConfig, gguf_key, register_gguf, register_hf
from .forward import (Step, dense_ffn, emulating, engine_input, indexer_rounding, kv_cache_dtype, kv_cache_fp8,
                      linear, register_block, rms_norm, tensor_name)


@dataclass(frozen=True)
class MoE:
    n_expert: int
    n_used: int
    n_shared: int
    n_ff_exp: int
    gating: str  # "sigmoid" or "softmax"
    norm_topk: bool
    scale: float
    n_group: int = 1
    topk_group: int = 1
    n_dense_lead: int = 0


# ---- config: GGUF ------------------------------------------------------------------------------------

def _gguf_yarn(g: Any, arch: str) -> mla.Yarn | None:
    if gguf_key(g, Keys.Rope.SCALING_TYPE, arch, "none") != "yarn":
        return None
    factor = float(gguf_key(g, Keys.Rope.SCALING_FACTOR, arch))
    # stored as 0.1 * mscale_all_dim; llama.cpp divides the 0.1 back out in float32 (exact for 0.1f / 0.1f)
    mall = float(np.float32(gguf_key(g, Keys.Rope.SCALING_YARN_LOG_MUL, arch, 0.0)) / np.float32(0.1))
    # cos/sin multiplier: the file's yarn_attn_factor; else 1 when DeepSeek's mscale_all_dim is set
    # (mscale == mscale_all_dim), else YaRN's default get_mscale(factor) (transformers' attention_factor).
    default_af = 1.0 if mall else mla.yarn_get_mscale(factor)
    return mla.Yarn(
        factor=factor,
        orig_ctx=int(gguf_key(g, Keys.Rope.SCALING_ORIG_CTX_LEN, arch)),
        beta_fast=float(gguf_key(g, Keys.Rope.SCALING_YARN_BETA_FAST, arch, 32.0)),
        beta_slow=float(gguf_key(g, Keys.Rope.SCALING_YARN_BETA_SLOW, arch, 1.0)),
        mscale_all_dim=mall,
        attn_factor=float(gguf_key(g, Keys.Rope.SCALING_YARN_ATTN_FACTOR, arch, default_af)),
    )


def _gguf_indexer(g: Any, arch: str, n_layer: int) -> mla.Indexer | None:
    n_head = gguf_key(g, Keys.Attention.Indexer.HEAD_COUNT, arch, None)
    if n_head is None:
        return None
    types = g.get(mla.INDEXER_TYPES_KEY.format(arch=arch))
    full = tuple(bool(t) for t in types) if types is not None else (True,) * n_layer
    if len(full) != n_layer or not full[0]:
        raise InputError(f"{g.path}: {mla.INDEXER_TYPES_KEY.format(arch=arch)} must have {n_layer} entries, the first full")
    # k_norm eps: transformers' nn.LayerNorm(eps=1e-6); a file may carry attention.layer_norm_epsilon
    eps = float(gguf_key(g, Keys.Attention.LAYERNORM_EPS, arch, 1e-6))
    return mla.Indexer(int(n_head), int(gguf_key(g, Keys.Attention.Indexer.KEY_LENGTH, arch)),
                       int(gguf_key(g, Keys.Attention.Indexer.TOP_K, arch)), full, eps)


def _gguf_moe(g: Any, arch: str) -> MoE | None:
    n_expert = gguf_key(g, Keys.LLM.EXPERT_COUNT, arch, None)
    if not n_expert:
        return None
    # llama.cpp: deepseek2 files without expert_gating_func are V2/V2.5 (softmax); glm-dsa defaults to sigmoid
    default = ExpertGatingFuncType.SIGMOID if arch == "glm-dsa" else ExpertGatingFuncType.SOFTMAX
    gating = int(gguf_key(g, Keys.LLM.EXPERT_GATING_FUNC, arch, default))
    if gating not in (ExpertGatingFuncType.SIGMOID, ExpertGatingFuncType.SOFTMAX):
        raise InputError(f"{g.path}: expert gating function {gating} not supported")
    return MoE(
        n_expert=int(n_expert),
        n_used=int(gguf_key(g, Keys.LLM.EXPERT_USED_COUNT, arch)),
        n_shared=int(gguf_key(g, Keys.LLM.EXPERT_SHARED_COUNT, arch, 0)),
        n_ff_exp=int(gguf_key(g, Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, arch)),
        gating="sigmoid" if gating == ExpertGatingFuncType.SIGMOID else "softmax",
        norm_topk=bool(gguf_key(g, Keys.LLM.EXPERT_WEIGHTS_NORM, arch, False)),
        scale=float(gguf_key(g, Keys.LLM.EXPERT_WEIGHTS_SCALE, arch, 1.0) or 1.0),
        n_group=int(gguf_key(g, Keys.LLM.EXPERT_GROUP_COUNT, arch, 1) or 1),
        topk_group=int(gguf_key(g, Keys.LLM.EXPERT_GROUP_USED_COUNT, arch, 1) or 1),
        n_dense_lead=int(gguf_key(g, Keys.LLM.LEADING_DENSE_BLOCK_COUNT, arch, 0)),
    )


@register_gguf("deepseek2", "glm-dsa")
def _mla_gguf(g: Any) -> ModelConfig:
    """MLA metadata as llama.cpp's deepseek2 / glm-dsa loaders read it. The GGUF's head_count_kv (1)
    and key/value_length (R + Dr, R) describe the absorbed MQA view; the config keeps the MHA view
    (n_head_kv = n_head, head_dim = Dn + Dr from key_length_mla) so that it diffs equal to the HF one.
    Files converted before llama.cpp split kv_b (no key_length_mla) store the MHA sizes in
    key/value_length and one attn_kv_b; the block splits it at load (`gguf.layout.kv_b_split`)."""
    arch = g.get("general.architecture")
    n_layer = int(gguf_key(g, Keys.LLM.BLOCK_COUNT, arch))
    n_head = int(gguf_key(g, Keys.Attention.HEAD_COUNT, arch))
    kv_lora = int(gguf_key(g, Keys.Attention.KV_LORA_RANK, arch))
    rope = int(gguf_key(g, Keys.Rope.DIMENSION_COUNT, arch))
    qk = gguf_key(g, Keys.Attention.KEY_LENGTH_MLA, arch, None)
    if qk is None:  # a file from before the MLA split: MHA head sizes, one unsplit attn_kv_b
        qk, v = gguf_key(g, Keys.Attention.KEY_LENGTH, arch), gguf_key(g, Keys.Attention.VALUE_LENGTH, arch)
    else:
        v = gguf_key(g, Keys.Attention.VALUE_LENGTH_MLA, arch)
    m = mla.MLA(
        q_lora_rank=int(gguf_key(g, Keys.Attention.Q_LORA_RANK, arch, 0) or 0),
        kv_lora_rank=kv_lora,
        qk_nope=int(qk) - rope,
        qk_rope=rope,
        v_dim=int(v),
        yarn=_gguf_yarn(g, arch),
        indexer=_gguf_indexer(g, arch, n_layer),
    )
    moe = _gguf_moe(g, arch)
    embd = g.tensor("token_embd.weight")
    return ModelConfig(
        arch=arch, n_layer=n_layer, n_embd=int(gguf_key(g, Keys.LLM.EMBEDDING_LENGTH, arch)),
        n_head=n_head, n_head_kv=n_head, head_dim=m.qk_dim, head_dim_v=m.v_dim,
        n_ff=int(gguf_key(g, Keys.LLM.FEED_FORWARD_LENGTH, arch, 0)), n_vocab=int(embd.ne[1]),
        norm_eps=float(gguf_key(g, Keys.Attention.LAYERNORM_RMS_EPS, arch)),
        rope_base=float(gguf_key(g, Keys.Rope.FREQ_BASE, arch, 10_000.0)), rope_dim=rope, rope_neox=False,
        attn_scale=mla.kq_scale(m), tied_output=not any(t.name == "output.weight" for t in g.tensors),
        mla=m, moe=moe, source="gguf",
    )


# ---- config: HF --------------------------------------------------------------------------------------

def _hf_yarn(d: dict) -> mla.Yarn | None:
    p = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if p.get("rope_type", p.get("type")) != "yarn":
        return None
    factor = float(p["factor"])
    mall, ms = float(p.get("mscale_all_dim") or 0.0), float(p.get("mscale") or 0.0)
    af = p.get("attention_factor")
    if af is None:  # transformers _compute_yarn_parameters
        af = mla.yarn_get_mscale(factor, ms) / mla.yarn_get_mscale(factor, mall) if ms and mall else mla.yarn_get_mscale(factor)
    return mla.Yarn(factor, int(p["original_max_position_embeddings"]), float(p.get("beta_fast") or 32.0),
                    float(p.get("beta_slow") or 1.0), mall, float(af))


@register_hf("deepseek_v2", "deepseek_v3", "glm_moe_dsa")
def _mla_hf(d: dict) -> ModelConfig:
    """transformers DeepseekV2Config / DeepseekV3Config / GlmMoeDsaConfig. Gating: DeepSeek-V2's router is
    softmax, V3's and GLM-MoE-DSA's sigmoid (transformers hardcodes both; the original checkpoints'
    config.json carry it as `scoring_func`)."""
    n_layer, n_head = int(d["num_hidden_layers"]), int(d["num_attention_heads"])
    ix = None
    if d.get("model_type") == "glm_moe_dsa":
        types = d.get("indexer_types") or ["full"] * n_layer
        ix = mla.Indexer(int(d["index_n_heads"]), int(d["index_head_dim"]), int(d["index_topk"]),
                         tuple(t == "full" for t in types))
    m = mla.MLA(q_lora_rank=int(d.get("q_lora_rank") or 0), kv_lora_rank=int(d["kv_lora_rank"]),
                qk_nope=int(d["qk_nope_head_dim"]), qk_rope=int(d["qk_rope_head_dim"]),
                v_dim=int(d["v_head_dim"]), yarn=_hf_yarn(d), indexer=ix)
    moe = None
    if d.get("n_routed_experts"):
        scoring = d.get("scoring_func") or ("softmax" if d.get("model_type") == "deepseek_v2" else "sigmoid")
        moe = MoE(n_expert=int(d["n_routed_experts"]), n_used=int(d["num_experts_per_tok"]),
                  n_shared=int(d.get("n_shared_experts") or 0), n_ff_exp=int(d["moe_intermediate_size"]),
                  gating=scoring, norm_topk=bool(d.get("norm_topk_prob")),
                  scale=float(d.get("routed_scaling_factor") or 1.0), n_group=int(d.get("n_group") or 1),
                  topk_group=int(d.get("topk_group") or 1), n_dense_lead=int(d.get("first_k_dense_replace") or 0))
    p = d.get("rope_parameters") or {}
    return ModelConfig(
        arch="glm-dsa" if d.get("model_type") == "glm_moe_dsa" else "deepseek2",
        n_layer=n_layer, n_embd=int(d["hidden_size"]), n_head=n_head, n_head_kv=n_head,
        head_dim=m.qk_dim, head_dim_v=m.v_dim, n_ff=int(d["intermediate_size"]), n_vocab=int(d["vocab_size"]),
        norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_base=float(p.get("rope_theta", d.get("rope_theta", 10_000.0))),
        rope_dim=m.qk_rope, rope_neox=False, attn_scale=mla.kq_scale(m),
        tied_output=bool(d.get("tie_word_embeddings", False)), mla=m, moe=moe, source="hf",
    )


# ---- MoE ---------------------------------------------------------------------------------------------

def group_scores(choice: torch.Tensor, n_group: int) -> torch.Tensor:
    """Selection scores [T, E] -> each expert group's score [T, G]: the sum of its two best experts'
    (DeepSeek-V3's noaux_tc grouping, as llama.cpp's and vLLM's grouped top-k compute it)."""
    t, e = choice.shape
    return choice.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)


def route(logits: torch.Tensor, bias: torch.Tensor | None, moe: MoE,
          override: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (+ correction bias [E]) -> (weights [T, k], expert ids [T, k], the selection
    scores [T, E] the ids were chosen by). `override` [T, k]: use these experts instead of choosing (an
    engine's choice among near-tied experts; the moe-routing check judges whether it is one the scores
    allow), weighted as the router weights its own."""
    t, e = logits.shape
    probs = torch.sigmoid(logits) if moe.gating == "sigmoid" else torch.softmax(logits, dim=-1)  # [T, E]
    scores = probs + bias.to(probs.dtype) if bias is not None else probs
    if override is not None:
        idx = override.to(device=logits.device, dtype=torch.long)
    else:
        choice = scores
        if moe.n_group > 1:
            keep = group_scores(scores, moe.n_group).topk(moe.topk_group, dim=-1).indices  # [T, topk_group]
            gmask = torch.zeros(t, moe.n_group, dtype=torch.bool, device=logits.device).scatter_(1, keep, True)
            choice = scores.masked_fill(~gmask.repeat_interleave(e // moe.n_group, dim=1), float("-inf"))
        idx = choice.topk(moe.n_used, dim=-1).indices  # [T, k]
    w = probs.gather(1, idx)
    if moe.norm_topk:
        w = w / w.sum(-1, keepdim=True)
    return w * moe.scale, idx, scores


def experts(h: torch.Tensor, w: torch.Tensor, idx: torch.Tensor,
            expert: Callable[[str, int], torch.Tensor]) -> torch.Tensor:
    """Routed SwiGLU experts. h [T, n_embd], w/idx [T, k]; expert(proj, e) gives expert e's matrix:
    "gate"/"up" [F, n_embd], "down" [n_embd, F]. Only the chosen experts are touched."""
    out = torch.zeros_like(h)
    for e in idx.unique().tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        x = h[tok]
        g = torch.nn.functional.silu(linear(x, expert("gate", e)))
        y = linear(g * linear(x, expert("up", e)), expert("down", e))  # [n, n_embd]
        out.index_add_(0, tok, y * w[tok, slot, None].to(y.dtype))
    return out


MOE_OVERRIDE = "moe_topk_override"  # Step.extra key: {layer: expert ids [T, k]} to replace the router's choice


def moe_ffn(st: Step, h: torch.Tensor) -> torch.Tensor:
    moe = st.cfg.moe
    acc = attn.acc_dtype(h.dtype)
    logits = linear(h.to(acc), st.w(MODEL_TENSOR.FFN_GATE_INP).to(acc))  # [T, E]
    bias = st.w(MODEL_TENSOR.FFN_EXP_PROBS_B, "bias") if st.has(MODEL_TENSOR.FFN_EXP_PROBS_B, "bias") else None
    w, idx, scores = route(logits, bias, moe, override=st.extra.get(MOE_OVERRIDE, {}).get(st.il))
    st.cap("ffn_moe_scores", scores)
    st.cap("ffn_moe_topk", idx)
    st.cap("ffn_moe_weights", w)
    kinds = {"gate": MODEL_TENSOR.FFN_GATE_EXP, "up": MODEL_TENSOR.FFN_UP_EXP, "down": MODEL_TENSOR.FFN_DOWN_EXP}
    out = experts(h, w, idx, lambda proj, e: st.weights.slab(tensor_name(kinds[proj], st.il), e))
    if moe.n_shared:
        g = torch.nn.functional.silu(linear(h, st.w(MODEL_TENSOR.FFN_GATE_SHEXP)))
        out = out + linear(g * linear(h, st.w(MODEL_TENSOR.FFN_UP_SHEXP)), st.w(MODEL_TENSOR.FFN_DOWN_SHEXP))
    return out


# ---- attention ---------------------------------------------------------------------------------------

DSA_OVERRIDE = "dsa_top_k_override"  # Step.extra key: {layer: indices [T, k]} to replace the indexer's choice
DSA_PREV = "dsa_top_k"  # Step.extra key: the last full layer's selection


def _kv_b(st: Step, m: mla.MLA) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(k_b [H, R, Dn], v_b [H, Dv, R], and the legacy unsplit attn_kv_b [H*(Dn+Dv), R] they are
    views of, or None for a file with attn_k_b / attn_v_b)."""
    if st.has(MODEL_TENSOR.ATTN_K_B):
        return st.w(MODEL_TENSOR.ATTN_K_B), st.w(MODEL_TENSOR.ATTN_V_B), None
    kv_b = st.w(MODEL_TENSOR.ATTN_KV_B)
    return (*kv_b_split(kv_b, st.cfg.n_head, m.qk_nope, m.v_dim, copy=False), kv_b)


def _expanded_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                        kv_b: torch.Tensor, k_b: torch.Tensor, v_b: torch.Tensor, allowed: torch.Tensor, *,
                        scale: float, il: int) -> torch.Tensor:
    """MLA as llama.cpp runs a file without the MLA split (no key_length_mla): K and V expanded per
    head with attn_kv_b, then ordinary attention over an MHA cache, under the emulated engine's
    arithmetic (the expansion fed like any matmul; Q, K, V and P in the cache dtype) -> [T, H, Dv]."""
    k_nope, v = mla.decompress(engine_input(latent, kv_b), k_b, v_b)  # [S, H, Dn], [S, H, Dv]
    q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, Dn+Dr]
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, k_nope.shape[1], -1)], dim=-1)  # [S, H, Dn+Dr]
    kv_dtype, fp8 = kv_cache_dtype(), kv_cache_fp8()
    if kv_dtype is not None:
        q, k, v = (t.to(kv_dtype).to(t.dtype) for t in (q, k, v))
    if fp8 is not None:  # an fp8 MHA cache of the expanded K and V, with the layer's scales
        q, k, v = fp8.q(il, q), fp8.k(il, k), fp8.v(il, v)
    o, _ = attn.partial_attention(q, k, v, allowed, scale=scale,
                                  p_dtype=kv_dtype or (fp8.weights(il) if fp8 else None))
    return o.to(q.dtype)


def _selection(st: Step, h: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The DSA top-k key indices [T, k] of this layer (own indexer, shared, or overridden)."""
    ix = st.cfg.mla.indexer
    override = st.extra.get(DSA_OVERRIDE, {}).get(st.il)
    if ix.full[st.il]:
        nb = MODEL_TENSOR.INDEXER_K_NORM
        score = mla.indexer_scores(
            h, q_resid, st.w(MODEL_TENSOR.INDEXER_ATTN_Q_B), st.w(MODEL_TENSOR.INDEXER_ATTN_K), st.w(nb),
            st.w(nb, "bias") if st.has(nb, "bias") else None, st.w(MODEL_TENSOR.INDEXER_PROJ), cos, sin, ix,
            linear=linear, quant=indexer_rounding())
        st.cap("indexer_score", score)
        st.extra[DSA_PREV] = mla.topk_indices(score, ix.top_k) if override is None else override
    elif override is not None:
        st.extra[DSA_PREV] = override
    return st.cap("top_k", st.extra[DSA_PREV])


def mla_attention(st: Step, h: torch.Tensor) -> torch.Tensor:
    """MLA self-attention (absorbed, as llama.cpp runs it) on the normed input h [T, n_embd]."""
    cfg, m = st.cfg, st.cfg.mla
    T, H, eps = h.shape[0], cfg.n_head, cfg.norm_eps
    q_resid = None
    if m.q_lora_rank:
        q_resid = rms_norm(linear(h, st.w(MODEL_TENSOR.ATTN_Q_A)), st.w(MODEL_TENSOR.ATTN_Q_A_NORM), eps)
        q = linear(q_resid, st.w(MODEL_TENSOR.ATTN_Q_B))
    else:
        q = linear(h, st.w(MODEL_TENSOR.ATTN_Q))
    q = q.view(T, H, m.qk_dim)
    kv = linear(h, st.w(MODEL_TENSOR.ATTN_KV_A_MQA))  # [T, R + Dr]
    latent = st.cap("kv_cmpr", rms_norm(kv[:, :m.kv_lora_rank], st.w(MODEL_TENSOR.ATTN_KV_A_NORM), eps))  # [T, R]
    cos, sin = mla.rope_tables(st.positions, m, cfg.layer_rope_base(st.il), h.dtype)
    q_pe = st.cap("q_pe", mla.rope_pairs(q[..., m.qk_nope:], cos, sin))  # [T, H, Dr]
    k_pe = st.cap("k_pe", mla.rope_pairs(kv[:, None, m.kv_lora_rank:], cos, sin)[:, 0])  # [T, Dr]
    k_b, v_b, kv_b = _kv_b(st, m)
    if m.indexer is None:
        allowed = attn.visible(T, T, device=h.device)
    else:
        allowed = mla.selection_mask(_selection(st, h, q_resid, cos, sin), T)
    if kv_b is not None and emulating():  # the engine runs this file as MHA, not as MLA
        o = _expanded_attention(q[..., :m.qk_nope], q_pe, latent, k_pe, kv_b, k_b, v_b, allowed,
                                scale=cfg.attn_scale, il=st.il)  # [T, H, Dv]
    else:
        q_abs = mla.absorb_q(engine_input(q[..., :m.qk_nope], k_b), q_pe, k_b)
        k_cat = mla.mqa_keys(latent, k_pe)
        st.cap("Qcur", q_abs)
        st.cap("Kcur", k_cat)
        st.cap("Vcur", latent[:, None, :])
        v_lat, kv_dtype, fp8 = latent, kv_cache_dtype(), kv_cache_fp8()
        if kv_dtype is not None:  # the engine's KV cache holds [latent, k_pe] (V is its latent part)
            q_abs, k_cat, v_lat = (t.to(kv_dtype).to(t.dtype) for t in (q_abs, k_cat, latent))
        if fp8 is not None:  # an fp8 cache row [latent, k_pe]: the layer's scale, or fp8_ds_mla's 128-tiles
            v_lat, pe = fp8.mla_row(st.il, latent, k_pe)
            q_abs, k_cat = fp8.q(st.il, q_abs), mla.mqa_keys(v_lat, pe)
        o = mla.latent_attention(q_abs, k_cat, v_lat, v_b, allowed, scale=cfg.attn_scale,
                                 p_dtype=kv_dtype or (fp8.weights(st.il) if fp8 else None),
                                 v_b_input=lambda o_lat: engine_input(o_lat, v_b))  # [T, H, Dv]
    o = st.cap("kqv_out", o.reshape(T, H * m.v_dim))
    return st.cap("attn_out", linear(o, st.w(MODEL_TENSOR.ATTN_OUT)))


@register_block("deepseek2", "glm-dsa")
def mla_block(st: Step, x: torch.Tensor) -> torch.Tensor:
    """Pre-norm block: MLA attention, then a dense FFN (leading layers) or MoE + shared expert
    (llama.cpp src/models/deepseek2.cpp and glm-dsa.cpp; transformers DeepseekV3DecoderLayer)."""
    eps = st.cfg.norm_eps
    h = st.cap("attn_norm", rms_norm(x, st.w(MODEL_TENSOR.ATTN_NORM), eps))
    x = st.cap("ffn_inp", x + mla_attention(st, h))
    h = st.cap("ffn_norm", rms_norm(x, st.w(MODEL_TENSOR.FFN_NORM), eps))
    moe = st.cfg.moe
    dense = moe is None or st.il < moe.n_dense_lead
    f = st.cap("ffn_out", dense_ffn(st, h) if dense else moe_ffn(st, h))
    return st.cap("l_out", x + f)


__all__ = ["MoE", "experts", "mla_attention", "mla_block", "moe_ffn", "route"]
