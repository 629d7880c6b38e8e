"""The one bit-for-bit comparison of the tests, on `metrics.bit_mismatch` (the checks' judge)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from llmdoctor.checks.metrics import bit_mismatch


def _f32(x: Any) -> torch.Tensor:
    x = torch.from_numpy(np.ascontiguousarray(x)) if not isinstance(x, torch.Tensor) else x.detach().cpu()
    assert x.dtype == torch.float32, f"expected float32, got {x.dtype}"
    return x


def mismatch(got: Any, want: Any, *, nan_equal: bool = True, what: str = "") -> torch.Tensor:
    """bool, the shape of `want`: float32 elements whose bit patterns differ (torch tensors on any
    device, or numpy arrays). With `nan_equal`, any NaN equals any NaN (payloads may legitimately differ)."""
    g, w = _f32(got), _f32(want)
    assert g.shape == w.shape, f"{what}: shape {tuple(g.shape)} != {tuple(w.shape)}"
    return bit_mismatch(g, w, nan_equal=nan_equal).reshape(w.shape)


def bits_equal(got: Any, want: Any, *, nan_equal: bool = True) -> bool:
    return not bool(mismatch(got, want, nan_equal=nan_equal).any())


def assert_bits_equal(got: Any, want: Any, what: str = "", *, nan_equal: bool = True) -> None:
    """float32 bit patterns equal, the shapes too; on failure the count and the first differing
    element are named."""
    bad = mismatch(got, want, nan_equal=nan_equal, what=what)
    if bad.any():
        g, w = _f32(got), _f32(want)
        i = tuple(bad.nonzero()[0].tolist())
        gb, wb = g[i].view(torch.int32).item() & 0xFFFFFFFF, w[i].view(torch.int32).item() & 0xFFFFFFFF
        pytest.fail(f"{what}: {int(bad.sum())} of {bad.numel()} elements differ; first at {i}: "
                    f"got {g[i].item()!r} ({gb:#010x}), want {w[i].item()!r} ({wb:#010x})")
