"""Op substitution: a suspect kernel swapped into the reference through an isolated child."""

from __future__ import annotations

import pytest
import torch

from llmdoctor.checks import metrics as M
from llmdoctor.gguf import dequantize
from llmdoctor.reference import load
from llmdoctor.subjects.substitution import KernelDequantizer, PrefillAttention

pytestmark = pytest.mark.slow

IDS = [2, 818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236761]


def test_kernel_dequantizer_round_trips_and_shows_a_fault(demo_path):
    from llmdoctor.gguf import open_gguf

    with open_gguf(demo_path) as g:
        t = g.tensor("blk.0.attn_output.weight")  # Q4_K
        want = dequantize(t.data, t.type, t.shape)
        with KernelDequantizer("torch") as kd:
            assert torch.equal(kd(t.data, t.type, t.shape), want)
        with KernelDequantizer("llmdoctor.faults.kernels:scale_min_swap") as kd:
            assert M.rel_l2(kd(t.data, t.type, t.shape), want) > 0.5


WRONG_SCALE = """
import torch

def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    # planted: the softmax scale doubled (one sequence, q_len == k_len, GQA by repeating kv heads)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                         is_causal=True, scale=2 * softmax_scale)
    return o.transpose(0, 1)
"""


def test_prefill_attention_swapped_into_the_reference(demo_path, tmp_path):
    with load(demo_path, cache=True) as m:
        _, ref = m.forward(IDS, capture={"l_out-*"})
        with PrefillAttention("sdpa-math") as good:
            _, same = m.forward(IDS, capture={"l_out-*"}, attention=good)
        planted = tmp_path / "wrong_scale.py"
        planted.write_text(WRONG_SCALE)
        with PrefillAttention(f"{planted}:prefill") as bad:
            _, off = m.forward(IDS, capture={"l_out-*"}, attention=bad)
    # a correct kernel reproduces the reference to float32 rounding over 18 layers; the planted one
    # moves the very first layer
    assert M.rel_l2(same["l_out-17"], ref["l_out-17"]) < 1e-4
    assert M.rel_l2(off["l_out-0"], ref["l_out-0"]) > 1e-2
