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


@register("reference-rope-pairing", "engine",
          "RoPE pairs taken the other way: by halves (i, i + d/2; llama.cpp NEOX) where the model interleaves "
          "them (2i, 2i + 1; llama.cpp NORM), or the reverse", expect="RoPE applied wrongly")
def rope_pairing(model: Any) -> Any:
    model.config = dataclasses.replace(model.config, rope_neox=not model.config.rope_neox)
    return model


class _QKRowsUnpermuted:
    """Weights whose attn_q / attn_k rows are in HF's rotate-half order under the GGUF's adjacent-pair RoPE."""

    def __init__(self, inner: Any, heads: dict[str, int]):
        self._inner, self._heads = inner, heads

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get(self, name: str):
        from ..gguf.layout import rope_unpermute

        w = self._inner.get(name)
        kind = next((k for k in self._heads if name.endswith(f"{k}.weight")), None)
        return w if kind is None else rope_unpermute(w, self._heads[kind])


@register("reference-qk-rows-unpermuted", "file",
          "attn_q / attn_k rows left in HF's rotate-half order under the GGUF's adjacent-pair RoPE (a converter "
          "that skipped convert_hf_to_gguf's Q/K permutation): a weight fault, not a RoPE one", expect="attn_q")
def qk_rows_unpermuted(model: Any) -> Any:
    cfg = model.config
    if cfg.mla is not None or cfg.rope_neox or cfg.rope_dim != cfg.head_dim:
        raise ValueError("reference-qk-rows-unpermuted needs a dense model with adjacent-pair RoPE on whole heads")
    model.weights = _QKRowsUnpermuted(model.weights, {"attn_q": cfg.n_head, "attn_k": cfg.n_head_kv})
    return model
