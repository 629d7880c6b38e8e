#!/usr/bin/env bash
# Issue 23 part 2 on the H200 in one device call: verify against the same-run read rate in all four modes
# (CPU with every core / GPU, cold / warm page cache), with and without the manifest's hashes in the same
# pass, on a >= 30 GB synthetic file written here by bench/bench_verify.py (never carried), with each
# verify child's max RSS; first, CPU and GPU reports compared on a small planted file.
# Carry: build/h23-whl (gguf-0.19.0-py3-none-any.whl: gguf is not in the device image; any gguf-*.whl under
# .whl is used as well). GB=32 by default; BENCH_S bounds the benchmark (520 s: one device call is 600 s).
# Writes under $OUT: steps.txt, env.txt, build.log, bench.log, verify-bench.json, verify-summary.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/llmdoctor-h200-verify}
mkdir -p "$OUT"
t0=$(date +%s)
step() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/steps.txt"; }
whl=$(find build/h23-whl .whl -name 'gguf-*.whl' 2>/dev/null | head -1)
if ! python3 -c "import gguf" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$whl" || { step "no gguf wheel"; exit 1; }
fi
export PYTHONPATH="/tmp/site:$PWD/src" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
step "build the native kernels for this Python"
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1
mkdir -p build
export TMPDIR="$PWD/build"  # the file on the machine's disk (not a tmpfs /tmp, whose pages cannot be evicted)
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g; df -hT /tmp "$TMPDIR"
  python3 -c "import torch, triton; from llmdoctor.gguf import dequant_native as d; from llmdoctor.checks import forensics as f
print('torch', torch.__version__, 'triton', triton.__version__, 'native dequant', d.available(), 'native forensics', f._NATIVE is not None)"
} > "$OUT/env.txt" 2>&1
step "env: $(tail -1 "$OUT/env.txt")"
step "bench: ${GB:-32} GB, cpu and cuda, cold and warm, with and without the manifest"
timeout "${BENCH_S:-520}" python3 bench/bench_verify.py --gb "${GB:-32}" --devices cpu,cuda --manifest --agree-gb 0.3 --keep \
    --out "$OUT" > "$OUT/bench.log" 2>&1
step "bench exit $?"
cat "$OUT/verify-summary.md" 2>/dev/null || tail -20 "$OUT/bench.log"
if [ -f "$TMPDIR/llmdoctor-bench-verify.gguf" ]; then  # kept by --keep: how the warm CPU pass scales with workers
    step "scaling: the CPU pass with 4, 8, 16 workers, warm, without and with the manifest"
    timeout "${SCALE_S:-150}" python3 bench/verify_workers.py "$TMPDIR/llmdoctor-bench-verify.gguf" | tee "$OUT/workers.jsonl"
    timeout 60 python3 bench/verify_workers.py "$TMPDIR/llmdoctor-bench-verify.gguf" --workers 16 --manifest | tee -a "$OUT/workers.jsonl"
fi
rm -f "$TMPDIR/llmdoctor-bench-verify.gguf"
step end
