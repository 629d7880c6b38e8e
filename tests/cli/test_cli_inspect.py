"""`llmdoctor inspect`: the demo model, the JSON envelope, errors."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from llmdoctor import faults
from llmdoctor.cli import app

runner = CliRunner()


def test_inspect_demo_default_human():
    r = runner.invoke(app, ["inspect"])
    assert r.exit_code == 0, r.output
    assert "gemma3" in r.output and "262144" in r.output and "Q4_K" in r.output


def test_inspect_json_envelope(demo_path):
    r = runner.invoke(app, ["inspect", str(demo_path), "--json", "--tensors"])
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    assert doc["schema"] == "llmdoctor.inspect/1"
    assert doc["exit_code"] == 0 and doc["verdict"] == "parsed"
    assert doc["counts"] == {"passed": 0, "failed": 0, "skipped": 0}
    assert doc["env"]["file"]["sha256"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert doc["env"]["gguf"] == "0.19.0"
    res = doc["result"]
    assert res["architecture"] == "gemma3"
    hp = res["hyperparameters"]
    assert (hp["block_count"], hp["head_count"], hp["head_count_kv"], hp["key_length"]) == (18, 4, 1, 256)
    assert hp["sliding_window"] == 512 and hp["rope_freq_base"] == 1e6
    tok = res["tokenizer"]
    assert (tok["model"], tok["vocab_size"], tok["bos_token"], tok["eos_token"]) == ("llama", 262144, "<bos>", "<eos>")
    ts = res["tensors"]
    assert ts["count"] == 236
    assert {k: v["count"] for k, v in ts["by_type"].items()} == {"F32": 109, "Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10}
    assert ts["parameters"] == sum(r["shape"][0] * (r["shape"][1] if len(r["shape"]) > 1 else 1) for r in res["tensor_table"])
    emb = next(t for t in res["tensor_table"] if t["name"] == "token_embd.weight")
    assert emb["shape"] == [262144, 640] and emb["ne"] == [640, 262144]


def test_inspect_hostile_json_error(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(faults.get("bad-magic").build())
    r = runner.invoke(app, ["inspect", str(path), "--json"])
    assert r.exit_code == 2
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "error" and doc["exit_code"] == 2 and "bad magic" in doc["error"]


def test_nonfinite_numbers_are_strings():
    from llmdoctor.report.envelope import dumps

    doc = json.loads(dumps({"a": float("nan"), "b": [float("inf"), -float("inf")], "c": 1.5}))
    assert doc == {"a": "nan", "b": ["inf", "-inf"], "c": 1.5}


def test_report_write_failure_is_an_input_error(tmp_path):
    import pytest

    from llmdoctor.errors import InputError
    from llmdoctor.report.envelope import check_writable, write_atomic

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(InputError, match="cannot write the report"):
        write_atomic(blocker / "r.json", "{}")
    with pytest.raises(InputError, match="not a writable folder"):
        check_writable(blocker / "r.json")
    write_atomic(tmp_path / "r.json", "{}")
    assert (tmp_path / "r.json").read_text() == "{}" and not list(tmp_path.glob(".*.tmp"))
