"""The attention shapes `check attention` runs at: a model's dense (prefill) view plus its MLA latent
view, from a preset, an HF config or a GGUF."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ...errors import InputError
from ...reference import mla as mla_ref


@dataclass(frozen=True)
class Shape:
    """A model's attention shape: the dense (prefill) view, plus the MLA latent view when it has one."""

    name: str
    n_head: int
    n_head_kv: int
    head_dim: int  # Dqk of the prefill contract (MLA: qk_nope + qk_rope, the naive form)
    head_dim_v: int
    scale: float
    window: Optional[int] = None  # sliding window of the model (keys seen, own included)
    softcap: Optional[float] = None
    mla: Optional[mla_ref.MLA] = None

    @property
    def top_k(self) -> int:
        return self.mla.indexer.top_k if self.mla and self.mla.indexer else 0


def _mla_shape(name: str, m: mla_ref.MLA, n_head: int) -> Shape:
    return Shape(name, n_head, n_head, m.qk_dim, m.v_dim, mla_ref.kq_scale(m), mla=m)


# Numbers from the models' HF configs (GLM-5's as issue 6 gives them).
PRESETS: dict[str, Shape] = {
    "glm-5": _mla_shape("glm-5", mla_ref.MLA(2048, 512, 192, 64, 256, indexer=mla_ref.Indexer(32, 128, 2048, (True,))),
                        64),
    "deepseek-v3": _mla_shape("deepseek-v3", mla_ref.MLA(1536, 512, 128, 64, 128,
                                                         yarn=mla_ref.Yarn(40.0, 4096, 32.0, 1.0, 1.0)), 128),
    "gemma3-270m": Shape("gemma3-270m", 4, 1, 256, 256, 1 / math.sqrt(256), window=512),
    "llama-3-8b": Shape("llama-3-8b", 32, 8, 128, 128, 1 / math.sqrt(128)),
}


def shape_from_config(cfg: Any, name: str) -> Shape:
    """Shape of a `reference.config.ModelConfig` (from a GGUF or an HF config)."""
    if cfg.mla is not None:
        return _mla_shape(name, cfg.mla, cfg.n_head)
    return Shape(name, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v, cfg.attn_scale,
                 window=cfg.sliding_window, softcap=cfg.attn_softcap)


def load_shape(preset: Optional[str], config: Optional[Path], gguf_file: Optional[Path]) -> Shape:
    given = [x for x in (preset, config, gguf_file) if x is not None]
    if len(given) > 1:
        raise InputError("give one of --preset, --config, --gguf")
    from ...reference import config as cfgmod

    if config is not None:
        return shape_from_config(cfgmod.from_hf(config), str(config))
    if gguf_file is not None:
        from ...gguf import open_gguf

        with open_gguf(gguf_file) as g:
            return shape_from_config(cfgmod.from_gguf(g), str(gguf_file))
    preset = preset or "glm-5"
    if preset not in PRESETS:
        raise InputError(f"--preset {preset!r}: expected one of {', '.join(PRESETS)}")
    return PRESETS[preset]
