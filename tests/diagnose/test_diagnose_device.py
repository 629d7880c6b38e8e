"""diagnose --device and --max-gpu-memory (issue 23 part 1), on the CPU: the budgeted device cache
(reference/device_cache.py) with the CPU standing in for the GPU (every dequantized weight counted while it
lives), the stage times, and a tiny glm-dsa file diagnosed healthy and with planted faults named at their
layer. The same on CUDA is marked `gpu`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import fixtures_mla
from llmdoctor import diagnose as dg
from llmdoctor.cli import app
from llmdoctor.errors import InputError
from llmdoctor.gguf import open_gguf
from llmdoctor.reference import load
from llmdoctor.reference.device_cache import DeviceBudget, DeviceCache, minimum_bytes, parse_bytes
from test_moe_routing import engine_copy

IDS = [int(i) for i in np.random.default_rng(0).integers(1, 90, size=24)]
STAGES = {"read", "decode", "reference", "engine", "judging"}


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return fixtures_mla.build("glm", tmp_path_factory.mktemp("glm")).gguf_path


def one_layer(path, itemsize: int = 4) -> int:
    with open_gguf(path) as g:
        return minimum_bytes(g, itemsize)


def inputs(path, **kw) -> dg.Inputs:
    """The diagnosis of `path` in transformers from token ids; the decode path (greedy generation) is left to
    tests/diagnose/test_decode_path.py (generate=0): these tests are about where the prefill's evidence is computed."""
    return dg.Inputs.from_options(gguf=path, hf=None, endpoint=None, engine="transformers", prompt=None,
                                  token_ids=",".join(map(str, IDS)), default_gguf=lambda: path, threads=2,
                                  generate=0, **kw)


def test_parse_bytes():
    assert parse_bytes("8GB") == 8 << 30 and parse_bytes("1.5G") == 3 << 29 and parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("4096") == 4096
    for bad in ("", "-1GB", "8XB", "GB", "0"):
        with pytest.raises(InputError, match="--max-gpu-memory"):
            parse_bytes(bad)


def test_cache_admits_while_room_lasts_and_pins_displace():
    """Admission, not LRU: a loop of layers longer than the cache keeps the first ones (LRU would keep none
    by the time they come round again); a pinned tensor displaces unpinned ones."""
    b = DeviceBudget(1000)
    b.require(200, "test")  # working set: 800 bytes left to cache
    c = DeviceCache(b)
    for i in range(6):
        c[f"t{i}"] = torch.zeros(50, dtype=torch.float32)  # 200 bytes each
    assert list(c) == ["t0", "t1", "t2", "t3"] and b.held == 800 and not b.admits(1)
    c.pin("sub", torch.zeros(100, dtype=torch.float32))  # 400 bytes: two unpinned ones go, oldest first
    assert "sub" in c and "t0" not in c and "t1" not in c and b.held == 800
    b.require(600, "a larger model")  # a larger working set: the unpinned entries give way, oldest first
    assert list(c) == ["sub"] and b.held == 400 and b.room == 0
    c.clear()
    assert b.held == 0 and len(c) == 0
    with pytest.raises(InputError, match="at least 2 KiB"):
        DeviceBudget(1000).require(2048, "test")


def runs(path, budget: DeviceBudget) -> torch.Tensor:
    """float32 then float64 runs of two models sharing `budget` (as a diagnosis builds them), the float64 one
    twice; its logits."""
    with load(path, cache=True, budget=budget) as m32, load(path, dtype=torch.float64, cache=True, budget=budget) as m64:
        m32.forward(IDS)
        m64.forward(IDS)
        decoded = budget.tracked
        got, _ = m64.forward(IDS, capture={"l_out-*"})
        budget.streamed = budget.tracked - decoded  # tensors decoded again on the second float64 run
        budget.kept = budget.held  # what the caches kept (closing the models empties them)
    return got


def test_the_cap_holds_across_models_and_runs(glm):
    """Every dequantized weight alive at once stays within the cap over three runs of two models, whose
    logits are the uncapped ones; without the cap the same runs hold more."""
    need = one_layer(glm, 8)
    cap = 2 * need
    capped, free = DeviceBudget(cap), DeviceBudget(None)
    got, want = runs(glm, capped), runs(glm, free)
    assert torch.equal(got, want)
    assert capped.reserve == need and 0 < capped.kept <= cap - need < free.kept
    assert need < capped.peak <= cap < free.peak, (capped.as_dict(), free.as_dict())
    # what did not fit was decoded again (uncapped, only expert slabs and embedding rows are: never cached)
    assert capped.streamed > free.streamed > 0


def test_too_small_a_cap_is_bad_input(glm):
    need = one_layer(glm)
    with pytest.raises(InputError, match=f"at least .*{need} bytes"):
        inputs(glm, max_gpu_memory=str(need - 1))
    r = CliRunner().invoke(app, ["diagnose", "--gguf", str(glm), "--engine", "transformers", "--token-ids", "1,2,3",
                                 "--max-gpu-memory", f"{need - 1}", "--json"])
    assert r.exit_code == 2 and "at least" in json.loads(r.stdout)["error"], r.output


def test_device_is_checked():
    with pytest.raises(InputError, match="expected cpu or cuda"):
        dg.inputs._device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="CUDA is not available"):
            dg.inputs._device("cuda")


@pytest.mark.slow
def test_a_capped_cpu_diagnosis_is_healthy_with_its_stages(glm):
    """The CPU path of the GPU diagnosis: --device cpu under a cap of twice one float64 layer (the float32
    engine's noise budget is the reference in float64)."""
    cap = 2 * one_layer(glm, 8)
    res = dg.run(inputs(glm, device="cpu", max_gpu_memory=str(cap)))
    assert res.exit_code == 0, res.verdict
    by = {f.check: f.status for f in res.findings}
    assert by["dsa-selection"] == by["moe-routing"] == by["engine-vs-reference"] == by["layer-localization"] == "pass"
    assert STAGES <= set(res.stages) and all(v >= 0 for v in res.stages.values())
    assert res.device["device"] == "cpu" and res.device["peak_live_bytes"] <= cap
    assert res.to_dict()["stages_s"] == res.stages


@pytest.mark.slow
@pytest.mark.parametrize("tensor,named", [
    ("blk.1.ffn_down_exps.weight", "layer-localization"),  # one expert's weights x8: named at layer 1
    ("blk.2.indexer.proj.weight", "dsa-selection"),  # the indexer's head weights negated: selection at layer 2
], ids=["expert", "indexer"])
def test_a_planted_fault_is_named_at_its_layer(glm, tmp_path, tensor, named):
    layer = int(tensor.split(".")[1])
    if "exps" in tensor:  # expert 0's slab only
        with open_gguf(glm) as g:
            n = g.tensor(tensor).shape[0]
        bad = engine_copy(glm, tmp_path / "engine.gguf", [tensor], 1.0)
        with open_gguf(bad) as g:
            t = g.tensor(tensor)
            off, count = t.offset, t.nbytes // 4 // n
        v = np.memmap(bad, dtype=np.float32, mode="r+", offset=off, shape=(count,))
        v *= 8
        v.flush()
        del v
    else:
        bad = engine_copy(glm, tmp_path / "engine.gguf", [tensor], -1.0)
    i = inputs(glm, device="cpu", max_gpu_memory=str(2 * one_layer(glm, 8)))
    i.engine_gguf = bad
    res = dg.run(i)
    assert res.exit_code == 1, res.verdict
    hit = next(f for f in res.findings if f.check == named and f.status == "fail")
    key = "first_divergent_layer" if named == "layer-localization" else "first_layer"
    assert hit.metrics[key] == layer, hit


def test_the_benchs_synthetic_blocks_are_what_a_quantizer_writes():
    """bench_glm5.py draws K-quant blocks instead of quantizing floats (tests/kquant_blocks.py): decoded they have
    the RMS asked for and mean ~0, and their sub-block codes end where llama.cpp's quantizer puts them
    (checks/file/subblock_codes.py SUBBLOCKS)."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import dequantize

    import kquant_blocks
    from llmdoctor.checks.file.subblock_codes import SUBBLOCKS
    from llmdoctor.gguf.block_layout import subblock_codes

    gen = torch.Generator().manual_seed(0)
    for qt, make in ((QT.Q4_K, kquant_blocks.q4_k_blocks), (QT.Q6_K, kquant_blocks.q6_k_blocks)):
        blocks = make(4096, 0.05, gen, "cpu").numpy()
        v = dequantize(blocks, qt).astype(np.float64)
        assert abs(np.sqrt((v ** 2).mean()) / 0.05 - 1) < 0.03 and abs(v.mean()) < 0.05 * 0.03, qt
        for fam in SUBBLOCKS[qt].families:
            codes = subblock_codes(blocks, qt)[fam.name]
            ends = codes.max(1) if fam.reduce == "max" else codes.min(1)
            assert set(ends.tolist()) <= set(fam.pinned), (qt, fam.name)


@pytest.mark.gpu
def test_a_capped_cuda_diagnosis_is_healthy(glm):
    """The same diagnosis with the reference and the engine on CUDA: healthy, the cap held, captures on the CPU."""
    cap = 2 * one_layer(glm, 8)
    res = dg.run(inputs(glm, device="cuda", max_gpu_memory=str(cap)))
    assert res.exit_code == 0, res.verdict
    assert res.device["peak_live_bytes"] <= cap and res.device["cuda_max_allocated_bytes"] > 0
    assert res.engine_run["device"] == "cuda"
