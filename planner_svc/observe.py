"""What the deployed planner sees: the router's registry and each replica scheduler's Stats, over gRPC.

`RouterObservations` is the `ObservationSource` of `python -m planner_svc`: every observation asks the
router for its replicas (`ListReplicas`) and each listed scheduler for its queue (`Stats`), with the
planner's own mTLS certificate (role `planner`, which sluice.tls.CALLERS lets call both). A scheduler
that does not answer within `timeout_s` counts as a replica that is not ready (it adds no capacity);
a router that does not answer gives an observation with no replicas, on which the core holds.

The arrival rate is the growth, between two observations, of the requests each scheduler has seen
(finished + cancelled + timed out + waiting + running). Each replica carries the role it registered
(`Replica.role`: prefill, decode or both), which is its pool for the pool planner (`--pools`).

The length mix and the latencies come the same way, from the running totals each scheduler reports
(`SchedulerStats.input_tokens`, `max_output_tokens`, TTFT and TPOT sums and counts): an interval's mean is the
growth of a sum over the growth of its count. The prompt lengths and TTFT are read where prompts are computed
(replicas of role both and prefill: a decode half's "first token" is its KV transfer), the output lengths and
TPOT where tokens are decoded (both and decode); `decode_tpot_observed_s` is the decode replicas' alone (the
decode pool's signal). A counter that went down is a restarted scheduler: its totals since the restart are the
interval's. TTFT here is the replica's (submit to first token), without admission's and the router's time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from planner_svc.signals import Observation, ReplicaLoad
from sluice.convert import role_from_proto, totals_from_proto
from sluice.tls import TlsFiles, sync_channel
from sluice.types import ReplicaRole, RequestTotals
from sluice.v1 import router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

__all__ = ["Counters", "RouterObservations", "interval_figures", "replica_load"]

log = logging.getLogger("sluice.planner")


def replica_load(replica: router_pb2.Replica, stats: scheduler_pb2.SchedulerStats | None) -> ReplicaLoad:
    """One replica as the planner sees it: ready only when the router routes to it and its scheduler answered; in
    the pool of the role it registered. Raises ValueError for a role this planner does not know."""
    draining, role = replica.state == router_pb2.DRAINING, role_from_proto(replica.role)
    if stats is None:
        return ReplicaLoad(replica.replica_id, ready=False, draining=draining, role=role)
    kv = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
    return ReplicaLoad(replica.replica_id, ready=replica.state == router_pb2.READY, queue_length=stats.waiting,
                       queued_prefill_tokens=stats.queued_prefill_tokens, in_flight=stats.waiting + stats.running,
                       kv_used_fraction=kv, draining=draining, role=role)


def seen_requests(stats: scheduler_pb2.SchedulerStats) -> int:
    """Requests a scheduler has seen so far (terminal or not): the arrival counter."""
    return stats.finished + stats.cancelled + stats.timed_out + stats.waiting + stats.running


@dataclass(frozen=True)
class Counters:
    """A scheduler's requests seen and running totals, as one Stats answer gives them (see the module docstring)."""

    seen: int = 0
    totals: RequestTotals = field(default_factory=RequestTotals)

    @classmethod
    def of(cls, stats: scheduler_pb2.SchedulerStats) -> Counters:
        return cls(seen_requests(stats), totals_from_proto(stats))

    def since(self, earlier: Counters | None) -> Counters:
        """The growth since `earlier` (None: nothing yet); all of self when a counter went down (a restart)."""
        if earlier is None:
            return Counters()
        grown = self.totals.since(earlier.totals)
        if grown is None or self.seen < earlier.seen:
            return self
        return Counters(self.seen - earlier.seen, grown)


def _ratio(parts: Iterable[tuple[float, float]]) -> float | None:
    top = bottom = 0.0
    for num, den in parts:
        top, bottom = top + num, bottom + den
    return top / bottom if bottom > 0 else None


def interval_figures(growth: list[tuple[ReplicaRole, Counters]]) -> dict[str, float | None]:
    """The interval's length mix and latencies from each replica's growth (see the module docstring): the
    `Observation` fields of those names (None: nothing measured; the lengths are then 0)."""
    prompts = [(g.seen, g.totals) for role, g in growth if role is not ReplicaRole.DECODE]
    decodes = [(g.seen, g.totals) for role, g in growth if role is not ReplicaRole.PREFILL]
    return {
        "mean_input_tokens": _ratio((t.input_tokens, seen) for seen, t in prompts) or 0.0,
        "mean_output_tokens": _ratio((t.max_output_tokens, seen) for seen, t in decodes) or 0.0,
        "ttft_observed_s": _ratio((t.ttft_s, t.ttft_count) for _, t in prompts),
        "tpot_observed_s": _ratio((t.tpot_s, t.tpot_count) for _, t in decodes),
        "decode_tpot_observed_s": _ratio((g.totals.tpot_s, g.totals.tpot_count) for role, g in growth
                                         if role is ReplicaRole.DECODE),
    }


@dataclass
class RouterObservations:
    """Observations of a deployed fleet through its router (see the module docstring)."""

    router: str
    """host:port of the router."""
    tls_files: TlsFiles | None = None
    timeout_s: float = 2.0
    last: Observation | None = None
    _seen: dict[str, Counters] = field(default_factory=dict)
    _last_at: float | None = None

    def observe(self, now: float) -> Observation:
        """The fleet at `now` (never raises for an RPC failure: see the module docstring)."""
        loads, growth = [], []
        for replica in self._replicas():
            stats = self._stats(replica.scheduler_address)
            load = replica_load(replica, stats)
            loads.append(load)
            if stats is not None:
                counters = Counters.of(stats)
                growth.append((load.role, counters.since(self._seen.get(replica.replica_id))))
                self._seen[replica.replica_id] = counters
        elapsed = now - self._last_at if self._last_at is not None else 0.0
        self._last_at = now
        arrivals = sum(g.seen for _, g in growth)
        self.last = Observation(at=now, arrival_rate=arrivals / elapsed if elapsed > 0 else 0.0,
                                replicas=tuple(loads), **interval_figures(growth))  # type: ignore[arg-type]
        return self.last

    def _replicas(self) -> list[router_pb2.Replica]:
        with sync_channel(self.router, self.tls_files) as channel:
            try:
                reply = router_pb2_grpc.RouterServiceStub(channel).ListReplicas(
                    router_pb2.ListReplicasRequest(), timeout=self.timeout_s)
            except grpc.RpcError as exc:
                log.warning("router %s did not list its replicas: %s", self.router, exc.code().name)
                return []
        return [r for r in reply.replicas if r.state != router_pb2.GONE]

    def _stats(self, address: str) -> scheduler_pb2.SchedulerStats | None:
        with sync_channel(address, self.tls_files) as channel:
            try:
                return scheduler_pb2_grpc.SchedulerServiceStub(channel).Stats(scheduler_pb2.StatsRequest(),
                                                                                timeout=self.timeout_s)
            except grpc.RpcError as exc:
                log.info("scheduler %s did not answer Stats: %s", address, exc.code().name)
                return None
