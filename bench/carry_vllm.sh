#!/usr/bin/env bash
# Prepare here everything the vLLM GPU pass (bench/h200_vllm.sh) needs on the H200, in folders that one
# device call each can carry (<= 56 MiB beside the ~2 MB working tree; a call carries at most 64 MiB),
# then print the device calls the lead makes back to back (a gap over 30 s between calls loses the
# machine and its /tmp). Recipe: ../shared/notes/vllm-on-h200.md (vLLM 0.24.0 + vllm-gguf-plugin 0.0.5
# for cp312 / torch 2.11+cu130, every wheel --no-deps).
#
#   bash bench/carry_vllm.sh            # download (idempotent), split, check, print the calls
#   bash bench/carry_vllm.sh calls      # print the calls only
#
# Layout under .whl/ (ignored through .git/info/exclude): dl/ the downloads; vllm1..vllmN/ the parts of the
# vLLM wheel (+ its sha256 in vllm1); wheels1..M/ the other wheels; demo1..K/ the parts of the demo GGUF.
set -euo pipefail
cd "$(dirname "$0")/.."
W=.whl
PART=$((55 * 1024 * 1024))  # a part; a folder (part + its sha256) stays under LIMIT
LIMIT=$((56 * 1024 * 1024))
PY=${PY:-/work/venv/bin/python}
DL=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$W/dl")
# the note's list; pins where a later release needs newer neighbours than vLLM 0.24 pins
SPECS=(vllm==0.24.0 xgrammar==0.2.2 gguf==0.19.0 vllm-gguf-plugin==0.0.5 annotated-types anthropic
       apache-tvm-ffi==0.1.9 blake3 cachetools cbor2 compressed-tensors==0.17.0 depyf==0.20.0 diskcache==5.6.3
       distro "fastapi<0.137,>=0.133" flashinfer-python==0.6.12 httpcore2==2.16.2 httpx2 ijson jiter jsonschema
       lark==1.2.2 "llguidance<1.8,>=1.7" lm-format-enforcer==0.11.3 loguru mcp mistral-common
       model-hosting-container-standards msgspec openai openai-harmony opentelemetry-api
       opentelemetry-exporter-otlp opentelemetry-sdk opentelemetry-semantic-conventions-ai outlines-core==0.2.14
       partial-json-parser prometheus-fastapi-instrumentator pybase64 pydantic python-json-logger pyzmq
       setproctitle sniffio starlette truststore typing-inspection watchfiles
       # `vllm serve`'s parser (--engine-args, issue 34) imports the OpenAI server's stack: absent on the H100/H200 host
       uvicorn h11 click python-multipart annotated-doc a2wsgi uvloop httptools email-validator dnspython
       prometheus-client anyio aiohttp aiohappyeyeballs aiosignal frozenlist multidict propcache yarl attrs
       jmespath websockets sse-starlette pydantic-settings python-dotenv pydantic-extra-types referencing rpds-py
       jsonschema-specifications pyjwt cryptography cffi pycparser mcp-types docstring-parser interegular
       opentelemetry-semantic-conventions opentelemetry-proto googleapis-common-protos astor dill pycountry
       rich-toolkit fastapi-cli opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-http
       opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common)

calls() {
    local i=1 d
    echo "# Device calls, back to back (run(command=..., carry=[...], timeout_s=600); a gap over 30 s loses /tmp there):"
    for d in $(ls -d $W/vllm[0-9]* $W/demo[0-9]* $W/wheels[0-9]* | sort -V); do
        echo "call $i: carry=[\"$d\"]  command: bash bench/h200_vllm.sh stash $d"
        i=$((i + 1))
    done
    echo "call $i: carry=[]  command: bash bench/h200_vllm.sh setup     # reassemble, sha256, install, models"
    echo "call $((i + 1)): carry=[]  command: CALL_S=590 bash bench/h200_vllm.sh rows  # the demo GGUF float32 row alone (timeout_s=600)"
    echo "call $((i + 2)): carry=[]  command: ROWS=none bash bench/h200_vllm.sh rest  # the dsa stage and the gpu checks"
    echo "          (kernels incl. every GGUF type, FA MLA probe, GPU tests, planted faults, explainer)"
    echo "call $((i + 3)): carry=[]  command: bash bench/h200_vllm.sh diagnose  # issue 22's whole table again, if time is left"
    echo "# A short pass: the vLLM and wheels carries only (no demo), then \`MODELS=glm bash bench/h200_vllm.sh setup &&"
    echo "#   bash bench/h200_vllm.sh dsa\` (~130 s) or \`MODELS=0 bash bench/h200_vllm.sh setup; bash bench/h200_vllm.sh types\` (~80 s)."
    echo "# Each refused start costs device time (90 s seen): ask \`status\` first and make one call at a time;"
    echo "# several run calls in one message are fine only while a machine is warm (session 8 lost 180 s otherwise)."
}

if [[ "${1:-}" == calls ]]; then calls; exit 0; fi

mkdir -p "$W/dl"
missing=()
for spec in "${SPECS[@]}"; do  # one at a time: a wheel the registry lacks is reported, not fatal
    "$PY" -m pip download -q "${DL[@]}" "$spec" 2>/dev/null || missing+=("$spec")
done
# llguidance 1.7 (structured output only, a LazyLoader import in vLLM 0.24) is absent from this registry
echo "not downloaded: ${missing[*]:-none}"
for spec in "${missing[@]}"; do [[ "$spec" == llguidance* ]] || { echo "needed: $spec" >&2; exit 1; }; done
# pydantic pins pydantic-core exactly: take the version its metadata names
core=$(unzip -p "$W"/dl/pydantic-[0-9]*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([^ ;]*\).*/\1/p')
"$PY" -m pip download -q "${DL[@]}" "pydantic-core==$core"

# the vLLM wheel in parts of PART bytes, one folder each; its sha256 travels in the first
rm -rf "$W"/vllm[0-9]* "$W"/wheels[0-9]* "$W"/demo[0-9]*
vwhl=$(ls "$W"/dl/vllm-0.24.0-*.whl)
tmp=$(mktemp -d)
split -b "$PART" -d -a 2 "$vwhl" "$tmp/vllm.whl.part"
i=1
for p in "$tmp"/vllm.whl.part*; do mkdir -p "$W/vllm$i"; mv "$p" "$W/vllm$i/"; i=$((i + 1)); done
(cd "$W/dl" && sha256sum "$(basename "$vwhl")") > "$W/vllm1/vllm.sha256"

# the demo GGUF (Gemma 3 270M Q4_K_M, llmdoctor's demo) the same way
demo=$("$PY" -c "from llmdoctor.demo import model_path; print(model_path())")
split -b "$PART" -d -a 2 "$demo" "$tmp/demo.gguf.part"
i=1
for p in "$tmp"/demo.gguf.part*; do mkdir -p "$W/demo$i"; mv "$p" "$W/demo$i/"; i=$((i + 1)); done
(cd "$(dirname "$demo")" && sha256sum "$(basename "$demo")") | sed 's/ .*/  demo.gguf/' > "$W/demo1/demo.sha256"
rmdir "$tmp"

# the other wheels, packed greedily (largest first) into folders of at most PART bytes
i=1; used=0; mkdir -p "$W/wheels1"
for f in $(ls -S "$W"/dl/*.whl | grep -v '/vllm-0.24.0-'); do
    sz=$(stat -c %s "$f")
    if (( used + sz > PART )); then i=$((i + 1)); used=0; mkdir -p "$W/wheels$i"; fi
    cp "$f" "$W/wheels$i/"; used=$((used + sz))
done
du -sh "$W"/vllm[0-9]* "$W"/demo[0-9]* "$W"/wheels[0-9]*
for d in "$W"/vllm[0-9]* "$W"/demo[0-9]* "$W"/wheels[0-9]*; do
    (( $(du -sb "$d" | cut -f1) <= LIMIT )) || { echo "$d is over $LIMIT bytes" >&2; exit 1; }
done
calls
