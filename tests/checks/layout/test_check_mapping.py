"""check mapping: consistent pairs pass (the demo against an HF checkpoint made from it by the inverse
transforms, the tiny DeepSeek-V3 / GLM-DSA models, a tiny quantized llama), every planted mapping fault is
found and named, and the CLI follows the exit-code conventions."""

from __future__ import annotations

import json
import math
import re

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

import fixtures_mla as fx
from llmdoctor import faults
from llmdoctor.checks.layout import mapping
from llmdoctor.cli import app
from llmdoctor.faults.mapping import _rewrite
from llmdoctor.gguf import layout, open_gguf
from llmdoctor.reference.config import from_gguf, from_hf
from llmdoctor.reference.forward import dequantize_raw
from test_reference_dense import write_gguf


def failed(res: mapping.Result) -> list[str]:
    return [f.explanation for f in res.findings if f.status == "fail"]


# ---- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_hf(demo_path, tmp_path_factory):
    """An HF-layout checkpoint of the demo: config.json written from its metadata, every tensor
    dequantized and taken through the inverse transforms (gemma norms: stored w + 1 -> w)."""
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("demo-hf")
    with open_gguf(demo_path) as g:
        cfg = from_gguf(g)
        config = mapping.hf_config(cfg, g)
        p = layout.plan(cfg.arch, list(mapping.meta_shapes(config)), config)
        gg = {t.name: dequantize_raw(t.data, t.type, t.shape, device="cpu") for t in g.tensors}
    save_file({k: v.contiguous() for k, v in layout.to_hf(p, gg).items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    out = tmp_path_factory.mktemp("mla")
    return {kind: (fx.build(kind, out).gguf_path, out / f"hf-{kind}") for kind in ("deepseek", "glm")}


# A tiny llama (GQA: 4 heads, 2 kv heads) as convert_hf_to_gguf.py + llama-quantize would write it:
# Q/K rows permuted, attn_q Q4_0, attn_v Q8_0, FFN Q5_0, output F16; attn_k F32 (the K fault edits it).
LLAMA_TYPES = {"attn_q": QT.Q4_0, "attn_v": QT.Q8_0, "ffn_gate": QT.Q5_0, "ffn_up": QT.Q5_0, "ffn_down": QT.Q5_1,
               "attn_output": QT.Q4_1, "output": QT.F16}


def _tiny_llama(out, *, vocab: int, hidden: int, ffn: int, std: float) -> None:
    """A 3-layer random llama (GQA 4/2, norms near 1) saved as out/hf and converted to out/f32.gguf."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if n.endswith("norm.weight") else torch.randn_like(p) * std)
    model.save_pretrained(out / "hf")
    d = json.loads((out / "hf" / "config.json").read_text())
    sd = dict(model.state_dict())
    write_gguf(out / "f32.gguf", "llama", d, layout.to_gguf(layout.plan("llama", list(sd), d), sd))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama")
    _tiny_llama(out, vocab=96, hidden=64, ffn=96, std=1 / 8)

    def quantize(name, data, qt):
        kind = name.split(".")[-2]
        t = LLAMA_TYPES.get(kind)
        yield (name, data, qt) if t is None else (name, gguf.quants.quantize(data, t), t)

    return _rewrite(out / "f32.gguf", out / "llama.gguf", quantize), out / "hf"


# ---- consistent pairs ----------------------------------------------------------------------------

@pytest.mark.slow
def test_demo_consistent(demo_path, demo_hf):
    res = mapping.run(demo_path, demo_hf)
    assert failed(res) == [] and not [f for f in res.findings if f.status == "skip"]
    numeric = [f for f in res.findings if f.target.startswith("numeric/")]
    assert len(numeric) == 236 and all(f.metrics["rel_l2"] <= f.budget["rel_l2_max"] for f in numeric)
    names = next(f for f in res.findings if f.target == "names")
    assert "lm_head.weight (tied" in names.explanation  # the derived parameter, named with its reason
    assert next(f for f in numeric if f.target == "numeric/token_embd.weight").metrics["rows_compared"] == 4096


def test_demo_without_hf_checks_names_and_shapes(demo_path):
    res = mapping.run(demo_path)
    assert failed(res) == []
    skipped = {f.target: f.reason for f in res.findings if f.status == "skip"}
    assert set(skipped) == {"metadata", "numeric"}


@pytest.mark.parametrize("kind", ["deepseek", "glm"])
def test_mla_consistent(mla, kind):
    res = mapping.run(*mla[kind])
    assert failed(res) == []
    assert {"names", "collisions", "shapes", "types", "metadata"} <= {f.target for f in res.findings}
    by = {f.target: f for f in res.findings}
    assert by["numeric/blk.0.attn_k_b.weight"].metrics["rel_l2"] == 0.0  # F32: the inverse is exact
    with open_gguf(mla[kind][0]) as g:  # one numeric finding per GGUF tensor, k_b and v_b sharing theirs
        n_rules = len(g.tensors) - sum(t.name.endswith("attn_v_b.weight") for t in g.tensors)
    assert len([t for t in by if t.startswith("numeric/")]) == n_rules


def test_quantized_llama_within_band(llama):
    """Quantized with gguf-py's quantizers, each tensor's error equals its own round-trip estimate:
    inside the band, and the band is far below a swapped tensor's sqrt(2)."""
    res = mapping.run(*llama)
    assert failed(res) == []
    q = next(f for f in res.findings if f.target == "numeric/blk.0.attn_q.weight")
    assert q.metrics["types"] == ["Q4_0"] and 0.05 < q.metrics["rel_l2"] <= q.budget["rel_l2_max"] < 0.5
    assert math.isclose(q.metrics["rel_l2"], q.budget["quant_rel_l2"], rel_tol=1e-6)
    k = next(f for f in res.findings if f.target == "numeric/blk.0.attn_k.weight")
    assert k.metrics["rel_l2"] == 0.0


@pytest.fixture(scope="module")
def kquant(tmp_path_factory):
    """A tiny llama (rows of 256, as K-quants need) quantized by llama.cpp itself (llama-cpp-python's
    llama_model_quantize, no importance matrix) to K- and IQ-quant mixes gguf-py cannot produce."""
    import ctypes

    llama_cpp = pytest.importorskip("llama_cpp")
    out = tmp_path_factory.mktemp("kquant")
    _tiny_llama(out, vocab=256, hidden=256, ffn=512, std=1 / 16)
    files = {}
    for ftype in ("Q4_K_M", "Q2_K", "IQ4_XS"):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}"), 1
        files[ftype] = out / f"{ftype}.gguf"
        assert llama_cpp.llama_model_quantize(str(out / "f32.gguf").encode(), str(files[ftype]).encode(),
                                              ctypes.byref(params)) == 0
    return files, out / "hf"


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q2_K", "IQ4_XS"])
def test_llama_cpp_quantized_within_band(kquant, ftype, tmp_path):
    """llama.cpp's own K/IQ quantizers land inside the band estimated from Q4_0's round trip (measured
    worst rel_l2 / band: 0.42 Q4_K, 0.47 Q2_K, 0.43 Q3_K, 0.38 IQ4_XS, 0.44 Q6_K), and a swap across
    layers still falls outside it at 2.6 bits per weight."""
    files, hf = kquant
    res = mapping.run(files[ftype], hf)
    assert failed(res) == []
    numeric = [f for f in res.findings if f.target.startswith("numeric/")]
    types = {t for f in numeric for t in f.metrics["types"]}
    assert {"Q4_K_M": "Q4_K", "Q2_K": "Q2_K", "IQ4_XS": "IQ4_XS"}[ftype] in types
    assert max(f.metrics["rel_l2"] / f.budget["rel_l2_max"] for f in numeric) < 0.6
    swapped, _ = faults.get("mapping-swap-layers").build(files[ftype], hf, tmp_path, kind="attn_q.weight")
    assert any("swapped across layers" in m for m in failed(mapping.run(swapped, hf)))


def test_hf_config_inverts_the_parsers(demo_path, mla):
    for path in [demo_path] + [p for p, _ in mla.values()]:
        with open_gguf(path) as g:
            cfg = from_gguf(g)
            assert from_hf(mapping.hf_config(cfg, g)).diff(cfg) == {}, path


def test_band_for_types_without_a_gguf_py_quantizer():
    """K-quants: Q4_0's round-trip error scaled by 2 per bit of bits-per-weight difference."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    e = {t: mapping.quant_error(x, t) for t in (QT.Q2_K, QT.Q4_K, QT.Q6_K, QT.Q4_0, QT.Q8_0, QT.F32)}
    assert e[QT.F32][0] == 0 and "gguf-py Q8_0" in e[QT.Q8_0][1] and "Q4_0 round trip" in e[QT.Q6_K][1]
    assert e[QT.Q4_K][0] == e[QT.Q4_0][0]  # same 4.5 bits per weight
    assert e[QT.Q8_0][0] < e[QT.Q6_K][0] < e[QT.Q4_K][0] < e[QT.Q2_K][0] < 0.5


def test_name_map_pollution_cannot_reach_the_check(llama):
    """gguf 0.19: after gguf-py builds an ARCTIC map, its own LLAMA maps lose post_attention_layernorm ->
    ffn_norm. The check builds its maps privately (layout.name_map), so it still finds the pair consistent."""
    saved = dict(gguf.TensorNameMap.block_mappings_cfg)
    try:
        gguf.TensorNameMap(gguf.MODEL_ARCH.ARCTIC, 3)
        layout.name_map.cache_clear()
        assert failed(mapping.run(*llama)) == []
    finally:
        gguf.TensorNameMap.block_mappings_cfg.clear()
        gguf.TensorNameMap.block_mappings_cfg.update(saved)


def test_many_to_one_collision():
    """gguf-py's map sends several architectures' names to token_embd: a checkpoint holding two of them
    collides."""
    p = layout.plan("llama", ["model.embed_tokens.weight", "transformer.wte.weight"], {"num_hidden_layers": 1,
                                                                                       "num_attention_heads": 1})
    [f] = mapping._collisions(p)
    assert f.status == "fail"
    assert f.explanation == "model.embed_tokens.weight and transformer.wte.weight all map onto token_embd.weight"


def test_gguf_tensor_without_hf_parameter(mla, tmp_path):
    gguf_path, hf = mla["deepseek"]

    def extra(name, data, qt):
        yield name, data, qt
        if name == "blk.0.attn_norm.weight":
            yield "blk.0.attn_norm_2.weight", data, qt

    res = mapping.run(_rewrite(gguf_path, tmp_path / "extra.gguf", extra), hf / "config.json")
    assert failed(res) == ["GGUF tensor blk.0.attn_norm_2.weight has no HF parameter in transformers (meta device) "
                           f"from {hf / 'config.json'}"]
    assert "numeric check needs an HF checkpoint (--hf DIR): --hf is a config.json" in \
        next(f.reason for f in res.findings if f.target == "numeric")


def test_metadata_differences_named_with_both_values(mla, tmp_path):
    gguf_path, hf = mla["glm"]
    config = json.loads((hf / "config.json").read_text())
    config.update(rms_norm_eps=1e-5, routed_scaling_factor=1.0, first_k_dense_replace=2, num_experts_per_tok=3,
                  scoring_func="softmax", index_topk=8, eos_token_id=7)
    (tmp_path / "config.json").write_text(json.dumps(config))
    msgs = failed(mapping.run(gguf_path, tmp_path / "config.json"))
    for want in ("norm_eps: GGUF glm-dsa.attention.layer_norm_rms_epsilon = 1e-06, config.json rms_norm_eps = 1e-05",
                 "moe.scale: GGUF glm-dsa.expert_weights_scale = 2.5, config.json routed_scaling_factor = 1.0",
                 "moe.n_dense_lead: GGUF glm-dsa.leading_dense_block_count = 1, config.json first_k_dense_replace = 2",
                 "moe.n_used: GGUF glm-dsa.expert_used_count = 2, config.json num_experts_per_tok = 3",
                 "moe.gating: GGUF glm-dsa.expert_gating_func = sigmoid, config.json scoring_func = softmax",
                 "mla.indexer.top_k: GGUF glm-dsa.attention.indexer.top_k = 6, config.json index_topk = 8"):
        assert want in msgs, msgs


def test_glm_nextn_block(mla, tmp_path):
    """GLM-4.5/GLM-5 GGUFs keep the NextN/MTP layer as an extra block (block_count = num_hidden_layers + 1,
    nextn_predict_layers = 1) that transformers builds no module for: consistent against config.json
    (the block listed as such), against the checkpoint holding model.layers.3.* (compared), and alone."""
    from safetensors.torch import load_file, save_file

    from llmdoctor.reference.mla import INDEXER_TYPES_KEY

    gguf_path, hf = mla["glm"]
    config = {**json.loads((hf / "config.json").read_text()), "num_nextn_predict_layers": 1}
    n, h = config["num_hidden_layers"], config["hidden_size"]
    ckpt = load_file(hf / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    mtp = {k.replace(f"layers.{n - 1}.", f"layers.{n}."): v for k, v in ckpt.items() if f"layers.{n - 1}." in k}
    mtp |= {f"model.layers.{n}.{k}": torch.randn(*s, generator=g) for k, s in
            (("eh_proj.weight", (h, 2 * h)), ("enorm.weight", (h,)), ("hnorm.weight", (h,)),
             ("shared_head.norm.weight", (h,)))}
    p = layout.plan("glm-dsa", list(mtp), config)
    assert not p.unmapped and "blk.3.nextn.eh_proj.weight" in p.by_target()
    extra = layout.to_gguf(p, mtp)

    def add(name, data, qt):
        yield name, data, qt
        if name == "token_embd.weight":
            yield from ((k, v.numpy(), QT.F32) for k, v in extra.items())

    V, arch = gguf.GGUFValueType, "glm-dsa"
    with open_gguf(gguf_path) as gf:
        types = list(gf.get(INDEXER_TYPES_KEY.format(arch=arch))) + [True]
    path = _rewrite(gguf_path, tmp_path / "mtp.gguf", add, {
        f"{arch}.block_count": (n + 1, V.UINT32), f"{arch}.nextn_predict_layers": (1, V.UINT32),
        INDEXER_TYPES_KEY.format(arch=arch): (types, V.ARRAY, V.BOOL)})
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    save_file(ckpt, str(d / "model.safetensors"))
    save_file(mtp, str(d / "mtp.safetensors"))
    res = mapping.run(path, d / "config.json")
    assert failed(res) == []
    names = next(f for f in res.findings if f.target == "names")
    assert "blk.3.nextn.eh_proj.weight" in [e.get("derived") for e in names.evidence]
    res = mapping.run(path, d)
    assert failed(res) == [] and "numeric/blk.3.nextn.eh_proj.weight" in {f.target for f in res.findings}
    assert failed(mapping.run(path)) == []
    # the reference forward pass skips the MTP block, as llama.cpp's graph does: same logits as without it
    from llmdoctor.reference import load

    ids = list(range(1, 24))
    with load(gguf_path) as a, load(path) as b:
        assert b.config.n_nextn == 1 and torch.equal(a.forward(ids)[0], b.forward(ids)[0])


class StandInGGUFModelLoader:
    """A stand-in with the contract of the vllm-gguf-plugin's name map (subjects/engines/vllm.py
    `gguf_name_map`: HF config -> {GGUF name: HF name}), so that the diff is tested for every map shape;
    tests/subjects/engines/test_engine_vllm.py asks the real one. Like vLLM it maps through gguf-py's table, stacked
    experts under expert 0's name, and kv_b_proj whole."""

    def _get_gguf_weights_map(self, model_config):
        c = model_config.hf_config
        out = {}
        for name in mapping.meta_shapes(c.to_dict()):
            e = re.match(r"(.+\.experts)\.(\d+)\.(\w+)\.weight$", name)
            t = layout.gguf_name("deepseek2", c.num_hidden_layers, f"{e[1]}.{e[3]}.weight" if e else name)
            if t and (e is None or e[2] == "0"):
                out[t] = name
        return out


@pytest.mark.parametrize("legacy", [False, True])
def test_engine_vllm_map_diffed_against_ours(tmp_path, monkeypatch, legacy):
    """--engine vllm: a map that keeps kv_b_proj whole agrees with a file converted before the MLA split
    and names each tensor it cannot place in a file with k_b / v_b."""
    import types

    from llmdoctor.subjects.engines import vllm as vllm_engine
    from llmdoctor.subjects.engines.base import Deployment

    def name_map(python, config):
        model_config = types.SimpleNamespace(hf_config=mapping.config_object(config))
        return {"map": StandInGGUFModelLoader()._get_gguf_weights_map(model_config)}

    monkeypatch.setattr(vllm_engine, "find_python", lambda explicit=None: "python")
    monkeypatch.setattr(vllm_engine, "gguf_name_map", name_map)
    f = fx.build("deepseek", tmp_path, legacy=legacy)
    res = mapping.run(f.gguf_path, tmp_path / "hf-deepseek" / "config.json",
                      engine=vllm_engine.VLLMEngine(Deployment(model=f.gguf_path)))
    vllm = [x for x in res.findings if x.subject == "vllm"]
    if legacy:
        assert [x.status for x in vllm] == ["pass"] and failed(res) == []
    else:
        msgs = failed(res)
        assert ("vLLM's map has no HF parameter for blk.0.attn_k_b.weight (ours: "
                "model.layers.0.self_attn.kv_b_proj.weight): vLLM would not load it") in msgs
        assert ("vLLM expects blk.0.attn_kv_b.weight (for model.layers.0.self_attn.kv_b_proj.weight), which the "
                "file does not have") in msgs


def test_an_engine_without_its_own_name_map_is_bad_input(demo_path):
    """check mapping --engine diffs that engine's own GGUF name map: naming one that has none (llama.cpp) is bad
    input, one line and exit 2."""
    from typer.testing import CliRunner

    from llmdoctor.cli import app

    r = CliRunner().invoke(app, ["check", "mapping", str(demo_path), "--engine", "llama.cpp"])
    assert r.exit_code == 2 and "--engine 'llama.cpp': llama.cpp exposes no GGUF name map of its own" in r.output, r.output


# ---- planted faults ------------------------------------------------------------------------------

def _pair(name, demo_path, demo_hf, mla, llama):
    """The pair each fault is planted in: config.json alone where names/metadata suffice (fast)."""
    return {
        "mapping-swap-layers": llama,
        "mapping-k-wrong-heads": (llama[0].with_name("f32.gguf"), llama[1]),
        "mapping-kb-not-transposed": mla["deepseek"],
        "mapping-indexer-missing": mla["glm"],
        "mapping-experts-order": mla["deepseek"],
        "mapping-indexer-quantized": mla["glm"],
        "mapping-rope-base": (demo_path, demo_hf / "config.json"),
        "mapping-head-count": (demo_path, demo_hf / "config.json"),
        "mapping-hf-no-source": (demo_path, demo_hf / "config.json"),
    }[name]


MAPPING_FAULTS = [f.name for f in faults.all_faults("file") if f.name.startswith("mapping-")]
NAMED = {  # the finding must say this much (with both values / the explaining transform)
    "mapping-swap-layers": "blk.1.attn_k.weight holds model.layers.2.self_attn.k_proj.weight's weights",
    "mapping-k-wrong-heads": "blk.0.attn_k.weight matches model.layers.0.self_attn.k_proj.weight only after the "
                             "RoPE permutation with n_head_kv=4 instead of 2",
    "mapping-kb-not-transposed": "blk.0.attn_k_b.weight was written without its transpose",
    "mapping-indexer-missing": "model.layers.0.self_attn.indexer.weights_proj.weight has no GGUF source",
    "mapping-indexer-quantized": "blk.0.indexer.proj.weight is Q8_0",
    "mapping-experts-order": "blk.1.ffn_up_exps.weight slot 0 holds model.layers.1.mlp.experts.1.up_proj.weight",
    "mapping-rope-base": "rope_base: GGUF gemma3.rope.freq_base = 100.0, config.json rope_theta = 1000000.0",
    "mapping-head-count": "n_head: GGUF gemma3.attention.head_count = 8, config.json num_attention_heads = 4",
    "mapping-hf-no-source": "HF parameter lm_head.weight has no GGUF source: output.weight is not in the file",
}


def test_every_mapping_fault_is_tested():
    assert sorted(MAPPING_FAULTS) == sorted(NAMED)


@pytest.mark.parametrize("name", sorted(NAMED))
def test_planted_fault_found_and_named(name, demo_path, demo_hf, mla, llama, tmp_path):
    f = faults.get(name)
    gguf_path, hf = f.build(*_pair(name, demo_path, demo_hf, mla, llama), tmp_path)
    res = mapping.run(gguf_path, hf)
    msgs = failed(res)
    assert any(f.expect in m for m in msgs), msgs
    assert any(NAMED[name] in m for m in msgs), msgs


# ---- CLI -----------------------------------------------------------------------------------------

def test_cli_exit_codes(mla, tmp_path):
    gguf_path, hf = mla["deepseek"]
    r = CliRunner().invoke(app, ["check", "mapping", str(gguf_path), "--hf", str(hf), "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["verdict"] == "consistent" and doc["schema"] == "llmdoctor.check.mapping/1"
    bad, _ = faults.get("mapping-kb-not-transposed").build(gguf_path, hf, tmp_path)
    r = CliRunner().invoke(app, ["check", "mapping", str(bad), "--hf", str(hf / "config.json"), "--engine", "vllm"])
    assert r.exit_code == 1 and "attn_k_b" in r.stdout and "inconsistent:" in r.stdout
    r = CliRunner().invoke(app, ["check", "mapping", str(gguf_path), "--hf", str(hf), "--engine", "vllm", "--json"])
    [v] = [f for f in json.loads(r.stdout)["findings"] if f["subject"] == "vllm"]
    # the named engine could not run: its map was not compared, so nothing healthy is concluded (exit 2)
    assert r.exit_code == 2 and v["status"] == "skip" and "name map could not be asked" in v["reason"]
    for bad_config, says in (("[1, 2]", "not a JSON object"), ('{"model_type": "llama"}', "lacks"),
                             ('{"model_type": "llama", "num_hidden_layers": 2, "rope_parameters": 5}', "")):
        (tmp_path / "bad.json").write_text(bad_config)
        r = CliRunner().invoke(app, ["check", "mapping", str(gguf_path), "--hf", str(tmp_path / "bad.json")])
        assert r.exit_code == 2 and r.stderr.startswith("error: ") and says in r.stderr, r.stderr
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text((hf / "config.json").read_text())
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"not safetensors")
    r = CliRunner().invoke(app, ["check", "mapping", str(gguf_path), "--hf", str(tmp_path / "ck")])
    assert r.exit_code == 2 and "not a readable safetensors file" in r.stderr, r.stderr
    r = CliRunner().invoke(app, ["check", "mapping", str(gguf_path), "--hf", str(tmp_path / "none")])
    assert r.exit_code == 2
