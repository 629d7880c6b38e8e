"""Op substitution: a suspect component swapped into the reference, to confirm which swap alone
reproduces an engine's divergence. `KernelDequantizer` makes a dequant kernel spec (the one kernel
loader, subjects/kernels.py) the reference's dequantizer; the kernel runs isolated in a child
process (subjects/isolation.py) and returns whole tensors.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .engines.llama_cpp import EngineError
from .isolation import Isolated


class KernelDequantizer:
    """`(raw, qtype, shape, *, device) -> float32 tensor` backed by an isolated kernel. Context manager."""

    def __init__(self, spec: str, *, device: str = "cpu", call_timeout: float = 300.0):
        self.spec = spec
        self._iso = Isolated("llmdoctor.subjects.kernels:serve", (spec, device, None), call_timeout=call_timeout)

    def __enter__(self) -> "KernelDequantizer":
        self._iso.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._iso.close()

    def __call__(self, raw: np.ndarray, qtype: int, shape: tuple[int, ...], *,
                 device: str | torch.device = "cpu") -> torch.Tensor:
        q = GGMLQuantizationType(int(qtype))
        block = GGML_QUANT_SIZES[q][0]
        n = int(np.prod(shape))
        payload = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)  # a private copy for the child
        out = self._iso.call({"qtype": int(q), "shape": list(shape), "block_size": block, "blocks": None},
                             payload.copy(), reply_hint=n * 8)
        if out.status != "ok":
            raise EngineError(f"kernel {self.spec!r} on a {q.name} tensor {tuple(shape)}: {out.status}: {out.message}")
        dtype = getattr(torch, out.header["dtype"])
        values = torch.frombuffer(out.payload, dtype=dtype)  # [n]
        return values.reshape(shape).to(device=device, dtype=torch.float32)
