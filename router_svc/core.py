"""The router's pure core: the fleet, the prefix index and a routing policy, composed.

Theory of operation
-------------------
* `router_svc.fleet` keeps the replica table: WARMING -> READY -> DRAINING -> GONE by a transition
  table, UNHEALTHY while a replica's worker is down; only READY replicas of the requested model
  and adapter version are candidates. A replica whose heartbeat is older than
  `heartbeat_timeout_s` is GONE at the next `expire(now)`, and everything known about it is purged.
  What a heartbeat's reported state does is `sluice.glue.apply_heartbeat` (over `transition` and
  `heartbeat` here), shared with the simulator.
* `router_svc.prefix_index` maps block hashes to the replicas that hold them, fed by each replica's
  KV events in event-id order; a gap makes `apply_kv_events` return False and the caller fetches a
  snapshot (`apply_snapshot`). `route` records its own decisions for `prediction_ttl_s`.
* `router_svc.scoring` chooses: the policy named by `RouterConfig.policy`, built once by
  `make_policy` (SCORE: minimum predicted time to first token, seeded random tie-break).
* Routing adds the request's uncached prompt tokens to the replica's unreported work, which the next
  heartbeat replaces with the replica's own report; `on_request_done` (the one path for a request
  refused, failed, cancelled or finished: the services call it from the completions stream, the
  simulator directly) takes them back when that heartbeat has not come yet.

Pure: no clock, no I/O; `now` is an argument, randomness comes from a seeded generator.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from router_svc.fleet import (
    REPLICA_TRANSITIONS,
    Fleet,
    Replica,
    ReplicaSpec,
    ReplicaView,
    forget_inflight,
    next_replica_state,
)
from router_svc.prefix_index import PrefixIndex
from router_svc.scoring import RouteDecision, RouteQuery, RoutingPolicy, make_policy, predict_ttft
from sluice.core_errors import IllegalReplicaTransition, NoReplicaAvailable, UnknownModel, UnknownReplica
from sluice.types import KvEvent, ReplicaInput, ReplicaLoad, ReplicaState

__all__ = [
    # re-exported: the router's names, importable from one place
    "REPLICA_TRANSITIONS", "IllegalReplicaTransition", "NoReplicaAvailable", "ReplicaInput", "ReplicaLoad",
    "ReplicaSpec", "ReplicaState", "ReplicaView", "RouteDecision", "RouteQuery", "RouterConfig", "RouterCore",
    "RoutingPolicy", "UnknownModel", "UnknownReplica", "next_replica_state",
]


@dataclass(frozen=True)
class RouterConfig:
    """How the router chooses."""

    policy: RoutingPolicy = RoutingPolicy.SCORE
    """Scoring rule (see RoutingPolicy)."""
    prediction_ttl_s: float = 2.0
    """How long the router trusts its own routing decisions as cached prefixes."""
    tie_tolerance_s: float = 0.001
    """Scores within this of the best are ties, broken at random."""
    heartbeat_timeout_s: float = 10.0
    """A replica silent for longer is GONE."""
    seed: int = 0
    """Seed of the tie-break and RANDOM policy generator."""
    prefill_weight: float = 1.0
    """SCORE only: weight of the request's own uncached prefill when replicas are compared (the
    reported prediction is unweighted). Above 1 it charges a request for the work it adds to the
    replica, which every request routed there after it waits for: cache hits count for more."""
    load_bound: float = 0.0
    """SCORE only: at 1 or above, a replica whose outstanding requests reach ceil(load_bound x (fleet
    total + 1) / replicas) is not a candidate (consistent hashing with bounded loads); 0: no bound."""
    tenant_spread: int = 0
    """SCORE only: at 1 or above, a replica where one more request of the caller's tenant would hold more than
    `tenant_spread` of them beyond the least such replica is not a candidate: each tenant's requests spread evenly, so every replica's
    fair queue sees every busy tenant and per-replica fair share adds up to fleet-wide fair share; 0: off."""
    ttft_target_s: float = 0.0
    """SCORE with a prefill weight only: above 0, the weight ranks only the replicas predicted to meet
    this TTFT, and when none would, the lowest predicted TTFT wins; so the weight never sends a request
    where it is predicted late while another replica is predicted on time (which admission's early
    refusal would refuse). 0: the weighted score ranks every replica."""


class RouterCore:
    """Fleet + prefix index + routing policy. See the module docstring."""

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self.fleet = Fleet()
        self.index = PrefixIndex(self.config.prediction_ttl_s)
        self.policy = make_policy(self.config.policy, cached=self.index.cached,
                                  rng=random.Random(self.config.seed),
                                  tie_tolerance_s=self.config.tie_tolerance_s,
                                  prefill_weight=self.config.prefill_weight,
                                  load_bound=self.config.load_bound, tenant_spread=self.config.tenant_spread,
                                  ttft_target_s=self.config.ttft_target_s)
        self.routed = 0
        self.stale_routes = 0
        """Routed requests forgotten because their replica reported itself idle long after (Fleet.heartbeat)."""

    # ---- fleet ----------------------------------------------------------------------------
    def register(self, spec: ReplicaSpec, now: float) -> ReplicaState:
        """Add (or re-add) a replica in WARMING; its prefix knowledge starts empty until a snapshot."""
        replica, old = self.fleet.add(spec, now)
        if old is not None:
            self.index.purge(old.cache)
        return replica.state

    def transition(self, replica_id: str, event: ReplicaInput, now: float) -> ReplicaState:
        """Apply `event` to the replica (GONE purges it). Raises UnknownReplica / IllegalReplicaTransition."""
        replica = self.fleet.get(replica_id)
        if event is ReplicaInput.WARMED:
            replica.last_heartbeat = now  # the replica spoke (a FAULT may be someone else's report)
        state = self.fleet.apply(replica, event)
        if state is ReplicaState.GONE:
            self.index.purge(replica.cache)
        return state

    def mark_ready(self, replica_id: str, now: float) -> ReplicaState:
        """The replica is warm: it may receive traffic. Raises UnknownReplica / IllegalReplicaTransition."""
        return self.transition(replica_id, ReplicaInput.WARMED, now)

    def mark_unhealthy(self, replica_id: str, now: float) -> ReplicaState:
        """The replica's worker is down: no traffic until `mark_ready`. Raises UnknownReplica /
        IllegalReplicaTransition. Its heartbeat clock is left alone: the report may come from a peer that
        could not reach it, so a dead replica still expires one timeout after it last spoke."""
        return self.transition(replica_id, ReplicaInput.FAULT, now)

    def drain(self, replica_id: str, now: float) -> ReplicaState:
        """Stop routing to the replica; what it already has finishes there."""
        return self.transition(replica_id, ReplicaInput.DRAIN, now)

    def remove(self, replica_id: str, now: float) -> ReplicaState:
        """The replica is gone: forget it and purge its index entries."""
        return self.transition(replica_id, ReplicaInput.REMOVE, now)

    def heartbeat(self, replica_id: str, load: ReplicaLoad, now: float) -> ReplicaState:
        """Record the replica's load; routed-but-unreported work is now part of the report. A replica that reports
        itself idle holds none of the requests routed there over a heartbeat timeout ago: they are forgotten
        (counted in `stale_routes`)."""
        self.stale_routes += len(self.fleet.heartbeat(replica_id, load, now, self.config.heartbeat_timeout_s))
        return self.fleet.get(replica_id).state

    def expire(self, now: float) -> list[str]:
        """Remove replicas whose heartbeat is older than the timeout; returns their ids."""
        lost = self.fleet.stale(now, self.config.heartbeat_timeout_s)
        for replica_id in lost:
            self.remove(replica_id, now)
        return lost

    def replicas(self) -> list[ReplicaView]:
        """Return every known replica, sorted by id."""
        return self.fleet.views()

    def state_of(self, replica_id: str) -> ReplicaState | None:
        """Return the replica's state, or None when it is not known."""
        replica = self.fleet.find(replica_id)
        return replica.state if replica is not None else None

    # ---- prefix index ---------------------------------------------------------------------
    def apply_kv_events(self, replica_id: str, events: Sequence[KvEvent], now: float) -> bool:
        """Apply a replica's KV events in order. Returns False on an event-id gap (nothing after the
        gap is applied; fetch a snapshot). Events at or below the last applied id are duplicates of
        an at-least-once delivery and are skipped; events of an unknown replica are ignored."""
        replica = self.fleet.find(replica_id)
        return True if replica is None else self.index.apply_events(replica.cache, events)

    def apply_snapshot(self, replica_id: str, last_event_id: int, hashes: Iterable[int], now: float,
                       host_hashes: Iterable[int] = ()) -> None:
        """Replace what is known of a replica's cache (device, and host tier) with a snapshot taken at `last_event_id`."""
        replica = self.fleet.find(replica_id)
        if replica is not None:
            self.index.apply_snapshot(replica.cache, last_event_id, hashes, host_hashes)

    @property
    def indexed_blocks(self) -> int:
        """Number of distinct block hashes held by any replica."""
        return len(self.index)

    @property
    def snapshots_needed(self) -> int:
        """Event-id gaps seen (each asked for a snapshot)."""
        return self.index.gaps

    def cached_blocks(self, replica_id: str, block_hashes: Sequence[int], now: float) -> int:
        """Length of the longest prefix of `block_hashes` the replica holds (or is predicted to)."""
        replica = self.fleet.find(replica_id)
        return 0 if replica is None else self.index.cached(replica.cache, block_hashes, now)

    # ---- routing --------------------------------------------------------------------------
    def route(self, query: RouteQuery, now: float) -> RouteDecision:
        """Choose a replica for `query` and record it there (unless `query.dry_run`). Raises UnknownModel (no
        replica of that model/adapter at all) or NoReplicaAvailable (none READY)."""
        self.index.prune(now)
        ready = self.fleet.ready_for(query.model, query.adapter_version)
        chosen = self.policy.choose(ready, query, now)
        cached = self.index.cached(chosen.cache, query.block_hashes, now)
        ttft, queue_wait, prefill = predict_ttft(chosen, query, cached)
        decision = RouteDecision(chosen.spec.replica_id, chosen.spec.address, ttft, queue_wait, prefill, cached)
        if not query.dry_run:
            self._record(chosen, query, cached, now)
        return decision

    def _record(self, replica: Replica, query: RouteQuery, cached: int, now: float) -> None:
        uncached = max(query.prompt_tokens - cached * replica.spec.block_size, 0)
        replica.inflight[query.request_id] = uncached
        replica.routed_at[query.request_id] = now
        if query.tenant:
            replica.inflight_tenants[query.request_id] = query.tenant
            replica.tenant_inflight[query.tenant] = replica.tenant_inflight.get(query.tenant, 0) + 1
        replica.unreported[query.request_id] = uncached
        replica.unreported_tokens += uncached
        self.routed += 1
        expiry = self.index.predict(replica.cache, query.block_hashes, now)
        if expiry is not None:
            replica.predictions[query.request_id] = (expiry, query.block_hashes)

    def on_request_done(self, replica_id: str, request_id: str, now: float, ran: bool = True) -> bool:
        """Forget a routed request (refused after routing, failed, cancelled or finished); unknown ids are
        ignored. Its uncached prompt tokens leave the replica's unreported work if no heartbeat has
        reported the replica since it was routed: a request refused (or ended) before it queued there
        must not stay predicted work until the next heartbeat (after one, the report is the truth).
        `ran` False (a REJECTED request: refused after routing, nothing computed) also takes back the
        prediction that the replica holds its prompt's blocks, which would otherwise draw its siblings
        there for `prediction_ttl_s`, to a cache it does not have. Returns True when it took one back."""
        replica = self.fleet.find(replica_id)
        if replica is None:
            return False
        prediction = None if ran else replica.predictions.get(request_id)
        forget_inflight(replica, request_id)
        if prediction is None:
            return False
        self.index.retract(replica.cache, prediction[1], prediction[0])
        return True
