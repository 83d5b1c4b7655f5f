"""`make bench-peers`: Sluice beside the routers people run today, in front of the same vLLM CPU engines.

    python -m sluice_tools.bench_peers --vllm-python .venv-vllm/bin/python \\
        --sglang-router .venv-peers/sglang/bin/sglang-router --vllm-router .venv-peers/vllm/bin/vllm-router

Starts N vLLM engines once (or uses `--engine-urls`), finds the engines' saturation rate with a short ramp
through round-robin (unless `--saturation-rps` is given), then for each workload (mooncake, chat) and load
(light = `--light-fraction` x saturation, near = saturation, over = 1.5 x saturation) replays the same requests
at the same arrival times through each front end in turn, each started fresh, with every engine's prefix cache
emptied before each run; then the fairness cell (two tenants, each sending the chat mix at its saturation rate).
Writes OUT/results.json, OUT/table.md and OUT/ttft_cdf_<workload>_<load>.png.
See docs/bench-peers.md for what each figure means.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sluice_tools.bench_peers_client import replay
from sluice_tools.bench_peers_fronts import Binaries, Engines, Started, check_fronts, front_factory
from sluice_tools.bench_peers_procs import (
    CpuMeter,
    Proc,
    counter_deltas,
    engine_counters,
    get_ok,
    reset_prefix_caches,
    spawn,
    wait_http,
    wait_idle,
)
from sluice_tools.bench_peers_report import (
    best_sluice,
    read_outputs,
    run_summary,
    sluice_best_rows,
    tenant_figures,
    versus_best_peer,
    write_outputs,
)
from sluice_tools.bench_peers_sluice import (
    SLUICE_CONFIGS,
    TENANT_KEYS,
    engine_urls,
    front_pids,
    is_sluice,
    start_stack,
    target,
)
from sluice_tools.bench_peers_workload import (
    ChatShape,
    MooncakeScale,
    Req,
    chat_requests,
    load_mooncake,
    mooncake_requests,
    prompt_token_stats,
    tenant_requests,
)
from sluice_tools.metrics import RequestRecord, summarize
from sluice_tools.vllm_engine import VllmEngineSpec, vllm_command, vllm_env, vllm_python

PEERS = ("round_robin", "sglang_cache_aware", "vllm_router_cache_aware", "vllm_router_kv_aware")
DEFAULT_FRONTS = (*PEERS, *SLUICE_CONFIGS)
"""Every front end: the peers first (on the bench's engines), then each Sluice configuration (its own stack)."""
ENGINE_ARGS = ("--enable-scale-out", "--prefix-caching-hash-algo", "sha256_cbor")
"""Added to every engine (the bench's and Sluice's): vllm-router's cache_aware tokenizes through the engines'
/v1/completions/render, which needs --enable-scale-out; sha256_cbor is vLLM's language-neutral block hash
(see docs/bench-peers.md on kv_aware)."""
TRACE = Path("/work/shared/data/traces/mooncake_synthetic.jsonl")


@dataclass(frozen=True)
class Plan:
    """What one bench run covers (from the command line)."""

    fronts: tuple[str, ...]
    workloads: tuple[str, ...]
    duration_s: float
    """Seconds of arrivals per run."""
    slo_ttft_s: float
    slo_tpot_s: float
    timeout_s: float
    trace: Path
    mooncake_rows: int = 360
    """The Mooncake window: the trace's last rows, the same requests at every rate."""
    tenant_drain_s: float = 60.0
    """The fairness cell: seconds after its last arrival at which what still runs is closed."""


def build_workload(name: str, rate: float, plan: Plan) -> list[Req]:
    """Return workload `name` at `rate` req/s: mooncake is one fixed window of `plan.mooncake_rows` trace rows at
    every rate (its span is rows / rate), chat `rate x plan.duration_s` turns; raises ValueError for an unknown
    name."""
    count = max(int(rate * plan.duration_s), 1)
    if name == "mooncake":
        return mooncake_requests(load_mooncake(plan.trace, plan.mooncake_rows), rate, MooncakeScale())
    if name == "chat":
        return chat_requests(count, rate, ChatShape())
    raise ValueError(f"unknown workload {name!r}; known: ['chat', 'mooncake']")


def start_engines(args: argparse.Namespace, log_dir: Path) -> tuple[Engines, list[Proc]]:
    """Start `args.engines` vLLM engines (engine i on core i mod cores); wait until every one is healthy."""
    model = args.model or str(log_dir / "tiny-model")
    if not args.model and not (Path(model) / "config.json").exists():
        from worker_svc.engine.presets import write_preset

        write_preset(Path(model), "tiny")
    log_dir.mkdir(parents=True, exist_ok=True)
    specs = [VllmEngineSpec(model, args.engine_port + i, f"{log_dir.resolve()}/kv{i}.sock", args.engine_port + 100 + i,
                            cpu=i % args.cores, extra_args=ENGINE_ARGS) for i in range(args.engines)]
    procs = [spawn(f"engine{i}", vllm_command(s, args.vllm_python), log_dir, vllm_env(s), url=s.url)
             for i, s in enumerate(specs)]
    try:
        for proc in procs:
            wait_http(proc, "/health", timeout_s=args.engine_timeout)
    except RuntimeError:
        for proc in procs:
            proc.stop()
        raise
    engines = Engines(tuple(s.url for s in specs), tuple(s.kv_endpoint for s in specs),
                      tuple(s.replay_endpoint for s in specs))
    return engines, procs


def run_one(front: str, reqs: Sequence[Req], engines: Engines, bins: Binaries, plan: Plan, log_dir: Path,
            started: Started | None = None) -> tuple[dict[str, object], list[RequestRecord]]:
    """Replay `reqs` through front end `front` (started fresh here, unless `started` is given) with every
    engine's prefix cache emptied first; return its summary and records. Requests of tenants (the fairness
    cell) carry their tenant's key and, to Sluice, their priority; that cell is cut `plan.tenant_drain_s` after
    its last arrival."""
    wait_idle(engines.urls)
    reset_prefix_caches(engines.urls)
    fresh = started is None
    started = front_factory(front)(engines, bins, log_dir) if started is None else started
    try:
        before, load_before = engine_counters(engines.urls), os.getloadavg()[0]
        meter = CpuMeter(started.pids())
        meter.start()
        wall = time.monotonic()
        tenants = any(r.tenant for r in reqs)
        stop_at = reqs[-1].arrival_s + plan.tenant_drain_s if tenants and reqs else None
        records = asyncio.run(replay(reqs, started.targets, engines.model, plan.timeout_s, started.api_key,
                                     api_keys=TENANT_KEYS if is_sluice(front) else None,
                                     send_priority=is_sluice(front), stop_at_s=stop_at))
        wall = time.monotonic() - wall
        cpu_s = meter.stop()
        wait_idle(engines.urls)
        deltas = counter_deltas(before, engine_counters(engines.urls))
    finally:
        if fresh:
            started.stop()
    summary = summarize(records, plan.slo_ttft_s, plan.slo_tpot_s, duration_s=max(wall, 1e-9))
    summary["machine_load_1min"] = {"before": load_before, "after": os.getloadavg()[0], "cores": os.cpu_count()}
    if tenants and reqs:
        summary["tenants"] = tenant_figures(records, reqs[-1].arrival_s)
    return run_summary(summary, records, deltas, cpu_s, bool(started.pids())), records


Runner = Callable[[str, Sequence[Req]], tuple[dict[str, object], list[RequestRecord]]]


def ramp(run: Runner, workload: str, plan: Plan, rates: Sequence[float]) -> tuple[float, list[dict[str, object]]]:
    """Find `workload`'s saturation rate through round-robin: the highest ramp rate at which the engines keep up
    (>= 95% of the requests end ok; the run lasts at most 1/0.9 of its arrival span plus a median request, so no
    backlog built up; TTFT p50 within the SLO), `plan.duration_s` of arrivals per step."""
    steps: list[dict[str, object]] = []
    best = rates[0]
    for rate in rates:
        reqs = build_workload(workload, rate, plan)
        summary, _ = run("round_robin", reqs)
        ttft_p50 = summary["ttft_s"]["p50"]  # type: ignore[index]
        done = summary["counts"]["ok"] / max(summary["requests"], 1)  # type: ignore[index,call-overload]
        e2e_p50 = summary["e2e_s"]["p50"] or 0.0  # type: ignore[index]
        busy = float(summary["duration_s"]) - e2e_p50  # type: ignore[arg-type]
        kept_up = reqs[-1].arrival_s / busy if busy > 0 else 0.0
        steps.append({"workload": workload, "rate_rps": rate, "ok_share": done, "kept_up": kept_up,
                      "ttft_p50_s": ttft_p50, "output_tokens_per_s": summary["output_tokens_per_s"]})
        print(json.dumps({"ramp": steps[-1]}), flush=True)
        if done < 0.95 or kept_up < 0.9 or ttft_p50 is None or ttft_p50 > plan.slo_ttft_s:
            break
        best = rate
    return best, steps


class EnginePool:
    """The bench's engines: started once, and started again when something outside the bench ended them (on
    this shared machine that happens); `restarts` counts it. With --engine-urls, the given engines as they are."""

    def __init__(self, args: argparse.Namespace, log_dir: Path) -> None:
        self.args, self.log_dir = args, log_dir
        self.procs: list[Proc] = []
        self.engines: Engines | None = None
        self.restarts = 0
        if args.engine_urls:
            self.engines = Engines(tuple(args.engine_urls), tuple(args.kv_events), tuple(args.kv_replay))

    def healthy(self) -> bool:
        """True when every engine process lives and answers /health."""
        if self.engines is None:
            return False
        alive = all(p.popen.poll() is None for p in self.procs)
        return alive and all(get_ok(f"{url}/health") for url in self.engines.urls)

    def get(self) -> Engines:
        """Return serving engines, (re)starting them when needed."""
        if self.args.engine_urls and self.engines is not None:
            return self.engines
        if self.engines is None or not self.healthy():
            if self.engines is not None:
                self.restarts += 1
                print(json.dumps({"engines_restarted": self.restarts}), flush=True)
            self.stop()
            self.engines, self.procs = start_engines(self.args, self.log_dir)
        return self.engines

    def stop(self) -> None:
        """Stop the engines this bench started."""
        for proc in self.procs:
            proc.stop()
        self.procs = []


def peer_runner(pool: EnginePool, bins: Binaries, plan: Plan, log_dir: Path, attempts: int = 3) -> Runner:
    """Return a runner of peer front ends that redoes a run whose engines were lost during it."""

    def run(front: str, reqs: Sequence[Req]) -> tuple[dict[str, object], list[RequestRecord]]:
        for _ in range(attempts):
            engines = pool.get()
            try:
                result = run_one(front, reqs, engines, bins, plan, log_dir)
            except RuntimeError as exc:
                print(json.dumps({"run_lost": front, "why": str(exc)[:200]}), flush=True)
                continue
            if pool.healthy():
                return result
            print(json.dumps({"run_lost": front, "why": "an engine ended during the run"}), flush=True)
        raise RuntimeError(f"{front}: engines lost {attempts} times in a row")

    return run


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(prog="bench_peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default="", help="the vLLM venv's python (default: $SLUICE_VLLM_PYTHON or "
                   ".venv-vllm, as sluice_tools.vllm_engine finds it)")
    p.add_argument("--sglang-router", default=".venv-peers/sglang/bin/sglang-router")
    p.add_argument("--vllm-router", default=".venv-peers/vllm/bin/vllm-router")
    p.add_argument("--engine-urls", nargs="*", default=None,
                   help="use running engines (started with bench_peers_procs.EngineSpec's flags) instead")
    p.add_argument("--kv-events", nargs="*", default=(), help="with --engine-urls: each engine's KV PUB endpoint")
    p.add_argument("--kv-replay", nargs="*", default=(), help="with --engine-urls: each engine's replay endpoint")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--cores", type=int, default=2, help="engine i binds its threads to core i mod CORES")
    p.add_argument("--engine-port", type=int, default=18400)
    p.add_argument("--engine-timeout", type=float, default=400.0)
    p.add_argument("--model", default="", help="model directory (default: a tiny preset written under OUT)")
    p.add_argument("--fronts", nargs="*", default=list(DEFAULT_FRONTS))
    p.add_argument("--workloads", nargs="*", default=["mooncake", "chat"])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    p.add_argument("--saturation-rps", type=float, default=0.0, help="skip the ramps, use this rate for every workload")
    p.add_argument("--saturation", nargs="*", default=[], metavar="WORKLOAD=RPS",
                   help="skip a workload's ramp, use this rate (e.g. mooncake=16 chat=6)")
    p.add_argument("--ramp-rates", type=float, nargs="*", default=[2, 4, 6, 8, 12, 16, 24, 32])
    p.add_argument("--ramp-duration", type=float, default=20.0)
    p.add_argument("--light-fraction", type=float, default=0.3)
    p.add_argument("--loads", nargs="*", default=["light", "near", "over"])
    p.add_argument("--mooncake-rows", type=int, default=360,
                   help="the Mooncake window: the trace's last rows, replayed at every rate")
    p.add_argument("--no-tenants", action="store_true", help="skip the fairness cell (two tenants, 2x chat load)")
    p.add_argument("--tenant-drain", type=float, default=60.0,
                   help="fairness cell: seconds after its last arrival at which what still runs is closed")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--out", type=Path, default=Path("out/bench-peers"))
    p.add_argument("--quick", action="store_true", help="20 s runs, a 3-step ramp of 10 s")
    p.add_argument("--include", type=Path, default=None,
                   help="an earlier run's OUT: its runs join this one's JSON, table and plots (same saturation)")
    return p.parse_args(argv)


LOAD_FACTOR = {"near": 1.0, "over": 1.5}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench; return 0, or 2 when a front end asked for cannot run (the reason is printed)."""
    args = parse_args(argv)
    if args.quick:
        args.duration, args.ramp_duration, args.ramp_rates = 20.0, 10.0, args.ramp_rates[:3]
    args.vllm_python = args.vllm_python or vllm_python()
    reasons = check_fronts(args.fronts)
    if reasons:
        print("bench_peers: " + "; ".join(reasons), file=sys.stderr)
        return 2
    log_dir = args.out / "logs"
    bins = Binaries(args.sglang_router, args.vllm_router, args.vllm_python)
    pool = EnginePool(args, log_dir)
    try:
        return _bench(args, pool, bins, log_dir)
    finally:
        pool.stop()


Cell = tuple[str, str, float, list[Req]]
"""(workload, load, rate, requests): one column of the comparison, the same for every front end."""


def _bench(args: argparse.Namespace, pool: EnginePool, bins: Binaries, log_dir: Path) -> int:
    plan = Plan(tuple(args.fronts), tuple(args.workloads), args.duration, args.slo_ttft, args.slo_tpot,
                args.timeout, args.trace, args.mooncake_rows, args.tenant_drain)
    ramp_plan = Plan(plan.fronts, plan.workloads, args.ramp_duration, plan.slo_ttft_s, plan.slo_tpot_s,
                     plan.timeout_s, plan.trace, plan.mooncake_rows)
    saturation: dict[str, float] = {}
    steps: list[dict[str, object]] = []
    for workload in plan.workloads:
        given = dict(item.split("=", 1) for item in args.saturation)
        if workload in given:
            saturation[workload] = float(given[workload])
        elif args.saturation_rps > 0:
            saturation[workload] = args.saturation_rps
        else:
            saturation[workload], found = ramp(peer_runner(pool, bins, ramp_plan, log_dir), workload, ramp_plan,
                                               args.ramp_rates)
            steps += found
    cells: list[Cell] = []
    for workload in plan.workloads:
        for load in args.loads:
            rate = saturation[workload] * (args.light_fraction if load == "light" else LOAD_FACTOR[load])
            cells.append((workload, load, rate, build_workload(workload, rate, plan)))
    if not args.no_tenants and "chat" in saturation:
        tenant_cell: Cell = ("tenants", "2x", 2 * saturation["chat"],
                             tenant_requests(saturation["chat"], plan.duration_s, ChatShape()))
        cells.append(tenant_cell)
    results: dict[str, object] = {"saturation_rps": saturation, "ramp": steps, "plan": _plan_json(plan, args),
                                  "runs": []}
    records: dict[tuple[str, str], dict[str, list[RequestRecord]]] = {}
    run_peer = peer_runner(pool, bins, plan, log_dir)
    for front in [f for f in plan.fronts if not is_sluice(f)]:
        for cell in cells:
            _record(results, records, cell, front, run_peer(front, cell[3]))
            write_outputs(results, records, args.out, plan.slo_ttft_s, plots=False)  # a stopped bench keeps its runs
    sluices = [f for f in plan.fronts if is_sluice(f)]
    if sluices:
        pool.stop()  # at most two engines on this machine: Sluice's stack starts its own
    for front in sluices:
        own = [c for c in cells if (c[0] == "tenants") == (SLUICE_CONFIGS[front].cells == "tenants")]
        if not own:
            continue
        stack = start_stack(front, ENGINE_ARGS, log_dir / front, args.vllm_python, args.model or "tiny")
        try:
            stack_engines = Engines(tuple(engine_urls(stack)), model=stack.model_id or "tiny")
            started = Started([target(stack)], other_pids=front_pids(stack), api_key=stack.api_key)
            for cell in own:
                run = run_one(front, cell[3], stack_engines, bins, plan, log_dir, started)
                _record(results, records, cell, front, run)
                write_outputs(results, records, args.out, plan.slo_ttft_s, plots=False)
        finally:
            stack.stop()
    if args.include is not None:
        _include(args.include, results, records)
    order = [*plan.workloads, "tenants"]
    results["runs"].sort(key=lambda r: (order.index(r["workload"]), [*args.loads, "2x"].index(r["load"])))  # type: ignore[attr-defined]
    results["engine_restarts"] = pool.restarts
    best = best_sluice(results["runs"], [k for k, c in SLUICE_CONFIGS.items() if c.cells == "loads"])  # type: ignore[arg-type]
    results["sluice_best"] = best
    results["runs"] += sluice_best_rows(results["runs"], best)  # type: ignore[operator,arg-type]
    results["sluice_vs_best_peer"] = versus_best_peer(results["runs"], [*SLUICE_CONFIGS, "sluice_best"])  # type: ignore[arg-type]
    write_outputs(results, records, args.out, plan.slo_ttft_s)
    print(f"bench_peers: wrote {args.out}/results.json, table.md and TTFT CDF plots", flush=True)
    return 0


def _include(earlier: Path, results: dict[str, object],
             records: dict[tuple[str, str], dict[str, list[RequestRecord]]]) -> None:
    """Add an earlier run's rows and records; raises ValueError when its saturation rate differs."""
    old, old_records = read_outputs(earlier)
    if old["saturation_rps"] != results["saturation_rps"]:
        raise ValueError(f"--include {earlier}: saturation {old['saturation_rps']} req/s, this run "
                         f"{results['saturation_rps']} (pass --saturation WORKLOAD=RPS ...)")
    results["runs"].extend(r for r in old["runs"] if r["front"] != "sluice_best")  # type: ignore[attr-defined]  # recomputed
    results["ramp"] = results["ramp"] or old.get("ramp", [])
    for cell, runs in old_records.items():
        for front, recs in runs.items():
            records.setdefault(cell, {}).setdefault(front, recs)


def _record(results: dict[str, object], records: dict[tuple[str, str], dict[str, list[RequestRecord]]], cell: Cell,
            front: str, run: tuple[dict[str, object], list[RequestRecord]]) -> None:
    workload, load, rate, reqs = cell
    row = {"workload": workload, "load": load, "rate_rps": rate, "front": front,
           "workload_stats": prompt_token_stats(reqs), **run[0]}
    results["runs"].append(row)  # type: ignore[attr-defined]
    records.setdefault((workload, load), {})[front] = run[1]
    print(json.dumps({k: row[k] for k in ("workload", "load", "front", "headline")}), flush=True)


def _plan_json(plan: Plan, args: argparse.Namespace) -> dict[str, object]:
    return {"fronts": list(plan.fronts), "workloads": list(plan.workloads), "duration_s": plan.duration_s,
            "slo": {"ttft_s": plan.slo_ttft_s, "tpot_s": plan.slo_tpot_s}, "engines": args.engines,
            "light_fraction": args.light_fraction, "mooncake_scale": vars(MooncakeScale()),
            "mooncake_rows": plan.mooncake_rows, "tenant_drain_s": plan.tenant_drain_s,
            "sluice_configs": {name: config.description for name, config in SLUICE_CONFIGS.items()},
            "chat_shape": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(ChatShape()).items()}}


if __name__ == "__main__":
    sys.exit(main())
