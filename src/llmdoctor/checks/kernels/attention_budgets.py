"""How far a case's output may be from the float64 reference, per dtype.

Budget in float32 (issue 18): `rounding_bound`, per element, derived for any summation order (a
float32 kernel's error IS its accumulation order, which is the kernel's choice: a floor emulated from
one order bounds nothing about another; measured, the old 4 x floor held for the plain and tiled
kernels here, with a margin of under 3x on batch1).

Budget in bfloat16 / float16 (issue 6): the noise floor of a case in a dtype is the largest error, over 5 seeds, of the
reference math run with its inputs rounded to the dtype, the probabilities P rounded to the dtype
before P·V, and the output rounded to the dtype (lse rounded to float32, what kernels return),
measured against the float64 math on the unrounded inputs. The emulation accumulates in float32
(`reference.attention.acc_dtype`), as kernels do: measured on CPU, a float64-accumulating emulation
gives a float32 floor 4-8x below what correct float32 kernels (SDPA math, flex) reach on 300-key rows,
because the P·V sum's rounding scales with sum |p v| while the output's scales with |sum p v|. A
correct kernel makes the same kinds of roundings in a different order, so its error stays within a
small multiple of the floor; a case fails above K_FLOOR = 4 x floor in max |err| (per sequence) or in
relative L2 (per case). NaN/inf where the reference is finite fails, except where it comes from the
unused rows of a paged cache alone (attention_verdicts.unused_rows_verdict). The subject's error is
measured against the float64 math on the inputs it was given (already rounded), so input rounding is
counted once, in the floor: the budget errs generous.

An fp8 latent cache (`mla-decode-fp8`) gets its floor the same way, its cache rounded through
float8_e4m3fn at the per-tensor scale; the subject is judged against the float64 math on the dequantized
fp8 cache it was given.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...reference import attention as attn
from ...reference import attention_cases as ref
from .. import metrics
from .attention_inputs import fp8_cache, make_inputs, rounded
from .attention_reference import Variant, chunk_calls, reference
from .attention_shapes import Shape
from .attention_suite import Case

K_FLOOR = 4.0
FLOOR_SEEDS = 5


@dataclass
class Floor:
    out_max: float
    out_rel: float
    lse_max: float


def noise_floor(shape: Shape, case: Case, dtype: torch.dtype, device: str = "cpu") -> Floor:
    """Largest error over FLOOR_SEEDS seeds of the rounded emulation (module docstring)."""
    fl = Floor(0.0, 0.0, 0.0)
    for seed in range(FLOOR_SEEDS):
        x = make_inputs(shape, case, 10_000 + seed, device)
        want, want_lse = reference(shape, case, x)
        emu, emu_lse = reference(shape, case, rounded(fp8_cache(x) if case.fp8_cache else x, dtype), p_dtype=dtype,
                                 out_dtype=dtype)
        fl.out_max = max(fl.out_max, metrics.max_abs_diff(emu, want))
        fl.out_rel = max(fl.out_rel, metrics.rel_l2(emu, want))
        fin = torch.isfinite(want_lse)
        fl.lse_max = max(fl.lse_max, metrics.max_abs_diff(emu_lse[fin], want_lse[fin]))
    return fl


# ----------------------------------------------------------------------------- the float32 budget

def rounding_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, *, scale: float,
                   u: float, softcap: float | None = None,
                   p_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bound on |kernel - exact| of attention computed in a float format of unit roundoff u, in ANY
    summation order (plain, blocked, split-K, online softmax), for float64 inputs that the kernel got
    exactly: (out bound [T, H, Dv], lse bound [T, H]), 0 for rows with no visible key. `p_dtype` is
    accepted for the wrappers' signature and ignored (the bound is for a kernel that keeps P in u).

    Derivation (Higham §2.2/§3.1: fl(a op b) = (a op b)(1 + δ), |δ| <= u; a sum of n terms in any order
    has error <= γ_{n-1}·Σ|terms|, γ_n = n·u / (1 - n·u)). For a query with n visible keys j:
    - score s_j = scale·q·k_j (D products, D - 1 additions, the scale and a possible log2(e) fold):
      |Δs_j| <= γ_{D+2}·scale·Σ_d |q_d k_dj|; softcap c·tanh(s/c) has slope <= 1 and adds 6u·|s_j|
      (divide, tanh within 4u, multiply);
    - the weight w_j = exp(s_j - m) of any subtracted maximum m (a common m cancels in out = Σ w v / Σ w):
      relative error a_j <= |Δs_j| + 2u·|s_j - m| (the subtraction and the log2(e) fold) + 4u (exp,
      within 4u also for ex2.approx);
    - online softmax rescales the running sums when the maximum grows, at most n - 1 times; the factors
      exp(m_old - m_new) have errors 2u·|m_old - m_new| + 4u, and the |m_old - m_new| telescope to at
      most the score range R = m - min_j s_j; each term then meets at most n - 1 additions and n - 1
      rescaling multiplies, and the final division and store: ε = γ_{6n+2} + 2u·R covers every path.
    Perturbing the weights by (1 + α_j), |α_j| <= a_j, moves out by Σ_j p_j α_j (v_j - out) / (1 - max a):
    |Δout| <= (Σ p_j a_j |v_j| + Σ p_j a_j·|out|) / (1 - max a) + ε/(1 - ε)·(Σ p_j |v_j| + |out|) + u·|out|,
    and lse = m + log Σ w: |Δlse| <= Σ p_j a_j / (1 - max a) + ε/(1 - ε) + 4u·(|lse| + |m| + 1).
    The bound is linear in the number of keys and the head size (worst case: each rounding error at
    its largest, all of one sign); it is what every correct order of the sums is guaranteed to meet.
    """
    t, h, d = q.shape
    s, hk, dv = v.shape
    x = attn.scores(q, k, scale=scale, softcap=softcap)  # [H, T, S] float64
    ds = metrics.gamma(d + 2, u) * attn.scores(q.abs(), k.abs(), scale=abs(scale))  # [H, T, S]: |Δs| before softcap
    if softcap:
        ds = ds + 6 * u * x.abs()
    none = ~allowed[None]
    xm = x.masked_fill(none, float("-inf"))
    lse = torch.logsumexp(xm, dim=-1)  # [H, T]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(xm - safe[..., None])  # [H, T, S]
    m = xm.amax(-1).masked_fill(~torch.isfinite(lse), 0.0)  # [H, T]
    lo = x.masked_fill(none, float("inf")).amin(-1).masked_fill(~torch.isfinite(lse), 0.0)
    a = (ds + 2 * u * (x - m[..., None]).abs() + 4 * u).masked_fill(none, 0.0)  # [H, T, S]
    n = allowed.sum(-1).to(x.dtype)  # [T]
    eps = (6 * n + 2) * u / (1 - (6 * n + 2) * u) + 2 * u * (m - lo)  # [H, T]: γ_{6n+2} + 2u·R
    shrink = 1 - a.amax(-1)  # [H, T]
    vg = v.to(x.dtype).abs().permute(1, 0, 2)[:, None]  # [Hk, 1, S, Dv]

    def pv(w: torch.Tensor) -> torch.Tensor:  # Σ_j w_j |v_j| per head: [H, T, Dv]
        return torch.matmul(w.reshape(hk, h // hk, t, s), vg).reshape(h, t, dv)

    out = torch.matmul(p.reshape(hk, h // hk, t, s), v.to(x.dtype).permute(1, 0, 2)[:, None]).reshape(h, t, dv)
    pa = p * a
    spa = pa.sum(-1)  # [H, T]
    bound = ((pv(pa) + spa[..., None] * out.abs()) / shrink[..., None]
             + (eps / (1 - eps))[..., None] * (pv(p) + out.abs()) + u * out.abs())
    lse_bound = spa / shrink + eps / (1 - eps) + 4 * u * (safe.abs() + m.abs() + 1)
    empty = ~torch.isfinite(lse)
    bound = bound.masked_fill(empty[..., None], 0.0)
    lse_bound = lse_bound.masked_fill(empty, 0.0)
    return bound.permute(1, 0, 2), lse_bound.transpose(0, 1)


F32_U = 2.0 ** -24  # float32's unit roundoff (metrics.unit_roundoff(torch.float32))
F32_RULE = ("float32 rounding bound of attention in any summation order (checks.kernels.attention_budgets.rounding_bound: "
            "γ_n in the keys and the head size, Higham §3.1), per element")


def f32_budget(shape: Shape, case: Case, x: dict[str, torch.Tensor],
               variant: Variant = Variant()) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element float32 bounds (out [Tq, H, Dv], lse [H, Tq]) of a case on inputs x. A chunked case is
    merged by LSE from its calls: out = Σ_c w_c out_c with w_c = exp(lse_c - lse), so a call's errors
    reach the result as w_c·(B_c + (Bl_c + Σ_c' w_c' Bl_c')·|out_c|) (to first order), lse's as Σ w_c Bl_c."""
    op = functools.partial(rounding_bound, u=F32_U)
    if not case.chunk:  # (the wrappers fill rows without keys with lse -inf: no error there, bound 0)
        out_b, lse_b = reference(shape, case, x, variant=variant, op=op)
        return out_b, lse_b.clamp_min(0.0)
    kw = dict(scale=variant.scale or shape.scale, window=case.window, softcap=case.softcap, top_left=variant.top_left)
    outs, lses, bounds, lbounds = [], [], [], []
    for k, v, cu_k, causal in chunk_calls(case, x):
        o, l = ref.varlen(x["q"], k, v, x["cu_q"], cu_k, causal=causal, **kw)
        b, lb = ref.varlen(x["q"], k, v, x["cu_q"], cu_k, causal=causal, op=op, **kw)
        outs.append(o), lses.append(l), bounds.append(b), lbounds.append(lb.clamp_min(0.0))
    _, lse = ref.merge_chunks(outs, lses)  # [H, Tq]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w = [torch.exp(l - safe).transpose(0, 1)[..., None] for l in lses]  # [Tq, H, 1] each (0 for empty chunks)
    lse_b = sum(wc[..., 0].transpose(0, 1) * lb for wc, lb in zip(w, lbounds))  # [H, Tq]
    tot = lse_b.transpose(0, 1)[..., None]
    out_b = sum(wc * (b + (lb.transpose(0, 1)[..., None] + tot) * o.abs())
                for wc, b, lb, o in zip(w, bounds, lbounds, outs))
    return out_b, lse_b


@dataclass
class Budget:
    """How far a case's output may be from the reference: `out`, `lse` per element (tensors: the float32
    bound) or as a number (K_FLOOR x the emulated floor), and `rel` over a whole case (None: none)."""

    out: Any
    lse: Any
    rel: Optional[float]
    info: dict[str, Any]

    def within(self, got: torch.Tensor, want: torch.Tensor, rows: Optional[slice] = None) -> bool:
        """got within budget on all rows, or on `rows` (a sequence: the relative L2 is a whole case's)."""
        lim = self.out[rows] if rows is not None and isinstance(self.out, torch.Tensor) else self.out
        if metrics.nonfinite_where_finite(got, want).any():
            return False
        if isinstance(lim, torch.Tensor):
            ok = not metrics.over_budget(got, want, lim.reshape(-1)).any()
        else:
            ok = metrics.max_abs_diff(got, want) <= lim
        return ok and (rows is not None or self.rel is None or metrics.rel_l2(got, want) <= self.rel)

    def lse_within(self, got: torch.Tensor, want: torch.Tensor, scale: float = 1.0) -> bool:
        """got lse within budget (x scale); where the reference has no key (lse -inf) any infinity passes:
        flash-attn 2 writes +inf there, flash-attn 3 -inf (reference.attention_cases)."""
        both_inf = torch.isinf(got) & torch.isinf(want)
        got = torch.where(both_inf, want, got)
        lim = self.lse * scale
        if metrics.nonfinite_where_finite(got, want).any():
            return False
        if isinstance(lim, torch.Tensor):
            return not metrics.over_budget(got, want, lim.reshape(-1)).any()
        return metrics.max_abs_diff(got, want) <= lim


def budget(shape: Shape, case: Case, x: dict[str, torch.Tensor], dtype: torch.dtype, fl: Optional["Floor"],
           variant: Variant = Variant()) -> Budget:
    """float32: the derived rounding bound (the accumulation order is the whole error there, and it is
    the kernel's choice). bfloat16 / float16: K_FLOOR x the emulated floor (module docstring): there the
    kernel's inputs, P and output are rounded to the dtype once each whatever the order, and the float32
    accumulations add errors 2^16 times smaller."""
    if dtype == torch.float32:
        out_b, lse_b = f32_budget(shape, case, x, variant)
        return Budget(out_b, lse_b, None, {"rule": F32_RULE, "bound_max": float(out_b.max()) if out_b.numel() else 0.0,
                                           "lse_bound_max": float(lse_b.max()) if lse_b.numel() else 0.0})
    return Budget(K_FLOOR * fl.out_max, K_FLOOR * fl.lse_max, K_FLOOR * fl.out_rel,
                  {"rule": f"{K_FLOOR:g} x noise floor (max over {FLOOR_SEEDS} seeds of the rounded float64 emulation)",
                   "floor_max_abs": fl.out_max, "floor_rel_l2": fl.out_rel, "floor_lse_max_abs": fl.lse_max,
                   "k": K_FLOOR})
