"""Layer localization on the real engine: llama.cpp on the demo model, healthy and with a planted
single-layer corruption, against the reference and its llama.cpp-arithmetic emulation."""

from __future__ import annotations

import pytest
import torch

from llmdoctor import faults
from llmdoctor.checks.compute.layers import error_curve, first_divergent_layer
from llmdoctor.reference import load
from llmdoctor.reference.emulate import LLAMA_CPP_CPU
from llmdoctor.subjects.engines import llama_cpp as engine

pytestmark = pytest.mark.slow

# "<bos>The quick brown fox jumps over the lazy dog." three times (34 tokens)
IDS = [2] + [818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236761] * 3 + [506, 31770, 4799]
CAPTURE = ("l_out-*", "attn_norm-*", "kqv_out-*", "sa_out-*", "ffn_out-*")
REF_CAPTURE = {"l_out-*", "attn_norm-*", "kqv_out-*", "ffn_inp-*", "ffn_out-*"}


@pytest.fixture(scope="module")
def reference(demo_path):
    with load(demo_path, cache=True) as m:
        _, ref = m.forward(IDS, capture=REF_CAPTURE)
    with load(demo_path, emulate=LLAMA_CPP_CPU, cache=True) as m:
        _, emu = m.forward(IDS, capture=REF_CAPTURE)
    return ref, emu


def _engine(path):
    run = engine.run(path, IDS, capture=CAPTURE, n_threads=2)
    return engine.to_reference_names(run.captures)


def test_healthy_llama_cpp_stays_within_its_noise(demo_path, reference):
    ref, emu = reference
    curve = error_curve(ref, emu, _engine(demo_path), 18)
    assert len(curve) == 18 * 5
    assert first_divergent_layer(curve) == (None, None)
    ratios = torch.tensor([p.error / p.noise for p in curve if p.noise > 0])
    # measured 2026-12-01: l_out ratios 0.85..1.3; every point within 0.5..2
    assert 0.5 < float(ratios.min()) and float(ratios.max()) < 2.0, ratios



def test_planted_layer_corruption_is_localized(demo_path, reference, tmp_path):
    ref, emu = reference
    bad = faults.get("attn-block-scales").build(demo_path, tmp_path, layers="blk.5.attn_output")
    layer, point = first_divergent_layer(error_curve(ref, emu, _engine(bad), 18))
    assert layer == 5 and point.point == "ffn_inp"
