"""gguf/layout.py: every HF<->GGUF transform round-trips, means what the converter means, and the
name maps are immune to gguf-py 0.19's class-level TensorNameMap mutation."""

from __future__ import annotations

import gguf
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fixtures_mla as fx
from llmdoctor.gguf import layout
from llmdoctor.reference import attention as attn


@settings(max_examples=40, deadline=None)
@given(n_head=st.integers(1, 6), half=st.integers(1, 5), cols=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_rope_permute_round_trip(n_head, half, cols, seed):
    w = torch.randn(n_head * 2 * half, cols, generator=torch.Generator().manual_seed(seed))
    p = layout.rope_permute(w, n_head)
    assert torch.equal(layout.rope_unpermute(p, n_head), w)
    assert torch.equal(layout.rope_permute(w[:, 0], n_head), p[:, 0])  # biases permute like rows


@pytest.mark.parametrize("n_head_kv", [1, 2, 4])
def test_rope_permute_turns_rotate_half_into_pairs(n_head_kv):
    """HF's rotate-half rope on k_proj(x) equals adjacent-pair rope on the permuted k_proj's output,
    exactly when the permutation uses K's own head count (GQA)."""
    g = torch.Generator().manual_seed(0)
    d, t, n_embd = 8, 5, 12
    wk = torch.randn(n_head_kv * d, n_embd, generator=g, dtype=torch.float64)
    x = torch.randn(t, n_embd, generator=g, dtype=torch.float64)
    cos, sin = attn.rope_cos_sin(torch.arange(t), d, 10_000.0)
    hf = attn.apply_rope((x @ wk.t()).view(t, n_head_kv, d), cos, sin, neox=True)
    ours = attn.apply_rope((x @ layout.rope_permute(wk, n_head_kv).t()).view(t, n_head_kv, d), cos, sin, neox=False)
    torch.testing.assert_close(ours.reshape(t, -1), layout.rope_permute(hf.reshape(t, -1).t(), n_head_kv).t())
    if n_head_kv > 1:  # the wrong head count gives another tensor
        assert not torch.equal(layout.rope_permute(wk, n_head_kv), layout.rope_permute(wk, 4 * n_head_kv))


def test_norm_offset_round_trip():
    w = torch.randn(7)
    assert torch.equal(layout.norm_offset(w), w + 1)
    assert torch.allclose(layout.norm_unoffset(layout.norm_offset(w)), w)


@settings(max_examples=30, deadline=None)
@given(h=st.integers(1, 4), nope=st.integers(1, 6), v=st.integers(1, 6), r=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_kv_b_split_round_trip(h, nope, v, r, seed):
    kv_b = torch.randn(h * (nope + v), r, generator=torch.Generator().manual_seed(seed))
    k_b, v_b = layout.kv_b_split(kv_b, h, nope, v)
    assert k_b.shape == (h, r, nope) and v_b.shape == (h, v, r)  # GGUF ne (nope, r, h) and (r, v, h)
    assert torch.equal(layout.kv_b_merge(k_b, v_b), kv_b)
    per_head = kv_b.view(h, nope + v, r)
    assert torch.equal(k_b[0], per_head[0, :nope].t())  # k_b is the transposed key half


def test_experts_round_trip():
    ws = [torch.randn(3, 5) for _ in range(4)]
    s = layout.stack_experts(ws)
    assert s.shape == (4, 3, 5)
    assert all(torch.equal(a, b) for a, b in zip(layout.unstack_experts(s), ws))


def _synthetic(names_shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(*s, generator=g) for n, s in names_shapes.items()}


def _round_trip(arch: str, hf: dict[str, torch.Tensor], config: dict) -> layout.Plan:
    p = layout.plan(arch, list(hf), config)
    assert not p.unmapped, p.unmapped
    back = layout.to_hf(p, layout.to_gguf(p, hf))
    assert set(back) == set(hf) - set(p.skipped)
    for r in p.rules:
        for k in r.sources:  # (w + 1) - 1 rounds w + 1 in float32: exact up to half an ulp of 1 + w
            atol = 2.0**-23 * float(hf[k].abs().max() + 1) if r.transform.startswith("norm_offset") else 0.0
            torch.testing.assert_close(back[k], hf[k], rtol=0, atol=atol)
    return p


def test_llama_plan_gqa():
    cfg = dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    pre = "model.layers.0."
    hf = _synthetic({"model.embed_tokens.weight": (10, 16), "lm_head.weight": (10, 16), "model.norm.weight": (16,),
                     pre + "self_attn.q_proj.weight": (16, 16), pre + "self_attn.k_proj.weight": (8, 16),
                     pre + "self_attn.v_proj.weight": (8, 16), pre + "self_attn.o_proj.weight": (16, 16),
                     pre + "input_layernorm.weight": (16,), pre + "post_attention_layernorm.weight": (16,),
                     pre + "mlp.gate_proj.weight": (20, 16), pre + "mlp.up_proj.weight": (20, 16),
                     pre + "mlp.down_proj.weight": (16, 20)})
    p = _round_trip("llama", hf, cfg)
    t = {r.targets[0]: r.transform for r in p.rules}
    assert t["blk.0.attn_q.weight"] == "rope_permute(n_head=4)"
    assert t["blk.0.attn_k.weight"] == "rope_permute(n_head=2)"
    assert t["blk.0.ffn_norm.weight"] == "copy"
    assert "lm_head.weight" in p.skipped


def test_gemma3_plan_norm_offset():
    cfg = dict(num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=True)
    pre = "model.layers.0."
    hf = _synthetic({"model.embed_tokens.weight": (10, 8), "model.norm.weight": (8,),
                     pre + "input_layernorm.weight": (8,), pre + "self_attn.q_norm.weight": (4,),
                     pre + "post_feedforward_layernorm.weight": (8,), pre + "self_attn.q_proj.weight": (4, 8)})
    p = _round_trip("gemma3", hf, cfg)
    t = {r.targets[0]: r.transform for r in p.rules}
    assert t["output_norm.weight"] == t["blk.0.attn_q_norm.weight"] == t["blk.0.post_ffw_norm.weight"] == "norm_offset(+1)"
    assert t["blk.0.attn_q.weight"] == "copy"  # gemma's rope is NEOX: no permutation
    g = layout.to_gguf(p, hf)
    assert torch.equal(g["output_norm.weight"], hf["model.norm.weight"] + 1)


@pytest.mark.parametrize("kind", ["deepseek", "glm"])
def test_mla_checkpoint_round_trip(kind, tmp_path):
    """A save_pretrained checkpoint -> GGUF tensors -> the same checkpoint, bit for bit."""
    f = fx.build(kind, tmp_path)
    arch = "glm-dsa" if kind == "glm" else "deepseek2"
    p = _round_trip(arch, f.checkpoint, f.config)
    by = {r.targets[0]: r for r in p.rules}
    assert by["blk.0.attn_k_b.weight"].transform == "kv_b_split"
    assert by["blk.1.ffn_up_exps.weight"].transform == "stack_experts"
    assert len(by["blk.1.ffn_up_exps.weight"].sources) == fx.COMMON["n_routed_experts"]
    assert "blk.1.exp_probs_b.bias" in by
    runtime = [n for n in f.model.state_dict() if not n.endswith("inv_freq")]
    assert sorted(layout.checkpoint_names(runtime, fx.COMMON["n_routed_experts"])) == sorted(f.checkpoint)
    if kind == "glm":
        assert {"blk.0.indexer.k_norm.weight", "blk.0.indexer.k_norm.bias", "blk.0.indexer.proj.weight",
                "blk.0.indexer.attn_k.weight", "blk.0.indexer.attn_q_b.weight"} <= set(by)


def test_mtp_layers():
    """deepseek2 skips the MTP layer past num_hidden_layers; glm-dsa maps it to an extra block."""
    cfg = dict(num_hidden_layers=1, num_attention_heads=1, num_nextn_predict_layers=1)
    names = ["model.layers.1.eh_proj.weight", "model.layers.1.input_layernorm.weight"]
    p = layout.plan("deepseek2", names, cfg)
    assert set(p.skipped) == set(names) and not p.rules
    p = layout.plan("glm-dsa", names, cfg)
    assert {r.targets[0] for r in p.rules} == {"blk.1.nextn.eh_proj.weight", "blk.1.attn_norm.weight"}


def test_name_map_immune_to_class_level_mutation():
    """gguf 0.19: building an ARCTIC TensorNameMap rewrites the class-level block table, after which a
    LLAMA map built by gguf-py itself maps post_attention_layernorm elsewhere. Ours is unaffected."""
    key = "model.layers.0.post_attention_layernorm"
    saved = dict(gguf.TensorNameMap.block_mappings_cfg)
    try:
        gguf.TensorNameMap(gguf.MODEL_ARCH.ARCTIC, 1)
        polluted = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, 1).get_name(key)
        layout.name_map.cache_clear()
        assert layout.name_map("llama", 1).get_name(key) == "blk.0.ffn_norm"
        print(f"gguf-py's own LLAMA map after an ARCTIC map: {key} -> {polluted}")
    finally:
        gguf.TensorNameMap.block_mappings_cfg.clear()
        gguf.TensorNameMap.block_mappings_cfg.update(saved)
