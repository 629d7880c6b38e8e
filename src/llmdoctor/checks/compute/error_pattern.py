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
               or one half of every head
    everywhere every position wrong, position 0 included, every head: a weight or the op's input, not
               a position-dependent step
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import metrics
from .layers import FLOOR, K


@dataclass
class Pattern:
    kind: str  # position | heads | channels | everywhere | none
    words: str
    wrong_positions: list[int] = field(default_factory=list)
    wrong_heads: list[int] = field(default_factory=list)
    wrong_channels: list[int] = field(default_factory=list)
    worst: dict[str, float] = field(default_factory=dict)  # the worst slice error / its limit, per axis

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "words": self.words, "wrong_positions": self.wrong_positions[:16],
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


def error_pattern(engine: Any, ref: Any, emu: Any, *, rope_dim: int | None = None) -> Pattern:
    """The spread of the engine's error at one capture point. engine, ref, emu: [T, H, D] or [T, C]
    (the reference's layout); `rope_dim`: the rotated channels of each head, first in the head (the
    reference's RoPE convention), when the point is after RoPE."""
    # a torch tensor through .double() first: bfloat16 has no numpy dtype (a bf16 engine's captures)
    x_e, x_r, x_n = (np.asarray(x.double() if hasattr(x, "double") else x, dtype=np.float64)
                     for x in (engine, ref, emu))
    if x_r.ndim == 2:
        x_e, x_r, x_n = (x[:, None, :] for x in (x_e, x_r, x_n))  # [T, 1, C]
    pos, w_pos = _wrong(x_e, x_r, x_n, 0)
    heads, w_head = _wrong(x_e, x_r, x_n, 1)
    chans, w_chan = _wrong(x_e, x_r, x_n, 2)
    t_n, h_n, d_n = x_r.shape
    p = Pattern("none", "no slice beyond its noise", pos, heads, chans,
                {"position": w_pos, "head": w_head, "channel": w_chan})
    if not pos:
        return p
    rope_only = bool(rope_dim and rope_dim < d_n and chans and set(chans) <= set(range(rope_dim)))
    if 0 not in pos and t_n > 1:
        p.kind = "position"
        p.words = (f"right at position 0, wrong from position {pos[0]} ({len(pos)} of {t_n - 1} later positions): "
                   "the rotary angle or the positions (RoPE leaves position 0 unrotated)"
                   + (f"; only the rotary channels 0-{rope_dim - 1} of each head" if rope_only else ""))
    elif h_n > 1 and len(heads) < h_n:
        p.kind = "heads"
        p.words = (f"heads {_ranges(heads)} wrong at every position, the other {h_n - len(heads)} right: a head layout "
                   "(head order, GQA grouping) or those heads' weights")
    elif len(chans) < d_n:
        half = set(range(d_n // 2)), set(range(d_n // 2, d_n))
        if rope_only:
            where = "the rotary channels only: the RoPE pair layout or its frequencies"
        elif set(chans) in half:
            where = "one half of every head: a split or concatenation order (e.g. nope/rope parts, halves of RoPE pairs)"
        else:
            where = "some channels only: a channel layout"
        p.kind, p.words = "channels", f"channels {_ranges(chans)} of {d_n} wrong, the others right: {where}"
    else:
        p.kind = "everywhere"
        p.words = ("every position wrong, position 0 included, in every head and channel: a weight or the op's "
                   "input, not a position-dependent step")
    return p
