"""Planted faults for `check mapping`: a GGUF / HF pair that loads but describes another network.

Every builder has the signature `build(gguf, hf, out_dir) -> (gguf, hf)`: it writes a broken copy of
one side into `out_dir` (the originals are never opened for writing) and returns the pair to check.
`hf` is an HF checkpoint directory or a config.json. `expect` is a substring of the failing
finding's explanation. Small in-place edits (same size) are byte patches of a copy; edits that change
a tensor's shape or type rewrite the file with gguf-py's GGUFWriter (fine for the tiny test models).
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType, GGUFWriter, quants

from ..gguf import layout, open_gguf
from ..hf_config import read_hf_config, text_config
from . import register
from .endpoint import rope_base

Pair = tuple[Path, Path | None]
Edit = Callable[[str, np.ndarray, QT], Iterable[tuple[str, np.ndarray, QT]]]


def _copy(src: Path, out_dir: Path, tag: str) -> Path:
    dst = Path(out_dir) / f"{Path(src).stem}.{tag}.gguf"
    shutil.copyfile(src, dst)
    return dst


def _value_offset(g, key: str) -> int:
    """File offset of a scalar KV's value: key length (u64), key bytes, value type (u32), value."""
    return g.fields[key].offset + 8 + len(key.encode()) + 4


def _rewrite(src: Path, dst: Path, edit: Edit, meta: dict[str, tuple] | None = None) -> Path:
    """Copy `src` to `dst` through GGUFWriter, every tensor passed through `edit(name, data, type)`,
    which yields the tensors to write instead: (name, float32 values or raw uint8 bytes, type).
    `meta`: metadata to set, key -> (value, GGUFValueType[, element type for arrays])."""
    with open_gguf(src) as g:
        w = GGUFWriter(str(dst), g.architecture)
        kv = {k: (f.value, f.type, f.element_type) for k, f in g.fields.items()}
        for key, (v, vtype, *sub) in {**kv, **(meta or {})}.items():
            if key == "general.architecture":
                continue  # the writer adds it
            if vtype == GGUFValueType.ARRAY:
                w.add_key_value(key, v.tolist() if hasattr(v, "tolist") else list(v), vtype, sub_type=sub[0])
            else:
                w.add_key_value(key, v, vtype)
        for t in g.tensors:
            data = t.numpy().astype(np.float32) if t.type == QT.F32 else np.array(t.data).reshape(*t.shape[:-1], -1)
            for name, arr, qt in edit(t.name, data, t.type):
                if qt == QT.F32:
                    w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
                else:
                    w.add_tensor(name, np.ascontiguousarray(arr), raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return dst


@register("mapping-swap-layers", "file", "two tensors of one kind exchanged across layers (blk.1 <-> blk.2)",
          expect="swapped across layers")
def swap_layers(gguf: Path, hf: Path | None, out_dir: Path, *, kind: str | None = None) -> Pair:
    """Exchange the bytes of blk.1.<kind> and blk.2.<kind> in a copy; `kind` defaults to attn_k.weight, or
    the first 2-D kind whose two tensors have the same type and size (attn_kv_a_mqa in MLA files)."""
    with open_gguf(gguf) as g:
        names = {t.name for t in g.tensors}

        def same(k: str) -> bool:
            a, b = f"blk.1.{k}", f"blk.2.{k}"
            return a in names and b in names and len(g.tensor(a).ne) == 2 and \
                (g.tensor(a).type, g.tensor(a).nbytes) == (g.tensor(b).type, g.tensor(b).nbytes)

        kinds = [kind] if kind else ["attn_k.weight"] + sorted(n[len("blk.1."):] for n in names if n.startswith("blk.1."))
        kind = next((k for k in kinds if same(k)), None)
        if kind is None:
            raise ValueError(f"{gguf}: no tensor kind with equal blk.1 / blk.2 tensors")
        a, b = g.tensor(f"blk.1.{kind}"), g.tensor(f"blk.2.{kind}")
        ba, bb = bytes(a.data), bytes(b.data)
        oa, ob = a.offset, b.offset
    dst = _copy(gguf, out_dir, "swap")
    with open(dst, "r+b") as fh:
        fh.seek(oa)
        fh.write(bb)
        fh.seek(ob)
        fh.write(ba)
    return dst, hf


@register("mapping-k-wrong-heads", "file",
          "llama attn_k permuted with n_head instead of n_head_kv (the classic GQA converter bug)",
          expect="RoPE permutation with n_head_kv=")
def k_wrong_heads(gguf: Path, hf: Path | None, out_dir: Path, *, layer: int = 0) -> Pair:
    """Re-permute blk.<layer>.attn_k (F32): undo the right permutation, apply it with n_head."""
    with open_gguf(gguf) as g:
        n_head = int(g.get(f"{g.architecture}.attention.head_count"))
        n_kv = int(g.get(f"{g.architecture}.attention.head_count_kv", n_head))
        t = g.tensor(f"blk.{layer}.attn_k.weight")
        if t.type != QT.F32 or n_kv == n_head:
            raise ValueError("mapping-k-wrong-heads needs an F32 attn_k under GQA (n_head_kv < n_head)")
        k = torch.from_numpy(t.numpy().copy())  # [n_kv * D, n_embd], adjacent-pair rows
        wrong = layout.rope_permute(layout.rope_unpermute(k, n_kv), n_head)
        offset = t.offset
    dst = _copy(gguf, out_dir, "k-heads")
    with open(dst, "r+b") as fh:
        fh.seek(offset)
        fh.write(wrong.numpy().astype("<f4").tobytes())
    return dst, hf


@register("mapping-kb-not-transposed", "file", "MLA attn_k_b written as [H, Dn, R] (without the transpose)",
          expect="without its transpose")
def kb_not_transposed(gguf: Path, hf: Path | None, out_dir: Path) -> Pair:
    def edit(name: str, data: np.ndarray, qt: QT):
        if name.endswith("attn_k_b.weight"):
            data = np.ascontiguousarray(data.swapaxes(-1, -2))  # [H, R, Dn] -> [H, Dn, R]
        yield name, data, qt

    return _rewrite(gguf, Path(out_dir) / f"{Path(gguf).stem}.kb.gguf", edit), hf


@register("mapping-indexer-missing", "file", "the DSA indexer's projection tensor of layer 0 left out",
          expect="blk.0.indexer.proj.weight is not in the file")
def indexer_missing(gguf: Path, hf: Path | None, out_dir: Path) -> Pair:
    def edit(name: str, data: np.ndarray, qt: QT):
        if name != "blk.0.indexer.proj.weight":
            yield name, data, qt

    return _rewrite(gguf, Path(out_dir) / f"{Path(gguf).stem}.no-indexer.gguf", edit), hf


@register("mapping-indexer-quantized", "file", "DSA indexer weights stored Q8_0 (what broke the seed's loader)",
          expect="dequantize it to F16/F32 at load")
def indexer_quantized(gguf: Path, hf: Path | None, out_dir: Path) -> Pair:
    def edit(name: str, data: np.ndarray, qt: QT):
        if ".indexer." in name and qt == QT.F32 and data.ndim >= 2 and data.shape[-1] % 32 == 0:
            yield name, quants.quantize(data, QT.Q8_0), QT.Q8_0
        else:
            yield name, data, qt

    return _rewrite(gguf, Path(out_dir) / f"{Path(gguf).stem}.q8-indexer.gguf", edit), hf


@register("mapping-experts-order", "file", "blk.1.ffn_up_exps with experts 0 and 1 in each other's slots",
          expect="experts stored out of order")
def experts_order(gguf: Path, hf: Path | None, out_dir: Path) -> Pair:
    def edit(name: str, data: np.ndarray, qt: QT):
        if name == "blk.1.ffn_up_exps.weight":
            data = data[[1, 0, *range(2, data.shape[0])]]
        yield name, data, qt

    return _rewrite(gguf, Path(out_dir) / f"{Path(gguf).stem}.experts.gguf", edit), hf


@register("mapping-rope-base", "file", "rope.freq_base changed in the metadata (-> 100)", expect="rope_base")
def rope_base_changed(gguf: Path, hf: Path | None, out_dir: Path) -> Pair:
    return rope_base(gguf, out_dir), hf


@register("mapping-head-count", "file", "attention.head_count doubled in the metadata", expect="n_head")
def head_count(gguf: Path, hf: Path | None, out_dir: Path) -> Pair:
    with open_gguf(gguf) as g:
        key = f"{g.architecture}.attention.head_count"
        if g.fields[key].type != GGUFValueType.UINT32:
            raise ValueError(f"{gguf}: {key} is not a u32")
        n, offset = int(g.get(key)), _value_offset(g, key)
    dst = _copy(gguf, out_dir, "heads")
    with open(dst, "r+b") as fh:
        fh.seek(offset)
        fh.write(struct.pack("<I", 2 * n))
    return dst, hf


@register("mapping-hf-no-source", "file",
          "config.json says tie_word_embeddings=false for a GGUF that ties its output to token_embd: the HF "
          "model's lm_head.weight has no GGUF source", expect="lm_head.weight has no GGUF source")
def hf_no_source(gguf: Path, hf: Path | None, out_dir: Path) -> Pair:
    import json

    if hf is None:
        raise ValueError("mapping-hf-no-source edits the HF config: give one")
    with open_gguf(gguf) as g:
        if any(t.name == "output.weight" for t in g.tensors):
            raise ValueError("mapping-hf-no-source needs a GGUF whose output is tied to token_embd")
    config = read_hf_config(hf)
    text_config(config)["tie_word_embeddings"] = False
    dst = Path(out_dir) / "untied-config.json"
    dst.write_text(json.dumps(config))
    return gguf, dst

