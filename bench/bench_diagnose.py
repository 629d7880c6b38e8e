"""The default main job: `llmdoctor diagnose` on the demo deployment, wall time against the 60 s
goal (issue 8; issue 25: with the engine's front end and 16 generated tokens per prompt, the decode path),
with the time of each hypothesis, the CPU time the run took (user + system, its children included: on a
machine shared with other work the wall time overstates what 2 free cores need) and the load average
around it. Process start and imports are included.

    python bench/bench_diagnose.py [--repeat N] [--generate N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

GOAL_S = 60.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--generate", type=int, default=16, help="tokens generated per prompt (the decode path)")
    a = ap.parse_args()
    walls = []
    for _ in range(a.repeat):
        load0 = os.getloadavg()[0]
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "llmdoctor.cli", "diagnose", "--json", "--generate", str(a.generate)],
                           capture_output=True, text=True)
        walls.append(time.perf_counter() - t0)
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        doc = json.loads(p.stdout)
        print(f"verdict {doc['verdict']!r} exit {p.returncode}; per hypothesis (s): {doc['timings_s']}")
        decode = next((f for f in doc["findings"] if f["check"] == "decode-path"), None)
        if decode is not None:
            eng = decode["metrics"].get("engine", {})
            print(f"decode-path {decode['status']}: {decode.get('explanation') or decode.get('reason')} "
                  f"(llama.cpp prefill {eng.get('prefill_s')} s, {decode['metrics'].get('generated', 0) - 1} decode "
                  f"steps {eng.get('decode_s')} s)")
        if doc.get("stages_s") or doc.get("stages"):
            print(f"stages (s): {doc.get('stages_s') or doc.get('stages')}")
        print(f"wall {walls[-1]:.1f} s, CPU {cpu:.1f} s (user + system, children), load average {load0:.1f} -> "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    best = min(walls)
    print(f"diagnose (demo, {os.cpu_count()} cores): best {best:.1f} s of {len(walls)}, goal {GOAL_S:.0f} s, "
          f"ratio goal/ours {GOAL_S / best:.2f} (>= 1 meets the goal)")


if __name__ == "__main__":
    main()
