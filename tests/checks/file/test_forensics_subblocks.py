"""Sub-block codes of K-quant blocks (checks/file/subblock_codes.py, SUBBLOCKS): llama.cpp's own quantizer
(ggml_quantize_chunk, through llama-cpp-python's bundled ggml) keeps every pinned end on every kind of
data, with and without an importance matrix where the source says so; the demo keeps them all; and a
tensor whose sub-block scale bytes were changed (faults: subblock-scales) is named by `verify` and by
diagnose's file-integrity step, for every K-quant type."""

from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from llmdoctor import faults
from llmdoctor.checks.file import forensics as F
from llmdoctor.checks.file import forensics_native as FN
from llmdoctor.checks.file import subblock_codes as SB
from llmdoctor.checks.file import tensor_stats as TS
from llmdoctor.checks.file import verify
from llmdoctor.cli import app
from gguf_builders import write_file

KQUANTS = (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)


@pytest.fixture(scope="module")
def quantize():
    """llama.cpp's quantizer for one matrix: (x float32 [rows, n], qtype, imatrix float32 [n] or None)
    -> raw blocks uint8 [rows * n / 256, type_size]. Without an importance matrix ggml_quantize_chunk
    runs quantize_row_*_ref (what llama_model_quantize does without one), with one the *_impl path."""
    pytest.importorskip("llama_cpp")
    from llama_cpp._ggml import libggml

    fn = libggml.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p]

    def run(x: np.ndarray, qtype: QT, imatrix: np.ndarray | None = None) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        bs, ts = GGML_QUANT_SIZES[qtype]
        out = np.zeros((x.size // bs, ts), np.uint8)
        im = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
        fn(int(qtype), x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1],
           None if im is None else im.ctypes.data)
        return out

    return run


def _data(kind: str, rng: np.random.Generator, rows: int = 64, n: int = 1024) -> np.ndarray:
    """x: float32 [rows, n] of one kind of weights, degenerate blocks included."""
    x = rng.standard_normal((rows, n)).astype(np.float32)
    if kind == "t3":  # heavy tails
        x = rng.standard_t(3, (rows, n)).astype(np.float32)
    elif kind == "one-sign":  # every min is 0: the all-zero min codes
        x = np.abs(x)
    elif kind == "sparse":
        x[rng.random((rows, n)) < 0.9] = 0
    elif kind == "zero-blocks":  # whole super-blocks of zeros, and sub-blocks of tiny values
        x[:, :256] = 0
        x[:, 300:305] = 1e-3
    elif kind == "constant":
        x[:] = 0.5
    return x * np.float32(0.02)


def _stats(blocks: np.ndarray, qtype: QT) -> dict:
    s = SB.SubBlockStats(qtype)
    s.add(blocks)
    return s.summary()


KINDS = ("normal", "t3", "one-sign", "sparse", "zero-blocks", "constant")
IMATRICES = ("ones", "uniform", "lognormal")


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
def test_llama_cpp_quantizer_keeps_the_pinned_ends(quantize, qtype):
    """Every kind of data, without an importance matrix: 0 blocks off the pinned end, in every family.
    With one (three matrices): still 0 for Q3_K and Q6_K (every_path); Q2_K, Q4_K and Q5_K do land off
    it (their make_qp_quants refinement), which is why their rule is exact only without one."""
    rng = np.random.default_rng(0)
    imatrix_off = 0
    for kind in KINDS:
        x = _data(kind, rng)
        s = _stats(quantize(x, qtype), qtype)
        for fam in SB.SUBBLOCKS[qtype].families:
            assert s[fam.name]["off_blocks"] == 0, (kind, fam.name, s[fam.name]["extreme_codes"])
        for im in IMATRICES:
            w = {"ones": np.ones(x.shape[1]), "uniform": rng.random(x.shape[1]),
                 "lognormal": rng.lognormal(0, 3, x.shape[1])}[im]
            s = _stats(quantize(x, qtype, w), qtype)
            for fam in SB.SUBBLOCKS[qtype].families:
                if fam.every_path:
                    assert s[fam.name]["off_blocks"] == 0, (kind, im, fam.name, s[fam.name]["extreme_codes"])
                else:
                    imatrix_off += s[fam.name]["off_blocks"]
    assert (imatrix_off > 0) == (not all(f.every_path for f in SB.SUBBLOCKS[qtype].families))


def test_degenerate_blocks_are_counted_not_flagged(quantize):
    """A super-block of zeros is written with all codes 0: counted as zero_blocks, never off."""
    x = _data("zero-blocks", np.random.default_rng(1))
    for qtype in KQUANTS:
        s = _stats(quantize(x, qtype), qtype)
        for fam in SB.SUBBLOCKS[qtype].families:
            assert s[fam.name]["zero_blocks"] >= x.shape[0] and s[fam.name]["off_blocks"] == 0, (qtype.name, fam.name)


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda q: q.name)
def test_native_counts_equal_numpy(qtype, monkeypatch):
    """The C counts (llmd_fx_subblocks) and numpy's unpacking agree on random bytes, all-zero codes
    included, across chunk boundaries."""
    if FN.NATIVE is None:
        pytest.skip("skipped: the forensics C passes are not built")
    rng = np.random.default_rng(4)
    lay = SB.SUBBLOCKS[qtype]
    b = rng.integers(0, 256, (3000, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    b[::7, lay.codes.offset:lay.codes.end] = 0
    native = SB.SubBlockStats(qtype)
    native.add(b[:1000])
    native.add(b[1000:])
    monkeypatch.setattr(FN, "NATIVE", None)
    plain = SB.SubBlockStats(qtype)
    plain.add(b[:1000])
    plain.add(b[1000:])
    assert native.summary() == plain.summary()
    assert plain.summary()["scales"]["zero_blocks"] == 429 and plain.summary()["scales"]["off_blocks"] > 0


LAYERS = 4


@pytest.fixture(scope="module")
def kquant_file(quantize, tmp_path_factory):
    """A GGUF of LAYERS layers with one tensor per K-quant type each (blk.N.<type>.weight, 512 blocks),
    quantized by llama.cpp without an importance matrix."""
    rng = np.random.default_rng(2)
    tensors = {}
    for layer in range(LAYERS):
        for qtype in KQUANTS:
            x = _data("normal", rng, rows=128, n=1024)
            raw = quantize(x, qtype).reshape(128, -1)  # [rows, row bytes]
            tensors[f"blk.{layer}.{qtype.name.lower()}.weight"] = (qtype, (1024, 128), raw)
    return write_file(tmp_path_factory.mktemp("kq") / "kquant.gguf", tensors=tensors, metadata=False)


def _corrupt_each_type(src, out_dir, layer: int = 2):
    """A copy with `subblock-scales` planted in blk.<layer>.<type>.weight for every K-quant type."""
    targets = [f"blk.{layer}.{qtype.name.lower()}.weight" for qtype in KQUANTS]
    return faults.get("subblock-scales").build(src, out_dir, tensor=targets, fraction=0.25), targets


def _subblock_fails(findings):
    return sorted(f.target for f in findings if f.status == "fail" and f.id.startswith("forensics/subblocks/"))


def test_verify_clean_file_passes_and_names_each_corrupted_type(kquant_file, tmp_path):
    clean = verify.run(kquant_file)
    assert [f for f in clean.findings if f.status == "fail"] == []
    summary = next(f for f in clean.findings if f.target == "siblings")
    assert summary.metrics["subblocks"]["partial_rule_exact"] and summary.metrics["subblocks"]["tensors"] == 20
    bad, targets = _corrupt_each_type(kquant_file, tmp_path)
    res = verify.run(bad)
    assert _subblock_fails(res.findings) == sorted(targets)
    f = next(f for f in res.findings if f.target == "blk.2.q6_k.weight" and f.id.startswith("forensics/subblocks/"))
    assert "Q6_K blocks have their min sub-block scale code off -128" in f.explanation
    assert f.metrics["subblocks"]["scales"]["first_off_code"] != -128 and f.budget == {"off_blocks_max": 0}


def test_detection_rate_per_corrupted_block(kquant_file, tmp_path):
    """One random byte changed per block: the share of damaged blocks the rule sees, by type (it sees a
    block when the byte moves the extreme sub-block's code). Measured, seed 0..3, 128 damaged blocks of
    512 each: printed for bench/RESULTS.md; each type sees at least 1 in 20."""
    from llmdoctor.gguf import open_gguf

    for i, qtype in enumerate(KQUANTS):
        name = f"blk.1.{qtype.name.lower()}.weight"
        seen = damaged = 0
        for seed in range(4):
            d = tmp_path / f"{i}-{seed}"
            d.mkdir()
            bad = faults.get("subblock-scales").build(kquant_file, d, tensor=name, fraction=0.25, seed=seed)
            with open_gguf(bad) as g:
                s = TS.tensor_stats(g.tensor(name)).subblocks
            damaged += 128
            seen += max(s[f.name]["off_blocks"] for f in SB.SUBBLOCKS[qtype].families)
        print(f"{qtype.name}: {seen / damaged:.1%} of damaged blocks off the pinned end")
        assert seen / damaged > 0.05


def test_importance_matrix_mark_turns_the_partial_rule_into_a_sibling_comparison(quantize, tmp_path):
    """Q4_K quantized with an importance matrix has blocks off 63: with no record in the metadata the
    file's mark (most Q2_K/Q4_K/Q5_K tensors off) keeps the exact rule from firing on every tensor; Q6_K
    in the same file stays exact."""
    rng = np.random.default_rng(3)
    tensors = {}
    for layer in range(LAYERS):
        for qtype in (QT.Q4_K, QT.Q6_K):
            x = _data("normal", rng, rows=64, n=1024)
            tensors[f"blk.{layer}.{qtype.name.lower()}.weight"] = (
                qtype, (1024, 64), quantize(x, qtype, rng.random(1024)).reshape(64, -1))
    path = write_file(tmp_path / "imatrix.gguf", tensors=tensors, metadata=False)
    findings, stats = F.analyze(path)
    assert [f for f in findings if f.status == "fail"] == []
    rules = next(f for f in findings if f.target == "siblings").metrics["subblocks"]
    assert not rules["partial_rule_exact"] and rules["partial_tensors_off"] == LAYERS
    by = {s.name: s.subblocks for s in stats}
    assert by["blk.0.q4_k.weight"]["scales"]["rule"] == "siblings"
    assert by["blk.0.q6_k.weight"]["scales"]["rule"] == "exact"
    assert "compared among siblings" in next(f for f in findings if f.target == "siblings").explanation


def test_recorded_importance_matrix_turns_the_partial_rule_into_a_sibling_comparison(kquant_file, tmp_path):
    """llama-quantize records its importance matrix (quantize.imatrix.*): then a Q4_K tensor off 63 is
    not damage by itself (compared among siblings), while Q6_K stays exact."""
    from gguf import GGUFValueType

    from llmdoctor.faults.mapping import _rewrite

    damaged = ("blk.2.q4_k.weight", "blk.2.q6_k.weight")
    bad = faults.get("subblock-scales").build(kquant_file, tmp_path, tensor=damaged, fraction=0.25)
    recorded = _rewrite(bad, tmp_path / "recorded.gguf", lambda *t: [t],
                        {"quantize.imatrix.file": ("imatrix.dat", GGUFValueType.STRING)})
    findings, stats = F.analyze(recorded)
    assert _subblock_fails(findings) == ["blk.2.q6_k.weight"]
    by = {s.name: s.subblocks for s in stats}
    assert by["blk.2.q4_k.weight"]["scales"]["rule"] == "siblings" and by["blk.2.q4_k.weight"]["scales"]["off_blocks"]


def test_demo_sub_blocks_all_pinned(demo_path):
    findings, stats = F.analyze(demo_path)
    k = [s for s in stats if s.subblocks]
    assert {s.qtype for s in k} == {"Q4_K", "Q6_K"} and len(k) == 36
    for s in k:
        for fam in SB.SUBBLOCKS[QT[s.qtype]].families:
            assert s.subblocks[fam.name]["off_blocks"] == 0 and s.subblocks[fam.name]["rule"] == "exact"
    assert _subblock_fails(findings) == []


@pytest.fixture(scope="module")
def demo_every_kquant(demo_path, quantize, tmp_path_factory):
    """The demo with blk.2/3/4.attn_output (Q4_K) re-quantized by llama.cpp to Q2_K, Q3_K and Q5_K, so that
    one model carries every K-quant type (blk.5.attn_output stays Q4_K, blk.1.ffn_down is Q6_K), and the
    tensors of each type to damage."""
    from llmdoctor.faults.mapping import _rewrite
    from llmdoctor.gguf import dequantize

    retype = {"blk.2.attn_output.weight": QT.Q2_K, "blk.3.attn_output.weight": QT.Q3_K,
              "blk.4.attn_output.weight": QT.Q5_K}

    def edit(name, data, qtype):
        if name not in retype:
            yield name, data, qtype
            return
        rows = data.shape[0]  # data: raw bytes [rows, row bytes]
        x = dequantize(data.reshape(-1), int(qtype), (rows, data.shape[1] // GGML_QUANT_SIZES[qtype][1] * 256)).numpy()
        yield name, quantize(x, retype[name]).reshape(x.shape[0], -1), retype[name]

    path = _rewrite(demo_path, tmp_path_factory.mktemp("demo-kq") / "demo-kq.gguf", edit)
    return path, [*retype, "blk.5.attn_output.weight", "blk.1.ffn_down.weight"]


@pytest.mark.slow
def test_diagnose_file_integrity_names_every_damaged_type(demo_every_kquant, tmp_path):
    """diagnose on the demo carrying every K-quant type, one tensor of each damaged: the top suspect is
    a forensics finding of its own per damaged tensor under file-integrity (high confidence), all five named; the finite-weights
    finding still passes (damaged codes are no non-finite weights)."""
    src, targets = demo_every_kquant
    bad = faults.get("subblock-scales").build(src, tmp_path, tensor=targets, fraction=0.05)
    r = CliRunner().invoke(app, ["diagnose", "--json", "--threads", "2", "--prompt", "The sky is",  # short: fast
                                 "--gguf", str(bad)])
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == 1, doc["verdict"]
    damaged = [f for f in doc["findings"] if f["step"] == "file-integrity" and f["status"] == "fail"]
    assert all(f["check"] == "forensics" and f["id"].startswith("forensics/") for f in damaged), damaged
    assert doc["suspects"][0] == damaged[0]["id"] and all(f["confidence"] == "high" for f in damaged)
    assert "sub-block scale bytes were changed after quantization" in damaged[0]["explanation"]
    assert {f["target"] for f in damaged} == set(targets), damaged
    finite = next(f for f in doc["findings"] if f["id"].startswith("file-integrity/") and f["status"] == "pass")
    assert finite["metrics"]["tensors_with_non_finite"] == 0  # damaged codes are not non-finite weights
