"""The simulated fleet: the real planner sizing a simulated deployment, with load, warm-up, drain and crashes.

Theory of operation. `FleetSimulator` is the `Simulator` (cluster.py: the real admission, router and
scheduler cores on a virtual clock) plus the fleet's life:

- every `planner_interval_s` it builds an `Observation` (arrival rate and length mix since the last
  one; per replica: ready, queue, queued prefill tokens, in-flight requests, KV use, draining) and
  calls `planner_svc.Planner.step`, the same core `sluice up --autoscale` and Kubernetes run;
- `ScaleUp(n)` starts n replicas: each registers WARMING and holds its GPU from that moment, and
  heartbeats READY `load_time_s + warmup_s` later (the planner's own figures, see below);
- `ScaleDown(id)` drains as the services do: the router stops routing (RouterCore.drain), the
  replica finishes what it has for up to `drain_timeout_s`, then hands the rest to migration
  (cancel at the replica, re-placed by "admission"); once empty it reports GONE through the one glue
  (`sluice.glue.apply_heartbeat`) and its GPU is released;
- a crash (`crash_at_s`) kills a replica at once: its rounds never return; `detect_s` later admission's
  watchdog moves its requests (it probes a dead scheduler at once after the stall timeout); the router
  forgets it at its heartbeat timeout;
- migration is admission's (admission_svc/migration.py) in simulated form: the request is submitted on
  the new replica under the same id with its prompt plus the tokens streamed so far and max_tokens
  reduced by them; its token times continue and its output count adds the streamed ones, so nothing
  is lost or counted twice; after `migration_limit` moves it ends failed.

Assumed figures (FleetConfig and PlannerConfig defaults), and where they come from:
  load_time_s 60, warmup_s 15   PlannerConfig; docs/planner.md "Assumed load and warm-up times"
                                (Llama-3-8B on one GPU, from published vLLM startup logs; not measured)
  drain_timeout_s 30            the scheduler's --drain-timeout default
  detect_s 2.0                  admission's stall_timeout_s (FrontDoorConfig): a dead scheduler's
                                requests move once they stall that long
  heartbeat timeout 10 s        RouterConfig.heartbeat_timeout_s (the router forgets a silent replica)
  planner_interval_s 5          docs/planner.md ("one Observation per tick, e.g. every 5 s")
GPU-seconds count each replica from the moment it is asked for (it holds a GPU while loading) to its
retirement, crash, or the end of the run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from planner_svc.config import PlannerConfig
from planner_svc.core import Decision, Planner, ScaleDown, ScaleUp
from planner_svc.pools import PoolsConfig
from planner_svc.signals import Observation, ReplicaLoad
from router_svc.core import NoReplicaAvailable, RouteQuery
from scheduler_svc.core import SchedulerCore
from sluice import glue
from sluice.core_errors import RequestRejected
from sluice.types import HeartbeatReport, NewRequest, ReplicaRole, ReplicaState, RequestStatus, SamplingParams
from sluice.types import ReplicaLoad as RouterLoad
from sluice_tools.metrics import RequestRecord
from sluice_tools.sim.cluster import _READY, _RETRY, Simulator, _Replica
from sluice_tools.sim.config import SimConfig
from sluice_tools.workload import WorkloadRequest

__all__ = ["FleetConfig", "FleetReport", "FleetSimulator", "rate_profile_workload"]

_PLAN, _DRAIN_DEADLINE, _CRASH, _CRASH_DETECT, _FORGET, _MOVE = range(20, 26)


@dataclass(frozen=True)
class FleetConfig:
    """How the simulated fleet changes: the planner's settings and the fleet's timings."""

    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """The planner's bounds, thresholds and load/warm-up times (the fleet uses the same times)."""
    planner_interval_s: float = 5.0
    """Seconds between two observations and decisions."""
    drain_timeout_s: float = 30.0
    """A draining replica finishes its requests for this long, then hands the rest to migration."""
    detect_s: float = 2.0
    """Seconds from a crash to admission moving the dead replica's requests."""
    heartbeat_timeout_s: float = 10.0
    """Seconds from a crash to the router forgetting the replica."""
    migration_limit: int = 3
    """Moves one request may make before it ends failed."""
    crash_at_s: float | None = None
    """Kill `crash_replica` at this simulated time (None: no crash)."""
    crash_replica: str = "replica-0"
    autoscale: bool = True
    """False: a static fleet of `SimConfig.replicas` (crashes and the report still apply)."""
    pools: PoolsConfig | None = None
    """With `SimConfig.disagg`: the prefill and decode pools' planners (planner_svc/pools.py); None: each pool is
    planned with `planner` (disagg_fleet.py)."""

    def pools_config(self) -> PoolsConfig:
        """Return the pools' planners: `pools`, or `planner` for each pool."""
        return self.pools if self.pools is not None else PoolsConfig(prefill=self.planner, decode=self.planner)


@dataclass
class FleetReport:
    """What the fleet did: scale events, readiness and drain times, migrations, GPU-seconds."""

    scale_events: list[dict[str, Any]] = field(default_factory=list)
    time_to_ready_s: list[float] = field(default_factory=list)
    drain_s: list[float] = field(default_factory=list)
    migrations: dict[str, int] = field(default_factory=dict)
    """Moves by cause: handed_off (drain timeout), replica_lost (crash)."""
    migration_failures: int = 0
    gpu_seconds: float = 0.0
    peak_replicas: int = 0
    pools: dict[str, dict[str, Any]] | None = None
    """Pools sized apart (disagg_fleet.py): per pool, its GPU-seconds, scale-ups and -downs, peak and each
    replica's timeline; None for an aggregated fleet."""

    def to_dict(self) -> dict[str, Any]:
        """Return the report as plain data (the summary's "fleet" section)."""
        ups = sum(1 for e in self.scale_events if e["kind"] == "scale_up")
        out = {"gpu_seconds": self.gpu_seconds, "scale_ups": ups,
               "scale_downs": sum(1 for e in self.scale_events if e["kind"] == "scale_down"),
               "peak_replicas": self.peak_replicas, "time_to_ready_s": self.time_to_ready_s,
               "drain_s": self.drain_s, "migrations": dict(self.migrations),
               "migration_failures": self.migration_failures, "scale_events": self.scale_events}
        if self.pools is not None:
            out["pools"] = self.pools
        return out


class FleetSimulator(Simulator):
    """A Simulator whose replica set the planner changes (see the module docstring)."""

    superseded_heartbeats = False  # its own events read the router's loads (see Simulator)

    def __init__(self, config: SimConfig, requests: Sequence[WorkloadRequest], fleet: FleetConfig) -> None:
        super().__init__(config, requests)
        self.fleet = fleet
        self.planner = Planner(fleet.planner)
        self.report = FleetReport(peak_replicas=config.replicas)
        info = self.cost.info()
        self._scheduler_config = config.scheduler_config(self.num_blocks, info.num_host_blocks, self.max_model_len)
        self._by_id = {r.request_id: r for r in self.requests}
        self._started_at = {r.replica_id: 0.0 for r in self.replicas}
        self._ready_at: dict[str, float] = {}
        self._drain_began: dict[str, float] = {}
        self._ended_at: dict[str, float] = {}
        self._dead: set[str] = set()
        self._draining: dict[str, float] = {}
        self._handing_off: set[str] = set()
        self._offsets: dict[str, int] = {}
        self._moves: dict[str, int] = {}
        self._arrivals: list[WorkloadRequest] = []
        self._last_plan = 0.0

    # ---- the run ------------------------------------------------------------------------------
    def run(self) -> list[RequestRecord]:
        """Play the workload with the fleet changing under it; fill `report`."""
        if self.fleet.autoscale:
            self.push(self.fleet.planner_interval_s, _PLAN)
        if self.fleet.crash_at_s is not None:
            self.push(self.fleet.crash_at_s, _CRASH, self.fleet.crash_replica)
        records = super().run()
        self.report.gpu_seconds = sum(self._gpu_seconds(rid) for rid in self._started_at)
        return records

    def _gpu_seconds(self, replica_id: str) -> float:
        """The replica's GPU time: from its request to its retirement, crash, or the end of the run's span."""
        end = self.end_s  # the run's span, as the summary's simulated_s
        return max(0.0, min(self._ended_at.get(replica_id, end), end) - self._started_at[replica_id])

    def _timeline(self, replica_id: str) -> dict[str, Any]:
        """The replica's life: asked for, READY, draining and ended (None: not reached in the run)."""
        def at(times: dict[str, float]) -> float | None:
            return round(times[replica_id], 3) if replica_id in times else None
        return {"replica": replica_id, "started_s": at(self._started_at), "ready_s": at(self._ready_at),
                "draining_s": at(self._drain_began), "ended_s": at(self._ended_at),
                "gpu_seconds": self._gpu_seconds(replica_id)}

    def _handlers(self) -> dict[int, Callable[[Any], None]]:
        handlers = super()._handlers()
        handlers.update({_PLAN: self._on_plan, _DRAIN_DEADLINE: self._on_drain_deadline, _CRASH: self._on_crash,
                         _CRASH_DETECT: self._on_crash_detect, _FORGET: self._on_forget, _MOVE: self._on_move})
        return handlers

    def _live(self) -> list[_Replica]:
        return [r for r in self.replicas if r.replica_id not in self._dead and r.state is not ReplicaState.GONE]

    def _busy(self) -> bool:
        if self._next_arrival < len(self.requests):
            return True
        if any(r.busy or r.core.has_unfinished() for r in self._live()):
            return True
        return any(kind in (_RETRY, _MOVE) for _, _, kind, _ in self._heap)

    # ---- what the base does, minus the dead and the retired -----------------------------------
    def _on_arrival(self, request: WorkloadRequest) -> None:
        self._arrivals.append(request)
        super()._on_arrival(request)

    def _on_round_done(self, payload: tuple[_Replica, Any, Any]) -> None:
        replica = payload[0]
        if replica.replica_id in self._dead:
            return  # the round died with its replica
        super()._on_round_done(payload)
        self._retire_if_drained(replica)

    def _on_deadline(self, replica: _Replica) -> None:
        if replica.replica_id not in self._dead:
            super()._on_deadline(replica)

    def _heartbeat(self, replica: _Replica) -> None:
        if replica.replica_id not in self._dead and replica.state is not ReplicaState.GONE:
            super()._heartbeat(replica)

    def _on_ready(self, replica: _Replica) -> None:
        if replica.replica_id in self._dead or replica.state is not ReplicaState.WARMING:
            return
        super()._on_ready(replica)
        self._ready_at[replica.replica_id] = self.now
        if self.now > 0:
            self.report.time_to_ready_s.append(self.now - self._started_at[replica.replica_id])

    def _route(self, query: RouteQuery) -> Any:
        decision = super()._route(query)
        if decision.replica_id in self._dead:  # the router does not know yet: Submit would fail
            raise NoReplicaAvailable(f"replica {decision.replica_id} does not answer")
        return decision

    def _finish(self, replica: _Replica, finished: Any) -> None:
        rid = finished.request_id
        if rid in self._handing_off and finished.status is RequestStatus.CANCELLED:
            self._handing_off.discard(rid)
            self._placement.pop(rid, None)
            self.router.on_request_done(replica.replica_id, rid, self.now)
            self._move(rid, "handed_off")
            return
        super()._finish(replica, finished)
        self.records[rid].output_tokens += self._offsets.pop(rid, 0)

    # ---- the planner ----------------------------------------------------------------------------
    def _on_plan(self, _: object) -> None:
        for role, decision in self._decide(self._observe()):
            self._apply(role, decision)
        if self._busy():
            self.push(self.now + self.fleet.planner_interval_s, _PLAN)

    def _decide(self, observation: Observation) -> list[tuple[ReplicaRole, Decision]]:
        """The planner's decisions, each with the role of the replicas it concerns (one fleet: BOTH)."""
        return [(ReplicaRole.BOTH, self.planner.step(observation))]

    def _apply(self, role: ReplicaRole, decision: Decision) -> None:
        """Carry a decision out: start n replicas of `role`, or drain the one named."""
        if isinstance(decision, ScaleUp):
            for _ in range(decision.n):
                self._add_replica(role)
            self._event("scale_up", f"+{decision.n}", decision.signal, decision.pressure, role)
        elif isinstance(decision, ScaleDown):
            self._drain(decision.replica_id)
            self._event("scale_down", decision.replica_id, decision.signal, decision.pressure, role)

    def _role_of(self, replica: _Replica) -> ReplicaRole:
        """The replica's pool (an aggregated fleet has one: BOTH)."""
        return ReplicaRole.BOTH

    def _observe(self) -> Observation:
        now, arrivals = self.now, self._arrivals
        elapsed = max(now - self._last_plan, 1e-9)
        self._last_plan, self._arrivals = now, []
        loads = []
        for replica in self._live():
            stats = replica.core.stats()
            total = stats.kv_blocks_total or 1
            loads.append(ReplicaLoad(
                replica.replica_id, ready=replica.state is not ReplicaState.WARMING, queue_length=stats.waiting,
                queued_prefill_tokens=stats.queued_prefill_tokens, in_flight=stats.waiting + stats.running,
                kv_used_fraction=stats.kv_blocks_used / total, draining=replica.replica_id in self._draining,
                role=self._role_of(replica)))
        count = len(arrivals) or 1
        return Observation(now, len(arrivals) / elapsed, tuple(loads),
                           mean_input_tokens=sum(r.input_length for r in arrivals) / count,
                           mean_output_tokens=sum(r.output_length for r in arrivals) / count)

    def _event(self, kind: str, what: str, signal: str, pressure: float,
               role: ReplicaRole = ReplicaRole.BOTH) -> None:
        serving = [r for r in self._live() if r.replica_id not in self._draining]
        self.report.peak_replicas = max(self.report.peak_replicas, len(serving))
        event: dict[str, Any] = {"t": round(self.now, 3), "kind": kind, "what": what, "signal": signal,
                                 "pressure": round(pressure, 3), "replicas_after": len(serving)}
        if role is not ReplicaRole.BOTH:  # pools sized apart: which pool, and its size after
            event["pool"] = role.value
            event["pool_replicas_after"] = sum(1 for r in serving if self._role_of(r) is role)
        self.report.scale_events.append(event)

    def _add_replica(self, role: ReplicaRole = ReplicaRole.BOTH) -> None:
        replica = self._new_replica(len(self.replicas), role)
        self.replicas.append(replica)
        self._started_at[replica.replica_id] = self.now
        self._register(replica)
        self.push(self.now + self._ready_delay_s(role), _READY, replica)

    def _new_replica(self, index: int, role: ReplicaRole) -> _Replica:
        """The replica a ScaleUp starts: its id and a fresh scheduler core of the deployment's configuration."""
        return _Replica(index, f"replica-{index}", SchedulerCore(self._scheduler_config, f"replica-{index}"))

    def _ready_delay_s(self, role: ReplicaRole) -> float:
        """Seconds from a new replica's request to READY: the planner's load + warm-up."""
        return self.fleet.planner.ready_delay_s

    # ---- drain and retirement -----------------------------------------------------------------
    def _drain(self, replica_id: str) -> None:
        replica = self.replicas[int(replica_id.rsplit("-", 1)[1])]
        self.router.drain(replica_id, self.now)
        replica.state = ReplicaState.DRAINING
        self._draining[replica_id] = self.now
        self._drain_began[replica_id] = self.now
        self.push(self.now + self.fleet.drain_timeout_s, _DRAIN_DEADLINE, replica)
        self._retire_if_drained(replica)

    def _on_drain_deadline(self, replica: _Replica) -> None:
        if replica.state is not ReplicaState.DRAINING or replica.replica_id in self._dead:
            return
        self._hand_over(replica, self._stranded(replica))

    def _stranded(self, replica: _Replica) -> list[str]:
        """The requests a draining replica still has at its drain timeout: those placed on it."""
        return [rid for rid, where in self._placement.items() if where is replica]

    def _hand_over(self, replica: _Replica, request_ids: list[str]) -> None:
        """Cancel the requests at the replica, to be moved by migration (`_finish`); retire it if it is empty."""
        for rid in request_ids:
            self._handing_off.add(rid)
            replica.core.cancel(rid, self.now)
        self._absorb(replica, replica.core.take_events())
        self._retire_if_drained(replica)

    def _holds_more(self, replica: _Replica) -> bool:
        """True while the replica holds work its core does not show (an aggregated replica: none)."""
        return False

    def _retire_if_drained(self, replica: _Replica) -> None:
        if replica.state is not ReplicaState.DRAINING or replica.busy or replica.core.has_unfinished():
            return
        if self._holds_more(replica):
            return
        rid = replica.replica_id
        replica.state = ReplicaState.GONE
        glue.apply_heartbeat(self.router, HeartbeatReport(rid, ReplicaState.GONE, RouterLoad()), self.now)
        self._ended_at[rid] = self.now
        self.report.drain_s.append(self.now - self._draining.pop(rid))

    # ---- crashes and migration ----------------------------------------------------------------
    def _on_crash(self, replica_id: str) -> None:
        replica = self.replicas[int(replica_id.rsplit("-", 1)[1])]
        self._dead.add(replica_id)
        self._ended_at[replica_id] = self.now
        self._draining.pop(replica_id, None)
        self._event("crash", replica_id, "", 0.0)
        self.push(self.now + self.fleet.detect_s, _CRASH_DETECT, replica)
        self.push(self.now + self.fleet.heartbeat_timeout_s, _FORGET, replica_id)

    def _on_crash_detect(self, replica: _Replica) -> None:
        for rid in [rid for rid, where in self._placement.items() if where is replica]:
            self._placement.pop(rid)
            self._move(rid, "replica_lost")

    def _on_forget(self, replica_id: str) -> None:
        if self.router.state_of(replica_id) is not None:
            self.router.remove(replica_id, self.now)

    def _on_move(self, payload: tuple[str, str]) -> None:
        self._move(*payload, counted=True)

    def _move(self, rid: str, cause: str, counted: bool = False) -> None:
        """Place the request again with its streamed tokens as prompt (a retry does not count twice)."""
        record, request = self.records[rid], self._by_id[rid]
        streamed = len(self._token_times.get(rid, ()))
        if not counted:
            self._moves[rid] = self._moves.get(rid, 0) + 1
            self.report.migrations[cause] = self.report.migrations.get(cause, 0) + 1
        left = request.output_length - streamed
        if self._moves[rid] > self.fleet.migration_limit or left <= 0:
            self._end_moved(record, "ok" if left <= 0 else "failed", streamed, f"migration_limit ({cause})")
            return
        query = RouteQuery(rid, self.config.model, "", (), request.input_length + streamed, left)
        try:
            replica = self.replicas[int(self._route(query).replica_id.rsplit("-", 1)[1])]
        except NoReplicaAvailable:
            self.push(self.now + 0.5, _MOVE, (rid, cause))
            return
        prompt = request.prompt_token_ids(self.vocab_size) + (1,) * streamed
        try:
            self._submit_moved(replica, request, prompt, left)
        except RequestRejected as error:
            self.router.on_request_done(replica.replica_id, rid, self.now, ran=False)
            self._end_moved(record, "failed", streamed, f"{error.reason.value}: {error.detail}")
            return
        replica.reported_idle = False
        self._placement[rid] = replica
        self._offsets[rid] = streamed  # the new attempt's output index 0 is the request's `streamed`
        self._absorb(replica, replica.core.take_events())
        self._watch_deadline(replica)
        self._kick(replica)

    def _submit_moved(self, replica: _Replica, request: WorkloadRequest, prompt: tuple[int, ...],
                      max_tokens: int) -> None:
        """Submit a moved request's new attempt to the replica's core; raises RequestRejected as the core does."""
        record = self.records[request.request_id]
        deadline = None if request.deadline_s is None else record.arrival_s + request.deadline_s
        new = NewRequest(request.request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                         tenant=request.tenant, priority=request.priority, arrival_time=self.now, deadline=deadline,
                         eos_token_id=None, tenant_weight=self.admission.tenant_weight(request.tenant))
        replica.core.submit(new, self.now)

    def _end_moved(self, record: RequestRecord, status: str, streamed: int, detail: str) -> None:
        if status == "failed":
            self.report.migration_failures += 1
        record.status, record.finish_s, record.detail = status, self.now, detail
        record.output_tokens = streamed
        record.token_times = self._token_times.pop(record.request_id, None)
        self._offsets.pop(record.request_id, None)
        self.admission.release(record.request_id, self.now)



def rate_profile_workload(rate_at: Callable[[float], float], duration_s: float, *, input_tokens: int = 256,
                          output_tokens: int = 64, seed: int = 0, peak_rate: float | None = None,
                          prefix: str = "r") -> list[WorkloadRequest]:
    """Return Poisson arrivals whose rate follows `rate_at(t)` (requests/s) over [0, duration_s), by thinning.

    `peak_rate` bounds `rate_at` (default: its maximum sampled every second)."""
    import random

    rng = random.Random(seed)
    peak = peak_rate or max(rate_at(float(t)) for t in range(int(duration_s) + 1)) or 1.0
    requests: list[WorkloadRequest] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return requests
        if rng.random() * peak <= rate_at(t):
            requests.append(WorkloadRequest(f"{prefix}{len(requests)}", t, input_tokens, output_tokens,
                                            seed=seed))
