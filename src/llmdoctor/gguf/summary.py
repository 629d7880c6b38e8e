"""What `llmdoctor inspect` shows: architecture, hyperparameters, tokenizer, tensor statistics.

A split model is summarized as one model (its shards listed under `shards`, sizes summed).
The JSON form (`summarize`) is stable and documented in README.md (schema llmdoctor.inspect/1).
Metadata key names come from gguf-py's `Keys`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
from gguf import Keys

from .reader import GGUFFile, StringArray

# (label, key template) for the hyperparameters shown when present.
_HPARAMS: list[tuple[str, str]] = [
    ("context_length", Keys.LLM.CONTEXT_LENGTH),
    ("embedding_length", Keys.LLM.EMBEDDING_LENGTH),
    ("block_count", Keys.LLM.BLOCK_COUNT),
    ("feed_forward_length", Keys.LLM.FEED_FORWARD_LENGTH),
    ("head_count", Keys.Attention.HEAD_COUNT),
    ("head_count_kv", Keys.Attention.HEAD_COUNT_KV),
    ("key_length", Keys.Attention.KEY_LENGTH),
    ("value_length", Keys.Attention.VALUE_LENGTH),
    ("rms_norm_eps", Keys.Attention.LAYERNORM_RMS_EPS),
    ("layer_norm_eps", Keys.Attention.LAYERNORM_EPS),
    ("sliding_window", Keys.Attention.SLIDING_WINDOW),
    ("attn_logit_softcapping", Keys.LLM.ATTN_LOGIT_SOFTCAPPING),
    ("final_logit_softcapping", Keys.LLM.FINAL_LOGIT_SOFTCAPPING),
    ("rope_dimension_count", Keys.Rope.DIMENSION_COUNT),
    ("rope_freq_base", Keys.Rope.FREQ_BASE),
    ("rope_scaling_type", Keys.Rope.SCALING_TYPE),
    ("rope_scaling_factor", Keys.Rope.SCALING_FACTOR),
    ("rope_scaling_orig_ctx_len", Keys.Rope.SCALING_ORIG_CTX_LEN),
    ("rope_scaling_yarn_log_mul", Keys.Rope.SCALING_YARN_LOG_MUL),
    ("q_lora_rank", Keys.Attention.Q_LORA_RANK),
    ("kv_lora_rank", Keys.Attention.KV_LORA_RANK),
    ("key_length_mla", Keys.Attention.KEY_LENGTH_MLA),
    ("value_length_mla", Keys.Attention.VALUE_LENGTH_MLA),
    ("indexer_head_count", Keys.Attention.Indexer.HEAD_COUNT),
    ("indexer_key_length", Keys.Attention.Indexer.KEY_LENGTH),
    ("indexer_top_k", Keys.Attention.Indexer.TOP_K),
    ("expert_count", Keys.LLM.EXPERT_COUNT),
    ("expert_used_count", Keys.LLM.EXPERT_USED_COUNT),
    ("expert_shared_count", Keys.LLM.EXPERT_SHARED_COUNT),
    ("expert_group_count", Keys.LLM.EXPERT_GROUP_COUNT),
    ("expert_group_used_count", Keys.LLM.EXPERT_GROUP_USED_COUNT),
    ("expert_weights_scale", Keys.LLM.EXPERT_WEIGHTS_SCALE),
    ("expert_weights_norm", Keys.LLM.EXPERT_WEIGHTS_NORM),
    ("expert_gating_func", Keys.LLM.EXPERT_GATING_FUNC),
    ("leading_dense_block_count", Keys.LLM.LEADING_DENSE_BLOCK_COUNT),
    ("vocab_size", Keys.LLM.VOCAB_SIZE),
]


def _plain(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist() if v.size <= 16 else {"array": str(v.dtype), "length": int(v.size)}
    if isinstance(v, StringArray):
        return {"array": "string", "length": len(v)}
    return v


def hyperparameters(g: GGUFFile) -> dict[str, Any]:
    arch = g.architecture or ""
    out: dict[str, Any] = {}
    for label, key in _HPARAMS:
        v = g.get(key.format(arch=arch))
        if v is not None:
            out[label] = _plain(v)
    return out


def tokenizer(g: GGUFFile) -> dict[str, Any]:
    tokens = g.get(Keys.Tokenizer.LIST)
    merges = g.get(Keys.Tokenizer.MERGES)

    def tok_id(key: str) -> int | None:
        return g.get(key)

    def text(i: int | None) -> str | None:
        if i is None or tokens is None or not 0 <= i < len(tokens):
            return None
        return tokens[i]

    bos, eos = tok_id(Keys.Tokenizer.BOS_ID), tok_id(Keys.Tokenizer.EOS_ID)
    return {
        "model": g.get(Keys.Tokenizer.MODEL),
        "pre": g.get(Keys.Tokenizer.PRE),
        "vocab_size": None if tokens is None else len(tokens),
        "merges": None if merges is None else len(merges),
        "bos_token_id": bos,
        "bos_token": text(bos),
        "eos_token_id": eos,
        "eos_token": text(eos),
        "add_bos_token": g.get(Keys.Tokenizer.ADD_BOS),
        "add_eos_token": g.get(Keys.Tokenizer.ADD_EOS),
        "has_chat_template": g.get(Keys.Tokenizer.CHAT_TEMPLATE) is not None,
    }


def tensor_stats(g: GGUFFile) -> dict[str, Any]:
    by_type: Counter[str] = Counter()
    bytes_by_type: Counter[str] = Counter()
    n_params = 0
    for t in g.tensors:
        by_type[t.type.name] += 1
        bytes_by_type[t.type.name] += t.nbytes
        n_params += t.n_elements
    return {
        "count": len(g.tensors),
        "parameters": n_params,
        "bytes": sum(bytes_by_type.values()),
        "by_type": {k: {"count": by_type[k], "bytes": bytes_by_type[k]} for k in sorted(by_type)},
    }


def tensor_table(g: GGUFFile) -> list[dict[str, Any]]:
    return [
        {
            "name": t.name,
            "type": t.type.name,
            "ne": list(t.ne),
            "shape": list(t.shape),
            "file": t.path,
            "offset": t.offset,
            "nbytes": t.nbytes,
            "supported": t.supported,
        }
        for t in g.tensors
    ]


def shards(g: GGUFFile) -> list[dict[str, Any]]:
    """The model's files (one for an unsplit model): path, bytes, tensors."""
    return [{"file": s.path, "bytes": s.file_size, "tensors": len(s.file_tensors)} for s in g.shards]


def summarize(g: GGUFFile, *, tensors: bool = False) -> dict[str, Any]:
    """`file` describes the first (or only) file; `shards` every file, `file.size` their total."""
    out: dict[str, Any] = {
        "file": {
            "path": g.path,
            "size": g.total_size,
            "version": g.version,
            "byte_order": "big" if g.byte_order == ">" else "little",
            "alignment": g.alignment,
            "data_offset": g.data_offset,
            "metadata_keys": len(g.fields),
        },
        "architecture": g.architecture,
        "name": g.get(Keys.General.NAME),
        "file_type": g.get(Keys.General.FILE_TYPE),
        "hyperparameters": hyperparameters(g),
        "tokenizer": tokenizer(g),
        "tensors": tensor_stats(g),
        "shards": shards(g),
    }
    if tensors:
        out["tensor_table"] = tensor_table(g)
    return out
