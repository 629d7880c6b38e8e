"""Whether an fp8 KV cache's per-tensor scales fit the values they scale (issue 34, item 2).

An e4m3 cache stores x / scale: beyond +-448 the value saturates (vLLM's CUDA and CPU cache writes both
clamp), below e4m3's smallest subnormal (2^-9; half of it when rounding to nearest) it is stored as 0, and
between 2^-9 and 2^-6 it keeps fewer than e4m3's 3 mantissa bits. A healthy scale (calibrated amax / 448, or
1.0 for activations of order one) leaves K and V inside the normal range; a wrong one (a checkpoint's k_scale
off by 1000x, a scale lost and defaulted) clips or zeroes a layer's keys or values, and an emulated run
that uses the same scale reproduces the damage, so engine-vs-reference alone would call it noise. This
check judges each layer's scales against the reference's own K (after RoPE, as the cache stores it) and V.

The criterion, derived: inside e4m3's normal range the round trip loses less than one quantum, a relative
error below 2^-3 rounding toward zero (vLLM for CPU) and at most 2^-4 rounding to nearest (CUDA), for every
value and hence for the relative L2 error of the whole tensor. A round trip whose relative L2 error reaches
that bound has lost more than e4m3's resolution explains: to saturation or to the subnormal and zero
range. The finding names the layer's k_scale or v_scale, the share of values saturated or zeroed, and the
scale that maps the layer's largest |value| to 448 (the factor it is off by).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ...reference.emulate import E4M3_MAX, E4M3_TINY, e4m3
from ..base import Finding

HYPOTHESIS = "the fp8 KV cache's scales keep K and V inside e4m3's range"
E4M3_NORMAL = 2.0 ** -6  # e4m3's smallest normal: below it fewer than 3 mantissa bits remain
RESOLUTION = {"rz": 2.0 ** -3, "rne": 2.0 ** -4}  # the worst relative error of a normal value's round trip


@dataclass(frozen=True)
class ScaleFit:
    layer: int
    which: str  # "k_scale" | "v_scale"
    scale: float
    amax: float  # the largest |value| of the reference's tensor
    saturated: float  # share of values with |x| / scale beyond 448
    zeroed: float  # share of nonzero values the cache stores as 0
    subnormal: float  # share of nonzero values in e4m3's subnormal range (fewer than 3 mantissa bits)
    rel_l2: float  # the round trip's relative L2 error with this scale
    limit: float  # the resolution bound (the module docstring)

    @property
    def fits(self) -> bool:
        return self.rel_l2 < self.limit

    @property
    def ideal(self) -> float:
        """The scale that maps the largest |value| to 448."""
        return self.amax / E4M3_MAX

    def words(self) -> str:
        name = f"layer {self.layer}'s {self.which} {self.scale:g}"
        off = self.scale / self.ideal if self.ideal > 0 else float("inf")
        parts = []
        if self.saturated:
            parts.append(f"{self.saturated:.1%} of its values beyond 448 x scale (saturated)")
        if self.zeroed:
            parts.append(f"{self.zeroed:.1%} stored as 0")
        if self.subnormal:
            parts.append(f"{self.subnormal:.1%} with fewer than 3 mantissa bits")
        what = ", ".join(parts) or "every value inside e4m3's normal range"
        return (f"{name}: {what}; round trip off by {self.rel_l2:.3g} (relative L2; e4m3's own resolution "
                f"{self.limit:g}); the largest |value| {self.amax:.3g} needs about {self.ideal:.3g} "
                f"({'%.3g' % off}x {'too large' if off > 1 else 'too small'})")


def fit(x: torch.Tensor, scale: float, rounding: str, *, layer: int, which: str) -> ScaleFit:
    """How the values x (any shape) fare in an e4m3 cache with per-tensor `scale` rounded as `rounding`."""
    xf = x.double().reshape(-1)
    a = (xf / scale).abs()
    nonzero = xf != 0
    back = e4m3(x.float(), scale, rounding).double().reshape(-1)
    n, nz = max(xf.numel(), 1), max(int(nonzero.sum()), 1)
    tiny = E4M3_TINY if rounding == "rz" else E4M3_TINY / 2
    norm = float(xf.norm())
    return ScaleFit(layer, which, float(scale), float(xf.abs().max()) if xf.numel() else 0.0,
                    saturated=float((a > E4M3_MAX).sum()) / n,
                    zeroed=float((nonzero & (back == 0)).sum()) / nz,
                    subnormal=float((nonzero & (a < E4M3_NORMAL) & (a >= tiny)).sum()) / nz,
                    rel_l2=float((back - xf).norm()) / norm if norm > 0 else 0.0, limit=RESOLUTION[rounding])


def finding(engine: str, fits: list[ScaleFit], words: str) -> Finding:
    """One finding over every layer's scales: fail naming the scales that do not fit (worst first), else pass
    with the closest to its bound. `words`: the KV cache as the engine's noise budget describes it."""
    bad = sorted((f for f in fits if not f.fits), key=lambda f: f.limit - f.rel_l2)
    worst = max(fits, key=lambda f: f.rel_l2 / f.limit)
    metrics = {"scales_judged": len(fits), "scales_failing": len(bad),
               "worst": {"layer": worst.layer, "scale": worst.which, "value": worst.scale,
                         "rel_l2": worst.rel_l2, "limit": worst.limit, "ideal": worst.ideal}}
    evidence = [{**asdict(f), "ideal": f.ideal, "fits": f.fits} for f in (bad or fits)[:16]]
    if bad:
        named = ", ".join(f"layer {f.layer} {f.which}" for f in bad[:6]) + (" ..." if len(bad) > 6 else "")
        return Finding("kv-scales", engine, named, "fail", hypothesis=HYPOTHESIS, confidence="high", metrics=metrics,
                       budget={"rel_l2_limit": worst.limit, "cache": words}, evidence=evidence,
                       explanation="the fp8 KV cache's scales lose K/V beyond e4m3's resolution: "
                                   + "; ".join(f.words() for f in bad[:3]))
    return Finding("kv-scales", engine, "fp8 KV cache scales", "pass", hypothesis=HYPOTHESIS, metrics=metrics,
                   budget={"rel_l2_limit": worst.limit, "cache": words}, evidence=evidence,
                   explanation=f"all {len(fits)} k/v scales keep the reference's K and V within e4m3's resolution; "
                               f"closest: {worst.words()}")
