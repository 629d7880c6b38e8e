"""The named step between the engine's runs and the reference's: what the reference takes from the engine, read
from the engine's runs only (they come first; nothing here changes them).

1. The model it reads. An engine that cannot run a GGUF may run the HF checkpoint beside it (vLLM: its run's
   `RunInfo.reference_reads`); the reference then reads that checkpoint too, so that the engine is compared with
   the model it ran. Only where the engine may do so (`may_substitute`) does this wait for the engine's run.
2. The engine's discrete choices (DSA key selections, MoE experts), which every reference run of the same tokens
   replays. The model does not say which of the keys or experts tied (or within rounding of a tie) at the k-th
   score to take: ReLU index scores are often exactly 0, and a router's near-tie flips under any other
   arithmetic, which moves the output far more than the arithmetic itself. Whether each choice is one the
   scores allow is the dsa-selection and moe-routing checks' business (checks/compute/routing.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..subjects.engines.base import EngineRun
from .inputs import Inputs


def may_substitute(inputs: Inputs) -> bool:
    """Whether the engine may run the HF checkpoint in place of the GGUF: one is given beside the GGUF and the
    engine runs checkpoints."""
    from ..reference.checkpoint import is_checkpoint
    from ..subjects.engines import engine_class

    return (inputs.engine is not None and inputs.gguf is not None and inputs.hf is not None
            and "hf" in engine_class(inputs.engine).traits.formats and is_checkpoint(inputs.hf))


def reads(run: EngineRun) -> Path | None:
    """The checkpoint the engine ran in place of the GGUF, or None (it ran what it was given)."""
    return Path(run.info.reference_reads) if run.info.reference_reads else None


def choices(cfg: Any, captures: dict[str, Any], n_tokens: int, device: str) -> dict | None:
    """The reference's per-run state from one engine run's captures of `n_tokens` tokens: {DSA_OVERRIDE: {layer:
    keys [T, top_k]}, MOE_OVERRIDE: {layer: experts [T, n_used]}} (reference/arch_deepseek.py), only what the
    model has and the engine exposed; None when nothing."""
    from ..reference.arch_deepseek import DSA_OVERRIDE, MOE_OVERRIDE

    indexer = cfg.mla is not None and cfg.mla.indexer is not None
    dsa, moe = {}, {}
    for il in range(cfg.n_layer):
        sel = captures.get(f"top_k-{il} (view)", captures.get(f"top_k-{il}"))
        if sel is not None and indexer:
            dsa[il] = torch.as_tensor(np.asarray(sel, dtype=np.int64), device=device)
        experts = captures.get(f"ffn_moe_topk-{il}")
        if experts is not None and cfg.moe is not None and np.shape(experts) == (n_tokens, cfg.moe.n_used):
            moe[il] = torch.as_tensor(np.asarray(experts, dtype=np.int64), device=device)
    extra = {k: v for k, v in ((DSA_OVERRIDE, dsa), (MOE_OVERRIDE, moe)) if v}
    return extra or None


def has_choices(cfg: Any) -> bool:
    """Whether the model makes discrete choices an engine may make otherwise (MoE routing, a DSA indexer)."""
    return cfg.moe is not None or (cfg.mla is not None and cfg.mla.indexer is not None)


def unseen(cfg: Any, replayed: dict) -> bool:
    """Whether a kind of discrete choice the model makes is missing from `replayed` (choices' answer, {} for none):
    a DSA indexer's keys or MoE experts the engine did not expose."""
    from ..reference.arch_deepseek import DSA_OVERRIDE, MOE_OVERRIDE

    indexer = cfg.mla is not None and cfg.mla.indexer is not None
    return (indexer and DSA_OVERRIDE not in replayed) or (cfg.moe is not None and MOE_OVERRIDE not in replayed)
