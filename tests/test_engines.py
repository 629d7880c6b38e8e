"""The engine interface (subjects/engines/base.py) and its registry (subjects/engines/__init__.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from llmdoctor.errors import InputError
from llmdoctor.subjects.engines import REGISTRY, create, engine_class, selectable
from llmdoctor.subjects.engines.base import Deployment, Engine, NotOffered

SRC = Path(__file__).resolve().parents[1] / "src" / "llmdoctor"


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
    engine = create("transformers", Deployment(model=Path("x.gguf")))
    with pytest.raises(NotOffered, match="select attention backends"):
        engine.explain_backends()
    with pytest.raises(NotOffered, match="GGUF name map"):
        engine.gguf_name_map({})
    with pytest.raises(NotOffered, match="full distribution"):
        create("endpoint", Deployment(url="http://127.0.0.1:9")).run([1, 2], None)


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
