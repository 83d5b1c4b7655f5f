"""The router's prefix index: block hash -> the replicas that hold it, fed by their KV events.

Rules
-----
* Block hashes are sluice.hashing chains. Each replica's view is a `ReplicaCache` (the hashes it
  holds, the hashes the router predicts it holds, the last applied event id); a hash's holders are
  the replicas whose set has it (a lookup asks one replica, so an event is one set update).
* A replica's events are applied in event-id order: an id at or below the last applied one is a
  duplicate of an at-least-once delivery and is skipped; an id that skips ahead is a gap, so
  `apply_events` stops there and returns False (the caller fetches a snapshot). `apply_snapshot`
  replaces what is known with a snapshot taken at an event id.
* Between events, the router's own routing decisions count as held for `ttl_s`
  (`predict`), so sibling requests sent right after see the prefix at once; `prune` forgets
  expired predictions in expiry order, and `retract` takes back one whose request never ran
  (refused after routing), so that its replica is not chosen for a cache it does not have.
* Blocks a replica reports on the CPU medium (its host prefix tier, or a swapped-out request's copies)
  are held too, in a set of their own (`host`): a GPU REMOVED for an evicted block leaves its host
  copy counted. A host hit costs a copy back at the host link's rate, about a tenth of computing the
  block again (8B model, H200, PCIe 5), so scoring counts it as cached. A swapped-out request's copies
  are counted while it waits, though only it can read them: a short-lived overestimate.
* A replica's cached prefix is found by binary search over the request's chain, which assumes
  the cached set is prefix-closed (a block is cached only with its parents; engines evict
  children first): O(log blocks) lookups per candidate.

Pure: no clock, no I/O; `now` is an argument.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sluice.types import KvEvent, KvEventKind, KvMedium

__all__ = ["PrefixIndex", "ReplicaCache"]


@dataclass
class ReplicaCache:
    """What the router knows of one replica's prefix cache."""

    replica_id: str
    hashes: set[int] = field(default_factory=set)
    """Block hashes its KV events (or a snapshot) say it holds."""
    host: set[int] = field(default_factory=set)
    """Block hashes its KV events say it holds in host (CPU) memory."""
    predicted: dict[int, float] = field(default_factory=dict)
    """Block hashes the router sent it -> until when they count as held."""
    last_event_id: int = 0

    def holds(self, block_hash: int, now: float) -> bool:
        """Return True if the replica holds the block or is predicted to at `now`."""
        return (block_hash in self.hashes or block_hash in self.host
                or self.predicted.get(block_hash, -math.inf) > now)


def prefix_len(cache: ReplicaCache, block_hashes: Sequence[int], now: float) -> int:
    """Return the length of the longest prefix of `block_hashes` the replica holds (or is predicted to)."""
    lo, hi = 0, len(block_hashes)
    held, predicted, never, host = cache.hashes, cache.predicted, -math.inf, cache.host
    while lo < hi:  # largest k such that block k-1 is held (prefix-closed cache)
        mid = (lo + hi + 1) // 2
        block_hash = block_hashes[mid - 1]
        # `holds`, inlined: the hot probe of routing (the host set is tested last: it is empty on most replicas)
        if block_hash in held or predicted.get(block_hash, never) > now or (host and block_hash in host):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixIndex:
    """Block hash -> holders, over the replicas' `ReplicaCache`s. See the module docstring."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._caches: dict[str, ReplicaCache] = {}
        """Every replica's cache the index has seen, by id: the holders of a hash are the caches whose set has it.
        No hash -> holders map is kept: a lookup asks one replica's set, so a KV event costs one set update."""
        self._predictions: deque[tuple[float, ReplicaCache, tuple[int, ...]]] = deque()
        self.gaps = 0
        """Event-id gaps seen (each one asks the caller for a snapshot)."""

    def __len__(self) -> int:
        """Return the number of distinct block hashes held by any replica (a union over replicas: for reports)."""
        return len(set().union(*(cache.hashes for cache in self._caches.values())))

    def holders(self) -> dict[int, list[str]]:
        """Return every held block hash with the ids of the replicas that hold it, sorted (for tests and reports)."""
        held: dict[int, list[str]] = {}
        for replica_id in sorted(self._caches):
            for block_hash in self._caches[replica_id].hashes:
                held.setdefault(block_hash, []).append(replica_id)
        return held

    # ---- events and snapshots -------------------------------------------------------------
    def apply_events(self, cache: ReplicaCache, events: Sequence[KvEvent]) -> bool:
        """Apply a replica's KV events in order; return False on an event-id gap (nothing after it applied)."""
        self._caches[cache.replica_id] = cache
        last = cache.last_event_id
        store, remove = cache.hashes.update, cache.hashes.difference_update  # bound once: ~3 M events a trace
        gpu, stored, removed = KvMedium.GPU, KvEventKind.STORED, KvEventKind.REMOVED
        for event in events:
            event_id = event.event_id
            if event_id <= last:
                continue
            if event_id != last + 1:
                cache.last_event_id = last
                self.gaps += 1
                return False
            last = event_id
            kind = event.kind
            if event.medium is not gpu and kind is not KvEventKind.ALL_CLEARED:
                if kind is stored:
                    cache.host.update(event.block_hashes)
                elif kind is removed:
                    cache.host.difference_update(event.block_hashes)
                continue
            if kind is stored:
                store(event.block_hashes)
            elif kind is removed:
                remove(event.block_hashes)
            else:
                self.purge(cache)
        cache.last_event_id = last
        return True

    def apply_snapshot(self, cache: ReplicaCache, last_event_id: int, hashes: Iterable[int],
                       host_hashes: Iterable[int] = ()) -> None:
        """Replace what is known of the replica's cache (device, and host tier) with a snapshot taken at `last_event_id`.
        The router's own live predictions stay (`predict`): they are requests routed there that the snapshot, taken
        by the replica, cannot know of yet. A replica that re-registers gets a fresh cache (`RouterCore.register`),
        so none of them is a previous incarnation's."""
        cache.hashes.clear()
        cache.host.clear()
        self._caches[cache.replica_id] = cache
        cache.hashes.update(hashes)
        cache.host.update(host_hashes)
        cache.last_event_id = last_event_id

    def purge(self, cache: ReplicaCache) -> None:
        """Forget everything the replica holds or is predicted to hold."""
        cache.hashes.clear()
        cache.host.clear()
        cache.predicted.clear()

    # ---- lookups --------------------------------------------------------------------------
    def cached(self, cache: ReplicaCache, block_hashes: Sequence[int], now: float) -> int:
        """Return the replica's cached prefix of `block_hashes`, in blocks; the hot lookup of scoring."""
        if not block_hashes:
            return 0
        if block_hashes[0] not in cache.hashes and not cache.predicted and block_hashes[0] not in cache.host:
            return 0
        return prefix_len(cache, block_hashes, now)

    # ---- the router's own decisions -------------------------------------------------------
    def predict(self, cache: ReplicaCache, block_hashes: tuple[int, ...], now: float) -> float | None:
        """Count `block_hashes` as held by the replica until now + ttl; return that expiry (None with no hashes
        or ttl 0: nothing predicted)."""
        if not block_hashes or self.ttl_s <= 0:
            return None
        expiry = now + self.ttl_s
        predicted = cache.predicted
        for block_hash in block_hashes:
            predicted[block_hash] = expiry
        self._predictions.append((expiry, cache, block_hashes))
        return expiry

    def retract(self, cache: ReplicaCache, block_hashes: tuple[int, ...], expiry: float) -> None:
        """Take back the prediction `predict` made with these very hashes and expiry (a routed request that never
        ran there: refused after routing). A hash that another live prediction for the replica also covers stays
        predicted until the latest of those; one already pruned or retracted changes nothing."""
        predictions = self._predictions
        for position, (until, held_by, hashes) in enumerate(predictions):
            if until == expiry and held_by is cache and hashes is block_hashes:
                del predictions[position]
                break
        else:
            return
        predicted = cache.predicted
        gone: set[int] = set()
        for block_hash in block_hashes:
            if predicted.get(block_hash) == expiry:
                del predicted[block_hash]
                gone.add(block_hash)
        if not gone:
            return
        never = -math.inf
        for until, held_by, hashes in predictions:
            if held_by is cache:
                for block_hash in hashes:
                    if block_hash in gone and predicted.get(block_hash, never) < until:
                        predicted[block_hash] = until

    def prune(self, now: float) -> None:
        """Forget the predictions that expired at or before `now`."""
        predictions = self._predictions
        while predictions and predictions[0][0] <= now:
            expiry, cache, hashes = predictions.popleft()
            predicted = cache.predicted
            for block_hash in hashes:
                if predicted.get(block_hash) == expiry:
                    del predicted[block_hash]
