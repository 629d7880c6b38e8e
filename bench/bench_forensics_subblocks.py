"""The cost of the K-quant sub-block rule (checks/file/subblock_codes.py: SubBlockStats) inside `verify`, against
the rest of verify's per-chunk work in the same run.

    python bench/bench_forensics_subblocks.py [--repeats 20] [--verify-runs 3]

per_chunk: CPU ms (one thread, best of --repeats) of one verify chunk (1M values) of the demo's Q4_K and
Q6_K tensors: the decode, the forensics accumulator with and without the sub-block counts, and the
counts alone in C and in numpy. verify: `checks.file.verify.run` on the demo (CPU), alternating with and
without the sub-block counts (the accumulator's `subblocks` dropped), wall and CPU seconds, best of
--verify-runs each. Prints one JSON object with the ratios.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from gguf import GGMLQuantizationType as Q

from llmdoctor.checks.file import forensics_native as FN
from llmdoctor.checks.file import subblock_codes as SB
from llmdoctor.checks.file import tensor_stats as TS
from llmdoctor.checks.file import verify as V
from llmdoctor.demo import model_path
from llmdoctor.gguf import dequantize, open_gguf


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        c = time.thread_time()
        fn()
        times.append(time.thread_time() - c)
    return min(times) * 1e3


def per_chunk(repeats: int) -> dict:
    out = {}
    with open_gguf(model_path()) as g:
        for q in (Q.Q4_K, Q.Q6_K):
            t = next(t for t in g.tensors if t.type == q and t.n_elements >= V.CHUNK_VALUES)
            nb = V.CHUNK_VALUES // t.block_size
            raw = t.data[: nb * t.type_size]
            blocks = raw.reshape(nb, -1)  # [n_blocks, type_size]
            v = dequantize(raw, q, (nb * t.block_size,))
            with_sb, without = TS.Accumulator(t.name, q), TS.Accumulator(t.name, q)
            without.subblocks = None
            sb = SB.SubBlockStats(q)
            native = FN.NATIVE
            row = {"decode": _best(lambda: dequantize(raw, q, (nb * t.block_size,), out=v), repeats),
                   "forensics": _best(lambda: with_sb.add(blocks, v), repeats),
                   "forensics_without_subblocks": _best(lambda: without.add(blocks, v), repeats),
                   "subblocks_c": _best(lambda: sb.add(blocks), repeats)}
            FN.NATIVE = None
            try:
                row["subblocks_numpy"] = _best(lambda: sb.add(blocks), repeats)
            finally:
                FN.NATIVE = native
            row = {k: round(x, 4) for k, x in row.items()}
            base = row["forensics_without_subblocks"]
            row["subblocks_c_over_forensics_without"] = round(row["subblocks_c"] / base, 3)
            row["subblocks_c_over_decode"] = round(row["subblocks_c"] / row["decode"], 3)
            out[q.name] = row
    return out


def verify_runs(runs: int) -> dict:
    path = model_path()
    real = TS.Accumulator.__init__

    def bare(self, name, qtype):  # the accumulator without its sub-block counts
        real(self, name, qtype)
        self.subblocks = None

    res: dict[str, list] = {"with": [], "without": []}
    for _ in range(runs):
        for mode in ("with", "without"):
            if mode == "without":
                TS.Accumulator.__init__ = bare
            try:
                w, c = time.perf_counter(), time.process_time()
                V.run(path)
                res[mode].append((time.perf_counter() - w, time.process_time() - c))
            finally:
                TS.Accumulator.__init__ = real
    best = {m: (min(r[0] for r in rs), min(r[1] for r in rs)) for m, rs in res.items()}
    return {"wall_s": {m: round(b[0], 3) for m, b in best.items()},
            "cpu_s": {m: round(b[1], 3) for m, b in best.items()},
            "wall_ratio": round(best["with"][0] / best["without"][0], 3),
            "cpu_ratio": round(best["with"][1] / best["without"][1], 3)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--verify-runs", type=int, default=3)
    a = ap.parse_args()
    keep = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        chunks = per_chunk(a.repeats)
    finally:
        torch.set_num_threads(keep)
    doc = {"native": FN.NATIVE is not None, "per_chunk_ms": chunks, "verify_demo": verify_runs(a.verify_runs)}
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
