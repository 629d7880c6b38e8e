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
(reference/arch_deepseek.py; tests/test_emulate.py). Rounding half away from zero follows ggml-quants.c's reference
(`roundf` / `nearest_int`); the SIMD paths round half to even, a difference only at exact ties.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as Q

_Q8_0_TYPES = {Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.IQ4_NL, Q.MXFP4, Q.Q4_1, Q.Q5_1}
_Q8_K_TYPES = {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS,
               Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0}


@dataclass(frozen=True)
class EnginePrecision:
    """How an engine computes: activation quantization before matmuls, and the attention dtype."""

    name: str
    activation_quant: bool = False
    kv_dtype: torch.dtype | None = None  # Q, K, V and P rounded to this dtype around attention


LLAMA_CPP_CPU = EnginePrecision("llama.cpp-cpu (Q8 activations, F16 KV cache)", True, torch.float16)


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
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


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
