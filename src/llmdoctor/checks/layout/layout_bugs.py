"""Candidate layout bugs of a dequant kernel, as transforms of the reference (gguf-py).

When a kernel's output differs from the reference, each candidate computes what a kernel with one
named bug would have produced on the compared blocks; the first candidate the output matches (under
the same judge as the check: bit-exact, or the reduced-precision bound) names the bug. Candidates
are of three kinds:

- byte transforms: decode, with the reference, the block bytes as the buggy kernel reads them
  (nibbles swapped, qh halves swapped, scale and min swapped, sub-block scales reversed, sign of d,
  d and dmin swapped; wrong type assumed = the bytes decoded with another type's layout);
- exact arithmetic: a quant offset dropped (signed/unsigned confusion) is d·q shifted by d·k, which
  is exact in float32 for Q4_0/Q5_0/Q8_0 (11-bit d times an integer of at most 9 bits);
- index maps: the output is the reference with elements moved (transposed, rows shifted or wrapped)
  or with the last block left unwritten.

Block layouts (where each type keeps d, dmin, the sub-block scales, qs, ...) are gguf/block_layout.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants

from ...gguf.block_layout import BLOCKS, pack_k4_scales, subblock_codes

# The fields holding quants (zeroing them leaves only the min term m of y = d·q + m).
QUANT_FIELDS = ("qs", "qh", "ql", "hmask")
# Types whose dequantized value is d·q + m with a nonzero per-block/sub-block m.
HAS_MIN = (T.Q4_1, T.Q5_1, T.Q2_K, T.Q4_K, T.Q5_K)


def reference(qtype: int, blocks: np.ndarray) -> np.ndarray:
    """gguf-py's dequantization of whole blocks: uint8 [k, type_size] -> float32 [k, block_size]."""
    qtype = T(qtype)
    blocks = np.ascontiguousarray(blocks)
    bs, _ = GGML_QUANT_SIZES[qtype]
    if blocks.shape[0] == 0:
        return np.zeros((0, bs), np.float32)
    with np.errstate(all="ignore"):  # random or corrupt scales legitimately decode to inf/NaN
        out = quants.dequantize(blocks, qtype)
    return np.ascontiguousarray(out, dtype=np.float32).reshape(blocks.shape[0], bs)


def min_part(qtype: int, blocks: np.ndarray) -> Optional[np.ndarray]:
    """m of y = d·q + m per element, float32 [k, block_size] (the reference with the quants zeroed);
    None for types without a min term."""
    qtype = T(qtype)
    if qtype not in HAS_MIN:
        return None
    z = np.array(blocks, copy=True)
    for name in QUANT_FIELDS:
        f = BLOCKS[qtype].get(name)
        if f is not None:
            z[:, f.offset:f.end] = 0
    return reference(qtype, z)


@dataclass
class Tensor:
    """What the candidates need to know about the tensor under test."""

    qtype: T
    shape: tuple[int, ...]  # row-major
    raw: np.ndarray  # uint8 [nbytes], the file bytes (read-only)

    @property
    def block_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def type_size(self) -> int:
        return GGML_QUANT_SIZES[self.qtype][1]

    @property
    def n_blocks(self) -> int:
        return self.raw.size // self.type_size

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1

    def blocks(self, idx: np.ndarray) -> np.ndarray:
        """uint8 [k, type_size] copies of the blocks `idx`."""
        return self.raw.reshape(-1, self.type_size)[idx]

    def ref_elements(self, flat: np.ndarray) -> np.ndarray:
        """Reference values at flat element indices (any shape), decoding only the blocks needed."""
        blk = flat // self.block_size
        uniq, inv = np.unique(blk, return_inverse=True)
        vals = reference(self.qtype, self.blocks(uniq))  # [u, block_size]
        return vals[inv.reshape(blk.shape), flat % self.block_size]


@dataclass(frozen=True)
class Candidate:
    name: str  # what the report says, e.g. "nibble order swapped"
    detail: str  # one line: what the buggy kernel does
    # values the buggy kernel would give on blocks idx: float32 [k, block_size], or None (n/a)
    expected: Callable[[Tensor, np.ndarray], Optional[np.ndarray]]
    ignore_last_block: bool = False  # compare every block except the tensor's last one


# ----------------------------------------------------------------------------- byte transforms

def _field(qtype: T, name: str) -> Optional[tuple[int, int]]:
    """[start, end) of the field `name` in `qtype`'s block, None where it has none."""
    lay = BLOCKS.get(qtype)
    f = lay.get(name) if lay is not None else None
    return None if f is None else (f.offset, f.end)


def _byte_candidate(name: str, detail: str, fn: Callable[[T, np.ndarray], bool]) -> Candidate:
    """`fn(qtype, blocks)` rewrites the copied blocks in place; returns False when n/a for the type."""

    def expected(t: Tensor, idx: np.ndarray) -> Optional[np.ndarray]:
        b = np.array(t.blocks(idx), copy=True)
        return reference(t.qtype, b) if fn(t.qtype, b) else None

    return Candidate(name, detail, expected)


# Types whose quants are packed two 4-bit nibbles per byte, and the field holding them.
_NIBBLE_FIELD = {T.Q4_0: "qs", T.Q4_1: "qs", T.Q5_0: "qs", T.Q5_1: "qs", T.Q4_K: "qs", T.Q5_K: "qs",
                 T.Q6_K: "ql", T.IQ4_NL: "qs", T.IQ4_XS: "qs"}
_REVERSED_BITS = np.array([int(f"{i:08b}"[::-1], 2) for i in range(256)], np.uint8)


def _swap_nibbles(qtype: T, b: np.ndarray) -> bool:
    if qtype not in _NIBBLE_FIELD:
        return False
    a, e = _field(qtype, _NIBBLE_FIELD[qtype])
    b[:, a:e] = (b[:, a:e] << 4) | (b[:, a:e] >> 4)
    return True


def _misplace_qh(qtype: T, b: np.ndarray) -> bool:
    f = _field(qtype, "qh")
    if f is None:
        return False
    a, e = f
    if qtype in (T.Q5_0, T.Q5_1):  # the high bit of element j read from bit j+16 and vice versa
        b[:, a:e] = np.concatenate([b[:, a + 2:e], b[:, a:a + 2]], axis=1)
    elif qtype == T.Q5_K:  # bit i of qh[l] belongs to sub-block i: read in reverse bit order
        b[:, a:e] = _REVERSED_BITS[b[:, a:e]]
    elif qtype == T.Q6_K:  # 2-bit groups of each qh byte read in reverse order
        q = b[:, a:e]
        b[:, a:e] = ((q & 3) << 6) | ((q & 12) << 2) | ((q >> 2) & 12) | (q >> 6)
    else:
        return False
    return True


def _swap_scale_min(qtype: T, b: np.ndarray) -> bool:
    f = _field(qtype, "scales")
    if qtype in (T.Q4_K, T.Q5_K):
        codes = subblock_codes(b, qtype)
        b[:, f[0]:f[1]] = pack_k4_scales(codes["mins"], codes["scales"])
    elif qtype == T.Q2_K:  # low nibble scale, high nibble min
        s = b[:, f[0]:f[1]]
        b[:, f[0]:f[1]] = (s << 4) | (s >> 4)
    else:
        return False
    return True


def _reverse_subblock_scales(qtype: T, b: np.ndarray) -> bool:
    f = _field(qtype, "scales")
    if qtype in (T.Q4_K, T.Q5_K):
        codes = subblock_codes(b, qtype)
        b[:, f[0]:f[1]] = pack_k4_scales(codes["scales"][:, ::-1], codes["mins"][:, ::-1])
    elif qtype in (T.Q2_K, T.Q6_K):  # one byte per sub-block
        b[:, f[0]:f[1]] = b[:, f[0]:f[1]][:, ::-1]
    else:
        return False
    return True


def _negate_d(qtype: T, b: np.ndarray) -> bool:
    lay = BLOCKS.get(qtype)
    f = lay.get("d") if lay is not None else None
    if f is None or f.encoding != "f16":
        return False
    b[:, f.offset + 1] ^= 0x80  # sign bit of the little-endian float16
    return True


def _swap_d_dmin(qtype: T, b: np.ndarray) -> bool:
    d = _field(qtype, "d")
    m = _field(qtype, "dmin") or _field(qtype, "m")
    if d is None or m is None:
        return False
    b[:, d[0]:d[1]], b[:, m[0]:m[1]] = b[:, m[0]:m[1]].copy(), b[:, d[0]:d[1]].copy()
    return True


# ----------------------------------------------------------------------------- exact arithmetic

def _unsigned(t: Tensor, idx: np.ndarray) -> Optional[np.ndarray]:
    """Quants read without their offset (Q4_0 -8, Q5_0 -16) or int8 read as uint8 (Q8_0): y + k·d."""
    if t.qtype not in (T.Q4_0, T.Q5_0, T.Q8_0):
        return None
    b = t.blocks(idx)
    ref = reference(t.qtype, b)
    lay = BLOCKS[t.qtype]
    d = np.ascontiguousarray(b[:, lay["d"].offset:lay["d"].end]).view(np.float16).astype(np.float32)  # [k, 1]
    if t.qtype == T.Q8_0:
        qs = lay["qs"]
        shift = np.where(b[:, qs.offset:qs.end].view(np.int8) < 0, np.float32(256), np.float32(0))
    else:
        shift = np.float32(8 if t.qtype == T.Q4_0 else 16)
    return ref + shift * d


# ----------------------------------------------------------------------------- index maps

def _index_map(name: str, detail: str, src: Callable[[Tensor, np.ndarray], Optional[np.ndarray]]) -> Candidate:
    """`src(t, flat)` maps flat output indices to the flat reference indices they hold."""

    def expected(t: Tensor, idx: np.ndarray) -> Optional[np.ndarray]:
        flat = idx[:, None] * t.block_size + np.arange(t.block_size)  # [k, block_size]
        s = src(t, flat)
        return None if s is None else t.ref_elements(s)

    return Candidate(name, detail, expected)


def _transposed(t: Tensor, flat: np.ndarray) -> Optional[np.ndarray]:
    if len(t.shape) != 2 or t.rows == 1:
        return None
    r, c = t.shape
    return (flat % r) * c + flat // r  # out.view(c, r)[j, i] = ref[i, j]


def _row_shift(k: int) -> Callable[[Tensor, np.ndarray], Optional[np.ndarray]]:
    def src(t: Tensor, flat: np.ndarray) -> Optional[np.ndarray]:
        if t.rows < 2:
            return None
        c = t.shape[-1]
        return ((flat // c + k) % t.rows) * c + flat % c

    return src


def _row_wrap(bits: int) -> Callable[[Tensor, np.ndarray], Optional[np.ndarray]]:
    def src(t: Tensor, flat: np.ndarray) -> Optional[np.ndarray]:
        if t.rows <= 1 << bits:
            return None
        c = t.shape[-1]
        return ((flat // c) % (1 << bits)) * c + flat % c

    return src


# ----------------------------------------------------------------------------- wrong type

def _as_type(other: T) -> Candidate:
    def expected(t: Tensor, idx: np.ndarray) -> Optional[np.ndarray]:
        bs, ts = GGML_QUANT_SIZES[other]
        if other == t.qtype or bs != t.block_size or t.n_blocks * ts > t.raw.size:
            return None
        return reference(other, t.raw[: t.n_blocks * ts].reshape(-1, ts)[idx])

    return Candidate(f"wrong type assumed ({other.name})", f"the bytes are decoded as {other.name}", expected)


def reference_types() -> list[T]:
    """Types gguf-py can dequantize (the only ones a wrong-type candidate can be computed for)."""
    return [T.F32, T.F16, *sorted(quants._type_traits, key=int)]


CANDIDATES: list[Candidate] = [
    _byte_candidate("nibble order swapped", "low and high nibbles of the packed 4-bit quants are exchanged", _swap_nibbles),
    _byte_candidate("high bits (qh) misplaced", "the high quant bits are taken from the wrong bit positions", _misplace_qh),
    _byte_candidate("scale and min swapped", "the sub-block scale is used as the min and vice versa", _swap_scale_min),
    _byte_candidate("sub-block scale order", "the sub-block scales are applied in reverse order", _reverse_subblock_scales),
    _byte_candidate("sign of d", "the block scale d is negated", _negate_d),
    _byte_candidate("d/dmin from the wrong half", "the super-block scale d and dmin (or d and m) are exchanged", _swap_d_dmin),
    Candidate("signed/unsigned quants", "the quants are read without their signed offset", _unsigned),
    _index_map("output transposed", "element (i, j) is written at (j, i) of a [cols, rows] buffer", _transposed),
    _index_map("rows shifted by +1", "row r holds reference row r+1", _row_shift(1)),
    _index_map("rows shifted by -1", "row r holds reference row r-1", _row_shift(-1)),
    _index_map("rows wrapped past 2^16", "row r holds reference row r mod 65536 (a 16-bit row index)", _row_wrap(16)),
    _index_map("rows wrapped past 2^15", "row r holds reference row r mod 32768 (a signed 16-bit row index)", _row_wrap(15)),
    Candidate("tail block unwritten", "only the last block differs: it was never written",
              lambda t, idx: reference(t.qtype, t.blocks(idx)), ignore_last_block=True),
    *[_as_type(o) for o in reference_types()],
]


def explain(t: Tensor, idx: np.ndarray, matches: Callable[[np.ndarray, np.ndarray], bool]) -> Optional[Candidate]:
    """The first candidate whose expected values on blocks `idx` the kernel output matches.

    `matches(expected [k, block_size], keep [k] bool)` applies the check's judge to the rows kept.
    """
    last = t.n_blocks - 1
    for c in CANDIDATES:
        keep = idx != last if c.ignore_last_block else np.ones(idx.shape, bool)
        if c.ignore_last_block and (keep.all() or not keep.any()):
            continue
        try:
            with np.errstate(all="ignore"):  # garbage scales (wrong type assumed) decode to inf/NaN
                exp = c.expected(t, idx)
        except (ValueError, NotImplementedError, KeyError):
            continue
        if exp is not None and matches(exp, keep):
            return c
    return None
