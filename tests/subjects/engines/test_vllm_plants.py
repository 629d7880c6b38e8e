"""tests/vllm_plants.py's planted faults checked directly against vLLM for CPU (LLMDOCTOR_VLLM_PYTHON): each
plant, in the interpreter its environment starts, makes the engine disagree with the unplanted engine under
the configuration it targets and agree under the rung that reverts that option (issue 34, item 4). The
vLLM parts run in vLLM's interpreter (vllm_plants.py as a script: LLM(...) configured by vLLM's own parser
from `vllm serve` arguments, one engine after another in a process); 4 processes, 15 engine starts.

Budgets: AGREE is the float32 compile-vs-eager noise of this tiny model measured at 4.9e-5 to 6.9e-5 (max abs
logprob, same engine otherwise; eager runs of the same path are bit-identical), times 14; DISAGREE is 6x
below the smallest planted difference measured (6.5). Both far from each other, so neither is tuned."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

import vllm_plants
from test_engine_vllm import vllm_checkpoint

pytestmark = pytest.mark.slow

AGREE, DISAGREE = 1e-3, 1.0
VOCAB = 96
BASE = "--skip-tokenizer-init --dtype float32 --max-model-len 256 --block-size 32 --kv-cache-memory-bytes 268435456"
EAGER, B32 = BASE + " --enforce-eager", " --max-num-batched-tokens 32"
RUNS = {  # name -> the `vllm serve` arguments after the model
    "compiled": BASE, "eager": EAGER, "O0": BASE + " -O0",
    "custom-ops-all": BASE + """ --compilation-config '{"custom_ops": ["all"]}'""",
    "eager-no-pc": EAGER + " --no-enable-prefix-caching",
    "eager-b32": EAGER + B32, "eager-b32-no-pc": EAGER + B32 + " --no-enable-prefix-caching",
    "compiled-b32": BASE + B32,
}


def _requests() -> list[dict]:
    """A: 100 tokens, prompt logprobs (vLLM does not read the prefix cache for it, it writes it), 4 steps.
    B: A's first 32-token block, then 68 other tokens, 4 steps: it reads block 0 legitimately; its blocks
    1-2 (full, before its last token) sit where A's differ."""
    rng = random.Random(0)
    a = [rng.randrange(3, VOCAB) for _ in range(100)]
    b = a[:32] + [rng.randrange(3, VOCAB) for _ in range(68)]
    return [{"prompt": a, "max_tokens": 4, "prompt_logprobs": True}, {"prompt": b, "max_tokens": 4}]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return vllm_checkpoint("llama", tmp_path_factory.mktemp("vllm-plants"))[0]


def run_vllm(vllm_python: str, model: Path, names: list[str], work: Path, env: dict[str, str]) -> dict:
    """{run name: run} of vllm_plants.py's runner in vLLM's interpreter with `env` added."""
    work.mkdir(parents=True, exist_ok=True)
    spec = {"model": str(model), "vocab": VOCAB, "requests": _requests(),
            "runs": [{"name": n, "args": RUNS[n]} for n in names]}
    (work / "spec.json").write_text(json.dumps(spec))
    p = subprocess.run([vllm_python, vllm_plants.__file__, str(work / "spec.json"), str(work / "out.json")],
                       env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads((work / "out.json").read_text())
    assert out["plant"] == (Path(env["PYTHONPATH"].split(os.pathsep)[0], vllm_plants.KIND_FILE).read_text()
                            if env else None)
    return {r["name"]: r for r in out["runs"]}


def diff(a: dict, b: dict) -> list[float]:
    """Per request, the max abs logprob difference over the full vocabulary: the prompt's positions, and the
    generated steps up to the first that chose another token (its distribution included)."""
    out = []
    for qa, qb in zip(a["requests"], b["requests"]):
        rows = list(zip(qa["prompt_logprobs"], qb["prompt_logprobs"])) if qa["prompt_logprobs"] else []
        for s, (ta, tb) in enumerate(zip(qa["ids"], qb["ids"])):
            rows.append((qa["logprobs"][s], qb["logprobs"][s]))
            if ta != tb:
                break
        out.append(max(abs(x - y) for ra, rb in rows for x, y in zip(ra, rb)))
    return out


@pytest.fixture(scope="module")
def healthy(vllm_python, llama, tmp_path_factory) -> dict:
    """The unplanted engine under every configuration the plants use; each agrees with eager."""
    runs = run_vllm(vllm_python, llama, ["eager", "compiled", "custom-ops-all", "eager-no-pc", "eager-b32",
                                         "compiled-b32"], tmp_path_factory.mktemp("healthy"), {})
    for name, r in runs.items():
        assert max(diff(r, runs["eager"])) <= AGREE, (name, diff(r, runs["eager"]))
        assert r["fired"] == {}
    return runs


def planted(kind: str, names: list[str], vllm_python, llama, tmp_path) -> dict:
    return run_vllm(vllm_python, llama, names, tmp_path / "run", vllm_plants.plant_env(kind, tmp_path / "site"))


def test_plant_env_puts_its_folder_first(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = vllm_plants.plant_env("chunk-offset", tmp_path / "p")
    assert env == {"PYTHONPATH": f"{tmp_path / 'p'}:/somewhere"}
    assert (tmp_path / "p" / "sitecustomize.py").read_bytes() == Path(vllm_plants.__file__).read_bytes()
    with pytest.raises(ValueError, match="unknown vLLM plant"):
        vllm_plants.plant_env("nope", tmp_path / "q")


def test_compiled_path_is_wrong_compiled_and_right_with_custom_ops(vllm_python, llama, healthy, tmp_path):
    """RotaryEmbedding's native form broken: compiled (custom ops "none": forward_native traced) disagrees;
    --enforce-eager and -O0 (custom ops "all": forward_cpu) are bit-identical to the unplanted eager engine;
    compiled with custom ops "all" agrees too (so the rung is the custom ops, not compilation itself)."""
    runs = planted("compiled-path", ["compiled", "eager", "O0", "custom-ops-all"], vllm_python, llama, tmp_path)
    assert runs["compiled"]["config"]["rotary_embedding_custom_op"] == "disabled"
    assert runs["compiled"]["fired"] == {"RotaryEmbedding.forward_native": 2}  # traced once per layer
    assert min(diff(runs["compiled"], healthy["compiled"])) > DISAGREE
    for name in ("eager", "O0"):
        assert runs[name]["config"]["rotary_embedding_custom_op"] == "enabled" and runs[name]["fired"] == {}
        assert max(diff(runs[name], healthy["eager"])) == 0.0
    assert max(diff(runs["custom-ops-all"], healthy["custom-ops-all"])) == 0.0


def test_prefix_cache_collision_serves_another_block_only_with_prefix_caching(vllm_python, llama, healthy, tmp_path):
    """Block hashes blind to the tokens: B reads A's blocks 1-2 (96 cached tokens where 32 are A's and B's
    own) and its steps disagree; A (prompt logprobs: vLLM does not read the cache for it) agrees; with
    --no-enable-prefix-caching all agree."""
    runs = planted("prefix-cache-collision", ["eager", "eager-no-pc"], vllm_python, llama, tmp_path)
    assert [q["cached_tokens"] for q in healthy["eager"]["requests"]] == [0, 32]
    assert [q["cached_tokens"] for q in runs["eager"]["requests"]] == [0, 96]
    a, b = diff(runs["eager"], healthy["eager"])
    assert a == 0.0 and b > DISAGREE
    assert max(diff(runs["eager-no-pc"], healthy["eager-no-pc"])) == 0.0


def test_chunk_offset_is_wrong_only_in_later_prefill_chunks(vllm_python, llama, healthy, tmp_path):
    """Later prefill chunks' positions one too far: with a 32-token budget both 100-token prompts disagree,
    eager and compiled alike (the positions are an input of the compiled graph); with prefix caching off too
    (not a prefix-cache fault); a budget that holds the prompt (LLM()'s default 4096) agrees bit for bit."""
    runs = planted("chunk-offset", ["eager-b32", "eager-b32-no-pc", "compiled-b32", "eager"], vllm_python, llama,
                   tmp_path)
    for name in ("eager-b32", "eager-b32-no-pc", "compiled-b32"):
        assert min(diff(runs[name], healthy[name if name in healthy else "eager-b32"])) > DISAGREE, name
        assert runs[name]["fired"]["GPUModelRunner._prepare_inputs"] >= 5
    assert runs["eager"]["fired"] == {} and max(diff(runs["eager"], healthy["eager"])) == 0.0
