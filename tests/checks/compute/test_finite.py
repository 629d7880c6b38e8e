"""Non-finite numbers are their own finding (checks/compute/finite.py and diagnose's engine-finite step), never
folded into a metric: planted NaN logits and activations."""

from __future__ import annotations

from llmdoctor import diagnose as dg
from llmdoctor.diagnose import hypotheses
from llmdoctor.subjects.engines.base import EngineRun


def test_planted_nan_is_its_own_finding():
    """An engine whose logits are NaN everywhere and whose layer-3 output is NaN: the finding says so in
    words, with counts and the first point; the metrics of other checks never carry it."""
    import numpy as np

    from llmdoctor.checks.compute import finite

    rng = np.random.default_rng(0)
    ref = rng.standard_normal((54, 32))
    got = np.full_like(ref, np.nan)
    f = finite.logits_finding("llama.cpp", got, ref)
    assert f.status == "fail" and f.explanation.startswith("engine logits NaN at 54 of 54 positions")
    got = ref.copy()
    got[7, 3] = np.inf
    assert "inf at 1 of 54 positions (first: position 7)" in finite.logits_finding("x", got, ref).explanation
    assert finite.logits_finding("x", ref, ref).status == "pass"
    ref_caps = {f"l_out-{i}": rng.standard_normal((54, 8)) for i in range(6)}
    caps = {k: v.copy() for k, v in ref_caps.items()}
    caps["l_out-3"][:, :] = np.nan
    caps["l_out-4"][0, 0] = np.nan
    c = finite.captures_finding("x", caps, ref_caps)
    assert c.status == "fail" and c.metrics["first_point"] == "l_out-3" and c.metrics["non_finite_points"] == 2
    assert "l_out-3 (NaN in 432 of 432 values)" in c.explanation


def test_planted_nan_in_a_diagnosis(demo_path):
    """diagnose's engine-finite step, given an engine run whose logits are NaN and whose layer-2 output
    is inf (planted in the session's evidence; the healthy demo diagnosis in tests/diagnose/test_diagnose.py runs
    the step on llama.cpp's real output and must pass it)."""
    import numpy as np

    rng = np.random.default_rng(1)
    ref = rng.standard_normal((6, 50)).astype(np.float32)
    ref_caps = {f"l_out-{i}": rng.standard_normal((6, 16)).astype(np.float32) for i in range(4)}
    caps = {k: v.copy() for k, v in ref_caps.items()}
    caps["l_out-2"][3] = np.inf
    s = dg.Session(dg.Inputs(gguf=demo_path, engine="llama.cpp"))
    try:
        s.engine_run = lambda: EngineRun(np.full_like(ref, np.nan), caps)
        s.reference = lambda dtype="float32", emulate=None: (ref, ref_caps, [])
        logits, acts = hypotheses.h_engine_finite(s)
    finally:
        s.close()
    assert logits.status == "fail" and logits.explanation.startswith("engine logits NaN at 6 of 6 positions")
    assert acts.status == "fail" and acts.metrics["first_point"] == "l_out-2" and "inf in 16 of 96" in acts.explanation


def test_layer_localization_says_non_finite_in_words(demo_path, monkeypatch):
    """A NaN capture is the first divergent point, said as non-finite, never "off by nan"."""
    import numpy as np

    rng = np.random.default_rng(2)
    ref_caps = {f"l_out-{i}": rng.standard_normal((6, 16)).astype(np.float32) for i in range(4)}
    noisy = {k: v + np.float32(1e-6) * rng.standard_normal(v.shape).astype(np.float32) for k, v in ref_caps.items()}
    caps = {k: v.copy() for k, v in noisy.items()}
    caps["l_out-2"][1] = caps["l_out-3"][1] = np.nan  # it propagates, as in a real engine
    monkeypatch.setattr(hypotheses, "substitutions", lambda s, point: [])
    s = dg.Session(dg.Inputs(gguf=demo_path, engine="llama.cpp"))
    s.n_draws = 0  # the runs are stand-ins: nothing to draw
    try:
        s.engine_run = lambda: EngineRun(None, caps)
        s.reference = lambda dtype="float32", emulate=None: (None, ref_caps, [])
        s.budget_reference = lambda: (None, noisy, [])
        (f,) = hypotheses.h_layer_localization(s)
    finally:
        s.close()
    assert f.status == "fail" and f.metrics["first_divergent_layer"] == 2
    assert "l_out-2 is not finite in the engine" in f.explanation and "off by" not in f.explanation
