"""One tensor's forensic statistics, gathered in one streaming pass (verify feeds it per chunk):

    acc = Accumulator(name, qtype)              # one per tensor
    acc.add(blocks, values)                     # blocks: uint8 [n, type_size]; values: float32, any shape
    stats = acc.finish()                        # TensorStats

Block scales (block_scales.py), sub-block codes (subblock_codes.py) and weight moments (weight_moments.py)
per chunk, joined in file order however the chunks were spread over threads."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from .block_scales import SCALE_FIELDS, ScaleStats
from . import forensics_native as fx_native  # its NATIVE read at each call: tests switch it off
from .subblock_codes import SUBBLOCKS, SubBlockStats
from .weight_moments import SAFE, Moments, scan


@dataclass
class TensorStats:
    """One tensor's statistics: per scale field, and of its dequantized (finite) values."""

    name: str
    qtype: str
    n_values: int
    nonfinite: int
    rms: float
    mean: float
    max_abs: float
    kurtosis: float  # E[(w - mean)^4] / var^2 (3 for a Gaussian)
    scales: dict[str, dict[str, Any]] = field(default_factory=dict)
    scale_medians: dict[str, float] = field(default_factory=dict)  # log2 of the median |s| per field
    first_nonfinite_block: int | None = None
    subblocks: dict[str, Any] = field(default_factory=dict)  # K-quants: SubBlockStats.summary()

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("name", "qtype", "n_values", "nonfinite", "rms", "mean", "max_abs",
                                              "kurtosis", "scales", "first_nonfinite_block", "subblocks")}


class Accumulator:
    """Gathers one tensor's statistics chunk by chunk, in file order (weight_moments.py's notes);
    merge() joins the accumulators of consecutive runs of blocks, as gathered on different threads."""

    def __init__(self, name: str, qtype: QT | int):
        self.name, self.qtype = name, QT(qtype)
        self.fields = SCALE_FIELDS.get(self.qtype, ())
        self.scales = {f.name: ScaleStats(f.encoding) for f in self.fields}
        self.subblocks = SubBlockStats(self.qtype) if self.qtype in SUBBLOCKS else None
        # of the finite values, one entry per add (a piece), folded in file order by finish(): the same
        # numbers however the pieces were grouped into the accumulators that merge() joined
        self.moments: list[Moments] = []
        self.n = self.nonfinite = 0
        self.max_abs = 0.0
        self._blocks_seen = 0
        self.first_nonfinite_block: int | None = None

    def add(self, blocks: np.ndarray | None, values: torch.Tensor | np.ndarray) -> bool:
        """One chunk: its raw blocks (uint8 [n, type_size]; None for float types) and its dequantized
        values (float32, n * block_size of them, in block order; a torch tensor on any device, or numpy).
        Its two halves (add_blocks, add_values) touch disjoint state: two threads may feed one each.
        Returns add_values's answer: whether every value is finite."""
        if blocks is not None:
            self.add_blocks(blocks)
        return self.add_values(values)

    def add_blocks(self, blocks: np.ndarray) -> None:
        """The raw blocks' half of add: block scales and sub-block codes."""
        for f in self.fields:
            self.scales[f.name].add_blocks(blocks, f)
        if self.subblocks is not None:
            self.subblocks.add(blocks)

    def add_values(self, values: torch.Tensor | np.ndarray) -> bool:
        """The decoded values' half of add: finiteness, max |w|, moments. Returns whether every value
        is finite (from the scan the moments need anyway: verify's check of the piece reuses it)."""
        v = torch.as_tensor(values).detach().reshape(-1)  # [n]
        if v.dtype != torch.float32 or not v.is_contiguous():
            v = v.to(torch.float32).contiguous()
        threads = torch.get_num_threads()  # this thread's; verify's statistics thread already runs on one
        if threads > 1 and v.device.type == "cpu":
            torch.set_num_threads(1)
        try:
            return self._values(v)
        finally:
            if threads > 1 and v.device.type == "cpu":
                torch.set_num_threads(threads)

    def _values(self, v: torch.Tensor) -> bool:
        bs = GGML_QUANT_SIZES[self.qtype][0]
        bad, w = 0, v
        if v.numel():
            lo, hi, total, ok = scan(v)
            if not ok:  # NaN or inf somewhere: the exact count
                finite = torch.isfinite(v)
                bad = v.numel() - int(finite.sum())
                if self.first_nonfinite_block is None:
                    self.first_nonfinite_block = self._blocks_seen + int((~finite).nonzero()[0, 0]) // bs
                w = v[finite]
                lo, hi, total, _ = scan(w) if w.numel() else (0.0, 0.0, 0.0, True)
            self.max_abs = max(self.max_abs, -lo, hi)
            self.moments.append(Moments.of(w, max(-lo, hi), total))
        self._blocks_seen += v.numel() // bs
        self.n += v.numel()
        self.nonfinite += bad
        return bad == 0

    def add_blocks_in_pieces(self, blocks: np.ndarray, piece_blocks: int) -> None:
        """add_blocks of each piece of piece_blocks consecutive blocks in turn (uint8 [n, type_size]): to
        the bit the same, in one native call per float16 scale field where the library is built."""
        n_blocks = blocks.shape[0]
        if fx_native.NATIVE is None or not blocks.flags.c_contiguous:
            for b0 in range(0, n_blocks, piece_blocks):
                self.add_blocks(blocks[b0:b0 + piece_blocks])
            return
        for f in self.fields:
            self.scales[f.name].add_pieces(blocks, f, piece_blocks)
        if self.subblocks is not None:
            self.subblocks.add(blocks)

    def add_decoded(self, blocks: np.ndarray, decoder: tuple[int, int], piece_blocks: int, out: torch.Tensor) -> list[int]:
        """A chunk of consecutive raw blocks (uint8 [n, type_size], C-contiguous) decoded here, piece by
        piece (piece_blocks at a time), by the C kernel `decoder` (gguf.dequant_native.kernel_address)
        into `out` (float32, CPU, >= piece_blocks * block_size values): the statistics of add() of each
        piece in turn, to the bit, in one native call for the values and one per float16 scale field.
        A piece the C pass leaves (a value inf or NaN, or max |w| outside the range its sums take) is
        decoded again and added by _values. Returns the pieces (indices in the chunk) that hold a
        value that is inf or NaN. Needs the native library (native_decoding())."""
        n_blocks, bs = blocks.shape[0], GGML_QUANT_SIZES[self.qtype][0]
        n_pieces = -(-n_blocks // piece_blocks)
        self.add_blocks_in_pieces(blocks, piece_blocks)
        fn, table = decoder
        res = np.empty((n_pieces, 7))
        fx_native.NATIVE.llmd_fx_pieces(fn, table or None, blocks.ctypes.data, n_blocks, blocks.shape[1], bs,
                                        piece_blocks, out.data_ptr(), SAFE[0], SAFE[1], res.ctypes.data)
        bad = []
        for p, (lo, hi, total, nonfinite, s2, s3, s4) in enumerate(res.tolist()):
            b0 = p * piece_blocks
            n = min(piece_blocks, n_blocks - b0) * bs
            if math.isnan(s2):  # left to the per-piece path: decode it again
                piece = blocks[b0:b0 + piece_blocks]
                fx_native.NATIVE.llmd_fx_pieces(fn, table or None, piece.ctypes.data, piece.shape[0], blocks.shape[1],
                                                bs, piece_blocks, out.data_ptr(), SAFE[0], SAFE[1],
                                                (ctypes.c_double * 7)())
                self._values(out[:n])
                if nonfinite:
                    bad.append(p)
                continue
            self.max_abs = max(self.max_abs, -lo, hi)
            self.moments.append(Moments.of_sums(n, total / n, s2, s3, s4))
            self._blocks_seen += n // bs
            self.n += n
        return bad

    def merge(self, o: "Accumulator") -> None:
        """self := self followed by o, an accumulator of the same tensor's next blocks (both halves: a
        half o was not fed is empty and changes nothing)."""
        for name, st in o.scales.items():
            self.scales[name].merge(st)
        if self.subblocks is not None and o.subblocks is not None:
            self.subblocks.merge(o.subblocks)
        if self.first_nonfinite_block is None and o.first_nonfinite_block is not None:
            self.first_nonfinite_block = self._blocks_seen + o.first_nonfinite_block
        self.moments += o.moments
        self.max_abs = max(self.max_abs, o.max_abs)
        self.n += o.n
        self.nonfinite += o.nonfinite
        self._blocks_seen += o._blocks_seen

    def finish(self) -> TensorStats:
        m = Moments()
        for piece in self.moments:
            m.merge(piece)
        k = max(m.n, 1)
        var = m.m2 / k
        summaries = {n: s.summary() for n, s in self.scales.items()}
        return TensorStats(self.name, self.qtype.name, self.n, self.nonfinite, math.sqrt(var + m.mean * m.mean),
                           m.mean, self.max_abs, m.m4 / k / (var * var) if var > 0 else math.nan, summaries,
                           {n: s["log2_median"] for n, s in summaries.items() if "log2_median" in s},
                           self.first_nonfinite_block, self.subblocks.summary() if self.subblocks is not None else {})


CHUNK_VALUES = 1 << 20  # values per chunk (verify's chunk): two float32 scratch buffers of 4 MiB


def tensor_stats(t: Any, values: torch.Tensor | None = None) -> TensorStats:
    """Statistics of a whole tensor (a reader TensorInfo), chunk by chunk; `values` when already
    dequantized (float32, any shape, block order)."""
    from ...gguf import dequantize

    acc = Accumulator(t.name, t.type)
    bs, ts = t.block_size, t.type_size
    blocks = t.data.reshape(-1, ts)  # [n_blocks, type_size]
    step = max(CHUNK_VALUES // bs, 1)
    flat = values.reshape(-1) if values is not None else None
    for b0 in range(0, blocks.shape[0], step):
        chunk = blocks[b0:b0 + step]
        v = flat[b0 * bs:(b0 + chunk.shape[0]) * bs] if flat is not None else \
            dequantize(chunk.reshape(-1), int(t.type), (chunk.shape[0] * bs,))
        acc.add(chunk if acc.fields else None, v)
    return acc.finish()
