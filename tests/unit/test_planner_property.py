"""Property: whatever the load, a fleet that follows the planner stays in [min, max] and changes no faster than the cooldown."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from planner_svc.config import PlannerConfig
from planner_svc.core import Planner, ScaleDown, ScaleUp
from planner_svc.signals import Observation, ReplicaLoad


@dataclass
class Fleet:
    """A fleet that carries out every decision: new replicas become ready after the ready delay."""

    ready_delay_s: float
    ready_at: dict[str, float] = field(default_factory=dict)
    next_id: int = 0

    def add(self, now: float, n: int) -> None:
        for _ in range(n):
            self.ready_at[f"r{self.next_id}"] = now + self.ready_delay_s
            self.next_id += 1

    def snapshot(self, now: float, queue: int, in_flight: int, kv: float) -> tuple[ReplicaLoad, ...]:
        return tuple(ReplicaLoad(rid, ready=now >= at, queue_length=queue, in_flight=in_flight + i,
                                 kv_used_fraction=kv) for i, (rid, at) in enumerate(sorted(self.ready_at.items())))


configs = st.builds(
    lambda lo, span, cooldown, window, load: PlannerConfig(
        min_replicas=lo, max_replicas=max(1, lo + span), cooldown_s=cooldown, window_s=window, min_observations=2,
        load_time_s=load, warmup_s=1.0, replica_tokens_per_s=100.0, output_token_weight=1.0),
    st.integers(0, 3), st.integers(0, 4), st.floats(0.0, 60.0), st.floats(1.0, 30.0), st.floats(0.0, 60.0))

steps = st.lists(st.tuples(
    st.floats(0.1, 10.0),                      # seconds to the next observation
    st.one_of(st.sampled_from([0.0, 500.0]), st.floats(0.0, 50.0)),  # arrival rate: calm, flood, between
    st.one_of(st.just(0), st.integers(0, 60)),       # queued requests per replica
    st.integers(0, 8),                               # in-flight requests
    st.one_of(st.just(0.0), st.floats(0.0, 1.0)),    # KV use
    st.one_of(st.none(), st.floats(0.0, 5.0)),       # observed TTFT
), min_size=1, max_size=80)


@settings(max_examples=300, deadline=None)
@given(config=configs, start=st.integers(0, 7), trace=steps)
def test_bounds_and_cooldown_hold_under_any_load(config: PlannerConfig, start: int,
                                                 trace: list[tuple[float, float, int, int, float, float | None]]) -> None:
    """Starting in bounds, every decision keeps the count in [min, max] and changes are >= cooldown_s apart."""
    planner, fleet = Planner(config), Fleet(config.ready_delay_s)
    fleet.add(-1e6, min(max(start, config.min_replicas), config.max_replicas))
    now, changes = 0.0, []
    for gap, rate, queue, in_flight, kv, ttft in trace:
        now += gap
        observation = Observation(at=now, arrival_rate=rate, mean_input_tokens=50.0, mean_output_tokens=20.0,
                                  replicas=fleet.snapshot(now, queue, in_flight, kv), ttft_observed_s=ttft)
        decision = planner.step(observation)
        if isinstance(decision, ScaleUp):
            assert decision.n >= 1
            fleet.add(now, decision.n)
            changes.append(now)
        elif isinstance(decision, ScaleDown):
            assert decision.replica_id in fleet.ready_at
            del fleet.ready_at[decision.replica_id]
            changes.append(now)
        assert config.min_replicas <= len(fleet.ready_at) <= config.max_replicas
    assert all(later - earlier >= config.cooldown_s for earlier, later in zip(changes, changes[1:], strict=False))
