"""Live stack vs the simulator, and the pipelined loop vs the serial one (`make bench`; a benchmark, minutes).

The same workload (Poisson arrivals, 512-token prompts, 128-token outputs, seed 7) runs through a spawned
stack (costmodel backend, Llama-3-8B, H200 emulated time) and through `sluice sim` with the same settings.
`table` prints TTFT p50/p99, TPOT p50/p99 and throughput of both and their difference at three loads on 1
and 2 replicas, with the simulator's control-plane delays (round gap, submit and token delays) fitted on
the first row (1 replica, low load) and then held fixed, and beside them the load-dependent control plane
(sluice_tools/sim/control_plane.py: the same delays stretched by a shared CPU's load) with its CPU scale
fitted on the first fleet's most loaded row; `batch` prints live TPOT/TTFT at batch 1, 32 and 256
(a burst of that many requests) with the pipelined and the serial loop against the cost model's decode step
and the simulator with no control-plane delay on the same requests, and the worker's idle gap between rounds.
Every row is also printed as one JSON line.

  python -m sluice_tools.fidelity table [--rates 2,8,20] [--replicas 1,2] [--n 200] [--repeats 3]
  python -m sluice_tools.fidelity batch [--batches 1,32,256]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import urllib.request
from collections.abc import Sequence
from typing import Any

from sluice_tools.commands.bench import drive, path_latency, records_of
from sluice_tools.metrics import summarize
from sluice_tools.sim.config import SimConfig
from sluice_tools.sim.control_plane import ControlPlaneConfig
from sluice_tools.sim.run import simulate
from sluice_tools.stack import Stack, StackConfig
from sluice_tools.workload import load_workload
from worker_svc.costmodel import CostModel, RoundShape

MODEL = "llama-3-8b"
SEED = 7
DEFAULT_CPU = ControlPlaneConfig()
"""The control plane's CPU costs before fitting (sluice_tools/sim/control_plane.py)."""


def workload(rate: float, n: int, output: int = 128) -> list[Any]:
    """Return the requests of the fidelity workload at `rate` req/s."""
    spec = f"synthetic:poisson?rate={rate}&n={n}&input=fixed:512&output=fixed:{output}"
    return list(load_workload(spec, seed=SEED).requests)


def figures(summary: dict[str, Any]) -> dict[str, float]:
    """Return TTFT/TPOT p50/p99 (ms) and throughput (req/s) of a summary."""
    ttft, tpot = summary["ttft_s"], summary["tpot_s"]
    return {"ttft_p50": 1e3 * (ttft["p50"] or 0), "ttft_p99": 1e3 * (ttft["p99"] or 0),
            "tpot_p50": 1e3 * (tpot["p50"] or 0), "tpot_p99": 1e3 * (tpot["p99"] or 0),
            "throughput": float(summary["throughput_rps"])}


def idle_gaps(urls: Sequence[str]) -> dict[str, float]:
    """Return the workers' idle-gap histogram as the share of gaps at or below each bucket bound (ms)."""
    counts: dict[float, float] = {}
    for url in urls:
        if not url:
            continue
        with urllib.request.urlopen(url, timeout=5) as reply:  # noqa: S310 (a loopback URL we started)
            for line in reply.read().decode().splitlines():
                if line.startswith("sluice_worker_idle_seconds_bucket"):
                    bound = line.split('le="', 1)[1].split('"', 1)[0]
                    key = float("inf") if bound == "+Inf" else float(bound)
                    counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    total = counts.get(float("inf"), 0.0) or 1.0
    return {f"le_{1e3 * b:g}ms": round(c / total, 3) for b, c in sorted(counts.items()) if b <= 0.002}


def live(requests: list[Any], replicas: int, pipeline: bool,
         concurrency: int = 1024) -> tuple[dict[str, float], dict[str, float]]:
    """Run `requests` through a spawned stack (at most `concurrency` at once); return (figures, idle gaps)."""
    args = () if pipeline else ("--no-pipeline",)
    stack = Stack(StackConfig(replicas=replicas, backend="costmodel", model=MODEL, emulate_time=True,
                              scheduler_args=args, log_level="WARNING")).start()
    try:
        outcomes = asyncio.run(drive(stack.endpoint, stack.api_key, requests, max_concurrency=concurrency,
                                     timeout=300.0, progress=False))
        gaps = idle_gaps([w.metrics_url for w in stack.workers])
    finally:
        stack.stop()
    out = figures(summarize(records_of(requests, outcomes), 10.0, 1.0))
    out["path_p50"] = 1e3 * (path_latency(outcomes)["p50"] or 0.0)
    return out, gaps


@dataclasses.dataclass(frozen=True)
class Delays:
    """What the live stack adds to the modelled rounds, as the simulator models it (seconds)."""

    round_gap_s: float = 0.0
    """Device idle between rounds."""
    submit_delay_s: float = 0.0
    """Arrival to the replica's submit."""
    token_delay_s: float = 0.0
    """Round to client, per token."""


def simulated(requests: list[Any], replicas: int, pipeline: bool, delays: Delays = Delays(),
              control_plane: ControlPlaneConfig | None = None) -> dict[str, float]:
    """Run `requests` through the simulator with the live settings; return its figures."""
    config = SimConfig(replicas=replicas, model=MODEL, pipeline=pipeline, heartbeat_interval_s=1.0,
                       control_plane=control_plane, **dataclasses.asdict(delays))
    return figures(simulate(config, requests, include_series=False).summary)


def fit(requests: list[Any], real: dict[str, float], cpu: ControlPlaneConfig | None = None) -> Delays:
    """Fit the simulator's delays to one live run on one replica at low load: the round gap from TPOT, the
    token delay from the client's path latency, the submit delay from what is left of TTFT. With the control
    plane `cpu`, the gap and submit delay are then divided by the stretch they get at that load (one step)."""
    bare = simulated(requests, 1, True, control_plane=cpu)
    gap = max(0.0, real["tpot_p50"] - bare["tpot_p50"]) / 1e3
    token = real["path_p50"] / 1e3
    gapped = simulated(requests, 1, True, Delays(gap, 0.0, token), cpu)
    delays = Delays(gap, max(0.0, real["ttft_p50"] - gapped["ttft_p50"]) / 1e3, token)
    if cpu is None:
        return delays
    sim = simulated(requests, 1, True, delays, cpu)
    tpot = (sim["tpot_p50"] - bare["tpot_p50"]) / 1e3
    ttft = (sim["ttft_p50"] - gapped["ttft_p50"]) / 1e3
    return Delays(gap * gap / tpot if tpot > 0 else gap, delays.submit_delay_s ** 2 / ttft if ttft > 0 else 0.0,
                  token)


def fit_scale(requests: list[Any], replicas: int, real: dict[str, float], delays: Delays,
              base: ControlPlaneConfig = DEFAULT_CPU, steps: int = 12) -> ControlPlaneConfig:
    """Fit the control plane's CPU scale (bisection) so that the simulated TTFT p50 of one loaded live run
    matches; the CPU costs' ratios are `base`'s (by default bench_live_cpu's split)."""
    low, high = 0.0, 16.0
    for _ in range(steps):
        mid = (low + high) / 2
        sim = simulated(requests, replicas, True, delays, dataclasses.replace(base, scale=mid))
        low, high = (mid, high) if sim["ttft_p50"] < real["ttft_p50"] else (low, mid)
    return dataclasses.replace(base, scale=round((low + high) / 2, 3))


Run = tuple[int, float, list[Any], dict[str, float], dict[str, float]]
"""(replicas, rate, requests, live figures, idle gaps) of one live row."""


def fit_control_plane(loaded: Run, second: Run | None, delays: Delays, base: ControlPlaneConfig = DEFAULT_CPU,
                      steps: int = 7) -> ControlPlaneConfig:
    """Fit the control plane on two loaded live rows: the CPU scale on `loaded` (TTFT p50), and the fixed CPU per
    round on `second` (TTFT p50, bisection; a row with another number of replicas, so other rounds per token),
    the scale refitted at each step. Without `second`, the default per-round cost."""
    if second is None:
        return fit_scale(loaded[2], loaded[0], loaded[3], delays, base)
    low, high = 0.0, 0.004
    for _ in range(steps):
        mid = (low + high) / 2
        cpu = fit_scale(loaded[2], loaded[0], loaded[3], delays, dataclasses.replace(base, round_cpu_s=mid))
        sim = simulated(second[2], second[0], True, delays, cpu)
        low, high = (mid, high) if sim["ttft_p50"] < second[3]["ttft_p50"] else (low, mid)
    return fit_scale(loaded[2], loaded[0], loaded[3], delays,
                     dataclasses.replace(base, round_cpu_s=round((low + high) / 2, 6)))


def _diff(a: float, b: float) -> str:
    return f"{100 * (a - b) / b:+.0f}%" if b else "-"


def live_rows(rates: Sequence[float], fleet: Sequence[int], n: int, saved: str | None,
              repeats: int = 1) -> list[dict[str, Any]]:
    """Return the live rows ({replicas, rate, n, live, spread, runs, idle_gaps}): run now, or read from `saved`
    (JSON lines of an earlier `table` run, to refit without running the stack again).

    With `repeats` > 1 every row runs that many times, the rows interleaved (row 1, row 2, ..., row 1, ...) so
    a noisy stretch of the machine falls on different rows; `live` is each figure's median over the runs and
    `spread` its (min, max), the live stack's own run-to-run noise the simulator is judged against."""
    if saved is not None:
        with open(saved) as lines:
            runs = [json.loads(line) for line in lines if line.startswith("{")]
        runs = [r for r in runs if "sim" not in r and "live" in r]
    else:
        runs = []
        for repeat in range(repeats):
            for replicas in fleet:
                for rate in rates:
                    count = max(n, int(12 * rate * replicas))
                    real, gaps = live(workload(rate * replicas, count), replicas, True)
                    runs.append({"replicas": replicas, "rate": rate * replicas, "n": count, "repeat": repeat,
                                 "live": real, "idle_gaps": gaps})
                    print(json.dumps(runs[-1]), flush=True)
    return merge_repeats(runs)


def merge_repeats(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return one row per (replicas, rate) in first-seen order: the median of every live figure over its runs,
    its (min, max) as `spread`, the number of runs, and the first run's idle gaps."""
    rows: dict[tuple[int, float], dict[str, Any]] = {}
    for run in runs:
        row = rows.setdefault((run["replicas"], run["rate"]), {
            "replicas": run["replicas"], "rate": run["rate"], "n": run["n"], "idle_gaps": run["idle_gaps"],
            "all": []})
        row["all"].append(run["live"])
    for row in rows.values():
        every = row.pop("all")
        row["runs"] = len(every)
        row["live"] = {k: statistics.median(r[k] for r in every) for k in every[0]}
        row["spread"] = {k: (min(r[k] for r in every), max(r[k] for r in every)) for k in every[0]}
    return list(rows.values())


def _within(value: float, spread: tuple[float, float]) -> str:
    """'*' when `value` lies within the live runs' (min, max)."""
    return "*" if spread[0] <= value <= spread[1] else " "


def table(rates: Sequence[float], fleet: Sequence[int], n: int, saved: str | None = None,
          base: ControlPlaneConfig = DEFAULT_CPU, repeats: int = 1) -> None:
    """Print live vs the simulator at each load and fleet size, with the constant delays (fitted on the first
    row) and with the load-dependent control plane (its CPU scale fitted on the first fleet's most loaded row,
    its per-round CPU on the second fleet's middle row). Live figures are medians over `repeats` runs; a '*'
    marks a model figure within the live runs' own spread (min..max)."""
    keys = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "throughput")
    rows = live_rows(rates, fleet, n, saved, repeats)
    runs: list[Run] = [(r["replicas"], r["rate"], workload(r["rate"], r["n"]), r["live"], r["idle_gaps"])
                       for r in rows]
    spreads = [r["spread"] for r in rows]
    delays = fit(runs[0][2], runs[0][3])
    loaded = runs[len(rates) - 1]
    second = runs[len(rates) + len(rates) // 2] if len(runs) > len(rates) else None
    cpu = fit_control_plane(loaded, second, delays, base)
    cpu_delays = fit(runs[0][2], runs[0][3], cpu)  # the idle machine's delays: the first row's, less its stretch
    cpu = fit_control_plane(loaded, second, cpu_delays, base)
    print(f"constants fitted on {runs[0][0]} replica(s) at {runs[0][1]:g} req/s: {delays}")
    fitted = f"{loaded[0]} replica(s) at {loaded[1]:g} req/s" + (
        "" if second is None else f" and {second[0]} at {second[1]:g} req/s")
    print(f"control plane: delays {cpu_delays} on the first row, CPU fitted on {fitted}: {cpu}")
    print(f"{'replicas':>8} {'rate':>6} " + " ".join(f"{k + ' live/const/cpu':>30}" for k in keys))
    for (replicas, rate, requests, real, gaps), spread in zip(runs, spreads, strict=True):
        const = simulated(requests, replicas, True, delays)
        model = simulated(requests, replicas, True, cpu_delays, cpu)
        cells = " ".join(f"{real[k]:>7.2f}/{const[k]:.2f}/{model[k]:.2f} {_diff(model[k], real[k]):>5}"
                         f"{_within(model[k], spread[k])}" for k in keys)
        print(f"{replicas:>8} {rate:>6g} {cells}", flush=True)
        print(json.dumps({"replicas": replicas, "rate": rate, "live": real, "live_spread": spread, "sim": const,
                          "sim_cpu": model, "sim_bare": simulated(requests, replicas, True), "idle_gaps": gaps}),
              flush=True)


def modelled(size: int, prompt: int = 512, output: int = 128) -> dict[str, float]:
    """Return the cost model's decode step at batch `size` (mean context) and its prefill of one prompt (ms)."""
    cost = CostModel(MODEL, "h200")
    context = prompt + output // 2
    step = cost.shape_time(RoundShape(size, size * context, size * context, size, size))
    prefill = cost.shape_time(RoundShape(prompt, prompt * (prompt + 1) // 2, prompt, prompt, 1))
    return {"tpot_p50": 1e3 * step, "ttft_p50": 1e3 * prefill}


def batch(sizes: Sequence[int]) -> None:
    """Print live TPOT/TTFT against the device at each batch size, pipelined and serial.

    Batch 1: one request at a time, 1 s apart (its TTFT is the prefill's). Batch B > 1: a burst of B requests
    at once (at most B in flight), so every round decodes the batch, interleaved with the burst's prefills at
    first. Two device references: `step`, the cost model's pure decode step at B (mean context), and `sim`,
    the simulator with no control-plane delay on the same requests (the device time of this very workload,
    prefills included): live against `sim` is the control plane's share.
    """
    print(f"{'batch':>6} {'step':>7} {'sim tpot':>8} {'pipelined':>10} {'serial':>8} {'sim ttft':>8} "
          f"{'pipelined':>10} {'serial':>8}  idle gaps (pipelined | serial)")
    for size in sizes:
        requests = workload(1.0, 12) if size == 1 else workload(100_000.0, size)
        model, device = modelled(size), simulated(requests, 1, True)
        cap = size if size > 1 else 1024  # batch 1: open loop (arrivals 1 s apart rarely overlap)
        piped, piped_gaps = live(requests, 1, True, cap)
        serial, serial_gaps = live(requests, 1, False, cap)
        print(f"{size:>6} {model['tpot_p50']:>7.2f} {device['tpot_p50']:>8.2f} {piped['tpot_p50']:>10.2f} "
              f"{serial['tpot_p50']:>8.2f} {device['ttft_p50']:>8.2f} {piped['ttft_p50']:>10.2f} "
              f"{serial['ttft_p50']:>8.2f}  {piped_gaps} | {serial_gaps}", flush=True)
        print(json.dumps({"batch": size, "model": model, "sim": device, "pipelined": piped, "serial": serial,
                          "idle_pipelined": piped_gaps, "idle_serial": serial_gaps}), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m sluice_tools.fidelity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["table", "batch", "all"])
    parser.add_argument("--rates", default="2,8,20", help="req/s per replica: low, medium, near saturation")
    parser.add_argument("--replicas", default="1,2")
    parser.add_argument("--n", type=int, default=60, help="requests per run at least (12 s of arrivals otherwise)")
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--repeats", type=int, default=1,
                        help="table: live runs per row (interleaved); the table shows their medians and spread")
    parser.add_argument("--live-from", metavar="FILE", help="table: the live rows from an earlier run's output")
    parser.add_argument("--replica-cores", type=float, default=0.0,
                        help="table: give the control-plane model a pool of this many cores per replica (0: none)")
    args = parser.parse_args(argv)
    if args.what in ("batch", "all"):
        batch([int(b) for b in args.batches.split(",")])
    if args.what in ("table", "all"):
        table([float(r) for r in args.rates.split(",")], [int(r) for r in args.replicas.split(",")], args.n, args.live_from,
              ControlPlaneConfig(replica_cores=args.replica_cores), max(args.repeats, 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
