"""Op substitution: a suspect component swapped into the reference, to confirm which swap alone
reproduces an engine's divergence. `KernelDequantizer` makes a dequant kernel spec (the one kernel
loader, subjects/kernels.py) the reference's dequantizer; `PrefillAttention` makes an attention
subject under the `prefill` contract (subjects/attention.py) the reference's attention. Both run
isolated in a child process, through the clients `IsolatedKernel` and `IsolatedAttention`.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .attention import IsolatedAttention
from .engines.base import EngineError
from .kernels import IsolatedKernel


class KernelDequantizer:
    """`(raw, qtype, shape, *, device) -> float32 tensor` backed by an isolated kernel. Context manager."""

    def __init__(self, spec: str, *, device: str = "cpu", call_timeout: float = 300.0):
        self.spec = spec
        self._kernel = IsolatedKernel(spec, device=device, timeout=call_timeout)

    def __enter__(self) -> "KernelDequantizer":
        self._kernel.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._kernel.close()

    def __call__(self, raw: np.ndarray, qtype: int, shape: tuple[int, ...], *,
                 device: str | torch.device = "cpu") -> torch.Tensor:
        q = GGMLQuantizationType(int(qtype))
        payload = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)  # a private copy for the child
        out = self._kernel.dequantize(payload.copy(), int(q), list(shape), GGML_QUANT_SIZES[q][0])
        if out.status != "ok":
            raise EngineError(f"kernel {self.spec!r} on a {q.name} tensor {tuple(shape)}: {out.status}: {out.message}")
        dtype = getattr(torch, out.header["dtype"])
        values = torch.frombuffer(out.payload, dtype=dtype)  # [n]
        return values.reshape(shape).to(device=device, dtype=torch.float32)


class PrefillAttention:
    """`(q [T, H, D], k [S, Hk, D], v [S, Hk, Dv], *, scale, window, softcap) -> [T, H, Dv]` through an
    attention subject's `prefill` contract (one sequence, bottom-right causal). Context manager."""

    def __init__(self, spec: str, *, device: str = "cpu", call_timeout: float = 300.0):
        self.spec = spec
        self._subject = IsolatedAttention(spec, "prefill", device=device, timeout=call_timeout)

    def __enter__(self) -> "PrefillAttention":
        self._subject.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._subject.close()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                 window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        t, h, _ = q.shape
        s = k.shape[0]
        cu_q = torch.tensor([0, t], dtype=torch.int32)
        cu_k = torch.tensor([0, s], dtype=torch.int32)
        kwargs = {}
        if window and s > window:  # only when the window cuts: a kernel without window support still runs
            kwargs["window_left"] = window - 1  # the contract's window_left counts keys before the query
        if softcap:
            kwargs["softcap"] = softcap
        got = self._subject.call("prefill", [q, k, v, cu_q, cu_k, t, s, scale, True], kwargs, (t, h, v.shape[-1]),
                                 (h, t))
        if got.status != "ok":
            raise EngineError(f"attention {self.spec!r} (prefill, T={t}): {got.status}: {got.message}")
        return got.out.to(dtype=q.dtype)
