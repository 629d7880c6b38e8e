"""check sharding: the rules' shards, saved engine shards, and the tensor-parallel forward over T ranks
(gloo on CPU: T processes run the code NCCL ranks would), with every planted sharding fault found at
its layer and named. Each forward test is one launch that runs the correct plan and the faults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from llmdoctor.checks.file import sharding
from llmdoctor.faults import get as get_fault
from llmdoctor.faults.sharding import plant
from llmdoctor.gguf import open_gguf
from llmdoctor.reference import forward as fw
from llmdoctor.reference import tensor_parallel as tp
from llmdoctor.reference.config import from_gguf

import fixtures_mla as fx


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return fx.build("deepseek", tmp_path_factory.mktemp("deepseek"))


def _plan(path, t, rules="vllm"):
    g = open_gguf(path)
    cfg = from_gguf(g)
    return tp.Plan(fw.Weights(g, dtype=torch.float32, device=torch.device("cpu"), cache=True), cfg, tp.RULES[rules], t)


def _first(res, plan):
    return next(f for f in res.findings if f.subject == plan and f.target == "first-divergence")


# ---- the rules ---------------------------------------------------------------------------------------

def test_rules_table():
    v, ep = tp.RULES["vllm"], tp.RULES["vllm-ep"]
    assert tp.split_of("blk.3.attn_q.weight", v)[0].kind == "column"
    assert tp.split_of("blk.3.attn_output.weight", v)[0] == tp.Split("row", 1, True)
    assert tp.split_of("blk.0.attn_kv_a_mqa.weight", v)[0].kind == "replicate"  # vLLM ReplicatedLinear
    assert tp.split_of("blk.0.attn_k_b.weight", v)[0] == tp.Split("heads", 0)
    assert tp.split_of("blk.1.ffn_down_exps.weight", v)[0] == tp.Split("expert_row", 2, True)
    assert tp.split_of("blk.1.ffn_down_exps.weight", ep)[0] == tp.Split("experts", 0, True)
    assert tp.split_of("blk.1.ffn_gate_inp.weight", v)[0].kind == "replicate"
    assert tp.split_of("blk.1.attn_output.bias", v)[0].kind == "replicate"  # added once, after the all-reduce
    # vocabulary 96 padded to 128 (vLLM pads to 64): T=4 leaves the last rank only padding
    assert [tp.vocab_range(96, r, 4, v) for r in range(4)] == [(0, 32), (32, 64), (64, 96), (96, 96)]
    assert [tp.vocab_range(96, r, 2, v) for r in range(2)] == [(0, 64), (64, 96)]


def test_kv_heads_replicated_when_t_exceeds_them(demo_path):
    plan = _plan(demo_path, 4)  # gemma3 270M: 4 query heads, 1 KV head
    k = [plan.shard("blk.0.attn_k.weight", r) for r in range(4)]
    assert all(torch.equal(k[0], x) for x in k) and k[0].shape[0] == plan.cfg.head_dim
    q = torch.cat([plan.shard("blk.0.attn_q.weight", r) for r in range(4)])
    assert torch.equal(q, plan.weights.get("blk.0.attn_q.weight"))
    assert tp.local_config(plan.cfg, 4).n_head == 1 and tp.local_config(plan.cfg, 4).n_head_kv == 1


def test_budget_is_twice_the_ordering_bound():
    m = torch.tensor([1.0, 0.0])
    b = sharding.metrics.reordered_sum_bound(m, torch.float32, 640)
    assert b[0] == pytest.approx(2 * 640 * 2**-24 / (1 - 640 * 2**-24) + 2 * 640 * 2**-150, rel=1e-12)


# ---- saved engine shards -----------------------------------------------------------------------------

def _save(plan, directory: Path, t: int, dtype=torch.float32) -> Path:
    from safetensors.torch import save_file

    directory.mkdir()
    for r in range(t):
        shards = {}
        for info in plan.weights.g.tensors:
            shards[info.name] = sharding._full_shard(plan, info.name, r).to(dtype).contiguous()
        save_file(shards, str(directory / f"rank{r}.safetensors"))
    return directory


def test_saved_shards(deepseek, tmp_path):
    base = _plan(deepseek.gguf_path, 2)
    good = sharding.compare_saved(sharding.EngineShards(base, _save(base, tmp_path / "good", 2)), base)
    assert good and all(f.status == "pass" for f in good), [f.reason for f in good if f.status != "pass"]
    bad = _save(get_fault("sharding-kv-b-latent-axis").build(base), tmp_path / "bad", 2)
    failed = {f.target: f for f in sharding.compare_saved(sharding.EngineShards(base, bad), base) if f.status == "fail"}
    assert set(failed) == {f"blk.{i}.attn_{x}_b.weight" for i in range(3) for x in "kv"}
    # a shard holding another rank's rows is named as such
    off = _save(get_fault("sharding-vocab-offset").build(base), tmp_path / "offset", 2)
    f = next(f for f in sharding.compare_saved(sharding.EngineShards(base, off), base) if f.target == "token_embd.weight")
    assert f.status == "fail" and "rank 0: holds rank 1's shard" in f.reason


# ---- the tensor-parallel forward ---------------------------------------------------------------------

@pytest.mark.slow
def test_demo_tp2_cli(demo_path, tmp_path):
    """Gemma 3 270M, T=2, two layers: the rules' plan passes every point; each fault is found at its
    layer and the right tensor (or collective) is named. Through the CLI, with --json-out."""
    from llmdoctor.cli import app

    out = tmp_path / "r.json"
    faults = ["sharding-heads-permuted", "sharding-vocab-offset", "sharding-missing-all-reduce"]
    args = ["check", "sharding", str(demo_path), "--tp", "2", "--layers", "2", "--tokens", "4", "--json-out", str(out)]
    for f in faults:
        args += ["--fault", f]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1, r.output
    doc = json.loads(out.read_text())
    plans = {p["plan"]: p["first_divergence"] for p in doc["plans"]}
    assert plans["rules"] is None
    rules_points = [f for f in doc["findings"] if f["subject"] == "rules"]
    assert all(f["status"] == "pass" for f in rules_points) and len(rules_points) == 1 + 2 * 2 + 1 + 1
    where = {"sharding-heads-permuted": "attn_out-0", "sharding-vocab-offset": "embedding",
             "sharding-missing-all-reduce": "attn_out-0"}
    for name in faults:
        first = plans[f"fault:{name}"]
        assert first["point"] == where[name], first
        assert get_fault(name).expect in first["explained_by"], first
    assert plans["fault:sharding-heads-permuted"]["tensors"] == ["blk.0.attn_q.weight"]


@pytest.mark.slow
def test_mla_tp2(deepseek, tmp_path):
    """DeepSeek-V3-shaped MLA + MoE (experts split by intermediate size), T=2: the engine's saved
    (correct) bfloat16 shards pass (the reference then holds the same bfloat16 values); MLA-specific and
    generic faults are found and named."""
    base = _plan(deepseek.gguf_path, 2)
    saved = _save(base, tmp_path / "shards", 2, torch.bfloat16)
    faults = ["sharding-heads-permuted", "sharding-kv-b-latent-axis", "sharding-vocab-offset",
              "sharding-missing-all-reduce"]
    res = sharding.run(deepseek.gguf_path, 2, engine_shards=saved, n_tokens=5, faults=faults, plant=plant)
    engine = f"engine-shards:{saved}"
    assert all(f.status == "pass" for f in res.findings if f.subject in (engine, "engine-shards")), \
        [f.reason for f in res.findings if f.status != "pass" and f.subject in (engine, "engine-shards")]
    by_plan = {p.plan: p.first for p in res.plans}
    assert by_plan[engine] is None
    for name, point in (("sharding-heads-permuted", "attn_out-0"), ("sharding-kv-b-latent-axis", "attn_out-0"),
                        ("sharding-vocab-offset", "embedding"), ("sharding-missing-all-reduce", "attn_out-0")):
        first = by_plan[f"fault:{name}"]
        assert first["point"] == point and get_fault(name).expect in first["explained_by"], first
        assert _first(res, f"fault:{name}").status == "fail"
    assert by_plan["fault:sharding-heads-permuted"]["tensors"] == ["blk.0.attn_q_b.weight"]
    assert set(by_plan["fault:sharding-kv-b-latent-axis"]["tensors"]) == {"blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"}


@pytest.mark.slow
def test_saved_shards_of_the_wrong_shape(deepseek, tmp_path):
    """k_b saved transposed ([H/T, Dn, R]): the comparison names it; the forward cannot run on it and
    says so (a skip with the failing rank's error), the exit code still 1 from the comparison."""
    from llmdoctor.checks.base import exit_code

    base = _plan(deepseek.gguf_path, 2)

    class Transposed(tp.PlanWrapper):
        def shard(self, name, rank):
            w = self.inner.shard(name, rank)
            return w.transpose(1, 2) if name == "blk.0.attn_k_b.weight" else w

    saved = _save(Transposed(base), tmp_path / "t", 2)
    res = sharding.run(deepseek.gguf_path, 2, engine_shards=saved, n_tokens=3)
    bad = {f.target: f for f in res.findings if f.status != "pass"}
    assert "shape [2, 12, 16], the rule gives [2, 16, 12]" in bad["blk.0.attn_k_b.weight"].reason
    assert bad["forward"].status == "skip" and "rank " in bad["forward"].reason
    assert exit_code(res.findings) == 1


@pytest.mark.slow
def test_mla_tp4_expert_parallel(deepseek):
    """T=4 with whole experts per rank: the rules' plan passes (the last rank's vocabulary shard is all
    padding); experts on the wrong rank are found at the first MoE layer (1) and the expert tensors named."""
    res = sharding.run(deepseek.gguf_path, 4, rules="vllm-ep", n_tokens=5, faults=["sharding-experts-wrong-rank"],
                       plant=plant)
    assert all(f.status == "pass" for f in res.findings if f.subject == "rules")
    first = {p.plan: p.first for p in res.plans}["fault:sharding-experts-wrong-rank"]
    assert first["point"] == "ffn_out-1"
    assert set(first["tensors"]) == {f"blk.1.ffn_{p}_exps.weight" for p in ("gate", "up", "down")}


def test_bad_input(demo_path):
    from llmdoctor.errors import InputError

    with pytest.raises(InputError, match="does not split into 3"):
        sharding.run(demo_path, 3, n_layer=1)
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="2 CUDA devices needed"):
            sharding.run(demo_path, 2, n_layer=1, device="cuda")
    with pytest.raises(InputError, match="expert-parallel rules"):
        get_fault("sharding-experts-wrong-rank").build(_plan(demo_path, 2))


@pytest.mark.gpu
def test_nccl_tp2(deepseek):
    """The same forward over NCCL, one GPU per rank (NVLink multicast off)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("skipped: needs 2 CUDA GPUs")
    res = sharding.run(deepseek.gguf_path, 2, n_tokens=5, device="cuda", faults=["sharding-missing-all-reduce"],
                       plant=plant)
    assert all(f.status == "pass" for f in res.findings if f.subject == "rules")
    assert {p.plan: p.first for p in res.plans}["fault:sharding-missing-all-reduce"]["point"] == "attn_out-0"
