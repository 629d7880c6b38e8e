"""Manifests: per-tensor sha256 and per-key metadata digests, written once from a known-good copy.

`llmdoctor manifest FILE --out m.json` writes one (so does `verify FILE --manifest-out m.json`, from
the hashes of its own pass: the same document, one read of the file for both); `verify FILE
--manifest m.json` and `diagnose --manifest m.json` name every tensor and key of FILE that differs from it.

What is hashed: a tensor's bytes exactly as stored; a metadata value in its canonical encoding (the
value type, then the value as GGUF stores it in little-endian order, so the digest does not depend on
the file's byte order). The split keys (`split.*`, gguf-py's `Keys.Split`) describe how a model is cut
into files, not the model: they are left out, so a split set and its unsplit file have one manifest.

Speed: tensors are hashed by `os.cpu_count()` threads (hashlib releases the GIL while it hashes) over
the file mapping, with read-ahead advice per tensor; one tensor's sha256 is sequential, so the largest
tensor bounds the time from below.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ...errors import InputError
from ...gguf.reader import GGUFFile, MetadataField, StringArray, TensorInfo
from ...gguf.split import SPLIT_KEYS
from ..base import Finding

SCHEMA = "llmdoctor.manifest/1"
CHECK = "manifest"
_PIECE = 16 << 20  # bytes handed to hashlib per call (the GIL is released for each)


def tensor_sha256(t: TensorInfo) -> str:
    """sha256 of the tensor's bytes as stored (read-ahead advised for the whole tensor first)."""
    t.file.advise(t.offset, t.nbytes)
    h = hashlib.sha256()
    data = t.data
    for i in range(0, t.nbytes, _PIECE):
        h.update(data[i : i + _PIECE])
    return h.hexdigest()


def value_digest(f: MetadataField) -> str:
    """sha256 of a metadata value's canonical encoding (value type, element type, little-endian value)."""
    h = hashlib.sha256(struct.pack("<II", f.type, 0 if f.element_type is None else f.element_type))
    v = f.value
    if isinstance(v, StringArray):
        h.update(np.asarray(v.lengths, "<u8").tobytes())
        if len(v):  # the strings lie back to back in the file, each after its 8-byte length: drop those
            lo, hi = int(v.starts[0]), int(v.starts[-1] + v.lengths[-1])
            keep = np.ones(hi - lo, bool)
            keep[((v.starts[1:] - lo)[:, None] - np.arange(1, 9)).ravel()] = False
            h.update(np.frombuffer(v._buf, np.uint8, hi - lo, lo)[keep].tobytes())
    elif isinstance(v, np.ndarray):
        h.update(np.ascontiguousarray(v, v.dtype.newbyteorder("<")).tobytes())
    elif isinstance(v, str):
        h.update(v.encode("utf-8"))
    else:
        h.update(json.dumps(v).encode())
    return h.hexdigest()


def short_value(v: Any) -> Any:
    """A metadata value as shown in reports: scalars as they are, arrays by length and first items."""
    if isinstance(v, StringArray):
        return {"array": "string", "length": len(v), "first": [v[i] for i in range(min(3, len(v)))]}
    if isinstance(v, np.ndarray):
        return v.tolist() if v.size <= 8 else {"array": str(v.dtype), "length": int(v.size), "first": v[:3].tolist()}
    if isinstance(v, str) and len(v) > 200:
        return v[:200] + f"... ({len(v)} characters)"
    return v


def model_keys(g: GGUFFile) -> dict[str, MetadataField]:
    """The model's metadata: every key of the first shard but the split keys."""
    return {k: f for k, f in g.fields.items() if k not in SPLIT_KEYS}


def hash_tensors(g: GGUFFile, progress: Callable[[int, int, str], None] = lambda done, total, name: None) -> dict[str, str]:
    """name -> sha256 of every tensor, hashed by os.cpu_count() threads, largest tensors first (the
    largest bounds the time, so it starts at once)."""
    order = sorted(g.tensors, key=lambda t: -t.nbytes)
    out: dict[str, str] = {}
    done, total = 0, sum(t.nbytes for t in order)
    with ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="sha256") as pool:
        for t, digest in zip(order, pool.map(tensor_sha256, order)):
            out[t.name] = digest
            done += t.nbytes
            progress(done, total, t.name)
    return {t.name: out[t.name] for t in g.tensors}


def build(g: GGUFFile, progress: Callable[[int, int, str], None] = lambda done, total, name: None,
          hashes: dict[str, str] | None = None) -> dict[str, Any]:
    """The manifest of `g`; `hashes`: its tensors' sha256 already computed (verify's pass), else hashed here."""
    keys = model_keys(g)
    meta = {k: {"type": f.type.name if f.element_type is None else f"{f.type.name}[{f.element_type.name}]",
                "sha256": value_digest(f), "value": short_value(f.value)} for k, f in keys.items()}
    digest = hashlib.sha256("".join(f"{k}\0{meta[k]['sha256']}\n" for k in sorted(meta)).encode()).hexdigest()
    if hashes is None:
        hashes = hash_tensors(g, progress)
    return {
        "schema": SCHEMA,
        "architecture": g.architecture,
        "metadata_digest": digest,
        "metadata": meta,
        "tensors": {t.name: {"type": t.type.name, "ne": list(t.ne), "nbytes": t.nbytes, "sha256": hashes[t.name]}
                    for t in g.tensors},
    }


def load(path: Path) -> dict[str, Any]:
    try:
        m = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: not a readable manifest ({e})") from None
    if not isinstance(m, dict) or m.get("schema") != SCHEMA or not isinstance(m.get("tensors"), dict) \
            or not isinstance(m.get("metadata"), dict):
        raise InputError(f"{path}: not an llmdoctor manifest (schema {SCHEMA})")
    return m


def _f(target: str, status: str, explanation: str, **kw: Any) -> Finding:
    return Finding(CHECK, "gguf", target, status, explanation=explanation, confidence="high", **kw)


def compare(g: GGUFFile, manifest: Path | dict[str, Any],
            progress: Callable[[int, int, str], None] = lambda done, total, name: None,
            built: dict[str, Any] | None = None) -> list[Finding]:
    """One failed finding per tensor or key of `g` that differs from the manifest; one pass when none.
    `built`: g's own manifest where it is already made (verify's pass), else built here."""
    want = manifest if isinstance(manifest, dict) else load(manifest)
    got = build(g, progress) if built is None else built
    out = []
    for k in sorted(set(want["metadata"]) | set(got["metadata"])):
        a, b = want["metadata"].get(k), got["metadata"].get(k)
        if a is None:
            out.append(_f(f"metadata/{k}", "fail", f"key {k} is not in the manifest (value {b['value']!r})",
                          metrics={"file": b["value"]}))
        elif b is None:
            out.append(_f(f"metadata/{k}", "fail", f"key {k} is missing (manifest: {a['value']!r})",
                          metrics={"manifest": a["value"]}))
        elif a["sha256"] != b["sha256"]:
            out.append(_f(f"metadata/{k}", "fail", f"key {k}: manifest {a['value']!r}, file {b['value']!r}",
                          metrics={"manifest": a["value"], "file": b["value"]}))
    for n in list(want["tensors"]) + [n for n in got["tensors"] if n not in want["tensors"]]:
        a, b = want["tensors"].get(n), got["tensors"].get(n)
        if a is None:
            out.append(_f(f"tensor/{n}", "fail", f"tensor {n} is not in the manifest", metrics=b))
        elif b is None:
            out.append(_f(f"tensor/{n}", "fail", f"tensor {n} is missing", metrics={"manifest": a}))
        elif a != b:
            what = [f"{k} {a.get(k)} -> {b[k]}" for k in ("type", "ne", "nbytes") if a.get(k) != b[k]]
            out.append(_f(f"tensor/{n}", "fail", f"tensor {n}: " + ("; ".join(what) or "bytes differ (sha256)"),
                          metrics={"manifest": a, "file": b}))
    if not out:
        out.append(_f("manifest", "pass", f"{len(got['tensors'])} tensors and {len(got['metadata'])} metadata keys "
                      "match the manifest", metrics={"metadata_digest": got["metadata_digest"]}))
    return out
