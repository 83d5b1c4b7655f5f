"""The one glue between a scheduler replica and the router's load view (sluice.glue), function by function."""

from __future__ import annotations

import itertools

import pytest

from router_svc.core import ReplicaSpec, RouterCore
from sluice import convert, glue
from sluice.core_errors import UnknownReplica
from sluice.glue import RoundRates
from sluice.types import (
    CoreStats,
    HeartbeatReport,
    ReplicaInput,
    ReplicaLoad,
    ReplicaState,
    RoundPlan,
    SamplingParams,
    ScheduledSeq,
)


def make_stats(**values: int) -> CoreStats:
    fields = dict.fromkeys(CoreStats.__dataclass_fields__, 0)
    fields.update(values)
    return CoreStats(**fields)


def test_round_rates_average_decode_rounds_and_prefill_throughput() -> None:
    """Decode-only rounds set the decode round time; a round with prefill counts its time less one decode
    round towards the prefill rate; later rounds move the averages by the weight alpha."""
    def seq(tokens: int, output_index: int) -> ScheduledSeq:
        return ScheduledSeq("r", 0, tuple(range(tokens)), 0, (0,), SamplingParams(), True, output_index)

    rates = RoundRates(alpha=0.5)
    assert (rates.decode_round_s, rates.prefill_tokens_per_s) == (0.0, 0.0)
    rates.observe(RoundPlan(1, (seq(1, 3), seq(1, 7))), 0.010)
    assert rates.decode_round_s == pytest.approx(0.010) and rates.prefill_tokens_per_s == 0.0
    rates.observe(RoundPlan(2, (seq(1, 4), seq(500, 0))), 0.060)  # 0.050 s of prefill for 500 tokens
    assert rates.prefill_tokens_per_s == pytest.approx(10_000.0)
    rates.observe(RoundPlan(3, (seq(1, 5),)), 0.020)
    assert rates.decode_round_s == pytest.approx(0.015)
    rates.observe(RoundPlan(4, (seq(1500, 0),)), 0.150)  # prefill only: the whole round is prefill
    assert rates.prefill_tokens_per_s == pytest.approx(1000 / 0.100)


def test_observe_decodes_is_observe_of_each_decode_round_and_returns_each_average() -> None:
    """Bulk folding of decode-only rounds gives exactly the averages `observe` gives round by round, after
    each round (the simulator's heartbeats during a bulk run read them)."""
    plan = RoundPlan(1, (ScheduledSeq("r", 0, (0,), 0, (0,), SamplingParams(), True, 3),))
    walls = [0.010, 0.013, 0.007, 0.0101, 0.02]
    one, bulk = RoundRates(alpha=0.3), RoundRates(alpha=0.3)
    expected = []
    for wall in walls:
        one.observe(plan, wall)
        expected.append(one.decode_round_s)
    assert bulk.observe_decodes(walls) == expected and bulk.decode_round_s == one.decode_round_s
    assert bulk.observe_decodes([]) == [] and bulk.decode_round_s == one.decode_round_s


def test_the_load_report_is_the_cores_queues_and_the_measured_rates() -> None:
    """replica_load copies waiting, running, queued prefill tokens and free blocks from the core's stats and
    the rates from RoundRates; a replica with no rounds yet reports rates 0 (the router then uses the
    registered ones)."""
    stats = make_stats(waiting=3, running=2, queued_prefill_tokens=900, kv_blocks_free=77, kv_blocks_used=5)
    assert glue.replica_load(stats, RoundRates()) == ReplicaLoad(3, 2, 900, 77, 0.0, 0.0)
    rates = RoundRates(decode_round_s=0.02, prefill_tokens=1000.0, prefill_s=0.1)
    assert glue.replica_load(stats, rates) == ReplicaLoad(3, 2, 900, 77, 10_000.0, 0.02)


def test_the_load_report_counts_evictable_cached_blocks_as_free() -> None:
    """A replica whose 100 blocks are 10 used, 20 free and 70 cached (unreferenced, evictable) reports 90
    free: the prefix cache is not load."""
    stats = make_stats(kv_blocks_total=100, kv_blocks_used=10, kv_blocks_free=20, kv_blocks_cached=70)
    assert glue.replica_load(stats, RoundRates()).kv_blocks_free == 90


def test_a_replica_whose_worker_is_down_reports_unhealthy_unless_it_drains() -> None:
    """reported_state turns WARMING and READY into UNHEALTHY while the worker is down and leaves every other
    state (and every state of a serving worker) as it is."""
    for state in ReplicaState:
        assert glue.reported_state(state, True) is state
        down = ReplicaState.UNHEALTHY if state in (ReplicaState.WARMING, ReplicaState.READY) else state
        assert glue.reported_state(state, False) is down
    report = glue.heartbeat_report("r", ReplicaState.READY, False, make_stats(waiting=1), RoundRates())
    assert report == HeartbeatReport("r", ReplicaState.UNHEALTHY, ReplicaLoad(waiting=1))


def test_every_held_and_reported_state_pair_reconciles_by_the_table() -> None:
    """Walk every (held, reported) pair: READY warms WARMING/UNHEALTHY, UNHEALTHY faults WARMING/READY,
    DRAINING drains whatever does not drain yet, GONE retires a DRAINING one; every other pair, an unknown
    replica and an unspecified report change nothing."""
    expected = {
        (ReplicaState.WARMING, ReplicaState.READY): ReplicaInput.WARMED,
        (ReplicaState.UNHEALTHY, ReplicaState.READY): ReplicaInput.WARMED,
        (ReplicaState.WARMING, ReplicaState.UNHEALTHY): ReplicaInput.FAULT,
        (ReplicaState.READY, ReplicaState.UNHEALTHY): ReplicaInput.FAULT,
        (ReplicaState.WARMING, ReplicaState.DRAINING): ReplicaInput.DRAIN,
        (ReplicaState.READY, ReplicaState.DRAINING): ReplicaInput.DRAIN,
        (ReplicaState.UNHEALTHY, ReplicaState.DRAINING): ReplicaInput.DRAIN,
        (ReplicaState.DRAINING, ReplicaState.GONE): ReplicaInput.REMOVE,
    }
    assert expected == glue.HEARTBEAT_INPUTS
    for held, reported in itertools.product(ReplicaState, ReplicaState):
        assert glue.reconcile(held, reported) is expected.get((held, reported))
    for state in ReplicaState:
        assert glue.reconcile(None, state) is None
        assert glue.reconcile(state, None) is None


def test_apply_heartbeat_moves_the_replica_and_records_its_load() -> None:
    """apply_heartbeat on a RouterCore moves a WARMING replica to READY, a READY one to UNHEALTHY and back,
    keeps a DRAINING one draining whatever it reports, records the load, and refuses an unknown replica."""
    router = RouterCore()
    router.register(ReplicaSpec("r", "m"), now=0.0)
    load = ReplicaLoad(waiting=4, prefill_tokens_per_s=5_000.0)
    steps = [
        (ReplicaState.WARMING, (ReplicaState.WARMING, ReplicaState.WARMING)),
        (ReplicaState.READY, (ReplicaState.WARMING, ReplicaState.READY)),
        (ReplicaState.UNHEALTHY, (ReplicaState.READY, ReplicaState.UNHEALTHY)),
        (ReplicaState.READY, (ReplicaState.UNHEALTHY, ReplicaState.READY)),
        (ReplicaState.DRAINING, (ReplicaState.READY, ReplicaState.DRAINING)),
        (ReplicaState.READY, (ReplicaState.DRAINING, ReplicaState.DRAINING)),
        (ReplicaState.UNHEALTHY, (ReplicaState.DRAINING, ReplicaState.DRAINING)),
    ]
    for i, (reported, outcome) in enumerate(steps):
        assert glue.apply_heartbeat(router, HeartbeatReport("r", reported, load), now=float(i)) == outcome
    view = router.replicas()[0]
    assert (view.load, view.last_heartbeat) == (load, float(len(steps) - 1))
    with pytest.raises(UnknownReplica):
        glue.apply_heartbeat(router, HeartbeatReport("nobody", ReplicaState.READY, load), now=9.0)


def test_a_drained_replica_reporting_gone_leaves_the_table() -> None:
    """A DRAINING replica's GONE heartbeat retires it: apply_heartbeat says GONE and the router forgets it,
    while a READY one reporting GONE stays as it is (only a drain ends in retirement)."""
    router = RouterCore()
    router.register(ReplicaSpec("r", "m"), now=0.0)
    router.register(ReplicaSpec("s", "m"), now=0.0)
    glue.apply_heartbeat(router, HeartbeatReport("r", ReplicaState.DRAINING, ReplicaLoad()), now=1.0)
    assert glue.apply_heartbeat(router, HeartbeatReport("r", ReplicaState.GONE, ReplicaLoad()), now=2.0) == (
        ReplicaState.DRAINING, ReplicaState.GONE)
    assert router.state_of("r") is None
    glue.apply_heartbeat(router, HeartbeatReport("s", ReplicaState.READY, ReplicaLoad()), now=1.0)
    assert glue.apply_heartbeat(router, HeartbeatReport("s", ReplicaState.GONE, ReplicaLoad()), now=2.0) == (
        ReplicaState.READY, ReplicaState.READY)


def test_a_heartbeat_report_survives_the_wire() -> None:
    """heartbeat_to_proto and heartbeat_from_proto are inverse for every state and for an unspecified one."""
    load = ReplicaLoad(1, 2, 3, 4, 1234.5, 0.025)
    for state in [*ReplicaState, None]:
        report = HeartbeatReport("r", state, load)
        wire = convert.heartbeat_to_proto(report).SerializeToString()
        assert convert.heartbeat_from_proto(type(convert.heartbeat_to_proto(report)).FromString(wire)) == report
