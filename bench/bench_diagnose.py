"""The default main job: `llmdoctor diagnose` on the demo deployment, wall time against the 60 s
goal (issue 8), with the time of each hypothesis. Process start and imports are included.

    python bench/bench_diagnose.py [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

GOAL_S = 60.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    walls = []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "llmdoctor.cli", "diagnose", "--json"],
                           capture_output=True, text=True)
        walls.append(time.perf_counter() - t0)
        doc = json.loads(p.stdout)
        print(f"verdict {doc['verdict']!r} exit {p.returncode}; per hypothesis (s): {doc['timings_s']}")
    best = min(walls)
    print(f"diagnose (demo, {os.cpu_count()} cores): best {best:.1f} s of {len(walls)}, goal {GOAL_S:.0f} s, "
          f"ratio goal/ours {GOAL_S / best:.2f} (>= 1 meets the goal)")


if __name__ == "__main__":
    main()
