"""False alarms of a real, healthy vLLM (issue 35 item 2's vLLM rows): `llmdoctor diagnose --engine vllm` run
again and again in one process on random prompts, each judged as a user's diagnosis is judged, counting every
diagnosis that is not "healthy" (any failing finding) with its two-sided 95% Clopper-Pearson upper bound per
dtype and length. The engine loads once (the resident driver serves every diagnosis of a configuration), so a
diagnosis costs the reference's runs and draws, not an engine start.

Unlike bench_false_alarms.py (randomized-rounding draws standing for engines), the engine here is vLLM itself:
on the GPU its real kernels (FLASH_ATTN, cuBLAS, TF32 Triton attention in float32), on a CPU vLLM for CPU's.
The draws of one prompt's diagnosis are independent of another's; the engine's own rounding repeats for a
repeated prompt, so every diagnosis gets a fresh prompt (ids drawn with a fixed seed per row).

    python bench/bench_vllm_alarms.py --python /tmp/vpy --model DIR --dtypes bfloat16,float32 --lengths 16,64,200 \
        --per-row 20 [--engine-args "MODEL --dtype bfloat16"] [--seconds 400] [--json-out F]

The same for another in-process engine on a GGUF (the engine's own dtype: one row per length), e.g. llama.cpp on the
demo with its decode path judged:

    python bench/bench_vllm_alarms.py --engine llama.cpp --model DEMO.gguf --lengths 32 --generate 16 --per-row 20

Prints one row per dtype and length and the total; a row cut short by --seconds says how many it ran.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_false_alarms import clopper_pearson_upper


def diagnose_once(args: argparse.Namespace, dtype: str, ids: list[int]) -> dict:
    """One diagnosis in this process (the resident vLLM driver kept between them): its verdict and the failing
    findings, each with how far beyond its allowance it is."""
    from typer.testing import CliRunner

    from llmdoctor.cli import app

    if args.model.endswith(".gguf"):
        engine = ["--gguf", args.model]
    elif args.engine_args:
        engine = ["--engine-args", args.engine_args.replace("{dtype}", dtype)]
    else:
        engine = ["--hf", args.model, "--engine-dtype", dtype]
    if args.engine == "vllm":
        engine += ["--engine-python", args.python]
    r = CliRunner().invoke(app, ["diagnose", *engine, "--engine", args.engine, "--token-ids", ",".join(map(str, ids)),
                                 "--generate", str(args.generate), "--device", args.device, "--json"])
    try:
        doc = json.loads(r.stdout)
    except json.JSONDecodeError:
        return {"exit": r.exit_code, "verdict": "no report", "failing": [r.output[-400:]]}
    failing = [f"{f['check']}/{f['target']}: {(f.get('explanation') or '')[:200]}"
               for f in doc["findings"] if f["status"] == "fail"]
    # the engine did not run: engine-vs-reference skipped (layer-localization may skip on a healthy compiled engine,
    # whose hooks see nothing, so it does not count)
    skipped_compute = [f["check"] for f in doc["findings"] if f["status"] == "skip" and f["check"] == "engine-vs-reference"]
    return {"exit": r.exit_code, "verdict": doc["verdict"][:300], "failing": failing, "skipped": skipped_compute}


def _gguf_vocab(path: str) -> int:
    from llmdoctor.gguf.split import open_gguf
    from llmdoctor.reference import from_gguf

    with open_gguf(path) as g:
        return from_gguf(g).n_vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="vllm", help="diagnose --engine")
    ap.add_argument("--python", help="the deployment's interpreter (imports vllm; --engine vllm)")
    ap.add_argument("--model", required=True, help="HF checkpoint folder or a GGUF (the reference; the engine's model)")
    ap.add_argument("--engine-args", default=None, help="`vllm serve` arguments ({dtype} filled in per row)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--lengths", default="16,64,200")
    ap.add_argument("--per-row", type=int, default=20)
    ap.add_argument("--generate", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where the reference and its draws run (diagnose --device)")
    ap.add_argument("--vocab", type=int, default=None, help="ids drawn below this (default: the config's vocab_size)")
    ap.add_argument("--seconds", type=float, default=None, help="stop starting diagnoses after this long")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    if args.engine == "vllm" and not args.python:
        ap.error("--engine vllm needs --python")
    gguf = args.model.endswith(".gguf")
    vocab = args.vocab or (_gguf_vocab(args.model) if gguf else
                           json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    t0, rows = time.perf_counter(), []
    for dtype in ["gguf"] if gguf else args.dtypes.split(","):
        for length in map(int, args.lengths.split(",")):
            rng = random.Random(f"{dtype}-{length}")
            row = {"dtype": dtype, "length": length, "diagnoses": 0, "alarms": 0, "no_compute": 0, "examples": [],
                   "seconds": 0.0}
            started = time.perf_counter()
            for _ in range(args.per_row):
                if args.seconds is not None and time.perf_counter() - t0 > args.seconds:
                    break
                got = diagnose_once(args, dtype, [rng.randrange(vocab) for _ in range(length)])
                if got.get("skipped") or got["verdict"] == "no report":
                    row["no_compute"] += 1  # the engine did not run: not a diagnosis of a healthy engine
                    row["examples"].append(got)
                    continue
                row["diagnoses"] += 1
                if got["verdict"] != "healthy":
                    row["alarms"] += 1
                    row["examples"].append(got)
            row["seconds"] = round(time.perf_counter() - started, 1)
            row["upper95"] = round(clopper_pearson_upper(row["alarms"], row["diagnoses"]), 4) if row["diagnoses"] else None
            rows.append(row)
            print(f"{dtype:9} T={length:<5} diagnoses {row['diagnoses']:4}  alarms {row['alarms']:3}  upper95 "
                  f"{row['upper95']}  not run {row['no_compute']}  ({row['seconds']} s)", flush=True)
            for e in row["examples"][:3]:
                print("    ", json.dumps(e)[:600], flush=True)
    n, k = sum(r["diagnoses"] for r in rows), sum(r["alarms"] for r in rows)
    total = {"diagnoses": n, "alarms": k, "upper95": round(clopper_pearson_upper(k, n), 4) if n else None,
             "seconds": round(time.perf_counter() - t0, 1)}
    print(f"total: {n} diagnoses, {k} alarms, 95% upper {total['upper95']} ({total['seconds']} s)")
    if args.json_out:
        args.json_out.write_text(json.dumps({"rows": rows, "total": total}, indent=1))


if __name__ == "__main__":
    main()
