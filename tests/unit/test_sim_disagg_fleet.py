"""Prefill and decode pools sized apart in the simulator (sluice_tools/sim/disagg_fleet.py): which pool grows,
drains that lose and duplicate nothing, a deterministic report, and the `sluice sim` flags."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from planner_svc.config import PlannerConfig
from planner_svc.core import Decision, ScaleDown
from planner_svc.pools import PoolsConfig
from planner_svc.signals import Observation
from sluice.types import CoreEvents, ReplicaRole, ReplicaState
from sluice_tools.cli import main
from sluice_tools.metrics import RequestRecord
from sluice_tools.sim import SimConfig, simulate
from sluice_tools.sim.disagg import Flow
from sluice_tools.sim.disagg_fleet import DisaggFleetSimulator
from sluice_tools.sim.fleet import FleetConfig, rate_profile_workload
from sluice_tools.workload import WorkloadRequest
from worker_svc.costmodel import CostModel


def pools_fleet(low: int = 1, high: int = 3, drain_timeout_s: float = 5.0) -> FleetConfig:
    """Each pool within low..high, with fleet_scenarios' shortened times (load 12 s, warm-up 3 s, window 15 s,
    cooldown 20 s, a decision a second) and targets a small synthetic load crosses."""
    pool = PlannerConfig(min_replicas=low, max_replicas=high, window_s=15.0, cooldown_s=20.0, load_time_s=12.0,
                         warmup_s=3.0, prefill_tokens_per_s=10_000.0, replica_tokens_per_s=20_000.0)
    return FleetConfig(planner_interval_s=1.0, drain_timeout_s=drain_timeout_s,
                       pools=PoolsConfig(prefill=pool, decode=pool, decode_seqs_per_replica=16.0))


def split(prefill: int, decode: int, **fields: Any) -> SimConfig:
    return SimConfig(replicas=prefill + decode, disagg=(prefill, decode), **fields)


def prefill_heavy() -> list[WorkloadRequest]:
    """2000-token prompts, 8-token answers, 10 req/s for 40 s, then a trickle: twice a prefill pool's target."""
    return rate_profile_workload(lambda t: 10.0 if t < 40 else 0.5, 80, input_tokens=2000, output_tokens=8, seed=1)


def decode_heavy() -> list[WorkloadRequest]:
    """32-token prompts, 400-token answers, 4 req/s for 40 s, then a trickle: three times a decode pool's target."""
    return rate_profile_workload(lambda t: 4.0 if t < 40 else 0.2, 80, input_tokens=32, output_tokens=400, seed=2)


def exact(records: list[RequestRecord], requests: list[WorkloadRequest]) -> bool:
    """Every request ended once, ok, with all its output tokens, each delivered once."""
    wanted = {r.request_id: r.output_length for r in requests}
    return sorted(r.request_id for r in records) == sorted(wanted) and all(
        r.status == "ok" and r.output_tokens == wanted[r.request_id] == len(r.token_times or ()) for r in records)


def pool_events(fleet: dict[str, Any], pool: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in fleet["scale_events"] if e.get("pool") == pool and e["kind"] == kind]


def test_a_prefill_heavy_load_grows_the_prefill_pool_and_not_the_decode_pool() -> None:
    """From 1:1 (each pool 1..3), long prompts with short answers make the pool planner add prefill replicas
    (registered as prefill, counted in the prefill pool's GPU-seconds) and no decode replica; when the load stops,
    a prefill replica drains and retires within its pool; every request ends once with all its tokens."""
    requests = prefill_heavy()
    result = simulate(split(1, 1), requests, include_series=False, fleet=pools_fleet())
    fleet = result.summary["fleet"]
    assert pool_events(fleet, "prefill", "scale_up") and not pool_events(fleet, "decode", "scale_up")
    prefill, decode = fleet["pools"]["prefill"], fleet["pools"]["decode"]
    assert prefill["peak_replicas"] > 1 and decode["peak_replicas"] == 1 and len(decode["replicas"]) == 1
    [down, *_] = pool_events(fleet, "prefill", "scale_down")
    retired = next(r for r in prefill["replicas"] if r["replica"] == down["what"])
    assert retired["ended_s"] is not None and retired["gpu_seconds"] == pytest.approx(
        retired["ended_s"] - retired["started_s"], abs=1e-2)
    assert fleet["gpu_seconds"] == pytest.approx(prefill["gpu_seconds"] + decode["gpu_seconds"])
    assert exact(result.records, requests)


def test_a_decode_heavy_load_grows_the_decode_pool_and_not_the_prefill_pool() -> None:
    """From 1:1 (each pool 1..3), short prompts with long answers (dozens decoding at once against 16 a replica)
    make the pool planner add decode replicas and no prefill replica; every request ends once with all its tokens."""
    requests = decode_heavy()
    result = simulate(split(1, 1), requests, include_series=False, fleet=pools_fleet())
    fleet = result.summary["fleet"]
    assert pool_events(fleet, "decode", "scale_up") and not pool_events(fleet, "prefill", "scale_up")
    assert fleet["pools"]["decode"]["peak_replicas"] > 1 and fleet["pools"]["prefill"]["peak_replicas"] == 1
    new = [r for r in fleet["pools"]["decode"]["replicas"] if r["started_s"] > 0]
    assert new and all(r["ready_s"] == pytest.approx(r["started_s"] + 15.0) for r in new)  # load 12 s + warm-up 3 s
    assert exact(result.records, requests)


class Scripted(DisaggFleetSimulator):
    """The pool simulator with scale-downs at given times instead of the planner's; it collects the tokens and
    every use of a retired replica (a round, a transfer, a hand-off to or from it)."""

    def __init__(self, *args: Any, script: dict[float, tuple[ReplicaRole, str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.script = script
        self.tokens: dict[str, list[int]] = {}
        self.after_retirement: list[str] = []
        self.used_at_retirement: dict[str, int] = {}
        """Blocks each retired replica's pool still had in use (pins included) when it retired."""

    def _retire_if_drained(self, replica: Any) -> None:
        was = replica.state
        super()._retire_if_drained(replica)
        if replica.state is not was:
            self.used_at_retirement[replica.replica_id] = replica.core.pool.num_used

    def _start(self, replica: Any, plan: Any) -> None:
        if replica.state is ReplicaState.GONE:
            self.after_retirement.append(f"round on {replica.replica_id}")
        super()._start(replica, plan)

    def _hand_off(self, flow: Flow, finished: Any) -> None:
        if ReplicaState.GONE in (flow.prefill.state, flow.decode.state):
            self.after_retirement.append(f"hand-off {flow.prefill.replica_id} -> {flow.decode.replica_id}")
        super()._hand_off(flow, finished)

    def _decide(self, observation: Observation) -> list[tuple[ReplicaRole, Decision]]:
        step = self.script.get(round(self.now, 3))
        return [] if step is None else [(step[0], ScaleDown(step[1], "scripted", 0.0))]

    def _absorb(self, replica: Any, events: CoreEvents) -> None:
        for request_id, _index, token in events.tokens:
            self.tokens.setdefault(request_id, []).append(token)
        super()._absorb(replica, events)


@pytest.mark.parametrize("bulk", ["1", "0"])
def test_a_drain_of_each_pool_past_its_timeout_loses_and_duplicates_no_request(
        bulk: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill and then a decode replica are drained under an overload with a 50 ms drain timeout and a decode KV
    pool too small for the prompts in flight: each drain reaches its timeout, so prompts being computed, prompts
    pinned and waiting for decode room, prompts bound for the decode replica, transfers and decodes are all handed
    over; each replica retires within a round or two of its timeout and is never used after; every request still
    ends once, ok, with all its tokens (without bulk decodes, where each token passes _absorb: exactly the cost
    model's tokens in order), and no block, pin, claim or flow is left anywhere."""
    monkeypatch.setenv("SLUICE_SIM_FASTFORWARD", bulk)
    requests = rate_profile_workload(lambda t: 40.0, 20, input_tokens=1500, output_tokens=60, seed=5)
    script = {5.0: (ReplicaRole.PREFILL, "replica-0"), 8.0: (ReplicaRole.DECODE, "replica-2")}
    sim = Scripted(split(2, 2, num_blocks=300), requests, pools_fleet(1, 2, drain_timeout_s=0.05), script=script)
    records = sim.run()
    assert [r.state for r in sim.replicas] == [ReplicaState.GONE, ReplicaState.READY] * 2
    assert len(sim.report.drain_s) == 2 and all(0.05 <= d < 0.15 for d in sim.report.drain_s), sim.report.drain_s
    assert sim.after_retirement == [] and sim.used_at_retirement == {"replica-0": 0, "replica-2": 0}
    assert sim.report.migrations["handed_off"] > 0 and sim.report.migration_failures == 0
    assert exact(records, requests)
    model = CostModel(sim.config.model)
    assert bulk == "1" or all(sim.tokens[r.request_id] == [model.token_for(r.request_id, r.input_length + k)
                                            for k in range(r.output_length)] for r in requests)
    assert not sim.flows and not sim.pairs.claims and sim._moving == 0
    assert all(replica.core.pool.num_used == 0 for replica in sim.replicas)


def summary_without_wall_time(run: Callable[[], dict[str, Any]]) -> str:
    summary = run()
    for key in ("wall_s", "sim_s_per_wall_s", "wall_us_per_round"):
        summary["sim"].pop(key)
    return json.dumps(summary, sort_keys=True)


def test_the_same_run_twice_gives_the_same_json() -> None:
    """Two runs of one workload, split and pools give the same summary, scale events and timelines included (the
    wall-clock figures aside)."""
    requests = decode_heavy()[:80]

    def run() -> dict[str, Any]:
        return simulate(split(1, 1), requests, include_series=False, fleet=pools_fleet()).summary

    assert summary_without_wall_time(run) == summary_without_wall_time(run)


def test_the_cli_runs_pools_from_the_split_brought_within_the_bounds(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`sluice sim WORKLOAD --disagg 1:4 --autoscale 2:3` starts the pools at 2:3 and reports each pool; a reversed
    bound and `--disagg all` with --autoscale are refused with exit 2 and one line naming the problem."""
    workload = "synthetic:poisson?rate=20&n=40&input=fixed:512&output=fixed:16"
    out = tmp_path / "pools.json"
    assert main(["sim", workload, "--disagg", "1:4", "--autoscale", "2:3", "--json", str(out), "--no-progress"]) == 0
    [run] = json.loads(out.read_text())["runs"].values()
    assert (run["disagg"]["prefill_replicas"], run["disagg"]["decode_replicas"]) == (2, 3)
    assert [len(run["fleet"]["pools"][pool]["replicas"]) for pool in ("prefill", "decode")] == [2, 3]
    assert "prefill pool:" in capsys.readouterr().out
    for flags, problem in ((["--disagg", "1:1", "--autoscale", "3:1"], "1 <= MIN <= MAX"),
                           (["--disagg", "all", "--autoscale", "1:2"], "--disagg all compares fixed splits")):
        assert main(["sim", workload, *flags, "--no-progress"]) == 2
        assert problem in capsys.readouterr().err


def test_crashes_are_refused_for_pools() -> None:
    """A crash asked of a pool simulation is refused, not silently ignored."""
    with pytest.raises(ValueError, match="crashes are not simulated"):
        DisaggFleetSimulator(split(1, 1), [], FleetConfig(crash_at_s=1.0))


def test_a_drain_within_its_timeout_retires_each_pool_only_when_the_pair_lets_it_go() -> None:
    """With a 30 s drain timeout under the same overload, the drained prefill replica retires only once the prompts
    it computed have left its pool (none waits pinned for decode room any more) and the decode replica only once
    nothing is bound for it; no request is handed over, none is lost, and neither replica is used after."""
    requests = rate_profile_workload(lambda t: 40.0, 12, input_tokens=1500, output_tokens=60, seed=5)
    script = {5.0: (ReplicaRole.PREFILL, "replica-0"), 8.0: (ReplicaRole.DECODE, "replica-2")}
    sim = Scripted(split(2, 2, num_blocks=300), requests, pools_fleet(1, 2, drain_timeout_s=30.0), script=script)
    records = sim.run()
    assert sim.used_at_retirement == {"replica-0": 0, "replica-2": 0} and sim.after_retirement == []
    assert sim.report.migrations == {} and exact(records, requests)
