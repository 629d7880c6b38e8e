"""The Python side of bench/h200_vllm.sh (vLLM 0.24.0 on the H200, issue 22): build the models, run the
planted faults, write the summary. Runs with llmdoctor from this tree (PYTHONPATH=src:tests).

    python bench/h200_vllm.py models DIR [--demo GGUF]   # tiny llama + DeepSeek-V3 checkpoints, a tiny llama
                                                         # Q8_0 GGUF, config.json + tokenizer beside each GGUF
    python bench/h200_vllm.py faults PYTHON OUT.json     # the CPU suite's planted faults, under vLLM on CUDA
    python bench/h200_vllm.py summary OUTDIR             # every JSON under OUTDIR -> OUTDIR/summary.md

The models are the ones tests/subjects/engines/test_engine_vllm.py runs on vLLM for CPU (dense heads of 32, DeepSeek-V3 with
its real latent dims); the Q8_0 file is the F32 GGUF converted from the llama checkpoint with its 2-D weights
quantized by gguf-py (issue 22's "tiny llama Q8_0 GGUF").
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "subjects" / "engines"))  # test modules imported by name

WORDS = ["<s>", "<unk>"] + [f"w{i}" for i in range(2, 96)]  # the tiny models' vocabulary (96)


def demo_beside(demo: Path) -> None:
    """config.json and the tokenizer files beside the demo GGUF, as vLLM's GGUF loading wants them
    (the config of the model llmdoctor's transformers engine builds from it; transformers' GGUF tokenizer)."""
    import torch
    import transformers

    from llmdoctor.subjects.engines.transformers import build

    model, _ = build(demo, torch.float32)
    model.config.save_pretrained(demo.parent)
    del model
    transformers.AutoTokenizer.from_pretrained(str(demo.parent), gguf_file=demo.name).save_pretrained(demo.parent)


# A tiny GLM-5 (glm-dsa) for vLLM's sparse MLA (issue 22 part 4): DeepSeek's real latent dims (the MLA
# backends take only head size 576), an indexer of 64 heads x 128 (the shape vLLM's indexer kernels are
# written for) with top-k 128, so that a prompt of DSA_TOKENS ids (200, within the fixture's 256 positions)
# is longer than one selection for its last 72 queries. Top-k 128, not less: vLLM 0.24's conversion of the
# picks to cache slots takes them in tiles of 128 (sparse_utils.triton_convert_req_index_to_global_index:
# "NUM_TOPK_TOKENS (64) must be divisible by BLOCK_N (128)", seen on the H200 2026-12-03 with top-k 64).
# An indexer in every layer, as GLM-5 has: the CPU fixture's "shared" layer (transformers' indexer_types,
# reusing the last full layer's picks) is unknown to vLLM 0.24, which builds an indexer per layer and then
# refuses the checkpoint ("weights not initialized: layers.1...indexer.k_norm", seen on the H200 2026-12-02).
DSA = dict(index_head_dim=128, index_n_heads=64, index_topk=128, indexer_types=["full", "full", "full"])
DSA_TOKENS = [(7 * i + 3) % 96 for i in range(200)]


def dsa_checkpoint(out: Path) -> Path:
    import fixtures_hf
    import fixtures_mla

    fixtures_mla.build("glm", out, **fixtures_hf.REAL_MLA, **DSA)
    ckpt = out / "hf-glm"
    # keys GLM-5's own config.json carries that transformers' GlmMoeDsaConfig does not write: vLLM reads them
    # (deepseek_v2.py: the router's e_score_correction_bias exists only for topk_method noaux_tc, else its
    # loader raises KeyError on it; its router scores by softmax unless scoring_func says sigmoid, which
    # transformers' GlmMoeDsa router and llmdoctor's reference use; the indexer's rotary is interleaved only
    # with indexer_rope_interleave, as transformers' GlmMoeDsaIndexer always is). Seen on the H200 2026-12-02:
    # without topk_method, KeyError. The tiny DeepSeek-V3 of tests/subjects/engines/test_engine_vllm.py sets the same two.
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                                                  "indexer_rope_interleave": True}, indent=2))
    fixtures_hf.with_tokenizer(ckpt, WORDS)
    return ckpt


def models(out: Path, demo: Path | None) -> dict[str, str]:
    import fixtures_hf
    import gguf_builders
    from test_engine_vllm import vllm_checkpoint

    t0 = time.perf_counter()
    llama, llama_gguf = vllm_checkpoint("llama", out / "llama")
    deepseek, _ = vllm_checkpoint("deepseek", out / "deepseek")
    for ckpt in (llama, deepseek):  # a deployment has one (diagnose's front-end checks read it)
        fixtures_hf.with_tokenizer(ckpt, WORDS)
    q8_dir = out / "llama-q8_0"
    q8_dir.mkdir(parents=True, exist_ok=True)
    q8 = gguf_builders.q8_0_copy(llama_gguf, q8_dir / "llama-q8_0.gguf")
    shutil.copy(llama / "config.json", q8_dir / "config.json")
    fixtures_hf.with_tokenizer(q8_dir, WORDS)
    got = {"llama": str(llama), "deepseek": str(deepseek), "llama_q8_0": str(q8)}
    if demo is not None:
        demo_beside(demo)
        got["demo"] = str(demo)
    try:  # last: the other rows do not wait on a transformers that lacks glm_moe_dsa
        got["glm"] = str(dsa_checkpoint(out / "glm"))
    except Exception as e:  # recorded; the dsa lane then fails naming it
        got["glm"] = f"not built: {type(e).__name__}: {e}"
    (out / "models.json").write_text(json.dumps(got, indent=1))
    print(json.dumps(got), f"({time.perf_counter() - t0:.0f} s)")
    return got


# (model kind, projection, rows scaled by 1.5, the point the diagnosis must name, dtypes vLLM runs it in on
# CUDA: no MLA backend takes float32)
PLANTED = [("llama", "q_proj", (0, None), "Qcur", ("bfloat16", "float32")),
           ("deepseek", "kv_a_proj_with_mqa", (512, None), "k_pe", ("bfloat16",))]


def faults(python: str, out: Path, work: Path) -> list[dict]:
    """tests/subjects/engines/test_engine_vllm.py's planted faults (rows of a layer-1 projection scaled by 1.5 in the copy
    the engine loads) under vLLM on CUDA: found when the diagnosis fails at layer 1 naming that point."""
    import fixtures_hf
    from test_engine_vllm import TOKENS, planted_copy, vllm_checkpoint

    from llmdoctor import diagnose as dg

    rows_out = []
    for kind, tensor, rows, point, dtypes in PLANTED:
        src, _ = vllm_checkpoint(kind, work / kind)
        fixtures_hf.with_tokenizer(src, WORDS)
        bad = planted_copy(src, work / f"{kind}-bad", tensor, slice(*rows))
        for dtype in dtypes:
            t0 = time.perf_counter()
            try:
                res = dg.run(dg.Inputs(hf=src, engine="vllm", engine_hf=bad, engine_python=python, engine_dtype=dtype,
                                       token_ids=TOKENS))
            except Exception as e:  # recorded, the next row still runs
                rows_out.append({"model": kind, "dtype": dtype, "error": f"{type(e).__name__}: {e}"})
                print(json.dumps(rows_out[-1]), flush=True)
                continue
            loc = next((f for f in res.findings if f.check == "layer-localization"), None)
            m = loc.metrics if loc else {}
            rows_out.append({"model": kind, "tensor": tensor, "dtype": dtype, "exit_code": res.exit_code,
                             "verdict": res.verdict, "first_divergent_layer": m.get("first_divergent_layer"),
                             "point": m.get("point"), "expected": {"layer": 1, "point": point},
                             "found": res.exit_code == 1 and m.get("first_divergent_layer") == 1
                             and m.get("point") == point, "seconds": round(time.perf_counter() - t0, 1)})
            print(json.dumps(rows_out[-1]), flush=True)
    out.write_text(json.dumps(rows_out, indent=1))
    return rows_out


def dsa_fault(python: str, ckpt: Path, out: Path) -> dict:
    """The tiny GLM-5 with layer 2's indexer head weights negated in the copy vLLM loads (the reference reads
    the original): its indexer then keeps the lowest-scoring keys there, which only dsa-selection can see
    (every reference run attends to the engine's picks). Found when the diagnosis fails dsa-selection at
    layer 2. Run on the H200 2026-12-03: found, 100% of the 72 choosing queries against a limit of 91%."""
    import torch
    from safetensors.torch import load_file, save_file

    from llmdoctor import diagnose as dg

    bad = ckpt.parent / f"{ckpt.name}-indexer-negated"
    shutil.copytree(ckpt, bad, dirs_exist_ok=True)
    name = "model.layers.2.self_attn.indexer.weights_proj.weight"
    for f in bad.glob("*.safetensors"):
        t = load_file(f)
        if name in t:
            t[name] = torch.neg(t[name])
            save_file(t, f, metadata={"format": "pt"})
    t0 = time.perf_counter()
    res = dg.run(dg.Inputs(hf=ckpt, engine="vllm", engine_hf=bad, engine_python=python, engine_dtype="bfloat16",
                           token_ids=DSA_TOKENS, generate=0))
    sel = next((f for f in res.findings if f.check == "dsa-selection"), None)
    row = {"model": "glm-dsa", "tensor": name, "negated": True, "exit_code": res.exit_code, "verdict": res.verdict,
           "dsa_selection": sel.status if sel else None, "metrics": sel.metrics if sel else None,
           "found": bool(sel and sel.status == "fail" and sel.metrics.get("first_layer") == 2),
           "seconds": round(time.perf_counter() - t0, 1)}
    out.write_text(json.dumps([row], indent=1, default=str))  # a list: summary() lists it as planted faults
    print(json.dumps(row, default=str), flush=True)
    return row


def _finding_line(f: dict) -> str:
    nums = {k: v for k, v in (f.get("metrics") or {}).items() if isinstance(v, (int, float, str)) and len(str(v)) < 40}
    why = (f.get("reason") or f.get("explanation") or "")[:200].replace("\n", " ")
    return f"  - {f['check']} [{f.get('subject', '')}] {f['target'] if 'target' in f else ''}: **{f['status']}** " \
           f"{why} {json.dumps(dict(list(nums.items())[:8]))}"


def summary(outdir: Path) -> str:
    """One markdown page: every diagnose / check JSON under `outdir` (verdict, exit code, the findings
    that are not passes, counts), the planted faults, the GPU tests' last line."""
    lines = [f"# vLLM 0.24.0 on the H200: bench/h200_vllm.sh ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", ""]
    for path in sorted(outdir.rglob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            lines.append(f"## {path.name}: unreadable ({e})")
            continue
        if isinstance(doc, list):  # the planted faults
            lines.append(f"## {path.name}")
            lines += [f"- {json.dumps(r)}" for r in doc]
            continue
        if "findings" not in doc:
            continue
        lines.append(f"## {path.name}: {doc.get('verdict')} (exit {doc.get('exit_code')}), counts {doc.get('counts')}")
        fs = doc["findings"]
        if doc.get("schema", "").startswith("llmdoctor.diagnose"):
            keep = [f for f in fs if f["check"] in ("engine-vs-reference", "layer-localization", "engine-backends")
                    or f["status"] == "fail"]
        else:
            keep = [f for f in fs if f["status"] != "pass"]
            by = {}
            for f in keep:  # one line per (subject, status, reason head): check attention has hundreds of cases
                by.setdefault((f.get("subject"), f["status"], (f.get("reason") or "")[:80]), []).append(f)
            keep = [v[0] | {"target": f"{v[0].get('target')} (+{len(v) - 1} more)" if len(v) > 1 else v[0].get("target")}
                    for v in by.values()]
        lines += [_finding_line(f) for f in keep[:40]]
        if doc.get("engine"):
            lines.append(f"  - engine explainer: {json.dumps(doc['engine'])[:400]}")
    for log in sorted(outdir.rglob("*.log")):
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        lines.append(f"- {log.name}: {tail[0][:300]}")
    text = "\n".join(lines) + "\n"
    (outdir / "summary.md").write_text(text)
    return text


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "models":
        demo = Path(args[args.index("--demo") + 1]) if "--demo" in args else None
        models(Path(args[0]), demo)
    elif cmd == "dsa-model":  # the dsa stage's checkpoint alone, for a short pass
        print(dsa_checkpoint(Path(args[0]) / "glm"))
    elif cmd == "faults":
        faults(args[0], Path(args[1]), Path(args[2]) if len(args) > 2 else Path("/tmp/vfaults"))
    elif cmd == "every-type":  # PATH: check dequant's all-types GGUF (tests/gguf_builders.every_type_file)
        from gguf_builders import every_type_file

        print(every_type_file(Path(args[0])))
    elif cmd == "dsa-fault":  # PYTHON CKPT OUT.json
        dsa_fault(args[0], Path(args[1]), Path(args[2]))
    elif cmd == "dsa-tokens":
        print(",".join(map(str, DSA_TOKENS)))
    elif cmd == "summary":
        print(summary(Path(args[0])))
    else:
        sys.exit(f"unknown command {cmd!r}: models | dsa-model | faults | every-type | dsa-fault | dsa-tokens | summary")
