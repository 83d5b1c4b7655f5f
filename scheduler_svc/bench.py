"""Benchmark of the scheduler core's per-round cost: `python -m scheduler_svc.bench [--quick] [--profile]`.

Measures the CPU time (time.process_time_ns) of `schedule()` + `on_round_result()` per round in
decode-only rounds at (running, waiting) = (64, 256), (256, 1024), (1024, 4096): block size 16,
prefix caching on, max_num_seqs = running so the waiting requests stay waiting, enough blocks.
Prompt and output lengths come from the Azure LLM 2023 conversation trace in ../shared (clipped
to max_model_len). A pure-Python reference loop timed in the same process lets figures from noisy
runs be normalised. A (64, 4096) case shows that the waiting queue's size does not change the cost.
Small cases (1, 2 and 4 running) measure the fixed cost of a round, which dominates a lightly
loaded replica and the simulator. The collector runs as in the scheduler service: the start-up
heap frozen (as sluice.serve does) and the thresholds of `scheduler_svc.collector` for each case's
max_num_seqs (`--python-gc` keeps CPython's defaults instead); each case reports its full
collections, its cost per running request and p99 / median, and the same rounds pipelined (each
planned while the one before is in flight, as the service and the simulator run them: every request
is placed ahead). After each round the events are taken (not timed), as the driver and the
simulator do. `--running 64,1024,2048` measures other sizes (4x as many waiting); `--cache-rounds N`
only runs N rounds per size for callgrind's cache model (`cache_rounds`). Prints JSON to stdout; `--profile`
adds the top cProfile entries of the largest case and of the 2-running case to stderr. The setup
uses only the core's public API, so this file also measures older checkouts side by side. `core` in the
report says whether the core ran compiled (`make compiled`) or from source (`SLUICE_PURE_PYTHON=1`).
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import gc
import json
import pstats
import random
import statistics
import sys
import time
from collections import deque
from itertools import starmap
from pathlib import Path

from scheduler_svc.collector import tune_collector
from scheduler_svc.core import COMPILED, SchedulerCore
from scheduler_svc.core.config import SchedulerConfig
from sluice.types import NewRequest, RoundPlan, RoundResult, SamplingParams, SeqOutput

TRACE_NAME = "shared/data/traces/azure_llm_2023_conv.csv"
# The shared data sit beside the checkout, or beside the folder of worktrees that holds it.
TRACE = next(
    (folder / TRACE_NAME for folder in Path(__file__).resolve().parents[1:4] if (folder / TRACE_NAME).exists()),
    Path(__file__).resolve().parents[1].parent / TRACE_NAME,
)
CASES = ((64, 256), (256, 1024), (1024, 4096))
SMALL_CASES = ((1, 0), (2, 4), (4, 16))
"""Rounds of a few sequences: what a lightly loaded replica (and the simulator) mostly runs."""
SMALL_ROUNDS = 4000
TARGETS_US = {64: 250.0, 256: 1000.0, 1024: 4500.0}
"""DESIGN.md: a tenth of vLLM's median round cost at the same sizes."""
BLOCK_SIZE = 16
PYTHON_GC_THRESHOLDS = (700, 10, 10)
"""CPython's default collector thresholds."""
MAX_MODEL_LEN = 8192


def load_lengths(seed: int = 0) -> tuple[list[tuple[int, int]], str]:
    """Return (prompt, output) length pairs and where they came from.

    Falls back to a fixed seeded lognormal mix only when the trace file is absent.
    """
    if TRACE.exists():
        with TRACE.open(newline="") as handle:
            pairs = [(int(row["ContextTokens"]), int(row["GeneratedTokens"])) for row in csv.DictReader(handle)]
        return pairs, str(TRACE)
    rng = random.Random(seed)
    pairs = [(int(rng.lognormvariate(6.5, 1.0)) + 1, int(rng.lognormvariate(5.0, 1.0)) + 1) for _ in range(20000)]
    return pairs, "synthetic lognormal(6.5, 1.0) prompts / lognormal(5.0, 1.0) outputs, seed 0 (trace file absent)"


def _requests(pairs: list[tuple[int, int]], count: int, rng: random.Random, prefix: str, min_out: int) -> list[NewRequest]:
    """Draw `count` requests whose prompt + max_tokens fit max_model_len and that outlive `min_out` rounds."""
    requests = []
    for i in range(count):
        prompt_len, output_len = rng.choice(pairs)
        max_tokens = min(max(output_len, min_out), MAX_MODEL_LEN // 2)
        prompt_len = max(1, min(prompt_len, MAX_MODEL_LEN - max_tokens))
        # Distinct tokens per request: no accidental prefix sharing inflates the cache.
        base = (i + 1) * 100_003 + len(prefix)
        prompt = tuple(range(base, base + prompt_len))
        requests.append(NewRequest(f"{prefix}{i}", prompt, SamplingParams(max_tokens=max_tokens)))
    return requests


def _answer(plan: RoundPlan) -> RoundResult:
    """The fake executor (not timed): one token per sampled sequence."""
    return RoundResult(
        plan.round_id,
        tuple(SeqOutput(s.request_id, s.epoch, (7 + s.output_index % 1000,) if s.sample else ()) for s in plan.seqs),
    )


def build_core(running: int, waiting: int, rounds: int, pairs: list[tuple[int, int]], seed: int) -> SchedulerCore:
    """Return a core with `running` requests past prefill and decoding and `waiting` queued ones."""
    rng = random.Random(seed)
    active = _requests(pairs, running, rng, "run", rounds + 2)
    blocks = sum(-(-(len(r.prompt_token_ids) + rounds + 2) // BLOCK_SIZE) for r in active) + 64
    config = SchedulerConfig(
        num_blocks=blocks,
        block_size=BLOCK_SIZE,
        # Room for every prompt in one round, so setup is one prefill round and then decodes only.
        max_num_batched_tokens=max(16384, sum(len(r.prompt_token_ids) for r in active)),
        max_num_seqs=running,
        max_prefill_chunk=MAX_MODEL_LEN,
        max_waiting=waiting + running + 1,  # the bound counts what a preemption may requeue
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=True,
    )
    core = SchedulerCore(config)
    for request in active:
        core.submit(request, 0.0)
    # Public API only, so this bench also runs against older cores side by side: prompts are
    # done when nothing waits and no prefill is pending.
    while core.num_waiting or core.stats().queued_prefill_tokens:
        plan = core.schedule(0.0)
        core.on_round_result(_answer(plan), 0.0)
    for request in _requests(pairs, waiting, rng, "wait", 1):
        core.submit(request, 0.0)
    core.take_events()
    return core


def measure(core: SchedulerCore, rounds: int, pipelined: bool = False) -> dict[str, float]:
    """Time `rounds` decode-only rounds; return median/p99 of schedule, result and both (µs).

    Also counts the garbage collector's full (generation 2) collections during the rounds and the
    longest one: they walk every object of the process and are what the p99 mostly is.
    `pipelined`: each round is planned ahead while the one before is in flight (`overlap=True`,
    what the scheduler service and the simulator do by default), so every request is placed ahead.
    """
    sched_ns, result_ns, total_ns = [], [], []
    clock = time.process_time_ns
    full_ms: list[float] = []
    started = [0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started[0] = time.perf_counter_ns()
            else:
                full_ms.append((time.perf_counter_ns() - started[0]) / 1e6)

    gc.collect()
    gc.callbacks.append(on_gc)
    ahead = core.schedule(0.5) if pipelined else None
    try:
        for i in range(rounds):
            now = 1.0 + i * 0.01
            t0 = clock()
            plan = core.schedule(now, overlap=True) if pipelined else core.schedule(now)
            t1 = clock()
            if ahead is not None:  # answer the round in flight; the one just planned is next
                ahead, plan = plan, ahead
            result = _answer(plan)
            t2 = clock()
            core.on_round_result(result, now)
            t3 = clock()
            # As the driver and the simulator do after every round (not timed, like the executor):
            # events left in the core would pile up a token tuple per sequence per round.
            core.take_events()
            assert plan.budget is not None and plan.budget.num_prefill_tokens == 0, "decode-only rounds"
            assert len(plan.seqs) == core.config.max_num_seqs, "every running request in every round"
            sched_ns.append(t1 - t0)
            result_ns.append(t3 - t2)
            total_ns.append(t1 - t0 + t3 - t2)
    finally:
        gc.callbacks.remove(on_gc)
    return {
        "median_us": statistics.median(total_ns) / 1000,
        "p99_us": _p99(total_ns) / 1000,
        "schedule_median_us": statistics.median(sched_ns) / 1000,
        "result_median_us": statistics.median(result_ns) / 1000,
        "gc_full_collections": len(full_ms),
        "gc_full_max_ms": max(full_ms, default=0.0),
    }


def _p99(values: list[int]) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))])


def reference_loop_us(repeats: int = 7) -> float:
    """Return the median µs of a fixed pure-Python loop (dict, list and attribute work), for normalising."""
    samples = []
    for _ in range(repeats):
        start = time.process_time_ns()
        table: dict[int, int] = {}
        items: list[int] = []
        for i in range(100_000):
            table[i & 1023] = i
            items.append(table[i & 511] + i)
        samples.append(time.process_time_ns() - start)
    return statistics.median(samples) / 1000


def _collector(max_num_seqs: int, python_gc: bool) -> tuple[int, int, int]:
    """Set the collector as a scheduler service with `max_num_seqs` runs it (or Python's defaults)."""
    gc.set_threshold(*PYTHON_GC_THRESHOLDS)
    return PYTHON_GC_THRESHOLDS if python_gc else tune_collector(max_num_seqs)


def run(quick: bool, profile: bool, python_gc: bool = False, running_sizes: tuple[int, ...] = ()) -> dict[str, object]:
    """Run every case and return the report (collector as the service sets it, or Python's defaults).

    `running_sizes` replaces the default cases' running counts (each with 4x as many waiting).
    """
    rounds = 40 if quick else 200
    pairs, source = load_lengths()
    reference = reference_loop_us()
    # As sluice.serve does after start-up: what exists now (modules, the length table) is frozen.
    gc.collect()
    gc.freeze()
    cases: list[dict[str, object]] = []
    per_running: list[float] = []
    per_running_ahead: list[float] = []
    cases_run = tuple((n, 4 * n) for n in running_sizes) or CASES
    for running, waiting in cases_run:
        core = build_core(running, waiting, rounds, pairs, seed=running)
        thresholds = _collector(running, python_gc)
        figures = measure(core, rounds)
        cases.append(
            {
                "running": running,
                "waiting": waiting,
                "rounds": rounds,
                **{k: round(v, 1) for k, v in figures.items()},
                "per_running_us": round(figures["median_us"] / running, 3),
                "p99_over_median": round(figures["p99_us"] / figures["median_us"], 2),
                "gc_thresholds": thresholds,
                "target_median_us": TARGETS_US.get(running),
                "median_per_reference_loop": round(figures["median_us"] / reference, 4),
            }
        )
        per_running.append(figures["median_us"] / running)
        del core
        core = build_core(running, waiting, rounds, pairs, seed=running)
        _collector(running, python_gc)
        ahead = measure(core, rounds, pipelined=True)
        cases[-1].update({
            "pipelined_median_us": round(ahead["median_us"], 1),
            "pipelined_p99_us": round(ahead["p99_us"], 1),
            "pipelined_per_running_us": round(ahead["median_us"] / running, 3),
        })
        per_running_ahead.append(ahead["median_us"] / running)
        del core
    small = []
    for running, waiting in SMALL_CASES:
        small_rounds = SMALL_ROUNDS // 10 if quick else SMALL_ROUNDS
        core = build_core(running, waiting, small_rounds, pairs, seed=running)
        _collector(running, python_gc)
        figures = measure(core, small_rounds)
        small.append(
            {
                "running": running,
                "waiting": waiting,
                "rounds": small_rounds,
                **{k: round(v, 2) for k, v in figures.items() if not k.startswith("gc_")},
            }
        )
    independence = {}
    for waiting in (256, 4096):
        core = build_core(64, waiting, rounds, pairs, seed=64)
        _collector(64, python_gc)
        independence[f"waiting_{waiting}_median_us"] = round(measure(core, rounds)["median_us"], 1)
    if profile:
        _profile(pairs, rounds)
    return {
        "benchmark": "scheduler core: schedule() + on_round_result() CPU time per decode-only round",
        "lengths_from": source,
        "python": sys.version.split()[0],
        "core": "compiled (mypyc)" if COMPILED else "pure Python",
        "reference_loop_us": round(reference, 1),
        "collector": "Python defaults" if python_gc else "as the scheduler service sets it (scheduler_svc.collector)",
        f"per_running_{cases_run[-1][0]}_over_{cases_run[0][0]}": round(per_running[-1] / per_running[0], 3),
        f"pipelined_per_running_{cases_run[-1][0]}_over_{cases_run[0][0]}": round(
            per_running_ahead[-1] / per_running_ahead[0], 3
        ),
        "cases": cases,
        "small_rounds": small,
        "queue_independence_64_running": independence,
    }


def cache_rounds(running: int, rounds: int) -> dict[str, object]:
    """Run `rounds` decode rounds at `running` (4x as many waiting) inside `itertools.starmap`, for a cache model.

    Under `valgrind --tool=callgrind --cache-sim=yes --collect-atstart=no --toggle-collect=starmap_next`
    only these rounds are counted (schedule, the fake executor, the result and the take of the events;
    five warm-up rounds and the setup are not): divide its totals by `rounds * running`.
    """
    pairs, _ = load_lengths()
    gc.collect()
    gc.freeze()
    core = build_core(running, 4 * running, rounds + 10, pairs, seed=running)
    _collector(running, False)

    def one(i: int) -> None:
        core.on_round_result(_answer(core.schedule(1.0 + i * 0.01)), 1.0 + i * 0.01)
        core.take_events()

    for i in range(5):
        one(i)
    gc.collect()
    deque(starmap(one, ((i,) for i in range(5, 5 + rounds))), maxlen=0)
    return {"running": running, "rounds": rounds, "request_rounds": running * rounds}


def _profile(pairs: list[tuple[int, int]], rounds: int) -> None:
    for running, waiting, case_rounds in ((1024, 4096, rounds), (2, 4, SMALL_ROUNDS)):
        core = build_core(running, waiting, case_rounds, pairs, seed=running)
        profiler = cProfile.Profile()
        profiler.enable()
        measure(core, case_rounds)
        profiler.disable()
        print(f"--- profile: {running} running, {waiting} waiting, {case_rounds} rounds", file=sys.stderr)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(15)


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run the benchmark and print its JSON report; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="40 rounds per case instead of 200")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the largest case to stderr")
    parser.add_argument("--python-gc", action="store_true",
                        help="measure with Python's default collector thresholds instead of the service's")
    parser.add_argument("--running", default="",
                        help="comma-separated running counts to measure instead of 64,256,1024 (e.g. 64,1024,2048)")
    parser.add_argument("--cache-rounds", type=int, default=0,
                        help="only run this many rounds per --running size inside itertools.starmap, for "
                             "callgrind's --toggle-collect=starmap_next (see cache_rounds)")
    args = parser.parse_args(argv)
    sizes = tuple(int(n) for n in args.running.split(",") if n)
    if args.cache_rounds:
        print(json.dumps([cache_rounds(n, args.cache_rounds) for n in sizes or (64,)]))
        return 0
    print(json.dumps(run(args.quick, args.profile, args.python_gc, sizes), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
