"""Shared fixtures. Tests never download anything (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def demo_path():
    """The assembled demo GGUF (Gemma 3 270M Q4_K_M)."""
    from llmdoctor.demo import model_path

    return model_path()


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly (with the reason) where CUDA is not available."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="skipped: no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The deployment's interpreter with vLLM (LLMDOCTOR_VLLM_PYTHON); in CI its absence fails."""
    path = os.environ.get("LLMDOCTOR_VLLM_PYTHON")
    if not path or not Path(path).exists():
        why = f"no vLLM environment (LLMDOCTOR_VLLM_PYTHON={path!r})"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI: {why}; .ci/run builds it")
        pytest.skip(why)
    return path


@pytest.fixture(scope="session")
def demo_tokenizer(demo_path, tmp_path_factory) -> Path:
    """The demo GGUF's tokenizer as transformers converts it (AutoTokenizer with gguf_file=, 50-60 s on 2 loaded
    cores: converted once per session), saved as an HF tokenizer folder; its chat template where the GGUF
    carries one (the demo's carries none)."""
    import transformers

    from llmdoctor.gguf import open_gguf

    out = tmp_path_factory.mktemp("demo-tokenizer")
    tok = transformers.AutoTokenizer.from_pretrained(str(demo_path.parent), gguf_file=demo_path.name)
    with open_gguf(demo_path) as g:
        template = g.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        tok.chat_template = template
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def demo_hf(demo_path, demo_tokenizer, tmp_path_factory) -> Path:
    """The demo GGUF as an HF checkpoint (float32 weights, the GGUF's tokenizer and chat template), as a
    vLLM deployment of the demo model would serve it."""
    import shutil

    import torch

    from llmdoctor.subjects.engines.transformers import build

    out = tmp_path_factory.mktemp("demo-hf")
    model, _ = build(demo_path, torch.float32)
    model.save_pretrained(out)
    shutil.copytree(demo_tokenizer, out, dirs_exist_ok=True)
    return out
