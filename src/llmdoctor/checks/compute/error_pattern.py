"""How an engine's error at its first divergent op is spread over positions, heads and channels, read as
a cause, as check attention reads a kernel's error pattern (issue 22).

Every slice (a position, a head, a channel) is judged like a whole point (checks/compute/layers.py): its error
rel_l2(engine, ref) against K x the emulated run's error on that same slice plus the float32 floor. The
pattern of the slices beyond their noise names a class of cause:

    position   right at position 0, wrong after it: RoPE rotates position 0 by angle 0, so only the
               rotary angle or the positions themselves (rope base, scaling, position ids) spare it
    heads      some heads right at every position, others wrong: a head layout (head order, GQA grouping)
               or one head's weights
    channels   only some channels wrong: the rotary channels alone (the RoPE pair layout or frequencies),
               one half of every head, or a minority of channels (most channels wrong with no such layout is
               read as everywhere)
    everywhere every position wrong, position 0 included, every head: a weight or the op's input, not
               a position-dependent step

At a point right after RoPE (q and k: Qcur/Kcur, MLA's q_pe/k_pe) the rotary pattern (position 0 right and
later positions wrong, or the rotary channels alone wrong) is named as a RoPE fault, and an experiment says
which rotary variant the engine computed (`rope_variant`): the reference's output is rotated back to its
input and rotated again another way (the pairs by halves instead of interleaved or the reverse, no
rotation, the opposite direction, positions one off throughout or from the first wrong position on, the
engine's own frequencies measured pair by pair);
a variant the engine agrees with within the point's own limit is the cause, said in words.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .. import metrics
from .layers import FLOOR, K


# How the rotary pairs are taken (reference/attention.py apply_rope's `neox`), in words.
PAIRING = {True: "by halves (i, i + d/2)", False: "interleaved (2i, 2i + 1)"}


@dataclass(frozen=True)
class Rope:
    """The reference's rotary embedding at a capture point (reference/attention.py apply_rope): channels
    [start, start + dim) of every head rotate, paired by halves (i, i + dim/2; neox) or interleaved (2i,
    2i + 1), by the angle positions x inv_freq, times `attn_factor` (YaRN's magnitude; 1 without)."""

    dim: int
    neox: bool
    inv_freq: np.ndarray  # [dim/2] radians per position of each pair (freq factors, YaRN included)
    positions: np.ndarray  # [T]
    start: int = 0
    attn_factor: float = 1.0
    base: float | None = None  # the reference's rope base, for the words
    # inv_freq under another base, as the reference computes it (YaRN's ramp depends on the base); None: the
    # reference's own factors per pair kept beside base^(-2j/d)
    inv_for: Callable[[float], np.ndarray] | None = None

    def inv_freq_for(self, base: float) -> np.ndarray:
        if self.inv_for is not None:
            return np.asarray(self.inv_for(base), dtype=np.float64)
        return self.inv_freq * (self.base / base) ** (2 * np.arange(len(self.inv_freq)) / self.dim)



@dataclass
class Pattern:
    kind: str  # position | heads | channels | everywhere | none
    words: str
    cause: str = ""  # the cause in a user's words, when the pattern names one (a RoPE fault); else ""
    rope: dict | None = None  # the RoPE experiment (rope_variant), where one ran
    wrong_positions: list[int] = field(default_factory=list)
    wrong_heads: list[int] = field(default_factory=list)
    wrong_channels: list[int] = field(default_factory=list)
    worst: dict[str, float] = field(default_factory=dict)  # the worst slice error / its limit, per axis

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "words": self.words, "cause": self.cause, "rope": self.rope,
                "wrong_positions": self.wrong_positions[:16],
                "wrong_heads": self.wrong_heads[:16], "wrong_channels": _ranges(self.wrong_channels),
                "worst": self.worst}


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x != start else f"{x}")
            start = None
    return ", ".join(out)


def _halves_of(d: int) -> tuple[set[int], set[int]]:
    """The first and the second half of a head's d channels."""
    return set(range(d // 2)), set(range(d // 2, d))


def _wrong(engine: np.ndarray, ref: np.ndarray, emu: np.ndarray, axis: int) -> tuple[list[int], float]:
    """(indices along `axis` whose slice is beyond its own noise, the worst slice's error / limit)."""
    bad, worst = [], 0.0
    for i in range(ref.shape[axis]):
        e, r, n = (np.take(x, i, axis=axis) for x in (engine, ref, emu))
        err, limit = metrics.rel_l2(e, r), K * metrics.rel_l2(n, r) + FLOOR
        if not (np.isfinite(err) and err <= limit):
            bad.append(i)
        worst = max(worst, err / limit if np.isfinite(err) else np.inf)
    return bad, float(worst)


def error_pattern(engine: Any, ref: Any, emu: Any, *, rope_dim: int | None = None, rope: Rope | None = None,
                  point: str = "") -> Pattern:
    """The spread of the engine's error at one capture point `point`. engine, ref, emu: [T, H, D] or [T, C]
    (the reference's layout); `rope_dim`: the rotated channels of each head, first in the head, when the
    point is after RoPE; `rope`: the reference's RoPE there in full (its channels, pairing and angles), which
    also runs the experiment of `rope_variant` when the pattern is RoPE's."""
    # a torch tensor through .double() first: bfloat16 has no numpy dtype (a bf16 engine's captures)
    x_e, x_r, x_n = (np.asarray(x.double() if hasattr(x, "double") else x, dtype=np.float64)
                     for x in (engine, ref, emu))
    if x_r.ndim == 2:
        x_r = x_r[:, None, :]  # [T, 1, C]
    # an engine's [T, 1, C] where the reference has [T, C] (vLLM's MLA k_pe): the reference's layout
    x_e, x_n = (x.reshape(x_r.shape) if x.size == x_r.size else x for x in (x_e, x_n))
    pos, w_pos = _wrong(x_e, x_r, x_n, 0)
    heads, w_head = _wrong(x_e, x_r, x_n, 1)
    chans, w_chan = _wrong(x_e, x_r, x_n, 2)
    t_n, h_n, d_n = x_r.shape
    p = Pattern("none", "no slice beyond its noise", "", None, pos, heads, chans,
                {"position": w_pos, "head": w_head, "channel": w_chan})
    if not pos:
        return p
    start, dim = (rope.start, rope.dim) if rope is not None else (0, rope_dim or 0)
    rotary = set(range(start, start + dim))
    rope_only = bool(dim and dim < d_n and chans and set(chans) <= rotary)
    span = f"{start}-{start + dim - 1}"
    if 0 not in pos and t_n > 1:
        p.kind = "position"
        p.words = (f"right at position 0, wrong from position {pos[0]} ({len(pos)} of {t_n - 1} later positions): "
                   "the rotary angle or the positions (RoPE leaves position 0 unrotated)"
                   + (f"; only the rotary channels {span} of each head" if rope_only else ""))
    elif h_n > 1 and len(heads) < h_n:
        p.kind = "heads"
        p.words = (f"heads {_ranges(heads)} wrong at every position, the other {h_n - len(heads)} right: a head layout "
                   "(head order, GQA grouping) or those heads' weights")
    elif len(chans) < d_n and (rope_only or set(chans) in _halves_of(d_n) or len(chans) <= d_n // 2):
        if rope_only:
            where = "the rotary channels only: the RoPE pair layout or its frequencies"
        elif set(chans) in _halves_of(d_n):
            where = "one half of every head: a split or concatenation order (e.g. nope/rope parts, halves of RoPE pairs)"
        else:
            where = "some channels only: a channel layout"
        p.kind, p.words = "channels", f"channels {_ranges(chans)} of {d_n} wrong, the others right: {where}"
    else:
        p.kind = "everywhere"  # most channels wrong with no layout among them is no channel pattern either
        where = "every channel" if len(chans) == d_n else f"{len(chans)} of {d_n} channels (the rest within their noise)"
        p.words = (f"every position wrong, position 0 included, in every head and {where}: a weight or the op's "
                   "input, not a position-dependent step")
    if rope is not None:  # the experiment runs on any pattern; a variant that reproduces the engine is the cause
        p.rope = rope_variant(x_e, x_r, x_n, rope, first_wrong=pos[0] if p.kind == "position" else None)
        found = p.rope["agrees"]
        rotary = p.kind == "position" and (rope_only or dim == d_n) or p.kind == "channels" and rope_only
        if found:
            p.cause = (f"RoPE applied wrongly to {point or 'this point'}: {found['words']}, the engine agrees "
                       f"(rel. L2 {found['error']:.3g}, its limit {p.rope['limit']:.3g}; as the reference "
                       f"rotates, {p.rope['error']:.3g})")
        elif rotary:
            p.cause = (f"RoPE applied wrongly to {point or 'this point'}: {p.words}; none of the rotary variants "
                       "tried reproduces it (the other pairing, no rotation, the opposite direction, positions one "
                       "off, from the first wrong one or throughout, the engine's own turn per pair measured)")
    return p


# ---- the RoPE experiment --------------------------------------------------------------------------------------

def _halves(x: np.ndarray, neox: bool) -> tuple[np.ndarray, np.ndarray]:
    """The two members of every rotary pair of x [..., d]: (i, i + d/2) by halves, (2i, 2i + 1) interleaved."""
    n = x.shape[-1] // 2
    return (x[..., :n], x[..., n:]) if neox else (x[..., 0::2], x[..., 1::2])


def _rotate(x: np.ndarray, ang: np.ndarray, neox: bool, scale: float = 1.0) -> np.ndarray:
    """x [T, H, d] with each pair turned by ang [T, d/2] and scaled by `scale` (apply_rope's convention)."""
    c, s = scale * np.cos(ang)[:, None, :], scale * np.sin(ang)[:, None, :]  # [T, 1, d/2]
    a, b = _halves(x, neox)
    out = np.empty_like(x)
    ra, rb = _halves(out, neox)
    ra[...], rb[...] = a * c - b * s, a * s + b * c
    return out


def _turn_per_position(engine: np.ndarray, x: np.ndarray, rope: Rope) -> np.ndarray:
    """[d/2]: how far the engine turned each pair per position, measured: the phase of the engine's pair
    against the un-rotated input's (summed over heads), unwrapped along the positions (any rope base turns
    a pair by less than pi per position) and fitted through position 0."""
    (ea, eb), (xa, xb) = _halves(engine, rope.neox), _halves(x, rope.neox)
    phase = np.angle(((ea + 1j * eb) * (xa - 1j * xb)).sum(axis=1))  # [T, d/2]
    order = np.argsort(rope.positions, kind="stable")
    pos = rope.positions[order].astype(np.float64)
    turned = np.unwrap(phase[order], axis=0)
    return (pos[:, None] * turned).sum(axis=0) / max(float((pos * pos).sum()), 1.0)


def _base_fit(w: np.ndarray, rope: Rope) -> float | None:
    """The rope base whose frequencies base^(-2j/d) (with the reference's own factors per pair) best fit the
    measured turns w [d/2], or None when too few pairs turn forwards. Least squares on log w, each pair
    weighted by its turn: a turn is measured to about the same absolute precision whatever its size, so
    log w of a slow pair is the least certain."""
    j = np.arange(len(w), dtype=np.float64)
    u = 2 * j / rope.dim
    own = rope.inv_freq * (rope.base ** u if rope.base else 1.0)  # the reference's factors beside its base
    ok = (w > 0) & (own > 0)
    if ok.sum() < 2 or not rope.base:
        return None
    slope = np.polyfit(u[ok], np.log(w[ok] / own[ok]), 1, w=w[ok])[0]
    return float(np.exp(-slope))


# Rope bases models ship (llama-2 / most 1e4, llama-3 5e5, qwen / gemma's global 1e6, ...), tried beside the fit.
COMMON_BASES = (1e4, 5e4, 1e5, 5e5, 1e6, 1e7)


def rope_variant(engine: np.ndarray, ref: np.ndarray, emu: np.ndarray, rope: Rope,
                 first_wrong: int | None = None) -> dict[str, Any]:
    """Which rotary variant of the reference's own input the engine computed at a point after RoPE. The
    reference's rotary channels are rotated back to their input x (the reference's own pairing and angles),
    then each variant rotates x again; the point with those channels is judged like the point itself (rel_l2
    against K x the emulated run's error + FLOOR). engine, ref, emu: float64 [T, H, D]; `first_wrong`: the first
    wrong position where earlier ones are right (the positions shifted from there on are tried too). Returns {"error",
    "limit" (the point as the reference rotates it), "tried" (the variants' words), "agrees" (None, or the
    first variant within the limit: {"variant", "words", "error", ...})}."""
    lo, hi = rope.start, rope.start + rope.dim
    ang = rope.positions.astype(np.float64)[:, None] * rope.inv_freq[None, :]  # [T, d/2]
    a = rope.attn_factor
    x = _rotate(ref[..., lo:hi], -ang, rope.neox, 1.0 / a)  # [T, H, d]: the input of the reference's RoPE
    limit = K * metrics.rel_l2(emu, ref) + FLOOR
    variants = [
        ("pairing", f"with the rotary pairs taken {PAIRING[not rope.neox]} instead of {PAIRING[rope.neox]}",
         lambda: _rotate(x, ang, not rope.neox, a)),
        ("unrotated", "with no rotation at all (RoPE not applied)", lambda: x),
        ("reversed", "with every pair turned the opposite way (the sine's sign flipped)",
         lambda: _rotate(x, -ang, rope.neox, a)),
        ("position+1", "with every position one later (p + 1)",
         lambda: _rotate(x, ang + rope.inv_freq, rope.neox, a)),
        ("position-1", "with every position one earlier (p - 1)",
         lambda: _rotate(x, ang - rope.inv_freq, rope.neox, a)),
    ]
    if first_wrong:  # a step in the positions from one position on: a later prefill chunk's or a cached prefix's
        late = (np.arange(len(rope.positions)) >= first_wrong)[:, None]  # [T, 1]
        for step, word in ((1, "later"), (-1, "earlier")):
            variants.append((f"position{step:+d}-from-{first_wrong}",
                             f"with the positions from {first_wrong} on one {word} (an offset that starts mid-prompt: "
                             "a later prefill chunk's or a cached prefix's positions)",
                             lambda step=step: _rotate(x, ang + step * late * rope.inv_freq, rope.neox, a)))
    if a != 1.0:
        variants.append(("magnitude", f"without YaRN's magnitude factor {a:.4g} on the rotated pairs",
                         lambda: _rotate(x, ang, rope.neox, 1.0)))
    w = _turn_per_position(engine[..., lo:hi], x, rope)
    fit = _base_fit(w, rope)
    if fit is not None:  # the fitted base, it rounded, and the bases models ship: the closest one is tried
        bases = {fit, float(f"{fit:.2g}"), *COMMON_BASES} - {rope.base}
        err_at = {b: metrics.rel_l2(engine[..., lo:hi], _rotate(x, rope.positions[:, None] * rope.inv_freq_for(b)[None, :],
                                                                 rope.neox, a)) for b in bases}
        base = min(err_at, key=err_at.get)
        variants.append(("base", f"with a rope base of {base:.4g} instead of the reference's {rope.base:.4g}",
                         lambda: _rotate(x, rope.positions[:, None] * rope.inv_freq_for(base)[None, :], rope.neox, a)))
    ratio = w / np.where(rope.inv_freq > 0, rope.inv_freq, np.inf)
    scale = float(np.median(ratio))
    variants.append(("scale", f"with every angle {scale:.4g} x the reference's (positions scaled by {scale:.4g}: "
                              "a linear RoPE scaling)",
                     lambda: _rotate(x, scale * ang, rope.neox, a)))
    worst = int(np.argmax(np.abs(w - rope.inv_freq)))
    variants.append(("frequencies", f"with the engine's own turn per position, measured pair by pair (pair {worst}: "
                                    f"{w[worst]:.4g} rad where the reference's turns {rope.inv_freq[worst]:.4g})",
                     lambda: _rotate(x, rope.positions[:, None] * w[None, :], rope.neox, a)))
    out: dict[str, Any] = {"error": metrics.rel_l2(engine, ref), "limit": limit, "tried": [], "agrees": None}
    for name, words, make in variants:
        cand = ref.copy()
        cand[..., lo:hi] = make()
        err = metrics.rel_l2(engine, cand)
        out["tried"].append(name)
        if out["agrees"] is None and np.isfinite(err) and err <= limit:
            out["agrees"] = {"variant": name, "words": words, "error": err}
    return out
