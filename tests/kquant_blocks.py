"""K-quant blocks drawn as llama.cpp's quantizer writes them, without a float model to quantize (Q4_K: 6-bit
sub-block scale and min codes whose largest is 63 in every block, d spread log-normally, dmin = 7.5 d with
min codes equal to scale codes, so that every sub-block is centered; Q6_K: int8 scales whose extreme is
-128): checks/file/forensics.py's block rules hold on them. Used by bench/bench_glm5.py's GLM-5-shaped file and
tested in tests/diagnose/test_diagnose_device.py."""

from __future__ import annotations

import math

import torch


# d is spread log-normally across blocks, exp(0.25 N(0,1) - SPREAD): E[exp(0.5 N)] = exp(0.125), so SPREAD = 0.0625
# keeps d's mean square, and the RMS the caller asks for
SPREAD = 0.25 ** 2


def q4_k_blocks(n: int, rms: float, gen: torch.Generator, device: str) -> torch.Tensor:
    """n Q4_K blocks (uint8 [n, 144], ggml's block_q4_K: d, dmin, 12 bytes of packed 6-bit scale/min codes,
    128 bytes of 4-bit quants) whose values have RMS ~ `rms` and mean 0 (module docstring)."""
    sc = torch.randint(24, 64, (n, 8), generator=gen, device=device)
    sc[torch.arange(n, device=device), torch.randint(0, 8, (n,), generator=gen, device=device)] = 63
    m = sc  # min codes = scale codes: with dmin = 7.5 d each sub-block's values d sc (q - 7.5) are centered
    # RMS of d sc (q - 7.5), q uniform in 0..15: d sqrt(E[sc^2]) sqrt(85/4)
    d = rms / (math.sqrt(float((sc.float() ** 2).mean())) * math.sqrt(85 / 4))
    d = (d * torch.exp(0.25 * torch.randn(n, generator=gen, device=device) - SPREAD)).to(torch.float16)
    head = torch.stack([d, (d.float() * 7.5).to(torch.float16)], 1).view(torch.uint8)  # [n, 4]
    lo, hi = sc[:, :4], sc[:, 4:]
    ml, mh = m[:, :4], m[:, 4:]
    scales = torch.cat([lo | ((hi >> 4) << 6), ml | ((mh >> 4) << 6), (hi & 15) | ((mh & 15) << 4)], 1)  # [n, 12]
    qs = torch.randint(0, 256, (n, 128), generator=gen, device=device, dtype=torch.uint8)
    return torch.cat([head, scales.to(torch.uint8), qs], 1)


def q6_k_blocks(n: int, rms: float, gen: torch.Generator, device: str) -> torch.Tensor:
    """n Q6_K blocks (uint8 [n, 210]: ql 128, qh 64, 16 int8 scales whose extreme is -128, d)."""
    sc = torch.randint(-128, -63, (n, 16), generator=gen, device=device)
    sc[torch.arange(n, device=device), torch.randint(0, 16, (n,), generator=gen, device=device)] = -128
    # RMS of d sc (q - 32), q uniform in 0..63: d sqrt(E[sc^2]) sqrt((64^2 - 1)/12 + 0.25)
    d = rms / (math.sqrt(float((sc.float() ** 2).mean())) * math.sqrt((64 ** 2 - 1) / 12 + 0.25))
    d = (d * torch.exp(0.25 * torch.randn(n, generator=gen, device=device) - SPREAD)).to(torch.float16)
    q = torch.randint(0, 256, (n, 192), generator=gen, device=device, dtype=torch.uint8)
    return torch.cat([q, sc.to(torch.int8).view(torch.uint8), d[:, None].view(torch.uint8)], 1)
