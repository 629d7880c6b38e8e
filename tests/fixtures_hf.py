"""Tiny random HF checkpoints (transformers `from_config` + `save_pretrained`, float32 safetensors, no
download) and the F32 GGUF convert_hf_to_gguf.py would write from each (gguf/layout.py's forward
transforms): llama, qwen2, qwen3, gemma3, DeepSeek-V3 with real MLA dims, GLM-MoE-DSA.

`checkpoint(kind, dir)` -> (checkpoint directory, its GGUF). No tokenizer is saved: tests give token ids
(`with_tokenizer` adds a word-level one).

DeepSeek-V3 keeps DeepSeek's real MLA dimensions (kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128): an
MLA engine (vLLM's MLA backends: head size kv_lora_rank + qk_rope = 576) only runs real latent sizes.
Everything else stays tiny, so every kind builds in about a second.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import fixtures_mla
from llmdoctor.gguf import layout
from test_reference_dense import GEMMA3_TINY, write_gguf

DENSE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
             rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
# kind -> (transformers model_type, GGUF arch, config overrides)
DENSE_KINDS = {
    "llama": ("llama", "llama", {"tie_word_embeddings": False}),
    "qwen2": ("qwen2", "qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", "qwen3", {"tie_word_embeddings": True, "head_dim": 32}),
    "gemma3": ("gemma3_text", "gemma3", GEMMA3_TINY),
}
REAL_MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
KINDS = (*DENSE_KINDS, "deepseek", "glm")


def _dense(kind: str, out: Path) -> tuple[Path, Path]:
    import transformers

    model_type, arch, extra = DENSE_KINDS[kind]
    config = transformers.AutoConfig.for_model(model_type, **{**DENSE, **extra})
    torch.manual_seed(sum(map(ord, kind)))
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # weights large enough for peaked distributions (as test_reference_dense's)
        for n, p in model.named_parameters():
            norm = n.endswith("norm.weight")
            # gemma's RMSNorm multiplies by (1 + w): w near 0 there, near 1 elsewhere
            p.copy_((0.0 if model_type.startswith("gemma") else 1.0) + 0.2 * torch.randn_like(p) if norm
                    else 0.3 * torch.randn_like(p))
    ckpt = out / f"hf-{kind}"
    model.save_pretrained(ckpt)
    d = json.loads((ckpt / "config.json").read_text())
    from safetensors.torch import load_file

    sd = load_file(ckpt / "model.safetensors")
    plan = layout.plan(arch, list(sd), d)
    assert not plan.unmapped, plan.unmapped
    path = out / f"{kind}.gguf"
    write_gguf(path, arch, d, layout.to_gguf(plan, sd))
    return ckpt, path


def checkpoint(kind: str, out: Path) -> tuple[Path, Path]:
    """(checkpoint directory, the F32 GGUF converted from it) of a tiny random model of `kind`."""
    out.mkdir(parents=True, exist_ok=True)
    if kind in DENSE_KINDS:
        return _dense(kind, out)
    fx = fixtures_mla.build(kind, out, **(REAL_MLA if kind == "deepseek" else {}))
    return out / f"hf-{kind}", fx.gguf_path


def with_tokenizer(ckpt: Path, words: list[str]) -> None:
    """Save a word-level tokenizer (tokenizer.json + tokenizer_config.json) into `ckpt`: token i is
    words[i], split on whitespace; "<s>" (id 0) is prepended as BOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=words[1]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single=f"{words[0]} $A", special_tokens=[(words[0], 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=words[0], unk_token=words[1]).save_pretrained(ckpt)
