"""vLLM for CPU with an fp8 KV cache (issue 34 item 2), run for real (LLMDOCTOR_VLLM_PYTHON): the tiny llama
served with `--kv-cache-dtype fp8` is healthy against the reference that emulates the cache with the engine's
own k/v scales (float32 and bfloat16), and fails without that emulation; a checkpoint whose quantization config
loads a wrong k_scale / v_scale into the engine is found by kv-scales, naming the layer's scale. Three engine
starts, and two more for the runs without the emulation (eager: 4-30 s each on 2 shared cores)."""

from __future__ import annotations

import json

import pytest

from llmdoctor.subjects.engines import vllm as vllm_engine
from test_engine_vllm import TOKENS, by_check, diagnose, vllm_checkpoint
from vllm_plants import wrong_kv_scales_copy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return vllm_checkpoint("llama", tmp_path_factory.mktemp("vllm-fp8") / "llama")[0]


def served(ckpt, python, args, model=None):
    return diagnose("--hf", str(ckpt), "--engine", "vllm", "--engine-python", python, "--engine-args",
                    f"{model or ckpt} --enforce-eager {args} --kv-cache-dtype fp8", token_ids=TOKENS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_healthy_fp8_kv_deployment_is_healthy_and_needs_the_emulation(dtype, llama, vllm_python, monkeypatch):
    """As served (k/v scales 1.0, the model's default), engine-vs-reference passes against the emulated cache
    (vLLM for CPU rounds toward zero) and kv-scales passes; the same engine judged against a reference that
    does not emulate the cache fails (measured: KL 0.024 vs noise 1e-9 in float32)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    code, doc, _ = served(llama, vllm_python, f"--dtype {dtype}")
    f = by_check(doc)
    config = doc["engine_run"]["engine_config"]
    assert config["resolved"]["kv_cache_dtype"] == "fp8"
    assert config["kv_scales"] == {f"model.layers.{i}.self_attn.attn": [1.0, 1.0] for i in range(2)}
    assert f["engine-vs-reference"]["status"] == "pass", f["engine-vs-reference"]["explanation"]
    assert "fp8 e4m3 KV cache with k/v scales 1/1 in all 2 layers, rounded toward zero" in \
        f["engine-vs-reference"]["budget"]["arithmetic"]
    assert f["kv-scales"]["status"] == "pass", f["kv-scales"]["explanation"]
    assert code == 0, json.dumps(doc["findings"])[-3000:]

    monkeypatch.setattr(vllm_engine, "kv_cache_emulation", lambda *a: (None, ""))
    _, doc, _ = served(llama, vllm_python, f"--dtype {dtype}")
    f = by_check(doc)
    assert f["engine-vs-reference"]["status"] == "fail", f["engine-vs-reference"]["explanation"]
    assert f["kv-scales"]["status"] == "skip"


def test_a_wrong_scale_in_the_checkpoint_is_named(llama, vllm_python, tmp_path, monkeypatch):
    """A copy of the checkpoint declaring an fp8 KV cache (compressed-tensors' kv_cache_scheme) with ModelOpt-named
    scales that vLLM loads into each attention layer: layer 0's k_scale 1e-3 (the keys saturate at 448 x 1e-3)
    and layer 1's v_scale 1e4 (every value stored as 0). The engine holds them (engine_config.kv_scales), the
    emulated run uses them too (engine-vs-reference cannot tell), and kv-scales fails naming both scales."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    bad = wrong_kv_scales_copy(llama, tmp_path / "llama-bad-scales")

    code, doc, _ = served(llama, vllm_python, "--dtype float32", model=bad)
    f = by_check(doc)
    assert doc["engine_run"]["engine_config"]["kv_scales"] == {  # float32 scales
        "model.layers.0.self_attn.attn": [pytest.approx(1e-3), 1.0], "model.layers.1.self_attn.attn": [1.0, 1e4]}
    kv = f["kv-scales"]
    assert kv["status"] == "fail" and code == 1
    assert set(kv["target"].split(", ")) == {"layer 0 k_scale", "layer 1 v_scale"}, kv["target"]
    assert "layer 0's k_scale 0.001: " in kv["explanation"] and "saturated" in kv["explanation"]
    assert "layer 1's v_scale 10000: 100.0% stored as 0" in kv["explanation"]
