"""IQ dequant speed on CPU: ours (torch) vs gguf-py's numpy `gguf.quants.dequantize`, one run.

Usage: python bench/bench_dequant_iq.py [N_ELEMENTS] [ROUNDS]   (defaults 2**20 elements per type, 40 rounds)

The machine is shared, so each figure is the minimum over ROUNDS interleaved calls (gguf-py, ours and
the anchors take turns, so a busy stretch hits all alike; each timed call right after an untimed one of
the same function, as in streaming), measured twice: wall time with torch's
default threads, and CPU time of the calling thread with torch on one thread (gguf-py is single-threaded
numpy; CPU time does not count the stretches when another process holds the core). Anchors of the
same run: a memcpy of the float32 output size into a reused buffer, and allocating + filling a fresh
buffer of that size (what any kernel that returns a new tensor pays at least). Ours is the entry point
without `out=`.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from llmdoctor.gguf import dequantize

IQ_TYPES = [T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS]


def race(fns: dict, rounds: int, clock) -> dict[str, float]:
    """Minimum seconds per function (by `clock`) over `rounds` interleaved calls. Each timed call follows an
    untimed one of the same function: the steady state of streaming many tensors (tables in cache, freed
    memory reused), not the cold start after another function evicted the cache."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            t0 = clock()
            fn()
            best[name] = min(best[name], clock() - t0)
    return best


def measure(n_elem: int, rounds: int, clock) -> tuple[dict, dict]:
    src, dst = torch.ones(n_elem), torch.empty(n_elem)
    anchors = race({"memcpy": lambda: dst.copy_(src), "fresh": lambda: torch.empty(n_elem).fill_(1.0)}, rounds, clock)
    rng = np.random.default_rng(0)
    times = {}
    for q in IQ_TYPES:
        block_size, type_size = GGML_QUANT_SIZES[q]
        blocks = rng.integers(0, 256, (n_elem // block_size, type_size), dtype=np.uint8)
        raw = torch.from_numpy(blocks.reshape(-1))
        with np.errstate(all="ignore"):
            times[q] = race({"ref": lambda: gguf_dequantize(blocks.reshape(1, -1), q),
                             "ours": lambda: dequantize(raw, q, (n_elem,))}, rounds, clock)
    return anchors, times


def main() -> None:
    n_elem = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    threads = torch.get_num_threads()
    wall = measure(n_elem, rounds, time.perf_counter)
    torch.set_num_threads(1)
    cpu = measure(n_elem, rounds, time.thread_time)
    print(f"torch {torch.__version__}, {n_elem} elements per type ({4 * n_elem / 1e6:.1f} MB float32 out), "
          f"min of {rounds} interleaved rounds, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for label, (anchors, _) in ((f"wall, {threads} threads", wall), ("CPU time, 1 thread", cpu)):
        print(f"anchors ({label}): memcpy {anchors['memcpy'] * 1e3:.3f} ms, "
              f"fresh alloc+fill {anchors['fresh'] * 1e3:.3f} ms")
    print(f"{'':8} {'wall, ' + str(threads) + ' threads':^30} | {'CPU time, 1 thread':^30}")
    print(f"{'type':8} {'gguf-py ms':>10} {'ours ms':>8} {'ratio':>6} {'GB/s':>5} | "
          f"{'gguf-py ms':>10} {'ours ms':>8} {'ratio':>6} {'GB/s':>5}")
    for q in IQ_TYPES:
        cells = []
        for _, times in (wall, cpu):
            t = times[q]
            cells.append(f"{t['ref'] * 1e3:10.2f} {t['ours'] * 1e3:8.3f} {t['ref'] / t['ours']:6.1f} "
                         f"{4 * n_elem / t['ours'] / 1e9:5.2f}")
        print(f"{q.name:8} {cells[0]} | {cells[1]}")
    print("GB/s: float32 bytes written per second by ours")


if __name__ == "__main__":
    main()
