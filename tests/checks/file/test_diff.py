"""diff: the same model (also split vs unsplit: test_split.py) exits 0; a changed key, a changed block, a
removed tensor are each named with both sides' values and the first differing block; a GGUF against
its HF checkpoint goes through the name map and the mapping band."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import fixtures_mla as fx
from llmdoctor.checks.file import diff as D
from llmdoctor.cli import app
from llmdoctor.gguf import open_gguf
from split_builders import copy_model

SUBSET = ["blk.0.attn_q.weight", "blk.0.attn_norm.weight", "blk.1.ffn_down.weight", "output_norm.weight"]
ROPE = "gemma3.rope.freq_base"
CHANGED = "blk.1.ffn_down.weight"


@pytest.fixture(scope="module")
def pair(demo_path, tmp_path_factory):
    """A: a demo subset; B: A with one key changed, one byte of CHANGED flipped; C: A less a tensor."""
    d = tmp_path_factory.mktemp("diff")
    a = copy_model(demo_path, d / "a.gguf", only=SUBSET)[0]
    c = copy_model(demo_path, d / "c.gguf", only=SUBSET[:-1])[0]
    b = d / "b.gguf"
    b.write_bytes(a.read_bytes())
    with open_gguf(b) as g:
        t, f = g.tensor(CHANGED), g.fields[ROPE]
        byte, value_at = t.offset + t.nbytes // 2, f.offset + 8 + len(ROPE) + 4
    mm = np.memmap(b, np.uint8, "r+")
    mm[byte] ^= 0x55
    mm[value_at : value_at + 4] = np.frombuffer(struct.pack("<f", 10000.0), np.uint8)
    mm.flush()
    del mm
    return a, b, c, byte


def test_same_file_is_the_same_model(pair):
    a = pair[0]
    r = CliRunner().invoke(app, ["diff", str(a), str(a), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["verdict"] == "same"


def test_changed_key_and_block_named(pair):
    a, b, _, byte = pair
    res = D.run(a, b)
    failed = {f.target: f for f in res.findings if f.status == "fail"}
    assert set(failed) == {f"metadata/{ROPE}", f"tensor/{CHANGED}"}
    assert failed[f"metadata/{ROPE}"].metrics == {"a": 1000000.0, "b": 10000.0}
    m = failed[f"tensor/{CHANGED}"].metrics
    with open_gguf(a) as g:
        t = g.tensor(CHANGED)
        block = (byte - t.offset) // t.type_size
        assert m["first_differing_block"]["a"] == {"block": block, "offset": t.offset + block * t.type_size, "file": str(a)}
    assert 0 < m["rel_l2"] < 1 and m["max_abs_diff"] > 0 and m["a"]["sha256"] != m["b"]["sha256"]


def test_removed_tensor_and_exit_1(pair):
    a, _, c, _ = pair
    r = CliRunner().invoke(app, ["diff", str(a), str(c)])
    assert r.exit_code == 1 and f"{SUBSET[-1]} removed in B" in r.stdout
    r = CliRunner().invoke(app, ["diff", str(c), str(a), "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and any("added in B" in f["explanation"] for f in doc["findings"])


def test_missing_input_is_exit_2(pair, tmp_path):
    r = CliRunner().invoke(app, ["diff", str(pair[0]), str(tmp_path / "nope.gguf")])
    assert r.exit_code == 2 and "no such file" in r.stderr


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    f = fx.build("deepseek", d)
    return f.gguf_path, d / "hf-deepseek"


def test_gguf_against_its_hf_checkpoint(tiny_hf, tmp_path):
    gguf_path, hf = tiny_hf
    res = D.run(gguf_path, hf)
    assert res.kind == "hf" and any(f.target.startswith("numeric/") for f in res.findings)
    assert not [f.explanation for f in res.findings if f.status == "fail"]
    # the same file with one tensor's values negated differs from the checkpoint: named, exit 1
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(gguf_path.read_bytes())
    with open_gguf(bad) as g:
        t = next(t for t in g.tensors if t.name.endswith("attn_output.weight") and t.type.name == "F32")
        off, n = t.offset, t.nbytes
    mm = np.memmap(bad, np.uint8, "r+")
    mm[off : off + n] = (-torch.from_numpy(np.frombuffer(mm[off : off + n].tobytes(), np.float32))).numpy().view(np.uint8)
    mm.flush()
    del mm
    r = CliRunner().invoke(app, ["diff", str(bad), str(hf), "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 1
    assert [f["target"] for f in doc["findings"] if f["status"] == "fail"] == [f"numeric/{t.name}"]


def test_big_endian_tensors_compared_by_bytes_not_decoded(tmp_path):
    from gguf import GGMLQuantizationType as Q

    from gguf_builders import write_file

    a, b = (write_file(tmp_path / f"{n}.gguf", metadata=False, big_endian=True,
                       tensors={"h": (Q.F16, (64,), np.full(64, v, np.float16))}) for n, v in (("a", 1), ("b", 2)))
    (f,) = [f for f in D.run(a, b).findings if f.status == "fail"]
    assert f.target == "tensor/h" and "not decoded: a big-endian file" in f.explanation
