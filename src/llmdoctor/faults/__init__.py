"""The one registry of planted faults: hostile files, corrupted models, faulty kernels and engines.

Tests plant faults from here and `diagnose --demo-fault` uses the same entries. Each fault has a
name, a kind, a one-line description, a builder and what a correct diagnosis must say (`expect`).
Modules that define faults register them at import; `all_faults()` imports them all.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

_MODULES = ("llmdoctor.faults.hostile_files", "llmdoctor.faults.reference", "llmdoctor.faults.reference_mla",
            "llmdoctor.faults.endpoint", "llmdoctor.faults.kernels", "llmdoctor.faults.demo",
            "llmdoctor.faults.attention", "llmdoctor.faults.mapping", "llmdoctor.faults.checkpoint",
            "llmdoctor.faults.file_corruptions", "llmdoctor.faults.decode",
            "llmdoctor.faults.sharding", "llmdoctor.faults.frontend")


@dataclass(frozen=True)
class Fault:
    name: str
    kind: str  # "hostile-file", "hostile-split", "file", "kernel", "engine", "endpoint", "frontend"
    description: str
    build: Callable[..., Any]
    expect: str  # a substring (or name) the right diagnosis contains


_REGISTRY: dict[str, Fault] = {}


def register(name: str, kind: str, description: str, expect: str) -> Callable:
    """Decorator: register `build` under `name`. Names are unique across all kinds."""

    def deco(build: Callable) -> Callable:
        if name in _REGISTRY:
            raise ValueError(f"fault {name!r} registered twice")
        _REGISTRY[name] = Fault(name, kind, description, build, expect)
        return build

    return deco


def _load() -> None:
    for m in _MODULES:
        importlib.import_module(m)


def all_faults(kind: str | None = None) -> list[Fault]:
    _load()
    return [f for f in _REGISTRY.values() if kind is None or f.kind == kind]


def get(name: str) -> Fault:
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown fault {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
