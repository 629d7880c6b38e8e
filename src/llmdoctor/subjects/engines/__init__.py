"""Engines under test, behind one interface (base.py) and looked up in one registry (here).

`engine_class(name)` is the only place an engine's name is resolved; diagnose and the checks ask the
class for its traits and an instance (`create`) for its runs. Modules load on lookup: an engine's own
library (llama-cpp-python, transformers) is imported only when that engine is used.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path
from typing import Callable, Iterator

from .base import Deployment, Engine, PieceRendering

# name -> "module:class" in this folder
REGISTRY = {
    "llama.cpp": "llama_cpp:LlamaCppEngine",
    "transformers": "transformers:TransformersEngine",
    "vllm": "vllm:VLLMEngine",
    "endpoint": "endpoint:EndpointEngine",
}
# The engine a diagnosis runs when none is named: a GGUF alone in llama.cpp (the built-in engine), an HF
# checkpoint alone in transformers (the in-process engine that runs safetensors).
DEFAULT_FOR_GGUF = "llama.cpp"
DEFAULT_FOR_CHECKPOINT = "transformers"


def engine_class(name: str) -> type[Engine]:
    """The engine registered as `name`; an InputError naming the known ones otherwise."""
    from ...errors import InputError

    if name not in REGISTRY:
        raise InputError(f"unknown engine {name!r} (known: {', '.join(selectable())})")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def create(name: str, deployment: Deployment) -> Engine:
    """An instance of the engine `name` for `deployment`: it loads its model on first use; close it (or use it
    as a context manager) to release it."""
    return engine_class(name)(deployment)


@contextlib.contextmanager
def gguf_pieces(path: str | os.PathLike) -> Iterator[Callable[[int, bool], bytes] | None]:
    """The built-in GGUF engine's rendering of single tokens from the file's vocab (a PieceRendering engine):
    `pieces(token_id, special) -> bytes`; None when it cannot be had (no llama-cpp-python, or it cannot read
    this vocab: the front-end audit's decode parity is then a skip)."""
    try:
        engine = create(DEFAULT_FOR_GGUF, Deployment(model=Path(path)))
        pieces = engine.piece_reader() if isinstance(engine, PieceRendering) else None
    except Exception:  # any failure to read the vocab means no parity, reported as a skip
        pieces = None
    try:
        yield pieces
    finally:
        if pieces is not None:
            pieces.close()


def selectable() -> tuple[str, ...]:
    """The engines `--engine` names (in-process or in their own interpreter; not the endpoint)."""
    return tuple(n for n in REGISTRY if engine_class(n).traits.in_process)


def distributions() -> dict[str, str]:
    """{engine name: the Python distribution whose version identifies it} (the JSON env block)."""
    return {n: engine_class(n).distribution for n in REGISTRY}
