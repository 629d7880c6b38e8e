"""What relates a weight an engine holds after its loader to the one the model file defines, when they
differ (issue 22 part 3): a scale, a transpose, a row permutation (the RoPE pair layout above all), or
another tensor's data. Both sides are in the engine's layout (the reference's tensor mapped there by
gguf/layout.py), as float64 arrays of the same role."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from .. import metrics


def _same(got: np.ndarray, want: np.ndarray, tol: float) -> bool:
    return got.shape == want.shape and metrics.rel_l2(got, want) <= tol


def rope_layout_rows(n_rows: int, n_head: int) -> dict[str, np.ndarray]:
    """The row orders the RoPE pair layout produces, per head: {"permuted": convert_hf_to_gguf's permute
    (rotate-half -> adjacent pairs), "unpermuted": its inverse} as index arrays (got[i] = want[idx[i]])."""
    from ...gguf.layout import rope_permute, rope_unpermute

    rows = torch.arange(n_rows, dtype=torch.float64)[:, None]
    return {"permuted": rope_permute(rows, n_head)[:, 0].long().numpy(),
            "unpermuted": rope_unpermute(rows, n_head)[:, 0].long().numpy()}


def _row_permutation(got: np.ndarray, want: np.ndarray, tol: float) -> np.ndarray | None:
    """idx with got[i] == want[idx[i]] for every row (a permutation), or None. Rows are matched by a few
    random projections, then confirmed whole."""
    if got.ndim != 2 or got.shape != want.shape:
        return None
    proj = np.random.default_rng(0).standard_normal((got.shape[1], 4))
    pg, pw = got @ proj, want @ proj  # [R, 4]
    idx = np.empty(got.shape[0], dtype=np.int64)
    for i in range(got.shape[0]):
        idx[i] = int(np.argmin(((pw - pg[i]) ** 2).sum(axis=1)))
    if len(set(idx.tolist())) != len(idx) or not _same(got, want[idx], tol):
        return None
    return idx


def relate(got: Any, want: Any, *, tol: float, n_head: int | None = None,
           others: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """None when `got` is `want` within `tol` (rel. L2: the engine's storage precision); else
    {"kind": scale | transpose | rope-layout | rows-permuted | other-tensor | unrelated, "words", ...}.
    `n_head`: the heads of a q/k projection (the RoPE pair layout is per head); `others`: tensors of the
    same layer in the same layout, for "holds another tensor's data"."""
    g, w = (np.asarray(x, dtype=np.float64) for x in (got, want))
    if _same(g, w, tol):
        return None
    err = metrics.rel_l2(g, w) if g.shape == w.shape else float("inf")
    if g.shape == w.shape and (w * w).sum() > 0:
        c = float((g * w).sum() / (w * w).sum())
        if c != 0 and _same(g, c * w, tol):
            return {"kind": "scale", "factor": c, "error": err, "words": f"the file's tensor scaled by {c:.6g}"}
    if g.ndim == 2 and g.shape == w.shape[::-1] and _same(g, w.T, tol):
        return {"kind": "transpose", "error": err, "words": "the file's tensor transposed"}
    idx = _row_permutation(g, w, tol)
    if idx is not None:
        if n_head:
            for name, order in rope_layout_rows(g.shape[0], n_head).items():
                if np.array_equal(idx, order):
                    return {"kind": "rope-layout", "order": name, "error": err,
                            "words": ("rows in the GGUF's adjacent-pair RoPE layout: the loader did not undo "
                                      "convert_hf_to_gguf's Q/K permutation" if name == "permuted" else
                                      "rows permuted by the inverse RoPE pair permutation (undone twice)")}
        moved = int((idx != np.arange(len(idx))).sum())
        return {"kind": "rows-permuted", "rows_moved": moved, "error": err,
                "words": f"the file's rows in another order ({moved} of {len(idx)} rows moved)"}
    for name, other in (others or {}).items():
        o = np.asarray(other, dtype=np.float64)
        if _same(g, o, tol):
            return {"kind": "other-tensor", "tensor": name, "error": err, "words": f"{name}'s data"}
    return {"kind": "unrelated", "error": err, "words": f"differs (rel. L2 {err:.3g}) by no simple transform"}
