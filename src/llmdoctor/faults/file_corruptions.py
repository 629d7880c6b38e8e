"""Corrupted copies of a GGUF: the damage weight forensics (checks/file/forensics.py) is asked to see.

Every builder has the signature `build(src, out_dir, *, tensor=..., seed=0) -> Path`: it copies `src`
(opened read-only) into `out_dir` and patches bytes of the copy in place (same size, same layout).
`expect` says whether a lone file's statistics can find it ("forensics") or cannot ("unseen: ...").
`attn-block-scales` (every attn_output's block scales x U(-2, 2)) and `subblock-scales` (bytes of a
K-quant tensor's packed sub-block scales changed) live here too; `mapping-swap-layers`
(two layers' tensors exchanged, faults/mapping.py) completes the set.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from ..checks.file.block_scales import SCALE_FIELDS
from ..checks.file.subblock_codes import SUBBLOCKS
from ..gguf import open_gguf
from . import register


_INT_TYPES = {VT.UINT32: "<u4", VT.INT32: "<i4", VT.UINT64: "<u8", VT.INT64: "<i8"}


def _info(src: Path, tensor: str) -> tuple:
    """`tensor`'s (offset, nbytes, type, type_size, shape) in `src`."""
    with open_gguf(src) as g:
        if not g.has_tensor(tensor):
            raise ValueError(f"{src}: no tensor {tensor!r}")
        t = g.tensor(tensor)
        return t.offset, t.nbytes, t.type, t.type_size, t.shape


def _patch(src: Path, out_dir: Path, tag: str, tensor: str) -> tuple[Path, np.memmap, object]:
    """A copy of `src` as `<stem>.<tag>.gguf`, mapped writable, and `tensor`'s info (from the source)."""
    info = _info(src, tensor)
    dst = Path(out_dir) / f"{Path(src).stem}.{tag}.gguf"
    shutil.copyfile(src, dst)
    return dst, np.memmap(dst, dtype=np.uint8, mode="r+"), info


def _blocks(mm: np.memmap, info) -> np.ndarray:
    offset, nbytes, _, type_size, _ = info
    return mm[offset:offset + nbytes].reshape(-1, type_size)  # [n_blocks, type_size], writable view


def _d_field(qtype: QT):
    fields = [f for f in SCALE_FIELDS.get(QT(qtype), ()) if f.name == "d" and f.encoding == "f16"]
    if not fields:
        raise ValueError(f"{QT(qtype).name} has no float16 block scale d")
    return fields[0]


def _perturb_d(blocks: np.ndarray, qtype: QT, rng: np.random.Generator) -> None:
    """Multiply every block's float16 scale d (at its own offset in the block) by U(-2, 2), in place.
    blocks: [n_blocks, type_size] writable bytes."""
    f = _d_field(qtype)
    field = blocks[:, f.offset:f.offset + 2]  # [n_blocks, 2] bytes of d
    d = np.ascontiguousarray(field).view("<f2")[:, 0].astype(np.float32)
    d *= rng.uniform(-2.0, 2.0, size=d.shape).astype(np.float32)
    field[:] = d.astype("<f2").view(np.uint8).reshape(-1, 2)


@register("scale-noise", "file", "one tensor's block scales d multiplied by U(-2, 2) noise (seeded), any block type",
          expect="forensics")
def scale_noise(src: Path, out_dir: Path, *, tensor: str = "blk.1.ffn_down.weight", seed: int = 0) -> Path:
    """d of every block of `tensor`, at d's own offset for every type (Q6_K, Q3_K, Q2_K keep it at the end)."""
    dst, mm, info = _patch(src, out_dir, "scale-noise", tensor)
    _perturb_d(_blocks(mm, info), info[2], np.random.default_rng(seed))
    mm.flush()
    return dst


@register("attn-block-scales", "file",
          "attn_output weights of every layer: each block's fp16 scale multiplied by a random factor in [-2, 2]",
          "reference-mismatch")
def attn_block_scales(src: Path, out_dir: Path, *, seed: int = 0, layers: str = "attn_output") -> Path:
    """`scale-noise` on every `layers` tensor of the model that has a float16 block scale d."""
    rng = np.random.default_rng(seed)
    with open_gguf(src) as g:
        targets = [(t.offset, t.nbytes, t.type, t.type_size, t.shape) for t in g.tensors
                   if t.name.endswith(f"{layers}.weight") and any(f.name == "d" and f.encoding == "f16"
                                                                   for f in SCALE_FIELDS.get(QT(t.type), ()))]
    dst = Path(out_dir) / f"{Path(src).stem}.attn-scales.gguf"
    shutil.copyfile(src, dst)
    mm = np.memmap(dst, dtype=np.uint8, mode="r+")
    for info in targets:
        _perturb_d(_blocks(mm, info), info[2], rng)
    mm.flush()
    del mm
    return dst


@register("scale-inf", "file", "one block scale d of one tensor set to +inf", expect="forensics")
def scale_inf(src: Path, out_dir: Path, *, tensor: str = "blk.7.attn_output.weight", block: int = 3) -> Path:
    dst, mm, info = _patch(src, out_dir, "scale-inf", tensor)
    f = _d_field(info[2])
    _blocks(mm, info)[block, f.offset:f.offset + 2] = np.array([np.inf], "<f2").view(np.uint8)
    mm.flush()
    return dst


@register("q4k-d-dmin-swap", "file", "a Q4_K tensor whose d and dmin are exchanged in every block",
          expect="forensics")
def q4k_d_dmin_swap(src: Path, out_dir: Path, *, tensor: str | None = None) -> Path:
    """`tensor` defaults to the first Q4_K tensor inside the blocks (blk.N.*)."""
    if tensor is None:
        with open_gguf(src) as g:
            tensor = next((t.name for t in g.tensors if t.type == QT.Q4_K and t.name.startswith("blk.")), None)
        if tensor is None:
            raise ValueError(f"{src}: no Q4_K tensor")
    dst, mm, info = _patch(src, out_dir, "d-dmin-swap", tensor)
    if info[2] != QT.Q4_K:
        raise ValueError(f"{tensor} is {QT(info[2]).name}, not Q4_K")
    b = _blocks(mm, info)
    d, dmin = (next(f for f in SCALE_FIELDS[QT.Q4_K] if f.name == n).offset for n in ("d", "dmin"))
    b[:, [d, d + 1, dmin, dmin + 1]] = b[:, [dmin, dmin + 1, d, d + 1]]
    mm.flush()
    return dst


@register("subblock-scales", "file",
          "K-quant tensors: one byte of the packed sub-block scales changed in a share of their blocks (seeded)",
          expect="forensics")
def subblock_scales(src: Path, out_dir: Path, *, tensor: str | tuple[str, ...] = "blk.1.ffn_down.weight",
                    fraction: float = 0.05, seed: int = 0) -> Path:
    """In `fraction` of each named tensor's blocks (at least one, chosen at random), one byte of the
    sub-block codes (gguf/block_layout.py: where each K-quant keeps them) XORed with a random
    nonzero byte. `tensor`: one name or several (one copy, each patched)."""
    names = (tensor,) if isinstance(tensor, str) else tuple(tensor)
    dst, mm, info = _patch(src, out_dir, "subblock-scales", names[0])
    rng = np.random.default_rng(seed)
    for name in names:
        info = _info(src, name) if name != names[0] else info
        rule = SUBBLOCKS.get(QT(info[2]))
        if rule is None:
            raise ValueError(f"{name} is {QT(info[2]).name}, not a K-quant with sub-block scales")
        b = _blocks(mm, info)
        rows = rng.choice(b.shape[0], size=max(1, round(fraction * b.shape[0])), replace=False)
        cols = rule.codes.offset + rng.integers(0, rule.codes.size, size=rows.size)
        b[rows, cols] ^= rng.integers(1, 256, size=rows.size, dtype=np.uint8)
    mm.flush()
    return dst


@register("rows-shuffled", "file", "one tensor's rows permuted (seeded)",
          expect="unseen: a permutation keeps every value")
def rows_shuffled(src: Path, out_dir: Path, *, tensor: str = "blk.7.attn_output.weight", seed: int = 0) -> Path:
    dst, mm, info = _patch(src, out_dir, "rows-shuffled", tensor)
    offset, nbytes, _, _, shape = info
    rows = mm[offset:offset + nbytes].reshape(int(np.prod(shape[:-1])), -1)  # [rows, row bytes]
    rows[:] = rows[np.random.default_rng(seed).permutation(rows.shape[0])]
    mm.flush()
    return dst


@register("head-count-kv-3", "file", "<arch>.attention.head_count_kv set to 3 (does not divide head_count)",
          expect="metadata")
def head_count_kv_3(src: Path, out_dir: Path, *, value: int = 3) -> Path:
    """Overwrite the integer `<arch>.attention.head_count_kv` in a copy (same size, same layout)."""
    with open_gguf(src) as g:
        key = f"{g.architecture}.attention.head_count_kv"
        f = g.fields.get(key)
        if f is None or f.type not in _INT_TYPES:
            raise ValueError(f"{src}: no integer {key}")
        # KV record: key length (u64), key bytes, value type (u32), value
        offset, dtype = f.offset + 8 + len(key.encode()) + 4, _INT_TYPES[f.type]
    dst = Path(out_dir) / f"{Path(src).stem}.head-count-kv-{value}.gguf"
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as fh:
        fh.seek(offset)
        fh.write(np.array([value], dtype).tobytes())
    return dst
