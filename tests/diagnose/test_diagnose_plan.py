"""diagnose's plan as data (diagnose/plan.py): its table, what each hypothesis needs, and docs/hypotheses.md's copy."""

from __future__ import annotations

import re
from pathlib import Path

from llmdoctor import diagnose as dg
from llmdoctor.diagnose.plan import NEEDS, PLAN, markdown

HYPOTHESES = Path(__file__).resolve().parents[2] / "docs" / "hypotheses.md"


def test_docs_table_is_the_plan():
    text = HYPOTHESES.read_text()
    m = re.search(r"<!-- plan:[^\n]*-->\n(.*?)\n<!-- /plan -->", text, re.S)
    assert m, "docs/hypotheses.md has no generated plan table"
    assert m.group(1) == markdown(), \
        "docs/hypotheses.md's table differs: regenerate it with `python -m llmdoctor.diagnose.plan`"


def test_every_need_is_known_and_keys_are_unique():
    assert len({h.key for h in PLAN}) == len(PLAN)
    for h in PLAN:
        assert h.needs and all(n in NEEDS for n in h.needs), h.key


def test_skip_reasons_come_from_the_first_missing_need(demo_path):
    s = dg.Session(dg.Inputs(gguf=demo_path))
    try:
        why = {h.key: h.missing(s) for h in PLAN}
    finally:
        s.close()
    assert why["file-integrity"] is None and why["metadata"] is None
    assert why["engine-vs-reference"] == "no in-process engine (--engine)"
    assert why["symptom-bisection"] == "no endpoint given (--endpoint)"
    assert why["dequant"].startswith("no dequant kernel to check")
    assert why["moe-routing"] == "gemma3 has no MoE layers"
    assert why["dsa-selection"] == "gemma3 has no sparse-attention indexer"
    assert why["engine-backends"] == "only --engine vllm selects attention backends at run time"
    assert why["engine-file"] == "the engine loads the reference file itself"


def test_an_engine_brings_its_built_in_dequant_kernel(demo_path):
    s = dg.Session(dg.Inputs(gguf=demo_path, engine="llama.cpp"))
    try:
        assert next(h for h in PLAN if h.key == "dequant").missing(s) is None
        assert s.dequant_kernel() == "ggml"
    finally:
        s.close()


def test_inputs_policy(demo_path, tmp_path, monkeypatch):
    """--gguf/--hf/--prompt/--token-ids and the engine default, resolved once (diagnose/inputs.py); paths
    relative to the caller's directory are made absolute."""
    import pytest

    from llmdoctor.errors import InputError

    opts = dict(hf=None, endpoint=None, engine=None, prompt=None, token_ids=None, default_gguf=lambda: demo_path)
    assert dg.Inputs.from_options(gguf=None, **opts).engine == "llama.cpp"  # the demo deployment
    monkeypatch.chdir(demo_path.parent)
    got = dg.Inputs.from_options(gguf=Path(demo_path.name), **{**opts, "token_ids": "2,3"})
    assert got.gguf == demo_path and got.gguf.is_absolute() and got.token_ids == [2, 3]
    with pytest.raises(InputError, match="--prompt and --token-ids"):
        dg.Inputs.from_options(gguf=None, **{**opts, "prompt": "x", "token_ids": "1"})
    with pytest.raises(InputError, match="unknown engine"):
        dg.Inputs.from_options(gguf=None, **{**opts, "engine": "nope"})
    with pytest.raises(InputError, match="no such file"):
        dg.Inputs.from_options(gguf=tmp_path / "missing.gguf", **opts)
