"""manifest: per-tensor sha256 and metadata digests; verify / diagnose --manifest name every tensor and key
that differs from the known-good copy; a bad manifest is bad input (exit 2)."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
from typer.testing import CliRunner

from llmdoctor import diagnose as dg
from llmdoctor.diagnose import hypotheses
from llmdoctor.checks.file import manifest as MF
from llmdoctor.cli import app
from llmdoctor.gguf import open_gguf
from split_builders import copy_model

SUBSET = ["blk.0.attn_q.weight", "blk.0.attn_norm.weight", "blk.1.ffn_down.weight", "output_norm.weight"]
ROPE = "gemma3.rope.freq_base"


@pytest.fixture(scope="module")
def known_good(demo_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("manifest")
    path = copy_model(demo_path, d / "good.gguf", only=SUBSET)[0]
    r = CliRunner().invoke(app, ["manifest", str(path), "--out", str(d / "m.json")])
    assert r.exit_code == 0, r.output
    return path, d / "m.json"


def _patched(src, dst, *, tensor: str, key: str, value: float):
    """A copy of src with one byte of `tensor` flipped and the float32 `key` set to `value`."""
    dst.write_bytes(src.read_bytes())
    with open_gguf(dst) as g:
        t, f = g.tensor(tensor), g.fields[key]
        at_byte, at_value = t.offset + t.nbytes // 2, f.offset + 8 + len(key) + 4  # key length, key, type
    mm = np.memmap(dst, np.uint8, "r+")
    mm[at_byte] ^= 0xFF
    mm[at_value : at_value + 4] = np.frombuffer(struct.pack("<f", value), np.uint8)
    mm.flush()
    del mm
    return dst


def test_hashes_are_sha256_of_the_bytes(known_good):
    path, m = known_good
    doc = json.loads(m.read_text())
    with open_gguf(path) as g:
        assert list(doc["tensors"]) == [t.name for t in g.tensors]
        for t in g.tensors:
            assert doc["tensors"][t.name]["sha256"] == hashlib.sha256(t.data.tobytes()).hexdigest()
        assert doc["metadata"][ROPE]["value"] == g.get(ROPE)
        assert not any(k.startswith("split.") for k in doc["metadata"])


def test_verify_manifest_names_every_difference(known_good, tmp_path):
    path, m = known_good
    bad = _patched(path, tmp_path / "bad.gguf", tensor="blk.1.ffn_down.weight", key=ROPE, value=10000.0)
    r = CliRunner().invoke(app, ["verify", str(bad), "--manifest", str(m), "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 1
    failed = {f["target"]: f for f in doc["findings"] if f["check"] == "manifest" and f["status"] == "fail"}
    assert set(failed) == {"tensor/blk.1.ffn_down.weight", f"metadata/{ROPE}"}
    assert failed[f"metadata/{ROPE}"]["metrics"] == {"manifest": 1000000.0, "file": 10000.0}


def test_diagnose_manifest_in_file_integrity(known_good, tmp_path):
    path, m = known_good
    bad = _patched(path, tmp_path / "bad.gguf", tensor="blk.0.attn_q.weight", key=ROPE, value=1.0)
    s = dg.Session(dg.Inputs(gguf=bad, manifest=m))
    with open_gguf(bad) as g:
        found = hypotheses._manifest_findings(s, g)
    assert {f.target for f in found if f.status == "fail"} == {"tensor/blk.0.attn_q.weight", f"metadata/{ROPE}"}
    with open_gguf(path) as g:
        assert [f.status for f in hypotheses._manifest_findings(dg.Session(dg.Inputs(gguf=path, manifest=m)), g)] == ["pass"]


@pytest.mark.parametrize("cmd", [["verify"], ["diagnose", "--gguf"]])
def test_bad_manifest_is_bad_input(known_good, tmp_path, cmd):
    path, _ = known_good
    (tmp_path / "x.json").write_text('{"schema": "something else"}')
    r = CliRunner().invoke(app, [*cmd, str(path), "--manifest", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and "not an llmdoctor manifest" in r.stderr


def test_manifest_to_stdout_is_one_json_object(known_good):
    path, m = known_good
    r = CliRunner().invoke(app, ["manifest", str(path)])
    assert r.exit_code == 0 and json.loads(r.stdout) == json.loads(m.read_text())
    assert MF.load(m)["schema"] == MF.SCHEMA


def test_verify_manifest_out_is_the_manifest_commands(known_good, tmp_path):
    """`verify --manifest-out` writes, from the hashes of its own pass, the document `manifest` writes."""
    path, m = known_good
    r = CliRunner().invoke(app, ["verify", str(path), "--manifest-out", str(tmp_path / "v.json"), "--json"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "v.json").read_text() == m.read_text()
    doc = json.loads(m.read_text())
    assert {t["name"]: t["sha256"] for t in json.loads(r.stdout)["tensors"]} == \
           {n: t["sha256"] for n, t in doc["tensors"].items()}
