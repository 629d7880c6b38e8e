"""Non-finite numbers are their own finding (checks/finite.py and diagnose's engine-finite step), never
folded into a metric: planted NaN logits and activations."""

from __future__ import annotations

from llmdoctor import diagnose as dg


def test_planted_nan_is_its_own_finding():
    """An engine whose logits are NaN everywhere and whose layer-3 output is NaN: the finding says so in
    words, with counts and the first point; the metrics of other checks never carry it."""
    import numpy as np

    from llmdoctor.checks import finite

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
    """diagnose's engine-finite step on the demo in llama.cpp: finite; with the engine's logits made NaN
    it is the first suspect among the engine's, in words."""
    import numpy as np

    s = dg.Session(dg.Inputs(gguf=demo_path, engine="llama.cpp", threads=2, prompt="Paris is the capital of"))
    try:
        assert [f.status for f in dg.h_engine_finite(s)] == ["pass", "pass"]
        logits, caps, info = s.engine_run()
        s._cache["engine"] = (np.full_like(np.asarray(logits), np.nan), caps, info)
        f = dg.h_engine_finite(s)[0]
        t = len(s.tokens())
        assert f.status == "fail" and f.explanation.startswith(f"engine logits NaN at {t} of {t} positions")
    finally:
        s.close()
