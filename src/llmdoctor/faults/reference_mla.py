"""Planted faults of MLA files (deepseek2 / glm-dsa): converter mistakes that still load and run.

Like faults/reference.py, `build(model)` takes a `llmdoctor.reference.ReferenceModel`, changes it in
place and returns it; the float64 comparison in tests/reference/test_reference_mla.py must flag each one (the
rope-base and norm-offset faults of faults/reference.py apply to MLA models unchanged).
"""

from __future__ import annotations

from typing import Any

from . import register


class _KvBSwapped:
    """Weights whose MLA kv_b was split in the wrong order: attn_k_b holds the value rows, attn_v_b the key rows."""

    def __init__(self, inner: Any):
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get(self, name: str):
        if name.endswith("attn_k_b.weight"):  # wanted [H, R, Dn]; give v_b [H, Dv, R] transposed
            return self._inner.get(name.replace("attn_k_b", "attn_v_b")).transpose(1, 2)
        if name.endswith("attn_v_b.weight"):  # wanted [H, Dv, R]; give k_b [H, R, Dn] transposed
            return self._inner.get(name.replace("attn_v_b", "attn_k_b")).transpose(1, 2)
        return self._inner.get(name)


@register("reference-mla-kv-b-swapped", "file",
          "MLA kv_b split in the wrong order (k_b and v_b exchanged); loads when qk_nope_head_dim == "
          "v_head_dim, as in DeepSeek-V3 (128/128)", expect="attn_k_b")
def kv_b_swapped(model: Any) -> Any:
    m = model.config.mla
    if m is None or m.qk_nope != m.v_dim:
        raise ValueError("reference-mla-kv-b-swapped needs an MLA model with qk_nope_head_dim == v_head_dim")
    model.weights = _KvBSwapped(model.weights)
    return model
