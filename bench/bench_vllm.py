"""vLLM (for CPU) against the reference on the tiny checkpoints of tests/subjects/engines/test_engine_vllm.py, one
`diagnose --hf DIR --engine vllm --engine-dtype float32` each: KL, top-1, the worst layer point
against its budget, and the time of each step (vLLM: start + load, the prefill run; the reference
forward pass in float32 and the float64 budget run; the whole diagnosis).

    python bench/bench_vllm.py PYTHON_OF_THE_VLLM_ENV [kind ...]   # kinds: llama qwen2 deepseek glm

Prints one JSON line per model; the anchor is the reference's own forward pass (ratio vLLM run / ours).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "subjects" / "engines"))  # test modules imported by name

TOKENS = [3, 17, 42, 5, 77, 8, 23, 61, 9, 30, 55, 14, 2, 88, 40, 19]


def one(kind: str, python: str, out: Path) -> dict:
    from test_engine_vllm import vllm_checkpoint

    from llmdoctor import diagnose as dg
    from llmdoctor.subjects.engines import vllm

    ckpt, _ = vllm_checkpoint(kind, out / kind)
    infos, run = [], vllm.run

    def timed_run(*a, **kw):  # vLLM's own step times (start + load, the prefill) from its driver
        t = time.perf_counter()
        r = run(*a, **kw)
        step = r.info.details
        infos.append({"child_s": round(time.perf_counter() - t, 1), "load_s": step["load_s"], "run_s": step["run_s"]})
        return r

    vllm.run = timed_run
    steps: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    res = dg.run(dg.Inputs(hf=ckpt, engine="vllm", engine_python=python, engine_dtype="float32", token_ids=TOKENS,
                           threads=2), progress=lambda m: steps.append((time.perf_counter() - t0, m)))
    wall = time.perf_counter() - t0
    vllm.run = run
    f = {x.check: x for x in res.findings}
    row = {"model": kind, "verdict": res.verdict, "exit_code": res.exit_code, "diagnose_s": round(wall, 1),
           "timings_s": res.timings}
    row["vllm"] = infos
    row["steps"] = [{"at_s": round(t, 1), "step": m} for t, m in steps]  # each step's start
    evr = f.get("engine-vs-reference")
    if evr is not None and evr.status != "skip":
        row.update(kl_mean=evr.metrics["kl_mean"], kl_max=evr.metrics["kl_max"], top1=evr.metrics["top1_agreement"],
                   kl_budget=evr.budget.get("kl_mean_limit"))
    loc = f.get("layer-localization")
    if loc is not None and loc.status == "pass":
        row.update(worst_point=loc.metrics["worst"], worst_ratio=round(loc.metrics["worst_ratio"], 3))
        curve = [p for p in res.curve if p["noise"] > 0]
        row["error_over_noise"] = [round(min(p["error"] / p["noise"] for p in curve), 2),
                                   round(max(p["error"] / p["noise"] for p in curve), 2)]
    b = f.get("engine-backends")
    row["backends"] = b.metrics.get("selected") if b is not None and b.status != "skip" else (b.reason if b else None)
    return row


def main() -> None:
    python, kinds = sys.argv[1], sys.argv[2:] or ["llama", "qwen2", "deepseek", "glm"]
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            print(json.dumps(one(kind, python, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
