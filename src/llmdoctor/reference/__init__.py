"""The reference: trusted logits and per-layer activations straight from a GGUF file or an HF checkpoint.

    from llmdoctor.reference import load
    model = load(path, dtype=torch.float64)          # device="cuda" works too; path: a .gguf or a checkpoint dir
    logits, acts = model.forward(ids, capture={"l_out-*", "result_norm"})
    model.stats                                       # per-layer max |activation|, inf/NaN counts

Capture point names and the layer-streaming contract: reference/forward.py.
"""

from __future__ import annotations

import torch

from .config import ModelConfig, from_gguf, from_hf
from .forward import ReferenceModel, register_block


def load(path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
         cache: bool = False, emulate=None, dequantizer=None, budget=None, capture_to=None) -> ReferenceModel:
    """Open a GGUF, or an HF checkpoint directory (config.json + safetensors, reference/checkpoint.py),
    for the reference forward pass (weights are dequantized lazily, block by block;
    `cache=True` keeps the dequantized blocks for repeated runs; `emulate` an EnginePrecision from
    reference/emulate.py reproduces an engine's arithmetic, to calibrate noise budgets;
    `dequantizer` swaps in another dequantizer, for op substitution; `budget` a device_cache.DeviceBudget
    bounds the dequantized weights held on `device`; `capture_to` keeps captures there, e.g. "cpu")."""
    return ReferenceModel(path, dtype=dtype, device=device, cache=cache, emulate=emulate, dequantizer=dequantizer,
                          budget=budget, capture_to=capture_to)


__all__ = ["ModelConfig", "ReferenceModel", "from_gguf", "from_hf", "load", "register_block"]
