# Two commands on a fresh machine: `make demo` and `make test`. Nothing clever.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PROTOS  := $(wildcard protos/sluice/v1/*.proto)
STAMP   := $(VENV)/.installed

.PHONY: setup protos test lint demo bench fuzz clean

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

setup: $(STAMP) sluice/v1/.stamp

protos: sluice/v1/.stamp

test: setup
	$(BIN)/python -m pytest -q tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy sluice sluice_tools scheduler_svc router_svc admission_svc worker_svc
	$(BIN)/lint-imports

demo: setup
	$(BIN)/python -m sluice_tools.demo

# Benchmarks print JSON; they are never part of `make test`. BENCH_FLAGS=--quick for a short run.
bench: setup
	$(BIN)/python -m scheduler_svc.bench $(BENCH_FLAGS)
	$(BIN)/python -m router_svc.bench $(BENCH_FLAGS)
	$(BIN)/python -m worker_svc.bench $(BENCH_FLAGS)

# The suite's fuzz tests (tests/fuzz) with many more examples: >= 10,000 messages per service.
# Prints the status counts per service; FUZZ_EXAMPLES=N per RPC and kind of input (default 2000).
FUZZ_EXAMPLES ?= 2000
fuzz: setup
	SLUICE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) SLUICE_FUZZ_REPORT=out/fuzz-report.json $(BIN)/python -m pytest -q -s --timeout 3600 tests/fuzz

clean:
	rm -rf $(VENV) sluice/v1 .pytest_cache
