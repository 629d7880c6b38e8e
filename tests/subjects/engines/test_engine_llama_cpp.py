"""The in-process llama.cpp engine: logits for every position and graph-node capture via cb_eval."""

from __future__ import annotations

import numpy as np
import pytest

from llmdoctor.subjects.engines import llama_cpp as engine

pytestmark = pytest.mark.slow

IDS = [2, 818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236761]  # "<bos>The quick brown fox..."


@pytest.fixture(scope="module")
def run(demo_path):
    return engine.run(demo_path, IDS, capture=("l_out-*", "attn_norm-0", "Qcur-0", "kqv_out-3", "result_*"), n_threads=2)


def test_logits_every_position(run):
    assert run.logits.shape == (len(IDS), 262144)
    assert np.isfinite(run.logits).all()
    # the captured output node is exactly what llama_get_logits returns
    assert np.array_equal(run.captures["result_output"], run.logits)


def test_captured_nodes_are_row_major(run):
    assert run.captures["l_out-17"].shape == (len(IDS), 640)
    assert run.captures["attn_norm-0"].shape == (len(IDS), 640)
    assert run.captures["Qcur-0"].shape == (len(IDS), 4, 256)  # [T, H, D]
    assert run.captures["kqv_out-3"].shape == (len(IDS), 1024)  # [T, H*Dv]
    assert len([k for k in run.captures if k.startswith("l_out-")]) == 18
    assert "sa_out-0" in run.node_names  # gemma3's name for the post-attention residual


def test_no_capture_means_no_callback(demo_path):
    r = engine.run(demo_path, IDS[:4], n_threads=2)
    assert r.captures == {} and r.node_names == []
    assert r.logits.shape == (4, 262144)


def test_bad_model_raises(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(engine.EngineError, match="could not load"):
        engine.run(bad, [1, 2])
