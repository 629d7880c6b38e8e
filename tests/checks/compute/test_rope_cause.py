"""The RoPE cause named from a divergence's error pattern (issue 35 item 3), on reference-side planted faults
(faults/reference.py): the reference runs with the fault (float64, its float32 run the emulated one), a healthy
float32 reference stands in for the engine, and the first divergent point's pattern is read as diagnose reads it
(diagnose/hypotheses.py rope_at, checks/compute/error_pattern.py). A RoPE fault reads as RoPE, with the variant
that reproduces the engine; a weight fault at the same point does not."""

from __future__ import annotations

import pytest
import torch

import fixtures_hf
import fixtures_mla
from llmdoctor import faults
from llmdoctor.checks.compute.error_pattern import error_pattern
from llmdoctor.checks.compute.layers import CURVE_POINTS, error_curve, first_divergent_layer
from llmdoctor.diagnose.hypotheses import rope_at
from llmdoctor.reference import load

IDS = [(7 * i + 3) % 90 for i in range(16)]
CAPTURE = {f"{p}-*" for p in CURVE_POINTS}


def _localize(path, fault: str):
    """(first divergent point, its error pattern) of a healthy engine against the reference with `fault`."""
    def run(dtype, planted: bool):
        model = load(path, dtype=dtype)
        if planted:
            model = faults.get(fault).build(model)
        _, caps = model.forward(IDS, capture=CAPTURE)
        return model.config, {k: v.double() for k, v in caps.items()}

    cfg, ref = run(torch.float64, True)
    _, emu = run(torch.float32, True)
    _, engine = run(torch.float32, False)
    layer, point = first_divergent_layer(error_curve(ref, emu, engine, cfg.n_layer, points=CURVE_POINTS))
    assert point is not None, "the planted fault diverged nowhere"
    name = f"{point.point}-{layer}"
    return point, error_pattern(engine[name], ref[name], emu[name], rope=rope_at(cfg, point, len(IDS)), point=name)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return fixtures_hf.checkpoint("llama", tmp_path_factory.mktemp("llama"))[1]


@pytest.mark.slow  # the tiny llama checkpoint through transformers: 2-3 s under load
def test_the_other_rope_pairing_reads_as_rope(llama):
    point, p = _localize(llama, "reference-rope-pairing")
    assert (point.layer, point.point) == (0, "Qcur") and p.kind == "position", (point, p.words)
    assert p.cause.startswith("RoPE applied wrongly to Qcur-0: with the rotary pairs taken interleaved (2i, 2i + 1) "
                              "instead of by halves (i, i + d/2), the engine agrees"), p.cause


@pytest.mark.slow  # the tiny llama checkpoint through transformers: 2-3 s under load
def test_rows_left_unpermuted_are_no_rope_fault(llama):
    """The converter that skipped the Q/K permutation: q's rows in the other order, wrong at position 0 too; no
    rotary variant reproduces it (the other pairing gives the engine's q permuted), so no RoPE cause."""
    point, p = _localize(llama, "reference-qk-rows-unpermuted")
    assert (point.layer, point.point) == (0, "Qcur") and 0 in p.wrong_positions, (point, p.words)
    assert p.cause == "" and p.rope["agrees"] is None, p.rope


def test_a_wrong_rope_base_in_mla_reads_as_rope_at_q_pe(tmp_path):
    """DeepSeek-V3's MLA with YaRN (the tiny fixture): the reference with another rope base diverges at q_pe-0;
    the base the engine uses is found (YaRN's frequencies recomputed for it, as the reference computes them)."""
    path = fixtures_mla.build("deepseek", tmp_path).gguf_path
    point, p = _localize(path, "reference-wrong-rope-base")
    assert (point.layer, point.point) == (0, "q_pe") and p.kind == "position", (point, p.words)
    assert p.cause.startswith("RoPE applied wrongly to q_pe-0: with a rope base of 1e+04 instead of the reference's "
                              "5e+05, the engine agrees"), p.cause
