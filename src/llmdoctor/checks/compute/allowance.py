"""Allowances from several randomized draws of a healthy engine (issue 35), set for the whole diagnosis.

A healthy engine's result is one more draw of its rounding noise; reference/draws.py makes N independent
draws of it (stochastic rounding wherever the emulation rounds: each draw stands for another machine's
healthy engine). Every judged item (a top-1 flip, a position's KL, a layer point) is compared with the
spread of the *same* item over the draws, and the threshold is set for the whole family of items the
diagnosis judges, so that a healthy engine raises any alarm with probability at most FAMILY_LEVEL whatever
the prompt length (Bonferroni: each of the n items at FAMILY_LEVEL / n).

Two kinds of statistic:

- *signed noise* (a logit pair's error, the square root of a position's KL): z = |x_engine| / s, s the RMS
  of the draws' x about the reference. For Gaussian noise and s from N draws, z is |t| with N degrees of
  freedom (Student), so the threshold is t_N's two-sided quantile at the per-item level. Rounding noise is
  not exactly Gaussian (a pair's error is a sum of a few large roundings; a KL is a quadratic of few
  probable tokens: heavier tails), so the tail is *measured*: each draw is judged against the other N-1
  exactly as the engine is judged against N (leave-one-out ratios, which under the null are |t_{N-1}|), and
  the ratio of their empirical upper quantiles to t_{N-1}'s (at 1 - 10/n_samples and the 99th percentile,
  where the samples say something) scales the threshold up when the draws' own tail is heavier; never down.
- *magnitudes* that pool many elements (a layer point's rel. L2, the mean KL over positions): the draws
  agree on them to a few percent, and what separates a healthy engine from the emulation is its other
  kernels (rounding at other places), not sampling: measured on the demo model in llama.cpp, a healthy
  engine's layer errors are 0.85..1.3x the emulated run's. Threshold K_MODEL = 3 times the draws' RMS, or
  the draws' own log-normal spread at the per-item level (leave-one-out, t_{N-1}) where that is wider.

N_DRAWS = 8: t_8's quantile at 1e-3 / 4096 (two-sided) is 15.9 where t_4's is 70 and t_16's 8.5; eight
draws of the demo model (270M, bfloat16, 200 positions) take about half a minute on 2 cores, within a
diagnosis's budget; 16 would double that for a factor 1.9 in the bound.

Every verdict carries its `ratio` (the worst item's measure over its allowance) and is *marginal* within
MARGINAL (2x) of it either way: the report then says what settles it (a longer prompt: more positions
separate a fault from noise; the engine in another dtype: float32 shrinks the noise ~256x).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .. import metrics

N_DRAWS = 8
MIN_DRAWS = 3  # fewer draws cannot measure a spread (leave-one-out needs two)
FAMILY_LEVEL = 1e-3
K_MODEL = 3.0
MARGINAL = 2.0
TOP_COLUMNS = 8  # the reference's top-8 tokens per position, whose logits every draw keeps
PAIR_FLOOR = 1e-6  # relative to the logits' own spread: float32 round-off, for a bit-exact draw
SETTLE = ("run a longer prompt (more positions separate a fault from noise) or the engine in another dtype "
          "(float32 shrinks the rounding noise)")


# ---- what a draw leaves behind ------------------------------------------------------------------

@dataclass
class DrawSummary:
    """One randomized draw against the float32 reference, without its [T, V] logits."""

    delta: torch.Tensor  # [T, C] float64: draw - reference logits at `cols` (the reference's top tokens first)
    pair_noise: torch.Tensor  # [T]: the draw's vocabulary-averaged pair noise (metrics.logit_pair_noise)
    kl: torch.Tensor  # [T]: KL(reference || draw)
    top1: torch.Tensor  # [T] long: the draw's own top-1
    finite: torch.Tensor  # [T] bool: every logit finite where the reference's is
    points: dict[str, float] = field(default_factory=dict)  # capture name -> rel_l2(draw, reference)

    def rows(self, sl: slice) -> "DrawSummary":
        """The summary of positions `sl` only (no layer points)."""
        return DrawSummary(self.delta[sl], self.pair_noise[sl], self.kl[sl], self.top1[sl], self.finite[sl])


def columns(ref: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """long [T, C]: the reference's TOP_COLUMNS best tokens per position, then each of `others`' top-1
    (the engine's): the tokens whose logit errors a draw keeps. ref, others: logits [T, V]. Draws made before
    an engine's logits are known (another configuration's run of the same tokens) keep the reference's alone."""
    k = min(TOP_COLUMNS, ref.shape[-1])
    cols = [torch.as_tensor(ref).topk(k, dim=-1).indices]
    cols += [torch.as_tensor(o).argmax(-1, keepdim=True) for o in others]
    return torch.cat(cols, -1)


def summarize(logits: Any, captures: Mapping[str, Any], ref: Any, ref_caps: Mapping[str, Any],
              cols: torch.Tensor, chunk: int = 256) -> DrawSummary:
    """A draw's logits [T, V] and captures against the reference's, kept as DrawSummary (positions in chunks
    of `chunk`: float64 over [T, V] at once would not fit long prompts)."""
    parts: list[tuple] = []
    got_all, want_all = torch.as_tensor(logits), torch.as_tensor(ref)
    for a in range(0, got_all.shape[0], chunk):
        got, want = got_all[a:a + chunk], want_all[a:a + chunk]  # [t, V], their own dtype
        top1, fin = got.argmax(-1), (torch.isfinite(got) | ~torch.isfinite(want)).all(-1)  # exact before float64
        got, want, c = got.to(torch.float64), want.to(torch.float64), cols[a:a + chunk]
        parts.append(((got.gather(-1, c) - want.gather(-1, c)), metrics.logit_pair_noise(got, want),
                      metrics.kl_divergence(got, want), top1, fin))
    delta, pn, kl, top1, fin = (torch.cat(x) for x in zip(*parts))
    points = {n: metrics.rel_l2(captures[n], ref_caps[n]) for n in ref_caps if n in captures}
    return DrawSummary(delta, pn, kl, top1, fin, points)


# ---- the tail model -----------------------------------------------------------------------------

def t_sf(x: float, nu: int) -> float:
    """P(T > x) for Student's t with an integer nu >= 1 degrees of freedom (x >= 0): A&S 26.7.3-4, a finite
    series in cos^2 of theta = atan(x / sqrt(nu)) for A = P(|T| < x)."""
    theta = math.atan(x / math.sqrt(nu))
    c2 = math.cos(theta) ** 2
    term = total = 1.0
    if nu % 2 == 0:  # A = sin(theta) (1 + 1/2 c2 + 1*3/(2*4) c2^2 + ... up to c2^((nu-2)/2))
        for k in range(1, nu // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        a = math.sin(theta) * total
    else:  # A = 2/pi (theta + sin cos (1 + 2/3 c2 + 2*4/(3*5) c2^2 + ... up to c2^((nu-3)/2))), nu > 1
        for k in range(1, (nu - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        a = 2 / math.pi * (theta + (math.sin(theta) * math.cos(theta) * total if nu > 1 else 0.0))
    return (1 - a) / 2


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, nu: int) -> float:
    """x with P(T > x) = p (0 < p < 1/2), by bisection on log x."""
    lo, hi = 0.0, 12.0  # log x
    while t_sf(math.exp(hi), nu) > p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_sf(math.exp(mid), nu) > p else (lo, mid)
    return math.exp(hi)


def loo_scale(sq: torch.Tensor) -> torch.Tensor:
    """sq [N, ...]: each draw's squared measure -> [N, ...]: the RMS of the other N - 1 (leave one out)."""
    n = sq.shape[0]
    return ((sq.sum(0, keepdim=True) - sq) / (n - 1)).sqrt()


def tail_inflation(null: torch.Tensor, nu: int) -> float:
    """How much heavier the draws' leave-one-out ratios `null` (any shape; |t_nu| under Gaussian noise) are
    than |t_nu| in their upper tail: the largest ratio of empirical to t quantiles at the 99th percentile and
    at 1 - 10/n (where at least 10 samples lie beyond), floored at 1."""
    r = null[torch.isfinite(null)].flatten().double()
    n = r.numel()
    worst = 1.0
    for q in (0.99, 1 - 10 / n if n else 1.0):
        if n < 100 or not 0.5 < q < 1:
            continue
        emp = float(torch.quantile(r, q)) if n <= 16_000_000 else float(r.sort().values[int(q * n)])
        worst = max(worst, emp / t_quantile((1 - q) / 2, nu))
    return worst


@dataclass
class Allowance:
    """The threshold of one criterion's items, and how it was set (for the report and the JSON)."""

    threshold: float  # in units of the item's own draw spread
    items: int  # the criterion's items in the family
    level: float  # per-item false-alarm level (FAMILY_LEVEL / all items of the diagnosis)
    draws: int
    inflation: float = 1.0  # measured tail heaviness (signed) or 1
    model: float = 1.0  # K_MODEL where it governs (magnitudes)

    def as_dict(self) -> dict:
        return {"threshold": self.threshold, "items": self.items, "per_item_level": self.level,
                "draws": self.draws, "tail_inflation": self.inflation, "model_factor": self.model}


def signed_allowance(null: torch.Tensor, items: int, family: int, draws: int) -> Allowance:
    """z threshold for `items` signed statistics judged against the RMS of `draws` draws; `null`: the draws'
    leave-one-out ratios of the same statistic."""
    level = FAMILY_LEVEL / max(family, 1)
    infl = tail_inflation(null, draws - 1)
    return Allowance(infl * t_quantile(level / 2, draws), items, level, draws, inflation=infl)


def magnitude_allowance(null: torch.Tensor, items: int, family: int, draws: int) -> Allowance:
    """Multiplier of the draws' RMS for `items` pooled magnitudes (a layer point's rel. L2, the mean KL):
    K_MODEL, or the leave-one-out log-ratios' spread (`null` [N, M] or [N]) at the per-item level where wider."""
    level = FAMILY_LEVEL / max(family, 1)
    logs = torch.log(null[torch.isfinite(null) & (null > 0)].double())
    spread = float(logs.std()) if logs.numel() > 1 else 0.0
    stat = math.exp(abs(float(logs.mean())) + t_quantile(level, max(draws - 1, 1)) * spread * math.sqrt(1 + 1 / draws)) \
        if logs.numel() > 1 else 1.0
    return Allowance(max(K_MODEL, stat), items, level, draws, model=K_MODEL if K_MODEL >= stat else 1.0)


def poisson_allowance(lam: float, level: float) -> int:
    """The smallest count a with P(Poisson(lam) > a) <= level."""
    a, term = 0, math.exp(-lam)
    cdf = term
    while 1.0 - cdf > level and a < 10_000_000:
        a += 1
        term *= lam / a
        cdf += term
    return a


def poisson_upper(count: int, level: float) -> float:
    """The exact (Garwood) upper confidence bound on a Poisson mean from one observed `count`: the mean m with
    P(Poisson(m) <= count) = level, by bisection."""
    def cdf(m: float) -> float:
        term = total = math.exp(-m)
        for a in range(1, count + 1):
            term *= m / a
            total += term
        return total

    lo, hi = 0.0, float(count) + 10.0
    while cdf(hi) > level:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) > level else (lo, mid)
    return hi


@dataclass
class UnseenChoices:
    """How many items a healthy engine may have beyond their threshold where it makes discrete choices (MoE
    experts, DSA keys) that no run can replay (an engine that exposes none: vLLM under torch.compile and CUDA
    graphs). Each run then takes its own near-ties, and one taken the other way moves that position far beyond
    the arithmetic's spread there: a rare event per position, so the number of such positions, not any one of
    them, is the statistic. The draws, each judged against the others (leave one out) at the same threshold,
    have `seen` beyond it in all; the healthy rate per run is at most `rate` (Poisson upper bound at confidence
    1 - level/2 from `seen` over `draws`) and the engine may have `allowed` (Poisson(rate)'s count exceeded with
    probability level/2). Positions beyond their threshold are rare independent events, whose count is less
    dispersed than Poisson's (a Poisson-binomial), so the bound holds whatever each position's own chance."""

    allowed: int
    seen: int
    draws: int
    rate: float
    level: float

    def as_dict(self) -> dict:
        return {"allowed": self.allowed, "seen_in_draws": self.seen, "draws": self.draws, "rate_upper": self.rate,
                "level": self.level}

    def words(self) -> str:
        return (f"the engine's discrete choices are unseen (it exposes none to replay; near-tie experts or keys may "
                f"go either way): a healthy engine has up to {self.allowed} such positions (its draws, each against "
                f"the others, have {self.seen} in {self.draws})")


def unseen_choices(null_beyond: torch.Tensor, level: float) -> UnseenChoices:
    """null_beyond: bool [N, T], each draw's items beyond the threshold against the other draws; `level`: the
    criterion's false-alarm share (split between the rate's bound and the count's tail)."""
    n, seen = int(null_beyond.shape[0]), int(null_beyond.sum())
    rate = poisson_upper(seen, level / 2) / max(n, 1)
    return UnseenChoices(poisson_allowance(rate, level / 2), seen, n, rate, level)


def marginal(ratio: float) -> bool:
    """A verdict within MARGINAL of its allowance either way (a non-finite ratio is never marginal)."""
    return math.isfinite(ratio) and 1 / MARGINAL < ratio < MARGINAL


def times(ratio: float) -> str:
    """'3.2x its allowance' / 'at 0.41 of its allowance', and 'marginal: ...' near the edge."""
    if not math.isfinite(ratio):
        return "not finite"
    words = f"{ratio:.3g}x its allowance" if ratio > 1 else f"at {ratio:.2g} of its allowance"
    return words + (f" (marginal: {SETTLE})" if marginal(ratio) else "")
