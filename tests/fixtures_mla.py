"""Tiny random-weight DeepSeek-V3 and GLM-MoE-DSA models, written to GGUF as llama.cpp's converter does.

`build(kind, dir)` makes an HF model with transformers from a config (`from_config`, no download),
saves it with save_pretrained (the on-disk checkpoint: per-expert tensors), and converts that checkpoint
the way convert_hf_to_gguf.py does (conversion/base.py TextModel.set_gguf_parameters,
conversion/deepseek.py DeepseekV2Model, conversion/glm.py GlmMoeDsaModel): the same metadata keys and
values, tensor names and transforms through llmdoctor.gguf.layout (kv_b split with k_b transposed,
stacked experts, indexer tensors), every tensor F32 (`--outtype f32`). No tokenizer is written: the
tests feed token ids.

Weights are random float32 values, so the float64 HF model and the F32 GGUF hold identical numbers.

`float64_mode()` makes transformers' forward really float64: its RMSNorm, router, indexer and rotary
code cast to float32 internally (`.to(torch.float32)`, `.float()`, `dtype=torch.float`); under the mode
every float32 request becomes float64, so both sides of the comparison round only in float64.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch
from torch.overrides import TorchFunctionMode

from llmdoctor.gguf import layout
from llmdoctor.reference.mla import INDEXER_TYPES_KEY

os.environ.setdefault("HF_HUB_OFFLINE", "1")

COMMON = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=12,
    n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, rms_norm_eps=1e-6,
    routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=256,
)
# DeepSeek-V3 with YaRN as the real checkpoints configure it (factor 40, mscale = mscale_all_dim = 1),
# scaled down so that the ramp between beta_fast and beta_slow falls inside the 4 rope frequencies.
DEEPSEEK_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                     beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
# GLM-5: rms_norm_eps is 1e-5 in its config, but transformers' GlmMoeDsaAttention builds its q_a / kv_a
# norms with the default 1e-6 while llama.cpp uses the file's rms eps for them: 1e-6 here keeps both
# sides the same network (the difference is a real one between the two for GLM-5 files).
GLM = dict(index_topk=6, index_head_dim=16, index_n_heads=2, indexer_types=["full", "shared", "full"])


class float64_mode(TorchFunctionMode):
    """Every float32 dtype requested inside the mode becomes float64 (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {k: (torch.float64 if v is torch.float32 else v) for k, v in (kwargs or {}).items()}
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        return func(*args, **kwargs)


def hf_config(kind: str, **over):
    from transformers import DeepseekV3Config, GlmMoeDsaConfig

    if kind == "deepseek":
        return DeepseekV3Config(**{**COMMON, "rope_parameters": DEEPSEEK_YARN, **over})
    if kind == "glm":
        return GlmMoeDsaConfig(**{**COMMON, **GLM, **over})
    if kind == "deepseek_v2":  # softmax router, greedy top-k, no normalization (DeepseekV2TopkRouter)
        from transformers import DeepseekV2Config

        v2 = {**COMMON, "n_group": None, "topk_group": None, "norm_topk_prob": False, "topk_method": "greedy"}
        return DeepseekV2Config(**{**v2, **over})
    raise ValueError(kind)


def _randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Unit-scale random float32 weights (norm weights near 1, biases small) so every path matters."""
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1 and name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


@dataclass
class Fixture:
    model: torch.nn.Module  # float64, eval, eager attention
    config: dict  # config.json as the converter read it
    gguf_path: Path
    checkpoint: dict[str, torch.Tensor]  # the saved HF tensors (float32)


def build(kind: str, out_dir: Path, *, seed: int = 0, legacy: bool = False, **over) -> Fixture:
    """`legacy`: write the file as converters before the MLA split did (attn_kv_b whole, MHA sizes)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = hf_config(kind, **over)
    with float64_mode():  # rotary inv_freq is computed here, in float64
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    _randomize(model, torch.Generator().manual_seed(seed))
    ckpt_dir = out_dir / f"hf-{kind}"
    model.save_pretrained(ckpt_dir)
    config = json.loads((ckpt_dir / "config.json").read_text())
    if kind == "deepseek_v2":
        config["scoring_func"] = "softmax"  # as DeepSeek-V2's own config.json says
    if kind == "deepseek":
        # transformers' DeepseekV3Config has no scoring_func (its router is always sigmoid); the real
        # DeepSeek-V3 config.json has "scoring_func": "sigmoid", which the converter turns into
        # expert_gating_func. Without it llama.cpp falls back to softmax (DeepSeek-V2's).
        config["scoring_func"] = "sigmoid"
    checkpoint = load_file(ckpt_dir / "model.safetensors")
    path = out_dir / f"{kind}.gguf"
    write_gguf(path, config, checkpoint, legacy=legacy)
    return Fixture(model.to(torch.float64).eval(), config, path, checkpoint)


def gguf_metadata(arch: str, c: dict) -> dict[str, tuple[object, gguf.GGUFValueType]]:
    """{key: (value, type)} as convert_hf_to_gguf.py writes them for a deepseek2 / glm-dsa model."""
    K, V = gguf.Keys, gguf.GGUFValueType
    k = lambda t: t.format(arch=arch)  # noqa: E731
    u32, f32 = V.UINT32, V.FLOAT32
    rope = c.get("rope_parameters") or {}
    meta: dict[str, tuple[object, gguf.GGUFValueType]] = {
        K.General.ARCHITECTURE: (arch, V.STRING),
        K.General.FILE_TYPE: (int(gguf.LlamaFileType.ALL_F32), u32),
        k(K.LLM.BLOCK_COUNT): (c["num_hidden_layers"], u32),
        k(K.LLM.CONTEXT_LENGTH): (c["max_position_embeddings"], u32),
        k(K.LLM.EMBEDDING_LENGTH): (c["hidden_size"], u32),
        k(K.LLM.FEED_FORWARD_LENGTH): (c["intermediate_size"], u32),
        k(K.Attention.HEAD_COUNT): (c["num_attention_heads"], u32),
        k(K.Attention.HEAD_COUNT_KV): (1, u32),  # MLA converts into MQA
        k(K.Rope.FREQ_BASE): (rope["rope_theta"], f32),
        k(K.Attention.LAYERNORM_RMS_EPS): (c["rms_norm_eps"], f32),
        k(K.LLM.EXPERT_USED_COUNT): (c["num_experts_per_tok"], u32),
        k(K.LLM.LEADING_DENSE_BLOCK_COUNT): (c["first_k_dense_replace"], u32),
        k(K.LLM.VOCAB_SIZE): (c["vocab_size"], u32),
        k(K.Attention.KV_LORA_RANK): (c["kv_lora_rank"], u32),
        k(K.Attention.KEY_LENGTH): (c["kv_lora_rank"] + c["qk_rope_head_dim"], u32),
        k(K.Attention.VALUE_LENGTH): (c["kv_lora_rank"], u32),
        k(K.Attention.KEY_LENGTH_MLA): (c["qk_nope_head_dim"] + c["qk_rope_head_dim"], u32),
        k(K.Attention.VALUE_LENGTH_MLA): (c["v_head_dim"], u32),
        k(K.LLM.EXPERT_FEED_FORWARD_LENGTH): (c["moe_intermediate_size"], u32),
        k(K.LLM.EXPERT_COUNT): (c["n_routed_experts"], u32),
        k(K.LLM.EXPERT_SHARED_COUNT): (c.get("n_shared_experts", 0), u32),
        k(K.LLM.EXPERT_WEIGHTS_SCALE): (c["routed_scaling_factor"], f32),
        k(K.Rope.DIMENSION_COUNT): (c["qk_rope_head_dim"], u32),
    }
    if c.get("n_group") is not None:
        meta[k(K.LLM.EXPERT_GROUP_COUNT)] = (c["n_group"], u32)
    if c.get("topk_group") is not None:
        meta[k(K.LLM.EXPERT_GROUP_USED_COUNT)] = (c["topk_group"], u32)
    if c.get("q_lora_rank") is not None:
        meta[k(K.Attention.Q_LORA_RANK)] = (c["q_lora_rank"], u32)
    if c.get("norm_topk_prob"):
        meta[k(K.LLM.EXPERT_WEIGHTS_NORM)] = (True, V.BOOL)
    if (sf := c.get("scoring_func")) is not None:
        meta[k(K.LLM.EXPERT_GATING_FUNC)] = (int(getattr(gguf.ExpertGatingFuncType, sf.upper())), u32)
    if rope.get("rope_type") == "yarn":
        meta[k(K.Rope.SCALING_TYPE)] = ("yarn", V.STRING)
        meta[k(K.Rope.SCALING_FACTOR)] = (rope["factor"], f32)
        meta[k(K.Rope.SCALING_ORIG_CTX_LEN)] = (rope["original_max_position_embeddings"], u32)
        for key, hf in ((K.Rope.SCALING_YARN_BETA_FAST, "beta_fast"), (K.Rope.SCALING_YARN_BETA_SLOW, "beta_slow"),
                        (K.Rope.SCALING_YARN_ATTN_FACTOR, "attention_factor")):
            if rope.get(hf) is not None:
                meta[k(key)] = (rope[hf], f32)
        if rope.get("mscale_all_dim") is not None:  # [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]: stored x 0.1
            meta[k(K.Rope.SCALING_YARN_LOG_MUL)] = (0.1 * rope["mscale_all_dim"], f32)
    if arch == "glm-dsa":
        meta[k(K.Attention.Indexer.HEAD_COUNT)] = (c["index_n_heads"], u32)
        meta[k(K.Attention.Indexer.KEY_LENGTH)] = (c["index_head_dim"], u32)
        meta[k(K.Attention.Indexer.TOP_K)] = (c["index_topk"], u32)
        if c.get("indexer_types") is not None:
            meta[INDEXER_TYPES_KEY.format(arch=arch)] = ([t == "full" for t in c["indexer_types"]], V.ARRAY)
    return meta


def legacy_metadata(arch: str, c: dict, meta: dict) -> dict:
    """Metadata of a deepseek2 file converted before the MLA split: MHA head count and sizes."""
    K, u32 = gguf.Keys.Attention, gguf.GGUFValueType.UINT32
    meta = {k: v for k, v in meta.items() if k not in (K.KEY_LENGTH_MLA.format(arch=arch), K.VALUE_LENGTH_MLA.format(arch=arch))}
    meta[K.HEAD_COUNT_KV.format(arch=arch)] = (c["num_attention_heads"], u32)
    meta[K.KEY_LENGTH.format(arch=arch)] = (c["qk_nope_head_dim"] + c["qk_rope_head_dim"], u32)
    meta[K.VALUE_LENGTH.format(arch=arch)] = (c["v_head_dim"], u32)
    return meta


def write_gguf(path: Path, config: dict, checkpoint: dict[str, torch.Tensor], *, legacy: bool = False) -> None:
    arch = "glm-dsa" if config["model_type"] == "glm_moe_dsa" else "deepseek2"
    plan = layout.plan(arch, list(checkpoint), config, split_kv_b=not legacy)
    assert not plan.unmapped, plan.unmapped
    meta = gguf_metadata(arch, config)
    if legacy:
        meta = legacy_metadata(arch, config, meta)
    w = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype) in meta.items():
        if key == gguf.Keys.General.ARCHITECTURE:
            continue  # the writer adds it
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    # no tokenizer is written (the tests feed token ids); "none" lets llama.cpp load the file anyway
    w.add_string(gguf.Keys.Tokenizer.MODEL, "none")
    for name, t in layout.to_gguf(plan, checkpoint).items():
        w.add_tensor(name, t.to(torch.float32).contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
