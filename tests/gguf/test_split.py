"""Split GGUF models: any shard opens the whole set as one model; hostile sets are one-line errors; every
command gives the same answers on a split set as on its unsplit file."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from gguf import Keys

from typer.testing import CliRunner

from llmdoctor import faults
from llmdoctor.cli import app
from llmdoctor.gguf import GGUFError, open_gguf
from llmdoctor.gguf.split import first_shard
from llmdoctor.gguf.summary import summarize
from split_builders import copy_model

HOSTILE_SETS = faults.all_faults("hostile-split")
# A few tensors of each kind the demo holds (small ones; the Q8_0 embedding would take the time).
SUBSET = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_norm.weight", "blk.0.ffn_down.weight",
          "blk.1.attn_q.weight", "blk.1.ffn_down.weight", "blk.2.attn_output.weight", "output_norm.weight"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The command in a child process (stderr on its own, as a user sees it)."""
    return subprocess.run([sys.executable, "-m", "llmdoctor.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def run_json(*args: str) -> tuple[int, dict]:
    """The command in this process (no interpreter start-up): exit code and its one JSON object."""
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, json.loads(r.stdout)


@pytest.fixture(scope="module")
def demo_split(demo_path, tmp_path_factory):
    """The whole demo model in 4 shards (gguf-split's layout, written by gguf-py's writer)."""
    d = tmp_path_factory.mktemp("demo_split")
    n = len(open_gguf(demo_path).tensors)
    return copy_model(demo_path, d / "demo.gguf", max_tensors=-(-n // 4))


@pytest.fixture(scope="module")
def subset(demo_path, tmp_path_factory):
    """SUBSET of the demo's tensors with all its metadata: unsplit, and in 3 shards."""
    d = tmp_path_factory.mktemp("subset")
    whole = copy_model(demo_path, d / "whole.gguf", only=SUBSET)[0]
    return whole, copy_model(demo_path, d / "part.gguf", only=SUBSET, max_tensors=3)


def test_writer_lays_out_shards_as_gguf_split(demo_split):
    assert [p.name for p in demo_split] == [f"demo-0000{i}-of-00004.gguf" for i in range(1, 5)]
    total = 0
    for i, p in enumerate(demo_split):
        with open(p, "rb"):
            pass
        from llmdoctor.gguf.reader import GGUFFile

        g = GGUFFile(p)  # one shard alone
        assert g.get(Keys.Split.LLM_KV_SPLIT_NO) == i and g.get(Keys.Split.LLM_KV_SPLIT_COUNT) == 4
        assert (len(g.fields) > 3) == (i == 0)  # the model's metadata in the first shard only
        total += len(g.file_tensors)
        g.close()
    with open_gguf(demo_split[0]) as g:
        assert g.get(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT) == total


@pytest.mark.parametrize("which", [0, 2, 3])
def test_any_shard_opens_the_whole_model(demo_path, demo_split, which):
    with open_gguf(demo_path) as a, open_gguf(demo_split[which]) as b:
        assert b.path == str(demo_split[0]) and [s.path for s in b.shards] == list(map(str, demo_split))
        assert [t.name for t in b.tensors] == [t.name for t in a.tensors]
        for name in ("token_embd.weight", "blk.17.ffn_down.weight", "output_norm.weight"):
            ta, tb = a.tensor(name), b.tensor(name)
            assert (ta.type, ta.ne) == (tb.type, tb.ne) and np.array_equal(ta.data, tb.data)
        assert {k for k in a.fields} == {k for k in b.fields} - {Keys.Split.LLM_KV_SPLIT_NO,
                                                                  Keys.Split.LLM_KV_SPLIT_COUNT,
                                                                  Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT}
        assert b.total_size == sum(p.stat().st_size for p in demo_split)
    assert first_shard(demo_split[2]) == demo_split[0]


def test_inspect_same_answers_and_shows_shards(demo_path, demo_split):
    with open_gguf(demo_path) as a, open_gguf(demo_split[1]) as b:
        sa, sb = summarize(a, tensors=True), summarize(b, tensors=True)
    assert [s["tensors"] for s in sb["shards"]] == [len(open_gguf(p).file_tensors) for p in demo_split]
    assert sum(s["tensors"] for s in sb["shards"]) == sa["tensors"]["count"]
    assert sb["file"]["size"] == sum(s["bytes"] for s in sb["shards"])
    for k in ("architecture", "name", "hyperparameters", "tokenizer", "tensors"):
        assert sa[k] == sb[k], k
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("file", "offset")} for r in rows]  # noqa: E731
    assert strip(sa["tensor_table"]) == strip(sb["tensor_table"])
    p = cli("inspect", str(demo_split[2]))
    assert p.returncode == 0, p.stderr
    assert "demo-00004-of-00004.gguf" in p.stdout and "Shards" in p.stdout


@pytest.mark.slow
def test_commands_same_answers_on_split_subset(subset, tmp_path):
    whole, parts = subset
    # verify: the same per-tensor numbers
    runs = [run_json("verify", str(p), "--json") for p in (whole, parts[1])]
    assert [code for code, _ in runs] == [0, 0]
    strip = lambda r: [{k: v for k, v in t.items() if k not in ("shard", "offset", "first_bad_offset")}  # noqa: E731
                       for t in r["tensors"]]
    assert strip(runs[0][1]) == strip(runs[1][1]) and len(runs[0][1]["tensors"]) == len(SUBSET)
    # manifest: one manifest for both; verify --manifest accepts the split set against it
    r = CliRunner().invoke(app, ["manifest", str(parts[2]), "--out", str(tmp_path / "m.json")])
    assert r.exit_code == 0, r.output
    assert run_json("manifest", str(whole))[1] == json.loads((tmp_path / "m.json").read_text())
    code, doc = run_json("verify", str(parts[0]), "--manifest", str(tmp_path / "m.json"), "--json")
    assert code == 0 and any(f["check"] == "manifest" and f["status"] == "pass" for f in doc["findings"])
    # diff: a split set and its unsplit file are the same model
    code, doc = run_json("diff", str(whole), str(parts[1]), "--json")
    assert code == 0 and doc["verdict"] == "same", doc["findings"]
    # check dequant: the same tensors checked, the same verdict
    outs = [run_json("check", "dequant", str(x), "--blocks", "4", "--kernel", "native", "--json") for x in (whole, parts[2])]
    assert [code for code, _ in outs] == [0, 0]
    assert sorted(f["target"] for f in outs[0][1]["findings"]) == sorted(f["target"] for f in outs[1][1]["findings"])


def test_reference_logits_same_on_split(demo_path, demo_split):
    """The reference forward pass reads its weights from every shard: the same logits, bit for bit."""
    runs = [run_json("logits", "Paris is", "--gguf", str(p), "--top", "5", "--json") for p in (demo_path, demo_split[3])]
    assert [code for code, _ in runs] == [0, 0] and runs[0][1]["result"] == runs[1][1]["result"]


@pytest.mark.parametrize("fault", HOSTILE_SETS, ids=lambda f: f.name)
def test_hostile_shard_set_is_one_line_naming_the_shard(tmp_path, fault):
    sset = fault.build()
    for name, data in sset.files.items():
        (tmp_path / name).write_bytes(data)
    t0 = time.perf_counter()
    old = signal.signal(signal.SIGALRM, lambda *a: pytest.fail(f"{fault.name}: no verdict within 5 s"))
    signal.setitimer(signal.ITIMER_REAL, 5)
    try:
        with pytest.raises(GGUFError) as exc:
            open_gguf(tmp_path / sset.open)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    msg = str(exc.value)
    assert fault.expect in msg and msg.startswith(str(tmp_path / sset.culprit)), msg
    assert "\n" not in msg and time.perf_counter() - t0 < 5


def test_hostile_set_cli_exit_2(tmp_path):
    sset = faults.get("split-no-duplicate").build()
    for name, data in sset.files.items():
        (tmp_path / name).write_bytes(data)
    p = cli("inspect", str(tmp_path / sset.open))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert str(tmp_path / sset.culprit) in lines[0] and "split.no" in lines[0], p.stderr
    for cmd in ("verify", "manifest", "diff"):
        r = CliRunner().invoke(app, [cmd, str(tmp_path / sset.open)] + ([str(tmp_path / sset.open)] if cmd == "diff" else []))
        assert r.exit_code == 2 and str(tmp_path / sset.culprit) in r.stderr and "split.no" in r.stderr, (cmd, r.output)


def test_shard_sets_in_the_corpus():
    names = {f.name for f in HOSTILE_SETS}
    assert {"split-missing-shard", "split-count-mismatch", "split-no-duplicate", "split-tensor-twice",
            "split-tensors-count-wrong", "split-shard-hostile"} <= names
