#!/usr/bin/env bash
# The GPU side of llmdoctor in one device call (the lent H200; see notes/device-checks.md):
#   the GPU tests, verify on CUDA against the CPU, check attention's correct and faulty kernels on CUDA
#   in every dtype, and check attention's run-to-run determinism on CUDA (meanwhile, on the same GPU).
# Carry: .whl (gguf 0.19.0, pip-downloaded for cp312) and .devdata (planted.gguf: the verify test's
# planted subset of the demo). Writes at most 8 files under $OUT (the device tool brings back 8).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/llmdoctor-h200}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf-*.whl \
    || exit 1
export PYTHONPATH="/tmp/site:$PWD/src:$PWD/tests" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
step() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/steps.txt"; }

step env
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} > "$OUT/env.txt" 2>&1

step "check attention on CUDA (two presets concurrently)"
K=llmdoctor.faults.attention
KERNELS="$K:prefill=prefill,$K:prefill_blocked=prefill,$K:prefill_last_1024=prefill,$K:mla_decode=mla-decode"
KERNELS="$KERNELS,$K:mla_sparse_decode=mla-sparse-decode,$K:mla_sparse_decode_iterating=mla-sparse-decode"
for preset in glm-5 deepseek-v3; do
    timeout 420 python3 bench/bench_attention_gpu.py run --preset "$preset" --subjects "sdpa-math,sdpa-efficient,$KERNELS" \
        --device cuda --dtype float32,bfloat16,float16 --out "$OUT/attn-$preset.json" > "/tmp/attn-$preset.log" 2>&1 &
done

step "GPU tests"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/gguf/test_dequant_cuda.py tests/reference/test_reference_dense.py \
    tests/reference/test_reference_hf.py tests/reference/test_reference_mla.py tests/checks/kernels/test_check_attention.py > "$OUT/gpu-tests.log" 2>&1
step "GPU tests: $(tail -1 "$OUT/gpu-tests.log")"

step "verify: CUDA against CPU on the planted subset"
python3 - > "$OUT/verify.txt" 2>&1 <<'PY'
import json, subprocess, sys
docs = {}
for dev in ("cpu", "cuda"):
    p = subprocess.run([sys.executable, "-m", "llmdoctor.cli", "verify", ".devdata/planted.gguf", "--device", dev, "--json"],
                       capture_output=True, text=True)
    docs[dev] = json.loads(p.stdout)
    print(dev, "exit", p.returncode, docs[dev]["counts"], p.stderr[-300:])
strip = lambda d: [{k: v for k, v in f.items() if k != "metrics"} for f in d["findings"]]
print("findings identical (metrics aside):", strip(docs["cpu"]) == strip(docs["cuda"]))
print(json.dumps(docs["cuda"]["findings"], indent=1)[:4000])
PY
step "determinism of check attention on CUDA"
timeout 300 python3 bench/bench_determinism.py check-attention --runs "${RUNS:-5}" --load 2 --device cuda \
    > "$OUT/determinism.txt" 2>&1
wait
step "check attention done"
tail -n 4 /tmp/attn-*.log >> "$OUT/steps.txt"
python3 bench/bench_attention_gpu.py table "$OUT"/attn-*.json > "$OUT/attn-table.md" 2>&1

step "end"
