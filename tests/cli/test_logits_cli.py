"""`llmdoctor logits`: top-K, prompt logprobs, greedy continuation, the JSON envelope, errors."""

from __future__ import annotations

import json
import math

from typer.testing import CliRunner

from llmdoctor.cli import app

runner = CliRunner()


def test_logits_json_greedy_and_prompt_logprobs(demo_path):
    r = runner.invoke(app, ["logits", "1 2 3 4 5 6 7 8 9 10", "--gguf", str(demo_path), "--greedy", "3",
                            "--top", "3", "--prompt-logprobs", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["schema"] == "llmdoctor.logits/1" and doc["verdict"] == "computed" and doc["exit_code"] == 0
    res = doc["result"]
    assert res["tokens"][0]["id"] == 2  # BOS from the file's metadata
    assert res["greedy"]["text"].startswith(" 11")
    assert [s["text"] for s in res["greedy"]["steps"]] == [" ", "1", "1"]
    assert all(len(s["top"]) == 3 and s["top"][0]["id"] == s["id"] for s in res["greedy"]["steps"])
    nxt = [c["logprob"] for c in res["next"]]
    assert nxt == sorted(nxt, reverse=True) and all(v <= 0 for v in nxt) and len(nxt) == 3
    pl = res["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(res["tokens"])
    assert all(p["rank"] >= 1 and p["logprob"] <= 0 and math.isfinite(p["logprob"]) for p in pl[1:])
    # counting is easy: once the pattern is set, each next number's digits are the top choice
    assert pl[-2]["rank"] == 1 and pl[-1]["rank"] == 1
    stats = res["stats"]
    assert [s["layer"] for s in stats] == list(range(-1, 19)) and all(s["n_nan"] == 0 for s in stats)


def test_logits_human_default_model():
    r = runner.invoke(app, ["logits", "1 2 3 4 5", "--top", "2"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0] == "prompt: 10 tokens" and lines[1] == "next token:" and "' ' (236743)" in lines[2]
    assert len(lines) == 4


def test_logits_bad_dtype_is_one_line_exit_2():
    r = runner.invoke(app, ["logits", "hi", "--dtype", "float8"])
    assert r.exit_code == 2
    assert "--dtype must be one of" in r.output and "Traceback" not in r.output


def test_logits_missing_file_json_error(tmp_path):
    r = runner.invoke(app, ["logits", "hi", "--gguf", str(tmp_path / "nope.gguf"), "--json"])
    assert r.exit_code == 2
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "error" and doc["exit_code"] == 2 and "nope.gguf" in doc["error"]
