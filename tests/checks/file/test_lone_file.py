"""What a lone model file reveals beyond its weights: metadata plausibility (checks/file/plausibility.py), the
front end it carries (checks/frontend/audit.py), diagnose's handling of inconsistent metadata, and the
findings as SARIF 2.1.0 (report/sarif.py), validated against the schema subset in tests/data."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from gguf import GGUFValueType as VT
from typer.testing import CliRunner

from llmdoctor import diagnose as dg
from llmdoctor.diagnose import hypotheses
from llmdoctor import faults
from llmdoctor.checks.frontend import audit as frontend
from llmdoctor.checks.file import plausibility
from llmdoctor.cli import app
from llmdoctor.faults.mapping import _rewrite
from llmdoctor.gguf import open_gguf
from llmdoctor.reference.tokenizer import Tokenizer

runner = CliRunner()
SCHEMA = json.loads((Path(__file__).parents[2] / "data" / "sarif-2.1.0-subset.schema.json").read_text())


def _failed(findings):
    return [f for f in findings if f.status == "fail"]


def _rules(findings):
    return {f.metrics.get("rule") for f in _failed(findings)}


def _valid_sarif(log: dict) -> None:
    jsonschema.Draft7Validator(SCHEMA, format_checker=jsonschema.FormatChecker()).validate(log)
    for r in log["runs"][0]["results"]:  # SARIF 3.27.9: a result that is not a failure has level "none"
        assert r["kind"] == "fail" or r["level"] == "none", r


# ---- metadata plausibility ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A 2-layer llama made with transformers (tests/reference/test_reference_dense.py), F32."""
    from test_reference_dense import TINY, tiny_gguf

    model_type, arch, extra = TINY["llama"]
    return tiny_gguf(tmp_path_factory.mktemp("tiny"), model_type, arch, extra)[2]


def test_demo_and_tiny_model_are_plausible(demo_path, tiny_llama):
    for path in (demo_path, tiny_llama):
        with open_gguf(path) as g:
            fs = plausibility.run(g, path)
        assert _failed(fs) == [] and not any(f.metrics.get("advisory") for f in fs), [f.explanation for f in fs]


@pytest.mark.parametrize("meta,rule,says", [
    ({"llama.attention.head_count_kv": (3, VT.UINT32)}, "head-count", "does not divide head_count = 4"),
    ({"llama.attention.key_length": (8, VT.UINT32)}, "head-dims", "blk.0.attn_q.weight is [64, 64]"),
    ({"llama.vocab_size": (97, VT.UINT32)}, "vocab", "token_embd.weight has 96 rows, llama.vocab_size = 97"),
    ({"tokenizer.ggml.bos_token_id": (96, VT.UINT32), "tokenizer.ggml.tokens":
      ([f"t{i}" for i in range(96)], VT.ARRAY, VT.STRING)}, "special-ids", "bos_token_id = 96 is outside"),
    ({"llama.context_length": (0, VT.UINT32)}, "context-length", "llama.context_length is 0"),
    ({"llama.block_count": (3, VT.UINT32)}, "block-count", "block 2 has no tensors"),
])
def test_each_hard_rule_fires(tiny_llama, tmp_path, meta, rule, says):
    bad = _rewrite(tiny_llama, tmp_path / "bad.gguf", lambda n, d, q: [(n, d, q)], meta)
    with open_gguf(bad) as g:
        fs = plausibility.run(g, bad)
    assert rule in _rules(fs), [f.explanation for f in fs]
    assert any(says in f.explanation for f in _failed(fs)), [f.explanation for f in _failed(fs)]


def test_soft_finding_names_expected_value_and_source(demo_path, tmp_path):
    bad = faults.get("rope-base").build(demo_path, tmp_path)  # 1e6 -> 100
    with open_gguf(bad) as g:
        fs = plausibility.run(g, bad)
    assert _failed(fs) == []  # reported, not a fault
    adv = [f for f in fs if f.metrics.get("advisory")]
    assert [f.target for f in adv] == ["gemma3.rope.freq_base"]
    assert adv[0].metrics["expected"] == "1e+06" and "Gemma3TextConfig" in adv[0].metrics["source"]


def test_soft_finding_for_a_name(tiny_llama, tmp_path):
    odd = _rewrite(tiny_llama, tmp_path / "yarn.gguf", lambda n, d, q: [(n, d, q)],
                   {"llama.rope.scaling.type": ("yarn", VT.STRING)})
    with open_gguf(odd) as g:
        fs = plausibility.run(g, odd)
    adv = [f for f in fs if f.metrics.get("advisory")]
    assert _failed(fs) == [] and [f.target for f in adv] == ["llama.rope.scaling.type"]
    assert "= yarn is far from what published configs use (none or linear" in adv[0].explanation


@pytest.mark.slow
def test_inconsistent_metadata_skips_what_needs_a_model(demo_path, tmp_path):
    """The crash a new user met (head_count_kv 3 in a demo copy: a traceback in reference/forward.py) is
    now the metadata finding, and every step that needs a consistent model says why it did not run."""
    bad = faults.get("head-count-kv-3").build(demo_path, tmp_path)
    res = dg.run(dg.Inputs(gguf=bad, threads=2))
    assert res.exit_code == 1 and res.suspects[0].check == "metadata"
    assert "head_count_kv = 3 does not divide head_count = 4" in res.verdict
    assert res.suspects[0].target == "gemma3.attention.head_count_kv"
    s = dg.Session(dg.Inputs(gguf=bad, engine="llama.cpp"))
    for h in (hypotheses.h_fp16_overflow, hypotheses.h_engine_vs_reference, hypotheses.h_layer_localization):
        with pytest.raises(dg.Skip, match="the metadata is inconsistent"):
            h(s)
    s.close()


# ---- the front end -------------------------------------------------------------------------------

ESCAPES = """{% for m in messages %}{{ m.content }}
{{ ''.__class__.__mro__[1].__subclasses__() }}
{{ cycler.__init__.__globals__.os }}
{{ messages|attr('__class__') }}
{% set ns = namespace(x=1) %}{{ ns.x }}
{{ namespace.__init__ }}
{% include 'other.jinja' %}
{% endfor %}"""


def test_template_escapes_flagged_with_their_line():
    esc = frontend.template_escapes(ESCAPES)
    lines = {e["line"] for e in esc}
    assert lines == {2, 3, 4, 6, 7}, esc  # line 5 calls namespace(): the legitimate use
    assert any(e["construct"] == ".__subclasses__" for e in esc)
    assert any(e["construct"] == "cycler" for e in esc)
    assert any(e["construct"] == "'__class__'" for e in esc)
    assert frontend.template_escapes("{% if x %}") [0]["construct"] == "syntax error"


class _Meta:
    """An open GGUF's metadata with a chat template and add_bos_token set."""

    def __init__(self, g, template: str | None):
        self.g, self.template = g, template

    def get(self, key, default=None):
        return self.template if key == "tokenizer.chat_template" else self.g.get(key, default)


@pytest.fixture(scope="module")
def demo_vocab(demo_path):
    g = open_gguf(demo_path)
    yield g, Tokenizer.from_gguf(g)
    g.close()


@pytest.mark.parametrize("template,ok,says", [
    ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}",
     True, "one BOS"),
    ("{% for m in messages %}{{ bos_token }}{{ m.content }}{% endfor %}", False, "3 times"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", False, "never emits BOS"),
])
def test_bos_usage(demo_vocab, template, ok, says):
    g, tok = demo_vocab
    fs = frontend.audit_template(_Meta(g, template), tok)
    bos = next(f for f in fs if f.check == "chat-template-bos")
    assert (bos.status == "pass") == ok and says in bos.explanation, bos.explanation


def test_tokenizer_audit_and_parity(demo_path, demo_vocab):
    """The demo vocab is well-formed and llama.cpp renders every sampled piece as we do; a tokenizer
    whose byte-token text we corrupt is found by the parity check."""
    llama_cpp = pytest.importorskip("llama_cpp")  # noqa: F841
    from llmdoctor.subjects.engines.llama_cpp import VocabPieces

    g, tok = demo_vocab
    assert _failed(frontend.audit_tokenizer(g, tok)) == []
    with VocabPieces(demo_path) as pieces:
        assert frontend.parity(tok, pieces, sample=512).status == "pass"
        tok.tokens[248] = "<0x0B>"  # the newline byte token now decodes to a vertical tab
        tok._pieces.clear()
        try:
            bad = frontend.parity(tok, pieces, sample=16)
        finally:
            tok.tokens[248] = "<0x0A>"
            tok._pieces.clear()
    assert bad.status == "fail" and bad.evidence[0]["id"] == 248


def test_bpe_without_merges_and_normal_special_token(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "bpe.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab", "<eos>"])
    w.add_token_types([1, 1, 1, 1])  # <eos> left NORMAL
    w.add_eos_token_id(3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open_gguf(path) as g:
        fs = frontend.audit_tokenizer(g, None)
        assert {f.metrics["rule"] for f in _failed(fs)} == {"merges", "special-ids"}
        assert any("'<eos>') is a normal token" in f.explanation for f in fs)
        fs = frontend.run(g, path)  # our tokenizer refuses the vocab too: one more finding, not a crash
    assert any("cannot be built" in f.explanation and "merges" in f.explanation for f in _failed(fs))


# ---- SARIF ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_sarif_of_check_commands_validates(demo_path, tmp_path):
    bad = faults.get("scale-inf").build(demo_path, tmp_path)
    out = tmp_path / "f.sarif"
    r = runner.invoke(app, ["check", "metadata", str(faults.get("head-count-kv-3").build(demo_path, tmp_path)),
                            "--sarif", str(out)])
    assert r.exit_code == 1, r.stdout
    log = json.loads(out.read_text())
    _valid_sarif(log)
    fail = [x for x in log["runs"][0]["results"] if x["kind"] == "fail"]
    assert fail[0]["ruleId"] == "metadata" and fail[0]["level"] == "error"
    assert fail[0]["locations"][0]["logicalLocations"][0] == {"name": "gemma3.attention.head_count_kv",
                                                              "kind": "property"}
    assert fail[0]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"].startswith("file://")
    r = runner.invoke(app, ["check", "forensics", str(bad), "--sarif", str(out)])
    assert r.exit_code == 1
    log = json.loads(out.read_text())
    _valid_sarif(log)
    fail = [x for x in log["runs"][0]["results"] if x["kind"] == "fail"]
    assert fail[0]["locations"][0]["logicalLocations"][0] == {"name": "blk.7.attn_output.weight", "kind": "resource"}
    r = runner.invoke(app, ["verify", str(bad), "--sarif", str(out)])  # verify's envelope names the file in `model`
    assert r.exit_code == 1
    log = json.loads(out.read_text())
    _valid_sarif(log)
    assert log["runs"][0]["artifacts"][0]["location"]["uri"] == bad.resolve().as_uri()
    assert any(x["kind"] == "fail" and x["locations"][0]["logicalLocations"][0]["name"] == "blk.7.attn_output.weight"
               for x in log["runs"][0]["results"])


@pytest.mark.slow
def test_sarif_of_diagnose_validates(tmp_path):
    broken = tmp_path / "bad.gguf"
    broken.write_bytes(b"GGML" + bytes(60))
    out = tmp_path / "d.sarif"
    r = runner.invoke(app, ["diagnose", "--gguf", str(broken), "--sarif", str(out)])
    assert r.exit_code == 1
    log = json.loads(out.read_text())
    _valid_sarif(log)
    kinds = {x["kind"] for x in log["runs"][0]["results"]}
    assert kinds == {"fail", "notApplicable"}
    assert all(x["message"]["text"] for x in log["runs"][0]["results"])
    r = runner.invoke(app, ["diagnose", "--gguf", str(broken), "--sarif", str(tmp_path / "no" / "x.sarif")])
    assert r.exit_code == 2 and "cannot write the report" in r.stderr


def test_sarif_template_line_and_nonfinite_numbers():
    from llmdoctor.checks.base import Finding
    from llmdoctor.report.envelope import dumps, envelope
    from llmdoctor.report.sarif import to_sarif

    f = Finding("chat-template", "gguf", "tokenizer.chat_template", "fail", metrics={"kl": float("nan")},
                evidence=[{"key": "tokenizer.chat_template", "line": 3}], explanation="line 3: cycler")
    doc = json.loads(dumps(envelope("check.frontend", argv=[], verdict="failed", exit_code=1, findings=[f])))
    log = json.loads(dumps(to_sarif(doc)))
    _valid_sarif(log)
    res = log["runs"][0]["results"][0]
    assert res["properties"]["metrics"]["kl"] == "nan" and "physicalLocation" not in res["locations"][0]
    assert res["locations"][0]["logicalLocations"] == [{"name": "tokenizer.chat_template", "kind": "property",
                                                         "fullyQualifiedName": "tokenizer.chat_template:3"}]

