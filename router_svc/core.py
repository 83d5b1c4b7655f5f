"""The router's pure core: replica registry, prefix index and scoring.

Theory of operation
-------------------
* Replicas move through WARMING -> READY -> DRAINING -> GONE by a transition table
  (`REPLICA_TRANSITIONS`); only READY replicas of the requested model and adapter version are
  candidates. A replica whose worker is down reports it (FAULT) and is UNHEALTHY, with no traffic,
  until it reports READY again. A replica whose heartbeat is older than `heartbeat_timeout_s` is GONE at the next
  `expire(now)`, and everything known about it is purged.
* The prefix index maps block hashes (sluice.hashing chains) to the replicas that hold them. It is
  fed by each replica's KV events, in event-id order: an event id that skips ahead is a gap, so
  `apply_kv_events` returns False and the caller must fetch a snapshot (`apply_snapshot`). Between
  events, `route` records its own decisions for `prediction_ttl_s` so sibling requests sent right
  after see the prefix at once.
* A replica's cached prefix for a request is found by binary search over the request's chain,
  which assumes the cached set is prefix-closed (a block is cached only with its parents; engines
  evict children first). This costs O(log blocks) lookups per candidate replica.
* Score (policy SCORE) = predicted time to first token on that replica
  = queue wait (queued prefill tokens / prefill rate)
  + prefill time of the uncached part
  + decode interference (one decode round per prefill chunk while the replica has running decodes).
  The minimum wins; replicas within `tie_tolerance_s` of it are tie-broken at random (seeded), so
  routers with the same stale view do not all herd onto one replica.

Pure: no clock, no I/O; `now` is an argument, randomness comes from a seeded generator.
"""

from __future__ import annotations

import enum
import math
import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sluice.core_errors import IllegalReplicaTransition, NoReplicaAvailable, UnknownModel, UnknownReplica
from sluice.types import KvEvent, KvEventKind


class ReplicaState(enum.Enum):
    WARMING = "warming"
    READY = "ready"
    DRAINING = "draining"
    GONE = "gone"
    UNHEALTHY = "unhealthy"
    """Registered, but its worker is down: no traffic until it reports READY again."""


class ReplicaInput(enum.Enum):
    WARMED = "warmed"
    """The replica reports its model loaded and a warm-up round done."""
    DRAIN = "drain"
    """Stop sending it traffic; in-flight work finishes."""
    REMOVE = "remove"
    """It left, or its heartbeat was lost."""
    FAULT = "fault"
    """It reports its worker down (it cannot run rounds until the worker is back)."""


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


class RoutingPolicy(enum.Enum):
    SCORE = "score"
    """Minimum predicted time to first token (queue wait + uncached prefill + interference)."""
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    LEAST_LOADED = "least_loaded"
    """Fewest waiting + running + routed-in-flight requests."""
    PREFIX_ONLY = "prefix_only"
    """Longest cached prefix, ties to the least loaded (ignores queues: the herding baseline)."""

    @classmethod
    def parse(cls, name: str) -> RoutingPolicy:
        """Return the policy named `name`; raises ValueError listing the known names."""
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown routing policy {name!r}; known: {known}") from None


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


@dataclass
class ReplicaLoad:
    """A replica's load as its last heartbeat reported it."""

    waiting: int = 0
    running: int = 0
    queued_prefill_tokens: int = 0
    kv_blocks_free: int = 0
    prefill_tokens_per_s: float = 0.0
    """Measured by the replica from its rounds; 0 = not yet (the spec's registered rate is used)."""
    decode_round_s: float = 0.0
    """Measured by the replica from its rounds; 0 = not yet (the spec's registered value is used)."""


@dataclass(frozen=True)
class RouteQuery:
    request_id: str
    model: str
    adapter_version: str = ""
    block_hashes: tuple[int, ...] = ()
    prompt_tokens: int = 0
    max_tokens: int = 0


@dataclass(frozen=True)
class RouteDecision:
    replica_id: str
    address: str
    predicted_ttft_s: float
    queue_wait_s: float
    prefill_s: float
    cached_blocks: int


@dataclass
class _Replica:
    spec: ReplicaSpec
    state: ReplicaState
    last_heartbeat: float
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    hashes: set[int] = field(default_factory=set)
    predicted: dict[int, float] = field(default_factory=dict)
    last_event_id: int = 0
    unreported_tokens: int = 0
    inflight: dict[str, int] = field(default_factory=dict)

    def holds(self, block_hash: int, now: float) -> bool:
        return block_hash in self.hashes or self.predicted.get(block_hash, -math.inf) > now


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


class RouterCore:
    """Replica registry + prefix index + scoring. See the module docstring."""

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self._replicas: dict[str, _Replica] = {}
        self._index: dict[int, set[str]] = {}
        self._predictions: deque[tuple[float, str, tuple[int, ...]]] = deque()
        self._rng = random.Random(self.config.seed)
        self._rr_counter = 0
        self.routed = 0
        self.snapshots_needed = 0

    # ---- registry -------------------------------------------------------------------------
    def register(self, spec: ReplicaSpec, now: float) -> ReplicaState:
        """Add (or re-add) a replica in WARMING; its prefix knowledge starts empty until a snapshot."""
        old = self._replicas.get(spec.replica_id)
        if old is not None:
            self._purge_index(old)
        self._replicas[spec.replica_id] = _Replica(spec=spec, state=ReplicaState.WARMING, last_heartbeat=now)
        return ReplicaState.WARMING

    def _get(self, replica_id: str) -> _Replica:
        replica = self._replicas.get(replica_id)
        if replica is None:
            raise UnknownReplica(f"unknown replica {replica_id!r}")
        return replica

    def _apply(self, replica: _Replica, event: ReplicaInput) -> ReplicaState:
        replica.state = next_replica_state(replica.spec.replica_id, replica.state, event)
        if replica.state is ReplicaState.GONE:
            self._purge_index(replica)
            del self._replicas[replica.spec.replica_id]
        return replica.state

    def mark_ready(self, replica_id: str, now: float) -> ReplicaState:
        """The replica is warm: it may receive traffic. Raises UnknownReplica / IllegalReplicaTransition."""
        replica = self._get(replica_id)
        replica.last_heartbeat = now
        return self._apply(replica, ReplicaInput.WARMED)

    def mark_unhealthy(self, replica_id: str, now: float) -> ReplicaState:
        """The replica's worker is down: no traffic until `mark_ready`. Raises UnknownReplica /
        IllegalReplicaTransition."""
        replica = self._get(replica_id)
        replica.last_heartbeat = now
        return self._apply(replica, ReplicaInput.FAULT)

    def drain(self, replica_id: str, now: float) -> ReplicaState:
        """Stop routing to the replica; what it already has finishes there."""
        return self._apply(self._get(replica_id), ReplicaInput.DRAIN)

    def remove(self, replica_id: str, now: float) -> ReplicaState:
        """The replica is gone: forget it and purge its index entries."""
        return self._apply(self._get(replica_id), ReplicaInput.REMOVE)

    def heartbeat(self, replica_id: str, load: ReplicaLoad, now: float) -> ReplicaState:
        """Record the replica's load; routed-but-unreported work is now part of the report."""
        replica = self._get(replica_id)
        replica.load = load
        replica.last_heartbeat = now
        replica.unreported_tokens = 0
        return replica.state

    def expire(self, now: float) -> list[str]:
        """Remove replicas whose heartbeat is older than the timeout; returns their ids."""
        limit = now - self.config.heartbeat_timeout_s
        lost = [rid for rid, r in self._replicas.items() if r.last_heartbeat < limit]
        for replica_id in lost:
            self.remove(replica_id, now)
        return lost

    def replicas(self) -> list[ReplicaView]:
        """Return every known replica, sorted by id."""
        return [
            ReplicaView(r.spec, r.state, r.load, len(r.inflight), len(r.hashes), r.last_event_id, r.last_heartbeat)
            for _, r in sorted(self._replicas.items())
        ]

    def state_of(self, replica_id: str) -> ReplicaState | None:
        replica = self._replicas.get(replica_id)
        return replica.state if replica is not None else None

    # ---- prefix index ---------------------------------------------------------------------
    def apply_kv_events(self, replica_id: str, events: Sequence[KvEvent], now: float) -> bool:
        """Apply a replica's KV events in order. Returns False on an event-id gap (nothing after the
        gap is applied; fetch a snapshot). Events at or below the last applied id are duplicates of
        an at-least-once delivery and are skipped."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return True
        for event in events:
            if event.event_id <= replica.last_event_id:
                continue
            if event.event_id != replica.last_event_id + 1:
                self.snapshots_needed += 1
                return False
            self._apply_event(replica, event)
            replica.last_event_id = event.event_id
        return True

    def _apply_event(self, replica: _Replica, event: KvEvent) -> None:
        rid = replica.spec.replica_id
        if event.kind is KvEventKind.STORED:
            for block_hash in event.block_hashes:
                replica.hashes.add(block_hash)
                self._index.setdefault(block_hash, set()).add(rid)
        elif event.kind is KvEventKind.REMOVED:
            for block_hash in event.block_hashes:
                self._unindex(replica, block_hash)
        else:
            self._purge_index(replica)

    def apply_snapshot(self, replica_id: str, last_event_id: int, hashes: Iterable[int], now: float) -> None:
        """Replace what is known of a replica's cache with a snapshot taken at `last_event_id`."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        self._purge_index(replica)
        for block_hash in hashes:
            replica.hashes.add(block_hash)
            self._index.setdefault(block_hash, set()).add(replica_id)
        replica.last_event_id = last_event_id

    def _unindex(self, replica: _Replica, block_hash: int) -> None:
        replica.hashes.discard(block_hash)
        holders = self._index.get(block_hash)
        if holders is not None:
            holders.discard(replica.spec.replica_id)
            if not holders:
                del self._index[block_hash]

    def _purge_index(self, replica: _Replica) -> None:
        for block_hash in list(replica.hashes):
            self._unindex(replica, block_hash)
        replica.predicted.clear()

    @property
    def indexed_blocks(self) -> int:
        return len(self._index)

    def cached_blocks(self, replica_id: str, block_hashes: Sequence[int], now: float) -> int:
        """Length of the longest prefix of `block_hashes` the replica holds (or is predicted to)."""
        replica = self._replicas.get(replica_id)
        return 0 if replica is None else self._prefix_len(replica, block_hashes, now)

    @staticmethod
    def _prefix_len(replica: _Replica, block_hashes: Sequence[int], now: float) -> int:
        lo, hi = 0, len(block_hashes)
        while lo < hi:  # largest k such that block k-1 is held (prefix-closed cache)
            mid = (lo + hi + 1) // 2
            if replica.holds(block_hashes[mid - 1], now):
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ---- routing --------------------------------------------------------------------------
    def route(self, query: RouteQuery, now: float) -> RouteDecision:
        """Choose a replica for `query`. Raises UnknownModel (no replica of that model/adapter at
        all) or NoReplicaAvailable (none READY)."""
        self._prune_predictions(now)
        ready = self._ready_replicas(query)
        policy = self.config.policy
        if policy is RoutingPolicy.SCORE:
            chosen = self._best_score(ready, query, now)
        elif policy is RoutingPolicy.ROUND_ROBIN:
            self._rr_counter += 1
            chosen = ready[(self._rr_counter - 1) % len(ready)]
        elif policy is RoutingPolicy.RANDOM:
            chosen = ready[self._rng.randrange(len(ready))]
        elif policy is RoutingPolicy.LEAST_LOADED:
            chosen = min(ready, key=self._load_key)
        else:  # PREFIX_ONLY
            chosen = min(ready, key=lambda r: (-self._cached(r, query, now), *self._load_key(r)))
        decision = self._decision(chosen, query, now)
        self._record(chosen, query, decision, now)
        return decision

    def _ready_replicas(self, query: RouteQuery) -> list[_Replica]:
        compatible = [
            r for r in self._replicas.values()
            if r.spec.model == query.model and r.spec.adapter_version == query.adapter_version
        ]
        if not compatible:
            raise UnknownModel(f"no replica serves model {query.model!r} adapter {query.adapter_version!r}")
        ready = [r for r in compatible if r.state is ReplicaState.READY]
        if not ready:
            states = ", ".join(sorted({r.state.value for r in compatible}))
            raise NoReplicaAvailable(f"no READY replica of model {query.model!r} (replicas are: {states})")
        ready.sort(key=lambda r: r.spec.replica_id)
        return ready

    def _cached(self, replica: _Replica, query: RouteQuery, now: float) -> int:
        if not query.block_hashes:
            return 0
        if replica.spec.replica_id not in self._index.get(query.block_hashes[0], ()) and not replica.predicted:
            return 0
        return self._prefix_len(replica, query.block_hashes, now)

    def _ttft(self, replica: _Replica, query: RouteQuery, cached: int) -> tuple[float, float, float]:
        """(predicted TTFT, queue wait, prefill time) of `query` on `replica`; the hot loop of SCORE."""
        spec, load = replica.spec, replica.load
        uncached_tokens = max(query.prompt_tokens - cached * spec.block_size, 1)
        # Measured rates (heartbeats) win over the ones the replica registered with.
        rate = load.prefill_tokens_per_s or spec.prefill_tokens_per_s
        rate = rate if rate > 0 else 1e-9
        decode_round_s = load.decode_round_s or spec.decode_round_s
        queue_wait = (replica.load.queued_prefill_tokens + replica.unreported_tokens) / rate
        prefill = uncached_tokens / rate
        interference = 0.0
        if replica.load.running or replica.inflight:
            interference = -(-uncached_tokens // max(spec.max_num_batched_tokens, 1)) * decode_round_s
        return queue_wait + prefill + interference, queue_wait, prefill

    def _best_score(self, ready: list[_Replica], query: RouteQuery, now: float) -> _Replica:
        extra = self.config.prefill_weight - 1.0
        if extra:
            scores = [ttft + extra * prefill for ttft, _, prefill in
                      (self._ttft(r, query, self._cached(r, query, now)) for r in ready)]
        else:
            scores = [self._ttft(r, query, self._cached(r, query, now))[0] for r in ready]
        limit = min(scores) + self.config.tie_tolerance_s
        ties = [r for r, score in zip(ready, scores, strict=True) if score <= limit]
        return ties[0] if len(ties) == 1 else ties[self._rng.randrange(len(ties))]

    def _decision(self, replica: _Replica, query: RouteQuery, now: float) -> RouteDecision:
        cached = self._cached(replica, query, now)
        ttft, queue_wait, prefill = self._ttft(replica, query, cached)
        return RouteDecision(replica.spec.replica_id, replica.spec.address, ttft, queue_wait, prefill, cached)

    def _load_key(self, replica: _Replica) -> tuple[int, str]:
        return (replica.load.waiting + replica.load.running + len(replica.inflight), replica.spec.replica_id)

    def _record(self, replica: _Replica, query: RouteQuery, decision: RouteDecision, now: float) -> None:
        uncached = max(query.prompt_tokens - decision.cached_blocks * replica.spec.block_size, 0)
        replica.inflight[query.request_id] = uncached
        replica.unreported_tokens += uncached
        self.routed += 1
        if query.block_hashes and self.config.prediction_ttl_s > 0:
            expiry = now + self.config.prediction_ttl_s
            for block_hash in query.block_hashes:
                replica.predicted[block_hash] = expiry
            self._predictions.append((expiry, replica.spec.replica_id, query.block_hashes))

    def _prune_predictions(self, now: float) -> None:
        while self._predictions and self._predictions[0][0] <= now:
            expiry, replica_id, hashes = self._predictions.popleft()
            replica = self._replicas.get(replica_id)
            if replica is None:
                continue
            for block_hash in hashes:
                if replica.predicted.get(block_hash) == expiry:
                    del replica.predicted[block_hash]

    def on_request_done(self, replica_id: str, request_id: str, now: float) -> None:
        """Forget a routed request (finished, cancelled or failed); unknown ids are ignored."""
        replica = self._replicas.get(replica_id)
        if replica is not None:
            replica.inflight.pop(request_id, None)
