"""verify --gpus N on CPU: N gloo processes each verify their share of the tensors (contiguous by
bytes), rank 0 gathers them into the report one process gives; a planted bad block in the last
rank's share is found with the same block and file offset."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from llmdoctor import faults
from llmdoctor.checks.file import verify as V
from llmdoctor.checks.file import verify_ranks as VR
from llmdoctor.gguf import open_gguf
from split_builders import copy_model

SUBSET = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_norm.weight", "blk.1.attn_q.weight",
          "blk.1.ffn_down.weight", "output_norm.weight"]
BAD = "blk.1.ffn_down.weight"


@pytest.fixture(scope="module")
def planted(demo_path, tmp_path_factory):
    sub = copy_model(demo_path, tmp_path_factory.mktemp("vr") / "sub.gguf", only=SUBSET)[0]
    return faults.get("scale-inf").build(sub, tmp_path_factory.mktemp("vr-planted"), tensor=BAD, block=5)


def test_shares_are_contiguous_runs_of_equal_bytes(demo_path):
    with open_gguf(demo_path) as g:
        order = sorted(g.tensors, key=lambda t: t.offset)
        total, largest = sum(t.nbytes for t in order), max(t.nbytes for t in order)
        size = {t.name: t.nbytes for t in order}
    for n in (1, 2, 4, 8):
        parts = VR.shares(demo_path, n)
        assert [name for p in parts for name in p] == [t.name for t in order]
        assert all(abs(sum(size[x] for x in p) - total / n) <= largest for p in parts)


@pytest.mark.slow
def test_two_ranks_give_the_one_process_report(planted, tmp_path):
    """Through the CLI (one launch): the JSON's tensors and findings are the one-process run's."""
    from llmdoctor.cli import app

    one = V.run(planted)
    out = tmp_path / "v.json"
    r = CliRunner().invoke(app, ["verify", str(planted), "--gpus", "2", "--json-out", str(out)])
    assert r.exit_code == 1, r.output
    doc = json.loads(out.read_text())
    assert doc["ranks"] == 2 and doc["totals"]["bytes"] == one.bytes
    assert doc["tensors"] == json.loads(json.dumps([t.__dict__ for t in one.tensors]))
    assert [(f["check"], f["target"], f["status"]) for f in doc["findings"]] == \
        [(f.check, f.target, f.status) for f in one.findings]
    assert BAD in VR.shares(planted, 2)[1]  # the bad block is found by the second rank
    (bad,) = [t for t in doc["tensors"] if t["non_finite"]]
    assert bad["name"] == BAD and bad["first_bad_block"] == 5


@pytest.mark.gpu
def test_two_gpus_give_the_one_process_report(planted):
    """NCCL, one GPU per rank: the same report as one GPU."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("skipped: needs 2 CUDA GPUs")
    one, two = V.run(planted, device="cuda"), VR.run(planted, 2, device="cuda")
    assert [t.__dict__ for t in two.tensors] == [t.__dict__ for t in one.tensors]
    assert [(f.target, f.status) for f in two.findings] == [(f.target, f.status) for f in one.findings]
