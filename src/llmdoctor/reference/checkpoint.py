"""The reference's weights from an HF safetensors checkpoint, presented under GGUF names.

Most deployments (vLLM's above all) serve a checkpoint directory, not a GGUF. `Checkpoint(dir)` reads
its config.json into the same `ModelConfig` a GGUF gives (config.from_hf) and lists the tensors of every
`*.safetensors` file in it; `CheckpointWeights` hands its tensors out as forward.py's `Weights` does
(the same methods, so a block cannot tell the two apart). Asked for a GGUF tensor
(`blk.0.attn_q.weight`), it reads the HF tensors gguf/layout.py's plan names for it and applies that
rule's forward transform: the very names and transforms convert_hf_to_gguf.py applies and `check
mapping` inverts (llama's Q/K rope permutation, gemma's +1 norm offset, MLA's kv_b split with k_b
transposed, per-expert tensors stacked). So every block of the reference runs unchanged from either
source, and an F32 GGUF converted from the same checkpoint gives bit-identical weights and logits
(tests/reference/test_reference_hf.py).

Reading is lazy and read-only: one safe_open handle per shard (its header parsed once), tensors read from
safetensors' mmap when a block asks for them; an embedding lookup reads only the rows it needs, the output
projection `vocab_chunk` rows at a time, one MoE expert only that expert's tensors.

Precision: a tensor is widened exactly to float32 (float64 for a float64 run) before its transform, so
gemma's 1 + w is computed as transformers computes it (in float32 over the widened weight), then cast to
the run's dtype.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

import torch

from ..errors import InputError
from ..gguf import layout
from ..hf_config import read_hf_config, text_config
from .config import ModelConfig, from_hf

# safetensors dtype names (the header's "dtype") the reference widens exactly; a quantized checkpoint
# (FP8 with weight_scale_inv, GPTQ/AWQ int packs) needs its scales applied first and is refused by name.
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
INDEX = "model.safetensors.index.json"  # a sharded checkpoint's tensor -> shard map (transformers' name)


class SafetensorsDir:
    """Every tensor of a directory's safetensors files, read on demand through safe_open's mmap, as stored
    (the reference's and `check mapping`'s reader). The files: the shards `model.safetensors.index.json`
    names when there is one (as transformers loads a sharded checkpoint; a repository may carry other
    files beside them, e.g. Mistral's consolidated.safetensors), else every `*.safetensors`."""

    def __init__(self, directory: str | os.PathLike):
        from safetensors import safe_open

        self.directory = Path(directory)
        self.files: dict[str, Path] = {}  # tensor name -> its shard
        self._open: dict[Path, Any] = {}
        for p in _shards(self.directory):
            try:
                f = safe_open(str(p), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own SafetensorError (an Exception) on a bad file
                raise InputError(f"{p}: not a readable safetensors file ({e})") from None
            self._open[p] = f
            self.files.update((k, p) for k in f.keys())

    def names(self) -> list[str]:
        return list(self.files)

    def _slice(self, name: str) -> Any:
        path = self.files.get(name)
        if path is None:
            raise InputError(f"{self.directory}: the checkpoint has no tensor {name!r}")
        return self._open[path].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The header's dtype name: F32, BF16, F8_E4M3, ..."""
        return self._slice(name).get_dtype()

    def tensor(self, name: str) -> torch.Tensor:
        self._slice(name)  # InputError when absent
        return self._open[self.files[name]].get_tensor(name)

    def row_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a tensor (slowest dim), reading only their bytes."""
        return self._slice(name)[start:stop]

    def rows(self, name: str, ids: Iterable[int]) -> torch.Tensor:
        """Rows `ids` (any order, repeats allowed) of a tensor, reading only those rows."""
        sl = self._slice(name)
        return torch.stack([sl[i:i + 1][0] for i in ids])

    def close(self) -> None:
        self._open.clear()  # safe_open handles unmap when dropped


def _shards(directory: Path) -> list[Path]:
    index = directory / INDEX
    if not index.is_file():
        return sorted(directory.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / f for f in sorted(set(weight_map.values()))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise InputError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None


def is_checkpoint(path: str | os.PathLike) -> bool:
    """A directory holding a config.json and at least one *.safetensors file."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


class Checkpoint:
    """An HF checkpoint directory as the reference sees it: `config` (ModelConfig from config.json),
    `tensors` (its safetensors) and `rules` (GGUF name -> gguf/layout.py Rule)."""

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory)
        if not self.path.is_dir():
            raise InputError(f"{directory}: not a checkpoint directory")
        self.hf_config = text_config(read_hf_config(self.path))
        self.config: ModelConfig = from_hf(self.hf_config)
        self.tensors = SafetensorsDir(self.path)
        if not self.tensors.files:
            raise InputError(f"{self.path}: no *.safetensors files (the reference needs the checkpoint's weights)")
        self.plan = layout.plan(self.config.arch, self.tensors.names(), self.hf_config)
        self.rules = self.plan.by_target()

    def close(self) -> None:
        self.tensors.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CheckpointWeights:
    """forward.py's `Weights` interface (has, get, rows, slab, row_slices; `qtypes`) with a checkpoint as
    the source: the same GGUF names, the tensors the layout plan's forward transforms make of the
    checkpoint's. Nothing is dequantized (no GGML type is remembered, so an engine's activation
    quantization is not emulated on these weights)."""

    def __init__(self, ckpt: Checkpoint, *, dtype: torch.dtype, device: torch.device, cache: bool):
        self.ckpt, self.rules = ckpt, ckpt.rules
        self.dtype, self.device, self.cache = dtype, device, cache
        self.qtypes: dict[int, int] = {}
        self._names = set(self.rules)
        self._cached: dict[str, torch.Tensor] = {}
        self._checked: set[str] = set()  # GGUF names whose sources' dtypes were checked
        # widened precision of the transforms: float32, or float64 for a float64 run
        self._wide = torch.float64 if dtype == torch.float64 else torch.float32

    def _rule(self, name: str) -> layout.Rule:
        rule = self.rules.get(name)
        if rule is None:
            raise InputError(f"{self.ckpt.path}: no checkpoint tensor maps to {name} (architecture {self.ckpt.config.arch})")
        if name not in self._checked:
            for src in rule.sources:
                if (dt := self.ckpt.tensors.dtype(src)) not in _FLOAT_DTYPES:
                    raise InputError(f"{self.ckpt.path}: tensor {src!r} is {dt}: quantized checkpoints are not supported "
                                     f"by the reference (only {', '.join(sorted(_FLOAT_DTYPES))} weights)")
            self._checked.add(name)
        return rule

    def _out(self, w: torch.Tensor) -> torch.Tensor:
        """A private contiguous copy in the run's dtype and device, never a view of the mmap. Fresh memory
        is also what makes the products bit-identical to the GGUF source's: tensors in a safetensors file
        are only 8-byte aligned, and CPU matmul kernels pick their path by the operand's alignment (read in
        place from the mmap, a DeepSeek-V3 MoE layer's expert products differed in the last bits: ffn_out-1
        by 4.8e-7)."""
        out = torch.empty(w.shape, dtype=self.dtype, device=self.device)
        return out.copy_(w)

    def has(self, name: str) -> bool:
        return name in self._names

    def _is_copy(self, name: str) -> bool:
        return self._rule(name).transform == "copy"

    def get(self, name: str) -> torch.Tensor:
        w = self._cached.get(name)
        if w is None:
            rule = self._rule(name)
            src = [self.ckpt.tensors.tensor(s).to(self._wide) for s in rule.sources]
            w = self._out(rule.forward(src)[rule.targets.index(name)])
            if self.cache:
                self._cached[name] = w
        return w

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        if name in self._cached or not self._is_copy(name):
            return self.get(name)[ids.to(self.device)]
        (src,) = self._rule(name).sources
        return self._out(self.ckpt.tensors.rows(src, ids.tolist()).to(self._wide))

    def slab(self, name: str, i: int) -> torch.Tensor:
        rule = self._rule(name)
        if name in self._cached or rule.transform != "stack_experts":
            return self.get(name)[i]
        return self._out(self.ckpt.tensors.tensor(rule.sources[i]).to(self._wide))  # expert i alone

    def row_slices(self, name: str, chunk: int) -> Iterable[torch.Tensor]:
        if self.cache or not self._is_copy(name):
            yield from self.get(name).split(chunk)
            return
        (src,) = self._rule(name).sources
        n_rows = self.ckpt.tensors.shape(src)[0]
        for r in range(0, n_rows, chunk):
            yield self._out(self.ckpt.tensors.row_range(src, r, r + chunk).to(self._wide))
