"""Emulating an engine's arithmetic in the reference, to calibrate how far a *healthy* engine is
expected to be from the float32 reference, layer by layer.

llama.cpp's CPU backend (ggml-cpu) does not multiply float activations with dequantized weights:
before each matmul it converts the activations to the weight type's `vec_dot_type` (ggml-cpu's
type traits) and takes integer dot products:

    weight type                              activations become
    Q4_0, Q5_0, Q8_0, IQ4_NL (and MXFP4)     Q8_0: blocks of 32, d = max|x| / 127 (stored f16), q = round(x / d)
    Q4_1, Q5_1                               Q8_1: the same values as Q8_0 (plus block sums)
    Q2_K .. Q6_K, IQ2_*, IQ3_*, IQ1_*, IQ4_XS Q8_K: blocks of 256, d = max / -127 in f32 with the
                                             signed extreme, q = min(127, round(x / d))
    F16 / BF16                               F16 / BF16 (rounded)
    F32                                      unchanged

and its KV cache is F16 by default: K and V are stored rounded to f16, and because a matmul with an
F16 operand converts the other operand to F16 too, Q (in K·Q) and the softmax probabilities P (in
V·P) are rounded to f16 as well. For MLA the cache holds [latent, k_pe] with the latent as V, so the
absorbed query, both and P are rounded; a legacy file (kv_b unsplit) caches the expanded K and V
(reference/arch_deepseek.py; tests/reference/test_emulate.py). Rounding half away from zero follows ggml-quants.c's reference
(`roundf` / `nearest_int`); the SIMD paths round half to even, a difference only at exact ties.

vLLM on CUDA in float32 (vLLM 0.24 / 0.32, vllm-gguf-plugin 0.0.5, Triton 3.6 / 3.9; read from their sources)
is not a float32 engine either:

- Triton attention (TRITON_ATTN: vllm/v1/attention/ops/triton_unified_attention.py, `kernel_unified_attention`)
  computes `tl.dot(Q, K)` and `tl.dot(P, V)` with no `input_precision`, so Triton's default applies:
  `knobs.language.fp32_default` (env TRITON_F32_DEFAULT) or else "tf32" on NVIDIA (language/core.py `dot`,
  backends/nvidia/compiler.py `default_dot_input_precision`). Triton's NVIDIA lowering passes the float32
  registers straight to `mma.sync ... .tf32` / `wgmma ... .tf32` (DotOpToLLVM/MMAv2.cpp, WGMMA.cpp: no
  `cvt.rna.tf32.f32` for a plain "tf32" dot; only its tf32x3 split converts), so the tensor core reads the
  top 19 bits: the low 13 mantissa bits are dropped (`tf32(x, "rz")`). Code that converts first
  (`cvt.rna.tf32.f32`: round to nearest, ties away from zero) gives `tf32(x, "rna")`. Measured on the H200
  (vLLM 0.24, session 5): truncation, with P rounded as the online softmax holds it (`tf32_weights`).
- The plugin's GGUF linear layers (quantization/linear.py `_fused_mul_mat_gguf`) multiply quantized weights
  with the activations quantized to Q8_1 by `quantize_q8_1` (csrc/gguf/gguf_kernel.cu, as llama.cpp's
  ggml-cuda/quantize.cu for MMVQ): blocks of 32, d = amax / 127 in float32, q = roundf(x / d), and the
  block stores half(d) and half(sum of the float x). MMVQ runs up to 6 tokens (2 when the weight has more
  than 5120 rows; IQ types 16 / 8), MMQ above for the legacy and K-quant types, dequantize-then-matmul for
  IQ types above (their CUDA dequantizers compute in float32: exact). The weight's constant part uses
  the block sum (vecdotq.cuh): Q4_0 / Q5_0 subtract 8 / 16 x d_w x half(sum) and Q4_1 / Q5_1 add
  m_w x half(sum) on both paths; Q4_K / Q5_K subtract dmin x m_j x half(sum) on MMQ and use the
  quantized values' sum on MMVQ; every other type only d_w x d_a x the integer dot (`q8_1_product`).
  Not emulated: Q4_1 / Q5_1 round d_w x d_a and m_w x s to half before use (__hmul2), and the extension
  is built with --use_fast_math (x / d approximate to 2 ulp: a quant differs only where x / d lies that
  close to a rounding tie).
- Without its CUDA ops (`_C_gguf` not loaded, or VLLM_GGUF_USE_CUDA=0) the plugin runs Triton GEMMs
  (triton/gemm/*): the weight dequantized in float32 and `tl.dot(x, w)`: TF32 on both.
- A DSA indexer (GLM-5, DeepSeek-V3.2) on CUDA scores keys in FP8 whatever the model's dtype
  (deepseek_v2.py `Indexer.forward`, sparse_attn_indexer.py): each indexer head's q, after its rotary, goes
  through `per_token_group_quant_fp8` (groups of 128, ue8m0: the scale max(amax, 1e-10) / 448 rounded up
  to a power of two, e4m3 values), the key through `indexer_k_quant_and_cache` (csrc/cache_kernels.cu: the
  same per 128 values of the key, amax floored at 1e-4), and DeepGEMM's `fp8_mqa_logits` sums relu(q . k) x
  the head weights in float32 (`fp8_blocks`).
- Quantized token embeddings are dequantized by the CUDA `ggml_dequantize` (dequantize.cuh), which for the
  legacy and K-quant types computes in half precision whatever the output dtype: one rounding of the
  float32 value to half for Q4_0 / Q5_0 / Q8_0 (an integer times the f16 scale, rounded once: exact
  emulation), two or three roundings for Q4_1 / Q5_1 / K-quants (emulated by one: within a half ulp).

vLLM with an fp8 KV cache (`--kv-cache-dtype fp8` / `fp8_e4m3`; vLLM 0.24 / 0.32, read from their sources and,
for the CPU, measured against vLLM for CPU 0.32's own ops; `KVCacheFP8`):

- Which values: K and V as the cache stores them (K after RoPE), each attention layer with its own per-tensor
  scales `k_scale` / `v_scale` (the layer's `_k_scale_float` / `_v_scale_float`: 1.0 unless the checkpoint's
  quantization config loads them, model_executor/layers/quantization/kv_cache.py `BaseKVCacheMethod`; a
  checkpoint with a single `kv_scale` gives both the same; 0.24's `--calculate-kv-scales` set them from the
  first batch as amax(|q|, |k|, |v|) / (200, 200, 100), deprecated; 0.32 has none). Stored value: e4m3(x /
  scale), read back as e4m3 x scale.
- vLLM for CPU (CPU_ATTN, csrc/cpu/cpu_attn_fp8.hpp `float_to_fp8e4m3_scalar`, used by both the VEC and AMX
  cache writes): x times the float32 1 / scale, clamped to +-448 (saturating; NaN becomes +448), then the
  low mantissa bits dropped: rounding *toward zero* on the e4m3 grid, subnormals (k 2^-9) included, after
  the float32 product x 2^-120 rounds a value below 2^-6 to a multiple of 2^-29. Measured bit-exact on
  0.32 (tests/data/vllm_cpu_fp8_kv_cache.npz): 0 of 4,096 values differ on each of the VEC (float32) and
  AMX (bfloat16) layouts; rounding to nearest differs in 21% of them. Q stays in the model dtype; the VEC path
  multiplies float32 Q by the float32 dequantized K and float32 P by V, the k/v scales folded into the
  softmax scale and the output (cpu_attn_vec.hpp): emulated to float32 rounding (within 3e-6 of |out| ~3 on random
  cases). The AMX (bfloat16) path feeds e4m3 x 2^-120 as bfloat16 to TDPBF16PS, whose denormal inputs and
  outputs are zero: e4m3 subnormals read as 0 and products below 2^-126 flush (cpu_attn_amx.hpp): not
  emulated (within the bfloat16 budget at scale 1.0 on the tiny llama; 5e-2 of |out| ~3 on random cases,
  against 8e-3 at scale 0.05).
- CUDA, FLASH_ATTN / FLASHINFER (csrc/cache_kernels.cu `reshape_and_cache_flash`, quantization/
  fp8 `scaled_convert`): x / scale converted by `__nv_cvt_float_to_fp8(..., __NV_SATFINITE, E4M3)`: round
  to nearest even, saturating at +-448. TRITON_ATTN (triton_reshape_and_cache_flash.py): x / scale stored
  to an fp8e4nv pointer, Triton's round-to-nearest conversion. Backends that take an fp8 query
  (`supports_quant_query_input`: FlashAttention 3, TRITON_ATTN on CUDA) quantize Q too, per tensor with the
  layer's `q_scale` (static QuantFP8: clamp +-448, round to nearest; q_scale = 1.0 without a quantization
  config, k_scale when the checkpoint's config gives k but not q), and the P·V product reads P (each row's
  exp(S - max), largest 1) as e4m3 (Triton `P.to(V.dtype)`; FA3's fp8 kernel converts P for its second
  GEMM); FA2 and FlashInfer's non-fp8-query paths read K and V dequantized into the query's dtype.
- MLA (concat_and_cache_mla): the cache row [latent, k_pe] with the one layer scale (k_scale), V being the
  latent part. `fp8_ds_mla` (sparse MLA, FlashMLA sparse; concat_and_cache_ds_mla_kernel): a 656-byte entry
  per token: the 512 latent values in 4 tiles of 128, each with its own float32 scale max(amax / 448,
  FLT_MIN) (not a power of two), values e4m3(x / tile scale) rounded to nearest; the 64 k_pe values kept in
  bfloat16 (the model's dtype: exact); the layer scales unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K

from .draws import random_integer

_Q8_0_TYPES = {Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.IQ4_NL, Q.MXFP4, Q.Q4_1, Q.Q5_1}
_Q8_K_TYPES = {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS,
               Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0}
# vllm-gguf-plugin's type sets (quantization/utils.py): what its GGUF linear layers multiply how
_UNQUANTIZED = {Q.F32, Q.F16, Q.BF16}
_PLUGIN_STANDARD = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}
_PLUGIN_K = {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
_PLUGIN_IQ = {Q.IQ1_M, Q.IQ1_S, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_XS, Q.IQ4_NL}
# weight types whose constant part the CUDA vec dots multiply by the Q8_1 block's half(sum of x)
# (vecdotq.cuh): on both paths, and on MMQ only
_SUM_TERM = {Q.Q4_0, Q.Q5_0, Q.Q4_1, Q.Q5_1}
_SUM_TERM_MMQ = {Q.Q4_K, Q.Q5_K}


@dataclass(frozen=True)
class EnginePrecision:
    """How an engine computes: activation quantization before matmuls, the attention dtype, and the
    roundings a GPU engine's float32 kernels apply (vLLM on CUDA). `name` identifies the combination
    (runs are cached by it)."""

    name: str
    activation_quant: bool = False  # ggml-cpu: activations converted to the weight type's vec_dot_type
    kv_dtype: torch.dtype | None = None  # Q, K, V and P rounded to this dtype around attention
    attention_tf32: str | None = None  # "rz" | "rna": Q, K, P, V as a float32 tensor-core dot reads them
    gguf_products: str | None = None  # quantized weights: "q8_1" (the plugin's CUDA MMVQ/MMQ), "tf32" (Triton GEMMs)
    dense_tf32: str | None = None  # unquantized weights: torch's float32 matmul in TF32 (precision "high")
    embedding_half: bool = False  # quantized token-embedding rows dequantized in half precision
    indexer_fp8: int = 0  # a DSA indexer's q and k in FP8 e4m3, power-of-two scales per this many (`fp8_blocks`)
    kv_fp8: "KVCacheFP8 | None" = None  # an fp8 (e4m3) KV cache with the engine's own scales

    def product(self, x: torch.Tensor, w: torch.Tensor, qtype: int | None, raw=None) -> torch.Tensor:
        """x [T, in] @ w [out, in]^T as the engine computes it; `qtype` is w's GGML type (None: not from a
        GGUF) and `raw` its bytes [out, row bytes] (the Q8_1 products read the weight's block constants)."""
        quantized = qtype is not None and Q(qtype) not in _UNQUANTIZED
        if self.activation_quant and qtype is not None:
            return quantize_activations(x, qtype) @ w.t()
        if quantized and self.gguf_products == "q8_1":
            return q8_1_product(x, w, qtype, raw)
        if quantized and self.gguf_products == "tf32":
            return tf32(x, "rz") @ tf32(w, "rz").t()  # the plugin's Triton GEMMs: Triton's default dot
        if not quantized and self.dense_tf32:
            return tf32(x, self.dense_tf32) @ tf32(w, self.dense_tf32).t()
        return x @ w.t()


LLAMA_CPP_CPU = EnginePrecision("llama.cpp-cpu (Q8 activations, F16 KV cache)", True, torch.float16)


def vllm_cuda(*, attention_tf32: str | None = None, gguf_products: str | None = None,
              dense_tf32: str | None = None, embedding_half: bool = False,
              indexer_fp8: int = 0, kv_fp8: "KVCacheFP8 | None" = None) -> EnginePrecision | None:
    """vLLM's arithmetic on CUDA as the run's info describes it (subjects/engines/vllm.py); None when
    it rounds nothing the float32 reference does not."""
    parts = [f"TF32 attention ({attention_tf32})" if attention_tf32 else "",
             {"q8_1": "Q8_1 activations", "tf32": "TF32 GGUF GEMMs"}.get(gguf_products or "", ""),
             f"TF32 dense matmuls ({dense_tf32})" if dense_tf32 else "",
             "f16 embedding dequant" if embedding_half else "", f"FP8 indexer ({indexer_fp8})" if indexer_fp8 else "",
             kv_fp8.name if kv_fp8 is not None else ""]
    parts = [p for p in parts if p]
    if not parts:
        return None
    return EnginePrecision(f"vllm-cuda ({', '.join(parts)})", attention_tf32=attention_tf32,
                           gguf_products=gguf_products, dense_tf32=dense_tf32, embedding_half=embedding_half,
                           indexer_fp8=indexer_fp8, kv_fp8=kv_fp8)


E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def fp8_blocks(x: torch.Tensor, block: int = 128, eps: float = 1e-10) -> torch.Tensor:
    """x [..., D] (D a multiple of `block`, or smaller than it: one block) as vLLM's CUDA indexer quantizes
    it: per block of `block` values along the last dim, scale = 2^ceil(log2(max(amax, eps) / 448)) (ue8m0),
    values x / scale rounded to float8_e4m3fn (round to nearest even, as the CUDA conversion), times the
    scale again; returned in x's dtype. The power-of-two scale makes x / scale exact, so the only rounding
    is e4m3's: 3 mantissa bits, a relative error of at most 2^-4 for normal values."""
    d = x.shape[-1]
    b = min(block, d)
    if d % b:
        raise ValueError(f"fp8_blocks: last dim {d} is not a multiple of the block {b}")
    xf = x.float().reshape(*x.shape[:-1], d // b, b)  # [..., blocks, b]
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=eps)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    q = (xf / scale).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(x.shape).to(x.dtype)


def tf32(x: torch.Tensor, mode: str = "rna") -> torch.Tensor:
    """x (float32) as a TF32 tensor-core operand: 10 explicit mantissa bits of float32's 23, the exponent
    range unchanged. "rna": PTX `cvt.rna.tf32.f32` (round to nearest, ties away from zero); "rz": the low
    13 bits dropped (an unconverted float32 register read as tf32). inf and NaN pass unchanged; a value
    that rounds past float32's largest becomes inf, as the conversion does. Computed as a multiple of the
    TF32 quantum 2^(e - 11) (x = m 2^e, m in [0.5, 1); subnormals share the smallest normal's quantum)."""
    if mode not in ("rna", "rz"):
        raise ValueError(f"tf32 rounding {mode!r}: expected 'rna' or 'rz'")
    xd = x.double()
    _, e = torch.frexp(xd)
    quantum = torch.ldexp(torch.ones_like(xd), torch.clamp(e, min=-125) - 11)
    a = xd.abs() / quantum  # exact: a power-of-two scaling
    n = random_integer(a) if mode == "rna" else None  # a randomized draw rounds "rna" stochastically (draws.py);
    n = n if n is not None else torch.floor(a + 0.5) if mode == "rna" else torch.floor(a)  # "rz" truncates anyway
    out = torch.copysign(n * quantum, xd).to(torch.float32)
    return torch.where(torch.isfinite(x), out, x.float()).to(x.dtype)


def tf32_weights(p: torch.Tensor, mode: str = "rz") -> torch.Tensor:
    """Attention weights p [..., S] (each row normalized) as a Triton flash-attention kernel feeds them to
    its P·V dot: its online softmax holds P = exp(S - row max), largest exactly 1, rounds that to TF32,
    and divides by the row sum after the dot (triton_unified_attention.py). Here: p scaled by its row max,
    rounded, scaled back (a row without a visible key stays 0). Against vLLM 0.24 on the H200 (tiny llama,
    float32, TRITON_ATTN) this reproduces the engine's kqv_out / l_out errors to 1% where rounding the
    normalized p directly overstates them by 20-35%."""
    mx = p.amax(dim=-1, keepdim=True)
    mx = torch.where(mx > 0, mx, torch.ones_like(mx))
    return tf32(p / mx, mode) * mx


def vec_dot_type(qtype: int) -> str:
    """The activation format ggml-cpu uses for a matmul with a weight of `qtype`."""
    q = Q(qtype)
    if q in _Q8_0_TYPES:
        return "q8_0"
    if q in _Q8_K_TYPES:
        return "q8_K"
    if q == Q.F16:
        return "f16"
    if q == Q.BF16:
        return "bf16"
    return "f32"


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """ggml's roundf; stochastic while a randomized draw runs (reference/draws.py)."""
    drawn = random_integer(x)
    return drawn if drawn is not None else torch.sign(x) * torch.floor(x.abs() + 0.5)


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K % 32 == 0) -> the values a Q8_0 round trip gives, in x's dtype."""
    b = x.float().reshape(-1, 32)  # [n_blocks, 32]
    d = b.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _round_half_away(b * inv)
    d16 = d.to(torch.float16).float()
    return (q * d16).reshape(x.shape).to(x.dtype)


def q8_K(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K % 256 == 0) -> the values a Q8_K round trip gives (ggml's quantize_row_q8_K_ref)."""
    b = x.float().reshape(-1, 256)  # [n_blocks, 256]
    idx = b.abs().argmax(dim=1, keepdim=True)
    mx = b.gather(1, idx)  # the signed extreme
    iscale = torch.where(mx == 0, torch.zeros_like(mx), -127.0 / mx)
    q = torch.clamp(_round_half_away(iscale * b), max=127)
    d = torch.where(mx == 0, torch.zeros_like(mx), 1 / iscale)
    return (q * d).reshape(x.shape).to(x.dtype)


def quantize_activations(x: torch.Tensor, qtype: int) -> torch.Tensor:
    """The activations a ggml-cpu matmul with a `qtype` weight actually multiplies. x [..., K]."""
    kind = vec_dot_type(qtype)
    if kind == "q8_0" and x.shape[-1] % 32 == 0:
        return q8_0(x)
    if kind == "q8_K" and x.shape[-1] % 256 == 0:
        return q8_K(x)
    if kind == "f16":
        return x.to(torch.float16).to(x.dtype)
    if kind == "bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    return x


def q8_1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (values [..., K], sums [..., ceil(K / 32)]) of a Q8_1 quantization as the plugin's
    CUDA `quantize_q8_1` does it (csrc/gguf/gguf_kernel.cu; llama.cpp ggml-cuda/quantize.cu for MMVQ):
    per block of 32 (K zero-padded), d = amax / 127 in float32, q = roundf(x / d) (0 for an all-zero
    block), value = q x half(d); sum = half(the float32 sum of x, added in the warp's xor-butterfly
    order: lanes i and i ^ 16, then ^ 8, ^ 4, ^ 2, ^ 1). Values and sums in float32."""
    k = x.shape[-1]
    b = F.pad(x.float().reshape(-1, k), (0, -k % 32)).reshape(-1, 32)  # [n_blocks, 32]
    amax = b.abs().amax(dim=1, keepdim=True)
    d = amax / 127
    r = (b / torch.where(amax == 0, 1.0, d)).double()  # the float32 quotient; roundf on it exactly (in float32,
    q = torch.where(amax == 0, 0.0, _round_half_away(r)).float()  # r + 0.5 itself rounds: 0.49999997 -> 1)
    values = (q * d.to(torch.float16).float()).reshape(*x.shape[:-1], -1)[..., :k]
    s = b
    while s.shape[1] > 1:  # lane 0's butterfly: (x_i + x_{i+16}), then pairs 8 apart, ...
        h = s.shape[1] // 2
        s = s[:, :h] + s[:, h:]
    return values, s.to(torch.float16).float().reshape(*x.shape[:-1], -1)


def plugin_path(qtype: int, rows: int, tokens: int) -> str:
    """Which product the vllm-gguf-plugin's `_fused_mul_mat_gguf` (quantization/linear.py) takes for a
    weight of `qtype` with `rows` output rows and `tokens` input rows: "dense" (unquantized: x @ w^T),
    "mmvq" (up to 6 tokens, 2 when rows > 5120; IQ types 16 / 8), "mmq" (legacy and K-quants above) or
    "dequant" (IQ types above: dequantized, then x @ w^T). A type outside the plugin's lists is "dense"
    (the plugin refuses it at load)."""
    q = Q(qtype)
    if q in _UNQUANTIZED or q not in (_PLUGIN_STANDARD | _PLUGIN_K | _PLUGIN_IQ):
        return "dense"
    iq = q in _PLUGIN_IQ
    safe = (8 if rows > 5120 else 16) if iq else (2 if rows > 5120 else 6)
    if tokens <= safe:
        return "mmvq"
    return "dequant" if iq else "mmq"


def block_constants(raw: np.ndarray, qtype: int, rows: int) -> torch.Tensor | None:
    """float32 [rows, K / 32]: the constant each 32-block of a weight row adds to every element (the part
    the CUDA vec dots multiply by the activations' block sum): Q4_0 -8 d, Q5_0 -16 d, Q4_1 / Q5_1 m,
    Q4_K / Q5_K -dmin x m_j (sub-block j's 6-bit min, gguf-py's `Q4_K.get_scale_min`); None for a type
    without one. `raw`: the weight's bytes, [rows, row bytes] or flat."""
    q = Q(qtype)
    raw = np.asarray(raw, dtype=np.uint8)
    _, type_size = GGML_QUANT_SIZES[q]
    if q not in _SUM_TERM | _SUM_TERM_MMQ or raw.size % (rows * type_size):
        return None  # no block constant, or bytes that are not this weight's (a slice aliasing a larger one)
    b = np.ascontiguousarray(raw.reshape(rows, -1, type_size))  # [rows, blocks, bytes]

    def f16(offset: int) -> np.ndarray:  # [rows, blocks]
        return b[..., offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)

    if q in (Q.Q4_0, Q.Q5_0):
        c = (-8.0 if q == Q.Q4_0 else -16.0) * f16(0)
    elif q in (Q.Q4_1, Q.Q5_1):
        c = f16(2)
    else:  # Q4_K / Q5_K: d, dmin, 12 bytes of packed 6-bit scales and mins
        _, mins = Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
        c = -f16(2)[..., None] * mins.reshape(rows, -1, 8).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(c.reshape(rows, -1)))


def q8_1_product(x: torch.Tensor, w: torch.Tensor, qtype: int, raw=None) -> torch.Tensor:
    """x [T, K] @ w [N, K]^T as the plugin's CUDA GGUF linear computes it (w: the exactly dequantized
    weight, `raw` its bytes): on MMVQ / MMQ the Q8_1 values times w, where the weight's block constant c
    meets half(block sum) instead of the values' sum: + (half(sum) - sum(values)) @ c^T (vecdotq.cuh);
    on the other paths x @ w^T."""
    path = plugin_path(qtype, w.shape[0], x.shape[0])
    if path in ("dense", "dequant"):
        return x @ w.t()
    xq, sums = q8_1(x)  # [T, K], [T, K / 32]
    y = xq.to(w.dtype) @ w.t()
    q = Q(qtype)
    sum_term = q in _SUM_TERM or (path == "mmq" and q in _SUM_TERM_MMQ)
    c = block_constants(raw, qtype, w.shape[0]) if raw is not None and sum_term else None  # [N, K / 32]
    if c is not None and c.shape[1] * 32 == x.shape[-1]:
        own = xq.reshape(*xq.shape[:-1], -1, 32).sum(-1)  # [T, K / 32]
        y = y + (sums - own).to(w.dtype) @ c.to(device=w.device, dtype=w.dtype).t()
    return y


def half_dequant(rows: torch.Tensor, qtype: int | None) -> torch.Tensor:
    """Dequantized rows of a `qtype` tensor as the plugin's CUDA `ggml_dequantize` leaves them: legacy and
    K-quant types computed in half precision (rounded once to float16 here: exact for Q4_0 / Q5_0 / Q8_0,
    within half a float16 ulp otherwise); unquantized and IQ types unchanged (float arithmetic)."""
    if qtype is None or Q(qtype) not in _PLUGIN_STANDARD | _PLUGIN_K:
        return rows
    return rows.to(torch.float16).to(rows.dtype)


# ---- an fp8 KV cache (vLLM `--kv-cache-dtype fp8`) -------------------------------------------------------

E4M3_TINY = 2.0 ** -9  # e4m3's smallest subnormal (its smallest normal is 2^-6)


def e4m3(x: torch.Tensor, scale: float = 1.0, rounding: str = "rne") -> torch.Tensor:
    """x as an fp8 e4m3 cache with per-tensor `scale` holds it: e4m3(x / scale) x scale, in x's dtype (the
    product in float32). "rne": x / scale rounded to nearest even, saturating at +-448 (CUDA's satfinite
    conversion; torch.float8_e4m3fn of the clamped value). "rz": vLLM for CPU's cache write: x times the
    float32 1 / scale, saturating at +-448 (NaN to +448), rounded toward zero (the module docstring)."""
    xf = x.float()
    if rounding == "rne":
        q = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    elif rounding == "rz":
        v = torch.nan_to_num(xf * torch.tensor(1.0 / scale, dtype=torch.float32), nan=E4M3_MAX)
        a = v.abs().clamp(max=E4M3_MAX)
        small = a < 2.0 ** -6  # the float32 product x 2^-120 is subnormal: rounded (to even) to a multiple of 2^-29
        a = torch.where(small, torch.round(a * 2.0 ** 29) * 2.0 ** -29, a)
        _, ex = torch.frexp(a)  # a = m 2^ex, m in [0.5, 1): the binade's quantum is 2^(ex - 4)
        quantum = torch.where(small, torch.full_like(a, E4M3_TINY), torch.ldexp(torch.ones_like(a), ex - 4))
        q = torch.copysign(torch.floor(a / quantum) * quantum, v)
    else:
        raise ValueError(f"e4m3 rounding {rounding!r}: expected 'rne' or 'rz'")
    return (q * torch.tensor(scale, dtype=torch.float32)).to(x.dtype)


def e4m3_tiles(x: torch.Tensor, tile: int = 128) -> torch.Tensor:
    """x [..., D] (D a multiple of `tile`) as fp8_ds_mla stores its latent: per tile of `tile` values a float32
    scale max(amax / 448, FLT_MIN), values e4m3(x / scale) rounded to nearest even; in x's dtype."""
    d = x.shape[-1]
    if d % tile:
        raise ValueError(f"e4m3_tiles: last dim {d} is not a multiple of the tile {tile}")
    xf = x.float().reshape(*x.shape[:-1], d // tile, tile)  # [..., tiles, tile]
    scale = (xf.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(x.shape).to(x.dtype)


def e4m3_weights(p: torch.Tensor) -> torch.Tensor:
    """Attention weights p [..., S] (rows normalized) as an fp8 P·V reads them: the kernel's exp(S - row max)
    (largest exactly 1) rounded to e4m3 (nearest even), the row sum divided after the dot; as `tf32_weights`."""
    mx = p.amax(dim=-1, keepdim=True)
    mx = torch.where(mx > 0, mx, torch.ones_like(mx))
    return e4m3(p / mx) * mx


@dataclass(frozen=True)
class KVCacheFP8:
    """An fp8 e4m3 KV cache as the engine writes and reads it (the module docstring has the sources):
    `scales[il]` is layer il's (k_scale, v_scale), None for a layer whose cache is not fp8; `rounding` "rne"
    (CUDA) or "rz" (vLLM for CPU); `q_scales[il]` the query's scale where the backend quantizes Q (and then
    reads P as e4m3), None elsewhere; `tile` > 0: fp8_ds_mla (the MLA latent per tile of that many values with
    its own scale, k_pe unquantized, the layer scales unused)."""

    scales: tuple[tuple[float, float] | None, ...]
    rounding: str = "rne"
    q_scales: tuple[float | None, ...] = ()
    tile: int = 0

    @property
    def name(self) -> str:
        """What it does, in a few words (the emulated run's name, by which runs are cached)."""
        kinds = {s for s in self.scales if s is not None}
        scales = (f"{next(iter(kinds))[0]:g}/{next(iter(kinds))[1]:g}" if len(kinds) == 1 else
                  ",".join("-" if s is None else f"{s[0]:g}/{s[1]:g}" for s in self.scales))
        what = f"fp8_ds_mla tiles of {self.tile}" if self.tile else f"fp8 e4m3 KV {scales} {self.rounding}"
        return what + (" with fp8 Q, P" if self.q_scales else "")

    def _scale(self, il: int, which: int) -> float | None:
        s = self.scales[il] if il < len(self.scales) else None
        return None if s is None else s[which]

    def k(self, il: int, x: torch.Tensor) -> torch.Tensor:
        """Layer il's keys [..., D] as its cache holds them."""
        s = self._scale(il, 0)
        return x if s is None else e4m3(x, s, self.rounding)

    def v(self, il: int, x: torch.Tensor) -> torch.Tensor:
        s = self._scale(il, 1)
        return x if s is None else e4m3(x, s, self.rounding)

    def q(self, il: int, x: torch.Tensor) -> torch.Tensor:
        """Layer il's queries as the backend feeds them (fp8 with the layer's q_scale, or unchanged)."""
        s = self.q_scales[il] if il < len(self.q_scales) else None
        return x if s is None else e4m3(x, s, "rne")

    def weights(self, il: int) -> "Callable[[torch.Tensor], torch.Tensor] | None":
        """The rounding of P before P·V in layer il (e4m3 where Q is fp8), or None."""
        return e4m3_weights if il < len(self.q_scales) and self.q_scales[il] is not None else None

    def mla_row(self, il: int, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An MLA cache row's (latent [..., R], k_pe [..., Dr]) as layer il's cache holds them: fp8_ds_mla tiles
        on the latent (k_pe exact), else both with the layer's k_scale (concat_and_cache_mla)."""
        if self.tile:
            return e4m3_tiles(latent, self.tile), k_pe
        return self.k(il, latent), self.k(il, k_pe)
