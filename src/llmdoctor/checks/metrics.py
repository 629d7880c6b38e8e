"""The one metrics module: every comparison in llmdoctor goes through these functions.

Conventions: `got` is the subject's value, `want` the reference's. Inputs are torch tensors (or
anything `torch.as_tensor` accepts); differences are computed in float64 so that the metric itself
adds no rounding worth mentioning. Scalar metrics return Python floats/ints. A metric over empty
input returns 0 (nothing differs).

Rounding analysis follows Higham, "Accuracy and Stability of Numerical Algorithms" (2nd ed.), §2.2
and §3.1: fl(a op b) = (a op b)(1 + δ) + η with |δ| <= u (unit roundoff) and |η| <= η_min (half the
smallest subnormal, only when the result underflows), and n roundings compound to at most
γ_n = n·u / (1 - n·u).
"""

from __future__ import annotations

import math
from typing import Any

import torch

# Integer views used to compare floats bit for bit (same width as the float).
_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}
_FLOAT32_FIELDS = {"sign": (31, 1), "exponent": (23, 8), "mantissa": (0, 23)}  # IEEE 754 binary32


def _t(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def _f64(x: Any) -> torch.Tensor:
    return _t(x).detach().to("cpu", torch.float64).reshape(-1)


def _pair(got: Any, want: Any) -> tuple[torch.Tensor, torch.Tensor]:
    g, w = _f64(got), _f64(want)
    if g.shape != w.shape:
        raise ValueError(f"cannot compare {g.numel()} values with {w.numel()}")
    return g, w


# ----------------------------------------------------------------------------- error norms

def abs_diff(got: Any, want: Any) -> torch.Tensor:
    """|got - want| per element, float64 [n]; NaN where either side is NaN, inf where one is inf."""
    g, w = _pair(got, want)
    d = (g - w).abs()
    both_same_inf = torch.isinf(g) & (g == w)  # inf - inf is NaN, but equal infinities do not differ
    return torch.where(both_same_inf, torch.zeros_like(d), d)


def max_abs_diff(got: Any, want: Any) -> float:
    """max |got - want|; NaN if any element is NaN on one side only."""
    d = abs_diff(got, want)
    return float(d.max()) if d.numel() else 0.0


def rel_l2(got: Any, want: Any) -> float:
    """||got - want||_2 / ||want||_2 (inf when want is all zeros and got is not, 0 when both are)."""
    g, w = _pair(got, want)
    num, den = torch.linalg.vector_norm(g - w), torch.linalg.vector_norm(w)
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return float(num / den)  # (not from squared sums: those under- or overflow for extreme float64)


def rel_l2_from_sums(sum_sq_err: float, sum_sq_ref: float) -> float:
    """rel_l2 accumulated over pieces: sqrt(sum |got - want|^2 / sum |want|^2), same conventions."""
    if sum_sq_ref == 0:
        return 0.0 if sum_sq_err == 0 else float("inf")
    return math.sqrt(sum_sq_err / sum_sq_ref)


def sq_sums(got: Any, want: Any) -> tuple[float, float]:
    """(sum |got - want|^2, sum |want|^2): the pieces `rel_l2_from_sums` accumulates over chunks. A
    difference that is NaN or inf (one side non-finite) counts as inf, so the accumulated rel_l2 is inf."""
    g, w = _pair(got, want)
    err = abs_diff(g, w).nan_to_num(math.inf)
    return float((err * err).sum()), float((w * w).sum())


def logsumexp(values: Any) -> float:
    """log(sum(exp(v))) in float64 without overflow; -inf for no values (the probability of nothing)."""
    v = _f64(values)
    return float(torch.logsumexp(v, 0)) if v.numel() else -math.inf


def grouped_logsumexp(values: Any, group: Any, n_groups: int) -> torch.Tensor:
    """float64 [n_groups]: logsumexp of `values` [n] over each group (`group` [n]: indices in
    0..n_groups-1), shifted by each group's max so nothing under- or overflows; -inf for an empty group."""
    v, g = _f64(values), _t(group).reshape(-1).long()
    top = torch.full((n_groups,), -math.inf, dtype=torch.float64).scatter_reduce(0, g, v, "amax")
    shift = top.nan_to_num(0.0, neginf=0.0)  # empty (or all -inf) groups: no shift
    sums = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, g, (v - shift[g]).exp())
    return sums.log() + shift


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (ties broken by order; 0 for fewer than 3 points)."""
    n = len(x)
    if n < 3:
        return 0.0

    def ranks(v: list[float]) -> list[int]:
        order = sorted(range(n), key=lambda i: v[i])
        r = [0] * n
        for rank, i in enumerate(order):
            r[i] = rank
        return r

    d2 = sum((a - b) ** 2 for a, b in zip(ranks(x), ranks(y)))
    return 1.0 - 6.0 * d2 / (n * (n * n - 1))


def nmse(got: Any, want: Any) -> float:
    """Normalized mean squared error ||got - want||² / ||want||² (the square of rel_l2)."""
    return rel_l2(got, want) ** 2


def cosine(got: Any, want: Any) -> float:
    """Cosine similarity of the two flattened tensors (1.0 when both are all zeros)."""
    g, w = _pair(got, want)
    ng, nw = torch.linalg.vector_norm(g), torch.linalg.vector_norm(w)
    if ng == 0 and nw == 0:
        return 1.0
    if ng == 0 or nw == 0:
        return 0.0
    return float(torch.dot(g, w) / (ng * nw))


# ----------------------------------------------------------------------------- distributions

def kl_divergence(got: Any, want: Any, *, logprobs: bool = False, dim: int = -1) -> torch.Tensor:
    """KL(P_want || P_got) per distribution (the reference is P), float64 with `dim` reduced.

    Inputs are logits (softmax is applied) or, with `logprobs=True`, log-probabilities. This is the
    direction llama.cpp's `llama-perplexity --kl-divergence` reports: sum_i p_i (log p_i - log q_i).
    """
    g, w = _t(got).to(torch.float64), _t(want).to(torch.float64)
    if not logprobs:
        g, w = torch.log_softmax(g, dim=dim), torch.log_softmax(w, dim=dim)
    p = w.exp()
    terms = torch.where(p > 0, p * (w - g), torch.zeros_like(p))
    return terms.sum(dim=dim)


def top1_agreement(got: Any, want: Any, *, dim: int = -1) -> float:
    """Fraction of distributions whose top-1 agrees (logits or logprobs alike): want's argmax is among
    got's maxima (top1_tied)."""
    agree = top1_tied(got, want, dim=dim)
    return float(agree.to(torch.float64).mean()) if agree.numel() else 1.0


def top1_tied(got: Any, want: Any, *, dim: int = -1) -> torch.Tensor:
    """bool per distribution: got reaches its maximum at want's top-1 token, shared with one other token
    at most. An engine whose two best logits tie (a bfloat16 output often rounds two close logits to one
    value) prefers neither; its argmax names the lower id by convention, which is no preference against
    want's. A maximum shared by more tokens is a flat output (the symptom this tool hunts), not a tie."""
    g, w = _t(got), _t(want)
    top = g.amax(dim=dim, keepdim=True)
    at_top = (g == top).sum(dim=dim, keepdim=True)
    return ((g.gather(dim, w.argmax(dim=dim, keepdim=True)) >= top) & (at_top <= 2)).squeeze(dim)


def top1_margin(got: Any, want: Any, *, dim: int = -1) -> torch.Tensor:
    """float64 per distribution: how much P_want prefers its own top-1 token over got's top-1, in
    log-probability (the logit difference; 0 where the two top-1s agree or got ties them, top1_tied)."""
    w = _t(want).to(torch.float64)
    a, b = w.argmax(dim=dim, keepdim=True), _t(got).argmax(dim=dim, keepdim=True)
    margin = (w.gather(dim, a) - w.gather(dim, b)).squeeze(dim)
    return torch.where(top1_tied(got, want, dim=dim), torch.zeros_like(margin), margin)


def logit_pair_noise(got: Any, want: Any, *, dim: int = -1) -> torch.Tensor:
    """float64 per distribution: the RMS error `got` puts on the difference of two logits of distinct
    tokens drawn uniformly from the vocabulary, sqrt(2·Var_i(δ_i)) with δ = got - want (any shift
    between the two cancels in a difference; the variance is the unbiased one, which makes the pair
    average exact). Tokens where `want` is not finite do not count; a non-finite δ elsewhere makes it
    non-finite. The vocabulary, not P_want, is the population: a logit's error does not depend on its
    probability (through an output projection δ_i = w_i·δh), while a P-weighted variance (the KL's,
    KL = Var_P(δ)/2 to second order) vanishes where P is confident and hides the error on the others."""
    g, w = _t(got).to(torch.float64), _t(want).to(torch.float64)
    keep = torch.isfinite(w)
    if w.shape[dim] > 1 and bool(keep.all()):  # the usual case, in a quarter of the time: no masks
        return (2 * (g - w).var(dim=dim, correction=1)).sqrt()
    delta = torch.where(keep, g - w, torch.zeros_like(w))
    n = keep.sum(dim=dim, keepdim=True)
    mean = delta.sum(dim=dim, keepdim=True) / n.clamp_min(1)
    var = torch.where(keep, (delta - mean) ** 2, torch.zeros_like(w)).sum(dim=dim, keepdim=True) / (n - 1).clamp_min(1)
    return (2 * var).sqrt().squeeze(dim)


# ----------------------------------------------------------------------------- bit-level

def bit_mismatch(got: torch.Tensor, want: torch.Tensor, *, nan_equal: bool = False) -> torch.Tensor:
    """bool [n]: elements whose bit patterns differ (the bit-exact judge). Both must share a float dtype.
    With `nan_equal`, any NaN matches any NaN (payloads and signs may legitimately differ)."""
    if got.dtype != want.dtype or got.dtype not in _INT_VIEW:
        raise ValueError(f"bit comparison needs one float dtype, got {got.dtype} and {want.dtype}")
    iv = _INT_VIEW[got.dtype]
    g, w = got.reshape(-1).contiguous(), want.reshape(-1).contiguous()
    differ = g.view(iv) != w.view(iv)
    return differ & ~(torch.isnan(g) & torch.isnan(w)) if nan_equal else differ


def ulp_distance(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """int64 [n]: number of representable values between got and want in their common float dtype.

    Bit patterns are mapped to a monotonic integer line (negative floats mirrored, so -0 == +0);
    NaN inputs give meaningless distances: screen them with `nonfinite` first.
    """
    if got.dtype != want.dtype or got.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"ulp distance needs one of float32/float16/bfloat16, got {got.dtype}, {want.dtype}")
    iv = _INT_VIEW[got.dtype]
    mag = (1 << (torch.finfo(got.dtype).bits - 1)) - 1

    def line(x: torch.Tensor) -> torch.Tensor:
        b = x.reshape(-1).contiguous().view(iv).to(torch.int64)
        return torch.where(b < 0, -(b & mag), b)

    return (line(got) - line(want)).abs()


def differing_bits(got: torch.Tensor, want: torch.Tensor) -> dict[str, Any]:
    """Summary of the bits that differ between two float32 tensors (as gguf-py's tests report them).

    Returns the number of differing elements, how many of them differ in the sign / exponent /
    mantissa field, a per-bit count (bit 0 = least significant mantissa bit) and the max ulp distance.
    """
    if got.dtype != torch.float32 or want.dtype != torch.float32:
        raise ValueError("differing_bits is defined for float32")
    x = (got.reshape(-1).contiguous().view(torch.int32) ^ want.reshape(-1).contiguous().view(torch.int32))
    diff = x != 0
    x = x[diff].to(torch.int64) & 0xFFFFFFFF
    per_bit = [int(((x >> b) & 1).sum()) for b in range(32)]
    fields = {name: int((((x >> lo) & ((1 << n) - 1)) != 0).sum()) for name, (lo, n) in _FLOAT32_FIELDS.items()}
    ulps = ulp_distance(got.reshape(-1)[diff], want.reshape(-1)[diff])
    return {"elements": int(diff.sum()), **fields, "per_bit": per_bit,
            "max_ulp": int(ulps.max()) if ulps.numel() else 0}


def nonfinite_where_finite(got: Any, want: Any) -> torch.Tensor:
    """bool [n]: got is NaN/inf where want is finite (always a failure, whatever the tolerance)."""
    g, w = _pair(got, want)
    return ~torch.isfinite(g) & torch.isfinite(w)


# ----------------------------------------------------------------------------- budgets

def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p for a p-bit significand: float32 2^-24, float16 2^-11, bfloat16 2^-8."""
    return torch.finfo(dtype).eps / 2


def underflow_unit(dtype: torch.dtype) -> float:
    """η_min: the largest absolute error of one rounding into the subnormal range (half the smallest
    subnormal): float16 2^-25, bfloat16 2^-134, float32 2^-150."""
    fi = torch.finfo(dtype)
    return fi.smallest_normal * fi.eps / 2


def gamma(n: int, u: float) -> float:
    """γ_n = n·u / (1 - n·u): the relative error bound of n compounded roundings (Higham Lemma 3.1)."""
    if n * u >= 1:
        raise ValueError(f"{n} roundings at u={u} have no bound")
    return n * u / (1 - n * u)


def rounding_bound(magnitude: Any, dtype: torch.dtype, roundings: int) -> torch.Tensor:
    """Per-element bound on |computed - exact| after `roundings` roundings in `dtype`, float64 [n].

    `magnitude` is the sum of the absolute values of the terms (e.g. |d·q| + |m|): with every
    intermediate rounded, |err| <= γ_n(u)·magnitude + n·η_min (each rounding may also underflow).
    """
    return gamma(roundings, unit_roundoff(dtype)) * _f64(magnitude).abs() + roundings * underflow_unit(dtype)


def reordered_sum_bound(magnitude: Any, dtype: torch.dtype, roundings: int) -> torch.Tensor:
    """Per-element bound on |a - b| for two evaluations of the same computation in `dtype` that differ
    only in the order of their sums (a tensor-parallel all-reduce against one device), float64 [n].

    Whatever its order, a recursively summed n-term dot product lies within γ_n(u)·Σ|x_k·w_k| of the
    exact value (Higham §3.1, eq. 3.5, and §4.2: the bound holds for any ordering or blocking), so
    two orderings differ by at most twice that. `magnitude` is Σ|terms| (|x| @ |W|^T for a product),
    `roundings` the n of the longest chain of roundings that leads to the value.
    """
    return 2 * rounding_bound(magnitude, dtype, roundings)


def over_budget(got: Any, want: Any, bound: torch.Tensor) -> torch.Tensor:
    """bool [n]: |got - want| > bound, or not comparable (NaN/inf where want is finite, or a NaN on
    one side only). NaN on both sides and equal infinities are within any budget."""
    g, w = _pair(got, want)
    d = abs_diff(g, w)
    return ~(d <= _f64(bound)) & ~(torch.isnan(g) & torch.isnan(w))


# ----------------------------------------------------------------------------- top-k + tail (endpoints)

def topk_tail(got: dict[Any, float], want: dict[Any, float], *, want_complete: bool = False) -> dict[str, Any]:
    """Compare two next-token distributions known through their top-k log-probs (what an HTTP
    endpoint returns), keyed by token id or, where the server gives only text, by token string.

    Each distribution is coarsened onto one partition: the keys listed by both (with
    `want_complete`, every key of `got`: `want` then holds a log-prob for every key, e.g. the
    reference's full distribution grouped by string) plus ONE tail bucket holding the rest of the
    mass, 1 - sum (clamped at 0). Returns, in nats:

    - `kl`: KL(want || got) on that partition. Bias: coarsening can only merge differences away
      (the log-sum inequality), so this is a LOWER bound of the true KL: never a false alarm, and
      a disagreement hidden inside the tail goes unseen. With string keys, tokens whose texts
      collide are merged on one side and possibly overwritten on the other (the server keeps one):
      the caller reports such collisions.
    - `top1_agree`: the two argmaxes (over the listed keys) are the same key. Disjoint top-k sets
      give a small `kl` (both are almost all tail) but a disagreeing top-1: check both.
    - `overlap`: |keys in both| / |keys of got|; `tail_got`, `tail_want`: the tail masses.
    - `entropy_got`: entropy of got's top-k + tail, a lower bound of its true entropy.
    """
    keys = list(got) if want_complete else [k for k in got if k in want]
    g = torch.tensor([got[k] for k in keys], dtype=torch.float64).exp()  # [S]
    w = torch.tensor([want[k] for k in keys], dtype=torch.float64).exp()  # [S]
    tail_g, tail_w = max(0.0, 1.0 - float(g.sum())), max(0.0, 1.0 - float(w.sum()))
    p = torch.cat([w, torch.tensor([tail_w], dtype=torch.float64)])  # want over S + tail
    q = torch.cat([g, torch.tensor([tail_g], dtype=torch.float64)])  # got over S + tail
    tiny = torch.finfo(torch.float64).tiny
    kl = float(torch.where(p > 0, p * (p.log() - q.clamp_min(tiny).log()), torch.zeros_like(p)).sum())
    full_g = torch.tensor(list(got.values()), dtype=torch.float64).exp()
    full_g = torch.cat([full_g, torch.tensor([max(0.0, 1.0 - float(full_g.sum()))], dtype=torch.float64)])
    entropy = float(-(full_g * full_g.clamp_min(tiny).log()).sum())
    return {
        "kl": max(kl, 0.0),
        "top1_agree": bool(got) and bool(want) and max(got, key=got.get) == max(want, key=want.get),
        "overlap": len(keys) / max(len(got), 1),
        "tail_got": tail_g,
        "tail_want": tail_w,
        "entropy_got": entropy,
    }
