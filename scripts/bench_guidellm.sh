#!/usr/bin/env bash
# guidellm's default sweep (synchronous, throughput, then constant rates between them) against Sluice's
# OpenAI-compatible HTTP API, with front-door queueing on: guidellm's throughput phase opens 512 requests at
# once and does not honour Retry-After, so without `max_queued_requests` every request over the budgets
# (max_active_requests = 256 by default) is a 429 and the phase ends with no successes.
#
# The stack is `sluice up --backend costmodel --model llama-3-8b --emulate-time` (an H100's modelled time per
# round, no GPU); guidellm builds its synthetic prompts with the tiny preset's byte tokenizer (the one admission
# uses for a cost-model stack), read from its local directory. Nothing is downloaded.
#
# guidellm lives in a venv of its own (its pins are not the server's):
#   python3 -m venv /tmp/gllm-venv && /tmp/gllm-venv/bin/pip install torch==2.13.0 guidellm==0.8.1
#   GUIDELLM=/tmp/gllm-venv/bin/guidellm scripts/bench_guidellm.sh
# Knobs (environment): MAX_SECONDS (per benchmark of the sweep, default 20), ISL (prompt tokens, 256),
# OSL (output tokens, 128), OUT (artifact directory), PYTHON (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
GUIDELLM=${GUIDELLM:-guidellm}
PY=${PYTHON:-.venv/bin/python}
MAX_SECONDS=${MAX_SECONDS:-20}; ISL=${ISL:-256}; OSL=${OSL:-128}
OUT=${OUT:-$(mktemp -d /tmp/sluice-bench-guidellm.XXXXXX)}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
cat > "$OUT/sluice.toml" <<'TOML'
[budgets]
max_queued_requests = 1024   # over a budget, wait at the front door (per tenant, first come first admitted)
queue_timeout_s = 600        # for up to 10 minutes, instead of an immediate 429

[tenants.bench]
api_keys = ["sk-sluice-local"]
TOML
source scripts/lib_sluice_up.sh
start_costmodel_stack "$OUT" --config "$OUT/sluice.toml"

echo "== guidellm sweep over HTTP ($ISL in / $OSL out, $MAX_SECONDS s per benchmark) =="
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$GUIDELLM" run \
    --backend "kind=openai_http,target=http://127.0.0.1:$HTTP_PORT,model=llama-3-8b,api_key=sk-sluice-local,request_format=/v1/completions" \
    --profile kind=sweep --constraint "kind=max_duration,seconds=$MAX_SECONDS" \
    --tokenizer "kind=hf_auto,model=$TOKENIZER" --data "kind=synthetic_text,prompt_tokens=$ISL,output_tokens=$OSL" \
    --output "kind=json,path=$OUT/guidellm.json" --disable-progress 2>&1 | tee "$OUT/guidellm.log"
curl -sS "http://127.0.0.1:$HTTP_PORT/metrics" | grep -E '^sluice_admission_(front_queue|http_requests)' \
    > "$OUT/admission_metrics.txt" || true
cat "$OUT/admission_metrics.txt"
echo "artifacts: $OUT"
