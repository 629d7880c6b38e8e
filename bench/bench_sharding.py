"""check sharding on a GLM-5-shaped model: the tensor-parallel forward over T ranks, every planted fault.

    python bench/bench_sharding.py [--tp 8] [--device cuda] [--layers 3] [--experts 16] [--hidden 6144] ...

Writes a random-weight glm-dsa GGUF (F32) with tests/fixtures_mla.py's converter: GLM-5's attention
dims (64 heads, q_lora 2048, kv_lora 512, qk_nope 192, qk_rope 64, v 256, DSA indexer 32 x 128, top-k
2048: checks/kernels/attention_shapes.py's glm-5 preset, issue 6), and hidden size, FFN, expert sizes and vocabulary
from the arguments (defaults believed to be GLM-5's: 6144, 12288, 2048 per expert, 8 used, 154880;
--experts reduces the expert count to fit memory: 16 experts x 3 layers is ~25 GB in float32). Then
`check sharding` with the vLLM rules (experts split by intermediate size) and the four generic faults,
and with expert parallelism (vllm-ep) and the experts fault. Prints one JSON object: per run the
wall time, per plan the first divergence and the largest share of the budget the correct plan used.
On the dev CPU: `--tiny` (small dims, T=2, gloo) checks the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reference"))  # test modules imported by name


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--ffn", type=int, default=12288)
    ap.add_argument("--expert-ffn", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=154880)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--tiny", action="store_true", help="small dims, T=2 on the CPU: checks the script")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import fixtures_mla as fx

    from llmdoctor.checks.file import sharding
    from llmdoctor.faults.sharding import plant

    dims = dict(hidden_size=args.hidden, intermediate_size=args.ffn, moe_intermediate_size=args.expert_ffn,
                num_hidden_layers=args.layers, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
                n_routed_experts=args.experts, num_experts_per_tok=min(8, args.experts), n_group=1, topk_group=1,
                kv_lora_rank=512, q_lora_rank=2048, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256,
                index_n_heads=32, index_head_dim=128, index_topk=2048, vocab_size=args.vocab,
                indexer_types=["full"] * args.layers)
    if args.tiny:
        dims.update(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
                    num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
                    v_head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=8, vocab_size=512,
                    n_routed_experts=8, num_experts_per_tok=2)
        args.tp, args.device = 2, "cpu"
    out: dict = {"dims": dims, "tp": args.tp, "device": args.device, "runs": []}
    with tempfile.TemporaryDirectory(prefix="bench-sharding-", dir=os.environ.get("BENCH_DIR")) as tmp:
        t0 = time.perf_counter()
        f = fx.build("glm", Path(tmp), **dims)
        out["write_s"] = time.perf_counter() - t0
        out["file_gb"] = f.gguf_path.stat().st_size / 1e9
        del f.model, f.checkpoint
        generic = ["sharding-heads-permuted", "sharding-kv-b-latent-axis", "sharding-vocab-offset",
                   "sharding-missing-all-reduce"]
        for rules, faults in (("vllm", generic), ("vllm-ep", ["sharding-experts-wrong-rank"])):
            t0 = time.perf_counter()
            res = sharding.run(f.gguf_path, args.tp, rules=rules, n_tokens=args.tokens, device=args.device,
                               faults=faults, plant=plant)
            used = [x.metrics["max_over_budget"] for x in res.findings
                    if x.subject == "rules" and "max_over_budget" in x.metrics]
            out["runs"].append({
                "rules": rules, "wall_s": time.perf_counter() - t0, "reference_s": res.reference.seconds,
                "correct_plan_budget_use": max(used),
                "plans": [{"plan": p.plan, "seconds": p.seconds,
                           "first": None if p.first is None else {k: p.first[k] for k in ("point", "explained_by")}}
                          for p in res.plans]})
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
