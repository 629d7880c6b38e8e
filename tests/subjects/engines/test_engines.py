"""The engine interface (subjects/engines/base.py) and its registry (subjects/engines/__init__.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from llmdoctor.errors import InputError
from llmdoctor.subjects.engines import REGISTRY, create, engine_class, selectable
from llmdoctor.subjects.engines.base import (BackendSelecting, Deployment, Engine, GGUFNameMapping, NotOffered,
                                             PieceRendering, RunInfo)

SRC = Path(__file__).resolve().parents[3] / "src" / "llmdoctor"


def test_every_registered_engine_implements_the_interface():
    for name in REGISTRY:
        cls = engine_class(name)
        assert issubclass(cls, Engine) and cls.name == name, name
        assert cls.title and cls.distribution and cls.traits.captures and cls.traits.noise, name
        assert cls.run is not Engine.run, f"{name} does not implement run"
    assert selectable() == ("llama.cpp", "transformers", "vllm")  # the endpoint is reached with --endpoint


def test_an_unknown_engine_is_bad_input():
    with pytest.raises(InputError, match=r"unknown engine 'sglang' \(known: llama.cpp, transformers, vllm\)"):
        engine_class("sglang")


def _engine_name_comparisons(tree: ast.AST, names: set[str]) -> list[int]:
    """Line numbers where a registered engine name is compared (==, !=, in) as a string literal."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                consts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                if any(isinstance(c, ast.Constant) and c.value in names for c in consts):
                    lines.append(node.lineno)
    return lines


def test_no_engine_name_is_compared_outside_the_engines_folder():
    """Issue 21: nothing outside subjects/engines/ decides by an engine's name; it asks the registry."""
    names = set(REGISTRY)
    found = []
    for path in SRC.rglob("*.py"):
        if "subjects/engines" in path.as_posix():
            continue
        found += [f"{path.relative_to(SRC)}:{n}" for n in _engine_name_comparisons(ast.parse(path.read_text()), names)]
    assert not found, found
    planted = ast.parse('if engine == "vllm":\n    pass\nok = engine in ("transformers", "x")\n')
    assert _engine_name_comparisons(planted, names) == [1, 3]  # the scan can fail


def test_cannot_run_says_which_formats(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    why = create("llama.cpp", Deployment(model=ckpt)).cannot_run()
    assert why.startswith("llama.cpp runs GGUF files only")
    assert create("transformers", Deployment(model=ckpt)).cannot_run() is None


def test_methods_an_engine_lacks_say_why():
    with pytest.raises(NotOffered, match="full distribution"):
        create("endpoint", Deployment(url="http://127.0.0.1:9")).run([1, 2], None)
    with pytest.raises(NotOffered, match="does not expose the weights"):
        create("llama.cpp", Deployment(model=Path("x.gguf"))).weights(0)


def test_capabilities_only_some_engines_have():
    """Issue 33: a query only one engine answers is a capability (base.py) that engine's class has, not a
    method of every engine; callers ask `isinstance`. The trait that answers before an instance exists (plan
    rows, check attention) agrees with the class."""
    for name in REGISTRY:
        cls = engine_class(name)
        assert cls.traits.selects_backends == issubclass(cls, BackendSelecting), name
    assert not any(hasattr(Engine, m) for m in ("explain_backends", "select_backend", "gguf_name_map", "piece_reader"))
    has = {n: {c.__name__ for c in (BackendSelecting, GGUFNameMapping, PieceRendering) if issubclass(engine_class(n), c)}
           for n in REGISTRY}
    assert has == {"llama.cpp": {"PieceRendering"}, "transformers": set(), "endpoint": set(),
                   "vllm": {"BackendSelecting", "GGUFNameMapping"}}


def test_run_info_is_typed_and_reports_in_the_engines_order():
    """EngineRun.info: the fields diagnose decides with, the rest as details; the report's engine_run block
    keeps the engine's order, with what the adapter adds later after it."""
    info = RunInfo.of({"engine": "vllm", "vllm": "0.32", "python": "3.12.3", "dtype": "float32",
                       "arithmetic": {"device": "cpu"}, "backends": {"decode": {}}, "explained": {"kind": "dense"}})
    assert (info.engine, info.dtype, info.arithmetic, info.reference_reads) == ("vllm", "float32", {"device": "cpu"}, None)
    assert info.details == {"vllm": "0.32", "python": "3.12.3"}
    info.details["gguf_error"] = "no"
    info.reference_reads = "/ckpt"
    info.details["python"] = "/venv/bin/python"
    assert list(info.as_dict().items()) == [
        ("engine", "vllm"), ("vllm", "0.32"), ("python", "/venv/bin/python"), ("dtype", "float32"),
        ("arithmetic", {"device": "cpu"}), ("backends", {"decode": {}}), ("explained", {"kind": "dense"}),
        ("gguf_error", "no"), ("reference_reads", "/ckpt")]
    assert RunInfo.of({"engine": "llama.cpp", "dtype": None}).as_dict() == {"engine": "llama.cpp", "dtype": None}
    assert list(RunInfo(engine="x", details={"a": 1}).as_dict()) == ["engine", "a"]


def test_transformers_loads_its_model_once_and_close_releases_it(tmp_path, monkeypatch):
    """Issue 33: one load for every run, other tokens' run, generation and weight read; `close` lets the model
    go (collected) and is idempotent; the engine loads again when used after it; `with` closes it."""
    import gc
    import weakref

    import fixtures_hf
    from llmdoctor.subjects.engines import transformers as hf_engine

    _, gguf = fixtures_hf.checkpoint("llama", tmp_path)
    loads = []
    real = hf_engine.load
    monkeypatch.setattr(hf_engine, "load", lambda *a, **k: loads.append(a) or real(*a, **k))
    ids = [3, 17, 42, 5, 77]
    with create("transformers", Deployment(model=gguf, threads=1)) as engine:
        first = engine.run(ids)
        other = engine.run(ids[:3])
        gen = engine.generate(ids, 3)
        held, _ = engine.weights(0)
        assert len(loads) == 1
        assert np.allclose(other.logits, first.logits[:3], atol=1e-5) and len(gen.ids) == 3 and held
        assert list(first.info.as_dict()) == ["engine", "transformers", "dtype", "dequant_kernel", "device"]
        model = weakref.ref(engine._held[0])
        engine.close()
        engine.close()
        assert model() is None
        again = engine.run(ids)
        assert len(loads) == 2 and np.array_equal(again.logits, first.logits)
    assert engine._held is None
    gc.collect()


@pytest.mark.slow
def test_llama_cpp_keeps_one_child_with_its_model_loaded(demo_path):
    """Issue 33: llama.cpp stays isolated in a child process, one for every run and generation of the engine,
    the model loaded in it by the first request only (a later one says it loaded nothing); `close` ends it,
    idempotent."""
    ids = [2, 818, 3823]
    header = {"command": "run", "model_path": str(demo_path), "tokens": ids, "capture": [], "n_threads": 2,
              "flash_attn": False}
    with create("llama.cpp", Deployment(model=demo_path, threads=2)) as engine:
        a = engine.run(ids)
        child = engine.child()
        pid = child._proc.pid
        engine.generate(ids, 1)
        assert child.call(header, b"").header["loaded"] is False
        b = engine.run(ids)
        assert engine.child() is child and child._proc.pid == pid and child.restarts == 0
        assert np.array_equal(a.logits, b.logits)
        engine.close()
        engine.close()
        assert engine._child is None and child._proc is None


@pytest.mark.slow
def test_llama_cpp_runs_and_names_its_captures_as_the_reference(demo_path):
    """One prefill through the interface: logits [T, V] and captures under the reference's point names
    (llama.cpp's `sa_out` is the reference's `ffn_inp`)."""
    from llmdoctor.reference.tokenizer import Tokenizer
    from llmdoctor.gguf import open_gguf

    with open_gguf(demo_path) as g:
        ids = Tokenizer.from_gguf(g).encode("Counting: 1 2 3")
    engine = create("llama.cpp", Deployment(model=demo_path, threads=2))
    assert engine.tokenize("Counting: 1 2 3") == ids  # llama_tokenize as the server does, at parity
    ran = engine.run(ids, None)
    assert ran.logits.shape == (len(ids), 262144)
    assert "ffn_inp-0" in ran.captures and not any(k.startswith("sa_out") for k in ran.captures)
    assert ran.captures["l_out-17"].shape == (len(ids), 640)
    assert engine.noise_budget(ran).emulate is not None  # its arithmetic is emulated, not assumed float32
    assert engine.describe()["llama_cpp_python"]


def test_vllm_gets_a_config_beside_a_lone_gguf(demo_path):
    """vLLM loads a GGUF only with a config.json beside it (issue 25 part 3): for a lone file the adapter
    writes one from the GGUF's metadata into a private folder holding a link to the file (never beside the
    model), removed with the engine; without a tokenizer beside it or --tokenizer, tokenizing is not offered."""
    import gc
    import json
    import os

    engine = create("vllm", Deployment(model=demo_path))
    model = engine.model()
    assert model.is_symlink() and os.readlink(model) == str(demo_path) and model.parent != demo_path.parent
    config = json.loads((model.parent / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["num_hidden_layers"] == 18 and config["vocab_size"] == 262144
    with pytest.raises(NotOffered, match="--tokenizer"):
        engine.tokenize_all(["hi"], [])
    folder = model.parent
    del engine, model
    gc.collect()
    assert not folder.exists()
