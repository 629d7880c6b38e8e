"""A byte budget for the reference's dequantized weights on one device (`diagnose --max-gpu-memory`).

The reference streams a model layer by layer: a layer's weights are dequantized onto the device, used,
and dropped, unless the run caches them for the next run (several reference runs share one diagnosis:
float32, the engine's dtype, op substitutions). A `DeviceBudget` bounds both: every dequantized weight
tensor alive on the device (`track`, counted when made and uncounted by a weakref finalizer when freed)
and what the caches keep (`DeviceCache`, one per reference model, all sharing one budget).

    budget = DeviceBudget(cap_bytes)            # shared by every model of a diagnosis
    budget.require(minimum_bytes(g, itemsize), what)   # InputError when one layer cannot fit
    cache = DeviceCache(budget)                 # dict-like: get, in, [], []=, pin, clear

The cap splits into a working set (`reserve`: the largest one layer's weights need at once, set by
`require`) and what caches may keep (cap - reserve). A cache keeps a tensor only while it fits there;
otherwise the tensor is streamed (used once, freed). Admission while room lasts, not least-recently-used
eviction: the reference visits layers in a loop, and under LRU a loop longer than the cache evicts every
tensor just before its reuse (a hit rate of 0), where keeping the first layers resident gives cap / model.
Cached tensors give way (oldest first) only to a pinned tensor (op substitution's replacements, which the
file no longer describes: kept whatever the room) or to a larger working set (a float64 model built after
a float32 one).

Nothing here is device-specific: on the CPU the same counts hold, which is how CI tests the cap.
"""

from __future__ import annotations

import re
import weakref
from collections import OrderedDict
from typing import Any, Iterator

import torch

from ..errors import InputError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def parse_bytes(text: str, option: str = "--max-gpu-memory") -> int:
    """'8GB', '8G', '512MiB', '1.5GB' or a plain byte count -> bytes (binary units: 1 GB = 2**30 bytes, as
    torch.cuda reports memory). An InputError for anything else."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise InputError(f"{option} {text!r}: expected a positive size such as 8GB, 512MB or a byte count")
    return int(float(m.group(1)) * _UNITS[unit])


def human(n: int) -> str:
    """Bytes in binary units, 3 significant digits: 1.5 GiB, 49.3 KiB."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} bytes"


def _expert_stack(name: str) -> bool:
    return name.endswith("_exps.weight")  # merged [E, out, in] expert tensors: one slab at a time


def minimum_bytes(g: Any, itemsize: int, *, vocab_chunk: int = 2048) -> int:
    """The most weight bytes (in a dtype of `itemsize` bytes) one layer of the reference holds at once:
    every tensor of the layer whole, except merged expert tensors, of which one expert's slab is held at
    a time (arch_deepseek.experts); the output head holds the final norm and `vocab_chunk` rows of the
    output matrix (forward.ReferenceModel). `g`: a GGUFFile (tensors with `.name` and `.shape`)."""
    per_layer: dict[str, int] = {}
    head = 0
    for t in g.tensors:
        numel = 1
        for n in t.shape:
            numel *= int(n)
        m = re.match(r"^blk\.(\d+)\.", t.name)
        if m is None:
            if t.name.startswith(("output.", "token_embd.")):
                head = max(head, min(int(t.shape[0]), vocab_chunk) * (numel // max(int(t.shape[0]), 1)))
            elif t.name.startswith("output_norm."):
                head += numel
            continue
        if _expert_stack(t.name):
            numel //= max(int(t.shape[0]), 1)
        per_layer[m.group(1)] = per_layer.get(m.group(1), 0) + numel
    return max([head, *per_layer.values()]) * itemsize


class DeviceBudget:
    """The byte cap for the reference's weights on one device, and the counts that show it holds:
    `live` (dequantized weight tensors alive now), `peak` (its maximum), `held` (what caches keep)."""

    def __init__(self, cap: int | None):
        self.cap = cap
        self.reserve = 0  # the working set one layer needs (require)
        self.live = self.peak = self.held = 0
        self.tracked = 0  # tensors counted, ever
        self._lru: OrderedDict[tuple[int, str], int] = OrderedDict()  # unpinned entries, oldest first
        self._caches: dict[int, "DeviceCache"] = {}

    def require(self, need: int, what: str) -> None:
        """Reserve `need` bytes of working set (one layer, `what` says of which model); an InputError saying
        the minimum when the cap is smaller."""
        if self.cap is not None and need > self.cap:
            raise InputError(f"--max-gpu-memory {human(self.cap)} is below one layer's weights of {what}: "
                             f"give at least {human(need)} ({need} bytes)")
        self.reserve = max(self.reserve, need)
        while self.cap is not None and self.room < 0 and self._lru:  # a larger working set: the caches give way
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        (cid, name), _ = next(iter(self._lru.items()))
        self._caches[cid]._drop(name)

    @property
    def room(self) -> int | None:
        """Bytes the caches may still keep (None: no cap)."""
        return None if self.cap is None else self.cap - self.reserve - self.held

    def admits(self, nbytes: int) -> bool:
        """Whether a cache could keep `nbytes` more now."""
        return self.cap is None or self.room >= nbytes

    def fits_transient(self, nbytes: int) -> bool:
        """Whether a tensor of `nbytes` may be made whole outside a layer's working set."""
        return self.cap is None or nbytes <= self.reserve or nbytes <= (self.room or 0)

    def track(self, t: torch.Tensor) -> torch.Tensor:
        """Count `t` (a freshly dequantized weight) as alive until it is freed."""
        n = t.numel() * t.element_size()
        self.live += n
        self.tracked += 1
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, n)
        return t

    def _free(self, n: int) -> None:
        self.live -= n

    # ---- the caches' side ----
    def _admit(self, cache: "DeviceCache", name: str, nbytes: int, pinned: bool) -> bool:
        if self.cap is not None:
            while pinned and self.room < nbytes and self._lru:
                self._evict_oldest()
            if not pinned and self.room < nbytes:
                return False
        self.held += nbytes
        if not pinned:
            self._lru[(id(cache), name)] = nbytes
        return True

    def _release(self, cache: "DeviceCache", name: str, nbytes: int) -> None:
        self.held -= nbytes
        self._lru.pop((id(cache), name), None)

    def as_dict(self) -> dict[str, Any]:
        return {"cap_bytes": self.cap, "working_set_bytes": self.reserve, "peak_live_bytes": self.peak,
                "held_bytes": self.held, "tensors_decoded": self.tracked}


class DeviceCache:
    """One model's dequantized tensors by name, kept within a shared DeviceBudget (no budget: unbounded).
    Dict-like where Weights uses it: `get`, `in`, `[name]`, `[name] = t` (kept only if it fits), `pin`,
    `clear`."""

    def __init__(self, budget: DeviceBudget | None = None):
        self.budget = budget or DeviceBudget(None)
        self._t: dict[str, torch.Tensor] = {}
        self.budget._caches[id(self)] = self

    def __contains__(self, name: str) -> bool:
        return name in self._t

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._t[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._t)

    def __len__(self) -> int:
        return len(self._t)

    def get(self, name: str, default: torch.Tensor | None = None) -> torch.Tensor | None:
        return self._t.get(name, default)

    def __setitem__(self, name: str, t: torch.Tensor) -> None:
        self._put(name, t, pinned=False)

    def pin(self, name: str, t: torch.Tensor) -> None:
        self._put(name, t, pinned=True)

    def _put(self, name: str, t: torch.Tensor, pinned: bool) -> None:
        self._drop(name)
        if self.budget._admit(self, name, t.numel() * t.element_size(), pinned):
            self._t[name] = t

    def _drop(self, name: str) -> None:
        t = self._t.pop(name, None)
        if t is not None:
            self.budget._release(self, name, t.numel() * t.element_size())

    def clear(self) -> None:
        for name in list(self._t):
            self._drop(name)
