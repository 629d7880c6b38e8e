"""Engine-arithmetic emulation: Q8_0 matches gguf-py's reference quantizer bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from llmdoctor.reference.emulate import q8_0, q8_K, quantize_activations, vec_dot_type


def test_q8_0_matches_gguf_py_round_trip():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 3
    x[0] = 0  # all-zero blocks
    ref = dequantize(quantize(x.numpy(), Q.Q8_0), Q.Q8_0)
    assert np.array_equal(q8_0(x).numpy(), ref)


def test_q8_K_properties():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 512, generator=g)
    y = q8_K(x)
    b, yb = x.reshape(-1, 256), y.reshape(-1, 256)
    amax = b.abs().amax(1)
    # the signed extreme is exact, every element within half a step, at most 255 levels
    assert torch.allclose(yb.abs().amax(1), amax, rtol=1e-6, atol=0)
    assert ((yb - b).abs() <= (amax / 127 / 2 + 1e-7)[:, None]).all()
    assert torch.equal(q8_K(torch.zeros(256)), torch.zeros(256))


def test_vec_dot_types_and_dispatch():
    assert vec_dot_type(Q.Q4_K) == "q8_K" and vec_dot_type(Q.Q5_0) == "q8_0"
    assert vec_dot_type(Q.F32) == "f32" and vec_dot_type(Q.F16) == "f16"
    x = torch.randn(3, 640, dtype=torch.float64)
    assert torch.equal(quantize_activations(x, Q.F32), x)
    assert not torch.equal(quantize_activations(x, Q.Q8_0), x)
    assert quantize_activations(x, Q.Q8_0).dtype == torch.float64
    y = torch.randn(2, 512, dtype=torch.float64)
    assert torch.equal(quantize_activations(y, Q.Q6_K), q8_K(y))


@pytest.mark.parametrize("legacy", [False, True], ids=["absorbed", "legacy-kv_b"])
def test_mla_attention_is_rounded_to_the_f16_kv_cache(tmp_path, legacy):
    """llama.cpp keeps MLA's KV cache ([latent, k_pe], or the expanded K and V of a legacy file) in F16
    and multiplies Q and P against it in F16: the emulated run must round there (issue 16's debt; done
    in e433153, end to end in tests/checks/compute/test_moe_routing.py). On an F32 file no activation is quantized, so
    the layer input is bit-identical and the attention output carries f16's rounding alone."""
    import fixtures_mla
    from llmdoctor.checks.metrics import rel_l2
    from llmdoctor.reference import load
    from llmdoctor.reference.emulate import LLAMA_CPP_CPU

    path = fixtures_mla.build("deepseek", tmp_path, legacy=legacy).gguf_path
    ids = [int(i) for i in np.random.default_rng(0).integers(1, 90, size=16)]
    capture = {"attn_norm-0", "kqv_out-0"}
    with load(path, cache=True) as m:
        _, ref = m.forward(ids, capture=capture)
        _, emu = m.forward(ids, capture=capture, emulate=LLAMA_CPP_CPU)
    assert torch.equal(emu["attn_norm-0"], ref["attn_norm-0"])
    err = rel_l2(emu["kqv_out-0"], ref["kqv_out-0"])
    assert 1e-5 < err < 1e-2, err  # f16's unit roundoff is 4.9e-4; float32 alone would be ~1e-7
