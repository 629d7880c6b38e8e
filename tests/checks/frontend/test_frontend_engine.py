"""The deployment's front end (issue 25): each engine's own tokenization against the model file's, the planted
front-end faults found and named, and the two compute runs a front-end fault gets in the report."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from llmdoctor.checks.frontend import engine as fe
from llmdoctor.faults import frontend as ff
from llmdoctor.faults import get
from llmdoctor.subjects.engines import create
from llmdoctor.subjects.engines.base import Deployment, Engine, NotOffered


@pytest.fixture(scope="module")
def ref(demo_path):
    return fe.ReferenceFrontEnd(demo_path)


@pytest.fixture(scope="module")
def healthy(demo_tokenizer, tmp_path_factory) -> Path:
    """The demo's tokenizer folder with a Gemma-style chat template writing BOS once (the demo GGUF has none)."""
    out = tmp_path_factory.mktemp("healthy-tokenizer")
    shutil.copytree(demo_tokenizer, out, dirs_exist_ok=True)
    ff.with_chat_template(out, ff.chat_template(bos_times=1))
    return out


class Scripted(Engine):
    """An engine whose front end returns the reference's ids edited by `edit` (no library behind it)."""

    name, title, distribution = "scripted", "scripted", "none"

    def __init__(self, ref, edit):
        super().__init__(Deployment())
        self.ref, self.edit = ref, edit

    def tokenize(self, text):
        return self.edit(self.ref.encode(text))

    def chat_tokenize(self, messages):
        raise NotOffered("scripted: no chat")


def test_a_difference_names_prompt_position_pieces_bos_and_ratio(ref):
    rows = fe.compare(Scripted(ref, lambda ids: [ref.bos_id] + ids), ref, "1 2 3")
    f = fe.finding(Scripted(ref, None), ref, rows)
    assert f.status == "fail" and f.check == "front-end"
    assert f.explanation.startswith("the deployment's front end tokenizes the diagnosis prompt '1 2 3' differently")
    assert "BOS doubled (2 leading, the reference 1)" in f.explanation
    assert "first difference at token 1: engine '<bos>' (2)" in f.explanation
    assert f.metrics["differ"] == f.metrics["compared"] == len(rows) - 1  # the chat is skipped, saying why
    assert [e for e in f.evidence if e["prompt_label"] == "chat"][0]["reason"] == "scripted: no chat"
    same = fe.finding(Scripted(ref, None), ref, fe.compare(Scripted(ref, list), ref, "1 2 3"))
    assert same.status == "pass" and "(chat skipped)" in same.explanation


@pytest.mark.slow
def test_llama_cpp_tokenizes_as_the_reference_and_says_how(demo_path, ref):
    engine = create("llama.cpp", Deployment(model=demo_path))
    f = fe.finding(engine, ref, fe.compare(engine, ref, "The capital of France is"))
    assert f.status == "pass", f.explanation
    assert f.metrics["compared"] == 7 and f.metrics["engine_front_end"]["loaded_by"] == "llama_tokenize"
    chat = f.evidence[-1]
    assert chat["status"] == "skip" and "carries no tokenizer.chat_template" in chat["reason"]


@pytest.mark.slow
def test_transformers_with_the_demo_tokenizer_folder_passes_chat_included(demo_path, ref, healthy):
    engine = create("transformers", Deployment(model=demo_path, tokenizer=healthy))
    f = fe.finding(engine, ref, fe.compare(engine, ref, "The capital of France is"))
    assert f.status == "pass", f.explanation
    assert f.metrics["compared"] == 8  # the chat too: the folder's template, held to the metadata's BOS
    assert f.metrics["engine_front_end"]["tokenizer"] == str(healthy)


def test_transformers_on_a_gguf_without_a_folder_says_why_not(demo_path):
    with pytest.raises(NotOffered, match="--tokenizer DIR"):
        create("transformers", Deployment(model=demo_path)).tokenize("hi")


@pytest.mark.slow
@pytest.mark.parametrize("fault, engine", [("tokenizer-no-bos", "transformers"), ("tokenizer-lost-merges", "llama.cpp"),
                                           ("tokenizer-other-model", "llama.cpp"),
                                           ("chat-template-double-bos", "transformers")])
def test_planted_front_end_fault_is_found_with_the_first_differing_token(fault, engine, demo_path, ref, healthy,
                                                                         tmp_path):
    f = get(fault)
    folder = f.build(healthy, tmp_path)
    e = create(engine, Deployment(model=demo_path, tokenizer=folder))
    found = fe.finding(e, ref, fe.compare(e, ref, "The capital of France is"))
    assert found.status == "fail" and f.expect in found.explanation, found.explanation
    first = found.metrics["first"]
    assert first["engine"] != first["reference"] and "first_difference" in first
    if fault == "chat-template-double-bos":
        assert first["prompt_label"] == "chat" and found.metrics["differ"] == 1


@pytest.mark.slow
def test_the_front_end_ranks_first_with_both_compute_runs(demo_path, healthy, tmp_path):
    """The demo in llama.cpp (llama-cpp-python with an HF tokenizer folder) whose folder adds no BOS, through
    diagnose's own plan entry: the front end fails, with the engine's next token on its own tokens and on the
    reference's, and the verdict says the front end is the cause; the plan puts it after the file-level steps
    and before every compute step, so it ranks first."""
    from llmdoctor.diagnose import PLAN, Inputs, Session
    from llmdoctor.diagnose import _findings
    from llmdoctor.diagnose.plan import order
    from llmdoctor.diagnose.verdict import judge

    folder = get("tokenizer-no-bos").build(healthy, tmp_path)
    inputs = Inputs.from_options(gguf=None, hf=None, endpoint=None, engine="llama.cpp", prompt=None, token_ids=None,
                                 default_gguf=lambda: demo_path, tokenizer=folder)
    assert inputs.tokenizer == folder.absolute()
    s = Session(inputs)
    try:
        found = _findings(next(h for h in PLAN if h.key == "front-end"), s)
    finally:
        s.close()
    suspects, _, verdict, code = judge(found, inputs)
    top = suspects[0]
    assert code == 1 and top.check == "front-end" and "BOS missing" in top.explanation, top.explanation
    runs = top.metrics["compute_runs"]
    assert runs["prompt_label"] == "diagnosis prompt"
    assert runs["engine_tokens"]["tokens"] == runs["reference_tokens"]["tokens"] - 1
    own, alone = runs["engine_tokens"], runs["reference_tokens"]
    assert alone["top1_agrees"] and alone["kl"] < 1e-2 * own["kl"]
    assert not own["top1_agrees"]  # the demo prompt's next token changes without BOS
    assert verdict.startswith("fault found: the deployment's front end") and "the front end is the cause" in verdict
    rank = order()
    assert rank["mapping"] < rank["front-end"] < min(rank[k] for k in ("dequant", "fp16-overflow", "engine-finite",
                                                                        "engine-vs-reference", "layer-localization"))


@pytest.mark.slow
def test_vllm_tokenizes_with_its_renderer_and_its_chat_doubles_bos(vllm_python, demo_path, ref, healthy, tmp_path):
    """vLLM for CPU's own renderer for the demo model (its config.json: no weights are loaded to tokenize) with a
    tokenizer folder whose chat template writes BOS twice: every text agrees with the GGUF's tokenizer, the
    chat does not."""
    from llmdoctor.gguf import open_gguf
    from llmdoctor.reference.config import from_gguf
    from llmdoctor.reference.config_hf import hf_config

    model = tmp_path / "demo-config"
    model.mkdir()
    with open_gguf(demo_path) as g:
        (model / "config.json").write_text(json.dumps(hf_config(from_gguf(g), g)))
    folder = get("chat-template-double-bos").build(healthy, tmp_path)
    e = create("vllm", Deployment(model=model, tokenizer=folder, python=vllm_python))
    found = fe.finding(e, ref, fe.compare(e, ref, "The capital of France is"))
    assert found.status == "fail" and "BOS doubled" in found.explanation, found.explanation
    assert found.metrics["first"]["prompt_label"] == "chat" and found.metrics["differ"] == 1
    assert found.metrics["engine_front_end"]["tokenizer"] == str(folder)
    assert found.metrics["engine_front_end"]["chat_add_special_tokens"] is False
