"""A ModelConfig read from a GGUF written back as an HF config.json (transformers 5 field names): the
inverse of reference/config.py's HF parsers, `from_hf(hf_config(cfg, g)).diff(cfg) == {}`. Used by
`check mapping` (the HF side when no checkpoint is given) and by the transformers engine (the model
it builds for a GGUF)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import InputError
from .config import ModelConfig


def nextn_layers(g: Any, arch: str) -> int:
    """NextN/MTP blocks the GGUF counts in its block_count (llama.cpp's converters for GLM-4.5/GLM-5
    write num_hidden_layers + num_nextn_predict_layers blocks and `{arch}.nextn_predict_layers`)."""
    return int(g.get(f"{arch}.nextn_predict_layers") or 0)


def main_layers(cfg: ModelConfig, nextn: int) -> ModelConfig:
    """`cfg` without its trailing `nextn` MTP blocks: the layer count and per-layer tuples as config.json
    counts them (num_hidden_layers, layer_types, indexer_types)."""
    if not nextn:
        return cfg
    n = cfg.n_layer - nextn
    out = dataclasses.replace(cfg, n_layer=n, swa_layers=cfg.swa_layers[:n])
    ix = cfg.mla.indexer if cfg.mla is not None else None
    if ix is not None:
        out.mla = dataclasses.replace(cfg.mla, indexer=dataclasses.replace(ix, full=ix.full[:n]))
    return out


def hf_config(cfg: ModelConfig, g: Any) -> dict:
    """A config.json (transformers 5 field names) describing the same network as the GGUF's metadata:
    the inverse of reference/config.py's HF parsers (from_hf(hf_config(c)).diff(c) == {})."""
    ids = {k: g.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
    nextn = nextn_layers(g, cfg.arch)
    cfg = main_layers(cfg, nextn)
    d: dict[str, Any] = dict(
        vocab_size=cfg.n_vocab, hidden_size=cfg.n_embd, intermediate_size=cfg.n_ff,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head_kv,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tied_output,
        max_position_embeddings=int(g.get(f"{cfg.arch}.context_length") or 4096),
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["padding"],
    )
    if nextn:
        d["num_nextn_predict_layers"] = nextn
    rope = {"rope_type": "default", "rope_theta": cfg.rope_base}
    if cfg.rope_scale != 1.0:
        rope = {"rope_type": "linear", "rope_theta": cfg.rope_base, "factor": 1.0 / cfg.rope_scale}
    if cfg.arch in ("llama", "qwen2", "qwen3"):
        d.update(model_type=cfg.arch, head_dim=cfg.head_dim, rope_parameters=rope,
                 attention_bias=cfg.qkv_bias and cfg.arch == "llama")
    elif cfg.arch == "gemma3":
        local = {"rope_type": "default", "rope_theta": cfg.rope_base_swa or cfg.rope_base}
        d.update(model_type="gemma3_text", head_dim=cfg.head_dim, sliding_window=cfg.sliding_window,
                 layer_types=["sliding_attention" if s else "full_attention" for s in cfg.swa_layers],
                 rope_parameters={"full_attention": rope, "sliding_attention": local},
                 query_pre_attn_scalar=_int_if_whole(cfg.attn_scale ** -2),
                 attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.final_softcap)
    elif cfg.mla is not None:
        d.update(_mla_config(cfg))
    else:
        raise InputError(f"no HF config for architecture {cfg.arch!r}")
    return d


def _int_if_whole(x: float) -> int | float:
    return int(round(x)) if abs(x - round(x)) < 1e-6 * max(1.0, abs(x)) else x


def _mla_config(cfg: ModelConfig) -> dict:
    m, moe = cfg.mla, cfg.moe
    d: dict[str, Any] = dict(kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank or None,
                             qk_rope_head_dim=m.qk_rope, qk_nope_head_dim=m.qk_nope, v_head_dim=m.v_dim)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_base}
    if m.yarn is not None:
        y = m.yarn
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_base, "factor": y.factor,
                "original_max_position_embeddings": y.orig_ctx, "beta_fast": y.beta_fast, "beta_slow": y.beta_slow,
                "mscale": y.mscale_all_dim, "mscale_all_dim": y.mscale_all_dim,
                "attention_factor": y.attn_factor}
    d["rope_parameters"] = rope
    if moe is not None:
        d.update(n_routed_experts=moe.n_expert, num_experts_per_tok=moe.n_used, n_shared_experts=moe.n_shared,
                 moe_intermediate_size=moe.n_ff_exp, scoring_func=moe.gating, norm_topk_prob=moe.norm_topk,
                 routed_scaling_factor=moe.scale, n_group=moe.n_group, topk_group=moe.topk_group,
                 first_k_dense_replace=moe.n_dense_lead)
    if cfg.arch == "glm-dsa":
        ix = m.indexer
        d.update(model_type="glm_moe_dsa", index_n_heads=ix.n_head, index_head_dim=ix.head_dim,
                 index_topk=ix.top_k, indexer_types=["full" if f else "shared" for f in ix.full])
    else:
        d["model_type"] = "deepseek_v2" if moe is not None and moe.gating == "softmax" else "deepseek_v3"
    return d
