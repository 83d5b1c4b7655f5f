"""Self-checking fleet scenarios (`sluice sim --scenario fleet-...`) and the equal-resources comparison.

Every scenario runs the real planner (planner_svc.Planner) over the simulated fleet (fleet.py) on
Llama-3-70B (2 x H200 per replica) with 512-token prompts and 128-token answers, whose one-replica
capacity the simulator puts at about 10 req/s (the SLO, TTFT 1 s and TPOT 50 ms, breaks near 12 req/s);
the planner's `replica_tokens_per_s` is set to match (pressure 1.0 at 9.8 req/s).
The planner's and the fleet's times are the defaults divided by 5 (load 12 s, warm-up 3 s, window
15 s, cooldown 20 s, a decision every second, drain timeout 5 s) so that a scenario plays in seconds;
the rules are the same, only the clock is shorter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from planner_svc.config import PlannerConfig
from sluice_tools.metrics import RequestRecord, summarize
from sluice_tools.sim.checks import Check, check, check_that
from sluice_tools.sim.config import SimConfig
from sluice_tools.sim.fleet import FleetConfig, FleetSimulator, rate_profile_workload
from sluice_tools.workload import WorkloadRequest

__all__ = ["FLEET_SCENARIOS", "compare_at_equal_resources", "equal_resources_table", "fleet_config", "sim_config"]

PROMPT, ANSWER = 512, 128
SIM = SimConfig(replicas=1, model="llama-3-70b", max_retries=5)


def sim_config(replicas: int) -> SimConfig:
    """Return the scenarios' deployment with `replicas` replicas at start."""
    return replace(SIM, replicas=replicas)


def fleet_config(min_replicas: int, max_replicas: int, **fleet: Any) -> FleetConfig:
    """Return the scenarios' planner and fleet (times / 5, capacity matched to the simulated replica)."""
    planner = PlannerConfig(min_replicas=min_replicas, max_replicas=max_replicas, window_s=15.0, cooldown_s=20.0,
                            load_time_s=12.0, warmup_s=3.0, replica_tokens_per_s=15_000.0)
    settings: dict[str, Any] = {"planner_interval_s": 1.0, "drain_timeout_s": 5.0, **fleet}
    return FleetConfig(planner=planner, **settings)


def _run(requests: list[WorkloadRequest], replicas: int, fleet: FleetConfig) -> tuple[FleetSimulator,
                                                                                     list[RequestRecord]]:
    simulator = FleetSimulator(sim_config(replicas), requests, fleet)
    return simulator, simulator.run()


def _exact(records: list[RequestRecord], requests: list[WorkloadRequest]) -> int:
    """Return how many requests finished ok with every output token they asked for."""
    wanted = {r.request_id: r.output_length for r in requests}
    return sum(1 for r in records if r.status == "ok" and r.output_tokens == wanted[r.request_id]
               and len(r.token_times or ()) == r.output_tokens)


def _first_breach(records: list[RequestRecord], slo_ttft_s: float) -> float | None:
    """Return the arrival time of the first request whose TTFT broke the SLO (None: none did)."""
    late = [r.arrival_s for r in records if r.ttft_s is None or r.ttft_s > slo_ttft_s]
    return min(late, default=None)


def fleet_burst() -> list[Check]:
    """A 4 s burst at 1.6x a replica's capacity, shorter than the 15 s a new replica needs: no scale-up."""
    requests = rate_profile_workload(lambda t: 16.0 if 30 <= t < 34 else 3.0, 60, input_tokens=PROMPT,
                                     output_tokens=ANSWER, seed=3)
    simulator, records = _run(requests, 1, fleet_config(1, 4))
    report = simulator.report
    return [
        check_that("burst shorter than a new replica's load + warm-up", "4 s < 15 s", 4 < 15, "true"),
        check("scale-ups", sum(1 for e in report.scale_events if e["kind"] == "scale_up"), 0),
        check("requests finished with all their tokens", _exact(records, requests), len(requests)),
    ]


def fleet_ramp() -> list[Check]:
    """A ramp from 2 to 16 req/s over 120 s: the first scale-up comes before one replica breaks the SLO."""
    requests = rate_profile_workload(lambda t: 2.0 + 14.0 * min(t, 120.0) / 120.0, 150, input_tokens=PROMPT,
                                     output_tokens=ANSWER, seed=4)
    simulator, records = _run(requests, 1, fleet_config(1, 4))
    ups = [e["t"] for e in simulator.report.scale_events if e["kind"] == "scale_up"]
    _, static = _run(requests, 1, fleet_config(1, 1, autoscale=False))
    breach = _first_breach(static, SIM.slo_ttft_s)
    attained = float(summarize(records, SIM.slo_ttft_s, SIM.slo_tpot_s)["slo_attainment"])  # type: ignore[arg-type]
    return [
        check_that("one static replica breaks the TTFT SLO", breach, breach is not None, "a time"),
        check_that("first scale-up (s) before that breach", ups[0] if ups else None,
                   bool(ups) and breach is not None and ups[0] < breach, f"< {breach}"),
        check_that("SLO attainment, autoscaled", round(float(attained), 3), float(attained) >= 0.9, ">= 0.9"),
        check("requests finished with all their tokens", _exact(records, requests), len(requests)),
    ]


def fleet_decline() -> list[Check]:
    """Load falls from 22 to 2 req/s on 3 replicas: replicas drain (long answers handed over) and retire; none lost."""
    requests = rate_profile_workload(lambda t: max(2.0, 22.0 - 20.0 * t / 40.0), 90, input_tokens=PROMPT,
                                     output_tokens=ANSWER * 4, seed=5)
    simulator, records = _run(requests, 3, fleet_config(1, 3))
    report = simulator.report
    downs = sum(1 for e in report.scale_events if e["kind"] == "scale_down")
    return [
        check_that("scale-downs", downs, downs >= 1, ">= 1"),
        check_that("drains completed (s)", [round(d, 1) for d in report.drain_s], len(report.drain_s) == downs,
                   "one per scale-down"),
        check_that("requests handed over at a drain timeout and moved", report.migrations.get("handed_off", 0),
                   report.migrations.get("handed_off", 0) >= 1, ">= 1"),
        check("requests finished with all their tokens", _exact(records, requests), len(requests)),
        check("admission's active requests at the end", simulator.admission.stats(simulator.now).active, 0),
    ]


def fleet_crash() -> list[Check]:
    """replica-0 of 2 crashes mid-load: its requests move (recompute) and finish whole; a replacement starts."""
    requests = rate_profile_workload(lambda t: 8.0, 50, input_tokens=PROMPT, output_tokens=ANSWER * 2, seed=6)
    simulator, records = _run(requests, 2, fleet_config(2, 2, crash_at_s=20.0))
    report = simulator.report
    moved = report.migrations.get("replica_lost", 0)
    repairs = [e for e in report.scale_events if e["kind"] == "scale_up" and e["signal"] == "bounds"]
    return [
        check_that("requests moved off the dead replica", moved, moved >= 1, ">= 1"),
        check("requests finished with all their tokens", _exact(records, requests), len(requests)),
        check_that("replacement asked for (bounds repair)", len(repairs), len(repairs) == 1, "1"),
        check("admission's active requests at the end", simulator.admission.stats(simulator.now).active, 0),
    ]


FLEET_SCENARIOS: dict[str, Callable[[], list[Check]]] = {
    "fleet-burst": fleet_burst,
    "fleet-ramp": fleet_ramp,
    "fleet-decline": fleet_decline,
    "fleet-crash": fleet_crash,
}


# ---- equal resources ----------------------------------------------------------------------------
def day_workload(duration_s: float = 600.0, low: float = 1.0, high: float = 16.0,
                 seed: int = 7) -> list[WorkloadRequest]:
    """Return a day-shaped workload: the rate rises from `low` to `high` req/s and falls back (sin^2)."""
    return rate_profile_workload(lambda t: low + (high - low) * math.sin(math.pi * t / duration_s) ** 2,
                                 duration_s, input_tokens=PROMPT, output_tokens=ANSWER, seed=seed)


def compare_at_equal_resources(requests: list[WorkloadRequest], fleet: FleetConfig, sim: SimConfig = SIM,
                               progress: Callable[[str], Callable[[float], None]] | None = None,
                               ) -> list[dict[str, Any]]:
    """Run the autoscaled fleet, then static fleets of its min, its max and its GPU-second-equal size (the
    autoscaled GPU-seconds over the run's span, rarely whole: both neighbours are run, bracketing it).
    `progress(label)`, if given, returns the callback each run reports its simulated time to (`sluice sim`'s
    progress lines).

    Returns one row per fleet: name, replicas, GPU-seconds, SLO attainment, TTFT p90, requests ok."""
    planner = fleet.planner

    def run(label: str, simulator: FleetSimulator) -> dict[str, Any]:
        simulator.on_progress = progress(label) if progress is not None else None
        return _row(label, simulator, simulator.run(), sim)

    auto = FleetSimulator(replace(sim, replicas=planner.min_replicas), requests, fleet)
    rows = [run(f"autoscaled {planner.min_replicas}:{planner.max_replicas}", auto)]
    span = max(auto.end_s, 1e-9)
    equal = auto.report.gpu_seconds / span
    bracket = {max(1, math.floor(equal)), max(1, math.ceil(equal))}
    for size in sorted({planner.min_replicas or 1, planner.max_replicas, *bracket}):
        static = FleetSimulator(replace(sim, replicas=size), requests, replace(fleet, autoscale=False))
        rows.append(run(f"static {size}" + (f" (GPU-s equal is {equal:.2f})" if size in bracket else ""), static))
    return rows


def _row(name: str, simulator: FleetSimulator, records: list[RequestRecord], sim: SimConfig) -> dict[str, Any]:
    summary: dict[str, Any] = summarize(records, sim.slo_ttft_s, sim.slo_tpot_s)
    return {"fleet": name, "peak_replicas": simulator.report.peak_replicas,
            "gpu_seconds": round(simulator.report.gpu_seconds), "slo_attainment": round(float(summary["slo_attainment"]), 3),
            "ttft_p90_s": summary["ttft_s"].get("p90"), "ok": sum(1 for r in records if r.status == "ok"),
            "requests": len(records), "scale_events": len(simulator.report.scale_events)}


def equal_resources_table(rows: list[dict[str, Any]]) -> str:
    """Return the comparison as a Markdown table."""
    lines = ["| fleet | peak replicas | GPU-seconds | SLO attainment | TTFT p90 (s) | ok / requests |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ttft = f"{r['ttft_p90_s']:.3f}" if r["ttft_p90_s"] is not None else "-"
        lines.append(f"| {r['fleet']} | {r['peak_replicas']} | {r['gpu_seconds']} | {r['slo_attainment']:.1%} | "
                     f"{ttft} | {r['ok']} / {r['requests']} |")
    return "\n".join(lines)
