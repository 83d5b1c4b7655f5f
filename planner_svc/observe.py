"""What the deployed planner sees: the router's registry and each replica scheduler's Stats, over gRPC.

`RouterObservations` is the `ObservationSource` of `python -m planner_svc`: every observation asks the
router for its replicas (`ListReplicas`) and each listed scheduler for its queue (`Stats`), with the
planner's own mTLS certificate (role `planner`, which sluice.tls.CALLERS lets call both). A scheduler
that does not answer within `timeout_s` counts as a replica that is not ready (it adds no capacity);
a router that does not answer gives an observation with no replicas, on which the core holds.

The arrival rate is the growth, between two observations, of the requests each scheduler has seen
(finished + cancelled + timed out + waiting + running). Each replica carries the role it registered
(`Replica.role`: prefill, decode or both), which is its pool for the pool planner (`--pools`). Latency
inputs (TTFT, TPOT) are not observed here; the queue, backlog, KV and demand signals drive the decisions
(docs/planner.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc

from planner_svc.signals import Observation, ReplicaLoad
from sluice.convert import role_from_proto
from sluice.tls import TlsFiles, sync_channel
from sluice.v1 import router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

__all__ = ["RouterObservations", "replica_load"]

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


@dataclass
class RouterObservations:
    """Observations of a deployed fleet through its router (see the module docstring)."""

    router: str
    """host:port of the router."""
    tls_files: TlsFiles | None = None
    timeout_s: float = 2.0
    last: Observation | None = None
    _seen: dict[str, int] = field(default_factory=dict)
    _last_at: float | None = None

    def observe(self, now: float) -> Observation:
        """The fleet at `now` (never raises for an RPC failure: see the module docstring)."""
        loads, arrivals = [], 0
        for replica in self._replicas():
            stats = self._stats(replica.scheduler_address)
            loads.append(replica_load(replica, stats))
            if stats is not None:
                seen = seen_requests(stats)
                arrivals += max(0, seen - self._seen.get(replica.replica_id, seen))
                self._seen[replica.replica_id] = seen
        elapsed = now - self._last_at if self._last_at is not None else 0.0
        self._last_at = now
        self.last = Observation(at=now, arrival_rate=arrivals / elapsed if elapsed > 0 else 0.0,
                                replicas=tuple(loads))
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
