"""verify's CPU pass on one file with 1..N workers, in this process (the page cache as it is): how the
pass scales with cores, which says whether the workers or something shared (the GIL, the reading)
bounds it. Used by bench/h200_verify.sh after the benchmark, on its warm 32 GB file.

    python bench/verify_workers.py FILE [--workers 4,8,16] [--manifest]
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from llmdoctor.checks.file import verify as V


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--workers", default="4,8,16")
    ap.add_argument("--manifest", action="store_true")
    a = ap.parse_args()
    rows = []
    for n in [int(x) for x in a.workers.split(",")]:
        V._workers = lambda n=n: n  # the pass's worker count; readers unchanged
        c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        r = V.run(a.file, write_manifest=a.manifest)
        wall = time.perf_counter() - t0
        c1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
        rows.append({"workers": n, "manifest": a.manifest, "gb_per_s": round(r.gb_per_s, 3),
                     "cores_busy": round(cpu / wall, 2), "cpu_s_per_gb": round(cpu / (r.bytes / 1e9), 3)})
        print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
