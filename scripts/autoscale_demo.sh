#!/usr/bin/env bash
# `sluice up --autoscale 1:3` under a rising then falling `sluice bench` load (cost model, modelled time).
# Prints what `sluice up` said (scale events, READY sets, retirements) and each bench run's summary.
# Usage: scripts/autoscale_demo.sh [OUT_DIR]   (about 2 minutes)
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
    "${SLUICE[@]}" bench "$2" --target "127.0.0.1:$PORT" --max-input-tokens 1500 --max-output-tokens 64 \
        --timeout 60 --json "$OUT/$1.json" --name "$1" >"$OUT/$1.txt" 2>&1
    echo "== bench $1: $2"; tail -n 12 "$OUT/$1.txt"
}
bench rising "synthetic:ramp?rate=1&rate_end=30&n=500&input=lognormal:1000:0.5:1500&output=fixed:64"
bench falling "synthetic:ramp?rate=30&rate_end=1&n=500&input=lognormal:1000:0.5:1500&output=fixed:64"
sleep 40  # idle: the planner retires what the load no longer needs
kill -INT $UP
wait $UP || true
trap - EXIT
echo "== sluice up (stderr)"
grep -E "autoscale|retired|scheduler started|died|restart|stopped" "$OUT/up.err" || true
echo "outputs in $OUT"
