"""Planted faults in the reference forward pass: the convention bugs a real engine or converter makes.

Each `build(model)` takes a `llmdoctor.reference.ReferenceModel`, changes one convention in place and
returns it. The comparison against llama.cpp (tests/reference/test_reference_dense.py) must flag each one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import register


@register("reference-wrong-rope-base", "engine",
          "RoPE with the wrong base: sliding-window layers use the global base (gemma3: 1e6 instead of "
          "its local 1e4); without a local base, 1e4 and 5e5 are swapped (llama-2 vs llama-3)",
          expect="rope")
def wrong_rope_base(model: Any) -> Any:
    cfg = model.config
    if cfg.rope_base_swa is not None and cfg.rope_base_swa != cfg.rope_base:
        model.config = dataclasses.replace(cfg, rope_base_swa=None)
    else:
        model.config = dataclasses.replace(cfg, rope_base=500_000.0 if cfg.rope_base == 10_000.0 else 10_000.0)
    return model


class _NormUnoffset:
    """Weights whose RMSNorm multipliers lack gemma's +1 (a converter that did not fold (1 + w))."""

    def __init__(self, inner: Any):
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get(self, name: str):
        w = self._inner.get(name)
        return w - 1 if name.endswith("norm.weight") else w


@register("reference-missing-norm-offset", "file",
          "RMSNorm weights without the (1 + w) offset that the GGUF converter folds in for gemma",
          expect="norm")
def missing_norm_offset(model: Any) -> Any:
    model.weights = _NormUnoffset(model.weights)
    return model
