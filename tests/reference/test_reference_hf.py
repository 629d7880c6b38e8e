"""The reference from an HF checkpoint (reference/checkpoint.py): the same forward pass as from the GGUF
converted from that checkpoint, bit for bit; `diagnose --hf DIR` without a GGUF against transformers
running the checkpoint itself (from_pretrained) is healthy on every architecture, and a tensor scaled in
the engine's copy is found at its layer.

Why bit-identical and not "close": the fixture GGUF is F32 and written by gguf/layout.py's forward
transforms from the very float32 tensors the checkpoint holds, so every weight the two sources hand the
forward pass is the same float32 tensor (F32 "dequantization" copies bytes; the transforms are
permutations, copies and splits, except gemma's +1, computed once in float32 from the same value on both
sides). The same code on the same inputs in one process gives the same bits; any difference is a bug in
a transform or a name, not rounding.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import fixtures_hf
from llmdoctor import diagnose as dg
from llmdoctor import faults
from llmdoctor.cli import app
from llmdoctor.errors import InputError
from llmdoctor.reference import load

pytestmark = pytest.mark.slow

IDS = [int(i) for i in np.random.default_rng(0).integers(1, 90, size=24)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """kind -> (checkpoint dir, its F32 GGUF), each built once per module."""
    made: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = fixtures_hf.checkpoint(kind, tmp_path_factory.mktemp(kind))
        return made[kind]

    return get


@pytest.mark.parametrize("kind", fixtures_hf.KINDS)
def test_checkpoint_reference_is_the_gguf_reference(built, kind):
    ckpt, gguf = built(kind)
    with load(ckpt) as hf, load(gguf) as gg:
        assert hf.config.diff(gg.config) == {} and hf.g is None
        hf.vocab_chunk = gg.vocab_chunk = 40  # the output projection read in row slices (3 for 96 rows)
        a, ca = hf.forward(IDS, capture={"*"})
        b, cb = gg.forward(IDS, capture={"*"})
    assert torch.equal(a, b), float((a - b).abs().max())
    assert ca.keys() == cb.keys() and len(ca) > 10
    assert all(torch.equal(ca[k], cb[k]) for k in ca), [k for k in ca if not torch.equal(ca[k], cb[k])][:3]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_checkpoint_reference_on_cuda(built, kind):
    """On CUDA too: the checkpoint's tensors are copied to the device, the GGUF's decoded there; the same
    float32 values through the same kernels (not run yet: no GPU in this session)."""
    ckpt, gguf = built(kind)
    with load(ckpt, device="cuda") as hf, load(gguf, device="cuda") as gg:
        a, b = hf.forward(IDS)[0], gg.forward(IDS)[0]
    assert a.is_cuda and torch.equal(a, b), float((a - b).abs().max())


def test_checkpoint_reads_only_what_it_needs_and_caches_the_same(built):
    """An uncached run reads embedding rows, vocabulary slices and single experts (partial reads); a
    cached run reads whole tensors: both give the same logits."""
    ckpt, _ = built("deepseek")
    with load(ckpt) as lazy, load(ckpt, cache=True) as cached:
        lazy.vocab_chunk = 40
        assert torch.equal(lazy.forward(IDS)[0], cached.forward(IDS)[0])
        assert not lazy.weights._cached and "blk.0.attn_k_b.weight" in cached.weights._cached


def test_bf16_and_sharded_checkpoints(built, tmp_path):
    """A bfloat16 checkpoint is widened exactly (its reference equals that of a float32 checkpoint of the
    same values); a checkpoint in several shards reads as one."""
    from transformers import AutoModelForCausalLM

    ckpt, _ = built("llama")
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model.to(torch.float32).save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    # a file the index does not name is not read (e.g. a repository's consolidated.safetensors beside the
    # shards; named to sort last here, where it would override the shards' embedding if read)
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(96, 64)}, tmp_path / "sharded" / "zz-stray.safetensors")
    with load(tmp_path / "bf16") as a, load(tmp_path / "sharded") as b:
        assert torch.equal(a.forward(IDS)[0], b.forward(IDS)[0])


def test_multimodal_wrapper_reads_its_text_model(built, tmp_path):
    """A Gemma3ForConditionalGeneration-style checkpoint (text config under text_config, text tensors
    under model.language_model., a vision tower beside them) runs as its text model."""
    from safetensors.torch import load_file, save_file

    ckpt, _ = built("gemma3")
    mm = tmp_path / "mm"
    mm.mkdir()
    text = json.loads((ckpt / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    sd = {k.replace("model.", "model.language_model.", 1): v for k, v in load_file(ckpt / "model.safetensors").items()}
    sd["model.vision_tower.vision_model.post_layernorm.weight"] = torch.ones(8)
    save_file(sd, mm / "model.safetensors")
    with load(ckpt) as a, load(mm) as b:
        assert torch.equal(a.forward(IDS)[0], b.forward(IDS)[0])


def test_quantized_checkpoint_tensor_is_refused_by_name(built, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt, _ = built("llama")
    bad = tmp_path / "fp8"
    shutil.copytree(ckpt, bad)
    sd = load_file(bad / "model.safetensors")
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)
    save_file(sd, bad / "model.safetensors")
    with load(bad) as model, pytest.raises(InputError, match="up_proj.weight.*F8_E4M3"):
        model.forward(IDS)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3", "deepseek", "glm"])
def test_diagnose_checkpoint_in_transformers_is_healthy(built, kind):
    ckpt, _ = built(kind)
    res = dg.run(dg.Inputs(hf=ckpt, engine="transformers", token_ids=IDS, threads=2))
    by = {f.check: f for f in res.findings}
    print(kind, by["engine-vs-reference"].explanation, "|", by["layer-localization"].explanation)
    assert res.exit_code == 0, res.verdict
    for check in ("file-integrity", "engine-file", "metadata", "mapping", "dequant"):
        assert by[check].status == "skip" and by[check].reason == dg.NO_GGUF, by[check]
    assert by["engine-vs-reference"].status == by["layer-localization"].status == "pass"
    assert by["fp16-overflow"].status == "pass"


@pytest.mark.parametrize("kind,tensors,layer", [
    ("llama", {"model.layers.0.mlp.down_proj.weight"}, 0),  # 2 layers: transformers shows l_out-0 only
    ("deepseek", lambda n: n.startswith("model.layers.1.mlp.experts.") and n.endswith("down_proj.weight"), 1),
])
def test_scaled_tensor_in_the_engines_checkpoint_is_found(built, tmp_path, kind, tensors, layer):
    ckpt, _ = built(kind)
    bad = faults.get("checkpoint-scaled-tensor").build(ckpt, tmp_path / "bad", tensors, 1.5)
    res = dg.run(dg.Inputs(hf=ckpt, engine_hf=bad, engine="transformers", token_ids=IDS, threads=2))
    by = {f.check: f for f in res.findings}
    assert res.exit_code == 1, res.verdict
    assert by["layer-localization"].status == "fail"
    assert by["layer-localization"].metrics["first_divergent_layer"] == layer, by["layer-localization"].explanation


def test_llama_cpp_needs_a_gguf(built):
    ckpt, _ = built("llama")
    res = dg.run(dg.Inputs(hf=ckpt, engine="llama.cpp", token_ids=IDS))
    assert res.exit_code == 2 and "llama.cpp runs GGUF files only" in res.verdict


def test_checkpoint_tokenizer(built, tmp_path):
    """A checkpoint's own tokenizer (AutoTokenizer) encodes the prompt; without one, prompts are ids."""
    ckpt, _ = built("llama")
    tok_dir = tmp_path / "tok"
    shutil.copytree(ckpt, tok_dir)
    fixtures_hf.with_tokenizer(tok_dir, ["<s>", "<unk>"] + [f"w{i}" for i in range(2, 96)])
    s = dg.Session(dg.Inputs(hf=tok_dir, prompt="w5 w7 w9 nothing"))
    assert s.tokens() == [0, 5, 7, 9, 1]
    r = CliRunner().invoke(app, ["logits", "w5 w7", "--hf", str(tok_dir), "--json"])
    res = json.loads(r.stdout)["result"]
    assert [(t["id"], t["text"]) for t in res["tokens"]] == [(0, "<s>"), (5, "w5"), (7, "w7")], r.output
    with pytest.raises(InputError, match="--token-ids"):
        dg.Session(dg.Inputs(hf=ckpt, prompt="w5")).tokens()


def test_cli_diagnose_and_logits_from_a_checkpoint(built):
    ckpt, _ = built("qwen2")
    runner = CliRunner()
    ids = ",".join(map(str, IDS))
    # no --engine: a checkpoint alone is diagnosed in transformers (not "healthy" on the overflow check alone)
    r = runner.invoke(app, ["diagnose", "--hf", str(ckpt), "--token-ids", ids, "--threads", "2", "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["verdict"] == "healthy", r.output
    [evr] = [f for f in doc["findings"] if f["check"] == "engine-vs-reference"]
    assert evr["status"] == "pass" and evr["subject"] == "transformers", evr
    r = runner.invoke(app, ["logits", "--hf", str(ckpt), "--token-ids", ids, "--top", "3", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)["result"]
    with load(ckpt) as model:
        want = model.forward(IDS, all_logits=False)[0][-1].topk(3).indices.tolist()
    assert [c["id"] for c in res["next"]] == want and res["next"][0]["text"] == f"[{want[0]}]"
    r = runner.invoke(app, ["logits", "some text", "--hf", str(ckpt)])
    assert r.exit_code == 2 and "--token-ids" in r.output
    r = runner.invoke(app, ["diagnose", "--hf", str(ckpt.parent), "--engine", "transformers"])  # no safetensors
    assert r.exit_code == 2 and "no config.json with *.safetensors" in r.output
