"""IQ dequant speed on CPU: ours (torch) vs gguf-py's numpy `gguf.quants.dequantize`, one run.

Usage: python bench/bench_dequant_iq.py [N_ELEMENTS] [ROUNDS]   (defaults 2**20 elements per type, 30 rounds)

The machine is shared, so each figure is the minimum over ROUNDS interleaved calls (gguf-py, ours and
the anchors take turns, so a busy stretch hits all alike). Anchors of the same run: a memcpy of the
float32 output size into a reused buffer, and allocating + filling a fresh buffer of that size (what
any kernel that returns a new tensor pays at least). Ours is the kernel the entry point calls, without
`out=` (the copy into `out` is the entry point's, not the kernel's).
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from llmdoctor.gguf import dequantize

IQ_TYPES = [T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS]


def race(fns: dict, rounds: int) -> dict[str, float]:
    """Minimum seconds per function over `rounds` interleaved calls."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main() -> None:
    n_elem = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {n_elem} elements per type, "
          f"min of {rounds} interleaved rounds")
    src, dst = torch.ones(n_elem), torch.empty(n_elem)
    anchors = race({"memcpy": lambda: dst.copy_(src), "fresh": lambda: torch.empty(n_elem).fill_(1.0)}, 5 * rounds)
    print(f"anchors: memcpy {anchors['memcpy'] * 1e3:.3f} ms, fresh alloc+fill {anchors['fresh'] * 1e3:.3f} ms "
          f"({src.nbytes / 1e6:.1f} MB)")
    print(f"{'type':8} {'gguf-py ms':>10} {'ours ms':>8} {'ratio':>6} {'in MB/s':>8} {'out GB/s':>8} {'memcpy/ours':>11}")
    rng = np.random.default_rng(0)
    for q in IQ_TYPES:
        block_size, type_size = GGML_QUANT_SIZES[q]
        blocks = rng.integers(0, 256, (n_elem // block_size, type_size), dtype=np.uint8)
        raw = torch.from_numpy(blocks.reshape(-1))
        with np.errstate(all="ignore"):
            t = race({"ref": lambda: gguf_dequantize(blocks.reshape(1, -1), q),
                      "ours": lambda: dequantize(raw, q, (n_elem,))}, rounds)
        print(f"{q.name:8} {t['ref'] * 1e3:10.2f} {t['ours'] * 1e3:8.3f} {t['ref'] / t['ours']:6.1f} "
              f"{blocks.nbytes / t['ours'] / 1e6:8.0f} {4 * n_elem / t['ours'] / 1e9:8.2f} "
              f"{anchors['memcpy'] / t['ours']:11.0%}")


if __name__ == "__main__":
    main()
