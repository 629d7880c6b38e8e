"""Shared fixtures. Tests never download anything (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import os

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
