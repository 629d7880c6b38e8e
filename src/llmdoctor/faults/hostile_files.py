"""Hand-built hostile GGUF files, one per hardening rule of the reader.

Each builder returns the file's bytes (kind "hostile-file"), or a set of shard files (kind
"hostile-split", a `ShardSet`: split-model rules of gguf/split.py). A tiny raw encoder is used instead of gguf-py's writer because
these files must break the rules the writer enforces. `expect` is a substring of the reader's error.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf import Keys

from . import register

_ALIGN = 32


def s(text: str | bytes, order: str = "<") -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack(order + "Q", len(b)) + b


def kv_u32(key: str, value: int, vtype: int = V.UINT32) -> bytes:
    return s(key) + struct.pack("<II", vtype, value)


def kv_str(key: str, value: str) -> bytes:
    return s(key) + struct.pack("<I", V.STRING) + s(value)


def tinfo(name: str | bytes, ne: tuple[int, ...], ttype: int, offset: int, n_dims: int | None = None) -> bytes:
    nd = len(ne) if n_dims is None else n_dims
    dims = b"".join(struct.pack("<Q", d & (2**64 - 1)) for d in ne)
    return s(name) + struct.pack("<I", nd) + dims + struct.pack("<IQ", ttype, offset)


def header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def gguf_file(kvs: list[bytes], infos: list[bytes], data: bytes = b"",
              n_tensors: int | None = None, n_kv: int | None = None) -> bytes:
    """Header + KVs + tensor infos, padded to the default alignment, then `data`."""
    head = header(len(infos) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    pad = (-len(body)) % _ALIGN
    return body + b"\0" * pad + data


_ARCH = kv_str("general.architecture", "llama")


def _one_f32(ne=(32,), offset=0, ttype=T.F32, data_len=None, **kw) -> bytes:
    n = 1
    for d in ne:
        n *= d
    return gguf_file([_ARCH], [tinfo("t", ne, ttype, offset, **kw)], b"\0" * (4 * n if data_len is None else data_len))


def _hostile(name: str, description: str, expect: str):
    return register(name, "hostile-file", description, expect)


@_hostile("bad-magic", "the file does not start with GGUF", "bad magic")
def bad_magic() -> bytes:
    return b"GGML" + _one_f32()[4:]


@_hostile("version-1", "GGUF v1 (32-bit counts) is not supported", "unsupported GGUF version 1")
def version_1() -> bytes:
    return b"GGUF" + struct.pack("<I", 1) + _one_f32()[8:]


@_hostile("version-99", "an unknown future version", "unsupported GGUF version 99")
def version_99() -> bytes:
    return b"GGUF" + struct.pack("<I", 99) + _one_f32()[8:]


@_hostile("truncated-header", "the file ends inside the header", "truncated file")
def truncated_header() -> bytes:
    return _one_f32()[:14]


@_hostile("n-kv-huge", "a metadata count that cannot fit in the file", "metadata count")
def n_kv_huge() -> bytes:
    return gguf_file([_ARCH], [], n_kv=2**62)


@_hostile("n-tensors-huge", "a tensor count that cannot fit in the file", "tensor count")
def n_tensors_huge() -> bytes:
    return gguf_file([_ARCH], [], n_tensors=2**40)


@_hostile("key-length-huge", "a key string longer than the file", "metadata key length")
def key_length_huge() -> bytes:
    return header(0, 1) + struct.pack("<Q", 2**63 + 5) + b"abc" + b"\0" * 16


@_hostile("array-2-40-u8", "a 49-byte file declaring a uint8 array of 2^40 elements (hangs gguf-py)", "cannot fit")
def array_2_40_u8() -> bytes:
    return header(0, 1) + s("a") + struct.pack("<IIQ", V.ARRAY, V.UINT8, 2**40)


@_hostile("array-count-overflow", "an array whose count x element size overflows 64 bits", "cannot fit")
def array_count_overflow() -> bytes:
    return header(0, 1) + s("a") + struct.pack("<IIQ", V.ARRAY, V.UINT64, 2**61 + 1) + b"\0" * 16


@_hostile("string-array-huge", "a string array whose count cannot fit in the file", "string array")
def string_array_huge() -> bytes:
    return header(0, 1) + s("a") + struct.pack("<IIQ", V.ARRAY, V.STRING, 2**50) + s("x")


@_hostile("string-in-array-too-long", "a string inside an array longer than the file", "length")
def string_in_array_too_long() -> bytes:
    return header(0, 1) + s("a") + struct.pack("<IIQ", V.ARRAY, V.STRING, 2) + s("x") + struct.pack("<Q", 10**12)


@_hostile("value-type-unknown", "a metadata value of unknown type", "unknown value type 13")
def value_type_unknown() -> bytes:
    return gguf_file([s("k") + struct.pack("<II", 13, 0)], [])


@_hostile("nested-array", "an array of arrays", "nested arrays")
def nested_array() -> bytes:
    return gguf_file([s("k") + struct.pack("<IIQ", V.ARRAY, V.ARRAY, 1) + struct.pack("<IQ", V.UINT8, 0)], [])


@_hostile("duplicate-key", "the same metadata key twice", "duplicate metadata key")
def duplicate_key() -> bytes:
    return gguf_file([_ARCH, _ARCH], [])


@_hostile("alignment-not-pow2", "general.alignment of 48", "not a power of two")
def alignment_not_pow2() -> bytes:
    return gguf_file([_ARCH, kv_u32("general.alignment", 48)], [])


@_hostile("alignment-zero", "general.alignment of 0", "not a power of two")
def alignment_zero() -> bytes:
    return gguf_file([_ARCH, kv_u32("general.alignment", 0)], [])


@_hostile("alignment-huge", "general.alignment of 2^31", "not a power of two")
def alignment_huge() -> bytes:
    return gguf_file([_ARCH, kv_u32("general.alignment", 2**31)], [])


@_hostile("alignment-wrong-type", "general.alignment stored as int32", "must be a uint32")
def alignment_wrong_type() -> bytes:
    return gguf_file([_ARCH, kv_u32("general.alignment", 32, V.INT32)], [])


@_hostile("tensor-name-too-long", "a 64-byte tensor name (ggml allows 63)", "too long")
def tensor_name_too_long() -> bytes:
    return gguf_file([_ARCH], [tinfo("x" * 64, (32,), T.F32, 0)], b"\0" * 128)


@_hostile("duplicate-tensor", "two tensors with one name", "duplicate tensor name")
def duplicate_tensor() -> bytes:
    return gguf_file([_ARCH], [tinfo("t", (32,), T.F32, 0), tinfo("t", (32,), T.F32, 128)], b"\0" * 256)


@_hostile("n-dims-zero", "a tensor with 0 dims", "n_dims 0")
def n_dims_zero() -> bytes:
    return gguf_file([_ARCH], [tinfo("t", (), T.F32, 0)], b"\0" * 128)


@_hostile("n-dims-five", "a tensor with 5 dims", "n_dims 5")
def n_dims_five() -> bytes:
    return gguf_file([_ARCH], [tinfo("t", (32, 1, 1, 1, 1), T.F32, 0)], b"\0" * 128)


@_hostile("dim-zero", "a tensor dim of 0", "dim 1 is 0")
def dim_zero() -> bytes:
    return _one_f32(ne=(32, 0), data_len=128)


@_hostile("dim-negative", "a tensor dim of -1 (as int64)", "dim 0 is -1")
def dim_negative() -> bytes:
    return _one_f32(ne=(-1,), data_len=128)


@_hostile("element-count-overflow", "dims whose product overflows int64", "element count overflows")
def element_count_overflow() -> bytes:
    return _one_f32(ne=(2**32, 2**32), data_len=128)


@_hostile("byte-size-overflow", "an F64 tensor whose byte size overflows int64", "byte size overflows")
def byte_size_overflow() -> bytes:
    return _one_f32(ne=(2**31, 2**31), ttype=T.F64, data_len=128)


@_hostile("ggml-type-unknown", "a tensor of GGML type 4 (removed Q4_2)", "unknown GGML type 4")
def ggml_type_unknown() -> bytes:
    return _one_f32(ttype=4)


@_hostile("ne0-not-block-multiple", "a Q4_K tensor whose row is not a multiple of 256", "not divisible")
def ne0_not_block_multiple() -> bytes:
    return _one_f32(ne=(100,), ttype=T.Q4_K, data_len=144)


@_hostile("offset-unaligned", "tensor data at offset 4", "not aligned")
def offset_unaligned() -> bytes:
    return _one_f32(offset=4, data_len=160)


@_hostile("offset-past-end", "tensor data offset beyond the end of the file", "past the end")
def offset_past_end() -> bytes:
    return _one_f32(offset=2**40)


@_hostile("offset-wraps", "tensor data offset near 2^64 (wraps in C)", "past the end")
def offset_wraps() -> bytes:
    return _one_f32(offset=2**64 - 32)


@_hostile("data-truncated", "tensor data cut short by the end of the file", "past the end")
def data_truncated() -> bytes:
    return _one_f32(data_len=64)


@_hostile("tensors-overlap", "two tensors sharing bytes", "overlaps")
def tensors_overlap() -> bytes:
    return gguf_file([_ARCH], [tinfo("a", (64,), T.F32, 0), tinfo("b", (32,), T.F32, 128)], b"\0" * 256)


# ---- hostile split sets (gguf/split.py): each a set of shard files and the one the error must name ----

@dataclass(frozen=True)
class ShardSet:
    files: dict[str, bytes]  # file name -> bytes
    open: str  # the shard a command is given
    culprit: str  # the shard the one-line error must name


def kv_int(key: str, value: int, vtype: int) -> bytes:
    return s(key) + struct.pack("<I", vtype) + struct.pack("<" + _INT_FORMATS[vtype], value)


_INT_FORMATS = {V.UINT16: "H", V.INT32: "i", V.UINT32: "I"}


def shard(no: int, count: int, names: list[str], total: int | None = None, *, split_no: int | None = None,
          count_kv: bytes | None = None, overlap: bool = False) -> bytes:
    """One shard as gguf-split writes it: metadata in shard 0 only, the split keys (gguf-py's Keys.Split)
    in each, `names` as F32 [32] tensors. `total`: split.tensors.count (default: the right one is unknown
    here, so callers pass it); `split_no`/`count_kv` override the keys; `overlap`: the tensors share bytes."""
    kvs = [_ARCH] if no == 0 else []
    kvs += [kv_int(Keys.Split.LLM_KV_SPLIT_NO, no if split_no is None else split_no, V.UINT16),
            count_kv if count_kv is not None else kv_int(Keys.Split.LLM_KV_SPLIT_COUNT, count, V.UINT16),
            kv_int(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, len(names) if total is None else total, V.INT32)]
    step = 0 if overlap else 128
    return gguf_file(kvs, [tinfo(n, (32,), T.F32, i * step) for i, n in enumerate(names)], b"\0" * 128 * len(names))


def _name(no: int, count: int) -> str:
    return f"m-{no + 1:05d}-of-{count:05d}.gguf"


def _set(shards: list[bytes | None], count: int | None = None, open_no: int = 0, culprit_no: int = 0) -> ShardSet:
    n = len(shards) if count is None else count
    return ShardSet({_name(i, n): b for i, b in enumerate(shards) if b is not None}, _name(open_no, n),
                    _name(culprit_no, n))


def _split(name: str, description: str, expect: str):
    return register(name, "hostile-split", description, expect)


@_split("split-missing-shard", "shard 2 of 3 is absent (opened from shard 3)", "is missing")
def split_missing_shard() -> ShardSet:
    return _set([shard(0, 3, ["a"], 3), None, shard(2, 3, ["c"], 3)], open_no=2, culprit_no=1)


@_split("split-count-mismatch", "shard 2 says split.count 4 in a set of 3", "split.count is 4, expected 3")
def split_count_mismatch() -> ShardSet:
    return _set([shard(0, 3, ["a"], 3), shard(1, 4, ["b"], 3), shard(2, 3, ["c"], 3)], culprit_no=1)


@_split("split-no-duplicate", "shards 2 and 3 both say split.no 1", "split.no is 1, expected 2")
def split_no_duplicate() -> ShardSet:
    return _set([shard(0, 3, ["a"], 3), shard(1, 3, ["b"], 3), shard(2, 3, ["c"], 3, split_no=1)], culprit_no=2)


@_split("split-no-missing", "shard 2 has no split.no", "has no split.no")
def split_no_missing() -> ShardSet:
    bare = gguf_file([kv_int(Keys.Split.LLM_KV_SPLIT_COUNT, 2, V.UINT16)], [tinfo("b", (32,), T.F32, 0)], b"\0" * 128)
    return _set([shard(0, 2, ["a"], 2), bare], culprit_no=1)


@_split("split-tensor-twice", "tensor 'a' in shards 1 and 2", "tensor 'a' is also in")
def split_tensor_twice() -> ShardSet:
    return _set([shard(0, 2, ["a"], 2), shard(1, 2, ["a"], 2)], culprit_no=1)


@_split("split-tensors-count-wrong", "split.tensors.count 5, 3 tensors in the set", "split.tensors.count is 5")
def split_tensors_count_wrong() -> ShardSet:
    return _set([shard(0, 2, ["a", "b"], 5), shard(1, 2, ["c"], 5)], open_no=1)


@_split("split-count-zero", "split.count 0", "split.count 0")
def split_count_zero() -> ShardSet:
    return ShardSet({"m-00001-of-00000.gguf": shard(0, 0, ["a"])}, "m-00001-of-00000.gguf", "m-00001-of-00000.gguf")


@_split("split-count-not-integer", "split.count stored as a string", "must be an integer")
def split_count_not_integer() -> ShardSet:
    return _set([shard(0, 2, ["a"], 2, count_kv=kv_str(Keys.Split.LLM_KV_SPLIT_COUNT, "2")), shard(1, 2, ["b"], 2)])


@_split("split-name-mismatch", "split.count 3 in a file not named <name>-00001-of-00003.gguf", "does not follow")
def split_name_mismatch() -> ShardSet:
    return ShardSet({"model.gguf": shard(0, 3, ["a"], 3)}, "model.gguf", "model.gguf")


@_split("split-count-huge", "split.count 65535 and one shard: found missing at once", "is missing")
def split_count_huge() -> ShardSet:
    return _set([shard(0, 65535, ["a"], 65535)], count=65535, culprit_no=1)


@_split("split-shard-hostile", "shard 2 of 2 breaks a reader rule (overlapping tensors)", "overlaps")
def split_shard_hostile() -> ShardSet:
    return _set([shard(0, 2, ["a"], 3), shard(1, 2, ["b", "c"], 3, overlap=True)], culprit_no=1)
