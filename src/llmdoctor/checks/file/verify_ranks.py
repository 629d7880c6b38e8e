"""`verify --gpus N`: verify's single-device pass spread over N ranks with torch.distributed.

The tensors, in file order (shard by shard for a split model), are cut into N contiguous runs of about
equal bytes, so that each rank reads one stretch of the file sequentially, as the single pass does.
Rank r runs verify's own pass (checks/file/verify.py `run`, restricted to its share by its `tensors`
argument) on GPU r (NCCL) or as one CPU process (gloo); its `combine` hook gathers every rank's
per-tensor reports (with their sha256, where a manifest is asked for) and forensic statistics on rank
0, which then builds the report one device would have built: per-tensor findings in file order, the
forensics' sibling comparison over all tensors, the manifest comparison and document. The processes are started
by llmdoctor itself (reference/tensor_parallel.launch: torch.multiprocessing spawn; NCCL with NVLink multicast off).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...errors import InputError
from ...gguf import open_gguf
from ...reference import tensor_parallel as tp


def shares(path: Path, n: int) -> list[list[str]]:
    """Tensor names per rank: contiguous runs of the file order, a tensor going to the rank whose
    1/n of the bytes holds its middle byte (so each share is within one tensor of total / n bytes; a
    rank may get nothing when one tensor is larger than a share)."""
    with open_gguf(path) as g:
        order = [(t.name, t.nbytes) for s in g.shards for t in sorted(s.file_tensors, key=lambda t: t.offset)]
    total = max(sum(b for _, b in order), 1)
    out: list[list[str]] = [[] for _ in range(n)]
    done = 0
    for name, nbytes in order:
        out[min(n - 1, (2 * done + nbytes) * n // (2 * total))].append(name)
        done += nbytes
    return out


def _rank(rank: int, n: int, device: torch.device, path: str, mine: list[list[str]], manifest: str | None,
          write_manifest: bool) -> Any:
    from . import verify

    def combine(reports: list, stats: list) -> tuple[list, list] | None:
        parts: list[Any] = [None] * n if rank == 0 else None
        dist.gather_object((reports, stats), parts, dst=0)
        if rank != 0:
            return None
        return [r for p in parts for r in p[0]], [s for p in parts for s in p[1]]  # ranks hold file-order runs

    return verify.run(Path(path), device=device.type, tensors=set(mine[rank]), combine=combine,
                      manifest=None if manifest is None else Path(manifest), write_manifest=write_manifest)


def run(path: Path, n: int, *, device: str = "cpu", manifest: Path | None = None, write_manifest: bool = False) -> Any:
    """verify.run's Result for the whole model, computed by N ranks; `seconds` is the wall time of the
    launch (process start included), `bytes` the whole model's."""
    if n < 1:
        raise InputError(f"--gpus {n}: needs at least 1 rank")
    tp.check_devices(n, device)
    mine = shares(path, n)
    t0 = time.perf_counter()
    res = tp.launch(n, _rank, (str(path), mine, None if manifest is None else str(manifest), write_manifest),
                    device=device)
    res.seconds = time.perf_counter() - t0
    return res
