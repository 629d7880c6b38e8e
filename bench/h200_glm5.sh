#!/usr/bin/env bash
# Issue 23 part 1 in one device call (nvidia-h200, <= 10 minutes): bench/bench_glm5.py writes a GLM-5-shaped
# glm-dsa GGUF (6 layers, 48 routed experts, Q4_K_M-like, ~7 GB) on the device's own disk, diagnoses it with
# the reference and transformers on CUDA under --max-gpu-memory 4GB, prints each stage's time, then plants
# one expert's scales and the indexer's weights in the file and checks both are named at their layer.
# Carry: build/h23-whl (gguf-0.19.0-py3-none-any.whl; gguf-py is not in the device image; any gguf-*.whl
# under .whl is used as well). Extra arguments go to
# bench_glm5.py (e.g. --layers 4 --experts 32). Writes env.txt, glm5.txt and the diagnoses' JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/llmdoctor-glm5}
mkdir -p "$OUT"
WHL=$(find build/h23-whl .whl -name 'gguf-*.whl' 2>/dev/null | head -1)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL" || exit 1
export PYTHONPATH="/tmp/site:$PWD/src:$PWD/tests" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# the native CPU kernels (dequant, forensics moments) for the device's Python; without them the torch kernels run
python3 setup.py -q build_ext --inplace > "$OUT/build_ext.txt" 2>&1 || echo "native build failed: torch kernels" >> "$OUT/build_ext.txt"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  nproc; free -g | head -2; df -h /tmp | tail -1
} > "$OUT/env.txt" 2>&1
timeout 570 python3 bench/bench_glm5.py --out /tmp/glm5 --device cuda --budget-s 550 --save "$OUT" "$@" 2>&1 \
    | tee "$OUT/glm5.txt"
rc=${PIPESTATUS[0]}
rm -f /tmp/glm5/*.gguf
exit "$rc"
