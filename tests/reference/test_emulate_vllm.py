"""vLLM-on-CUDA arithmetic in the reference (issue 22 part 1, reference/emulate.py): each rounding matches
its definition bit for bit (TF32 against a bit-manipulation oracle, Q8_1 against a lane-by-lane
transcription of the plugin's `quantize_q8_1`), the Q8_1 products against transcriptions of the CUDA vec
dots, the reference run changes where the emulated kernels round, and VLLMEngine's budget follows what
the run says vLLM built. The GPU confirmations at the end skip without CUDA."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from llmdoctor.reference.emulate import (block_constants, fp8_blocks, half_dequant, plugin_path, q8_1, q8_1_product,
                                         tf32, tf32_weights, vllm_cuda)

# ---- TF32 -----------------------------------------------------------------------------------------


def _tf32_bits(x: np.ndarray, mode: str) -> np.ndarray:
    """The oracle: on the float32 bit pattern, drop the low 13 mantissa bits ("rz"), after adding half of
    their weight ("rna": `cvt.rna.tf32.f32`; a carry runs into the exponent, up to inf). inf / NaN kept."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    if mode == "rna":
        u = u + 0x1000
    out = (u & 0xFFFFE000).astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(x), out, x)


def _tf32_inputs() -> np.ndarray:
    rng = np.random.default_rng(0)
    scales = 2.0 ** rng.integers(-140, 120, size=4000)
    x = (rng.standard_normal(4000) * scales).astype(np.float32)
    bits = rng.integers(0, 2**32, size=2000, dtype=np.uint64).astype(np.uint32)
    ties = (bits & ~np.uint32(0x1FFF)) | np.uint32(0x1000)  # exactly half of the dropped weight
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, np.finfo(np.float32).max, -np.finfo(np.float32).max,
                        np.finfo(np.float32).tiny, 1e-45, -3e-41, 1 + 2**-11, 1 + 2**-11 + 2**-23], dtype=np.float32)
    return np.concatenate([x, bits.view(np.float32), ties.view(np.float32), special])


@pytest.mark.parametrize("mode", ["rna", "rz"])
def test_tf32_matches_the_bit_oracle(mode):
    x = _tf32_inputs()
    got = tf32(torch.from_numpy(x), mode).numpy()
    want = _tf32_bits(x, mode)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    diff = np.flatnonzero(got[~nan].view(np.uint32) != want[~nan].view(np.uint32))
    assert diff.size == 0, [(hex(x[~nan].view(np.uint32)[i]), got[~nan][i], want[~nan][i]) for i in diff[:5]]
    # ties round away from zero under rna; rz never increases the magnitude
    assert tf32(torch.tensor([1 + 2**-11, -(1 + 2**-11)]), "rna").tolist() == [1 + 2**-10, -(1 + 2**-10)]
    assert (tf32(torch.from_numpy(x[np.isfinite(x)]), "rz").abs() <= torch.from_numpy(x[np.isfinite(x)]).abs()).all()


def test_tf32_weights_round_p_as_the_online_softmax_holds_it():
    """The kernel rounds P = exp(S - row max) (largest exactly 1) and normalizes after: rounding the
    normalized p relative to its row max is that, up to float32's own rounding of the scaling."""
    g = torch.Generator().manual_seed(2)
    s = torch.randn(3, 5, 40, generator=g, dtype=torch.float64) * 4
    s[0, 0, 7:] = float("-inf")  # masked keys
    e = torch.exp(s - s.amax(-1, keepdim=True))
    want = tf32(e.float(), "rz").double() / e.sum(-1, keepdim=True)
    got = tf32_weights((e / e.sum(-1, keepdim=True)).float(), "rz").double()
    assert torch.allclose(got, want, rtol=3e-7, atol=0), (got - want).abs().max()
    assert torch.equal(tf32_weights(torch.zeros(2, 4)), torch.zeros(2, 4))  # no visible key: stays 0


def test_tf32_attention_reproduces_vllm_on_the_h200(tmp_path):
    """Frozen measurement (notes/device-checks.md, session 5): vLLM 0.24 on the H200, tiny llama (the
    fixture tests/subjects/engines/test_engine_vllm.py and bench/h200_vllm.py build), float32, TRITON_ATTN, 16 token ids: the
    engine's rel_l2 from the float32 reference at kqv_out-0, kqv_out-1, l_out-1 was 6.710e-4, 2.026e-3,
    1.204e-3. The emulated run (truncated Q, K, V and max-relative P) gives the same to 1%; rounding to
    nearest would give 5.1e-4, 1.2e-3, 1.0e-3, so the H200 truncates (`tf32(., "rz")`)."""
    import fixtures_hf
    from unittest import mock

    from llmdoctor.checks.metrics import rel_l2
    from llmdoctor.reference import load

    with mock.patch.dict(fixtures_hf.DENSE, num_attention_heads=2, num_key_value_heads=1):  # heads of 32
        ckpt, _ = fixtures_hf.checkpoint("llama", tmp_path)
    tokens = [3, 17, 42, 5, 77, 8, 23, 61, 9, 30, 55, 14, 2, 88, 40, 19]
    measured = {"kqv_out-0": 6.710e-4, "kqv_out-1": 2.026e-3, "l_out-1": 1.204e-3}
    with load(ckpt, cache=True) as m:
        _, ref = m.forward(tokens, capture=set(measured))
        _, emu = m.forward(tokens, capture=set(measured), emulate=vllm_cuda(attention_tf32="rz"))
    for point, engine in measured.items():
        assert abs(rel_l2(emu[point], ref[point]) / engine - 1) < 0.03, (point, rel_l2(emu[point], ref[point]))


# ---- Q8_1 -----------------------------------------------------------------------------------------


def _q8_1_transcribed(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """gguf_kernel.cu `quantize_q8_1`, one block of 32 lanes at a time, each lane's float32 arithmetic as
    written: xor-butterfly max and sum across the 32 lanes, d = amax / 127, q = roundf(x / d), ds = half2."""
    f32 = np.float32
    k = x.shape[-1]
    kp = -(-k // 32) * 32
    rows = np.zeros((x.shape[0], kp), dtype=f32)
    rows[:, :k] = x
    values = np.zeros_like(rows)
    sums = np.zeros((x.shape[0], kp // 32), dtype=f32)
    for r in range(rows.shape[0]):
        for b in range(kp // 32):
            xi = rows[r, 32 * b:32 * b + 32]
            amax, s = np.abs(xi), xi.copy()
            for mask in (16, 8, 4, 2, 1):
                lanes = np.arange(32) ^ mask
                amax, s = np.fmax(amax, amax[lanes]), (s + s[lanes]).astype(f32)
            d = f32(amax[0] / f32(127))
            for i in range(32):
                v = float(f32(xi[i] / d)) if amax[0] != 0 else 0.0
                q = math.copysign(math.floor(abs(v) + 0.5), v)  # C roundf: half away from zero
                values[r, 32 * b + i] = f32(q) * f32(np.float16(d))
            sums[r, b] = f32(np.float16(s[0]))
    return values[:, :k], sums


def test_q8_1_matches_the_transcribed_quantizer():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 96)) * np.array([1e-3, 1, 30, 1e3, 1, 1])[:, None]).astype(np.float32)
    x[4, :32] = 0  # an all-zero block
    x[5, :32] = 0
    x[5, 0], x[5, 1], x[5, 2], x[5, 3] = 127, np.nextafter(np.float32(0.5), np.float32(0)), 2.5, -2.5  # d = 1: ties
    for xs in (x, x[:, :80]):  # 80: a block zero-padded as the kernel pads
        values, sums = q8_1(torch.from_numpy(xs))
        want_v, want_s = _q8_1_transcribed(xs)
        assert np.array_equal(values.numpy(), want_v) and np.array_equal(sums.numpy(), want_s)
    assert q8_1(torch.from_numpy(x))[0][5, :4].tolist() == [127, 0, 3, -3]  # roundf, not float32's x + 0.5


def _gguf_raw(qtype: Q, rows: int, k: int, seed: int) -> np.ndarray:
    """Random blocks of `qtype` [rows, row bytes] whose f16 scales are finite (any quant bytes are valid)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, k // block, size), dtype=np.uint8)
    n_f16 = 2 if qtype in (Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K) else 1
    at = size - 2 if qtype == Q.Q6_K else 0  # Q6_K keeps its d last
    raw[..., at:at + 2 * n_f16] = (rng.uniform(0.001, 0.01, size=(rows, k // block, n_f16))
                                   .astype(np.float16).view(np.uint8).reshape(rows, k // block, 2 * n_f16))
    return raw.reshape(rows, -1)


QUANT_BYTES = {Q.Q4_0: slice(2, None), Q.Q5_0: slice(2, None), Q.Q4_1: slice(4, None), Q.Q5_1: slice(4, None),
               Q.Q4_K: slice(16, None), Q.Q5_K: slice(16, None)}


@pytest.mark.parametrize("qtype", list(QUANT_BYTES), ids=lambda q: q.name)
def test_block_constants_are_what_a_zero_quant_dequantizes_to(qtype):
    """With every quant zeroed a block dequantizes to its constant alone (gguf-py's dequantizer), which is
    what `block_constants` reads from the scales."""
    rows, k = 3, 512
    raw = _gguf_raw(qtype, rows, k, seed=2)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(rows, -1, size)
    blocks[..., QUANT_BYTES[qtype]] = 0
    want = gguf_dequantize(blocks.reshape(rows, -1), qtype).reshape(rows, -1, 32)
    got = block_constants(blocks.reshape(rows, -1), qtype, rows).numpy()
    assert np.array_equal(np.broadcast_to(got[..., None], want.shape), want)
    assert block_constants(_gguf_raw(Q.Q8_0, 2, 64, 0), Q.Q8_0, 2) is None
    assert block_constants(blocks.reshape(rows, -1)[:2], qtype, rows) is None  # bytes of another shape


def test_plugin_paths_follow_fused_mul_mat_gguf():
    assert [plugin_path(Q.Q4_K, 1024, t) for t in (1, 6, 7)] == ["mmvq", "mmvq", "mmq"]
    assert [plugin_path(Q.Q8_0, 6144, t) for t in (2, 3)] == ["mmvq", "mmq"]
    assert [plugin_path(Q.IQ4_XS, 1024, t) for t in (16, 17)] == ["mmvq", "dequant"]
    assert [plugin_path(Q.IQ2_XXS, 8192, t) for t in (8, 9)] == ["mmvq", "dequant"]
    assert plugin_path(Q.F32, 64, 1) == plugin_path(Q.F16, 64, 99) == plugin_path(Q.TQ1_0, 64, 9) == "dense"


def _transcribed_product(x: np.ndarray, raw: np.ndarray, qtype: Q, mmq: bool) -> np.ndarray:
    """y [T, N] as vecdotq.cuh's vec dots compute it, block by block (float64 sums): Q8_0
    d_w d_a sum(q_w q_a); Q4_0 d_w (d_a sum(u q_a) - 8 s_a) with u the unsigned nibble; Q4_K
    dall sum_j d8_j sc_j sum(q q_a) - dmin sum_j m_j (s8_j on MMQ, d8_j sum(q_a) on MMVQ)."""
    xq, s = (t.numpy().astype(np.float64) for t in q8_1(torch.from_numpy(x)))
    t_, k = x.shape
    amax = np.abs(x.reshape(t_, -1, 32)).max(-1)
    d_a = np.float16(amax.astype(np.float32) / np.float32(127)).astype(np.float64)  # [T, nb]
    qa = np.where(d_a[..., None] > 0, xq.reshape(t_, -1, 32) / np.where(d_a > 0, d_a, 1)[..., None], 0)
    rows = raw.shape[0]
    _, size = GGML_QUANT_SIZES[qtype]
    b = raw.reshape(rows, -1, size)
    f16 = lambda o: b[..., o:o + 2].copy().view(np.float16)[..., 0].astype(np.float64)  # noqa: E731
    if qtype == Q.Q8_0:
        qw = b[..., 2:].view(np.int8).astype(np.float64)  # [N, nb, 32]
        return np.einsum("nb,tb,nbi,tbi->tn", f16(0), d_a, qw, qa)
    if qtype == Q.Q4_0:
        qs = b[..., 2:].astype(np.int64)
        u = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.float64)  # [N, nb, 32]: low nibbles first
        return (np.einsum("nb,tb,nbi,tbi->tn", f16(0), d_a, u, qa) - 8 * np.einsum("nb,tb->tn", f16(0), s))
    assert qtype == Q.Q4_K
    sc, m = (a.reshape(rows, -1, 8).astype(np.float64) for a in Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12)))
    qs = b[..., 16:].reshape(rows, -1, 4, 32).astype(np.int64)  # 4 pairs of sub-blocks, 32 bytes each
    q = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(rows, -1, 8, 32).astype(np.float64)  # [N, nb, 8, 32]
    qa8, da8 = qa.reshape(t_, -1, 8, 32), d_a.reshape(t_, -1, 8)
    sumd = np.einsum("tbj,nbj,nbji,tbji->tnb", da8, sc, q, qa8)
    a_sum = s.reshape(t_, -1, 8) if mmq else da8 * qa8.sum(-1)
    return (np.einsum("nb,tnb->tn", f16(0), sumd) - np.einsum("nb,nbj,tbj->tn", f16(2), m, a_sum))


@pytest.mark.parametrize("qtype,tokens", [(Q.Q8_0, 4), (Q.Q8_0, 9), (Q.Q4_0, 3), (Q.Q4_0, 12), (Q.Q4_K, 5),
                                          (Q.Q4_K, 11)], ids=lambda v: getattr(v, "name", str(v)))
def test_q8_1_product_matches_the_transcribed_vec_dots(qtype, tokens):
    n, k = 48, 512
    raw = _gguf_raw(qtype, n, k, seed=3)
    w = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(n, k).astype(np.float32))
    x = np.random.default_rng(4).standard_normal((tokens, k)).astype(np.float32)
    got = q8_1_product(torch.from_numpy(x), w, qtype, raw).double().numpy()
    want = _transcribed_product(x, raw, qtype, mmq=plugin_path(qtype, n, tokens) == "mmq")
    scale = np.abs(want).max()
    assert np.allclose(got, want, rtol=0, atol=1e-5 * scale), np.abs(got - want).max() / scale
    # the block sum matters: the plain Q8_1 product misses it where the weight has a block constant
    plain = (q8_1(torch.from_numpy(x))[0] @ w.t()).double().numpy()
    sum_term = qtype == Q.Q4_0 or (qtype == Q.Q4_K and tokens > 6)
    assert (np.abs(plain - want).max() > 1e-4 * scale) == sum_term, np.abs(plain - want).max() / scale


def test_q4_0_from_gguf_py_quantizer_and_half_dequant():
    """A real Q4_0 weight (gguf-py's quantizer): the product keeps the d_w x 8 x half(sum) term; the half
    dequant of a Q8_0 / Q4_0 row is the float row rounded once to float16 (an integer times the f16 scale)."""
    rng = np.random.default_rng(5)
    w32 = rng.standard_normal((16, 256)).astype(np.float32)
    raw = gguf_quantize(w32, Q.Q4_0)
    w = torch.from_numpy(gguf_dequantize(raw, Q.Q4_0).astype(np.float32))
    x = rng.standard_normal((10, 256)).astype(np.float32)
    got = q8_1_product(torch.from_numpy(x), w, Q.Q4_0, raw).double().numpy()
    want = _transcribed_product(x, raw, Q.Q4_0, mmq=True)
    # float32 sums of 256 products in another order: a few ulps of the largest (|want| ~ 34: ulp 3.8e-6; 1e-5
    # absolute failed once in the full suite at 4e-6 off, another thread count's order)
    assert np.allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    rows = torch.from_numpy(gguf_dequantize(gguf_quantize(w32 * 3, Q.Q8_0), Q.Q8_0).astype(np.float32))
    assert torch.equal(half_dequant(rows, Q.Q8_0), rows.half().float())
    assert torch.equal(half_dequant(rows, Q.F32), rows) and torch.equal(half_dequant(rows, Q.IQ4_XS), rows)


# ---- the reference run under vLLM's CUDA arithmetic --------------------------------------------------


@pytest.fixture(scope="module")
def demo_runs(demo_path):
    """The demo Gemma 3 (Q5_0 q/k/v/gate/up, Q4_K / Q6_K down and o, Q8_0 tied embeddings) on 8 tokens:
    the float32 reference and each vLLM-CUDA rounding alone."""
    from llmdoctor.reference import load

    ids = [2, 818, 5279, 529, 7001, 563, 9079, 236761]
    capture = {"inp_scaled", "attn_norm-0", "Qcur-0", "kqv_out-0", "l_out-17"}
    kinds = {"plain": None, "tf32": vllm_cuda(attention_tf32="rz"), "q8_1": vllm_cuda(gguf_products="q8_1"),
             "embd": vllm_cuda(embedding_half=True)}
    with load(demo_path, cache=True) as m:
        return {k: m.forward(ids, capture=capture, emulate=e, all_logits=False) for k, e in kinds.items()}


@pytest.mark.slow
def test_each_rounding_changes_the_run_where_its_kernel_runs(demo_runs):
    from llmdoctor.checks.metrics import rel_l2

    (ref_logits, ref), err = demo_runs["plain"], {}
    for kind in ("tf32", "q8_1", "embd"):
        logits, caps = demo_runs[kind]
        err[kind] = {p: rel_l2(caps[p], ref[p]) for p in ref}
        err[kind]["logits"] = rel_l2(logits, ref_logits)
    # TF32 attention: the input of the first attention and its q untouched, its output off by TF32's
    # rounding (2^-10 truncation of 10-bit mantissas, averaged over the dots)
    assert err["tf32"]["attn_norm-0"] == 0 and err["tf32"]["Qcur-0"] == 0
    assert 1e-5 < err["tf32"]["kqv_out-0"] < 3e-3, err["tf32"]
    # Q8_1 activations: the Q5_0 projection sees them, its input does not; 127 levels a block and Q5_0's
    # -16 d_w x half(sum) term (3.0e-2 here, 1.1e-2 without that term, as llama.cpp's CPU Q8_0)
    assert err["q8_1"]["attn_norm-0"] == 0 and 3e-3 < err["q8_1"]["Qcur-0"] < 0.1, err["q8_1"]
    # the Q8_0 embedding rows rounded to f16: 2^-12 relative, and only there at first
    assert 1e-5 < err["embd"]["inp_scaled"] < 1e-3, err["embd"]
    for kind in err:  # each stays noise at the logits (the last position's), far from a fault's size
        assert 0 < err[kind]["logits"] < 0.2, (kind, err[kind])


# ---- the budget VLLMEngine derives from what the run says it built ------------------------------------


def _engine_budget(info: dict, dtype: str | None = "float32"):
    from llmdoctor.subjects.engines.base import Deployment, EngineRun, RunInfo
    from llmdoctor.subjects.engines.vllm import VLLMEngine

    engine = VLLMEngine(Deployment(dtype=dtype))
    return engine.noise_budget(EngineRun(np.zeros((1, 4), np.float32), info=RunInfo.of(info)))


def _cuda_info(dtype="float32", backend="TRITON_ATTN", gguf=False, cuda_ops=True, f32_dot="tf32", matmul="highest"):
    arith = {"device": "cuda", "float32_matmul_precision": matmul, "triton": {"version": "3.6.0", "f32_dot": f32_dot},
             "attention_impls": {"model.layers.0.self_attn.attn": "TritonAttentionImpl"},
             "linear_methods": {"UnquantizedLinearMethod": 7}}
    if gguf:
        arith["linear_methods"] = {"GGUFLinearMethod": 7, "GGUFEmbeddingMethod": 1}
        arith["gguf_plugin"] = {"version": "0.0.5", "cuda_ops": cuda_ops}
    return {"dtype": dtype, "backends": {"decode": {"model.layers.0.self_attn.attn": backend}, "prefill": {}},
            "arithmetic": arith}


def test_budget_on_cuda_follows_what_vllm_built():
    b = _engine_budget(_cuda_info())  # the tiny llama, TRITON_ATTN, float32
    assert b.dtype == "float32" and b.emulate.attention_tf32 == "rz" and b.emulate.gguf_products is None
    assert "attention computed in TF32 by TRITON_ATTN" in b.words
    b = _engine_budget(_cuda_info(gguf=True))  # the demo Gemma 3 GGUF through the plugin, float32
    e = b.emulate
    assert (e.attention_tf32, e.gguf_products, e.embedding_half) == ("rz", "q8_1", True), e
    assert "Q8_1 activations (the plugin's CUDA MMVQ/MMQ)" in b.words and "half precision" in b.words
    e = _engine_budget(_cuda_info(gguf=True, cuda_ops=False)).emulate  # the plugin's Triton fallback
    assert (e.gguf_products, e.embedding_half) == ("tf32", False)
    e = _engine_budget(_cuda_info(matmul="high")).emulate
    assert e.dense_tf32 == "rna" and e.attention_tf32 == "rz"
    # TRITON_F32_DEFAULT=ieee: float32 again, judged against float64 like vLLM for CPU
    assert _engine_budget(_cuda_info(f32_dot="ieee")) == _engine_budget({"dtype": "float32"})
    assert _engine_budget(_cuda_info(f32_dot="ieee")).dtype == "float64"
    # bfloat16 with FlashAttention: the engine's dtype, nothing emulated; with a GGUF the Q8_1 stays
    b = _engine_budget(_cuda_info("bfloat16", "FLASH_ATTN"), "bfloat16")
    assert b.dtype == "bfloat16" and b.emulate is None
    b = _engine_budget(_cuda_info("bfloat16", "FLASH_ATTN", gguf=True), "bfloat16")
    assert b.dtype == "bfloat16" and b.emulate.gguf_products == "q8_1" and b.emulate.attention_tf32 is None


def test_fp8_blocks_are_e4m3_values_times_power_of_two_scales():
    """vLLM's indexer quantization: per block of 128 a power-of-two scale (ue8m0) just above amax / 448, the
    values rounded to e4m3 (3 mantissa bits, to nearest even); a zero block stays zero."""
    x = torch.zeros(2, 256)
    x[0, 0], x[0, 1] = 1.0, 0.3  # scale 2^ceil(log2(1 / 448)) = 2^-8: 0.3 / 2^-8 = 76.8, e4m3's nearest 80
    assert fp8_blocks(x)[0, :2].tolist() == [1.0, 0.3125] and not fp8_blocks(x)[1].any()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 256, generator=g) * torch.logspace(-3, 3, 256)
    for dtype in (torch.float32, torch.bfloat16):
        got = fp8_blocks(x.to(dtype)).float()
        blocks, got_b = x.to(dtype).float().view(5, 3, 2, 128), got.view(5, 3, 2, 128)
        scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True) / 448)))
        v = got_b / scale
        assert torch.equal(v, v.to(torch.float8_e4m3fn).float()) and v.abs().max() <= 448  # e4m3 values
        normal = (blocks / scale).abs() >= 2.0 ** -6  # e4m3's normal range: 3 bits, half an ulp 2^-4
        assert ((got_b - blocks).abs() <= 2.0 ** -4 * blocks.abs())[normal].all()
    with pytest.raises(ValueError, match="not a multiple"):
        fp8_blocks(torch.ones(2, 200))


def test_an_fp8_indexer_is_judged_by_its_own_noise(tmp_path):
    """vLLM's CUDA DSA indexer scores keys in FP8 in a bfloat16 model: an FP8 engine's picks (simulated by the
    reference with FP8 indexer inputs, float32 elsewhere: not the budget's own run) fall below the k-th score by
    more than bfloat16's score error alone explains (the false alarm a bfloat16 budget would raise: 8 such picks
    against an allowance of 5 here, and 8 queries missed where the bfloat16 run keeps a top-k set) and within
    what the bfloat16 + FP8 emulation explains; an indexer that picks the lowest-scoring keys still fails under
    the FP8 budget."""
    import fixtures_mla

    from llmdoctor.checks.compute.routing import dsa_misses, dsa_rows
    from llmdoctor.reference import load

    top_k = 16
    fixture = fixtures_mla.build("glm", tmp_path, index_topk=top_k, index_head_dim=128, index_n_heads=8,
                                 indexer_types=["full", "full", "full"])
    ids = [(7 * i + 3) % 90 for i in range(48)]

    def run(dtype, emulate):
        with load(fixture.gguf_path, dtype=dtype, cache=True) as m:
            _, caps = m.forward(ids, capture={"top_k-*", "indexer_score-*"}, emulate=emulate)
        return {k: v.float().numpy() for k, v in caps.items()}

    fp8 = vllm_cuda(indexer_fp8=128)
    ref, bf16, emulated = run(torch.float32, None), run(torch.bfloat16, None), run(torch.bfloat16, fp8)
    engine = run(torch.float32, fp8)  # another draw of FP8 picks than the budget's own (float32 around them)
    (under_bf16, *_), (under_fp8, *_) = (dsa_rows(3, top_k, ref, emu, engine, 1e-3 / 6) for emu in (bf16, emulated))
    assert "picks of the 32 queries that choose score below the k-th best" in dsa_misses(under_bf16), under_bf16
    assert under_bf16["alone"] > 4 * under_fp8["alone"], (under_bf16, under_fp8)  # layer 0: the false alarm
    assert dsa_misses(under_fp8) == "", under_fp8
    lowest = np.nan_to_num(ref["indexer_score-0"], neginf=np.inf)  # the masked keys last
    worst = {"top_k-0": np.argsort(lowest, axis=1, kind="stable")[:, :top_k]}
    (planted, *_) = dsa_rows(3, top_k, ref, emulated, worst, 1e-3 / 6)
    assert planted["disagreement"] > planted["limit"] and dsa_misses(planted).startswith("100% of the 32"), planted


def test_budget_of_a_sparse_indexer_on_cuda():
    """The driver reports vLLM's sparse indexer (its FP8 block and scale format): the budget emulates it in
    bfloat16 as in float32; a scale format it does not emulate is said, not emulated."""
    info = _cuda_info("bfloat16", "FLASHMLA_SPARSE")
    info["arithmetic"]["sparse_indexer"] = {"layers": 2, "quant_block_size": 128, "scale_fmt": "ue8m0"}
    b = _engine_budget(info, "bfloat16")
    assert b.dtype == "bfloat16" and b.emulate.indexer_fp8 == 128 and b.emulate.attention_tf32 is None
    assert "the DSA indexer's q and k in FP8 (e4m3, power-of-two scales per 128 values" in b.words
    info["arithmetic"]["sparse_indexer"]["scale_fmt"] = None
    b = _engine_budget(info, "bfloat16")
    assert b.emulate is None and "scale format None: not emulated" in b.words


def test_budget_on_the_cpu_or_from_an_older_driver_is_unchanged():
    cpu = {"dtype": "float32", "backends": {"decode": {"l0": "CPU_ATTN"}}, "arithmetic": {"device": "cpu"}}
    assert _engine_budget(cpu).dtype == "float64" and _engine_budget(cpu).emulate is None
    assert _engine_budget({"dtype": "float32"}).dtype == "float64"  # no `arithmetic`: a driver before issue 22


def _simulated_engine(model, ids, fault: str | None):
    """A float32 vLLM on CUDA with TRITON_ATTN as its run reports it, computing what such an engine
    computes: the reference with TF32 attention (and `fault`'s weight scaled by 1.02: a planted fault)."""
    from llmdoctor.reference import load
    from llmdoctor.subjects.engines.base import EngineRun, RunInfo

    with load(model, cache=True) as m:
        if fault:
            m.weights.replace(fault, m.weights.get(fault) * 1.02)
        logits, caps = m.forward(ids, capture={"*"}, emulate=vllm_cuda(attention_tf32="rz"))
    return EngineRun(torch.log_softmax(logits, -1).numpy(), {k: v.numpy() for k, v in caps.items()}, list(caps),
                     RunInfo.of(_cuda_info()))


@pytest.mark.slow
@pytest.mark.parametrize("source,fault", [("gguf", None), ("hf", None), ("gguf", "blk.0.attn_v.weight")])
def test_a_tf32_engine_is_judged_by_its_own_noise(source, fault, tmp_path, monkeypatch):
    """The issue's false alarm, on the CPU: a healthy TF32 engine fails against the float64 budget (the
    budget vLLM had) and passes against the budget its run's info derives, the reference reading the GGUF
    or (the issue's row) the HF checkpoint; a planted fault of 2% in a weight is still found, at its
    layer, under the wider budget."""
    import fixtures_hf
    from llmdoctor.diagnose import Inputs, Session
    from llmdoctor.diagnose.hypotheses import h_engine_vs_reference, h_layer_localization
    from llmdoctor.subjects.engines.base import RunInfo

    ckpt, gguf = fixtures_hf.checkpoint("llama", tmp_path)
    ids = [3, 17, 42, 5, 77, 8, 23, 61, 9, 30, 55, 14]
    model = {"gguf": gguf, "hf": ckpt}[source]
    ran = _simulated_engine(model, ids, fault)

    def verdicts(info: dict) -> dict[str, tuple[str, str]]:
        s = Session(Inputs(**{source: model}, engine="vllm", engine_dtype="float32", token_ids=ids))
        monkeypatch.setattr(s, "engine_run", lambda: ran)
        ran.info = RunInfo.of(info)
        return {f.check: (f.status, f) for h in (h_engine_vs_reference, h_layer_localization) for f in h(s)}

    derived = verdicts(_cuda_info())
    if fault is None:
        old = verdicts({**_cuda_info(), "arithmetic": {"device": "cpu"}})  # judged as vLLM for CPU is
        assert old["layer-localization"][0] == "fail", old
        assert {c: v[0] for c, v in derived.items()} == {"engine-vs-reference": "pass", "layer-localization": "pass"}
        f = derived["engine-vs-reference"][1]
        assert "attention computed in TF32 by TRITON_ATTN" in f.budget["arithmetic"] and "TF32" in f.explanation
    else:
        loc = derived["layer-localization"][1]
        assert loc.status == "fail" and loc.metrics["first_divergent_layer"] == 0, loc
        if source == "gguf":  # a simulated engine: vLLM's loaded weights cannot be read, and the report says so
            assert loc.metrics["engine_weights"].get("unread") and "were not compared" in loc.explanation, loc


@pytest.mark.slow
def test_vllm_for_cpu_reports_its_arithmetic_and_keeps_its_budget(vllm_python, tmp_path):
    """The driver's `arithmetic` on a real vLLM (for CPU): device cpu, the attention impl per layer, torch's
    float32 matmul precision, Triton's default; the budget stays float64 for float32."""
    import fixtures_hf
    from unittest import mock

    from llmdoctor.gguf import open_gguf
    from llmdoctor.reference.config import from_gguf
    from llmdoctor.subjects.engines.base import Deployment
    from llmdoctor.subjects.engines.vllm import VLLMEngine

    with mock.patch.dict(fixtures_hf.DENSE, num_attention_heads=2, num_key_value_heads=1):  # heads of 32
        ckpt, gguf = fixtures_hf.checkpoint("llama", tmp_path / "llama")
    engine = VLLMEngine(Deployment(model=ckpt, dtype="float32", python=vllm_python))
    ran = engine.run([3, 17, 42, 5, 77, 8], from_gguf(open_gguf(gguf)))
    arith = ran.info.arithmetic
    assert arith["device"] == "cpu" and arith["float32_matmul_precision"] == "highest", arith
    impls = list(arith["attention_impls"].values())
    assert len(impls) == 2 and all(i.endswith("Impl") for i in impls), arith
    assert "UnquantizedLinearMethod" in arith["linear_methods"], arith
    assert arith["rope_styles"] == {"neox (rotate-half)": 2}, arith  # one rotary module per layer
    assert "triton" in arith and "gguf_plugin" not in arith
    budget = engine.noise_budget(ran)
    assert budget.dtype == "float64" and budget.emulate is None


@pytest.mark.slow
def test_the_driver_reports_the_gguf_plugins_ops(vllm_python, tmp_path):
    """The driver's `arithmetic` on a runner holding GGUF layers, in the deployment's interpreter (vLLM for
    CPU with vllm-gguf-plugin 0.0.5, whose CUDA extension cannot load here): the methods, the weight types,
    the plugin's version, cuda_ops false and the extension's import error (what decides Q8_1 vs Triton)."""
    import json
    import shutil
    import subprocess

    from llmdoctor.subjects.engines.vllm import DRIVER

    shutil.copyfile(DRIVER, tmp_path / DRIVER.name)  # alone: our vllm.py beside it would shadow vLLM
    script = (
        "import json, torch, vllm_driver as d\n"
        "GGUFLinearMethod = type('GGUFLinearMethod', (), {})\n"
        "GGUFEmbeddingMethod = type('GGUFEmbeddingMethod', (), {})\n"
        "m, lin, emb = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()\n"
        "lin.quant_method, lin.qweight_type = GGUFLinearMethod(), type('T', (), {'weight_type': 8})()\n"
        "emb.quant_method = GGUFEmbeddingMethod()\n"
        "m.add_module('q_proj', lin); m.add_module('embed_tokens', emb)\n"
        "print(json.dumps(d.arithmetic(type('R', (), {'device': torch.device('cpu'), 'model': m})())))\n")
    p = subprocess.run([vllm_python, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    arith = json.loads(p.stdout.strip().splitlines()[-1])
    assert arith["linear_methods"] == {"GGUFLinearMethod": 1, "GGUFEmbeddingMethod": 1}, arith
    assert arith["gguf_weight_types"] == {"q_proj": 8} and arith["device"] == "cpu", arith
    plugin = arith["gguf_plugin"]
    assert plugin["version"] == "0.0.5" and plugin["cuda_ops"] is False and plugin["cuda_ops_error"], plugin
    assert _engine_budget({"dtype": "float32", "backends": {"decode": {"l0": "TRITON_ATTN"}},
                           "arithmetic": {**arith, "device": "cuda"}}).emulate.gguf_products == "tf32"


# ---- on a GPU (`pytest -m gpu`, bench/h200_vllm.sh): what only the hardware can say ------------------------

@pytest.mark.gpu
def test_gpu_triton_default_f32_dot_reads_tf32_as_emulated():
    """A float32 `tl.dot` with Triton's default precision on this GPU equals the float64 product of the
    operands rounded as `tf32(., "rz")` (Triton passes unconverted registers to mma/wgmma), and differs
    from "rna" on inputs built to tell them apart; `input_precision="ieee"` is plain float32."""
    import os

    import triton
    import triton.language as tl

    if os.environ.get("TRITON_F32_DEFAULT"):
        pytest.skip(f"TRITON_F32_DEFAULT={os.environ['TRITON_F32_DEFAULT']} sets another default")

    @triton.jit
    def dot(a_ptr, b_ptr, c_ptr, IEEE: tl.constexpr):
        i = tl.arange(0, 16)
        a = tl.load(a_ptr + i[:, None] * 16 + i[None, :])
        b = tl.load(b_ptr + i[:, None] * 16 + i[None, :])
        if IEEE:
            c = tl.dot(a, b, input_precision="ieee")
        else:
            c = tl.dot(a, b)
        tl.store(c_ptr + i[:, None] * 16 + i[None, :], c)

    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=g)
    bits = a.view(torch.int32)
    a = ((bits & ~0x1FFF) | 0x1FFF).view(torch.float32)  # just below the next TF32 value: rz and rna differ by an ulp
    b = torch.eye(16)  # exact in TF32: c = a as the tensor core read it
    c = torch.empty(16, 16, device="cuda")
    dot[(1,)](a.cuda(), b.cuda(), c, IEEE=False)
    read = {m: torch.equal(c.cpu(), tf32(a, m)) for m in ("rz", "rna")}
    # rna here: flip "rz" to "rna" in VLLMEngine.noise_budget and EnginePrecision.product's Triton GEMM line
    assert read == {"rz": True, "rna": False}, read
    dot[(1,)](a.cuda(), b.cuda(), c, IEEE=True)
    assert torch.equal(c.cpu(), a)
    print(f"Triton {triton.__version__} on {torch.cuda.get_device_name()}: default f32 dot = TF32, truncated")


@pytest.mark.gpu
def test_gpu_plugin_q8_1_products_match_the_emulation():
    """The vllm-gguf-plugin's CUDA ops (when installed beside llmdoctor) against `q8_1_product`: MMVQ and
    MMQ on Q8_0, Q4_0, Q5_0, Q4_K, Q6_K weights, within float32 summation-order noise."""
    ops = pytest.importorskip("vllm_gguf_plugin.ops")
    if not getattr(ops, "_CUDA_ENABLED", False):
        pytest.skip("the plugin's CUDA ops did not load")
    n, k = 64, 512
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q6_K):
        raw = _gguf_raw(qtype, n, k, seed=6)
        w = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(n, k).astype(np.float32))
        for tokens in (3, 12):
            x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens))
            op = ops.ggml_mul_mat_vec_a8 if tokens <= 6 else ops.ggml_mul_mat_a8
            got = op(torch.from_numpy(raw).cuda(), x.cuda(), int(qtype), n).cpu().double()
            want = q8_1_product(x, w, qtype, raw).double()
            plain = (x @ w.t()).double()
            err, plain_err = (got - want).norm() / want.norm(), (got - plain).norm() / plain.norm()
            assert err < 1e-5 and err < plain_err / 10, (qtype.name, tokens, float(err), float(plain_err))
