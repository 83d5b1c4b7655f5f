# Sourced by the third-party benchmark scripts (bench_openai.sh, bench_guidellm.sh): start one
# `sluice up --backend costmodel --model llama-3-8b --emulate-time` stack in the background and wait for its banner.
#   start_costmodel_stack OUT [extra `sluice up` flags...]
# Needs PY (the venv's python). Sets GRPC_PORT, HTTP_PORT, UP (its pid) and TOKENIZER (the tiny preset's byte
# tokenizer directory, the one admission uses for a cost-model stack); the stack gets Ctrl-C (SIGINT) on exit.
start_costmodel_stack() {
    local out=$1
    shift
    read -r GRPC_PORT HTTP_PORT < <("$PY" -c "from sluice.redis_server import free_port; print(free_port(), free_port())")
    "$PY" -m sluice_tools.cli up --backend costmodel --model llama-3-8b --emulate-time --port "$GRPC_PORT" \
        --http-port "$HTTP_PORT" --run-dir "$out/run" "$@" > "$out/up.log" 2>&1 &
    UP=$!
    trap 'kill -INT $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
    for _ in $(seq 600); do
        grep -q "Ctrl-C to stop" "$out/up.log" && break
        kill -0 "$UP" 2>/dev/null || { cat "$out/up.log"; exit 1; }
        sleep 0.2
    done
    grep -q "Ctrl-C to stop" "$out/up.log" || { echo "sluice up did not start"; cat "$out/up.log"; exit 1; }
    TOKENIZER=$("$PY" -c "from worker_svc.models import resolve_model; print(resolve_model('tiny'))")
}
