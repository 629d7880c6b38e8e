"""verify and manifest at disk speed, each against a same-run anchor on the same file.

    python bench/bench_verify.py [--synthetic-gb 4] [--keep]      (--synthetic-gb 0: the demo alone)

Files: the demo model, and a synthetic GGUF of --synthetic-gb GB written under /tmp by this script
(Q4_K, Q6_K, Q8_0 and F32 tensors of random blocks whose scales are finite float16, so every value
decodes finite; removed afterwards unless --keep).
For each file, cold (its pages evicted from the page cache before each run) and warm:
  read      one sequential pass, os.readv into one reused 16 MiB buffer (the anchor)
  verify    checks.verify.run on the CPU, with the forensics statistics (what the command does),
            and without them (`verify-bare`: the decode and finite checks alone), to name the slowest stage
  manifest  checks.manifest.hash_tensors (every tensor's sha256, os.cpu_count() threads)
  sha256sum `sha256sum FILE` (the anchor of the hashing)
Each stage: wall seconds, CPU seconds of this process, GB/s, and CPU seconds per GB (the steadier
figure on a shared machine). Also, once: the CPU milliseconds per 1M decoded values of each stage of
verify's chunk (native decode, the finite check, the forensics accumulator), one thread, best of 20,
on a chunk of each of the demo's quant types (`per_million`).
Cold: `echo 3 > /proc/sys/vm/drop_caches` where the machine allows it, else posix_fadvise(DONTNEED)
on the file (evicts its clean pages without privileges); the output says which (the cold read's
rate against the warm one shows that the pages were gone). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter

from llmdoctor.checks import manifest as MF
from llmdoctor.checks import verify as V
from llmdoctor.checks.forensics import SCALE_FIELDS
from llmdoctor.demo import model_path
from llmdoctor.gguf import open_gguf

READ_BUFFER = 16 << 20
TENSOR_VALUES = 1 << 26  # 64M values per synthetic tensor (a 2048 x 32768 matrix)
MIX = (Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.F32)  # roughly a Q4_K_M file's byte mix, with F32


def _blocks(qtype: Q, n_values: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n_blocks, type_size] random blocks with every float16 scale field finite (1e-3..1e-2)."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    if qtype == Q.F32:
        return rng.standard_normal(n_values, dtype=np.float32).view(np.uint8).reshape(-1, 4)
    b = rng.integers(0, 256, size=(n_values // bs, ts), dtype=np.uint8)
    for f in SCALE_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 1e-2, size=len(b)).astype("<f2")
        b[:, f.offset : f.offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return b


def write_synthetic(path: Path, gb: float) -> Path:
    """A GGUF of about `gb` GB: tensors blk.N.<role> cycling through MIX, each 64M values; one block
    template per type, written again for every tensor of that type (the bytes a disk reads are real)."""
    rng = np.random.default_rng(0)
    templates = {q: _blocks(q, TENSOR_VALUES, rng) for q in set(MIX)}
    plan, size, i = [], 0, 0
    while size < gb * 1e9:
        q = MIX[i % len(MIX)]
        plan.append((f"blk.{i // len(MIX)}.t{i % len(MIX)}.weight", q))
        size += templates[q].nbytes
        i += 1
    w = GGUFWriter(str(path), "llama")
    for name, q in plan:
        w.add_tensor_info(name, (2048, TENSOR_VALUES // 2048), np.dtype(np.float32), templates[q].nbytes, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, q in plan:
        w.write_tensor_data(templates[q].reshape(2048, -1))
    w.close()
    return path


def _files(path: Path) -> list[str]:
    with open_gguf(path) as g:
        return [s.path for s in g.shards]


def evict(path: Path) -> str:
    """Drop the file's pages from the page cache; returns how."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        pass
    for p in _files(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED)"


def read_all(path: Path) -> int:
    buf = bytearray(READ_BUFFER)
    n = 0
    for p in _files(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while got := os.readv(fd, [buf]):
                n += got
        finally:
            os.close(fd)
    return n


def timed(fn, *args) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process)."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - t0, time.process_time() - c0


def verify_bare(path: Path) -> None:
    keep = V._forensics
    V._forensics = lambda: None  # the decode and finite checks alone
    try:
        V.run(path)
    finally:
        V._forensics = keep


def hash_all(path: Path) -> None:
    with open_gguf(path) as g:
        MF.hash_tensors(g)


def sha256sum(path: Path) -> None:
    subprocess.run(["sha256sum", *_files(path)], check=True, capture_output=True)


STAGES = {"read": read_all, "verify": lambda p: V.run(p), "verify-bare": verify_bare, "manifest": hash_all,
          "sha256sum": sha256sum}


def _figures(size: int, wall: float, cpu: float) -> dict:
    return {"s": round(wall, 3), "cpu_s": round(cpu, 3), "GB/s": round(size / wall / 1e9, 3),
            "cpu_s_per_GB": round(cpu / size * 1e9, 2)}


def bench_file(path: Path, stages: list[str]) -> dict:
    with open_gguf(path) as g:
        size = g.total_size
    out: dict = {"file": str(path), "bytes": size, "cold": {}, "warm": {}}
    for stage in stages:
        how = evict(path)
        wall, cpu = timed(STAGES[stage], path)
        out["cold"][stage] = _figures(size, wall, cpu)
        out["evicted_by"] = how
        STAGES["read"](path)  # warm the cache, then time the warm run
        wall, cpu = timed(STAGES[stage], path)
        out["warm"][stage] = _figures(size, wall, cpu)
    for cache in ("cold", "warm"):
        r = out[cache]
        out[cache]["ratios"] = {
            "verify / read": round(r["verify"]["GB/s"] / r["read"]["GB/s"], 3),
            "verify-bare / read": round(r["verify-bare"]["GB/s"] / r["read"]["GB/s"], 3),
            "manifest / sha256sum": round(r["manifest"]["GB/s"] / r["sha256sum"]["GB/s"], 3),
        }
    return out


def per_million(repeats: int = 20) -> dict:
    """CPU ms per 1M values of verify's per-chunk work, one torch thread, best of `repeats`."""
    import torch

    from llmdoctor.checks import forensics as FX
    from llmdoctor.gguf import dequantize

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            c = time.thread_time()
            fn()
            times.append(time.thread_time() - c)
        return min(times) * 1e3

    keep = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        with open_gguf(model_path()) as g:
            for q in (Q.Q4_K, Q.Q6_K, Q.Q8_0):
                t = next(t for t in g.tensors if t.type == q and t.n_elements >= V.CHUNK_VALUES)
                nb = V.CHUNK_VALUES // t.block_size
                raw = t.data[: nb * t.type_size]
                v = dequantize(raw, q, (nb * t.block_size,))
                acc = FX.Accumulator(t.name, q)
                out[q.name] = {"decode": round(best(lambda: dequantize(raw, q, (nb * t.block_size,), out=v)), 3),
                               "finite check": round(best(lambda: float(v.sum())), 3),
                               "forensics": round(best(lambda: acc.add(raw.reshape(nb, -1), v)), 3)}
    finally:
        torch.set_num_threads(keep)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--synthetic-gb", type=float, default=4.0)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    stages = list(STAGES)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
              "load_average_before": os.getloadavg(), "ms_per_1M_values": per_million(), "files": []}
    result["files"].append(bench_file(model_path(), stages))
    if a.synthetic_gb <= 0:  # the demo alone
        print(json.dumps(result, indent=2))
        return 0
    syn = Path("/tmp/llmdoctor-bench-verify.gguf")
    t0 = time.perf_counter()
    write_synthetic(syn, a.synthetic_gb)
    result["synthetic_write_s"] = round(time.perf_counter() - t0, 1)
    try:
        result["files"].append(bench_file(syn, stages))
    finally:
        if not a.keep:
            syn.unlink(missing_ok=True)
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
