"""Split GGUF models: the shards `<prefix>-%05d-of-%05d.gguf` opened and validated as one model
(`open_gguf`, the way every model file is opened: a lone file is a set of one).

The layout is llama.cpp's gguf-split (tools/gguf-split/gguf-split.cpp, and gguf-py's GGUFWriter with
`split_max_tensors`): the first shard holds every metadata key; every shard holds `split.no` (its
0-based index), `split.count` and `split.tensors.count` (the model's total number of tensors); the
tensors follow in order, each in exactly one shard. The file names are llama.cpp's `llama_split_path`
("%s-%05d-of-%05d.gguf", 1-based). Key names come from gguf-py's `Keys.Split`.

The set is validated like a single file (each shard is a hardened `GGUFFile`), plus: every shard
present, the same `split.count` in each, `split.no` 0..n-1 each exactly once and matching the file
name, no tensor name in two shards, `split.tensors.count` equal to the tensors found, one byte order.
A violation is a `GGUFError` naming the shard (its path) and the problem.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gguf import GGUFValueType, Keys

from ..errors import GGUFError
from .reader import GGUFFile

SPLIT_NO = Keys.Split.LLM_KV_SPLIT_NO
SPLIT_COUNT = Keys.Split.LLM_KV_SPLIT_COUNT
SPLIT_TENSORS_COUNT = Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT
SPLIT_KEYS = frozenset((SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS_COUNT))  # per shard, not the model's metadata

SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5,})-of-(?P<count>\d{5,})\.gguf$")
_INTEGER_TYPES = frozenset((GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
                            GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64))


def shard_path(prefix: str, no: int, count: int) -> str:
    """llama.cpp's llama_split_path: shard `no` (0-based) of `count`."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def _int(g: GGUFFile, key: str) -> int | None:
    f = g.fields.get(key)
    if f is None:
        return None
    if f.type not in _INTEGER_TYPES:
        raise GGUFError(f"{key} must be an integer, got {f.type.name}", f.offset, g.path)
    return int(f.value)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open and index a GGUF model read-only: a file, or the whole split set of which `path` is any
    shard. Raises `GGUFError` on any format or safety violation, naming the file (shard) at fault.
    A lone file (no `split.count`, or 1) is its own `GGUFFile`; a set is joined into its first shard's.
    Closes what it opened when the set is invalid."""
    g = GGUFFile(path)
    try:
        count = _int(g, SPLIT_COUNT)
        if count is None or count == 1:
            _check_lone(g, count)
            return g
        return _join(g, count)
    except BaseException:
        g.close()
        raise


def _check_lone(g: GGUFFile, count: int | None) -> None:
    if count is None:
        return
    no, total = _int(g, SPLIT_NO), _int(g, SPLIT_TENSORS_COUNT)
    if no not in (None, 0):
        raise GGUFError(f"split.no {no} but split.count 1", g.fields[SPLIT_NO].offset, g.path)
    if total is not None and total != len(g.tensors):
        raise GGUFError(f"split.tensors.count {total} but the file holds {len(g.tensors)} tensors",
                        g.fields[SPLIT_TENSORS_COUNT].offset, g.path)


def _join(g: GGUFFile, count: int) -> GGUFFile:
    if count < 1:
        raise GGUFError(f"split.count {count} (must be >= 1)", g.fields[SPLIT_COUNT].offset, g.path)
    m = SHARD_NAME.match(os.path.basename(g.path))
    if m is None or int(m["count"]) != count:
        raise GGUFError(f"split.count {count}, but the name does not follow <name>-NNNNN-of-{count:05d}.gguf",
                        None, g.path)
    mine = int(m["no"]) - 1
    prefix = os.path.join(os.path.dirname(g.path), m["prefix"])
    shards: list[GGUFFile] = []
    try:
        for i in range(count):
            path = shard_path(prefix, i, count)
            if i == mine:
                shards.append(g)
            elif not os.path.exists(path):
                raise GGUFError(f"shard {i + 1} of {count} is missing", None, path)
            else:
                shards.append(GGUFFile(path))
            _check_shard(shards[0], shards[i], i, count)
        _check_tensors(shards)
    except BaseException:
        for s in shards:
            if s is not g:
                s.close()
        raise
    first = shards[0]
    first.shards = shards
    first.tensors = [t for s in shards for t in s.file_tensors]
    first._tensor_index = {t.name: i for i, t in enumerate(first.tensors)}
    return first


def _check_shard(first: GGUFFile, s: GGUFFile, i: int, count: int) -> None:
    """Shard i's split keys against its place in the set."""
    for key, want in ((SPLIT_COUNT, count), (SPLIT_NO, i)):
        got = _int(s, key)
        if got is None:
            raise GGUFError(f"shard {i + 1} of {count} has no {key}", None, s.path)
        if got != want:
            raise GGUFError(f"{key} is {got}, expected {want} (shard {i + 1} of {count} by its name)",
                            s.fields[key].offset, s.path)
    if s.byte_order != first.byte_order:
        raise GGUFError(f"byte order differs from the first shard's ({Path(first.path).name})", 4, s.path)


def _check_tensors(shards: list[GGUFFile]) -> None:
    """No tensor in two shards; split.tensors.count (where a shard has it) equal to the tensors found."""
    seen: dict[str, GGUFFile] = {}
    for s in shards:
        for t in s.file_tensors:
            other = seen.setdefault(t.name, s)
            if other is not s:
                raise GGUFError(f"tensor {t.name!r} is also in {Path(other.path).name}", t.info_offset, s.path)
    for s in shards:
        total = _int(s, SPLIT_TENSORS_COUNT)
        if s is shards[0] and total is None:
            raise GGUFError(f"the first shard has no {SPLIT_TENSORS_COUNT}", None, s.path)
        if total is not None and total != len(seen):
            raise GGUFError(f"{SPLIT_TENSORS_COUNT} is {total}, but the {len(shards)} shards hold {len(seen)} "
                            "tensors", s.fields[SPLIT_TENSORS_COUNT].offset, s.path)


def first_shard(path: str | os.PathLike) -> Path:
    """The first shard of the set `path` belongs to (by name), or `path` itself: what engines that
    find the other shards on their own (llama.cpp) must be given."""
    p = Path(path)
    m = SHARD_NAME.match(p.name)
    if m is None:
        return p
    return Path(shard_path(str(p.with_name(m["prefix"])), 0, int(m["count"])))
