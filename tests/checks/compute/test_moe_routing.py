"""MoE routing agreement on a real engine: llama.cpp runs a tiny DeepSeek-V3 GGUF (random weights,
written like convert_hf_to_gguf.py); its experts match the reference's, and a file whose
gating function is changed is caught in the first MoE layer."""

from __future__ import annotations

import shutil
import struct

import numpy as np
import pytest

import fixtures_mla
from llmdoctor import diagnose as dg
from llmdoctor.checks.compute.routing import routing_inadmissible, routing_tolerance
from llmdoctor.gguf import open_gguf

IDS = [int(i) for i in np.random.default_rng(0).integers(1, 90, size=40)]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return fixtures_mla.build("deepseek", tmp_path_factory.mktemp("moe")).gguf_path


def _routing(findings):
    return next(f for f in findings if f.check == "moe-routing")


def engine_copy(src, dst, names, scale: float):
    """A copy of the F32 GGUF `src` at `dst` with the tensors `names` (exact names, or a predicate on
    the name) multiplied by `scale`: the engine's corrupted copy of the file."""
    shutil.copyfile(src, dst)
    pick = names if callable(names) else (lambda n: n in names)
    with open_gguf(dst) as g:
        spans = [(t.offset, t.nbytes // 4) for t in g.tensors if pick(t.name)]
        assert spans and all(t.type.name == "F32" for t in g.tensors if pick(t.name))
    for start, n in spans:
        values = np.memmap(dst, dtype=np.float32, mode="r+", offset=start, shape=(n,))
        values *= scale
        values.flush()
        del values
    return dst


def test_routing_admissibility_allows_near_ties_only():
    """The near-tie a healthy vLLM in bfloat16 flipped (tiny DeepSeek-V3, layer 2, position 3: two expert
    groups whose scores, sums of their two best experts, are 0.0009 apart): the other group's experts are
    admissible within the emulated run's score error, not without it; a choice below a clear winner is not."""
    sc = np.array([[0.50, 0.610955, 0.662887, 0.40, 0.628752, 0.644139, 0.30, 0.20]])
    engine = np.array([[5, 4]])
    assert routing_inadmissible(sc, engine, 2, tol=0.0, n_group=2, topk_group=1).tolist() == [True]
    assert routing_inadmissible(sc, engine, 2, tol=0.002, n_group=2, topk_group=1).tolist() == [False]
    assert routing_inadmissible(sc, np.array([[2, 1]]), 2, tol=0.0, n_group=2, topk_group=1).tolist() == [False]
    assert routing_inadmissible(sc, np.array([[2, 5]]), 2, tol=0.002, n_group=2, topk_group=1).tolist() == [True]  # two groups
    assert routing_inadmissible(sc, np.array([[2, 0]]), 2, tol=0.002, n_group=2, topk_group=1).tolist() == [True]  # 0.50 < 0.61
    # ungrouped: ties either way, duplicates and out-of-range ids never
    flat = np.array([[0.9, 0.5, 0.5, 0.1]])
    assert routing_inadmissible(np.repeat(flat, 4, 0), np.array([[0, 1], [2, 0], [0, 3], [0, 0]]), 2, tol=1e-9).tolist() \
        == [False, False, True, True]
    # the tolerance: z x sqrt(2) x the emulated run's RMS score error (plus a few float32 roundings), z the normal
    # quantile at the level over the layer's comparisons (2 x 6 experts + 1 x 1 group here): the flipped near-tie
    # is within it
    (tol,) = routing_tolerance(sc, sc + 1e-3, 2, 1e-3, n_group=2, topk_group=1)
    z = 3.78478  # P(N(0, 1) > z) = 1e-3 / 13
    assert tol == pytest.approx(z * (2**0.5 * 1e-3 + 8 * 2.0**-24 * 0.662887), rel=1e-4)
    assert routing_inadmissible(sc, engine, 2, tol=np.array([tol]), n_group=2, topk_group=1).tolist() == [False]
    # the level holds: 4,000 healthy layers (8 positions x 16 experts, the engine's and the emulated run's errors
    # independent draws of one Gaussian) choose an expert the tolerance does not allow in fewer than 1 in 100
    rng = np.random.default_rng(0)
    alarms = 0
    for _ in range(4000):
        ref = rng.standard_normal((8, 16)) * 0.05
        emu, eng = (ref + 0.01 * rng.standard_normal(ref.shape) for _ in range(2))
        tol = routing_tolerance(ref, emu, 4, 0.01)
        alarms += bool(routing_inadmissible(ref, np.argsort(-eng, axis=1)[:, :4], 4, tol).any())
    assert alarms < 40, alarms


@pytest.mark.slow
def test_llama_cpp_routes_like_the_reference(deepseek):
    res = dg.run(dg.Inputs(gguf=deepseek, engine="llama.cpp", token_ids=IDS, threads=2))
    f = _routing(res.findings)
    assert f.status == "pass", f
    assert f.metrics["layers"] >= 1 and f.metrics["max_disagreement"] == 0.0 and f.metrics["near_ties_taken"] == 0
    # A healthy MLA engine is healthy layer by layer too: the budget's emulated rerun rounds the MLA
    # KV cache ([latent, k_pe]), the absorbed query and P to f16 as llama.cpp does (without that, this
    # file failed at kqv_out-0 with error 3.5e-4 against a noise of 0).
    by = {g.check: g for g in res.findings}
    assert by["engine-vs-reference"].status == "pass", by["engine-vs-reference"]
    assert by["layer-localization"].status == "pass", by["layer-localization"]
    assert 0 < by["layer-localization"].metrics["worst_ratio"] < 1


@pytest.mark.slow
def test_a_legacy_unsplit_kv_b_file_is_healthy_in_llama_cpp(tmp_path):
    """A file from before the MLA split (one attn_kv_b): llama.cpp runs it as MHA with K and V
    expanded per head, and the emulated rerun does the same."""
    legacy = fixtures_mla.build("deepseek", tmp_path, legacy=True).gguf_path
    res = dg.run(dg.Inputs(gguf=legacy, engine="llama.cpp", token_ids=IDS, threads=2))
    by = {g.check: g for g in res.findings}
    assert by["engine-vs-reference"].status == "pass", by["engine-vs-reference"]
    assert by["layer-localization"].status == "pass", by["layer-localization"]
    assert 0 < by["layer-localization"].metrics["worst_ratio"] < 1


# Dims that are multiples of 32, so that llama.cpp's quantizer gives attn_k_b / attn_v_b (or attn_kv_b)
# a quantized type instead of its F16 fallback.
QUANTIZABLE = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, kv_lora_rank=32,
                   q_lora_rank=32, qk_nope_head_dim=32, v_head_dim=32, qk_rope_head_dim=32)


@pytest.mark.slow
@pytest.mark.parametrize("legacy", [False, True], ids=["split", "legacy"])
@pytest.mark.parametrize("ftype,qtype", [(7, "Q8_0"), (2, "Q4_0")])
def test_a_quantized_mla_file_is_healthy_in_llama_cpp(tmp_path, legacy, ftype, qtype):
    """Quantized by llama.cpp itself (its quantize API): the k_b / v_b products then quantize their
    activations in the engine, and the emulated rerun must do the same for a healthy verdict."""
    import ctypes

    import llama_cpp

    src = fixtures_mla.build("deepseek", tmp_path, legacy=legacy, **QUANTIZABLE).gguf_path
    out = tmp_path / f"{qtype}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) == 0
    with open_gguf(out) as g:
        kv_b = {t.name: t.type.name for t in g.tensors if t.name.startswith("blk.1.attn_") and "_b." in t.name}
    assert set(kv_b.values()) <= {"Q8_0", "Q4_0"} and kv_b, kv_b  # quantized, not the F16 fallback
    res = dg.run(dg.Inputs(gguf=out, engine="llama.cpp", token_ids=IDS, threads=2))
    by = {g.check: g for g in res.findings}
    assert by["engine-vs-reference"].status == "pass", by["engine-vs-reference"]
    assert by["layer-localization"].status == "pass", by["layer-localization"]
    assert res.exit_code == 0


@pytest.mark.slow
def test_an_engine_that_aborts_does_not_end_the_diagnosis(tmp_path):
    """llama.cpp runs in a child process: the tiny GLM-DSA file makes llama-cpp-python 0.3.36 abort
    (GGML_ASSERT in a mul_mat); the diagnosis goes on and says so. Should a later llama.cpp run it,
    it must then be healthy."""
    glm = fixtures_mla.build("glm", tmp_path).gguf_path
    res = dg.run(dg.Inputs(gguf=glm, engine="llama.cpp", token_ids=IDS, threads=2))
    f = next(g for g in res.findings if g.check == "engine-vs-reference")
    if f.status == "skip":
        assert "llama.cpp crashed" in f.reason and "SIGABRT" in f.reason, f.reason
        assert res.exit_code == 2 and "engine-vs-reference could not run" in res.verdict
    else:
        assert f.status == "pass", f


def test_an_engine_that_cannot_load_the_model_is_a_skip(deepseek, monkeypatch):
    """An engine that cannot load the model: the hypotheses that need it say why (once: the failure is
    remembered), the rest of the plan still runs, and the diagnosis ends with exit 2 naming it."""
    from llmdoctor.subjects.engines import transformers as hf_engine
    from llmdoctor.subjects.engines.llama_cpp import EngineError

    calls = []

    def cannot(*args, **kwargs):
        calls.append(1)
        raise EngineError("no GGUF source for HF parameters ['model.layers.0.mlp.router.weight']")

    monkeypatch.setattr(hf_engine, "run", cannot)
    res = dg.run(dg.Inputs(gguf=deepseek, engine="transformers", token_ids=IDS, threads=2))
    skipped = {f.check: f.reason for f in res.findings if f.status == "skip"}
    for check in ("engine-vs-reference", "layer-localization"):
        assert "the engine could not run the model: no GGUF source" in skipped[check], skipped
    assert len(calls) == 1
    assert any(f.check == "file-integrity" and f.status == "pass" for f in res.findings)
    assert res.exit_code == 2 and "engine-vs-reference could not run" in res.verdict


@pytest.mark.slow
@pytest.mark.parametrize("kind,legacy", [("deepseek", False), ("deepseek", True), ("glm", False)])
def test_dense_mla_models_in_transformers_are_healthy(tmp_path, kind, legacy):
    """MLA without MoE (every layer dense) through the transformers engine: its own DeepseekV3 /
    GlmMoeDsa code on the GGUF's weights (config written back from the GGUF's metadata; a legacy
    unsplit attn_kv_b merged back) agrees with the reference to float32 rounding."""
    gguf = fixtures_mla.build(kind, tmp_path, legacy=legacy, first_k_dense_replace=3).gguf_path
    res = dg.run(dg.Inputs(gguf=gguf, engine="transformers", token_ids=IDS, threads=2))
    by = {g.check: g for g in res.findings}
    assert by["engine-vs-reference"].status == "pass" and by["engine-vs-reference"].metrics["kl_max"] < 1e-9
    assert by["layer-localization"].status == "pass", by["layer-localization"]
    assert res.exit_code == 0, res.verdict
    if kind == "glm":  # transformers' indexer picks are captured (keys tied at the k-th score: its choice)
        assert by["dsa-selection"].status == "pass", by["dsa-selection"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["deepseek", "glm"])
def test_moe_mla_models_in_transformers_are_healthy_and_a_bad_expert_is_found(tmp_path, kind):
    """MLA + MoE through the transformers engine (its fused expert parameters filled from the GGUF's
    stacked experts, its routers' choices captured): healthy at float32 rounding with the same experts
    chosen; an engine copy whose layer-1 router is negated is caught by routing at layer 1, one whose
    layer-1 experts are scaled by layer localization at layer 1."""
    gguf = fixtures_mla.build(kind, tmp_path).gguf_path
    res = dg.run(dg.Inputs(gguf=gguf, engine="transformers", token_ids=IDS, threads=2))
    by = {g.check: g for g in res.findings}
    assert by["engine-vs-reference"].status == "pass" and by["engine-vs-reference"].metrics["kl_max"] < 1e-9
    assert by["layer-localization"].status == "pass" and res.exit_code == 0, res.verdict
    assert by["moe-routing"].status == "pass" and by["moe-routing"].metrics["max_disagreement"] == 0.0

    # the engine's layer-1 router scores every expert backwards
    negated = engine_copy(gguf, tmp_path / "bad-router.gguf", {"blk.1.ffn_gate_inp.weight"}, -1.0)
    res = dg.run(dg.Inputs(gguf=gguf, engine="transformers", engine_gguf=negated, token_ids=IDS, threads=2))
    routing = next(g for g in res.findings if g.check == "moe-routing")
    assert routing.status == "fail" and routing.metrics["first_layer"] == 1, routing

    bad = engine_copy(gguf, tmp_path / "bad-experts.gguf", {"blk.1.ffn_down_exps.weight"}, 3.0)
    res = dg.run(dg.Inputs(gguf=gguf, engine="transformers", engine_gguf=bad, token_ids=IDS, threads=2))
    loc = next(g for g in res.findings if g.check == "layer-localization")
    assert loc.status == "fail" and loc.metrics["first_divergent_layer"] == 1, loc
    assert res.exit_code == 1


# Indexer and attention dims llama.cpp's glm-dsa graph runs (the default tiny ones make it abort).
GLM_RUNNABLE = dict(index_head_dim=64, qk_rope_head_dim=32, hidden_size=64, kv_lora_rank=32, q_lora_rank=32,
                    qk_nope_head_dim=32, v_head_dim=32, intermediate_size=64, moe_intermediate_size=32)


@pytest.mark.slow
def test_glm_dsa_in_llama_cpp_is_healthy_and_a_wrong_indexer_is_named(tmp_path):
    """GLM-DSA in llama.cpp: its key selections are among the reference's top k up to ties (ReLU index
    scores are often exactly 0, and which tied key it takes is the engine's choice: the reference runs
    with the engine's selections so that a legitimate tie-break is not a divergence), so it is healthy;
    an engine copy whose layer-0 indexer key projection is negated fails the selection check at layer 0
    (and the file diff names the tensor)."""
    gguf = fixtures_mla.build("glm", tmp_path, **GLM_RUNNABLE).gguf_path
    res = dg.run(dg.Inputs(gguf=gguf, engine="llama.cpp", token_ids=IDS, threads=2))
    by = {g.check: g for g in res.findings}
    assert by["dsa-selection"].status == "pass" and by["dsa-selection"].metrics["layers"] == 3, by["dsa-selection"]
    assert by["engine-vs-reference"].status == "pass" and by["layer-localization"].status == "pass"
    assert res.exit_code == 0, res.verdict

    bad = engine_copy(gguf, tmp_path / "bad-indexer.gguf", {"blk.0.indexer.attn_k.weight"}, -1.0)
    res = dg.run(dg.Inputs(gguf=gguf, engine="llama.cpp", engine_gguf=bad, token_ids=IDS, threads=2))
    sel = next(g for g in res.findings if g.check == "dsa-selection")
    assert sel.status == "fail" and sel.metrics["first_layer"] == 0, sel
    assert "sparse-attention indexer selects other keys from layer 0" in sel.explanation
    assert res.exit_code == 1 and "blk.0.indexer.attn_k.weight" in res.verdict  # the engine-file diff names it first


@pytest.mark.slow
def test_a_quantized_glm_dsa_file_is_healthy_in_llama_cpp(tmp_path):
    """GLM-DSA quantized by llama.cpp (Q8_0; its indexer weights too): llama.cpp consumes the quantized
    indexer (so check mapping does not fail it for this engine), and near-ties its quantized index
    projections flip are within what the emulated run flips."""
    import ctypes

    import llama_cpp

    src = fixtures_mla.build("glm", tmp_path, **GLM_RUNNABLE).gguf_path
    out = tmp_path / "glm-q8.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = 7
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) == 0
    with open_gguf(out) as g:
        assert g.tensor("blk.0.indexer.attn_k.weight").type.name == "Q8_0"
    res = dg.run(dg.Inputs(gguf=out, engine="llama.cpp", token_ids=IDS, threads=2))
    by = {g.check: g for g in res.findings if g.status != "skip"}
    assert by["dsa-selection"].status == "pass", by["dsa-selection"]
    assert res.exit_code == 0, res.verdict


@pytest.mark.slow
def test_a_missing_correction_bias_is_named_at_routing(deepseek, tmp_path):
    """An engine copy without the score-correction bias (exp_probs_b zeroed): routing flips at the first
    MoE layer diverge its FFN output with the same router inputs, so routing is named there, even
    when the flips there are few and later layers' routing only differs downstream of them."""
    bad = engine_copy(deepseek, tmp_path / "no-bias.gguf", lambda n: n.endswith("exp_probs_b.bias"), 0.0)
    res = dg.run(dg.Inputs(gguf=deepseek, engine="llama.cpp", engine_gguf=bad, token_ids=IDS, threads=2))
    routing = next(g for g in res.findings if g.check == "moe-routing")
    assert routing.status == "fail" and routing.metrics["first_layer"] == 1, routing


@pytest.mark.slow
def test_routing_differences_downstream_of_an_attention_fault_are_not_blamed_on_routing(deepseek, monkeypatch):
    """transformers with layer 1's attention output scaled by 1.5 (a hook on its self_attn): the router
    of layer 1 reads a different input (ffn_norm-1, captured from the router hook), so its different
    choices are not reported as a routing fault; the divergence is, at layer 1."""
    from llmdoctor.subjects.engines import transformers as hf_engine

    build = hf_engine.build

    def faulty_build(*args, **kwargs):
        model, cfg = build(*args, **kwargs)
        model.model.layers[1].self_attn.register_forward_hook(lambda m, i, o: (o[0] * 1.5, *o[1:]))
        return model, cfg

    monkeypatch.setattr(hf_engine, "build", faulty_build)
    res = dg.run(dg.Inputs(gguf=deepseek, engine="transformers", token_ids=IDS, threads=2))
    by = {g.check: g for g in res.findings}
    assert by["moe-routing"].status == "skip" and "router's inputs already differ at layer 1" in by["moe-routing"].reason
    assert by["layer-localization"].status == "fail" and by["layer-localization"].metrics["first_divergent_layer"] == 1
    assert "MoE routing" not in res.verdict


@pytest.mark.parametrize("child,says", [("aborting", "llama.cpp crashed"), ("hanging", "did not finish")])
def test_run_isolated_turns_a_dead_child_into_an_engine_error(monkeypatch, child, says):
    from llmdoctor.subjects.engines import llama_cpp

    monkeypatch.setattr(llama_cpp, "_SERVE", f"engine_children:{child}")
    with pytest.raises(llama_cpp.EngineError, match=says):
        llama_cpp.run_isolated("model.gguf", [1, 2, 3], timeout=2)


@pytest.mark.slow
def test_softmax_gating_instead_of_sigmoid_is_caught(deepseek, tmp_path):
    """The engine's copy says softmax gating (what llama.cpp falls back to when a DeepSeek-V3
    file lacks expert_gating_func): the correction bias then outweighs the scores."""
    bad = tmp_path / "softmax.gguf"
    shutil.copyfile(deepseek, bad)
    with open_gguf(deepseek) as g:
        key = "deepseek2.expert_gating_func"
        f = g.fields[key]
        assert f.value == 2  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        value_at = f.offset + 8 + len(key) + 4  # key length, key, value type, value
        first_moe = min(int(t.name.split(".")[1]) for t in g.tensors if "ffn_gate_inp" in t.name)
    with open(bad, "r+b") as fh:
        fh.seek(value_at)
        fh.write(struct.pack("<I", 1))  # SOFTMAX
    res = dg.run(dg.Inputs(gguf=deepseek, engine="llama.cpp", engine_gguf=bad, token_ids=IDS, threads=2))
    f = _routing(res.findings)
    assert f.status == "fail" and f.metrics["first_layer"] == first_moe, f
    assert "routing differs" in f.explanation and res.exit_code == 1
