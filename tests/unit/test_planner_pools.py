"""Prefill and decode pools sized apart (planner_svc/pools.py): each pool by its own signals and its own replicas."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner_svc.config import PlannerConfig
from planner_svc.core import Hold, HoldReason, ScaleDown, ScaleUp
from planner_svc.pools import PoolPlanner, PoolsConfig
from planner_svc.signals import Observation, ReplicaLoad
from sluice.types import ReplicaRole

# Hand-checkable numbers: prefill rate 1,000 tokens/s and TTFT SLO 1 s, so 1,000 queued prefill tokens per prefill
# replica is backlog pressure 1; decode pressure 1 at 10 requests in flight per decode replica or 90 % KV use.
POOL = PlannerConfig(min_replicas=1, max_replicas=6, window_s=10.0, min_observations=3, cooldown_s=30.0,
                     load_time_s=20.0, warmup_s=5.0, prefill_tokens_per_s=1_000.0, replica_tokens_per_s=1e9,
                     ttft_slo_s=1.0, tpot_slo_s=0.05, queue_per_replica=1e9)
CONFIG = PoolsConfig(prefill=POOL, decode=POOL, decode_seqs_per_replica=10.0)


def fleet(prefill: int = 2, decode: int = 2, *, queued_prefill: int = 0, in_flight: int = 0,
          kv: float = 0.0) -> tuple[ReplicaLoad, ...]:
    return (
        *(ReplicaLoad(f"p{i}", queued_prefill_tokens=queued_prefill, role=ReplicaRole.PREFILL) for i in range(prefill)),
        *(ReplicaLoad(f"d{i}", in_flight=in_flight, kv_used_fraction=kv, role=ReplicaRole.DECODE)
          for i in range(decode)),
    )


def run(planner: PoolPlanner, replicas: tuple[ReplicaLoad, ...], seconds: int = 3, **fields: object):  # type: ignore[no-untyped-def]
    decision = None
    for at in range(seconds):
        decision = planner.step(Observation(at=float(at), arrival_rate=1.0, replicas=replicas, **fields))  # type: ignore[arg-type]
    return decision


def test_queued_prefill_tokens_grow_the_prefill_pool_only() -> None:
    """2,000 queued prefill tokens per prefill replica (backlog pressure 2) scale the prefill pool up, by enough to
    bring it to the target (ceil(2 x 2 / 0.7) - 2 = 4); the idle decode pool holds."""
    decisions = run(PoolPlanner(CONFIG), fleet(queued_prefill=2_000))
    assert decisions.prefill == ScaleUp(4, "backlog", pytest.approx(2.0))
    assert isinstance(decisions.decode, ScaleDown)  # idle above its minimum: it shrinks, it does not grow


def test_kv_use_grows_the_decode_pool_only() -> None:
    """Decode replicas at 99 % KV use (pressure 1.1) scale the decode pool; the prefill pool, idle, does not grow."""
    decisions = run(PoolPlanner(CONFIG), fleet(kv=0.99))
    assert isinstance(decisions.decode, ScaleUp) and decisions.decode.signal == "kv"
    assert not isinstance(decisions.prefill, ScaleUp)


def test_decode_load_grows_the_decode_pool() -> None:
    """20 requests in flight per decode replica (2x the per-replica target) scale the decode pool by decode load."""
    decisions = run(PoolPlanner(CONFIG), fleet(in_flight=20))
    assert decisions.decode == ScaleUp(4, "decode_load", pytest.approx(2.0))
    assert not isinstance(decisions.prefill, ScaleUp)


def test_latency_signals_go_to_their_own_pool() -> None:
    """A TTFT over its SLO is the prefill pool's signal; a TPOT over its SLO, as the decode replicas measure it, is
    the decode pool's."""
    late_first = run(PoolPlanner(CONFIG), fleet(), ttft_observed_s=2.0)
    assert isinstance(late_first.prefill, ScaleUp) and late_first.prefill.signal == "ttft"
    assert not isinstance(late_first.decode, ScaleUp)
    slow_decode = run(PoolPlanner(CONFIG), fleet(), tpot_observed_s=0.1, decode_tpot_observed_s=0.1)
    assert isinstance(slow_decode.decode, ScaleUp) and slow_decode.decode.signal == "tpot"
    assert not isinstance(slow_decode.prefill, ScaleUp)


def test_a_slow_hand_off_is_not_decode_pressure() -> None:
    """The TPOT clients see (admission's) includes the hand-off from the prefill pool; when the decode replicas'
    own TPOT is on target, a client TPOT of twice the SLO does not grow the decode pool."""
    decisions = run(PoolPlanner(CONFIG), fleet(in_flight=5), tpot_observed_s=0.1, decode_tpot_observed_s=0.02)
    assert not isinstance(decisions.decode, ScaleUp), decisions.decode
    assert run(PoolPlanner(CONFIG), fleet(in_flight=5), tpot_observed_s=0.1).decode == decisions.decode


def test_each_pool_retires_its_own_replica() -> None:
    """With both pools idle and above their minimum, each scale-down names a replica of its own role."""
    decisions = run(PoolPlanner(CONFIG), fleet(3, 3))
    assert isinstance(decisions.prefill, ScaleDown) and decisions.prefill.replica_id.startswith("p")
    assert isinstance(decisions.decode, ScaleDown) and decisions.decode.replica_id.startswith("d")


def test_pools_have_their_own_bounds_and_cooldowns() -> None:
    """A prefill scale-up starts the prefill pool's cooldown only: the decode pool (at its minimum, so unchanged)
    scales up at the next step, capped by its own max_replicas."""
    config = replace(CONFIG, decode=replace(POOL, max_replicas=3))
    planner = PoolPlanner(config)
    first = run(planner, fleet(2, 1, queued_prefill=2_000))
    assert isinstance(first.prefill, ScaleUp) and first.decode.reason is HoldReason.AT_MIN
    later = planner.step(Observation(at=3.0, arrival_rate=1.0, replicas=fleet(2, 1, in_flight=60)))
    assert later.prefill == Hold(HoldReason.COOLDOWN)
    # decode load over the window (0, 0, 0, 6) averages 1.5: ceil(1.5 / 0.7) - 1 = 2 more, within max 3
    assert later.decode == ScaleUp(2, "decode_load", pytest.approx(1.5))


def test_both_replicas_are_in_neither_pool() -> None:
    """A BOTH replica's queue moves neither pool (this planner sizes a disaggregated fleet)."""
    replicas = (*fleet(1, 1), ReplicaLoad("b0", queued_prefill_tokens=50_000, in_flight=500))
    decisions = run(PoolPlanner(CONFIG), replicas)
    assert not isinstance(decisions.prefill, ScaleUp) and not isinstance(decisions.decode, ScaleUp)


def test_bad_decode_target_is_refused() -> None:
    """decode_seqs_per_replica must be positive: ValueError naming it."""
    with pytest.raises(ValueError, match="decode_seqs_per_replica"):
        PoolsConfig(decode_seqs_per_replica=0.0)
