"""Copies of a GGUF model written with gguf-py's GGUFWriter: whole, a tensor subset, or split into shards
as llama.cpp's gguf-split lays them out (`split_max_tensors`: every metadata key in the first shard, the
split keys in every shard, the tensors in order, `<name>-%05d-of-%05d.gguf`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from llmdoctor.gguf import StringArray, open_gguf
from llmdoctor.gguf.split import SPLIT_KEYS


def copy_model(src: Path, dst: Path, *, max_tensors: int = 0, only: list[str] | None = None) -> list[Path]:
    """Write src's metadata and tensors (those in `only`, in file order, when given) to dst: one file,
    or shards of at most `max_tensors` tensors. Returns the files written, first shard first."""
    with open_gguf(src) as g:
        w = GGUFWriter(str(dst), g.architecture, split_max_tensors=max_tensors)
        for key, f in g.fields.items():
            if key == "general.architecture" or key in SPLIT_KEYS:
                continue  # the writer adds the architecture itself, and its own split keys
            if key == "general.alignment":
                w.add_custom_alignment(f.value)
                continue
            value = f.value
            if isinstance(value, StringArray):
                value = value.decode_all()
            elif isinstance(value, np.ndarray):
                value = value.tolist()
            w.add_key_value(key, value, f.type, sub_type=f.element_type)
        keep = None if only is None else set(only)
        for t in g.tensors:
            if keep is None or t.name in keep:
                w.add_tensor(t.name, np.ascontiguousarray(t.data).reshape(*t.shape[:-1], -1), raw_dtype=t.type)
        files = w.format_shard_names(Path(dst))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return files
