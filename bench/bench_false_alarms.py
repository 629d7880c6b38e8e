"""False alarms of healthy engines, and the count behind the 1-in-1,000 claim (issue 35 item 2).

A healthy diagnosis here: one randomized draw of the engine's arithmetic (reference/draws.py; it stands for
another machine's healthy engine) judged as the engine against the allowances set by N_DRAWS *other* draws,
exactly as diagnose judges (checks/compute/layers.py `distribution_criteria` with draws, `error_curve`), every
run replaying the float32 reference's discrete choices (DSA keys, MoE experts) as diagnose replays the engine's
(whether a choice is one the scores allow is the dsa-selection and moe-routing checks', not measured here). Any
failing criterion or divergent layer point is a false alarm. A pool of P draws of one configuration gives P
diagnoses (draw j the engine, the N_DRAWS draws after it, cyclically, the allowance): the engines are
independent draws, the allowances overlap (so the P verdicts are not independent; the bound treats them as
if they were). The count is reported with its 95% Clopper-Pearson upper bound per engine, dtype and length.

Engines (their arithmetic as diagnose emulates it, Engine.noise_budget): "transformers" in float32 (float32
rounded stochastically), bfloat16 and float16 (the reference in that dtype); "llama.cpp" (float32 with Q8
activations and the F16 KV cache: emulate.LLAMA_CPP_CPU); "vllm-cuda" (the dtype, and vLLM's FP8 DSA indexer).
With --no-replay no run replays another's choices: each draw picks its own keys and experts, as diagnose's
reference and draws do where the engine exposes no activations (vLLM under torch.compile and CUDA graphs), only
the prompt's criteria are judged (family 2T + 1), and those per position count the positions beyond their threshold
against what the draws' own unseen choices explain (layers.py drawn_criteria `unseen`). Models: the demo (Gemma 3
270M Q4_K_M) and the tiny checkpoints of tests/fixtures_hf.py (llama, gemma3, deepseek MLA, glm DSA).

    python bench/bench_false_alarms.py --models tiny-llama,tiny-glm --lengths 16,256,4096 --pool 40
    python bench/bench_false_alarms.py --models demo --engines llama.cpp,transformers --dtypes bfloat16 --lengths 16,64
    python bench/bench_false_alarms.py --models tiny-llama --lengths 32,272 --pool 40 --decode-steps 16
    python bench/bench_false_alarms.py --models tiny-glm,tiny-deepseek --engines vllm-cuda --dtypes bfloat16 --no-replay

Prints one row per configuration and the total; --json-out writes them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in ("tests", "tests/reference"):
    sys.path.insert(0, str(ROOT / p))

from llmdoctor.checks.compute import allowance as A  # noqa: E402
from llmdoctor.checks.compute.layers import CURVE_POINTS, distribution_criteria, error_curve  # noqa: E402
from llmdoctor.diagnose.replay import choices  # noqa: E402
from llmdoctor.reference import load  # noqa: E402
from llmdoctor.reference.draws import draw_dtypes, randomized  # noqa: E402
from llmdoctor.reference.emulate import LLAMA_CPP_CPU, vllm_cuda  # noqa: E402
from llmdoctor.reference.points import REFERENCE_POINTS  # noqa: E402


def clopper_pearson_upper(k: int, n: int, conf: float = 0.95) -> float:
    """The two-sided 95% interval's upper end for k alarms in n: p with P(X <= k | n, p) = 0.025."""
    if k >= n:
        return 1.0
    alpha = (1 - conf) / 2

    def cdf(p: float) -> float:
        return sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
                            + i * math.log(p) + (n - i) * math.log1p(-p)) for i in range(k + 1))

    lo, hi = 0.0, 1.0
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) > alpha else (lo, mid)
    return hi


def model_path(name: str, work: Path) -> Path:
    if name == "demo":
        from llmdoctor.demo import model_path as demo

        return demo()
    import fixtures_hf

    kind = name.removeprefix("tiny-")
    return fixtures_hf.checkpoint(kind, work / kind)[1]


def arithmetic(engine: str, dtype: str, cfg) -> tuple[str, object, bool]:
    """(model dtype, emulation, float32 rounded stochastically) of an engine's draws, as Session.draw; "vllm-cuda":
    vLLM's CUDA arithmetic where it rounds beyond the dtype (its FP8 DSA indexer, e4m3 in blocks of 128)."""
    if engine == "llama.cpp":
        return "float32", LLAMA_CPP_CPU, False
    indexer = cfg.mla is not None and cfg.mla.indexer is not None
    emulate = vllm_cuda(indexer_fp8=128 if indexer else 0) if engine == "vllm-cuda" else None
    return dtype, emulate, dtype == "float32"


def run_config(path: Path, engine: str, dtype: str, length: int, pool: int, seed: int, steps: int = 0,
               replay: bool = True) -> dict:
    """`steps` > 0: the decode-path judgement instead (diagnose/decode.py): the last `steps` rows of each run,
    standing for generated steps, judged against 2 x N_DRAWS other draws of the same tokens kept at the
    reference's columns alone, in a family that counts them and their control too (hypotheses.py `family`); with
    `replay`, the decode steps' activations too (all but the first of those rows, as the decode path judges them
    where the engine exposes them: checks/compute/decode.py `judge_points`).
    `replay` False: every run makes its own discrete choices and only the prompt's criteria are judged, as when
    the engine exposes no activations (vLLM under torch.compile and CUDA graphs)."""
    ref_model = load(path, dtype=torch.float32, cache=True)
    cfg = ref_model.config
    model_dtype, emulate, f32 = arithmetic(engine, dtype, cfg)
    model = ref_model if model_dtype == "float32" else load(path, dtype=getattr(torch, model_dtype), cache=True)
    ids = torch.randint(1, cfg.n_vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    caps = set(REFERENCE_POINTS)
    t0 = time.time()
    ref, ref_caps = ref_model.forward(ids, capture=caps)
    # the discrete choices (DSA keys, MoE experts) every run replays, as diagnose replays the engine's into its
    # reference and draws (diagnose/replay.py): here the reference's own, standing for the healthy engine's
    extra = choices(cfg, ref_caps, length, "cpu") if replay else None
    model.forward(ids, capture=caps, emulate=emulate, extra=extra)  # weights dequantized outside the draws
    runs = []
    for i in range(pool):
        with randomized(seed * 100_000 + i, draw_dtypes(f32)):
            logits, c = model.forward(ids, capture=caps, emulate=emulate, extra=extra)
        runs.append((logits.float(), {k: v for k, v in c.items()}))
    forward_s = (time.time() - t0) / (pool + 2)
    # the engine exposes no activations without replay (compile and graphs): nor layer points nor choices are judged
    n_points = sum(f"{p}-{il}" in ref_caps for il in range(cfg.n_layer) for p in CURVE_POINTS) if replay else 0
    family = 2 * length + 1 + n_points
    rows = slice(length - steps, length) if steps else slice(0, length)
    at = rows if not steps else slice(length - steps + 1, length)  # the points' rows: the decode steps'
    if steps:
        family += 2 * (2 * (steps - 1) + 1) + 2 * n_points  # the decode steps' points and their control's

    def held(caps: dict) -> dict:
        return {k: v[at] for k, v in caps.items() if getattr(v, "ndim", 0) and v.shape[0] == length}
    n_draws = 2 * A.N_DRAWS if steps else A.N_DRAWS
    alarms, worst = [], {}
    for j in range(pool):
        eng_logits, eng_caps = runs[j]
        others = [runs[(j + 1 + k) % pool] for k in range(n_draws)]
        cols = A.columns(ref[rows]) if steps else A.columns(ref, eng_logits)
        draws = [A.summarize(lg[rows], held(cp), ref[rows], held(ref_caps), cols) for lg, cp in others]
        crit = distribution_criteria(eng_logits[rows], ref[rows], others[0][0][rows], draws=draws, cols=cols,
                                     family=family, unseen=not replay)
        curve = [] if not replay else error_curve(held(ref_caps), held(others[0][1]), held(eng_caps), cfg.n_layer,
                                                  points=CURVE_POINTS, draws=draws, family=family)
        failed = [c.name for c in crit if not c.ok] + [f"{p.point}-{p.layer}" for p in curve if p.divergent]
        alarms.append(failed)
        for c in crit:
            worst[c.name] = max(worst.get(c.name, 0.0), c.times)
        worst["layer points"] = max([worst.get("layer points", 0.0)] + [p.ratio for p in curve])
    k = sum(bool(a) for a in alarms)
    return {"model": path.name, "engine": engine, "dtype": dtype if engine != "llama.cpp" else "float32+Q8",
            "length": length, "diagnoses": pool, "false_alarms": k, "upper95": clopper_pearson_upper(k, pool),
            "worst_ratio": worst, "alarms": [a for a in alarms if a][:5], "forward_s": round(forward_s, 2),
            "family": family, "judged": "decode steps" if steps else "prompt", "steps": steps, "replay": replay}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny-llama,tiny-gemma3,tiny-deepseek,tiny-glm")
    ap.add_argument("--engines", default="transformers")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--lengths", default="16,256,1024")
    ap.add_argument("--pool", type=int, default=40, help="draws per configuration (= its diagnoses)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decode-steps", type=int, default=0,
                    help="judge the last N rows as the decode path judges its steps (2 x N_DRAWS draws; pool > that)")
    ap.add_argument("--no-replay", action="store_true",
                    help="every run makes its own DSA / MoE choices, and they are judged (an engine that exposes none)")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            path = model_path(name, Path(tmp))
            for engine in a.engines.split(","):
                for dtype in (a.dtypes.split(",") if engine != "llama.cpp" else ["float32"]):
                    for length in map(int, a.lengths.split(",")):
                        t = time.time()
                        try:
                            r = run_config(path, engine, dtype, length, a.pool, a.seed, a.decode_steps,
                                           not a.no_replay)
                        except Exception as e:  # a configuration that cannot run is said, not hidden
                            print(f"{name} {engine} {dtype} {length}: skipped: {type(e).__name__}: {e}", flush=True)
                            continue
                        r["model"], r["seconds"] = name, round(time.time() - t, 1)
                        rows.append(r)
                        ratios = ", ".join(f"{k} {v:.2g}" for k, v in r["worst_ratio"].items())
                        print(f"{name:14s} {engine:12s} {r['dtype']:10s} T={length:5d}: {r['false_alarms']}/{r['diagnoses']} "
                              f"false alarms (95% upper {r['upper95']:.3f}); worst ratio to allowance: {ratios}; "
                              f"{r['seconds']} s {r['alarms'] or ''}", flush=True)
    n, k = sum(r["diagnoses"] for r in rows), sum(r["false_alarms"] for r in rows)
    print(f"total: {k} false alarms in {n} healthy diagnoses (95% upper bound {clopper_pearson_upper(k, n):.2g})")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"rows": rows, "diagnoses": n, "false_alarms": k}, indent=1))


if __name__ == "__main__":
    main()
