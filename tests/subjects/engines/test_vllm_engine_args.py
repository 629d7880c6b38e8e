"""The deployment's own `vllm serve` arguments (issue 34, item 1), run for real with vLLM for CPU
(LLMDOCTOR_VLLM_PYTHON; without it these tests skip, in CI they fail): parsed by vLLM's own parser in its
interpreter, bad arguments refused in its words (exit 2), the engine run as they say with its resolved
configuration beside vLLM's defaults, and a tokenizer-only --tokenizer folder beside a GGUF (the
vllm-gguf-plugin reads a GGUF's config.json from the tokenizer folder)."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

import fixtures_hf
from llmdoctor.cli import app
from llmdoctor.subjects.engines import create
from llmdoctor.subjects.engines.base import Deployment
from llmdoctor.subjects.engines.vllm_args import split
from test_engine_vllm import vllm_checkpoint

pytestmark = pytest.mark.slow

WORDS = ["<s>", "<unk>", *(f"w{i}" for i in range(94))]  # the tiny models' 96 tokens as words
TOKENS = list(range(3, 40))  # 37 positions: more than the 16-token chunked-prefill budget below


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the tiny qwen2 checkpoint, a folder holding its F32 GGUF alone, a folder holding tokenizer files only)."""
    out = tmp_path_factory.mktemp("vllm-args")
    ckpt, gguf = vllm_checkpoint("qwen2", out / "models")
    lone = out / "lone"
    lone.mkdir()
    shutil.copyfile(gguf, lone / "qwen2.gguf")
    tok = out / "tokenizer-only"
    tok.mkdir()
    fixtures_hf.with_tokenizer(tok, WORDS)
    assert sorted(p.name for p in tok.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    return ckpt, lone / "qwen2.gguf", tok


def diagnose(*args: str):
    return CliRunner().invoke(app, ["diagnose", *args, "--token-ids", ",".join(map(str, TOKENS)), "--generate", "0",
                                    "--json"])


def test_split_as_the_shell_does_and_drops_a_pasted_vllm_serve():
    assert split("vllm serve 'my model' --max-model-len 64") == ["my model", "--max-model-len", "64"]
    assert split("--enforce-eager") == ["--enforce-eager"]


def test_engine_args_are_for_an_engine_that_takes_them():
    """No --engine, or an engine without a serve parser: bad input before any work (no vLLM needed)."""
    for engine, words in (([], "name the engine they are for (--engine vllm)"),
                          (["--engine", "llama.cpp"], "llama.cpp takes none (they are `vllm serve` arguments")):
        r = diagnose(*engine, "--engine-args", "--enforce-eager")
        assert r.exit_code == 2 and words in json.loads(r.stdout)["error"], r.output[-2000:]


def test_bad_arguments_are_one_line_quoting_vllm_exit_2(vllm_python, models, tmp_path):
    """An unknown flag (vLLM's parser's own error line) and a named model that does not exist (vLLM's own lookup
    error), before any work: exit 2, one line."""
    ckpt, _, _ = models
    for args, words in ((f"{ckpt} --no-such-flag", "unrecognized arguments: --no-such-flag"),
                        (f"{tmp_path / 'missing.gguf'} --enforce-eager", "missing.gguf': no such file or folder")):
        r = diagnose("--engine", "vllm", "--engine-python", vllm_python, "--engine-args", args)
        assert r.exit_code == 2, r.output[-2000:]
        error = json.loads(r.stdout)["error"]
        assert error.startswith("--engine-args: ") and words in error and "\n" not in error, error
        assert r.output.strip().splitlines()[-1] == f"error: {error}"


def test_a_tokenizer_only_folder_serves_a_gguf_front_end(vllm_python, models):
    """vLLM's front end for a GGUF with --tokenizer naming a folder of tokenizer files only: the vllm-gguf-plugin
    reads the GGUF's config.json from the tokenizer folder, and vLLM refused it ("Unrecognized model in DIR");
    with the config read beside the GGUF (--hf-config-path, as a deployment serving that folder passes) it
    tokenizes with that folder's tokenizer."""
    _, gguf, tok = models
    from transformers import AutoTokenizer

    engine = create("vllm", Deployment(model=gguf, tokenizer=tok, python=vllm_python))
    try:
        texts, _ = engine.tokenize_all(["w1 w2 w3 w90"], [])
    finally:
        engine.close()
    assert texts == [AutoTokenizer.from_pretrained(tok)("w1 w2 w3 w90")["input_ids"]] == [[0, 3, 4, 5, 92]]
    assert engine.front_end()["tokenizer"] == str(tok)


def test_the_engine_runs_as_the_arguments_say_and_reports_how(vllm_python, models, monkeypatch):
    """`diagnose --engine vllm --engine-args "GGUF --tokenizer DIR --max-num-batched-tokens 16
    --enable-prefix-caching --enforce-eager --dtype float32"` (the arguments naming the model and a
    tokenizer-only folder, relative to the caller's directory): the engine loads them as vLLM parses them (the
    GGUF's config read beside it, not from the tokenizer folder), chunked prefill splits the 37-token prompt, the
    run agrees with the reference, and the run info shows the resolved configuration and how it differs from
    vLLM's defaults for the model; the VLLM_* variables set are listed. (Eager: vLLM for CPU's default
    torch.compile adds ~40 s to the load; notes/vllm-engine-args.md has it measured.)"""
    _, gguf, tok = models
    monkeypatch.chdir(gguf.parent.parent)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    args = f"{gguf.parent.name}/{gguf.name} --tokenizer {tok.name} --max-num-batched-tokens 16 --enable-prefix-caching " \
           "--enforce-eager --dtype float32"
    r = diagnose("--engine", "vllm", "--engine-python", vllm_python, "--engine-args", args)
    doc = json.loads(r.stdout)
    run = doc["engine_run"]
    config = run["engine_config"]
    assert config["engine_args"] == args.split()
    resolved, differs = config["resolved"], config["differs"]
    assert resolved["max_num_batched_tokens"] == 16 and resolved["chunked_prefill"] is True
    assert resolved["prefix_caching"] is True and resolved["dtype"] == "float32"
    assert differs["max_num_batched_tokens"] == {"default": config["defaults"]["max_num_batched_tokens"], "deployed": 16}
    assert differs["enforce_eager"] == {"default": False, "deployed": True}
    assert differs["compilation_mode"]["deployed"] == "NONE" != differs["compilation_mode"]["default"]
    assert config["llmdoctor_sets"]["skip_tokenizer_init"] is True
    assert config["env"]["read"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert run["model"].endswith("/qwen2.gguf") and "config.json written by llmdoctor" in run["model_folder"]
    # the compute agrees; the front end the arguments name (their --tokenizer) has nothing to be compared with in
    # this tiny GGUF (it carries no tokenizer): a named subject that could not run, exit 2 for that alone
    f = {x["check"]: x for x in doc["findings"]}["engine-vs-reference"]
    assert f["status"] == "pass" and doc["counts"]["failed"] == 0, f
    assert r.exit_code == 2 and doc["verdict"].startswith("could not diagnose: front-end could not run: no front end "
                                                          "to compare against"), doc["verdict"]


def test_the_terminal_report_shows_the_resolved_configuration_and_what_differs():
    """The report's table of the engine_config block (no vLLM needed); absent without one."""
    from rich.console import Console

    from llmdoctor.report.diagnosis import render

    config = {"resolved": {"compilation_mode": "NONE", "max_num_batched_tokens": 16, "kv_cache_dtype": "auto"},
              "defaults": {"compilation_mode": "DYNAMO_TRACE_ONCE", "max_num_batched_tokens": 2048, "kv_cache_dtype": "auto"},
              "differs": {"compilation_mode": {}, "max_num_batched_tokens": {}},
              "llmdoctor_sets": {"skip_tokenizer_init": True}, "env": {"read": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}}}
    doc = {"exit_code": 0, "verdict": "healthy", "counts": {"passed": 0, "failed": 0, "skipped": 0}, "findings": []}
    shown = []
    for engine_run in ({"engine_config": config}, {}):
        console = Console(record=True, width=200)
        render({**doc, "engine_run": engine_run}, console)
        shown.append(console.export_text())
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
            for line in shown[0].splitlines() if line.count("│") >= 4}
    assert rows["max_num_batched_tokens"] == ["16", "2048"] and rows["kv_cache_dtype"] == ["auto", ""]
    assert rows["compilation_mode"] == ["NONE", "DYNAMO_TRACE_ONCE"]
    assert "VLLM_CPU_OMP_THREADS_BIND=nobind" in shown[0] and "Engine configuration" not in shown[1]
