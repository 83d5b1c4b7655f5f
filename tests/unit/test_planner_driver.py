"""The planner loop: a change is carried out through the connector, traced as a span and counted; a hold is only counted."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from planner_svc.config import PlannerConfig
from planner_svc.connectors import PrometheusConnector
from planner_svc.core import Hold, HoldReason, Planner, ScaleDown, ScaleUp
from planner_svc.driver import PlannerLoop, PlannerMetrics
from planner_svc.signals import Observation, ReplicaLoad


class ScriptedSource:
    """Observations of a 2-replica fleet at a fixed arrival rate (demand pressure = rate / 2)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate

    def observe(self, now: float) -> Observation:
        return Observation(at=now, arrival_rate=self.rate, replicas=(ReplicaLoad("r0"), ReplicaLoad("r1")),
                           mean_input_tokens=1.0)


def make_loop(rate: float) -> tuple[PlannerLoop, PrometheusConnector]:
    config = PlannerConfig(min_replicas=1, max_replicas=4, window_s=10.0, min_observations=2, cooldown_s=30.0,
                           replica_tokens_per_s=1.0, output_token_weight=0.0)
    metrics = PlannerMetrics()
    connector = PrometheusConnector(metrics)
    return PlannerLoop(Planner(config), ScriptedSource(rate), connector, metrics), connector


def value(loop: PlannerLoop, name: str, labels: dict[str, str] | None = None) -> float | None:
    return loop.metrics.registry.get_sample_value(name, labels or {})


def test_a_scale_up_is_acted_on_traced_and_counted(span_exporter: InMemorySpanExporter) -> None:
    """Pressure 1.4 on 2 replicas: desired goes 2 -> 4 (current stays 2), one planner.scale span says why."""
    loop, connector = make_loop(rate=2.8)
    assert loop.tick(0.0) == Hold(HoldReason.WINDOW_NOT_FULL)
    decision = loop.tick(1.0)
    assert isinstance(decision, ScaleUp) and decision.n == 2
    assert value(loop, "sluice_planner_desired_replicas") == 4 and connector.current_replicas() == 2
    [span] = [s for s in span_exporter.get_finished_spans() if s.name == "planner.scale"]
    assert span.attributes is not None
    assert span.attributes["sluice.planner.decision"] == "scale_up"
    assert span.attributes["sluice.planner.reason"] == "demand"
    assert (span.attributes["sluice.planner.replicas_before"], span.attributes["sluice.planner.replicas_after"]) == (2, 4)
    assert value(loop, "sluice_planner_decisions_total", {"kind": "scale_up", "reason": "demand"}) == 1
    assert value(loop, "sluice_planner_decisions_total", {"kind": "hold", "reason": "window_not_full"}) == 1
    assert value(loop, "sluice_planner_pressure", {"signal": "demand"}) == 1.4


def test_a_hold_is_counted_but_not_traced(span_exporter: InMemorySpanExporter) -> None:
    """Pressure 0.7 is in band: nothing changes, no span, the hold is counted with its reason."""
    loop, connector = make_loop(rate=1.4)
    loop.tick(0.0)
    assert loop.tick(1.0).reason is HoldReason.IN_BAND  # type: ignore[union-attr]
    assert [s for s in span_exporter.get_finished_spans() if s.name == "planner.scale"] == []
    assert connector.current_replicas() == 2
    assert value(loop, "sluice_planner_decisions_total", {"kind": "hold", "reason": "in_band"}) == 1
    assert value(loop, "sluice_planner_desired_replicas") == 2


class RecordingConnector:
    """One pool's connector: counts the replicas it was asked for and the ones it was told to remove."""

    def __init__(self, replicas: int) -> None:
        self.replicas, self.added = replicas, 0
        self.removed: list[str] = []

    def current_replicas(self) -> int:
        return self.replicas

    def add(self, n: int) -> None:
        self.added += n

    def remove(self, replica_id: str) -> None:
        self.removed.append(replica_id)


def test_pool_decisions_go_to_their_pools_connector_with_a_pool_label(span_exporter: InMemorySpanExporter) -> None:
    """A prefill backlog (pressure 3 on each of 2 prefill replicas) scales the prefill pool up through the prefill
    connector only, while the idle decode pool retires one of its own replicas through the decode connector; the
    metrics carry the pool label and each planner.scale span says which pool."""
    from planner_svc.driver import PoolPlannerLoop
    from planner_svc.pools import PoolPlanner, PoolsConfig
    from sluice.types import ReplicaRole

    pool = PlannerConfig(min_replicas=1, max_replicas=6, window_s=10.0, min_observations=2, cooldown_s=30.0,
                         prefill_tokens_per_s=1_000.0, replica_tokens_per_s=1e9, queue_per_replica=1e9)
    replicas = (*(ReplicaLoad(f"p{i}", queued_prefill_tokens=3_000, role=ReplicaRole.PREFILL) for i in range(2)),
                *(ReplicaLoad(f"d{i}", role=ReplicaRole.DECODE) for i in range(2)))

    class Source:
        def observe(self, now: float) -> Observation:
            return Observation(at=now, arrival_rate=0.0, replicas=replicas)

    prefill, decode = RecordingConnector(2), RecordingConnector(2)
    loop = PoolPlannerLoop(PoolPlanner(PoolsConfig(prefill=pool, decode=pool)), Source(),
                           {ReplicaRole.PREFILL: prefill, ReplicaRole.DECODE: decode})
    loop.tick(0.0)
    decisions = loop.tick(1.0)
    assert isinstance(decisions.prefill, ScaleUp) and isinstance(decisions.decode, ScaleDown)
    assert prefill.added == decisions.prefill.n > 0 and not prefill.removed
    assert decode.added == 0 and decode.removed == ["d0"]
    get = loop.metrics.registry.get_sample_value
    assert get("sluice_planner_pool_decisions_total", {"pool": "prefill", "kind": "scale_up", "reason": "backlog"}) == 1
    assert get("sluice_planner_pool_current_replicas", {"pool": "decode"}) == 2
    assert get("sluice_planner_pool_desired_replicas", {"pool": "prefill"}) == 2 + decisions.prefill.n
    assert get("sluice_planner_pool_pressure", {"pool": "prefill", "signal": "backlog"}) == 3.0
    spans = [s for s in span_exporter.get_finished_spans() if s.name == "planner.scale"]
    assert [(s.attributes or {}).get("sluice.planner.pool") for s in spans] == ["prefill", "decode"]
    assert [(s.attributes or {}).get("sluice.replica_id") for s in spans] == [None, "d0"]
    assert all([e.name for e in s.events] == ["pool_scaled"] for s in spans)


def test_the_pool_loop_needs_both_pools_connectors() -> None:
    """A missing pool's connector is refused at construction, naming it."""
    from planner_svc.driver import PoolPlannerLoop
    from planner_svc.pools import PoolPlanner, PoolsConfig
    from sluice.types import ReplicaRole

    with pytest.raises(ValueError, match="decode"):
        PoolPlannerLoop(PoolPlanner(PoolsConfig()), ScriptedSource(0.0), {ReplicaRole.PREFILL: RecordingConnector(1)})
