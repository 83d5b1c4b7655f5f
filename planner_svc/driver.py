"""The planner loop: observe, decide, act, record. The only place that joins the pure core to I/O.

`PlannerLoop.tick(now)` takes one observation from an `ObservationSource` (the router's registry and
the schedulers' queues in a live stack; the simulator's replicas in `sluice sim`), asks the core for
a decision, carries a change out through a `ReplicaConnector`, and records it:
  * metrics (`PlannerMetrics`): decisions by kind and reason, the pressure by signal, desired vs
    current replicas;
  * a span `planner.scale` for every change, with the decision, its signal and pressure, and the
    replica counts before and after (holds are counted, not traced: they happen every tick).
The caller owns the clock and the period (e.g. every 5 s); `now` is an argument here too.

`PoolPlannerLoop` is the same loop for a disaggregated fleet (planner_svc/pools.py): one observation, one
decision per pool (prefill, decode), each carried out through that pool's connector (a new replica joins with
the pool's role; a ScaleDown names a replica of that pool, so the drain stays within it), recorded with a
`pool` label (`PoolPlannerMetrics`) and, for a change, a `planner.scale` span with `sluice.planner.pool` and
a `pool_scaled` event.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from planner_svc.connectors import ReplicaConnector, apply_decision
from planner_svc.core import Decision, Hold, Planner, ScaleDown, ScaleUp
from planner_svc.pools import PoolDecisions, PoolPlanner, pool_observation
from planner_svc.signals import Observation
from sluice.telemetry import get_tracer
from sluice.types import ReplicaRole


class ObservationSource(Protocol):
    """Produces the fleet snapshot the planner decides on."""

    def observe(self, now: float) -> Observation:
        """The snapshot at `now`."""
        ...


@dataclass
class PlannerMetrics:
    """Metrics of the planner (names in docs/planner.md). `desired` is what an external HPA scales on."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.decisions = Counter("sluice_planner_decisions", "Planner decisions by kind (scale_up, scale_down, "
                                 "hold) and reason (signal or hold reason).", ["kind", "reason"], registry=r)
        self.pressure = Gauge("sluice_planner_pressure", "Window pressure by signal (1.0 = at target).",
                              ["signal"], registry=r)
        self.current = Gauge("sluice_planner_current_replicas", "Replicas in the fleet as last observed (ready or warming, not draining).",
                             registry=r)
        self.desired = Gauge("sluice_planner_desired_replicas",
                             "Replicas the planner wants: the observed count plus its last change.", registry=r)
        self.retire = Gauge("sluice_planner_retire_candidate", "1 for the replica the planner retires next.",
                            ["replica"], registry=r)
        self._seen = False

    def record(self, decision: Decision, observation: Observation, pressures: dict[str, float]) -> None:
        """Count the decision; set pressures and current replicas; move desired on a change (and at first)."""
        kind, reason = describe(decision)
        self.decisions.labels(kind, reason).inc()
        for signal, value in pressures.items():
            self.pressure.labels(signal).set(value)
        current = fleet_size(observation)
        self.current.set(current)
        if not self._seen or not isinstance(decision, Hold):
            self.desired.set(current + change_of(decision))
            self._seen = True
        if isinstance(decision, ScaleDown):
            self.retire.clear()
            self.retire.labels(decision.replica_id).set(1)


def fleet_size(observation: Observation) -> int:
    """Replicas in the fleet: ready or warming; draining ones are already leaving."""
    return sum(1 for replica in observation.replicas if not replica.draining)


def describe(decision: Decision) -> tuple[str, str]:
    """(kind, reason) of a decision, as the metrics and spans label it."""
    if isinstance(decision, ScaleUp):
        return "scale_up", decision.signal
    if isinstance(decision, ScaleDown):
        return "scale_down", decision.signal
    return "hold", decision.reason.value


def change_of(decision: Decision) -> int:
    """The change of replica count a decision asks for."""
    if isinstance(decision, ScaleUp):
        return decision.n
    return -1 if isinstance(decision, ScaleDown) else 0


class PlannerLoop:
    """One planner, one source of observations, one connector."""

    def __init__(self, planner: Planner, source: ObservationSource, connector: ReplicaConnector,
                 metrics: PlannerMetrics | None = None) -> None:
        self.planner, self.source, self.connector = planner, source, connector
        self.metrics = metrics if metrics is not None else PlannerMetrics()
        self._tracer = get_tracer("sluice.planner")

    def tick(self, now: float) -> Decision:
        """Observe at `now`, decide, carry out a change, record it; return the decision.

        Raises what the connector raises (the decision is recorded first; the core's cooldown holds
        the next change either way, so a failed action is not retried at once).
        """
        observation = self.source.observe(now)
        decision = self.planner.step(observation)
        signals = self.planner.last_signals
        self.metrics.record(decision, observation, signals.pressures if signals is not None else {})
        if isinstance(decision, Hold):
            return decision
        kind, reason = describe(decision)
        before = fleet_size(observation)
        with self._tracer.start_as_current_span("planner.scale") as span:
            span.set_attributes({"sluice.planner.decision": kind, "sluice.planner.reason": reason,
                                 "sluice.planner.pressure": decision.pressure,
                                 "sluice.planner.replicas_before": before,
                                 "sluice.planner.replicas_after": before + change_of(decision)})
            if isinstance(decision, ScaleDown):
                span.set_attribute("sluice.replica_id", decision.replica_id)
            apply_decision(self.connector, decision)
        return decision


@dataclass
class PoolPlannerMetrics:
    """Metrics of the pool planner, each with a `pool` label (prefill, decode; names in docs/planner.md)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.decisions = Counter("sluice_planner_pool_decisions", "Pool planner decisions by pool, kind (scale_up, "
                                 "scale_down, hold) and reason (signal or hold reason).", ["pool", "kind", "reason"],
                                 registry=r)
        self.pressure = Gauge("sluice_planner_pool_pressure", "Window pressure by pool and signal (1.0 = at target).",
                              ["pool", "signal"], registry=r)
        self.current = Gauge("sluice_planner_pool_current_replicas", "Replicas of the pool as last observed (ready "
                             "or warming, not draining).", ["pool"], registry=r)
        self.desired = Gauge("sluice_planner_pool_desired_replicas", "Replicas the planner wants in the pool: the "
                             "observed count plus its last change.", ["pool"], registry=r)

    def record(self, pool: str, decision: Decision, observation: Observation, pressures: dict[str, float]) -> None:
        """Count the pool's decision; set its pressures and replica counts (`observation`: the pool's replicas)."""
        kind, reason = describe(decision)
        self.decisions.labels(pool, kind, reason).inc()
        for signal, value in pressures.items():
            self.pressure.labels(pool, signal).set(value)
        current = fleet_size(observation)
        self.current.labels(pool).set(current)
        self.desired.labels(pool).set(current + change_of(decision))


class PoolPlannerLoop:
    """One pool planner, one source of observations, one connector per pool (see the module docstring)."""

    def __init__(self, planner: PoolPlanner, source: ObservationSource,
                 connectors: Mapping[ReplicaRole, ReplicaConnector], metrics: PoolPlannerMetrics | None = None) -> None:
        missing = {ReplicaRole.PREFILL, ReplicaRole.DECODE} - set(connectors)
        if missing:
            raise ValueError(f"the pool planner needs a connector for each pool; missing: "
                             f"{sorted(role.value for role in missing)}")
        self.planner, self.source, self.connectors = planner, source, connectors
        self.metrics = metrics if metrics is not None else PoolPlannerMetrics()
        self._tracer = get_tracer("sluice.planner")

    def tick(self, now: float) -> PoolDecisions:
        """Observe at `now`, decide for each pool, carry out its change, record it; return both decisions.

        Raises what a connector raises (the decisions are recorded first; each pool's cooldown holds its next
        change either way)."""
        observation = self.source.observe(now)
        decisions = self.planner.step(observation)
        for role, planner, decision in ((ReplicaRole.PREFILL, self.planner.prefill, decisions.prefill),
                                        (ReplicaRole.DECODE, self.planner.decode, decisions.decode)):
            pool = pool_observation(observation, role)
            signals = planner.last_signals
            self.metrics.record(role.value, decision, pool, signals.pressures if signals is not None else {})
            if not isinstance(decision, Hold):
                self._apply(role, decision, fleet_size(pool))
        return decisions

    def _apply(self, role: ReplicaRole, decision: ScaleUp | ScaleDown, before: int) -> None:
        kind, reason = describe(decision)
        attributes: dict[str, str | int | float] = {
            "sluice.planner.pool": role.value, "sluice.planner.decision": kind, "sluice.planner.reason": reason,
            "sluice.planner.pressure": decision.pressure, "sluice.planner.replicas_before": before,
            "sluice.planner.replicas_after": before + change_of(decision)}
        if isinstance(decision, ScaleDown):
            attributes["sluice.replica_id"] = decision.replica_id
        with self._tracer.start_as_current_span("planner.scale", attributes=attributes) as span:
            span.add_event("pool_scaled", attributes=attributes)
            apply_decision(self.connectors[role], decision)
