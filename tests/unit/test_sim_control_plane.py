"""The load-dependent control plane (sluice_tools/sim/control_plane.py): a shared CPU stretching the delays."""

from __future__ import annotations

import math
from typing import Any

import pytest

from sluice_tools.sim.config import SimConfig
from sluice_tools.sim.control_plane import ControlPlane, ControlPlaneConfig
from sluice_tools.sim.run import simulate
from sluice_tools.workload import load_workload

DELAYS: dict[str, Any] = {"round_gap_s": 0.0005, "submit_delay_s": 0.008, "token_delay_s": 0.0015}


def test_an_idle_control_plane_adds_nothing_to_the_constants() -> None:
    """A zero-cost plane charges nothing and leaves every delay exactly its constant, whatever the work."""
    free = ControlPlane(ControlPlaneConfig(scale=0.0))
    assert free.submit_delay(0.0, 0.008) == 0.008
    assert free.token_delay(1.0, 0.0015, 64) == 0.0015
    assert free.round_gap(2.0, 0.0005, 256) == 0.0005
    assert free.busy_s == 0.0


def test_delays_grow_with_the_work_in_flight_as_processor_sharing() -> None:
    """Charged work raises rho = work / window / cores, and every delay becomes constant / (1 - rho)."""
    config = ControlPlaneConfig(cores=2.0, token_cpu_s=1e-4, window_s=0.25, request_cpu_s=0.0, round_cpu_s=0.0)
    plane = ControlPlane(config)
    plane.token_delay(0.0, 0.0015, 1000)  # 0.1 CPU-s at t=0: rho = 0.1 / 0.25 / 2 = 0.2
    assert math.isclose(plane.utilization(0.0), 0.2)
    assert math.isclose(plane.submit_delay(0.0, 0.008), 0.008 / 0.8)
    busier = ControlPlane(config)
    busier.token_delay(0.0, 0.0015, 3000)  # rho 0.6
    assert math.isclose(busier.round_gap(0.0, 0.001, 0), 0.001 / 0.4)
    assert busier.stretch(0.0) > plane.stretch(0.0) > 1.0


def test_load_decays_with_the_window_and_saturation_is_capped() -> None:
    """Work of long ago weighs exp(-age / window); past saturation rho stops at max_rho (a finite stretch)."""
    plane = ControlPlane(ControlPlaneConfig(token_cpu_s=1e-4, window_s=0.25, max_rho=0.9))
    plane.token_delay(0.0, 0.0, 1000)
    assert math.isclose(plane.utilization(0.25), 0.2 * math.exp(-1.0))
    plane.token_delay(0.25, 0.0, 100_000)
    assert plane.utilization(0.25) == 0.9
    assert math.isclose(plane.stretch(0.25), 10.0)


def test_round_and_request_work_are_charged_at_their_costs() -> None:
    """A round charges round_cpu_s + seq_cpu_s per sequence, a request request_cpu_s, both times the scale."""
    plane = ControlPlane(ControlPlaneConfig(round_cpu_s=1e-3, seq_cpu_s=1e-5, request_cpu_s=2e-3, scale=2.0))
    plane.round_gap(0.0, 0.0, 100)
    plane.submit_delay(0.0, 0.0)
    assert math.isclose(plane.busy_s, 2.0 * (1e-3 + 100 * 1e-5 + 2e-3))


def test_a_bad_config_is_refused() -> None:
    """Zero cores or a utilisation cap of 1 (an infinite stretch) are refused."""
    with pytest.raises(ValueError):
        ControlPlaneConfig(cores=0.0)
    with pytest.raises(ValueError):
        ControlPlaneConfig(max_rho=1.0)


def _summary(rate: float, control_plane: ControlPlaneConfig | None) -> dict[str, float]:
    spec = f"synthetic:poisson?rate={rate}&n={int(6 * rate)}&input=fixed:512&output=fixed:64"
    requests = load_workload(spec, seed=5).requests
    config = SimConfig(replicas=1, heartbeat_interval_s=1.0, control_plane=control_plane, **DELAYS)
    summary: dict[str, Any] = simulate(config, requests, include_series=False).summary
    return {"ttft": summary["ttft_s"]["p50"], "tpot": summary["tpot_s"]["p50"], "ttft99": summary["ttft_s"]["p99"]}


def test_a_zero_cost_control_plane_gives_the_constant_delays_results() -> None:
    """Off (None) and on at zero cost give the same figures: the hooks apply exactly the constants when idle."""
    assert _summary(20.0, None) == _summary(20.0, ControlPlaneConfig(scale=0.0))


def test_in_the_simulator_the_control_plane_slows_a_loaded_run_more_than_a_light_one() -> None:
    """The model's added TTFT and TPOT over the constants grow with the arrival rate (the constants' do not)."""
    model = ControlPlaneConfig(scale=2.0)
    added = {}
    for rate in (2.0, 20.0):
        const, loaded = _summary(rate, None), _summary(rate, model)
        added[rate] = (loaded["ttft"] - const["ttft"], loaded["tpot"] - const["tpot"])
        assert loaded["ttft"] > const["ttft"] and loaded["tpot"] > const["tpot"]
    assert added[20.0][0] > 2 * added[2.0][0]
    assert added[20.0][1] > 2 * added[2.0][1]


def test_the_fast_path_is_off_while_the_control_plane_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bulk decode runs (fastforward.py) would apply the constants, not the stretched delays: with the model on,
    switching the fast path on or off changes nothing, and the loaded run still differs from the constants'."""
    model = ControlPlaneConfig(scale=2.0)
    monkeypatch.setenv("SLUICE_SIM_FASTFORWARD", "0")
    slow = _summary(20.0, model)
    monkeypatch.setenv("SLUICE_SIM_FASTFORWARD", "1")
    assert _summary(20.0, model) == slow != _summary(20.0, None)


def test_the_fidelity_fit_recovers_a_known_scale() -> None:
    """Fitting the CPU scale on figures the model itself produced at scale 2 finds 2 again (to the bisection's step)."""
    from sluice_tools.fidelity import Delays, fit_scale, simulated, workload

    requests = workload(20.0, 80, output=32)
    delays = Delays(0.0003, 0.008, 0.0015)
    real = simulated(requests, 1, True, delays, ControlPlaneConfig(scale=2.0))
    assert abs(fit_scale(requests, 1, real, delays, steps=10).scale - 2.0) < 0.05


def test_a_replica_pool_slows_only_its_own_replica() -> None:
    """With replica_cores, a replica's rounds load its own pool: its round gap and token delay stretch by that pool's
    1 / (1 - rho) on top of the shared stretch, another replica's do not; without the pool the stretch is 1."""
    config = ControlPlaneConfig(cores=1000.0, round_cpu_s=0.0, seq_cpu_s=1e-3, window_s=0.25, replica_cores=1.0)
    plane = ControlPlane(config)
    plane.round_gap(0.0, 0.001, 125, 0)  # 0.125 CPU-s on replica 0: its rho 0.5
    shared = plane.stretch(0.0)
    assert math.isclose(plane.token_delay(0.0, 0.002, 0, 0), 0.002 * shared * 2.0)
    assert math.isclose(plane.token_delay(0.0, 0.002, 0, 1), 0.002 * shared)
    assert ControlPlane(ControlPlaneConfig()).replica_stretch(0.0, 0, 10.0) == 1.0


def test_repeated_live_rows_merge_into_medians_and_spread() -> None:
    """Interleaved repeats of the fidelity table's live rows become one row per (replicas, rate) in first-seen
    order, each figure the median of its runs and its (min, max) the spread the simulator is judged against."""
    from sluice_tools.fidelity import merge_repeats

    def run(replicas: int, rate: float, ttft: float, repeat: int) -> dict[str, Any]:
        return {"replicas": replicas, "rate": rate, "n": 60, "repeat": repeat, "idle_gaps": {"0.5": repeat},
                "live": {"ttft_p50": ttft, "throughput": rate}}

    runs = [run(1, 2.0, 30.0, 0), run(2, 4.0, 10.0, 0), run(1, 2.0, 50.0, 1), run(2, 4.0, 12.0, 1),
            run(1, 2.0, 35.0, 2), run(2, 4.0, 20.0, 2)]
    rows = merge_repeats(runs)
    assert [(r["replicas"], r["rate"], r["runs"]) for r in rows] == [(1, 2.0, 3), (2, 4.0, 3)]
    assert rows[0]["live"] == {"ttft_p50": 35.0, "throughput": 2.0}
    assert rows[0]["spread"]["ttft_p50"] == (30.0, 50.0)
    assert rows[1]["live"]["ttft_p50"] == 12.0 and rows[1]["spread"]["ttft_p50"] == (10.0, 20.0)
    assert rows[0]["idle_gaps"] == {"0.5": 0}
    assert merge_repeats(runs[:2])[0]["spread"]["ttft_p50"] == (30.0, 30.0)
