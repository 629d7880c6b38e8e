"""The deployment as its `vllm serve` arguments configure it (issue 34 items 2-4), with vLLM for CPU
(LLMDOCTOR_VLLM_PYTHON): the configured requests (a prompt longer than the token budget, a prefix-cache hit)
agree on a healthy engine, and each planted fault (tests/vllm_plants.py: broken by the test, in the deployment's
interpreter) is found and named by the ladder's rung whose reversal makes the engine agree."""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from llmdoctor.cli import app
from llmdoctor.diagnose.configured import RUNGS, prefix_requests
from llmdoctor.diagnose.requests import long_prompt
from test_engine_vllm import vllm_checkpoint
from vllm_plants import plant_env

TOKENS = list(range(3, 40))  # 37 positions: three prefill chunks of the 16-token budget below
# eager (vLLM for CPU's torch.compile adds ~40 s to a load), chunks of 16, prefix caching on, blocks of 32 (the
# CPU attention backend's block sizes are multiples of 32)
EAGER = "--dtype float32 --enforce-eager --max-num-batched-tokens 16 --max-num-seqs 16 --enable-prefix-caching --block-size 32"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return vllm_checkpoint("llama", tmp_path_factory.mktemp("configured") / "llama")[0]


def diagnose(vllm_python: str, args: str) -> dict:
    r = CliRunner().invoke(app, ["diagnose", "--engine", "vllm", "--engine-python", vllm_python, "--engine-args", args,
                                 "--token-ids", ",".join(map(str, TOKENS)), "--generate", "4", "--json"])
    assert r.exit_code in (0, 1), r.output[-3000:]
    return json.loads(r.stdout)


def by_target(doc: dict, check: str) -> dict[str, dict]:
    return {f["target"]: f for f in doc["findings"] if f["check"] == check}


def test_the_second_request_shares_full_blocks_then_holds_a_block_of_its_own(monkeypatch):
    """No vLLM: the prefix-cache request's tokens, as prefix_requests builds them from a prompt shorter than two
    blocks (repeated), in a model of 256 positions."""
    import llmdoctor.diagnose.requests as requests

    class Prompt:
        def tokens(self):
            return TOKENS

    monkeypatch.setattr(requests, "_context", lambda s: 256)
    first, second, shared = prefix_requests(Prompt(), {"prefix_caching": True, "block_size": 32})
    assert len(first) == 65 and first[:37] == TOKENS and shared == 32
    assert second[:32] == first[:32] and len(second) == 65 and second[32:64] != first[32:64]


@pytest.mark.parametrize("said, words", [(True, "asks for it (--enable-prefix-caching), and vLLM turned it off"),
                                          (False, "turns it off (--no-enable-prefix-caching)"),
                                          (None, "leaves it to vLLM")])
def test_an_option_off_says_who_turned_it_off(said, words):
    """No vLLM: a request that needs an option the resolved configuration has off says whether the command line
    turned it off, left it to vLLM, or asked for it and vLLM turned it off (vllm_driver.py `asked`)."""
    from llmdoctor.diagnose.session import Skip

    cfg = {"prefix_caching": False, "chunked_prefill": False, "asked": {"prefix_caching": said, "chunked_prefill": None}}
    with pytest.raises(Skip, match=r"prefix caching is off in this configuration: .*" + re.escape(words)):
        prefix_requests(None, cfg)
    with pytest.raises(Skip, match="chunked prefill is off in this configuration: the command line leaves it to vLLM"):
        long_prompt(None, cfg)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return vllm_checkpoint("deepseek", tmp_path_factory.mktemp("configured") / "deepseek")[0]


@pytest.mark.slow
@pytest.mark.parametrize("model, dtype", [("llama", "float32"), ("deepseek", "bfloat16")])
def test_a_healthy_configured_engine_agrees_on_every_request(vllm_python, model, dtype, request, monkeypatch):
    """Chunked prefill (37 tokens in chunks of 16), a prefix-cache hit (vLLM read exactly the 32 tokens the two
    requests share) and the generated steps agree with the reference; the ladder has nothing to name.
    DeepSeek-V3's MLA is the regression test of the driver's backend explainer, which once rewrote the live
    engine's scheduler config (CPU_MLA's chunked prefill off) and left every later request over 16 tokens
    unscheduled until the driver's 30-minute limit: the requests here must finish. DeepSeek-V3 runs in bfloat16
    (vLLM for CPU's AMX GEMM refuses its router's float32 weights on CPUs with AMX)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    doc = diagnose(vllm_python, f"{request.getfixturevalue(model)} {EAGER.replace('float32', dtype)}")
    got = by_target(doc, "configured-requests")
    chunked = got["a prompt longer than the token budget"]
    prefix = got["a request reading another's blocks from the prefix cache"]
    if model == "deepseek" and not torch.cpu._is_amx_tile_supported():
        # vLLM for CPU turns chunked prefill and prefix caching off for MLA on a CPU without AMX tiles
        # (vllm/platforms/cpu.py, "MLA is enabled on a non-GPU platform"): the requests that need them say so
        assert chunked["status"] == "skip" and "chunked prefill is off" in chunked["reason"], chunked
        assert "leaves it to vLLM" in chunked["reason"], chunked  # the arguments say nothing of it
        assert prefix["status"] == "skip" and "prefix caching is off" in prefix["reason"], prefix
        assert "asks for it (--enable-prefix-caching), and vLLM turned it off" in prefix["reason"], prefix
    else:
        assert chunked["status"] == "pass" and chunked["metrics"]["chunks"] == 3, chunked
        assert prefix["status"] == "pass", prefix
        assert prefix["metrics"]["cached_tokens"] == prefix["metrics"]["shared_tokens"] == 32, prefix["metrics"]
    ladder = next(f for f in doc["findings"] if f["check"] == "configured-ladder")
    assert ladder["status"] == "skip" and "every request agrees" in ladder["reason"]
    assert doc["verdict"] == "healthy", doc["verdict"]
    layers = next(f for f in doc["findings"] if f["check"] == "layer-localization")
    assert layers["status"] == "pass" and layers["metrics"]["points"] > 0  # the chunks' captures, gathered


@pytest.mark.slow
@pytest.mark.parametrize("kind, args, option, failing", [
    ("chunk-offset", EAGER, "chunked_prefill", "a prompt longer than the token budget"),
    ("prefix-cache-collision", EAGER, "prefix_caching", "a request reading another's blocks from the prefix cache"),
    ("compiled-path", "--dtype float32 --max-num-batched-tokens 64 --max-num-seqs 16", "compilation", None),
])
def test_each_planted_fault_is_named_by_its_rung(vllm_python, llama, tmp_path, monkeypatch, kind, args, option, failing):
    """A fault only in one option's code path: the request that reaches it fails, and the ladder names the option
    whose reversal makes the engine agree (the rungs before it are tried and do not); the verdict says so."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    for k, v in plant_env(kind, tmp_path / "plant").items():
        monkeypatch.setenv(k, v)
    doc = diagnose(vllm_python, f"{llama} {args}")
    if failing is not None:
        f = by_target(doc, "configured-requests")[failing]
        assert f["status"] == "fail", f
    ladder = next(f for f in doc["findings"] if f["check"] == "configured-ladder")
    assert ladder["status"] == "fail" and ladder["metrics"]["option"] == option, ladder
    assert ladder["explanation"].startswith(RUNGS[option][1]), ladder["explanation"]
    tried = ladder["metrics"]["options_tried"]
    rungs = [r for r in ladder["evidence"] if "option" in r]  # then the localization
    assert tried[-1] == option and all(r["agrees"] is False for r in rungs[:-1] if r["ran"]) and rungs[-1]["agrees"]
    assert doc["verdict"].startswith("fault found: ") and RUNGS[option][1] in doc["verdict"], doc["verdict"]
    where = ladder["metrics"]["localized"]
    if kind == "prefix-cache-collision":
        words = by_target(doc, "configured-requests")[failing]["explanation"]
        assert "read more tokens from the cache than it shares" in words, words
        assert where["localized"] is False and "not localized" in ladder["explanation"], where  # no capture of a hit
    else:  # RoPE's native pairing (compiled), the later chunks' positions (chunked): q after RoPE of layer 0
        assert where["localized"] and where["layer"] == 0 and where["point"] == "Qcur", where
        assert where["configuration"] == ("as configured" if kind == "chunk-offset" else
                                          "made eager with vLLM's custom ops in their native forms"), where
    if kind == "chunk-offset":  # the RoPE experiment names the step: positions one too far from the second chunk on
        loc = next(f for f in doc["findings"] if f["check"] == "layer-localization")
        cause = loc["metrics"]["error_pattern"]["cause"]
        assert "with the positions from 16 on one later" in cause and "the engine agrees" in cause, cause


@pytest.mark.slow
def test_a_fault_in_every_configuration_is_localized_without_naming_an_option(vllm_python, llama, tmp_path,
                                                                              monkeypatch):
    """q_proj loaded in GGUF's adjacent-pair row order (the tiny Q8_0 GGUF's fault under the GPU plugin) runs in every
    configuration: no rung agrees, the ladder names no option, and says where the fault is: layer 0's Qcur."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    for k, v in plant_env("loader-q-rows", tmp_path / "plant").items():
        monkeypatch.setenv(k, v)
    doc = diagnose(vllm_python, f"{llama} {EAGER}")
    assert doc["verdict"].startswith("fault found"), doc["verdict"]
    ladder = next(f for f in doc["findings"] if f["check"] == "configured-ladder")
    rungs = [r for r in ladder["evidence"] if "option" in r]
    assert ladder["status"] == "pass" and ladder["metrics"]["option"] is None, ladder
    assert rungs and all(r["ran"] and r["agrees"] is False for r in rungs), rungs
    assert "the fault is in the path every configuration runs" in ladder["explanation"], ladder["explanation"]
    where = ladder["metrics"]["localized"]
    assert where["localized"] and where["layer"] == 0 and where["point"] == "Qcur", where
    assert "first divergent layer 0, Qcur-0" in ladder["explanation"], ladder["explanation"]
