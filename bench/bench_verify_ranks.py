"""verify --gpus N: GB/s on 1, 2, 4, 8 ranks and the scaling efficiency, against the machine's aggregate
disk read rate measured in the same run.

    python bench/bench_verify_ranks.py [--gb 30] [--ranks 1,2,4,8] [--device cuda] [--file F.gguf] [--keep]

The file: --file, or a synthetic GGUF of --gb GB written by bench_verify.write_synthetic next to this
script's temp folder (on the GPU machine: its local disk; nothing that large travels), removed
afterwards unless --keep. For each N, with the file's pages evicted before each run (bench_verify.evict):
  read    N threads, each reading its rank's share (verify_ranks.shares: one contiguous byte range
          per file) with 16 MiB preads: the aggregate rate the disk gives N sequential readers
  verify  checks.file.verify_ranks.run(path, N, device): the command's own path, process start included
Printed: one JSON object with, per N, both rates, verify / read, and the scaling efficiency
(rate_N / (N * rate_1), rate_1 the per-rank rate of the first N in --ranks). Results go to bench/RESULTS.md by hand,
with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_verify import evict, write_synthetic

from llmdoctor.checks.file import verify_ranks
from llmdoctor.gguf import open_gguf

READ_BUFFER = 16 << 20


def ranges(path: Path, n: int) -> list[list[tuple[str, int, int]]]:
    """Per rank: (file, start, end) byte ranges of its share, one per file it touches."""
    with open_gguf(path) as g:
        where = {t.name: (s.path, t.offset, t.offset + t.nbytes) for s in g.shards for t in s.file_tensors}
    out = []
    for share in verify_ranks.shares(path, n):
        spans: dict[str, tuple[int, int]] = {}
        for name in share:
            f, a, b = where[name]
            lo, hi = spans.get(f, (a, b))
            spans[f] = (min(lo, a), max(hi, b))
        out.append([(f, a, b) for f, (a, b) in spans.items()])
    return out


def _read(spans: list[tuple[str, int, int]]) -> int:
    buf, n = bytearray(READ_BUFFER), 0
    for f, a, b in spans:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_SEQUENTIAL)
            pos = a
            while pos < b:
                got = os.preadv(fd, [memoryview(buf)[: min(READ_BUFFER, b - pos)]], pos)
                if got <= 0:
                    break
                pos += got
                n += got
        finally:
            os.close(fd)
    return n


def read_parallel(path: Path, n: int) -> tuple[int, float]:
    parts = ranges(path, n)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        total = sum(pool.map(_read, parts))
    return total, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=30.0)
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--file", type=Path)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    tmp = None
    path = args.file
    if path is None:
        tmp = Path(tempfile.mkdtemp(prefix="bench-verify-ranks-", dir=os.environ.get("BENCH_DIR")))
        path = write_synthetic(tmp / "synthetic.gguf", args.gb)
    try:
        rows, base = [], None
        for n in (int(x) for x in args.ranks.split(",")):
            how = evict(path)
            nbytes, rs = read_parallel(path, n)
            evict(path)
            res = verify_ranks.run(path, n, device=args.device)
            bad = sum(1 for f in res.findings if f.status == "fail")
            read_gbs, verify_gbs = nbytes / rs / 1e9, res.bytes / res.seconds / 1e9
            base = base or verify_gbs / n  # per-rank rate of the first N in --ranks
            rows.append({"ranks": n, "bytes": res.bytes, "read_gb_s": read_gbs, "verify_gb_s": verify_gbs,
                         "verify_over_read": verify_gbs / read_gbs, "scaling_efficiency": verify_gbs / (n * base),
                         "verify_s": res.seconds, "failed_findings": bad, "evicted_by": how})
        print(json.dumps({"file": str(path), "device": args.device, "load_avg": os.getloadavg(), "rows": rows}, indent=1))
    finally:
        if tmp is not None and not args.keep:
            for p in tmp.iterdir():
                p.unlink()
            tmp.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
