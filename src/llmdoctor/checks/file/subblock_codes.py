"""Sub-block code rules of weight forensics: where llama.cpp's quantizer pins the extreme sub-block code of
every K-quant block it writes, and the streamed histogram of each block's extreme code (the packed codes'
bytes and their unpacking: gguf/block_layout.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QT

from ...gguf.block_layout import BLOCKS, Field, subblock_codes
from . import forensics_native as fx_native  # its NATIVE read at each call: tests switch it off

# A K-quant super-block of QK_K values holds, besides d (and dmin), one small integer code per sub-block
# that multiplies d (and one per sub-block that multiplies dmin). llama.cpp's quantizer (ggml-quants.c:
# quantize_row_q*_K_ref without an importance matrix, quantize_row_q*_K_impl with one) fits each
# sub-block's scale first and then chooses d so that the block's extreme sub-block lands on the end of
# the code range. That end is in every block it writes, so a block without it was written by something
# else: the bytes were changed after quantization. Per type, from the source (names as in ggml-quants.c):
#   Q6_K  int8 codes; iscale = -128 / max_scale (the signed sub-block scale of largest |.|), each code
#         nearest_int(iscale * scale_j) capped at 127: the extreme's code is exactly -128, with or without
#         an importance matrix (both paths share that step). A block whose sub-blocks are all zero is
#         written as zero bytes.
#   Q3_K  6-bit codes stored with +32 (code - 32 is the signed scale). Without an importance matrix:
#         iscale = -32 / max_scale, the extreme's code is -32 + 32 = 0. With one: make_qx_quants(nmax 32)
#         tries iscale = -(32 + 0.1 k) / max for k in -9..9, so the extreme's l = nearest_int(-(32 + 0.1 k))
#         clamped to [-32, 31] is -32 or -31: its code is 0 or 1. Rule: the smallest code is 0 or 1.
#   Q4_K, Q5_K  6-bit scale codes and 6-bit min codes; without an importance matrix inv_scale =
#         63 / max_scale and inv_min = 63 / max_min, so the largest scale code and the largest min code
#         are exactly 63 (all codes 0 where max_scale, or max_min, is 0).
#   Q2_K  4-bit scale and min codes (low and high nibble); likewise 15 / max_scale and 15 / max_min:
#         the largest of each is exactly 15.
# With an importance matrix Q2_K, Q4_K and Q5_K fit their codes by make_qp_quants, whose refinement
# may lower the extreme's code (measured on llama.cpp's own quantizer: the largest scale code 58..63,
# the largest min code down to 42 on data of one sign), so for those three types the rule is exact
# only for files quantized without one; for the others the share of blocks off the end is compared
# among role siblings instead (forensics.py: subblock_rules). Corrupted codes are seen only where they move the extreme:
# a random byte in a block's scales breaks the rule when it hits the extreme sub-block's code (about one
# block in 8 to 16, by type: tests/checks/file/test_forensics_subblocks.py measures it), so one damaged block in a
# tensor may go unseen while tens of them are found with certainty.


@dataclass(frozen=True)
class CodeFamily:
    """One kind of sub-block code of a K-quant block, and where llama.cpp's quantizer pins it."""

    name: str  # "scales" (multiply d) or "mins" (multiply dmin)
    reduce: str  # "max" or "min": the end of a block's codes that its extreme sub-block takes
    pinned: tuple[int, ...]  # the values that end takes in every block the quantizer writes
    lo: int  # the code range (histogram bins), inclusive
    hi: int
    every_path: bool  # pinned with and without an importance matrix (else: only without one)


@dataclass(frozen=True)
class SubBlockRule:
    """A K-quant type's code families, and the packing's number in _forensics_native.c's llmd_fx_subblocks."""

    qtype: QT
    families: tuple[CodeFamily, ...]
    kind: int

    @property
    def codes(self) -> Field:
        """The block's packed sub-block codes (gguf/block_layout.py's "scales")."""
        return BLOCKS[self.qtype]["scales"]


_SIX_BIT = dict(lo=0, hi=63)
_K4 = (CodeFamily("scales", "max", (63,), every_path=False, **_SIX_BIT),
       CodeFamily("mins", "max", (63,), every_path=False, **_SIX_BIT))
SUBBLOCKS: dict[QT, SubBlockRule] = {
    QT.Q2_K: SubBlockRule(QT.Q2_K, (CodeFamily("scales", "max", (15,), 0, 15, False),
                                    CodeFamily("mins", "max", (15,), 0, 15, False)), 2),
    QT.Q3_K: SubBlockRule(QT.Q3_K, (CodeFamily("scales", "min", (0, 1), every_path=True, **_SIX_BIT),), 3),
    QT.Q4_K: SubBlockRule(QT.Q4_K, _K4, 4),
    QT.Q5_K: SubBlockRule(QT.Q5_K, _K4, 4),  # the same 12 bytes after d and dmin
    QT.Q6_K: SubBlockRule(QT.Q6_K, (CodeFamily("scales", "min", (-128,), -128, 127, True),), 6),
}


_BINS = 256  # histogram bins per family: every code of a byte (Q6_K's signed ones shifted by 128)


@functools.cache
def _pinned(rule: SubBlockRule) -> np.ndarray:
    """uint8 [2, _BINS]: 1 where a family's extreme (as a bin: code - lo) is where the quantizer pins it."""
    out = np.zeros((2, _BINS), np.uint8)
    for i, fam in enumerate(rule.families):
        out[i, np.asarray(fam.pinned) - fam.lo] = 1
    return out


class SubBlockStats:
    """Per code family of one K-quant tensor, streamed: a histogram of each block's extreme code (its
    largest or smallest, CodeFamily.reduce; bin = code - lo) over blocks whose codes are not all zero,
    the number of all-zero blocks (what the quantizer writes for a block of zeros), and the first block
    whose extreme is not where the quantizer pins it. Counted in C where it is built (numpy's unpacking
    costs several times the moment passes: bench/bench_forensics_subblocks.py), else with numpy."""

    def __init__(self, qtype: QT):
        self.qtype, self.rule = qtype, SUBBLOCKS[qtype]
        self.blocks = 0
        self.hist = np.zeros((2, _BINS), np.int64)  # [family, bin]
        self.zero = np.zeros(2, np.int64)
        self.first_off: dict[str, tuple[int, int]] = {}  # family -> (block, its extreme code)

    def add(self, blocks: np.ndarray) -> None:
        """blocks: consecutive raw blocks of the tensor, uint8 [n, type_size]."""
        rule, pinned = self.rule, _pinned(self.rule)
        first = np.full(2, -1, np.int64)  # the chunk's first off block per family
        if fx_native.NATIVE is not None and blocks.flags.c_contiguous:
            fx_native.NATIVE.llmd_fx_subblocks(blocks.ctypes.data + rule.codes.offset, blocks.shape[0],
                                               blocks.shape[1], rule.kind, pinned.ctypes.data, self.hist.ctypes.data,
                                               self.zero.ctypes.data, first.ctypes.data)
        else:
            codes = subblock_codes(blocks, self.qtype)
            for i, fam in enumerate(rule.families):
                c = codes[fam.name]  # [n, sub-blocks]
                nonzero = c.any(1)
                e = _extreme(fam, c)[nonzero] - fam.lo  # [n nonzero] bins
                self.hist[i] += np.bincount(e, minlength=_BINS)
                self.zero[i] += int((~nonzero).sum())
                off = np.flatnonzero(nonzero)[pinned[i, e] == 0]
                first[i] = off[0] if off.size else -1
        for i, fam in enumerate(rule.families):
            if first[i] >= 0 and fam.name not in self.first_off:
                b = int(first[i])
                code = int(_extreme(fam, subblock_codes(blocks[b:b + 1], self.qtype)[fam.name])[0])
                self.first_off[fam.name] = (self.blocks + b, code)
        self.blocks += blocks.shape[0]

    def merge(self, o: "SubBlockStats") -> None:
        """self := self followed by o (the blocks right after self's)."""
        self.hist += o.hist
        self.zero += o.zero
        for fam, (b, code) in o.first_off.items():
            self.first_off.setdefault(fam, (self.blocks + b, code))
        self.blocks += o.blocks

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"blocks": self.blocks}
        pinned = _pinned(self.rule)
        for i, fam in enumerate(self.rule.families):
            h = self.hist[i]
            first = self.first_off.get(fam.name)
            out[fam.name] = {"reduce": fam.reduce, "pinned": list(fam.pinned), "every_path": fam.every_path,
                             "zero_blocks": int(self.zero[i]), "off_blocks": int(h[pinned[i] == 0].sum()),
                             "extreme_codes": {int(b) + fam.lo: int(n) for b, n in enumerate(h) if n},
                             "first_off_block": None if first is None else first[0],
                             "first_off_code": None if first is None else first[1]}
        return out


def _extreme(fam: CodeFamily, codes: np.ndarray) -> np.ndarray:
    """Each block's extreme code: int [n] of codes [n, sub-blocks]."""
    return codes.max(1) if fam.reduce == "max" else codes.min(1)

