"""`sluice up --autoscale MIN:MAX`: the planner (planner_svc) sizing the replicas of a local stack.

Theory of operation
- `StackLauncher` is the planner's `ReplicaLauncher` on this machine: `start_replica` starts a worker
  with a fresh replica id (its scheduler follows once the worker serves; the scheduler registers with
  the router, WARMING, and reports READY: only then is it routed to); `stop_replica` drains it: the
  router stops routing to it at once, its scheduler gets SIGTERM, finishes its requests for up to its
  drain timeout (`--drain-timeout`, 30 s by default) and cancels what is left (those requests end
  CANCELLED), then exits; its worker is stopped after it. Both return at once: the supervisor's pass
  (`StackFleet.advance_replicas`) moves replicas along.
- `StackObservations` is the planner's `ObservationSource`: the router's registry (READY, WARMING,
  DRAINING) and every scheduler's Stats (waiting = queue length, queued prefill tokens, waiting +
  running = in flight, KV blocks used / total). The arrival rate is counted from Stats deltas:
  requests that arrived on a replica between two observations = its change of (finished + cancelled
  + timed out + waiting + running); a replica seen for the first time counts from zero. Admission's
  own arrival counter is not read.
- Latency and lengths come from the services' `/metrics` pages (`sluice_tools.scrape`), as growth since
  the previous observation: observed TTFT and TPOT are the means of admission's histograms, predicted
  TTFT the mean of admission's routed prediction; the mean prompt and output lengths are the
  schedulers' prompt and generated tokens per first token (requests entering service) in the
  interval: the lengths in steady state, a rate-weighted estimate while load changes. An interval with no new sample leaves the value None (no pressure). With `--no-metrics`
  these stay None and the demand and latency signals 0.
  Not observed: cached prefix blocks (the victim is chosen by in-flight requests and queue length).
- `Autoscaler.tick(now)` runs `PlannerLoop.tick` every `period_s` and reports each scale event and
  each change of the fleet's READY count as one line.
- `sluice up --disagg P:D --autoscale MIN:MAX`: `PoolAutoscaler` runs `PoolPlannerLoop` (planner_svc/pools.py)
  instead, each pool kept within MIN..MAX: the observations carry each replica's role (its pool), queued
  prefill tokens, queued requests and TTFT size the prefill pool, KV use, requests in flight and TPOT the decode
  pool (the TPOT its decode schedulers measure, `sluice_time_per_output_token_seconds`: admission's would count
  the hand-off as decode time); a pool's ScaleUp starts replicas of its role (`PoolLauncher`: `StackFleet.add_replica(role)`) and its
  ScaleDown drains the replica of that pool it names. Each event line names the pool.
- `Autoscaler.serve_metrics()` serves the planner's metrics (`PlannerMetrics`: decisions, pressure by
  signal, current/desired replicas, the next retirement) on a loopback port; `sluice up --autoscale`
  prints the URL with the other services' (the Grafana row "Fleet: planner, drains, migration").
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from planner_svc.config import PlannerConfig
from planner_svc.connectors import LocalProcessConnector
from planner_svc.core import Planner, ScaleDown, ScaleUp
from planner_svc.driver import PlannerLoop, PoolPlannerLoop
from planner_svc.pools import PoolPlanner, PoolsConfig
from planner_svc.signals import Observation, ReplicaLoad
from sluice.prom import serve_metrics
from sluice.types import ReplicaRole
from sluice.v1 import router_pb2, scheduler_pb2, scheduler_pb2_grpc
from sluice_tools.scrape import Scraper
from sluice_tools.stack import Stack

__all__ = ["Autoscaler", "PoolAutoscaler", "PoolLauncher", "StackLauncher", "StackObservations", "local_planner_config",
           "local_pools_config", "parse_bounds", "quick_planner_config", "quick_pools_config"]


def parse_bounds(text: str) -> tuple[int, int]:
    """Parse `MIN:MAX` (e.g. "1:3"); raises ValueError naming the problem."""
    low, sep, high = text.partition(":")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise ValueError(f"--autoscale takes MIN:MAX, e.g. 1:3; got {text!r}")
    lo, hi = int(low), int(high)
    if not 1 <= lo <= hi:
        raise ValueError(f"--autoscale needs 1 <= MIN <= MAX, got {lo}:{hi}")
    return lo, hi


def local_planner_config(min_replicas: int, max_replicas: int, load_time_s: float = 3.0) -> PlannerConfig:
    """The planner of `sluice up --autoscale`: local replicas start in seconds, not the minute and more of a
    GPU replica (PlannerConfig's defaults), so the window, cooldown and load time are scaled down.

    Scale-down waits for a nearly empty queue (0.15): the signals observed here are queues, which collapse
    as soon as capacity suffices; at the default 0.5 a fleet that just absorbed a rising load shrinks while
    the load still lasts (measured: 3 -> 1 replica at 30 req/s), then grows again.

    `load_time_s`: how long a new replica takes to serve; `sluice up` passes the start time it measured of the
    replicas it started (a vLLM engine's is a minute or more), so a burst shorter than that starts none."""
    return PlannerConfig(min_replicas=min_replicas, max_replicas=max_replicas, window_s=10.0, min_observations=3,
                         cooldown_s=max(15.0, load_time_s), load_time_s=load_time_s, warmup_s=1.0, queue_per_replica=4.0,
                         scale_down_pressure=0.15, target_pressure=0.5)


def quick_planner_config(min_replicas: int, max_replicas: int) -> PlannerConfig:
    """A planner for tests on cost-model replicas that start in about a second: short window, cooldown and
    load time, and a queue target low enough for a small test load to move it."""
    return PlannerConfig(min_replicas=min_replicas, max_replicas=max_replicas, window_s=4.0, min_observations=3,
                         cooldown_s=4.0, load_time_s=1.0, warmup_s=0.5, queue_per_replica=2.0)


def local_pools_config(min_replicas: int, max_replicas: int, load_time_s: float = 3.0) -> PoolsConfig:
    """The two pools of `sluice up --disagg P:D --autoscale MIN:MAX`: each `local_planner_config`, each pool kept
    within MIN..MAX."""
    pool = local_planner_config(min_replicas, max_replicas, load_time_s)
    return PoolsConfig(prefill=pool, decode=pool)


def quick_pools_config(min_replicas: int, max_replicas: int) -> PoolsConfig:
    """Pools for tests on cost-model replicas: `quick_planner_config` each, with `local_planner_config`'s
    scale-down threshold (a nearly empty queue, 0.15): a pool's queue collapses as soon as one more replica
    serves, and at 0.5 the pool retired the replica it had just asked for while that one still warmed up. Decode
    load pressure 1 at 8 requests in flight per decode replica (not a GPU's 128), for a small test load."""
    pool = replace(quick_planner_config(min_replicas, max_replicas), scale_down_pressure=0.15, target_pressure=0.5)
    return PoolsConfig(prefill=pool, decode=pool, decode_seqs_per_replica=8.0)


class StackLauncher:
    """Starts and retires replicas of a running Stack (planner_svc.connectors.ReplicaLauncher)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    def start_replica(self) -> str:
        return self.stack.fleet.add_replica()

    def stop_replica(self, replica_id: str) -> None:
        self.stack.fleet.retire_replica(replica_id)

    def replica_ids(self) -> Sequence[str]:
        return [rid for rid, replica in self.stack.replicas.items() if not replica.retiring]


class PoolLauncher:
    """Starts and retires the replicas of one pool (one role) of a running disaggregated Stack
    (planner_svc.connectors.ReplicaLauncher)."""

    def __init__(self, stack: Stack, role: ReplicaRole) -> None:
        self.stack, self.role = stack, role

    def start_replica(self) -> str:
        return self.stack.fleet.add_replica(self.role.value)

    def stop_replica(self, replica_id: str) -> None:
        self.stack.fleet.retire_replica(replica_id)

    def replica_ids(self) -> Sequence[str]:
        return [rid for rid, replica in self.stack.replicas.items()
                if not replica.retiring and replica.role == self.role.value]


@dataclass
class StackObservations:
    """Observations of a running Stack for the planner (see the module docstring)."""

    stack: Stack
    last: Observation | None = None
    """The newest observation."""
    _arrived: dict[str, int] = field(default_factory=dict)
    _last_at: float | None = None

    def __post_init__(self) -> None:
        admission = self.stack.admission
        self._admission = Scraper(lambda: [admission.metrics_url] if admission is not None else [], ADMISSION_SERIES)
        self._schedulers = Scraper(lambda: [r.scheduler.metrics_url for r in self.stack.replicas.values()
                                            if r.scheduler is not None], SCHEDULER_SERIES)
        self._decoders = Scraper(lambda: [r.scheduler.metrics_url for r in self.stack.replicas.values()
                                          if r.scheduler is not None and r.role == ReplicaRole.DECODE.value],
                                 DECODE_SERIES)

    def observe(self, now: float) -> Observation:
        try:
            listed = {r.replica_id: r.state for r in self.stack.fleet.list_replicas()}
        except grpc.RpcError:
            listed = {}
        loads, arrivals = [], 0
        for replica_id, replica in self.stack.replicas.items():
            stats = self._stats(replica.scheduler.address) if replica.scheduler is not None else None
            state = listed.get(replica_id)
            loads.append(_load(replica_id, state, stats, replica.retiring, ReplicaRole(replica.role)))
            if stats is not None:
                seen = stats.finished + stats.cancelled + stats.timed_out + stats.waiting + stats.running
                arrivals += max(0, seen - self._arrived.get(replica_id, 0))
                self._arrived[replica_id] = seen
        elapsed = now - self._last_at if self._last_at is not None else 0.0
        self._last_at = now
        self.last = Observation(at=now, arrival_rate=arrivals / elapsed if elapsed > 0 else 0.0,
                                replicas=tuple(loads), **self._latency_and_lengths())
        return self.last

    def _latency_and_lengths(self) -> dict[str, Any]:
        """The Observation fields read from the services' metrics since the previous observation."""
        a, s = self._admission.delta(), self._schedulers.delta()
        return {"decode_tpot_observed_s": _ratio(self._decoders.delta(), "sluice_time_per_output_token_seconds"),
                "ttft_observed_s": _ratio(a, "sluice_admission_time_to_first_token_seconds"),
                "tpot_observed_s": _ratio(a, "sluice_admission_time_per_output_token_seconds"),
                "ttft_predicted_s": _ratio(a, "sluice_admission_predicted_ttft_seconds"),
                "mean_input_tokens": _per(s, "vllm:prompt_tokens_total", "vllm:time_to_first_token_seconds_count"),
                "mean_output_tokens": _per(s, "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count")}

    def _stats(self, address: str) -> scheduler_pb2.SchedulerStats | None:
        with self.stack.channel(address) as channel:
            try:
                return scheduler_pb2_grpc.SchedulerServiceStub(channel).Stats(scheduler_pb2.StatsRequest(),
                                                                                timeout=1)
            except grpc.RpcError:
                return None


ADMISSION_SERIES = tuple(f"{name}_{part}" for name in ("sluice_admission_time_to_first_token_seconds",
                                                       "sluice_admission_time_per_output_token_seconds",
                                                       "sluice_admission_predicted_ttft_seconds")
                         for part in ("sum", "count"))
DECODE_SERIES = ("sluice_time_per_output_token_seconds_sum", "sluice_time_per_output_token_seconds_count")
"""What the decode replicas measure of their own TPOT (their first token there to their last: no hand-off)."""
SCHEDULER_SERIES = ("vllm:prompt_tokens_total", "vllm:time_to_first_token_seconds_count",
                    "vllm:generation_tokens_total")


def _ratio(delta: dict[str, float], histogram: str) -> float | None:
    """Mean of a histogram's new samples, or None when it got none."""
    count = delta.get(f"{histogram}_count", 0.0)
    return delta.get(f"{histogram}_sum", 0.0) / count if count > 0 else None


def _per(delta: dict[str, float], total: str, count: str) -> float:
    """`total`'s growth per unit of `count`'s growth (0 when `count` did not grow)."""
    n = delta.get(count, 0.0)
    return delta.get(total, 0.0) / n if n > 0 else 0.0


def _load(replica_id: str, state: int | None, stats: scheduler_pb2.SchedulerStats | None,
          retiring: bool, role: ReplicaRole = ReplicaRole.BOTH) -> ReplicaLoad:
    """One replica as the planner sees it: ready only when the router routes to it; `role`: its pool."""
    draining = retiring or state == router_pb2.DRAINING
    if stats is None:
        return ReplicaLoad(replica_id, ready=False, draining=draining, role=role)
    kv = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
    return ReplicaLoad(replica_id, ready=state == router_pb2.READY, queue_length=stats.waiting,
                       queued_prefill_tokens=stats.queued_prefill_tokens, in_flight=stats.waiting + stats.running,
                       kv_used_fraction=kv, draining=draining, role=role)


class _Ticking:
    """What both autoscalers share: the period gate, the metrics server and the READY line."""

    loop: PlannerLoop | PoolPlannerLoop
    period_s: float
    on_event: Callable[[str], None]
    _next_at: float | None = None
    _ready: tuple[str, ...] = ()

    def serve_metrics(self, port: int = 0, addr: str = "127.0.0.1") -> str:
        """Serve the planner's metrics over HTTP (a daemon thread); return the URL."""
        bound = serve_metrics(self.loop.metrics.registry, port, addr)
        return f"http://{addr}:{bound}/metrics"

    def _due(self, now: float) -> bool:
        """True (and the next tick scheduled) when the planner's period is due at `now`."""
        if self._next_at is not None and now < self._next_at:
            return False
        self._next_at = now + self.period_s
        return True

    def _report_ready(self, ready: tuple[str, ...]) -> None:
        """Print the READY replicas when they changed since the last tick."""
        if ready != self._ready:
            self._ready = ready
            self.on_event(f"autoscale: READY replicas: {', '.join(ready) or 'none'}")


@dataclass
class Autoscaler(_Ticking):
    """The planner loop on a running Stack, ticked from the supervisor's pass every `period_s`."""

    stack: Stack
    config: PlannerConfig
    period_s: float = 1.0
    on_event: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))
    events: list[tuple[float, str, int]] = field(default_factory=list)
    """(time, "scale_up"/"scale_down", replicas after) for each change."""

    def __post_init__(self) -> None:
        self.source = StackObservations(self.stack)
        self.launcher = StackLauncher(self.stack)
        self.loop: PlannerLoop = PlannerLoop(Planner(self.config), self.source,
                                             LocalProcessConnector(self.launcher))

    def tick(self, now: float) -> None:
        """Run the planner if its period is due; report changes of the fleet and of its READY replicas."""
        if not self._due(now):
            return
        decision = self.loop.tick(now)
        count = len(self.launcher.replica_ids())
        if (change := _change(decision, count)) is not None:
            self.events.append((now, change[0], count))
            self.on_event(change[1])
        self._report_ready(tuple(r.replica_id for r in self.source.last.replicas if r.serving)
                           if self.source.last else ())


def _change(decision: object, count: int, pool: str = "") -> tuple[str, str] | None:
    """Return ("scale_up"/"scale_down", the line that reports it) for a decision that changed the fleet (a pool's
    when `pool` names one; `count` its replicas after), or None."""
    prefix, unit = (f"{pool} pool: ", f"{pool} replicas") if pool else ("", "replicas")
    if isinstance(decision, ScaleUp):
        return "scale_up", (f"autoscale: {prefix}scale up by {decision.n} ({decision.signal} pressure "
                            f"{decision.pressure:.2f}) -> {count} {unit}")
    if isinstance(decision, ScaleDown):
        return "scale_down", (f"autoscale: {prefix}scale down: draining {decision.replica_id} ({decision.signal} "
                              f"pressure {decision.pressure:.2f}) -> {count} {unit}")
    return None


@dataclass
class PoolAutoscaler(_Ticking):
    """The pool planner loop on a running disaggregated Stack, ticked from the supervisor's pass every `period_s`
    (the module docstring): the prefill and decode pools sized apart."""

    stack: Stack
    config: PoolsConfig
    period_s: float = 1.0
    on_event: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))
    events: list[tuple[float, str, str, int]] = field(default_factory=list)
    """(time, pool, "scale_up"/"scale_down", the pool's replicas after) for each change."""

    def __post_init__(self) -> None:
        self.source = StackObservations(self.stack)
        self.launchers = {role: PoolLauncher(self.stack, role) for role in (ReplicaRole.PREFILL, ReplicaRole.DECODE)}
        self.loop: PoolPlannerLoop = PoolPlannerLoop(
            PoolPlanner(self.config), self.source,
            {role: LocalProcessConnector(launcher) for role, launcher in self.launchers.items()})

    def tick(self, now: float) -> None:
        """Run the pool planner if its period is due; report each pool's changes and the READY replicas."""
        if not self._due(now):
            return
        decisions = self.loop.tick(now)
        for role, decision in ((ReplicaRole.PREFILL, decisions.prefill), (ReplicaRole.DECODE, decisions.decode)):
            count = len(self.launchers[role].replica_ids())
            if (change := _change(decision, count, role.value)) is not None:
                self.events.append((now, role.value, change[0], count))
                self.on_event(change[1])
        self._report_ready(tuple(f"{r.replica_id} ({r.role.value})" for r in self.source.last.replicas if r.serving)
                           if self.source.last else ())
