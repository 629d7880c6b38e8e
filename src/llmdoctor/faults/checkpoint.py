"""Planted faults in an HF checkpoint: the engine's copy of a safetensors checkpoint differs from the
one the reference reads (a bad shard, a botched re-save or merge). Tests run diagnose with the reference
on the original and the engine on the copy (`Inputs.engine_hf`)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from . import register


@register("checkpoint-scaled-tensor", "engine",
          "the engine's copy of the checkpoint has tensors scaled (names, or a predicate on the name)",
          expect="first divergent layer")
def scaled_tensor(src: str | Path, dst: str | Path, names: set[str] | Callable[[str], bool], scale: float) -> Path:
    """A copy of checkpoint directory `src` at `dst` whose tensors `names` are multiplied by `scale`
    (each shard rewritten with safetensors, its metadata kept); the other files are copied as they are."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    pick = names if callable(names) else (lambda n: n in names)
    hit = False
    for shard in sorted(dst.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        picked = [k for k in tensors if pick(k)]
        if picked:
            hit = True
            for k in picked:
                tensors[k] = tensors[k] * scale
            save_file(tensors, str(shard), metadata=meta)
    if not hit:
        raise ValueError(f"{src}: no tensor picked")
    return dst
