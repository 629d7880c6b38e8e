"""CPU dequantization of the whole demo file: ours (torch) against gguf-py, and against memcpy.

Ours streams every tensor through one reused float32 buffer (`out=`), as `check dequant` does; the
anchor is a same-run memcpy of the same sizes into the same buffer, and a fill of them (writing the
output with nothing to read: no kernel that produces it can be faster). gguf-py runs first, twice: its
first pass pays for fresh output memory (page faults), as one run of a tool does; its second reuses
the memory its first pass freed (glibc keeps it), its best case. Both ratios are printed. Ours
(`--torch`: the torch kernels only) and memcpy: best of --reps. Wall and CPU time are printed, and
the load average: the machine is shared. Per type, ours and the fill of the same tensors (best of the
runs each) show where the gap to the floor is. `--no-gguf-py` skips gguf-py (seconds of a loaded
machine) when only ours against the fill is wanted.

    python bench/bench_dequant_cpu.py [FILE] [--reps 5] [--threads N] [--torch] [--no-gguf-py]
    python bench/bench_dequant_cpu.py --per-type     # synthetic random blocks, every non-IQ type
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import time

import gguf.quants as gq
import numpy as np
import torch

from llmdoctor.demo import model_path
from llmdoctor.gguf import open_gguf
from llmdoctor.gguf.dequant import dequantize


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def bench_per_type(reps: int, native: bool) -> None:
    """ns per output element for each type on 2^23 random-byte outputs: ours (best wall, and CPU
    time), gguf-py (once, on rows of 4096 values), and the ratio."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

    n = 1 << 23
    out = torch.empty(n)
    out.fill_(0)
    rng = np.random.default_rng(0)
    print(f"torch {torch.get_num_threads()} threads; ns per output element (random bytes)")
    print("type    ours wall  ours CPU  gguf-py   ratio (wall)")
    for q in (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K,
              T.Q5_K, T.Q6_K, T.TQ1_0, T.TQ2_0, T.MXFP4, T.NVFP4):
        block_size, type_size = GGML_QUANT_SIZES[q]
        if q == T.F16:  # finite halves: NaNs take a slower exact path
            raw = torch.randn(n).half().view(torch.uint8)
        else:
            raw = torch.from_numpy(rng.integers(0, 256, n // block_size * type_size, dtype=np.uint8))
        dequantize(raw, q, (n,), out=out, native=native)
        wall, cpu = min(timed(lambda: dequantize(raw, q, (n,), out=out, native=native)) for _ in range(reps))
        rows = raw.numpy().reshape(-1, 4096 // block_size * type_size)  # rows of 4096 values, as in a model
        with np.errstate(all="ignore"):
            ref, _ = timed(lambda: gq.dequantize(rows, q))
        ref_ns = ref / n * 1e9
        print(f"{q.name:6s} {wall / n * 1e9:9.3f} {cpu / n * 1e9:9.3f} {ref_ns:9.2f} {ref_ns / (wall / n * 1e9):8.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", nargs="?", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--per-type", action="store_true")
    ap.add_argument("--torch", action="store_true", help="our torch kernels only (no native C kernels)")
    ap.add_argument("--no-gguf-py", action="store_true", help="skip gguf-py (ours against memcpy and fill only)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.per_type:
        return bench_per_type(args.reps, not args.torch)
    f = open_gguf(args.file or model_path())
    tensors = f.tensors
    n_max = max(t.n_elements for t in tensors)
    n_total = sum(t.n_elements for t in tensors)
    in_bytes = sum(t.nbytes for t in tensors)
    out_bytes = 4 * n_total
    buf = torch.empty(n_max)
    src = torch.empty(n_max)
    buf.fill_(0)  # touch every page before timing
    src.fill_(1)
    for t in tensors:  # page the file in
        np.asarray(t.data).sum()

    per_type_runs: list[dict[str, float]] = []
    per_type_fills: list[dict[str, float]] = []
    native = not args.torch

    def ours() -> None:  # also records each type's wall time in this run
        split: dict[str, float] = collections.defaultdict(float)
        for t in tensors:
            w = time.perf_counter()
            dequantize(t.data, t.type, t.shape, out=buf[: t.n_elements].view(t.shape), native=native)
            split[t.type.name] += time.perf_counter() - w
        per_type_runs.append(split)

    def memcpy() -> None:
        for t in tensors:
            buf[: t.n_elements].copy_(src[: t.n_elements])

    def fill() -> None:  # writing the output alone: the floor for anything that produces it
        split: dict[str, float] = collections.defaultdict(float)
        for t in tensors:
            w = time.perf_counter()
            buf[: t.n_elements].fill_(1.0)
            split[t.type.name] += time.perf_counter() - w
        per_type_fills.append(split)

    def reference() -> None:
        for t in tensors:
            gq.dequantize(t.data.reshape(*t.shape[:-1], -1), t.type)

    nan = float("nan")
    ref_wall, ref_cpu = (nan, nan) if args.no_gguf_py else timed(reference)  # first, before our threads: cold
    warm_wall = nan if args.no_gguf_py else timed(reference)[0]  # its output memory recycled from the first pass
    ours()  # warm-up
    per_type_runs.clear()
    runs = [timed(ours) for _ in range(args.reps)]
    copies = [timed(memcpy) for _ in range(args.reps)]
    fills = [timed(fill) for _ in range(args.reps)]
    our_wall, our_cpu = min(runs)
    cp_wall, _ = min(copies)
    fill_wall, _ = min(fills)

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__} with {torch.get_num_threads()} threads, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"file: {f.path} ({len(tensors)} tensors, {in_bytes / 1e6:.1f} MB quantized, "
          f"{out_bytes / 1e9:.3f} GB float32 out)")
    if not args.no_gguf_py:
        print(f"gguf-py:  {ref_wall:7.3f} s wall  {ref_cpu:7.3f} s CPU  {in_bytes / ref_wall / 1e6:7.1f} MB/s in "
              f"(first pass); second pass {warm_wall:.3f} s")
    print(f"ours:     {our_wall:7.3f} s wall  {our_cpu:7.3f} s CPU  (best of {args.reps}; "
          f"median {sorted(r[0] for r in runs)[len(runs) // 2]:.3f} s; {'native + torch' if native else 'torch'} kernels)")
    print(f"memcpy:   {cp_wall:7.3f} s wall  (same sizes into the same buffer)")
    print(f"fill:     {fill_wall:7.3f} s wall  (writing the same sizes, nothing read: the floor)")
    if not args.no_gguf_py:
        print(f"speed-up vs gguf-py: {ref_wall / our_wall:.1f}x wall vs its first pass ({ref_cpu / our_cpu:.1f}x CPU "
              f"time), {warm_wall / our_wall:.1f}x vs its second")
    print(f"written:  ours {out_bytes / our_wall / 1e9:.2f} GB/s, memcpy {out_bytes / cp_wall / 1e9:.2f} GB/s "
          f"-> {cp_wall / our_wall:.0%} of memcpy; fill {out_bytes / fill_wall / 1e9:.2f} GB/s -> {fill_wall / our_wall:.0%} "
          f"of fill" + ("" if args.no_gguf_py else f"; 30x gguf-py's first pass needs {ref_wall / 30 * 1e3:.1f} ms, "
                        f"fill takes {fill_wall * 1e3:.1f} ms"))
    print("per type (wall, best of the runs), ours / fill: " + ", ".join(
        f"{k} {min(r[k] for r in per_type_runs) * 1e3:.1f} / {min(r[k] for r in per_type_fills) * 1e3:.1f} ms"
        for k in per_type_runs[0]))


if __name__ == "__main__":
    main()
