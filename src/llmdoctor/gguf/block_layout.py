"""Where each quant type keeps the fields of its block: one BlockLayout per type, and the unpacking of
the K-quants' packed sub-block codes.

Field order and sizes follow ggml-common.h's block structs as gguf-py splits them
(gguf.quants.<TYPE>.dequantize_blocks); every size is written from gguf-py's QK_K, Q4_K.K_SCALE_SIZE and
the values per block (GGML_QUANT_SIZES), and each layout's fields add up to GGML_QUANT_SIZES' type size
(asserted when the table is built). Used by weight forensics (checks/file/) and the dequant check's
layout-bug candidates (checks/layout/layout_bugs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf.constants import QK_K
from gguf.quants import Q4_K

F16 = np.dtype(np.float16).itemsize  # ggml_half


@dataclass(frozen=True)
class Field:
    """One field of a block: its bytes [offset, offset + size), and how a scalar scale is encoded."""

    name: str
    offset: int
    size: int
    encoding: str | None = None  # one scale per block: "f16" or "e8m0" (2^(e - 127)); None: packed integers

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class BlockLayout:
    """A quant type's block: its fields in byte order, covering the block's GGML_QUANT_SIZES bytes."""

    qtype: QT
    fields: tuple[Field, ...]

    def get(self, name: str) -> Field | None:
        return next((f for f in self.fields if f.name == name), None)

    def __getitem__(self, name: str) -> Field:
        f = self.get(name)
        if f is None:
            raise KeyError(f"{self.qtype.name} blocks have no field {name!r}")
        return f


def _layout(qtype: QT, *spec: tuple) -> BlockLayout:
    """spec: (name, size[, encoding]) in byte order."""
    fields, offset = [], 0
    for name, size, *enc in spec:
        fields.append(Field(name, offset, size, *enc))
        offset += size
    assert offset == GGML_QUANT_SIZES[qtype][1], (qtype, offset)
    return BlockLayout(qtype, tuple(fields))


def _block_layouts() -> dict[QT, BlockLayout]:
    d, dmin, m = ("d", F16, "f16"), ("dmin", F16, "f16"), ("m", F16, "f16")
    n = {q: GGML_QUANT_SIZES[q][0] for q in (QT.Q4_0, QT.Q8_0, QT.MXFP4, QT.NVFP4)}  # values per block
    nibbles = ("qs", n[QT.Q4_0] // 2)  # 4-bit quants of a 32-value block
    layouts = [
        _layout(QT.Q4_0, d, nibbles),
        _layout(QT.Q4_1, d, m, nibbles),
        _layout(QT.Q5_0, d, ("qh", n[QT.Q4_0] // 8), nibbles),
        _layout(QT.Q5_1, d, m, ("qh", n[QT.Q4_0] // 8), nibbles),
        _layout(QT.Q8_0, d, ("qs", n[QT.Q8_0])),
        _layout(QT.Q2_K, ("scales", QK_K // 16), ("qs", QK_K // 4), d, dmin),
        # 16 sub-blocks' 6-bit scales: QK_K // 16 * 6 // 8 bytes
        _layout(QT.Q3_K, ("hmask", QK_K // 8), ("qs", QK_K // 4), ("scales", QK_K // 16 * 6 // 8), d),
        _layout(QT.Q4_K, d, dmin, ("scales", Q4_K.K_SCALE_SIZE), ("qs", QK_K // 2)),
        _layout(QT.Q5_K, d, dmin, ("scales", Q4_K.K_SCALE_SIZE), ("qh", QK_K // 8), ("qs", QK_K // 2)),
        _layout(QT.Q6_K, ("ql", QK_K // 2), ("qh", QK_K // 4), ("scales", QK_K // 16), d),
        _layout(QT.TQ1_0, ("qs", (QK_K - 4 * QK_K // 64) // 5), ("qh", QK_K // 64), d),
        _layout(QT.TQ2_0, ("qs", QK_K // 4), d),
        _layout(QT.MXFP4, ("e", 1, "e8m0"), ("qs", n[QT.MXFP4] // 2)),
        _layout(QT.NVFP4, ("d", n[QT.NVFP4] // 16), ("qs", n[QT.NVFP4] // 2)),  # d: 4 UE4M3 sub-block scales
        _layout(QT.IQ2_XXS, d, ("qs", QK_K // 4)),
        _layout(QT.IQ2_XS, d, ("qs", QK_K // 4), ("scales", QK_K // 32)),
        _layout(QT.IQ2_S, d, ("qs", QK_K // 8), ("signs", QK_K // 8), ("qh", QK_K // 32), ("scales", QK_K // 32)),
        _layout(QT.IQ3_XXS, d, ("qs", QK_K // 4), ("scales", QK_K // 8)),
        _layout(QT.IQ3_S, d, ("qs", QK_K // 4), ("qh", QK_K // 32), ("signs", QK_K // 8), ("scales", QK_K // 64)),
        _layout(QT.IQ1_S, d, ("qs", QK_K // 8), ("qh", QK_K // 16)),
        # no d: the block scale is spread over the top bits of the sub-block scales
        _layout(QT.IQ1_M, ("qs", QK_K // 8), ("qh", QK_K // 16), ("scales", QK_K // 32)),
        _layout(QT.IQ4_NL, d, nibbles),
        _layout(QT.IQ4_XS, d, ("scales_h", 2), ("scales_l", QK_K // 64), ("qs", QK_K // 2)),
    ]
    return {lay.qtype: lay for lay in layouts}


BLOCKS: dict[QT, BlockLayout] = _block_layouts()


def subblock_codes(blocks: np.ndarray, qtype: QT) -> dict[str, np.ndarray]:
    """The sub-block codes of K-quant blocks uint8 [n, type_size]: "scales" (and "mins" for Q2_K, Q4_K,
    Q5_K) -> int16 [n, sub-blocks]; Q3_K's as stored (0..63, the signed scale + 32), Q6_K's signed.
    Unpacked as gguf-py's dequantize_blocks reads them (Q4_K/Q5_K: Q4_K.get_scale_min)."""
    f = BLOCKS[qtype]["scales"]
    s = blocks[:, f.offset:f.end]  # [n, size] packed codes
    if qtype == QT.Q2_K:  # scale in the low nibble, min in the high
        return {"scales": (s & 0xF).astype(np.int16), "mins": (s >> 4).astype(np.int16)}
    if qtype == QT.Q6_K:
        return {"scales": s.view(np.int8).astype(np.int16)}
    if qtype == QT.Q3_K:  # low 4 bits: bytes 0..7 (j < 8 low nibble, j >= 8 high); high 2 bits: bytes 8..11
        low = np.concatenate([s[:, :8] & 0xF, s[:, :8] >> 4], axis=1)  # [n, 16]
        high = (s[:, None, 8:12] >> np.array([0, 2, 4, 6], np.uint8)[None, :, None]) & 3  # [n, j // 4, j % 4]
        return {"scales": (low | (high.reshape(-1, 16) << 4)).astype(np.int16)}
    if qtype in (QT.Q4_K, QT.Q5_K):
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(s))  # [n, 8] each
        return {"scales": sc.astype(np.int16), "mins": mn.astype(np.int16)}
    raise KeyError(f"{qtype.name} has no packed sub-block codes")


def pack_k4_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 packed bytes of 6-bit scale and min codes [n, 8] each: uint8 [n, 12] (the inverse
    of Q4_K.get_scale_min)."""
    lo = (sc[:, :4] & 0x3F) | ((sc[:, 4:] & 0x30) << 2)
    mid = (mn[:, :4] & 0x3F) | ((mn[:, 4:] & 0x30) << 2)
    hi = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([lo, mid, hi], axis=1).astype(np.uint8)
