"""Non-finite numbers are their own finding, never folded into a metric.

A KL divergence or a relative error over inf/NaN is itself NaN (or, worse, a NaN that a max or a mean
skips): "KL nan" or "off by nan" hides what happened. This module counts where an engine's logits and
captured activations are inf or NaN while the reference's are finite, and says it in words: "engine
logits NaN at 54 of 54 positions", "the first non-finite activation is l_out-3 (NaN in 640 of 3,840
values)".
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from ..base import Finding

HYPOTHESIS = "the engine computes finite numbers where the reference does"
_LAYER = re.compile(r"-(\d+)")


def _kinds(x: np.ndarray) -> str:
    nan, inf = bool(np.isnan(x).any()), bool(np.isinf(x).any())
    return "NaN and inf" if nan and inf else "NaN" if nan else "inf"


def logits_finding(engine: str, got: Any, want: Any) -> Finding:
    """Positions whose logits (engine `got` [T, V]) hold inf/NaN where the reference's (`want`) do not."""
    g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    bad_rows = (~np.isfinite(g) & np.isfinite(w)).any(axis=-1)  # [T]
    n, t = int(bad_rows.sum()), int(g.shape[0])
    if not n:
        return Finding("engine-finite", engine, "logits", "pass", hypothesis=HYPOTHESIS,
                       metrics={"positions": t, "non_finite_positions": 0},
                       explanation=f"engine logits finite at all {t} positions")
    where = np.flatnonzero(bad_rows)
    return Finding("engine-finite", engine, "logits", "fail", hypothesis=HYPOTHESIS, confidence="high",
                   metrics={"positions": t, "non_finite_positions": n, "first_position": int(where[0])},
                   evidence=[{"position": int(p)} for p in where[:8]],
                   explanation=f"engine logits {_kinds(g[bad_rows])} at {n} of {t} positions "
                               f"(first: position {int(where[0])}); the reference's are finite there")


def captures_finding(engine: str, got: Mapping[str, Any], want: Mapping[str, Any]) -> Finding | None:
    """The first capture point (in layer order) where the engine's activations hold inf/NaN and the
    reference's do not; None when no capture point is shared."""
    shared = [k for k in got if k in want]
    if not shared:
        return None

    def layer(name: str) -> int:
        m = _LAYER.search(name)
        return int(m.group(1)) if m else 1 << 30  # result_norm and other model-level points last

    bad = []
    for name in sorted(shared, key=lambda k: (layer(k), shared.index(k))):
        g, w = np.asarray(got[name], dtype=np.float64), np.asarray(want[name], dtype=np.float64)
        if g.shape != w.shape:
            continue
        mask = ~np.isfinite(g) & np.isfinite(w)
        if mask.any():
            bad.append({"point": name, "kind": _kinds(g[mask]), "values": int(mask.sum()), "of": int(mask.size)})
    if not bad:
        return Finding("engine-finite", engine, "activations", "pass", hypothesis=HYPOTHESIS,
                       metrics={"points": len(shared)}, explanation=f"every captured activation finite ({len(shared)} points)")
    b = bad[0]
    return Finding("engine-finite", engine, "activations", "fail", hypothesis=HYPOTHESIS, confidence="high",
                   metrics={"points": len(shared), "non_finite_points": len(bad), "first_point": b["point"]},
                   evidence=bad[:8],
                   explanation=f"the engine's first non-finite activation is {b['point']} ({b['kind']} in "
                               f"{b['values']:,} of {b['of']:,} values); {len(bad)} captured point(s) hold inf/NaN "
                               "where the reference is finite")
