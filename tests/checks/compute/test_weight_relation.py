"""Naming the cause of a divergence by the engine's own weights (issue 22 part 3): checks/compute/weight_relation.py
relates a tensor the engine holds after its loader to the file's, and diagnose's layer localization
confirms a differing tensor by swapping the engine's version into the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmdoctor.checks.compute.weight_relation import relate, rope_layout_rows
from llmdoctor.gguf.layout import rope_permute


@pytest.fixture
def w():
    return np.random.default_rng(0).standard_normal((32, 24))


def test_relations(w):
    assert relate(w, w, tol=1e-6) is None
    assert relate(w * 0.5, w, tol=1e-6)["kind"] == "scale"
    assert relate(w.T, w, tol=1e-6)["kind"] == "transpose"
    gguf_rows = rope_permute(torch.as_tensor(w), 4).numpy()  # what convert_hf_to_gguf writes for a q_proj
    r = relate(gguf_rows, w, tol=1e-6, n_head=4)
    assert r["kind"] == "rope-layout" and r["order"] == "permuted" and "did not undo" in r["words"]
    swapped = w[np.r_[1, 0, 2:32]]
    assert relate(swapped, w, tol=1e-6, n_head=4) == {"kind": "rows-permuted", "rows_moved": 2,
                                                       "error": pytest.approx(relate(swapped, w, tol=1e-6)["error"]),
                                                       "words": "the file's rows in another order (2 of 32 rows moved)"}
    other = np.random.default_rng(1).standard_normal(w.shape)
    assert relate(other, w, tol=1e-6, others={"k_proj": other})["words"] == "k_proj's data"
    assert relate(other, w, tol=1e-6)["kind"] == "unrelated"


def test_rope_layout_rows_are_inverse():
    orders = rope_layout_rows(16, 2)
    assert np.array_equal(orders["permuted"][orders["unpermuted"]], np.arange(16))


@pytest.mark.slow
def test_a_loader_that_keeps_the_gguf_rope_layout_is_named(tmp_path, monkeypatch):
    """transformers serving a tiny llama GGUF with a loader that forgets to undo the Q/K permutation of
    layer 0's q_proj (planted on the built model; the engine exposes l_out-0 only of its two layers): layer
    localization names layer 0, the engine's q_proj as 'rows in the GGUF's adjacent-pair RoPE layout', and the
    swap reproduces the divergence."""
    import fixtures_hf

    from llmdoctor import diagnose as dg
    from llmdoctor.subjects.engines import transformers as hf_engine

    _, gguf_path = fixtures_hf.checkpoint("llama", tmp_path)
    real = hf_engine.build

    def faulty_build(path, dtype=torch.float32, dequantizer=None, **kw):
        model, cfg = real(path, dtype, dequantizer, **kw)
        q = model.model.layers[0].self_attn.q_proj.weight
        with torch.no_grad():
            q.copy_(rope_permute(q.detach().clone(), cfg.n_head))  # the file's row order, kept
        return model, cfg

    monkeypatch.setattr(hf_engine, "build", faulty_build)
    res = dg.run(dg.Inputs(gguf=gguf_path, engine="transformers", token_ids=list(range(3, 19)), threads=2))
    loc = next(f for f in res.findings if f.check == "layer-localization")
    assert loc.status == "fail" and loc.metrics["first_divergent_layer"] == 0, loc.explanation
    (held,) = loc.metrics["engine_weights"]["differ"]
    assert held["tensor"] == "model.layers.0.self_attn.q_proj.weight" and held["kind"] == "rope-layout"
    assert held["reproduces"] is True
    assert "the engine holds model.layers.0.self_attn.q_proj.weight as rows in the GGUF's adjacent-pair" \
           in loc.explanation and "swapped into the reference it alone reproduces" in loc.explanation
    assert "the cause: the engine holds model.layers.0.self_attn.q_proj.weight" in loc.explanation
    assert "no single swap" not in loc.explanation  # the held weight's swap reproduces it
    assert loc.metrics["cause"].startswith("the engine holds model.layers.0.self_attn.q_proj.weight as rows")
    assert "confirmed by substitution: the engine holds model.layers.0.self_attn.q_proj.weight" in res.verdict
