"""Weight forensics (checks/file/forensics.py): silent on the demo and on tiny HF-made models; finds the
planted block-scale noise, an inf scale and a Q4_K d/dmin exchange; and, honestly, cannot see two
layers' tensors exchanged or one tensor's rows shuffled (the statistics are invariant under both)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from llmdoctor import faults
from llmdoctor.checks.file import block_scales as BS
from llmdoctor.checks.file import forensics as F
from llmdoctor.checks.file import forensics_native as FN
from llmdoctor.checks.file import tensor_stats as TS
from llmdoctor.gguf import open_gguf


@pytest.fixture(scope="module")
def demo_stats(demo_path):
    findings, stats = F.analyze(demo_path)
    return findings, stats


def _restat(path, demo_path, base: list[TS.TensorStats]) -> list[TS.TensorStats]:
    """Statistics of a corrupted copy: recomputed for the tensors whose bytes differ from the demo's."""
    by = {s.name: s for s in base}
    with open_gguf(path) as g, open_gguf(demo_path) as d:
        changed = [t for t in g.tensors if not np.array_equal(t.data, d.tensor(t.name).data)]
        assert changed, "the fault changed nothing"
        for t in changed:
            by[t.name] = TS.tensor_stats(t)
    return [by[s.name] for s in base]


def _failed(findings):
    return [f for f in findings if f.status == "fail"]


def test_demo_is_silent(demo_stats):
    findings, stats = demo_stats
    assert _failed(findings) == []
    summary = next(f for f in findings if f.target == "siblings")
    assert summary.status == "pass" and summary.metrics["roles_compared"] >= 10
    # the rule's limit is the Bonferroni quantile over the tests run
    assert 4 < summary.metrics["limit"] < 5


def test_scale_noise_found(demo_path, demo_stats, tmp_path):
    bad = faults.get("attn-block-scales").build(demo_path, tmp_path, layers="blk.7.attn_output")
    found = _failed(F.compare(_restat(bad, demo_path, demo_stats[1])))
    assert [f.target for f in found] == ["blk.7.attn_output.weight"]
    m = {o["metric"]: o for o in found[0].metrics["outliers"]}
    assert m["d_negative"]["value"] > 0.4 and m["d_negative"]["siblings_median"] == 0.0
    assert "of block scales negative" in found[0].explanation and "17 siblings" in found[0].explanation


@pytest.mark.parametrize("tensor,metric", [("blk.1.ffn_down.weight", "d_jitter"),  # Q6_K: d signed, at the end
                                           ("blk.7.attn_q.weight", "d_jitter")])  # Q5_0: d signed, first
def test_scale_noise_found_on_signed_scale_types(demo_path, demo_stats, tmp_path, tensor, metric):
    bad = faults.get("scale-noise").build(demo_path, tmp_path, tensor=tensor)
    found = _failed(F.compare(_restat(bad, demo_path, demo_stats[1])))
    assert [f.target for f in found] == [tensor]
    assert metric in {o["metric"] for o in found[0].metrics["outliers"]}


def test_inf_scale_found_end_to_end(demo_path, tmp_path):
    bad = faults.get("scale-inf").build(demo_path, tmp_path, tensor="blk.7.attn_output.weight", block=3)
    found = _failed(F.analyze(bad)[0])
    assert [f.target for f in found] == ["blk.7.attn_output.weight"]
    assert "1 non-finite block scale(s) d" in found[0].explanation
    assert found[0].metrics["first_nonfinite_block"] == 3


def test_d_dmin_swap_found(demo_path, demo_stats, tmp_path):
    bad = faults.get("q4k-d-dmin-swap").build(demo_path, tmp_path)
    with open_gguf(bad) as g:
        name = next(t.name for t in g.tensors if t.type == QT.Q4_K and t.name.startswith("blk."))
    found = _failed(F.compare(_restat(bad, demo_path, demo_stats[1])))
    assert [f.target for f in found] == [name]
    metrics = {o["metric"] for o in found[0].metrics["outliers"]}
    assert "dmin_over_d" in metrics


@pytest.mark.parametrize("fault", ["mapping-swap-layers", "rows-shuffled"])
def test_what_a_lone_file_cannot_see(demo_path, demo_stats, tmp_path, fault):
    """Exchanged layers and shuffled rows leave every statistic of every tensor unchanged (as a set):
    no finding, and the README says so."""
    if fault == "mapping-swap-layers":
        bad, _ = faults.get(fault).build(demo_path, None, tmp_path, kind="attn_output.weight")
    else:
        bad = faults.get(fault).build(demo_path, tmp_path, tensor="blk.7.attn_output.weight")
    stats = _restat(bad, demo_path, demo_stats[1])
    assert _failed(F.compare(stats)) == []
    before = sorted((s.rms, s.max_abs) for s in demo_stats[1])
    after = sorted((s.rms, s.max_abs) for s in stats)
    assert np.allclose(before, after, rtol=1e-6)
    assert "cannot see" in (F.__doc__ or "")


def test_every_block_scale_layout_matches_gguf_py():
    """The scale fields read where gguf-py's dequantizer reads them: a block whose d is set to 1
    (and dmin/m to 0) dequantizes to values that scale with d when d is doubled."""
    from llmdoctor.gguf import dequantize

    rng = np.random.default_rng(0)
    for q, fields in BS.SCALE_FIELDS.items():
        d = next((f for f in fields if f.name == "d" and f.encoding == "f16"), None)
        if d is None:
            continue
        bs, ts = GGML_QUANT_SIZES[q]
        block = rng.integers(0, 256, ts, dtype=np.uint8)
        for f in fields:
            block[f.offset:f.offset + 2] = np.array([0.0 if f.name != "d" else 1.0], "<f2").view(np.uint8)
        v1 = dequantize(block, q, (bs,)).numpy()
        block[d.offset:d.offset + 2] = np.array([2.0], "<f2").view(np.uint8)
        v2 = dequantize(block, q, (bs,)).numpy()
        assert np.array_equal(v2, 2 * v1), q.name
        assert BS.scale_values(block[None], d)[0] == 2.0


def test_streaming_equals_whole(demo_path):
    """verify's chunked pass gives the statistics of the whole tensor."""
    from llmdoctor.gguf import dequantize

    with open_gguf(demo_path) as g:
        t = g.tensor("blk.3.ffn_down.weight")
        whole = TS.tensor_stats(t, dequantize(t.data, int(t.type), t.shape))
        acc = TS.Accumulator(t.name, t.type)
        blocks = t.data.reshape(-1, t.type_size)
        for b0 in range(0, blocks.shape[0], 1000):
            chunk = blocks[b0:b0 + 1000]
            acc.add(chunk, dequantize(chunk.reshape(-1), int(t.type), (chunk.shape[0] * t.block_size,)))
        part = acc.finish()
    jit = [(x["d"].pop("jitter"), y["d"].pop("jitter")) for x, y in ((part.scales, whole.scales),)][0]
    assert part.scales == whole.scales and part.n_values == whole.n_values and np.isclose(*jit, rtol=1e-9)
    assert np.isclose(part.rms, whole.rms, rtol=1e-6) and np.isclose(part.kurtosis, whole.kurtosis, rtol=1e-5)


@pytest.mark.parametrize("tensor", ["blk.3.ffn_down.weight", "blk.0.ffn_down.weight", "blk.2.attn_q.weight"])
def test_merged_parts_equal_one_pass_to_the_bit(demo_path, tensor):
    """verify's workers gather chunks of one tensor into accumulators of their own, joined in file order
    by merge(): the statistics of one sequential pass over the same pieces, to the bit, with the first
    non-finite block and the first off sub-block counted from the tensor's start."""
    from llmdoctor.gguf import dequantize

    with open_gguf(demo_path) as g:
        t = g.tensor(tensor)
        blocks = t.data.reshape(-1, t.type_size).copy()
    blocks[-3, :] = 0xFF  # the last chunk's: a non-finite scale (f16 0xFFFF) and off sub-block codes
    unit = 512
    pieces = [blocks[b0:b0 + unit] for b0 in range(0, blocks.shape[0], unit)]
    values = [dequantize(p.reshape(-1), int(t.type), (p.shape[0] * t.block_size,)) for p in pieces]
    one = TS.Accumulator(t.name, t.type)
    for p, v in zip(pieces, values):
        one.add(p if one.fields else None, v)
    joined = TS.Accumulator(t.name, t.type)
    for lo in range(0, len(pieces), 3):  # chunks of three pieces, each in its own accumulator
        part = TS.Accumulator(t.name, t.type)
        for p, v in zip(pieces[lo:lo + 3], values[lo:lo + 3]):
            part.add(p if part.fields else None, v)
        joined.merge(part)
    a, b = one.finish(), joined.finish()
    assert str(a.as_dict()) == str(b.as_dict())  # to the bit (repr: NaN-safe)
    assert a.first_nonfinite_block is not None and a.first_nonfinite_block >= blocks.shape[0] - 3
    assert a.n_values == t.n_elements


def test_one_native_call_per_chunk_equals_piece_by_piece():
    """add_decoded (the chunk decoded and gathered in one C call) against add() piece by piece, to the
    bit, on F32 pieces the C pass hands back: one with a NaN, one with max |w| ~1e30 and one ~1e-30
    (outside the range its sums are taken in), between ordinary ones."""
    import torch

    decoder = FN.native_decoding(QT.F32)
    if decoder is None:
        pytest.skip("skipped: the native libraries are not built here")
    rng = np.random.default_rng(1)
    unit = 1000  # values per piece (F32: one value per block)
    values = rng.standard_normal(6 * unit).astype(np.float32)
    values[unit + 7] = np.nan
    values[2 * unit:3 * unit] *= np.float32(1e30)
    values[4 * unit:5 * unit] *= np.float32(1e-30)
    blocks = values.view(np.uint8).reshape(-1, 4)
    one = TS.Accumulator("t", QT.F32)
    for b0 in range(0, len(values), unit):
        one.add(None, torch.from_numpy(values[b0:b0 + unit].copy()))
    fused = TS.Accumulator("t", QT.F32)
    bad = fused.add_decoded(blocks, decoder, unit, torch.empty(unit))
    assert bad == [1]
    assert repr(one.finish().as_dict()) == repr(fused.finish().as_dict())


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])
def test_tiny_hf_models_are_silent(tmp_path, name):
    """Tiny random models made with transformers (tests/reference/test_reference_dense.py), F32 and quantized by
    gguf-py (Q8_0 / Q4_0 / Q5_1 block scales): no finding; their roles have too few layers for the
    sibling rule except gemma3's 6, and that is said."""
    from gguf import quants
    from test_check_mapping import _rewrite
    from test_reference_dense import TINY, tiny_gguf

    model_type, arch, extra = TINY[name]
    _, _, path = tiny_gguf(tmp_path, model_type, arch, extra)
    kinds = {"attn_q": QT.Q8_0, "attn_k": QT.Q4_0, "ffn_up": QT.Q5_1}

    def quantize(tname, data, qt):
        t = kinds.get(tname.split(".")[-2])
        yield (tname, data, qt) if t is None or data.shape[-1] % 32 else (tname, quants.quantize(data, t), t)

    for p in (path, _rewrite(path, tmp_path / "q.gguf", quantize)):
        findings, stats = F.analyze(p)
        assert _failed(findings) == [], [f.explanation for f in _failed(findings)]
        summary = next(f for f in findings if f.target == "siblings")
        assert summary.status == ("pass" if name == "gemma3" else "skip"), summary
