"""diagnose one way (issue 33): the session holds evidence and judges nothing; the reference's replay of the
engine's choices is its own step; op substitution is one routine with one rule; a finding keeps its check's id,
the plan step it answers is a field of its own. Fast: no model is run."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from llmdoctor.checks.base import Finding
from llmdoctor.diagnose import Inputs, Session, _findings, replay
from llmdoctor.diagnose.plan import Hypothesis
from llmdoctor.diagnose.substitute import REPRODUCES_AT, reproduces, substitute
from llmdoctor.diagnose.verdict import judge


def test_the_session_judges_nothing():
    for judging in ("prefill_criteria", "divergence", "curve", "reference_extra"):
        assert not hasattr(Session, judging), judging
    s = Session(Inputs())
    assert not hasattr(s, "curve")


@pytest.mark.parametrize("error,engine,want", [
    (0.5, 1.0, True), (0.49, 1.0, False), (3.0, 1.0, True), (0.0, 0.0, True),
    (math.nan, math.nan, True), (math.inf, math.nan, True), (math.nan, 1.0, False), (1.0, math.nan, False),
])
def test_one_substitution_rule(error, engine, want):
    """At least half the engine's error, or non-finite like the engine's: nothing else."""
    assert REPRODUCES_AT == 0.5
    assert reproduces(error, engine) is want


def _session_with_reference(ref: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(reference=lambda dtype: (None, {"l_out-3": ref}, None))


def test_substitute_judges_the_rerun_at_the_point():
    point = SimpleNamespace(point="l_out", layer=3, error=0.2)
    ref = torch.ones(4, 8)
    s = _session_with_reference(ref)
    asked = []

    def rerun(capture):
        asked.append(capture)
        return {"l_out-3": ref * 1.15}  # rel_l2 0.15 >= 0.5 x 0.2

    got = substitute(s, point, "a swap", rerun)
    assert asked == [{"l_out-3"}]
    assert got["swap"] == "a swap" and got["reproduces"] is True and got["error"] == pytest.approx(0.15)
    assert substitute(s, point, "small", lambda c: {"l_out-3": ref * 1.05})["reproduces"] is False
    missing = substitute(s, point, "elsewhere", lambda c: {})
    assert missing["reproduces"] is False and math.isnan(missing["error"])


def test_a_swapped_component_that_crashes_is_evidence():
    point = SimpleNamespace(point="l_out", layer=3, error=0.2)

    def crash(capture):
        raise RuntimeError("illegal address")

    got = substitute(_session_with_reference(torch.ones(2)), point, "the kernel", crash)
    assert got == {"swap": "the kernel", "reproduces": None, "error": None,
                   "could_not_run": "RuntimeError: illegal address"}


def test_replay_takes_the_engines_choices_from_its_captures():
    from llmdoctor.reference.arch_deepseek import DSA_OVERRIDE, MOE_OVERRIDE

    cfg = SimpleNamespace(n_layer=2, moe=SimpleNamespace(n_used=2), mla=None)
    caps = {"ffn_moe_topk-1": np.array([[0, 3], [2, 1], [1, 0]]), "ffn_moe_topk-0": np.zeros((3, 5)),
            "top_k-0": np.zeros((3, 2))}
    got = replay.choices(cfg, caps, 3, "cpu")
    assert list(got) == [MOE_OVERRIDE] and list(got[MOE_OVERRIDE]) == [1]  # layer 0's shape is not [T, n_used]
    assert got[MOE_OVERRIDE][1].dtype == torch.int64 and got[MOE_OVERRIDE][1].tolist() == [[0, 3], [2, 1], [1, 0]]
    dsa = SimpleNamespace(n_layer=1, moe=None, mla=SimpleNamespace(indexer=object()))
    got = replay.choices(dsa, {"top_k-0 (view)": np.array([[0, 1]]), "top_k-0": np.array([[9, 9]])}, 1, "cpu")
    assert got[DSA_OVERRIDE][0].tolist() == [[0, 1]]  # the view, where the engine shows one
    assert replay.choices(cfg, {}, 3, "cpu") is None
    assert replay.has_choices(cfg) and replay.has_choices(dsa)
    assert not replay.has_choices(SimpleNamespace(moe=None, mla=SimpleNamespace(indexer=None)))


def test_only_an_engine_that_runs_checkpoints_may_substitute_one(demo_path, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"")
    assert replay.may_substitute(Inputs(gguf=demo_path, hf=ckpt, engine="transformers"))
    assert not replay.may_substitute(Inputs(gguf=demo_path, hf=ckpt, engine="llama.cpp"))  # GGUF only
    assert not replay.may_substitute(Inputs(gguf=demo_path, engine="transformers"))
    assert not replay.may_substitute(Inputs(hf=ckpt, engine="transformers"))  # it runs the checkpoint given
    # where it may not, what the reference reads never waits for the engine
    s = Session(Inputs(gguf=demo_path, engine="llama.cpp"))
    try:
        assert s.engine_reads() is None and s.reference_path() == demo_path and "engine" not in s._cache
    finally:
        s.close()


def test_a_finding_keeps_its_checks_id_and_ranks_with_its_step():
    """A sub-check's finding (a probe under symptom-bisection) keeps its check and id; the plan step it answers
    is Finding.step, by which the verdict ranks it."""
    probe = Finding("probe", "http://x", "logprobs", "fail", explanation="garbage")
    hyp = Hypothesis("symptom-bisection", "t", "Which symptom?", (), lambda s: [probe], "e")
    [f] = _findings(hyp, SimpleNamespace(inputs=Inputs()))
    assert (f.check, f.id, f.target, f.step) == ("probe", "probe/http://x/logprobs", "logprobs", "symptom-bisection")
    assert f.to_dict()["step"] == "symptom-bisection" and "step" not in Finding("x", "y", "z", "pass").to_dict()
    late = Finding("layer-localization", "e", "layer 3", "fail", step="layer-localization",
                   metrics={"first_divergent_layer": 3, "cause": None})
    suspects, _, verdict, code = judge([late, f], Inputs(endpoint="http://x"))
    assert suspects == [f, late] and code == 1 and verdict.startswith("fault found: garbage")
    skipped = Finding("probe", "http://x", "-", "skip", reason="no answer", step="symptom-bisection")
    assert judge([skipped], Inputs(endpoint="http://x"))[2:] == (
        "could not diagnose: symptom-bisection could not run: no answer", 2)
