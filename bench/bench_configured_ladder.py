"""What an as-configured vLLM diagnosis costs (issue 34's speed target), with vLLM for CPU (LLMDOCTOR_VLLM_PYTHON)
on the tiny llama checkpoint of the tests:

    default      `diagnose --hf MODEL --engine vllm` as llmdoctor builds the engine (eager, no --engine-args)
    configured   the same with --engine-args (eager, chunks of 16, prefix caching): the configured requests run
    ladder       the configured run with a planted chunked-prefill fault (tests/vllm_plants.py), so the ladder
                 restarts the engine once per rung inside the resident driver process

The anchor for a rung is a fresh driver process: the interpreter's start and `import vllm` (timed here in the same
run), which a rung in the resident process does not pay. Prints one JSON object per run and the ratio.
With `rows`: issue 34's healthy rows that vLLM for CPU runs (tiny llama, DeepSeek-V3 MLA and GLM-5 DSA under
vLLM's defaults in bfloat16, with and without an fp8 KV cache), one markdown row each.

    LLMDOCTOR_VLLM_PYTHON=... python bench/bench_configured_ladder.py [rows]
"""

from __future__ import annotations

import json
import os
from math import nan
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests/reference"), str(ROOT / "tests/subjects/engines")]

from test_engine_vllm import vllm_checkpoint  # noqa: E402  (the tests' tiny llama, built from a transformers config)
from vllm_plants import plant_env  # noqa: E402

TOKENS = ",".join(map(str, range(3, 40)))  # 37 positions: three prefill chunks of 16
ARGS = "--dtype float32 --enforce-eager --max-num-batched-tokens 16 --max-num-seqs 16 --enable-prefix-caching --block-size 32"


ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
# `rows`: the healthy rows of issue 34 item 4 that vLLM for CPU runs: vLLM's defaults (torch.compile on; no CUDA
# graphs on a CPU) in bfloat16, with and without an fp8 KV cache, chunks of 16 and prefix caching on
ROW_ARGS = {"defaults": "--dtype bfloat16 --max-num-batched-tokens 16 --max-num-seqs 16 --enable-prefix-caching "
                        "--block-size 32",
            "fp8-kv": "--dtype bfloat16 --max-num-batched-tokens 16 --max-num-seqs 16 --enable-prefix-caching "
                      "--block-size 32 --kv-cache-dtype fp8"}


def diagnose(python: str, model: Path, engine_args: str | None, env: dict[str, str]) -> tuple[float, int, dict | None, str]:
    """(seconds, exit code, the JSON report or None, stderr's tail) of one `diagnose --engine vllm`."""
    cmd = [sys.executable, "-m", "llmdoctor.cli", "diagnose", "--engine", "vllm", "--engine-python", python,
           "--token-ids", TOKENS, "--generate", "4", "--json"]
    cmd += ["--engine-args", f"{model} {engine_args}"] if engine_args else ["--hf", str(model), "--engine-dtype", "float32"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=1800)
    doc = json.loads(p.stdout) if p.stdout.strip().startswith("{") else None
    return time.perf_counter() - t0, p.returncode, doc, p.stderr[-600:]


def rows(python: str) -> None:
    """One markdown row per model and configuration: the verdict and what each configured check said."""
    print("| model | configuration | verdict | engine-vs-reference | configured requests | ladder | wall |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("llama", "deepseek", "glm"):
            model = vllm_checkpoint(kind, Path(tmp) / kind)[0]
            for name, args in ROW_ARGS.items():
                wall, rc, doc, err = diagnose(python, model, args, ENV)
                if doc is None:
                    print(f"| {kind} | {name} | exit {rc}: {err.strip().splitlines()[-1] if err.strip() else ''} | | | | "
                          f"{wall:.0f} s |", flush=True)
                    continue
                by = {f["check"] + ":" + f["target"]: f for f in doc["findings"]}
                evr = next((f for k, f in by.items() if k.startswith("engine-vs-reference:")), {})
                reqs = "; ".join(f"{'chunked' if 'budget' in f['target'] else 'prefix'}: {f['status']}"
                                 for k, f in by.items() if k.startswith("configured-requests:"))
                lad = next((f for k, f in by.items() if k.startswith("configured-ladder:")), {})
                kl, noise = evr.get("metrics", {}).get("kl_mean", nan), evr.get("budget", {}).get("kl_noise_mean", nan)
                print(f"| {kind} | {name} | {doc['verdict'][:90]} | {evr.get('status')} (KL {kl:.3g}, noise {noise:.3g}) "
                      f"| {reqs} | {lad.get('status')} | {wall:.0f} s |", flush=True)


def main() -> None:
    python = os.environ.get("LLMDOCTOR_VLLM_PYTHON")
    if not python:
        raise SystemExit("set LLMDOCTOR_VLLM_PYTHON to vLLM's interpreter")
    if sys.argv[1:] == ["rows"]:
        return rows(python)
    env = ENV
    with tempfile.TemporaryDirectory() as tmp:
        model = vllm_checkpoint("llama", Path(tmp) / "llama")[0]
        t0 = time.perf_counter()
        subprocess.run([python, "-c", "import vllm; from vllm import LLM"], check=True, capture_output=True,
                       env={**os.environ, **env})
        fresh = time.perf_counter() - t0
        out = {"fresh_process_import_s": round(fresh, 2)}
        for name, args, extra in (("default", None, {}), ("configured", ARGS, {}),
                                  ("ladder", ARGS, plant_env("chunk-offset", Path(tmp) / "plant"))):
            wall, rc, doc, err = diagnose(python, model, args, {**env, **extra})
            if doc is None or rc not in (0, 1):
                raise SystemExit(f"diagnose failed ({rc}): {err}")
            ladder = next((f for f in doc["findings"] if f["check"] == "configured-ladder"), {})
            rungs = [{k: r.get(k) for k in ("option", "agrees", "load_s", "seconds")}
                     for r in ladder.get("evidence", []) if "option" in r]
            out[name] = {"wall_s": round(wall, 1), "verdict": doc["verdict"], "stages_s": doc.get("stages_s"),
                         "rungs": rungs}
            print(json.dumps({name: out[name]}), flush=True)
        rungs = out["ladder"]["rungs"]
        if rungs:
            per_rung = sum(r["seconds"] for r in rungs) / len(rungs)
            print(f"rung in the resident driver: {per_rung:.2f} s mean over {len(rungs)}; a fresh driver process adds "
                  f"{fresh:.2f} s (interpreter + import vllm) to each: resident/fresh = {per_rung / (per_rung + fresh):.2f}")
        print(f"configured vs default diagnosis: {out['configured']['wall_s']:.1f} s / {out['default']['wall_s']:.1f} s "
              f"= {out['configured']['wall_s'] / out['default']['wall_s']:.2f}x")


if __name__ == "__main__":
    main()
