"""`check attention` over the built-in subjects on presets, as one table (issue 6's GPU run).

    python bench/bench_attention_gpu.py run --preset glm-5 --subjects sdpa-math,flex --device cuda \
        --dtype bfloat16,float16 --out OUT.json        # one group: findings + wall time as JSON
    (a subject is a built-in name or MODULE:FUNC=CONTRACT, e.g. llmdoctor.faults.attention:prefill=prefill)
    python bench/bench_attention_gpu.py table OUT1.json OUT2.json ...   # markdown table for RESULTS.md

Each `run` is one process so that an outer `timeout` can bound a group (compiled flex may spend long in
compilation) without losing the groups already written.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path


def run(a: argparse.Namespace) -> None:
    from llmdoctor.checks.kernels import attention as ca
    from llmdoctor.checks.kernels import attention_shapes as shapes
    from llmdoctor.subjects.attention import IsolatedAttention
    from llmdoctor.report.envelope import dumps, provenance

    t0 = time.perf_counter()
    shape = shapes.PRESETS[a.preset]
    subjects = [tuple(s.split("=", 1)) if "=" in s else (s, None) for s in a.subjects.split(",")]
    res = ca.run(shape, subjects, IsolatedAttention, device=a.device, dtypes=tuple(a.dtype.split(",")),
                 timeout=a.timeout, on_step=lambda s: print(f"[{time.perf_counter() - t0:6.1f}s] {s}", flush=True))
    Path(a.out).write_text(dumps({"preset": a.preset, "device": a.device, "env": provenance(),
                                  "wall_s": time.perf_counter() - t0, "subjects": res.subjects,
                                  "patterns": res.patterns, "findings": [f.to_dict() for f in res.findings]}))
    print(f"{a.preset} {a.subjects}: {time.perf_counter() - t0:.1f} s", flush=True)


def table(a: argparse.Namespace) -> None:
    rows: dict[tuple, dict] = defaultdict(lambda: {"pass": 0, "fail": 0, "skip": 0, "ratio": 0.0, "bound": 0.0,
                                                   "failed": [], "skipped": set()})
    wall: dict[str, float] = defaultdict(float)
    env = None
    for p in a.files:
        d = json.loads(Path(p).read_text())
        env = env or d["env"]
        wall[d["preset"]] += d["wall_s"]
        for f in d["findings"]:
            dt = f["metrics"].get("dtype", "-")
            r = rows[(d["preset"], f["subject"], dt)]
            r[f["status"]] += 1
            fl = f["budget"].get("floor_max_abs") or f["budget"].get("floor")
            err = f["metrics"].get("max_abs_diff")
            if f["status"] != "skip" and isinstance(err, float) and fl:
                r["ratio"] = max(r["ratio"], err / fl)
            if f["status"] != "skip" and isinstance(f["metrics"].get("bound_used"), float):
                r["bound"] = max(r["bound"], f["metrics"]["bound_used"])
            if f["status"] == "fail":
                r["failed"].append(f["target"].split("/")[0])
            if f["status"] == "skip":
                r["skipped"].add(f["reason"][:90])
    print(f"GPU {env['gpu']} (cc {env['compute_capability']}), torch {env['torch']}, triton {env['triton']}\n")
    print("| preset | subject | dtype | pass | fail | skip | worst err / floor | float32 bound used | failing cases "
          "| skip reasons |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (preset, subject, dt), r in sorted(rows.items()):
        print(f"| {preset} | {subject} | {dt} | {r['pass']} | {r['fail']} | {r['skip']} | {r['ratio']:.2f} | "
              f"{r['bound']:.2g} | "
              f"{', '.join(r['failed'])} | {'; '.join(sorted(r['skipped']))} |")
    print()
    for preset, s in wall.items():
        print(f"- {preset}: check wall time {s:.1f} s (all groups)")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--preset", required=True)
    r.add_argument("--subjects", required=True)
    r.add_argument("--device", default="cuda")
    r.add_argument("--dtype", default="bfloat16,float16")
    r.add_argument("--timeout", type=float, default=120.0)
    r.add_argument("--out", required=True)
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    a = ap.parse_args()
    (run if a.cmd == "run" else table)(a)


if __name__ == "__main__":
    main()
