#!/usr/bin/env bash
# A third-party benchmark (NVIDIA's aiperf, unmodified) against Sluice's OpenAI-compatible HTTP API,
# and `sluice bench` (gRPC) at the same load on the same stack, for comparison.
#
# The stack is `sluice up --backend costmodel --model llama-3-8b --emulate-time` (an H100's modelled
# time per round, no GPU). aiperf counts tokens with the tiny preset's byte tokenizer (the one admission
# uses for a cost-model stack: one token per byte), read from its local directory; its prompts come
# from the corpus shipped in the aiperf package. Nothing is downloaded. (HF_HUB_OFFLINE must stay
# unset: in offline mode aiperf 0.13.0 takes a directory for a hub cache id and fails.)
#
# aiperf's dependencies clash with the server pins (prometheus-client), so it lives in a venv of its own:
#   python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf==0.13.0   # = sluice[bench]
#   AIPERF=/tmp/aiperf-venv/bin/aiperf scripts/bench_openai.sh
# Knobs (environment): RATE (requests/s, Poisson, default 4), N (requests, 200), ISL (prompt tokens, 256),
# OSL (output tokens, 128), OUT (artifact directory), PYTHON (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
AIPERF=${AIPERF:-aiperf}
PY=${PYTHON:-.venv/bin/python}
RATE=${RATE:-4}; N=${N:-200}; ISL=${ISL:-256}; OSL=${OSL:-128}
OUT=${OUT:-$(mktemp -d /tmp/sluice-bench-openai.XXXXXX)}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
source scripts/lib_sluice_up.sh
start_costmodel_stack "$OUT"

echo "== aiperf over HTTP (rate $RATE/s Poisson, $N requests, $ISL in / $OSL out) =="
HF_DATASETS_OFFLINE=1 "$AIPERF" profile \
    --model llama-3-8b --url "http://127.0.0.1:$HTTP_PORT" --endpoint-type completions --streaming \
    --api-key sk-sluice-local --tokenizer "$TOKENIZER" \
    --request-rate "$RATE" --arrival-pattern poisson --request-count "$N" --random-seed 0 \
    --prompt-input-tokens-mean "$ISL" --prompt-input-tokens-stddev 0 \
    --prompt-output-tokens-mean "$OSL" --prompt-output-tokens-stddev 0 --extra-inputs ignore_eos:true \
    --no-server-metrics --ui-type none --output-artifact-dir "$OUT/aiperf" 2>&1 | tee "$OUT/aiperf.log"

echo "== sluice bench over gRPC (the same load) =="
"$PY" -m sluice_tools.cli bench "synthetic:poisson?rate=$RATE&n=$N&input=fixed:$ISL&output=fixed:$OSL" \
    --target "127.0.0.1:$GRPC_PORT" --seed 0 --json "$OUT/sluice_bench.json" 2>&1 | tee "$OUT/sluice_bench.log"
echo "artifacts: $OUT"
