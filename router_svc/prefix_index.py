"""The router's prefix index: block hash -> the replicas that hold it, fed by their KV events.

Rules
-----
* Block hashes are sluice.hashing chains. Each replica's view is a `ReplicaCache` (the hashes it
  holds, the hashes the router predicts it holds, the last applied event id); the index maps every
  held hash to the ids of its holders.
* A replica's events are applied in event-id order: an id at or below the last applied one is a
  duplicate of an at-least-once delivery and is skipped; an id that skips ahead is a gap, so
  `apply_events` stops there and returns False (the caller fetches a snapshot). `apply_snapshot`
  replaces what is known with a snapshot taken at an event id.
* Between events, the router's own routing decisions count as held for `ttl_s`
  (`predict`), so sibling requests sent right after see the prefix at once; `prune` forgets
  expired predictions in expiry order.
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
    predicted: dict[int, float] = field(default_factory=dict)
    """Block hashes the router sent it -> until when they count as held."""
    last_event_id: int = 0

    def holds(self, block_hash: int, now: float) -> bool:
        """Return True if the replica holds the block or is predicted to at `now`."""
        return block_hash in self.hashes or self.predicted.get(block_hash, -math.inf) > now


def prefix_len(cache: ReplicaCache, block_hashes: Sequence[int], now: float) -> int:
    """Return the length of the longest prefix of `block_hashes` the replica holds (or is predicted to)."""
    lo, hi = 0, len(block_hashes)
    while lo < hi:  # largest k such that block k-1 is held (prefix-closed cache)
        mid = (lo + hi + 1) // 2
        if cache.holds(block_hashes[mid - 1], now):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixIndex:
    """Block hash -> holders, over the replicas' `ReplicaCache`s. See the module docstring."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._holders: dict[int, frozenset[str]] = {}
        """Immutable: nearly every hash has one holder, whose frozenset({id}) every such hash shares (no set each)."""
        self._alone: dict[str, frozenset[str]] = {}
        self._predictions: deque[tuple[float, ReplicaCache, tuple[int, ...]]] = deque()
        self.gaps = 0
        """Event-id gaps seen (each one asks the caller for a snapshot)."""

    def __len__(self) -> int:
        return len(self._holders)

    # ---- events and snapshots -------------------------------------------------------------
    def apply_events(self, cache: ReplicaCache, events: Sequence[KvEvent]) -> bool:
        """Apply a replica's KV events in order; return False on an event-id gap (nothing after it applied)."""
        last = cache.last_event_id
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
            if event.medium is not KvMedium.GPU and kind is not KvEventKind.ALL_CLEARED:
                continue  # host copies of a swapped-out request: no other request can hit them (ids still count)
            if kind is KvEventKind.STORED:
                self._add(cache, event.block_hashes)
            elif kind is KvEventKind.REMOVED:
                self._remove(cache, event.block_hashes)
            else:
                self.purge(cache)
        cache.last_event_id = last
        return True

    def apply_snapshot(self, cache: ReplicaCache, last_event_id: int, hashes: Iterable[int]) -> None:
        """Replace what is known of the replica's cache with a snapshot taken at `last_event_id`."""
        self.purge(cache)
        self._add(cache, hashes)
        cache.last_event_id = last_event_id

    def _alone_of(self, replica_id: str) -> frozenset[str]:
        """Return frozenset({replica_id}), one object per replica."""
        alone = self._alone.get(replica_id)
        if alone is None:
            alone = self._alone[replica_id] = frozenset((replica_id,))
        return alone

    def _add(self, cache: ReplicaCache, hashes: Iterable[int]) -> None:
        # Plain loops with the lookups hoisted: a simulated trace stores and removes millions of blocks.
        rid, held, holders, alone = cache.replica_id, cache.hashes, self._holders, self._alone_of(cache.replica_id)
        for block_hash in hashes:
            held.add(block_hash)
            holding = holders.get(block_hash)
            if holding is None:
                holders[block_hash] = alone
            elif rid not in holding:
                holders[block_hash] = holding | alone

    def _remove(self, cache: ReplicaCache, hashes: Iterable[int]) -> None:
        rid, held, holders, alone = cache.replica_id, cache.hashes, self._holders, self._alone_of(cache.replica_id)
        for block_hash in hashes:
            held.discard(block_hash)
            holding = holders.get(block_hash)
            if holding is not None and rid in holding:
                if len(holding) == 1:
                    del holders[block_hash]
                else:
                    holders[block_hash] = holding - alone

    def purge(self, cache: ReplicaCache) -> None:
        """Forget everything the replica holds or is predicted to hold."""
        self._remove(cache, list(cache.hashes))
        cache.predicted.clear()

    # ---- lookups --------------------------------------------------------------------------
    def cached(self, cache: ReplicaCache, block_hashes: Sequence[int], now: float) -> int:
        """Return the replica's cached prefix of `block_hashes`, in blocks; the hot lookup of scoring."""
        if not block_hashes:
            return 0
        if cache.replica_id not in self._holders.get(block_hashes[0], ()) and not cache.predicted:
            return 0
        return prefix_len(cache, block_hashes, now)

    # ---- the router's own decisions -------------------------------------------------------
    def predict(self, cache: ReplicaCache, block_hashes: tuple[int, ...], now: float) -> None:
        """Count `block_hashes` as held by the replica until now + ttl (no-op with ttl 0)."""
        if not block_hashes or self.ttl_s <= 0:
            return
        expiry = now + self.ttl_s
        predicted = cache.predicted
        for block_hash in block_hashes:
            predicted[block_hash] = expiry
        self._predictions.append((expiry, cache, block_hashes))

    def prune(self, now: float) -> None:
        """Forget the predictions that expired at or before `now`."""
        predictions = self._predictions
        while predictions and predictions[0][0] <= now:
            expiry, cache, hashes = predictions.popleft()
            for block_hash in hashes:
                if cache.predicted.get(block_hash) == expiry:
                    del cache.predicted[block_hash]
