"""`python -m planner_svc` (planner_svc/__main__.py): its flags choose one pool or, with --pools, the prefill and
decode pools sized apart; flags that do not go together end it with one line naming the flag; the deployed
planner's observations carry each replica's role (its pool)."""

from __future__ import annotations

import pytest

from planner_svc.__main__ import build_loop, parse_args, planner_config, pool_deployments
from planner_svc.core import ScaleDown, ScaleUp
from planner_svc.driver import PlannerLoop, PoolPlannerLoop
from planner_svc.observe import Counters, interval_figures, replica_load
from planner_svc.pools import PoolDecisions
from planner_svc.signals import Observation, ReplicaLoad
from sluice.types import ReplicaRole, RequestTotals
from sluice.v1 import router_pb2, scheduler_pb2

P, D = ReplicaRole.PREFILL, ReplicaRole.DECODE
# Bounds 2..3 for each pool: the observation below has one prefill replica (under the minimum) and four decode
# replicas (over the maximum), so each pool's first decision is a bounds repair, taken at once.
POOLS = ["--pools", "--connector", "prometheus", "--min-replicas", "2", "--max-replicas", "3"]


class UnevenPools:
    """One prefill replica and four decode replicas (d2 the only idle one, so the cheapest to retire)."""

    def observe(self, now: float) -> Observation:
        decode = tuple(ReplicaLoad(f"d{i}", in_flight=0 if i == 2 else 3, role=D) for i in range(4))
        return Observation(at=now, arrival_rate=1.0, replicas=(ReplicaLoad("p0", role=P), *decode))


@pytest.mark.parametrize("argv, flag", [
    (["--prefill-deployment", "p"], "--prefill-deployment"),
    (["--decode-deployment", "d"], "--decode-deployment"),
    (["--pools", "--deployment", "replica-x"], "--deployment"),
    (["--pools", "--prefill-deployment", "same", "--decode-deployment", "same"], "--prefill-deployment"),
])
def test_flags_that_do_not_go_together_exit_with_one_line_naming_the_flag(
        argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A pool's Deployment without --pools, --deployment with --pools, or one Deployment for both pools: exit 2
    before anything starts, with one line on stderr that names the flag."""
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("python -m planner_svc: error: ") and flag in line


def test_pools_name_their_deployments_by_default_or_by_flag() -> None:
    """--pools scales replica-prefill and replica-decode unless the flags name others; without --pools the one
    --deployment is scaled."""
    assert pool_deployments(parse_args(["--pools"])) == {P: "replica-prefill", D: "replica-decode"}
    named = parse_args(["--pools", "--prefill-deployment", "pf", "--decode-deployment", "dc"])
    assert pool_deployments(named) == {P: "pf", D: "dc"}
    assert parse_args([]).pools is False and parse_args([]).deployment == "replica"


def test_without_pools_the_service_runs_the_one_fleet_planner() -> None:
    """No --pools: a PlannerLoop over the whole fleet, publishing the unlabelled sluice_planner_* figures."""
    options = parse_args(["--connector", "prometheus", "--min-replicas", "2", "--max-replicas", "3"])
    loop, registry = build_loop(options, planner_config(options), UnevenPools())
    assert isinstance(loop, PlannerLoop)
    assert isinstance(loop.tick(0.0), ScaleDown)  # five replicas, over the maximum of three
    assert registry.get_sample_value("sluice_planner_current_replicas") == 5


def test_pools_run_the_pool_planner_and_publish_a_figure_per_pool() -> None:
    """--pools with the prometheus connector: the prefill pool (1 replica, minimum 2) asks for one more, the decode
    pool (4, maximum 3) retires its idle replica, and each pool's desired and current count is its own gauge,
    which that pool's connector reads back."""
    options = parse_args(POOLS)
    loop, registry = build_loop(options, planner_config(options), UnevenPools())
    assert isinstance(loop, PoolPlannerLoop)
    decisions = loop.tick(0.0)
    assert decisions == PoolDecisions(ScaleUp(1, "bounds"), ScaleDown("d2", "bounds"))

    def gauge(name: str, pool: str) -> float | None:
        return registry.get_sample_value(f"sluice_planner_pool_{name}_replicas", {"pool": pool})

    assert (gauge("desired", "prefill"), gauge("current", "prefill")) == (2, 1)
    assert (gauge("desired", "decode"), gauge("current", "decode")) == (3, 4)
    assert registry.get_sample_value("sluice_planner_desired_replicas") is None  # not the one-fleet figure
    assert {role: c.current_replicas() for role, c in loop.connectors.items()} == {P: 1, D: 4}


@pytest.mark.parametrize("wire, role", [(router_pb2.REPLICA_ROLE_PREFILL, P), (router_pb2.REPLICA_ROLE_DECODE, D),
                                        (router_pb2.REPLICA_ROLE_BOTH, ReplicaRole.BOTH)])
def test_the_deployed_planner_sees_the_role_each_replica_registered(wire: int, role: ReplicaRole) -> None:
    """RouterObservations' replica_load keeps the router's Replica.role, answered or not: without it every replica
    would be BOTH and both pools would look empty to the pool planner."""
    replica = router_pb2.Replica(replica_id="r", state=router_pb2.READY, role=wire)  # type: ignore[arg-type]
    stats = scheduler_pb2.SchedulerStats(waiting=2, running=1, kv_blocks_used=1, kv_blocks_total=4)
    assert replica_load(replica, stats).role is role
    assert replica_load(replica, None).role is role


def _counters(seen: int, **totals: float) -> Counters:
    """A scheduler's Counters (planner_svc.observe) of `seen` requests and the running totals named."""
    return Counters(seen, RequestTotals(**totals))  # type: ignore[arg-type]


def test_an_interval_s_means_are_growths_of_sums_over_growths_of_counts() -> None:
    """Two reads of a scheduler's totals give the interval's length mix and latencies; a first read gives
    nothing yet, and a counter that went down (a restart) makes the totals since then the interval's."""
    first = _counters(10, input_tokens=1000, max_output_tokens=500, ttft_s=2.0, ttft_count=10,
                     tpot_s=0.5, tpot_count=10)
    later = _counters(14, input_tokens=1800, max_output_tokens=700, ttft_s=3.2, ttft_count=14,
                     tpot_s=0.9, tpot_count=12)
    assert first.since(None) == Counters()
    growth = later.since(first)
    assert (growth.seen, growth.totals.input_tokens, growth.totals.ttft_count) == (4, 800, 4)
    figures = interval_figures([(ReplicaRole.BOTH, growth)])
    assert figures["mean_input_tokens"] == pytest.approx(200) and figures["mean_output_tokens"] == pytest.approx(50)
    assert figures["ttft_observed_s"] == pytest.approx(0.3) and figures["tpot_observed_s"] == pytest.approx(0.2)
    assert figures["decode_tpot_observed_s"] is None
    restarted = _counters(3, input_tokens=300, max_output_tokens=30, ttft_s=0.3, ttft_count=3)
    assert restarted.since(later) == restarted
    assert interval_figures([(ReplicaRole.BOTH, Counters())])["ttft_observed_s"] is None


def test_a_disaggregated_fleet_s_prompts_are_read_on_prefill_replicas_and_its_decoding_on_decode_ones() -> None:
    """Prompt lengths and TTFT come from the prefill pool (a decode half's first token is its KV transfer), output
    lengths and TPOT from the decode pool, whose TPOT is also the decode pool's own signal."""
    prefill = _counters(4, input_tokens=4000, max_output_tokens=4, ttft_s=2.0, ttft_count=4)
    decode = _counters(4, input_tokens=4000, max_output_tokens=400, ttft_s=0.04, ttft_count=4,
                      tpot_s=0.12, tpot_count=4)
    figures = interval_figures([(P, prefill), (D, decode)])
    assert figures["mean_input_tokens"] == pytest.approx(1000) and figures["mean_output_tokens"] == pytest.approx(100)
    assert figures["ttft_observed_s"] == pytest.approx(0.5)
    assert figures["tpot_observed_s"] == pytest.approx(0.03) and figures["decode_tpot_observed_s"] == pytest.approx(0.03)
