#!/usr/bin/env bash
# `sluice up --autoscale 1:3` under a rising then falling `sluice bench` load (cost model, modelled time).
# Prints what `sluice up` said (scale events, READY sets, retirements) and each bench run's summary.
# Usage: scripts/autoscale_demo.sh [OUT_DIR]   (about 3 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d -t sluice-autoscale-XXXX)}
mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
SLUICE=("$PY" -m sluice_tools.cli)
PORT=$("$PY" -c 'from sluice.redis_server import free_port; print(free_port())')

"${SLUICE[@]}" up --backend costmodel --model llama-3-8b --emulate-time --autoscale 1:3 --port "$PORT" \
    --run-dir "$OUT/run" >"$OUT/up.out" 2>"$OUT/up.err" &
UP=$!
trap 'kill -INT $UP 2>/dev/null || true' EXIT
for _ in $(seq 120); do grep -q "Sluice is up" "$OUT/up.out" 2>/dev/null && break; sleep 1; done
grep -q "Sluice is up" "$OUT/up.out"

bench() {  # NAME SPEC
    "${SLUICE[@]}" bench "$2" --target "127.0.0.1:$PORT" --max-input-tokens 1900 --max-output-tokens 64 \
        --timeout 60 --json "$OUT/$1.json" --name "$1" >"$OUT/$1.txt" 2>&1
    echo "== bench $1: $2"; tail -n 12 "$OUT/$1.txt"
}
# One cost-model H100 replica of llama-3-8b prefills about 30 requests/s of these prompts: the peak needs 3.
bench rising "synthetic:ramp?rate=5&rate_end=70&n=1200&input=lognormal:1500:0.3:1900&output=fixed:64"
bench falling "synthetic:ramp?rate=70&rate_end=1&n=1200&input=lognormal:1500:0.3:1900&output=fixed:64"
sleep 40  # idle: the planner retires what the load no longer needs
kill -INT $UP
wait $UP || true
trap - EXIT
echo "== sluice up (stderr)"
grep -E "autoscale|retired|scheduler started|died|restart|stopped|serving again" "$OUT/up.err" || true
for f in rising falling; do echo "== $f"; grep -E "^(requests|ok|rejected|timed out|cancelled|failed|throughput|TTFT p50|TTFT p99) " "$OUT/$f.txt" | sed "s/  */ /g"; done
echo "outputs in $OUT"
