"""gguf/block_layout.py against gguf-py's own decoding: every block scale sits where gguf-py reads it (doubling
each scalar scale doubles every decoded value), and the K-quants' sub-block codes unpack and pack back to
the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf import quants

from llmdoctor.gguf.block_layout import BLOCKS, pack_k4_scales, subblock_codes

QUANTIZED = [q for q in sorted(quants._type_traits, key=int) if GGML_QUANT_SIZES[q][0] > 1]


def test_every_quantized_type_gguf_py_decodes_has_a_layout():
    assert sorted(BLOCKS, key=int) == QUANTIZED


@pytest.mark.parametrize("qtype", [q for q in QUANTIZED if any(f.encoding for f in BLOCKS[q].fields)],
                         ids=lambda q: q.name)
def test_scalar_scales_are_where_gguf_py_reads_them(qtype):
    """Every scalar scale (d, dmin, m; MXFP4's exponent e) times 2 doubles every value gguf-py decodes: a
    field at a wrong offset would change quants or other scales instead."""
    rng = np.random.default_rng(int(qtype))
    blocks = rng.integers(0, 256, (64, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    scaled = blocks.copy()
    for f in BLOCKS[qtype].fields:
        if f.encoding == "f16":  # |scale| in [2^-8, 2^8): doubling stays exact and finite
            s = rng.uniform(2 ** -8, 2 ** 8, blocks.shape[0]) * rng.choice([-1, 1], blocks.shape[0])
            blocks[:, f.offset:f.end] = s.astype("<f2").view(np.uint8).reshape(-1, 2)
            scaled[:, f.offset:f.end] = (2 * s).astype("<f2").view(np.uint8).reshape(-1, 2)
        elif f.encoding == "e8m0":
            blocks[:, f.offset] = rng.integers(100, 150, blocks.shape[0])
            scaled[:, f.offset] = blocks[:, f.offset] + 1
    want = quants.dequantize(blocks, qtype)
    assert np.array_equal(quants.dequantize(scaled, qtype), 2 * want)


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K], ids=lambda q: q.name)
def test_subblock_codes_unpack_as_gguf_py_and_pack_back(qtype):
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (32, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    codes = subblock_codes(blocks, qtype)
    n_sub = {QT.Q4_K: 8, QT.Q5_K: 8}.get(qtype, 16)
    assert all(c.shape == (32, n_sub) for c in codes.values())
    if qtype in (QT.Q4_K, QT.Q5_K):
        f = BLOCKS[qtype]["scales"]
        assert np.array_equal(pack_k4_scales(codes["scales"], codes["mins"]), blocks[:, f.offset:f.end])
        sc, mn = quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, f.offset:f.end]))
        assert np.array_equal(codes["scales"], sc) and np.array_equal(codes["mins"], mn)
