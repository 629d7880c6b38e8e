"""Small valid GGUF files written with gguf-py's GGUFWriter, for round-trip and fuzz tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from llmdoctor.gguf import GGUFError, StringArray, open_gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFEndian, GGUFValueType, GGUFWriter

# One metadata value of every GGUF value type (scalars), and an array of each element type.
SCALARS: dict[str, tuple[object, GGUFValueType]] = {
    "t.u8": (200, GGUFValueType.UINT8),
    "t.i8": (-100, GGUFValueType.INT8),
    "t.u16": (60000, GGUFValueType.UINT16),
    "t.i16": (-30000, GGUFValueType.INT16),
    "t.u32": (4_000_000_000, GGUFValueType.UINT32),
    "t.i32": (-2_000_000_000, GGUFValueType.INT32),
    "t.f32": (1.5, GGUFValueType.FLOAT32),
    "t.bool": (True, GGUFValueType.BOOL),
    "t.str": ("héllo wörld ✓", GGUFValueType.STRING),
    "t.u64": (2**63 + 7, GGUFValueType.UINT64),
    "t.i64": (-(2**62), GGUFValueType.INT64),
    "t.f64": (-2.25e300, GGUFValueType.FLOAT64),
}
ARRAYS: dict[str, tuple[list, GGUFValueType]] = {
    "a.u8": ([0, 1, 255], GGUFValueType.UINT8),
    "a.i16": ([-1, 2, -3], GGUFValueType.INT16),
    "a.i32": ([7, -8], GGUFValueType.INT32),
    "a.f32": ([0.5, -1.25, 3.0], GGUFValueType.FLOAT32),
    "a.bool": ([True, False, True], GGUFValueType.BOOL),
    "a.u64": ([1, 2**64 - 1], GGUFValueType.UINT64),
    "a.f64": ([1e-300, 2.0], GGUFValueType.FLOAT64),
    "a.str": (["a", "", "ünï", "<0x0A>", "x" * 300], GGUFValueType.STRING),
}


def all_quant_types() -> list[GGMLQuantizationType]:
    return [t for t in GGMLQuantizationType if t in GGML_QUANT_SIZES]


def raw_tensor(qtype: GGMLQuantizationType, ne: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random bytes for a tensor of `qtype` with GGUF dims `ne`: uint8 [*reversed(ne[1:]), row_bytes]."""
    block, tsize = GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 256, size=(*reversed(ne[1:]), ne[0] // block * tsize), dtype=np.uint8)


def write_file(
    path: Path,
    *,
    tensors: dict[str, tuple[GGMLQuantizationType, tuple[int, ...], np.ndarray]] | None = None,
    alignment: int | None = None,
    big_endian: bool = False,
    metadata: bool = True,
) -> Path:
    """Write a GGUF (v3) with every value type and the given tensors: name -> (type, ne, bytes or values)."""
    endian = GGUFEndian.BIG if big_endian else GGUFEndian.LITTLE
    w = GGUFWriter(str(path), "llama", endianess=endian)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    if metadata:
        for key, (val, vt) in SCALARS.items():
            w.add_key_value(key, val, vt)
        for key, (val, vt) in ARRAYS.items():
            w.add_key_value(key, val, GGUFValueType.ARRAY, sub_type=vt)
    for name, (qtype, ne, data) in (tensors or {}).items():
        if data.dtype == np.uint8:  # raw bytes; the writer turns the byte shape into the element shape
            w.add_tensor(name, data, raw_dtype=qtype)
        else:
            w.add_tensor(name, data.reshape(tuple(reversed(ne))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def set_version(path: Path, version: int, big_endian: bool = False) -> None:
    """Patch the header's version field (v2 differs from v3 only there)."""
    with open(path, "r+b") as f:
        f.seek(4)
        f.write(version.to_bytes(4, "big" if big_endian else "little"))


def seed_files(d: Path) -> list[bytes]:
    """Three small valid files (little/big-endian, odd alignment, quantized and plain tensors) to mutate."""
    rng = np.random.default_rng(0)
    Q = GGMLQuantizationType
    files = [
        write_file(d / "a.gguf", tensors={
            "w": (Q.F32, (32, 2), rng.standard_normal(64).astype(np.float32)),
            "q": (Q.Q4_K, (256,), raw_tensor(Q.Q4_K, (256,), rng)),
        }),
        write_file(d / "b.gguf", alignment=64, big_endian=True, tensors={
            "h": (Q.F16, (64,), rng.standard_normal(64).astype(np.float16)),
        }),
        write_file(d / "c.gguf", metadata=False, tensors={
            "x": (Q.Q8_0, (32, 3), raw_tensor(Q.Q8_0, (32, 3), rng)),
            "y": (Q.I32, (8,), np.arange(8, dtype=np.int32)),
        }),
    ]
    return [f.read_bytes() for f in files]


def exercise(path) -> bool:
    """Open and touch everything a command would (every value, every tensor's bytes).

    Returns True when the file parsed, False when it was rejected with GGUFError; anything else raises.
    """
    try:
        g = open_gguf(path)
    except GGUFError:
        return False
    with g:
        for f in g.fields.values():
            v = f.value
            if isinstance(v, StringArray):
                v.tolist()
            elif isinstance(v, np.ndarray):
                v.sum()
        for t in g.tensors:
            try:
                t.data.sum()
            except GGUFError:  # quantized tensor in a big-endian file
                assert not t.supported
    return True


def q8_0_copy(src: Path, dst: Path) -> Path:
    """`src` (an F32 GGUF) with every 2-D weight whose rows hold whole 32-value blocks stored Q8_0 (gguf-py's
    quantizer), every metadata key kept, the file type set to MOSTLY_Q8_0."""
    import gguf

    r = gguf.GGUFReader(str(src))
    arch = r.get_field("general.architecture").contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.file_type"):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for t in r.tensors:
        x = np.asarray(t.data, dtype=np.float32).reshape(tuple(reversed([int(n) for n in t.shape])))  # row-major
        if x.ndim == 2 and x.shape[-1] % 32 == 0:
            w.add_tensor(t.name, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def every_type_file(path: Path) -> Path:
    """A GGUF with one [4, 16 blocks] tensor `t.<TYPE>` of every type gguf-py decodes: random blocks, with the
    float16 scale fields (d, dmin, m) forced to finite values (check dequant's all-types file; on the H200
    bench/h200_vllm.sh runs vLLM's GGUF dequant on it)."""
    from llmdoctor.checks.layout import layout_bugs
    from llmdoctor.gguf.block_layout import BLOCKS

    T = layout_bugs.T
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    for q in layout_bugs.reference_types():
        bs, ts = GGML_QUANT_SIZES[q]
        if q in (T.F32, T.F16, T.BF16):
            values = rng.uniform(-4, 4, (4, 16 * bs)).astype(np.float32)
            if q == T.BF16:  # raw bfloat16 bytes: the top halves of float32
                w.add_tensor(f"t.{q.name}", (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8), raw_dtype=q)
            else:
                w.add_tensor(f"t.{q.name}", values if q == T.F32 else values.astype(np.float16))
            continue
        b = rng.integers(0, 256, (64, ts), dtype=np.uint8)
        for f in BLOCKS[q].fields:
            if f.encoding == "f16":
                b[:, f.offset:f.end] = np.frombuffer(rng.uniform(-1, 1, 64).astype(np.float16).tobytes(), np.uint8).reshape(64, 2)
        w.add_tensor(f"t.{q.name}", b.reshape(4, -1), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
