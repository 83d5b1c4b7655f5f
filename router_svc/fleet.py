"""The router's replica fleet: who is there, in which state, with which load.

Rules
-----
* Replicas move through WARMING -> READY -> DRAINING -> GONE by a transition table
  (`REPLICA_TRANSITIONS`); `next_replica_state` is the one function that applies it. A replica
  whose worker is down reports it (FAULT) and is UNHEALTHY, with no traffic, until it reports
  READY again. A GONE replica leaves the table at once.
* Only READY replicas of the requested model and adapter version are candidates
  (`ready_for`, sorted by id so that every policy sees them in one order).
* A heartbeat replaces the replica's load and clears its routed-but-unreported tokens (they are
  part of the report now); a request done (refused, failed, cancelled or finished) before that takes
  its own back (`RouterCore.on_request_done`); what a heartbeat's reported state does to the table is
  `sluice.glue.reconcile`. A replica silent for longer than the timeout is `stale`. A heartbeat that
  reports the replica idle also forgets the requests routed there over a grace ago: it holds none of
  them (they ended, or their caller died between Route and Submit), and none may weigh on it for good.
* A replica registers with its scheduler's incarnation (new on every process start). Registering
  again with another incarnation is a restart: the row is replaced (the old one's routed requests are
  gone with it), and a heartbeat that names another incarnation than the registered one is refused
  (`heartbeat_from`), so a restarted process cannot pass for the one that held the lost requests.
* Each replica carries its `ReplicaCache` (router_svc.prefix_index), so that the scoring loop
  reaches a candidate's cached prefix without a lookup.

Pure: no clock, no I/O; `now` is an argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from router_svc.prefix_index import ReplicaCache
from sluice.core_errors import IllegalReplicaTransition, NoReplicaAvailable, UnknownModel, UnknownReplica
from sluice.types import ReplicaInput, ReplicaLoad, ReplicaRole, ReplicaState

__all__ = [
    "REPLICA_TRANSITIONS", "Fleet", "Replica", "ReplicaSpec", "ReplicaView", "forget_inflight", "next_replica_state",
]

REPLICA_TRANSITIONS: dict[tuple[ReplicaState, ReplicaInput], ReplicaState] = {
    (ReplicaState.WARMING, ReplicaInput.WARMED): ReplicaState.READY,
    (ReplicaState.WARMING, ReplicaInput.DRAIN): ReplicaState.DRAINING,
    (ReplicaState.WARMING, ReplicaInput.REMOVE): ReplicaState.GONE,
    (ReplicaState.READY, ReplicaInput.WARMED): ReplicaState.READY,
    (ReplicaState.READY, ReplicaInput.DRAIN): ReplicaState.DRAINING,
    (ReplicaState.READY, ReplicaInput.REMOVE): ReplicaState.GONE,
    (ReplicaState.DRAINING, ReplicaInput.DRAIN): ReplicaState.DRAINING,
    (ReplicaState.DRAINING, ReplicaInput.REMOVE): ReplicaState.GONE,
    (ReplicaState.DRAINING, ReplicaInput.FAULT): ReplicaState.DRAINING,
    (ReplicaState.WARMING, ReplicaInput.FAULT): ReplicaState.UNHEALTHY,
    (ReplicaState.READY, ReplicaInput.FAULT): ReplicaState.UNHEALTHY,
    (ReplicaState.UNHEALTHY, ReplicaInput.FAULT): ReplicaState.UNHEALTHY,
    (ReplicaState.UNHEALTHY, ReplicaInput.WARMED): ReplicaState.READY,
    (ReplicaState.UNHEALTHY, ReplicaInput.DRAIN): ReplicaState.DRAINING,
    (ReplicaState.UNHEALTHY, ReplicaInput.REMOVE): ReplicaState.GONE,
}


def next_replica_state(replica_id: str, state: ReplicaState, event: ReplicaInput) -> ReplicaState:
    """Return the state after `event`; raises IllegalReplicaTransition (nothing changes)."""
    try:
        return REPLICA_TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalReplicaTransition(replica_id, state, event) from None


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica tells the router when it registers."""

    replica_id: str
    model: str
    adapter_version: str = ""
    address: str = ""
    block_size: int = 16
    num_blocks: int = 0
    max_num_batched_tokens: int = 2048
    prefill_tokens_per_s: float = 10_000.0
    """Prefill throughput, for the predicted prefill and queue time."""
    decode_round_s: float = 0.01
    """Time of a decode round, the interference a prefill chunk suffers while decodes run."""
    prefill_pair_s: float = 0.0
    """Seconds per attended (prompt token, earlier token) pair beyond the prefill rate: a long prompt's
    later chunks attend to all of it, so its prefill grows with its square (0: not modelled)."""
    incarnation: str = ""
    """The scheduler process's incarnation (new on every start; "" = not reported): a registration with
    another one is a restart, and a heartbeat of another one than the registered is refused."""
    role: ReplicaRole = ReplicaRole.BOTH
    """Prefill, decode or both (disaggregated serving: router_svc.disagg)."""
    attention_pairs_per_token: int = 0
    """The scheduler's attention charge rate K (0: no charge): a chunk starting at s past
    `attention_free_context` pays n * (s - C) / K tokens of the round budget, so a deep prompt's chunks are
    smaller and its prefill takes more rounds (the TTFT prediction counts them)."""
    attention_free_context: int = 0
    """C: context a chunk attends to for free (the budget is sized for it)."""


@dataclass
class Replica:
    """One row of the fleet table (the router's own; ReplicaView is the read-only picture)."""

    spec: ReplicaSpec
    state: ReplicaState
    last_heartbeat: float
    cache: ReplicaCache
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    unreported_tokens: int = 0
    """Uncached prompt tokens routed here since the last heartbeat (queued, but not yet reported)."""
    unreported: dict[str, int] = field(default_factory=dict)
    """The requests those tokens belong to: request id -> its uncached prompt tokens (taken back when one is
    done before the next heartbeat reports it)."""
    inflight: dict[str, int] = field(default_factory=dict)
    """Routed requests not yet done: request id -> uncached prompt tokens."""
    routed_at: dict[str, float] = field(default_factory=dict)
    """When each of `inflight` was routed (an idle report forgets the ones it cannot be holding)."""
    inflight_tenants: dict[str, str] = field(default_factory=dict)
    """Routed requests not yet done that named a tenant: request id -> tenant."""
    tenant_inflight: dict[str, int] = field(default_factory=dict)
    """Routed requests not yet done, per tenant (what --tenant-spread balances)."""
    predictions: dict[str, tuple[float, tuple[int, ...]]] = field(default_factory=dict)
    """Routed requests not yet done whose blocks the prefix index counts as held here: request id -> (the
    prediction's expiry, its block hashes), for `PrefixIndex.retract` when the request never runs."""


def forget_inflight(replica: Replica, request_id: str) -> None:
    """Forget one routed request of the replica (done, refused after routing, or never arrived); unknown ids
    are ignored. Its uncached prompt tokens leave the replica's unreported work too."""
    replica.inflight.pop(request_id, None)
    replica.routed_at.pop(request_id, None)
    tenant = replica.inflight_tenants.pop(request_id, None)
    if tenant is not None:
        left = replica.tenant_inflight.get(tenant, 0) - 1
        if left > 0:
            replica.tenant_inflight[tenant] = left
        else:
            replica.tenant_inflight.pop(tenant, None)
    replica.unreported_tokens -= replica.unreported.pop(request_id, 0)
    replica.predictions.pop(request_id, None)


@dataclass(frozen=True)
class ReplicaView:
    """A read-only picture of one replica, for ListReplicas and tests."""

    spec: ReplicaSpec
    state: ReplicaState
    load: ReplicaLoad
    inflight: int
    indexed_blocks: int
    last_event_id: int
    last_heartbeat: float


class Fleet:
    """The replica table. See the module docstring."""

    def __init__(self) -> None:
        self._replicas: dict[str, Replica] = {}

    def add(self, spec: ReplicaSpec, now: float) -> tuple[Replica, Replica | None]:
        """Add (or replace) a replica in WARMING with an empty cache; return it and the one it replaced."""
        old = self._replicas.get(spec.replica_id)
        replica = Replica(spec, ReplicaState.WARMING, now, ReplicaCache(spec.replica_id))
        self._replicas[spec.replica_id] = replica
        return replica, old

    def get(self, replica_id: str) -> Replica:
        """Return the replica; raises UnknownReplica."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            raise UnknownReplica(f"unknown replica {replica_id!r}")
        return replica

    def find(self, replica_id: str) -> Replica | None:
        """Return the replica, or None when it is not known."""
        return self._replicas.get(replica_id)

    def apply(self, replica: Replica, event: ReplicaInput) -> ReplicaState:
        """Move the replica by the table (GONE leaves the table); raises IllegalReplicaTransition."""
        replica.state = next_replica_state(replica.spec.replica_id, replica.state, event)
        if replica.state is ReplicaState.GONE:
            del self._replicas[replica.spec.replica_id]
        return replica.state

    def heartbeat_from(self, replica_id: str, incarnation: str) -> bool:
        """True when a heartbeat naming `incarnation` comes from the registered incarnation of the replica
        (or either side reported none). Raises UnknownReplica."""
        known = self.get(replica_id).spec.incarnation
        return not incarnation or not known or incarnation == known

    def heartbeat(self, replica_id: str, load: ReplicaLoad, now: float, grace_s: float = math.inf) -> list[str]:
        """Record the replica's load; routed-but-unreported work is now part of the report. Raises UnknownReplica.

        A report of an idle replica (nothing waiting or running) also forgets the in-flight requests routed there
        more than `grace_s` ago and returns their ids: it holds none of them, so each either ended (its completion
        is still on the way, and is ignored when it comes) or never arrived (its caller died between Route and
        Submit, or only probed). Without this such a request would weigh on the replica's score for good."""
        replica = self.get(replica_id)
        replica.load = load
        replica.last_heartbeat = now
        replica.unreported_tokens = 0
        replica.unreported.clear()
        if load.waiting or load.running or not replica.inflight:
            return []
        limit = now - grace_s
        gone = [rid for rid, at in replica.routed_at.items() if at < limit]
        for request_id in gone:
            forget_inflight(replica, request_id)
        return gone

    def stale(self, now: float, timeout_s: float) -> list[str]:
        """Return the ids of replicas whose last heartbeat is older than `timeout_s`."""
        limit = now - timeout_s
        return [rid for rid, r in self._replicas.items() if r.last_heartbeat < limit]

    def ready_for(self, model: str, adapter_version: str) -> list[Replica]:
        """Return the READY replicas of the model and adapter, by id.

        Raises UnknownModel (replicas are registered, none of that model/adapter) or NoReplicaAvailable (none
        READY, or none registered at all: a router that just restarted, whose replicas register again within a
        heartbeat, cannot tell an unknown model yet and must not answer NOT_FOUND for a known one).
        """
        compatible = [
            r for r in self._replicas.values()
            if r.spec.model == model and r.spec.adapter_version == adapter_version
        ]
        if not compatible and not self._replicas:
            raise NoReplicaAvailable("no replica is registered (yet)")
        if not compatible:
            raise UnknownModel(f"no replica serves model {model!r} adapter {adapter_version!r}")
        ready = [r for r in compatible if r.state is ReplicaState.READY]
        if not ready:
            states = ", ".join(sorted({r.state.value for r in compatible}))
            raise NoReplicaAvailable(f"no READY replica of model {model!r} (replicas are: {states})")
        ready.sort(key=lambda r: r.spec.replica_id)
        return ready

    def views(self) -> list[ReplicaView]:
        """Return every known replica, sorted by id."""
        return [
            ReplicaView(r.spec, r.state, r.load, len(r.inflight), len(r.cache.hashes), r.cache.last_event_id,
                        r.last_heartbeat)
            for _, r in sorted(self._replicas.items())
        ]
