#!/usr/bin/env bash
# The vLLM GPU pass of issue 22 on the lent H200, in stages, one device call each (the calls and their
# carry folders: `bash bench/carry_vllm.sh calls`; the folders: `bash bench/carry_vllm.sh`).
#
#   stash DIR   copy a carried folder (.whl/vllmN, .whl/demoN, .whl/wheelsN) to /tmp/carry
#   setup       reassemble + sha256-check the vLLM wheel and the demo GGUF, install every wheel into
#               /tmp/vsite (--no-deps, ../shared/notes/vllm-on-h200.md), write /tmp/vpy (the deployment's
#               interpreter), build the models (bench/h200_vllm.py models)
#   diagnose    issue 22's table: tiny llama and DeepSeek-V3 checkpoints, the tiny llama Q8_0 GGUF and the
#               demo GGUF, each `diagnose --engine vllm --engine-python /tmp/vpy` in bfloat16 and float32
#               (four engines at a time, each asking for a fifth of the GPU; the fourth lane is the dsa stage)
#   dsa         issue 22 part 4: a tiny GLM-5 under vLLM's sparse MLA in bfloat16, diagnosed with the DSA
#               selection check against vLLM's own indexer picks (the driver's top_k-i captures); then the
#               same with layer 2's indexer head weights negated in the copy vLLM loads (found by that check)
#   types       check dequant --kernel vllm on a GGUF with every type (after setup; MODELS=0 is enough)
#   gpu         vLLM's kernels as subjects (check dequant on the demo, the Q8_0 file and every type, check attention on
#               llama-3-8b, deepseek-v3 and glm-5, the GPU tests of tests/subjects/engines/test_vllm_kernels.py and the engine
#               explainer's) and, meanwhile, the planted faults of the CPU suite under vLLM on CUDA; then
#               summary.md over every stage
#   rows        only the diagnose rows in ROWS (default demo-gguf:float32), with nothing beside them
#   rest        one call for what a first pass left: the diagnose rows in ROWS (default demo-gguf:float32,
#               started first), the dsa stage and the gpu stage side by side
#               (MODELS=0: none; MODELS=glm: the dsa stage's checkpoint alone)
#   args        issue 34 item 1: diagnose rows built from --engine-args (vLLM's defaults: CUDA graphs and
#               torch.compile; fp8 KV; a tokenizer-only --tokenizer folder; a bad flag)
#   configured  issue 34 items 2 and 4 on the GPU: a value frozen at CUDA-graph capture (planted), fp8 KV (healthy and
#               with wrong k/v scales), DeepSeek-V3 chunked and fp8, GLM-5 DSA under the defaults, the tokenizer-only
#               GGUF, a bad flag and a missing model; beside them issue 35's vLLM false-alarm rows (bench_vllm_alarms.py)
#   settle      after configured: the Q8_0 GGUF row eager and with --hf, GLM-5 DSA eager, longer false-alarm rows
#   choices     after settle: the Q8_0 GGUF, GLM-5 DSA and DeepSeek-V3 (200 ids, with fp8 KV) under the defaults again
#   mini        the least for a short pass: the dsa stage (when setup built the models: MODELS=0 skips them),
#               bench/h200_fa_mla_probe.py, the GPU tests
#
# /tmp on that machine outlives a call only while the machine is held (30 s idle): make the calls back to
# back. CALL_S (default 545) is the seconds a stage may take (less where the device time left is less).
# Each stage writes at most 4 files under $OUT (a tarball of its outputs, its summary, its log).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/llmdoctor-vllm}
C=/tmp/carry M=/tmp/vmodels W=/tmp/vout
mkdir -p "$OUT" "$C" "$M" "$W"
export PYTHONPATH="/tmp/site:$PWD/src:$PWD/tests:$PWD/tests/reference:$PWD/tests/subjects/engines" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
TOKENS=3,17,42,5,77,8,23,61,9,30,55,14,2,88,40,19  # tests/subjects/engines/test_engine_vllm.py's TOKENS
stage=${1:?stage: stash DIR | setup | diagnose | dsa | gpu | rows | rest | types | mini | args}
t0=$(date +%s)
step() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$W/$stage.steps"; }
left() { local n=$(( ${CALL_S:-545} - ($(date +%s) - t0) )); echo $(( n > 1 ? n : 1 )); }  # seconds left of this call
cap() { local n=$(left); echo $(( n < $1 ? n : $1 )); }  # at most $1 seconds, within what is left
pack() {  # the stage's folder as one tarball, its steps and summary beside it
    python3 bench/h200_vllm.py summary "$W/$stage" > /dev/null 2>&1
    cp "$W/$stage/summary.md" "$OUT/$stage-summary.md" 2>/dev/null
    cp "$W/$stage.steps" "$OUT/$stage-steps.txt"
    tar czf "$OUT/$stage.tgz" -C "$W" "$stage"
}

diag() {  # name dtype args...: one row of issue 22's table, into $D
    local name=$1 dtype=$2
    shift 2
    timeout "$(left)" python3 -m llmdoctor.cli diagnose "$@" --engine vllm --engine-python /tmp/vpy \
        --engine-dtype "$dtype" --token-ids "$TOKENS" --generate 0 --json-out "$D/$name-$dtype.json" > "$D/$name-$dtype.log" 2>&1
    step "$name $dtype: exit $?"
}

lanes() {  # the rows of ROWS (name:dtype ..., default demo-gguf:float32; "none": none), each in the background, into $D
    for row in ${ROWS:-demo-gguf:float32}; do
        name=${row%%:*} dtype=${row#*:}
        case $name in
        demo-gguf) diag "$name" "$dtype" --gguf "$M/demo/demo.gguf" & ;;
        llama-q8_0-gguf) diag "$name" "$dtype" --gguf "$M/llama-q8_0/llama-q8_0.gguf" & ;;
        llama-hf) diag "$name" "$dtype" --hf "$M/llama/hf-llama" & ;;
        deepseek-hf) diag "$name" "$dtype" --hf "$M/deepseek/hf-deepseek" & ;;
        none) ;;
        *) step "unknown row $row" ;;
        esac
    done
}

crow() {  # name PYTHON "ARGS" [diagnose options]: one row into $D, vLLM built from ARGS (`vllm serve` arguments) under PYTHON
    local name=$1 py=$2 args=$3
    shift 3
    timeout "$(left)" python3 -m llmdoctor.cli diagnose --engine vllm --engine-python "$py" --engine-args "$args" \
        "$@" ${DIAG_EXTRA:-} --json-out "$D/$name.json" > "$D/$name.log" 2>&1
    step "$name: exit $?"
}

alarms() {  # DTYPE LENGTHS: issue 35's vLLM false-alarm rows for tiny llama into $D (bench_vllm_alarms.py)
    timeout "$(left)" python3 bench/bench_vllm_alarms.py --python /tmp/vpy --model "$M/llama/hf-llama" --dtypes "$1" \
        --lengths "$2" --per-row "${ALARMS_PER_ROW:-30}" --seconds "$(( $(left) - 40 ))" \
        --json-out "$D/vllm-alarms-$1.json" > "$D/vllm-alarms-$1.log" 2>&1
    step "vLLM false alarms $1: $(tail -1 "$D/vllm-alarms-$1.log")"
}

dsa() {  # DIR: issue 22 part 4, the tiny GLM-5 (real MLA dims, indexer 64 x 128, top-k 128) under vLLM's sparse MLA
    step "glm-dsa bfloat16 (vLLM's sparse MLA, the DSA check against its own indexer picks)"
    timeout "$(left)" python3 -m llmdoctor.cli diagnose --hf "$M/glm/hf-glm" --engine vllm --engine-python /tmp/vpy \
        --engine-dtype bfloat16 --token-ids "$(python3 bench/h200_vllm.py dsa-tokens)" --generate 0 \
        --json-out "$1/glm-dsa-bfloat16.json" 2>&1 | tee "$OUT/glm-dsa-bfloat16.log" > "$1/glm-dsa-bfloat16.log"
    step "glm-dsa bfloat16: exit ${PIPESTATUS[0]}"
    step "glm-dsa planted: layer 2's indexer head weights negated in the copy vLLM loads"
    timeout "$(left)" python3 bench/h200_vllm.py dsa-fault /tmp/vpy "$M/glm/hf-glm" "$1/glm-dsa-planted.json" \
        > "$1/glm-dsa-planted.log" 2>&1
    step "glm-dsa planted: exit $? $(grep -o '"found": [a-z]*' "$1/glm-dsa-planted.json" 2>/dev/null)"
}

dequant_vllm() {  # FILE: vLLM's GGUF dequant (the plugin's CUDA op, or its Triton kernels) on every block, into $G
    local n
    n=$(basename "$1" .gguf)
    timeout "$(cap 220)" python3 -m llmdoctor.cli check dequant "$1" --kernel vllm --device cuda --all \
        --json-out "$G/dequant-$n.json" > "$G/dequant-$n.log" 2>&1
    step "check dequant $n: exit $?"
}

types() {  # every quantized type the plugin dequantizes (and the ones it does not: skipped with its table)
    step "every type: $(python3 bench/h200_vllm.py every-type /tmp/vmodels/every_type.gguf 2>&1 | tail -1)"
    (export PYTHONPATH="$PYTHONPATH:/tmp/vsite"; dequant_vllm /tmp/vmodels/every_type.gguf)
}

gpu_checks() {  # vLLM's kernels as subjects, the GPU tests, the explainer, the planted faults, into $G
    step "planted faults under vLLM (meanwhile)"
    LLMDOCTOR_VLLM_GPU_MEMORY_UTILIZATION=0.25 timeout "$(left)" python3 bench/h200_vllm.py faults /tmp/vpy \
        "$G/planted-faults.json" /tmp/vfaults > "$G/planted-faults.log" 2>&1 &
    export PYTHONPATH="$PYTHONPATH:/tmp/vsite"  # vLLM's kernels run in llmdoctor's own process from here on
    mkdir -p /tmp/vbin && ln -sf /tmp/vpy /tmp/vbin/python && export PATH="/tmp/vbin:$PATH"  # the explainer's `python`
    step "check attention x3 (meanwhile)"
    ca() {  # preset dtypes
        timeout "$(left)" python3 -m llmdoctor.cli check attention --preset "$1" --subjects vllm --device cuda --dtype "$2" \
            --json-out "$G/attention-$1.json" > "$G/attention-$1.log" 2>&1
        step "check attention $1 $2: exit $?"
    }
    ca llama-3-8b bfloat16,float32 &
    ca deepseek-v3 bfloat16 &
    ca glm-5 bfloat16 &
    step "FlashAttn MLA's NaN: adapter or kernel (meanwhile)"
    timeout "$(cap 200)" python3 bench/h200_fa_mla_probe.py "$G/fa-mla-probe.json" > "$G/fa-mla-probe.log" 2>&1 &
    step "check dequant"
    for f in "$M/llama-q8_0/llama-q8_0.gguf" "$M/demo/demo.gguf"; do
        dequant_vllm "$f"
    done
    types
    step "GPU tests"
    timeout "$(cap 180)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/subjects/engines/test_vllm_kernels.py > "$G/gpu-tests.log" 2>&1
    step "GPU tests: $(grep -E 'passed|failed|skipped|error' "$G/gpu-tests.log" | tr '\n' ' ')"
    step "the engine explainer's selection on this GPU"
    timeout "$(cap 90)" python3 - > "$G/explainer.txt" 2>&1 <<'PY'
import json
from llmdoctor.subjects.engines import vllm
for head, dtype, mla, sparse in [(128, "bfloat16", False, False), (128, "float32", False, False), (192, "bfloat16", False, False),
                                 (576, "bfloat16", True, False), (576, "float32", True, False), (576, "bfloat16", True, True)]:
    try:
        got = vllm.select("/tmp/vpy", head, dtype, use_mla=mla, use_sparse=sparse)
    except Exception as e:
        got = {"raised": f"{type(e).__name__}: {e}"}
    print(head, dtype, "mla" if mla else "dense", "sparse" if sparse else "", json.dumps(got, default=str)[:600])
PY
}

case "$stage" in
stash)
    src=${2:?stash DIR}
    cp -r "$src"/. "$C"/ && ls -la "$C" | tee "$OUT/stash.txt"
    df -h /tmp | tail -1 >> "$OUT/stash.txt"
    ;;

setup)
    mkdir -p "$W/setup" "$M/demo"
    step "reassemble and check"
    (cd "$C" && cat vllm.whl.part* > "$(awk '{print $2}' vllm.sha256)" && sha256sum -c vllm.sha256) \
        > "$W/setup/sha256.txt" 2>&1 || { step "vLLM wheel sha256 FAILED"; pack; exit 1; }
    demo=(--demo "$M/demo/demo.gguf")  # the demo parts may be left out of a pass short of device time
    (cd "$C" && cat demo.gguf.part* > "$M/demo/demo.gguf" && cd "$M/demo" && sha256sum -c "$C/demo.sha256") \
        >> "$W/setup/sha256.txt" 2>&1 || { step "demo sha256 FAILED or not carried (the demo rows will fail)"; demo=(); }
    rm -f "$C"/*.part*
    step "install"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vsite "$C"/*.whl \
        > "$W/setup/pip.log" 2>&1 || { step "pip install into /tmp/vsite FAILED"; pack; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$C"/gguf-*.whl \
        >> "$W/setup/pip.log" 2>&1
    # llguidance (structured output) is not on this registry, yet vLLM 0.24 imports it when its engine starts
    # (vllm/v1/structured_output/backend_guidance.py): inert placeholders let it start; llmdoctor never asks
    # for structured output (measured 2026-12-02: without them every engine run was "No module named 'llguidance'")
    if [ ! -d /tmp/vsite/llguidance ]; then
        mkdir -p /tmp/vsite/llguidance
        for sub in __init__ hf torch numpy; do
            printf '"""placeholder: llguidance is absent; structured output is never used"""\ndef __getattr__(name):\n    return type(name, (), {"__init__": lambda self, *a, **k: None})\n' \
                > /tmp/vsite/llguidance/$sub.py
        done
    fi
    printf '#!/bin/sh\nexport PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0\nexec python3 "$@"\n' > /tmp/vpy
    chmod +x /tmp/vpy
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      /tmp/vpy -c "import vllm, torch, transformers, triton, vllm_gguf_plugin; from importlib.metadata import version as v; print('vllm', vllm.__version__, 'plugin', v('vllm-gguf-plugin'), 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
      PYTHONPATH="$PYTHONPATH:/tmp/vsite" python3 -c "import vllm.vllm_flash_attn, vllm.v1.attention.ops.flashmla as f; print('in-process: flash_attn ok; flashmla dense', f.is_flashmla_dense_supported(), 'sparse', f.is_flashmla_sparse_supported())"
    } > "$W/setup/env.txt" 2>&1
    [ "${MODELS:-1}" = 0 ] && { step "models skipped (MODELS=0)"; pack; exit 0; }
    if [ "${MODELS:-1}" = glm ]; then  # the dsa stage's checkpoint alone (a short pass)
        step "glm model only (MODELS=glm): $(timeout "$(left)" python3 bench/h200_vllm.py dsa-model "$M" 2>&1 | tail -1)"
        pack; exit 0
    fi
    step "models"
    timeout "$(left)" python3 bench/h200_vllm.py models "$M" "${demo[@]}" > "$W/setup/models.log" 2>&1 \
        || step "models FAILED: $(tail -1 "$W/setup/models.log")"
    step "end"
    pack
    ;;

diagnose)
    D="$W/diagnose"
    mkdir -p "$D"
    export LLMDOCTOR_VLLM_GPU_MEMORY_UTILIZATION=0.2
    step "four lanes (the fourth: the dsa stage)"
    diag demo-gguf bfloat16 --gguf "$M/demo/demo.gguf" &  # ~420 s here: its float32 row runs in `rest`
    { diag llama-hf bfloat16 --hf "$M/llama/hf-llama"; diag llama-hf float32 --hf "$M/llama/hf-llama"
      diag llama-q8_0-gguf bfloat16 --gguf "$M/llama-q8_0/llama-q8_0.gguf"; } &
    { diag deepseek-hf bfloat16 --hf "$M/deepseek/hf-deepseek"; diag deepseek-hf float32 --hf "$M/deepseek/hf-deepseek"
      diag llama-q8_0-gguf float32 --gguf "$M/llama-q8_0/llama-q8_0.gguf"; } &
    dsa "$D" &
    wait
    step "end"
    pack
    ;;

dsa)
    mkdir -p "$W/dsa"
    dsa "$W/dsa"
    pack
    ;;

gpu)
    G="$W/gpu"
    mkdir -p "$G"
    gpu_checks
    wait
    step "end"
    pack
    python3 bench/h200_vllm.py summary "$W" > /dev/null 2>&1 && cp "$W/summary.md" "$OUT/summary.md"
    ;;

rows)  # only the diagnose rows in ROWS (default demo-gguf:float32), each in a lane of its own, nothing beside them
    D="$W/rows"
    export LLMDOCTOR_VLLM_GPU_MEMORY_UTILIZATION=0.2
    mkdir -p "$D"
    lanes
    wait
    step "end"
    pack
    ;;

rest)  # after diagnose: the rows still open (ROWS="demo-gguf:float32 ..."), the dsa stage, the gpu stage, in one call
    G="$W/rest" D="$W/rest"
    export LLMDOCTOR_VLLM_GPU_MEMORY_UTILIZATION=0.2
    mkdir -p "$G"
    lanes
    dsa "$D" &
    gpu_checks
    wait
    step "end"
    pack
    python3 bench/h200_vllm.py summary "$W" > /dev/null 2>&1 && cp "$W/summary.md" "$OUT/summary.md"
    ;;

args)  # issue 34 item 1 on the H200 (after setup): --engine-args, the user's `vllm serve` line, parsed by vLLM 0.24's parser
    D="$W/args"
    mkdir -p "$D" "$M/tok-only"
    cp "$M/llama-q8_0"/tokenizer*.json "$M/tok-only/" 2>/dev/null  # a folder of tokenizer files alone
    export LLMDOCTOR_VLLM_GPU_MEMORY_UTILIZATION=0.2
    argrow() {  # name "ARGS" [diagnose options]: one row, vLLM built from ARGS
        local name=$1 args=$2
        shift 2
        timeout "$(left)" python3 -m llmdoctor.cli diagnose --engine vllm --engine-python /tmp/vpy --engine-args "$args" \
            --token-ids "$TOKENS" --generate 0 "$@" --json-out "$D/$name.json" > "$D/$name.log" 2>&1
        step "$name: exit $?"
    }
    step "rows, two lanes"
    { diag llama-hf bfloat16 --hf "$M/llama/hf-llama"  # eager, as before (the refactor's check)
      argrow llama-defaults "$M/llama/hf-llama --dtype bfloat16"  # vLLM's defaults: CUDA graphs, torch.compile
      argrow llama-fp8kv "$M/llama/hf-llama --dtype bfloat16 --kv-cache-dtype fp8"; } &
    { argrow deepseek-defaults "$M/deepseek/hf-deepseek --dtype bfloat16"
      argrow q8-tok-only "$M/llama-q8_0/llama-q8_0.gguf --tokenizer $M/tok-only --dtype bfloat16"
      argrow bad-flag "$M/llama/hf-llama --no-such-flag"; } &
    # a prompt of 200 ids (the tiny models hold 256 positions) in prefill chunks of 64 under graphs + compile
    LONG=$(python3 -c "print(','.join(str((7 * i * i + 3 * i + 1) % 96) for i in range(200)))")
    { argrow llama-long-chunked "$M/llama/hf-llama --dtype bfloat16 --max-num-batched-tokens 64 --max-num-seqs 16" \
          --token-ids "$LONG"
      argrow deepseek-long-chunked "$M/deepseek/hf-deepseek --dtype bfloat16 --max-num-batched-tokens 64 --max-num-seqs 16" \
          --token-ids "$LONG"; } &
    wait
    step "end"
    pack
    ;;

configured)  # issue 34 items 2 and 4 on the GPU (after setup), and issue 35's vLLM rows: six lanes, 0.12 of the GPU each
    D="$W/configured"
    mkdir -p "$D" "$M/tok-only"
    cp "$M/llama-q8_0"/tokenizer*.json "$M/tok-only/" 2>/dev/null
    export LLMDOCTOR_VLLM_GPU_MEMORY_UTILIZATION=0.12
    [ -d "$M/llama-bad-scales" ] || python3 -c "import sys; from pathlib import Path; from vllm_plants import wrong_kv_scales_copy as w; w(Path(sys.argv[1]), Path(sys.argv[2]))" \
        "$M/llama/hf-llama" "$M/llama-bad-scales"
    # the plant's interpreter: vllm_plants.py as sitecustomize first on its path (the engine is broken by the bench)
    python3 -c "import sys; from pathlib import Path; from vllm_plants import plant_env; plant_env(sys.argv[1], Path(sys.argv[2]))" \
        graph-frozen-scale /tmp/plant-graph
    printf '#!/bin/sh\nexport PYTHONPATH=/tmp/plant-graph:/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0\nexec python3 "$@"\n' > /tmp/vpy-plant
    chmod +x /tmp/vpy-plant
    LONG=$(python3 -c "print(','.join(str((7 * i * i + 3 * i + 1) % 96) for i in range(200)))")
    step "six lanes"
    { crow graph-frozen-scale /tmp/vpy-plant "$M/llama/hf-llama --dtype bfloat16" --token-ids "$TOKENS" --generate 4
      crow llama-fp8kv /tmp/vpy "$M/llama/hf-llama --dtype bfloat16 --kv-cache-dtype fp8" --token-ids "$TOKENS" --generate 4
      crow llama-bad-scales /tmp/vpy "$M/llama-bad-scales --dtype bfloat16 --kv-cache-dtype fp8" --hf "$M/llama/hf-llama" \
          --token-ids "$TOKENS" --generate 0; } &
    { crow deepseek-long-chunked /tmp/vpy "$M/deepseek/hf-deepseek --dtype bfloat16 --max-num-batched-tokens 64 --max-num-seqs 16" \
          --token-ids "$LONG" --generate 0
      crow deepseek-fp8kv /tmp/vpy "$M/deepseek/hf-deepseek --dtype bfloat16 --kv-cache-dtype fp8" --token-ids "$TOKENS" --generate 4; } &
    { crow glm-dsa-defaults /tmp/vpy "$M/glm/hf-glm --dtype bfloat16" --token-ids "$(python3 bench/h200_vllm.py dsa-tokens)" --generate 0
      crow glm-dsa-fp8kv /tmp/vpy "$M/glm/hf-glm --dtype bfloat16 --kv-cache-dtype fp8" --token-ids "$(python3 bench/h200_vllm.py dsa-tokens)" --generate 0; } &
    { crow q8-tok-only /tmp/vpy "$M/llama-q8_0/llama-q8_0.gguf --tokenizer $M/tok-only --dtype bfloat16" --token-ids "$TOKENS" --generate 0
      crow bad-flag /tmp/vpy "$M/llama/hf-llama --no-such-flag" --token-ids "$TOKENS" --generate 0
      crow missing-model /tmp/vpy "$M/no-such-model --dtype bfloat16" --token-ids "$TOKENS" --generate 0; } &
    for dt in bfloat16 float32; do alarms $dt 16,64,200 & done  # issue 35's vLLM rows, one lane per dtype
    wait
    step "end"
    pack
    ;;

settle)  # after `configured`: the rows it left unsettled, each with one thing changed, and more false-alarm rows
    D="$W/settle"
    mkdir -p "$D" "$M/tok-only"
    cp "$M/llama-q8_0"/tokenizer*.json "$M/tok-only/" 2>/dev/null
    export LLMDOCTOR_VLLM_GPU_MEMORY_UTILIZATION=0.15
    step "five lanes"
    { crow q8-tok-only-eager /tmp/vpy "$M/llama-q8_0/llama-q8_0.gguf --tokenizer $M/tok-only --dtype bfloat16 --enforce-eager" \
          --token-ids "$TOKENS" --generate 0
      crow q8-with-hf /tmp/vpy "$M/llama-q8_0/llama-q8_0.gguf --tokenizer $M/tok-only --dtype bfloat16" --hf "$M/llama/hf-llama" \
          --token-ids "$TOKENS" --generate 0; } &
    crow glm-dsa-eager /tmp/vpy "$M/glm/hf-glm --dtype bfloat16 --enforce-eager" --token-ids "$(python3 bench/h200_vllm.py dsa-tokens)" \
        --generate 0 &
    alarms bfloat16 64,200 &
    alarms float32 64,200 &
    wait
    step "end"
    pack
    ;;

choices)  # after settle: the rows it explained, again with what followed (2026-12-06): a fault no rung clears is localized,
    # and a model whose choices the compiled engine hides is judged by counting positions (layers.py `unseen`)
    D="$W/choices"
    mkdir -p "$D" "$M/tok-only"
    cp "$M/llama-q8_0"/tokenizer*.json "$M/tok-only/" 2>/dev/null
    export LLMDOCTOR_VLLM_GPU_MEMORY_UTILIZATION=0.15
    LONG=$(python3 -c "print(','.join(str((7 * i * i + 3 * i + 1) % 96) for i in range(200)))")
    step "lanes: ${CHOICES:=q8 glm deepseek alarms} (${DIAG_EXTRA:-})"
    [[ $CHOICES == *q8* ]] && crow q8-tok-only-defaults /tmp/vpy "$M/llama-q8_0/llama-q8_0.gguf --tokenizer $M/tok-only --dtype bfloat16" \
        --token-ids "$TOKENS" --generate 0 &
    [[ " $CHOICES " == *" glm "* ]] && crow glm-dsa-defaults /tmp/vpy "$M/glm/hf-glm --dtype bfloat16" \
        --token-ids "$(python3 bench/h200_vllm.py dsa-tokens)" --generate 0 &
    [[ $CHOICES == *glmfp8* ]] && crow glm-dsa-defaults-fp8kv /tmp/vpy "$M/glm/hf-glm --dtype bfloat16 --kv-cache-dtype fp8" \
        --token-ids "$(python3 bench/h200_vllm.py dsa-tokens)" --generate 0 &
    [[ $CHOICES == *deepseek* ]] && { crow deepseek-defaults /tmp/vpy "$M/deepseek/hf-deepseek --dtype bfloat16" --token-ids "$LONG" --generate 4
      crow deepseek-defaults-fp8kv /tmp/vpy "$M/deepseek/hf-deepseek --dtype bfloat16 --kv-cache-dtype fp8" --token-ids "$LONG" \
          --generate 0; } &
    [[ $CHOICES == *alarms* ]] && alarms bfloat16 64,200 &
    wait
    step "end"
    pack
    ;;

types)  # after setup (MODELS=0 is enough): check dequant --kernel vllm on every GGUF type, written straight
    G="$OUT"  # to $OUT (what a call cut short at the device budget's end leaves there still comes back)
    types
    step "end"
    ;;

mini)  # the least a short pass needs after setup: the dsa stage, the FlashAttn MLA probe and the GPU tests
    G="$W/mini"
    mkdir -p "$G"
    export LLMDOCTOR_VLLM_GPU_MEMORY_UTILIZATION=0.3
    [ -d "$M/glm/hf-glm" ] && dsa "$G" &
    export PYTHONPATH="$PYTHONPATH:/tmp/vsite"
    step "FlashAttn MLA's NaN: adapter or kernel"
    timeout "$(left)" python3 bench/h200_fa_mla_probe.py "$G/fa-mla-probe.json" > "$G/fa-mla-probe.log" 2>&1
    step "probe: exit $?"
    timeout "$(left)" python3 -m pytest -q -m gpu -p no:cacheprovider tests/subjects/engines/test_vllm_kernels.py > "$G/gpu-tests.log" 2>&1
    step "GPU tests: $(grep -E 'passed|failed|skipped|error' "$G/gpu-tests.log" | tr '\n' ' ')"
    wait
    step "end"
    pack
    ;;

*)
    echo "unknown stage $stage (stash DIR | setup | diagnose | dsa | gpu | rows | rest | types | mini | args | configured | settle | choices)" >&2
    exit 2
    ;;
esac
