"""The one float32 bit-for-bit comparison of the dequant tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch


def _f32(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    assert x.dtype == np.float32, f"expected float32, got {x.dtype}"
    return x


def assert_bits_equal(got: Any, want: Any, what: str = "", *, nan_equal: bool = True) -> None:
    """float32 bit patterns equal (torch tensors on any device, or numpy arrays), the shapes too.
    With `nan_equal`, any NaN equals any NaN (payloads may legitimately differ); on failure the
    count and the first differing element are named."""
    g, w = _f32(got), _f32(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    gb, wb = g.view(np.uint32), w.view(np.uint32)
    bad = gb != wb
    if nan_equal:
        bad &= ~(np.isnan(g) & np.isnan(w))
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        pytest.fail(f"{what}: {int(bad.sum())} of {bad.size} elements differ; first at {i}: "
                    f"got {g[i]!r} ({gb[i]:#010x}), want {w[i]!r} ({wb[i]:#010x})")
