"""Randomized rounding: independent draws of a healthy engine's arithmetic (issue 35).

The emulated run (reference/emulate.py) rounds where the engine rounds, to nearest: one draw of the engine's
rounding noise. A healthy engine on another machine rounds at the same places but from slightly different
values (other summation orders, other fused kernels, an activation that differs upstream by one ulp), so
*which way* each value rounds is, for the comparison, a coin whose bias is where the exact value lies
between its two neighbours. Stochastic rounding (SR) is exactly that coin: a value x between grid points
lo < x < hi becomes hi with probability (x - lo) / (hi - lo), lo otherwise; unbiased, independent per
element and per draw (seeded: a draw is reproducible). Its error variance is p(1-p) ulp^2, ulp^2/6 on
average over p, twice round-to-nearest's ulp^2/12: a draw is as noisy as an engine that rounds at up to
twice as many places as the emulation (an unfused kernel rounds its intermediates), never less noisy than
one that rounds where the emulation does. That is the conservative side for an allowance.

Where a draw rounds (`randomized`):

- every aten op whose result is a floating tensor of a *randomized dtype* is computed in the next wider
  dtype from the same inputs (bfloat16 / float16 / FP8 -> float32, float32 -> float64) and rounded
  stochastically to its own dtype (torch's CPU kernels compute half-precision ops in float32 and round
  once; this rounds the same value at random). The randomized dtypes are the run's own half precision, the
  emulation's casts (F16 KV cache, FP8 indexer) and, for a float32 engine (whose budget is float64), float32.
- the emulation's integer roundings (Q8 activations' q = round(x / d), TF32's mantissa): emulate.py asks
  `random_integer` while a draw runs.

Data movement (views, gathers, concatenation) rounds nothing and is left alone, as are in-place ops (the
reference's forward pass has none on its activations' path) and ops without tensor inputs (factories).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

aten = torch.ops.aten
_GENERATOR: ContextVar["Generators | None"] = ContextVar("llmdoctor_draw", default=None)

FP8 = tuple(d for d in (getattr(torch, n, None) for n in ("float8_e4m3fn", "float8_e5m2")) if d is not None)
HALF = (torch.bfloat16, torch.float16, *FP8)
# pure data movement: the result holds input values, nothing to round (and an embedding table stays unwidened)
_EXACT = {aten.embedding.default, aten.index.Tensor, aten.index_select.default, aten.gather.default,
          aten.cat.default, aten.stack.default, aten.clone.default, aten.where.self, aten.masked_fill.Scalar,
          aten.constant_pad_nd.default, aten.topk.default, aten.sort.default, aten.max.dim, aten.amax.default,
          aten.argmax.default, aten._unsafe_view.default, aten.copy.default, aten.lift_fresh.default}


def _wider(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float32 else torch.float32


class Generators:
    """One draw's random generators, one per device its tensors lie on (a generator draws on its own device
    only; a draw on a GPU still makes small tensors on the CPU), each seeded with the draw's seed."""

    def __init__(self, seed: int) -> None:
        self.seed, self._by_device = seed, {}

    def on(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._by_device:
            self._by_device[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._by_device[key]


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator | None = None) -> torch.Tensor:
    """x (a wider float dtype) rounded to `dtype` stochastically: to the grid neighbour above with probability
    (x - lo) / (hi - lo). From y = round-to-nearest(x): r = x - y (exact: y is x's neighbour), the other
    neighbour is y + sign(r) * step, where step is y's ulp (finfo: 2^(e-1) * eps for y = m 2^e, m in [0.5, 1);
    subnormals the smallest normal's), halved when y is a power of two and r points toward zero (the binade
    below is finer). Non-finite values and exact ones pass unchanged; a step past the largest finite stays."""
    info = torch.finfo(dtype)
    y = x.to(dtype)
    yw = y.to(x.dtype)
    r = x - yw  # [...]: exact (Sterbenz)
    m, e = torch.frexp(yw)
    tiny = info.smallest_normal * info.eps
    step = torch.clamp(torch.ldexp(torch.full_like(yw, info.eps / 2), e), min=tiny)
    toward_zero = (torch.sign(r) != torch.sign(yw)) & (yw != 0)
    step = torch.where(toward_zero & (m.abs() == 0.5), torch.clamp(step / 2, min=tiny), step)
    other = yw + torch.sign(r) * step
    take = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device) * step < r.abs()
    take = take & torch.isfinite(x) & (other.abs() <= info.max)
    return torch.where(take, other, yw).to(dtype)


def random_integer(x: torch.Tensor) -> torch.Tensor | None:
    """floor(x + U[0, 1)) while a draw runs (x rounded to an integer stochastically), else None: the
    emulation's integer roundings (Q8 quants, TF32 mantissas) ask this first."""
    g = _GENERATOR.get()
    if g is None:
        return None
    return torch.floor(x + torch.rand(x.shape, generator=g.on(x.device), dtype=x.dtype, device=x.device))


class _RandomRounding(TorchDispatchMode):
    """Every op with a result in one of `dtypes`: computed one dtype wider, rounded stochastically back."""

    def __init__(self, generators: Generators, dtypes: frozenset[torch.dtype]):
        super().__init__()
        self.generators, self.dtypes = generators, dtypes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _EXACT or func.is_view or func._schema.is_mutable:
            return func(*args, **kwargs)
        target = kwargs.get("dtype")
        tensors = [a for a in _flat(args) if isinstance(a, torch.Tensor)]
        if not tensors:
            return func(*args, **kwargs)  # factories (rand, arange, full): nothing computed to round
        if target is None:
            floats = [t.dtype for t in tensors if t.is_floating_point() and t.dim() > 0] or \
                     [t.dtype for t in tensors if t.is_floating_point()]
            if not floats:
                return func(*args, **kwargs)
            target = floats[0]
            for d in floats[1:]:
                target = torch.promote_types(target, d)
        if target not in self.dtypes:
            return func(*args, **kwargs)
        wide = _wider(target)

        def up(a):
            return a.to(wide) if isinstance(a, torch.Tensor) and a.dtype in self.dtypes else a

        kw = {k: (wide if k == "dtype" else up(v)) for k, v in kwargs.items()} if "dtype" in kwargs else tree_map(up, kwargs)
        out = func(*tree_map(up, args), **kw)
        return tree_map(lambda o: stochastic_round(o, target, self.generators.on(o.device))
                        if isinstance(o, torch.Tensor) and o.dtype == wide else o, out)


def _flat(args) -> list:
    out = []
    for a in args:
        out.extend(_flat(a) if isinstance(a, (list, tuple)) else [a])
    return out


def draw_dtypes(float32: bool) -> frozenset[torch.dtype]:
    """The dtypes a draw rounds stochastically: the half precisions and FP8 (the run's own, or an emulated
    cast's), and float32 when the engine is a float32 one (its noise is float32's rounding)."""
    return frozenset(HALF) | ({torch.float32} if float32 else frozenset())


@contextmanager
def randomized(seed: int, dtypes: frozenset[torch.dtype]) -> Iterator[None]:
    """One draw: every op and emulated rounding inside the block rounds stochastically (seeded by `seed`, on
    whichever device each tensor lies)."""
    g = Generators(seed)
    token = _GENERATOR.set(g)
    try:
        with _RandomRounding(g, dtypes):
            yield
    finally:
        _GENERATOR.reset(token)
