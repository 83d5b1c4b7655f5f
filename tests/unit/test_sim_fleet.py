"""The simulated fleet's accounting and its command-line form."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sluice_tools.commands.sim import format_fleet, parse_autoscale
from sluice_tools.sim.fleet import FleetConfig, rate_profile_workload
from sluice_tools.sim.fleet_scenarios import (
    compare_at_equal_resources,
    day_workload,
    fleet_config,
    sim_config,
)
from sluice_tools.sim.run import simulate


def test_autoscale_flag_parses_bounds_and_refuses_nonsense() -> None:
    """`--autoscale 1:4` gives the planner's bounds with its default times; reversed or malformed bounds are errors."""
    fleet = parse_autoscale("1:4")
    assert (fleet.planner.min_replicas, fleet.planner.max_replicas, fleet.planner.ready_delay_s) == (1, 4, 75.0)
    for bad in ("4:1", "0:2", "3", "a:b"):
        with pytest.raises(ValueError, match="MIN:MAX"):
            parse_autoscale(bad)


def test_a_static_fleet_costs_replicas_times_the_run_and_reports_no_events() -> None:
    """With autoscaling off, GPU-seconds are replicas x the run's span and the fleet section has no scale event."""
    requests = rate_profile_workload(lambda t: 4.0, 10, input_tokens=256, output_tokens=32, seed=1)
    result = simulate(sim_config(2), requests, include_series=False, fleet=FleetConfig(autoscale=False))
    fleet = result.summary["fleet"]
    assert fleet["gpu_seconds"] == pytest.approx(2 * result.summary["sim"]["simulated_s"])
    assert (fleet["scale_ups"], fleet["scale_downs"], fleet["migrations"]) == (0, 0, {})
    assert "GPU-seconds" in format_fleet(fleet, "static")


def test_a_fleet_that_loses_a_replica_and_repairs_counts_the_replacement_from_its_request() -> None:
    """After a crash the bounds rule asks for a replacement, READY load + warm-up later; the dead replica's GPU
    time stops at the crash and the replacement's starts when it was asked for."""
    requests = rate_profile_workload(lambda t: 4.0, 40, input_tokens=256, output_tokens=64, seed=2)
    result = simulate(sim_config(2), requests, include_series=False, fleet=fleet_config(2, 2, crash_at_s=10.0))
    fleet = result.summary["fleet"]
    [repair] = [e for e in fleet["scale_events"] if e["kind"] == "scale_up"]
    assert repair["signal"] == "bounds" and fleet["time_to_ready_s"] == [15.0]
    span = result.summary["sim"]["simulated_s"]
    assert fleet["gpu_seconds"] == pytest.approx(span + 10.0 + (span - repair["t"]), abs=1e-2)
    assert all(r.status == "ok" and r.output_tokens == 64 for r in result.records)


def test_the_equal_resources_comparison_reports_progress_for_every_fleet_it_runs() -> None:
    """`sluice sim --equal-resources` runs several fleets one after another; each reports its simulated time
    to its own progress callback (so a long comparison is never silent), and the labels are the rows' names."""
    seen: dict[str, list[float]] = {}

    def progress(label: str) -> Callable[[float], None]:
        seen[label] = []
        return seen[label].append

    rows = compare_at_equal_resources(day_workload(duration_s=60.0, high=4.0), fleet_config(1, 3), progress=progress)
    assert list(seen) == [row["fleet"] for row in rows]
    assert all(times and times == sorted(times) and times[-1] > 0 for times in seen.values())
