"""`llmdoctor diff A B`: are two model files (or shard sets) the same model, and where do they differ?

Two GGUF models: metadata keys added, removed or changed (both values; the split keys are left out,
so a split set and its unsplit file are the same model); tensors added or removed, with another type
or shape, or other bytes. Tensors of one shape whose bytes differ are decoded (chunk by chunk, both
sides) and compared: max |a - b|, rel L2 of B against A (checks/metrics.py), the first differing
value and the block holding it in each file, and both sha256.

A GGUF against an HF checkpoint directory: the mapping check's name map, shapes and numeric
comparison (gguf/layout.py's inverse transforms, under the band `check mapping` derives: see
checks/layout/mapping.py), whose findings are reported as they are.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ...gguf import open_gguf
from ...gguf.reader import GGUFFile, TensorInfo
from .. import metrics as M
from ..base import Finding
from .manifest import model_keys, short_value, tensor_sha256, value_digest

CHECK = "diff"
CHUNK_VALUES = 1 << 22  # values per side decoded at a time (16 MiB of float32 each)
_COMPARE_BYTES = 16 << 20

Progress = Callable[[int, int, str], None]  # (bytes done, bytes in all, tensor name)


@dataclass
class Result:
    findings: list[Finding]
    a: str
    b: str
    kind: str  # "gguf" or "hf"
    seconds: float
    summary: dict[str, Any]


def _f(target: str, status: str, explanation: str, **kw: Any) -> Finding:
    return Finding(CHECK, "gguf", target, status, explanation=explanation, **kw)


def _metadata(ga: GGUFFile, gb: GGUFFile) -> list[Finding]:
    ka, kb = model_keys(ga), model_keys(gb)
    out = []
    for k in sorted(set(ka) | set(kb)):
        a, b = ka.get(k), kb.get(k)
        if a is None:
            out.append(_f(f"metadata/{k}", "fail", f"key {k} added in B: {short_value(b.value)!r}",
                          metrics={"b": short_value(b.value)}))
        elif b is None:
            out.append(_f(f"metadata/{k}", "fail", f"key {k} removed in B (A: {short_value(a.value)!r})",
                          metrics={"a": short_value(a.value)}))
        elif value_digest(a) != value_digest(b):
            out.append(_f(f"metadata/{k}", "fail", f"key {k}: A {short_value(a.value)!r}, B {short_value(b.value)!r}",
                          metrics={"a": short_value(a.value), "b": short_value(b.value)}))
    if not out:
        out.append(_f("metadata", "pass", f"{len(ka)} metadata keys identical"))
    return out


def _first_byte_difference(a: TensorInfo, b: TensorInfo) -> int | None:
    """Index of the first byte where two tensors of one type and shape differ, or None."""
    da, db = a.data, b.data
    for i in range(0, a.nbytes, _COMPARE_BYTES):
        ne = np.flatnonzero(da[i : i + _COMPARE_BYTES] != db[i : i + _COMPARE_BYTES])
        if ne.size:
            return i + int(ne[0])
    return None


def _numeric(a: TensorInfo, b: TensorInfo) -> dict[str, Any]:
    """Decode both (rows of CHUNK_VALUES at a time) and compare: max |a - b|, rel L2 of b against a,
    the first differing value."""
    from ...gguf.dequant import dequantize

    shape = a.shape
    row = shape[-1]
    n_rows = a.n_elements // row
    step = max(1, CHUNK_VALUES // row)
    ra, rb = a.data.reshape(n_rows, -1), b.data.reshape(n_rows, -1)
    buf_a = torch.empty(min(step, n_rows) * row)
    buf_b = torch.empty_like(buf_a)
    err = ref = 0.0
    worst, first = 0.0, None
    for r0 in range(0, n_rows, step):
        r1 = min(r0 + step, n_rows)
        va = dequantize(ra[r0:r1].reshape(-1), a.type, (r1 - r0, row), out=buf_a[: (r1 - r0) * row].view(r1 - r0, row))
        vb = dequantize(rb[r0:r1].reshape(-1), b.type, (r1 - r0, row), out=buf_b[: (r1 - r0) * row].view(r1 - r0, row))
        e, w = M.sq_sums(vb, va)
        err, ref = err + e, ref + w
        m = M.max_abs_diff(vb, va)
        if math.isnan(m) or m > worst:  # a NaN, once seen, stays
            worst = m
        if first is None:
            differs = (va.view(-1) != vb.view(-1)) & ~(va.view(-1).isnan() & vb.view(-1).isnan())
            idx = differs.nonzero()
            if idx.numel():
                first = r0 * row + int(idx[0, 0])
    out: dict[str, Any] = {"max_abs_diff": worst, "rel_l2": M.rel_l2_from_sums(err, ref)}
    if first is not None:
        ba, bb = first // a.block_size, first // b.block_size
        out["first_differing_value"] = first
        out["first_differing_block"] = {"a": {"block": ba, "offset": a.offset + ba * a.type_size, "file": a.path},
                                        "b": {"block": bb, "offset": b.offset + bb * b.type_size, "file": b.path}}
    return out


def _tensors(ga: GGUFFile, gb: GGUFFile, progress: Progress) -> list[Finding]:
    out, same, done, total = [], 0, 0, sum(t.nbytes for t in ga.tensors)
    for t in ga.tensors:
        done += t.nbytes
        progress(done, total, t.name)
        if not gb.has_tensor(t.name):
            out.append(_f(f"tensor/{t.name}", "fail", f"tensor {t.name} removed in B"))
            continue
        u = gb.tensor(t.name)
        if t.shape != u.shape:
            out.append(_f(f"tensor/{t.name}", "fail", f"tensor {t.name}: shape {list(t.shape)} in A, {list(u.shape)} in B",
                          metrics={"a": {"type": t.type.name, "shape": list(t.shape)},
                                   "b": {"type": u.type.name, "shape": list(u.shape)}}))
            continue
        if t.type == u.type and _first_byte_difference(t, u) is None:
            same += 1
            continue
        m = {"a": {"type": t.type.name, "sha256": tensor_sha256(t)}, "b": {"type": u.type.name, "sha256": tensor_sha256(u)}}
        if t.file.byte_order == u.file.byte_order == "<":
            m.update(_numeric(t, u))
        else:  # the decoders read little-endian blocks
            m.update(max_abs_diff=math.nan, rel_l2=math.nan, numeric="skipped: a big-endian file")
        what = f"type {t.type.name} -> {u.type.name}" if t.type != u.type else "bytes differ"
        blk = m.get("first_differing_block")
        where = f", first at value {m['first_differing_value']} (block {blk['a']['block']} at offset " \
                f"{blk['a']['offset']} of A)" if blk else ", not decoded: a big-endian file" if "numeric" in m \
            else ", but every decoded value is equal"
        out.append(_f(f"tensor/{t.name}", "fail", f"tensor {t.name}: {what}; max |diff| {m['max_abs_diff']:.4g}, "
                      f"rel L2 {m['rel_l2']:.4g}{where}", metrics=m))
    for u in gb.tensors:
        if not ga.has_tensor(u.name):
            out.append(_f(f"tensor/{u.name}", "fail", f"tensor {u.name} added in B ({u.type.name} {list(u.shape)})"))
    if same == len(ga.tensors) == len(gb.tensors):
        out.append(_f("tensors", "pass", f"{same} tensors identical (type, shape, bytes)"))
    elif same:
        out.append(_f("tensors/identical", "pass", f"{same} tensors identical (type, shape, bytes)"))
    return out


def run(a: Path, b: Path, *, progress: Progress = lambda done, total, name: None) -> Result:
    """Compare model A (a GGUF or any shard of a set) with B (the same, or an HF checkpoint directory)."""
    t0 = time.perf_counter()
    if Path(b).is_dir():
        from ..layout import mapping

        res = mapping.run(a, b)
        keep = [f for f in res.findings if f.target.split("/")[0] in ("names", "shape", "numeric", "collision")]
        return Result(keep, str(a), str(b), "hf", time.perf_counter() - t0, {"hf_source": res.hf_source})
    with open_gguf(a) as ga, open_gguf(b) as gb, torch.inference_mode():
        findings = _metadata(ga, gb) + _tensors(ga, gb, progress)
        summary = {"a": {"shards": len(ga.shards), "tensors": len(ga.tensors), "bytes": ga.total_size},
                   "b": {"shards": len(gb.shards), "tensors": len(gb.tensors), "bytes": gb.total_size}}
    return Result(findings, str(a), str(b), "gguf", time.perf_counter() - t0, summary)
