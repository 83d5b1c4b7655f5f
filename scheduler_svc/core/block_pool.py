"""The KV block pool of one replica: reference counts, a hash-indexed prefix cache, pins, events.

Theory of operation
-------------------
Every block is in exactly one of three ledgers:
  * free    -- refcount 0, no hash: handed out first (a stack, so recently freed blocks are reused);
  * cached  -- refcount 0 with a registered hash: still findable by `lookup`, kept in an LRU and
               evicted lazily (a REMOVED event) only when an allocation runs out of free blocks;
  * used    -- refcount > 0 (owners plus pins).
so `num_free + num_used + num_cached == num_blocks` always holds. A full block gets its hash with
`register` once its KV is computed (a STORED event); equal prefixes then share that block through
`lookup` + `acquire`. `pin` takes an extra reference for an explicit reader (a swap-out copy), so a
pinned block is never handed out. Allocation that does not fit returns None and changes nothing.

Events (vLLM's shape, see docs/kv-events.md): STORED when a hash is registered, REMOVED when a cached
block is evicted, ALL_CLEARED on reset; `emit_host` adds the host (CPU) copies under the same monotonic
event ids. A STORED event carries the block's tokens only when the caller passes them (the scheduler does
when `kv_event_token_ids` is set), so the default costs nothing extra. `to_page_out` and `unpage` keep the
host prefix tier's marks (which blocks it holds), for the round builder's page-out.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from scheduler_svc.core.retype import retyping_constructor
from sluice.types import KvEvent, KvEventKind, KvMedium

_new_kv_event = retyping_constructor(KvEvent)
"""KvEvent's constructor, positional (a STORED event per registered block: see retype.py)."""


def longest_prefix(block_of: dict[int, int], block_hashes: Sequence[int]) -> list[int]:
    """Return the blocks `block_of` maps the longest prefix of `block_hashes` to (the device's and the host
    tier's prefix lookups)."""
    found: list[int] = []
    for block_hash in block_hashes:
        block = block_of.get(block_hash)
        if block is None:
            break
        found.append(block)
    return found


class BlockPoolError(Exception):
    """A caller broke the pool's bookkeeping (freeing a free block, unpinning an unpinned one)."""


class BlockPool:
    """Fixed pool of `num_blocks` KV blocks with reference counts and a prefix cache."""

    __slots__ = (
        "num_blocks",
        "caching",
        "_refcount",
        "_pins",
        "_hash_of",
        "_block_of",
        "_free",
        "_cached",
        "_events",
        "last_event_id",
        "_paged",
    )

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.caching = enable_caching
        # Arrays, not lists: the garbage collector does not walk their items, and a full
        # collection that walks 10^5-10^6 ints costs tens of ms (a p99 round time).
        self._refcount = array("q", bytes(8 * num_blocks))
        self._pins = array("q", bytes(8 * num_blocks))
        self._hash_of = array("Q", bytes(8 * num_blocks))
        self._block_of: dict[int, int] = {}
        # Reversed so that block 0 is handed out first (plans are easier to read).
        self._free = array("q", range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._events: list[KvEvent] = []
        self.last_event_id = 0
        # Which blocks' KV the host prefix tier (host_blocks.py) holds or is copying: `to_page_out` skips them
        # with one byte read each, without asking the tier.
        self._paged = bytearray(num_blocks)

    # ---- ledgers ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Return the number of free blocks without a cached hash."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Return the number of unreferenced blocks that keep a hash (evictable)."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        """Return the number of blocks with a reference (owner or pin)."""
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def num_allocatable(self) -> int:
        """Return how many blocks an allocation could get now (free + evictable cached)."""
        return len(self._free) + len(self._cached)

    def refcount(self, block_id: int) -> int:
        """Return the reference count of one block."""
        return self._refcount[block_id]

    def pin_count(self, block_id: int) -> int:
        """Return how many pins one block holds."""
        return self._pins[block_id]

    def free_block_ids(self) -> tuple[int, ...]:
        """Return the ids of free (uncached) blocks; for invariant checks."""
        return tuple(self._free)

    def cached_block_ids(self) -> tuple[int, ...]:
        """Return the ids of cached blocks, least recently used first; for invariant checks."""
        return tuple(self._cached)

    # ---- allocation ------------------------------------------------------------------------
    def allocate(self, count: int) -> list[int] | None:
        """Return `count` fresh blocks (refcount 1), or None, changing nothing, when they don't fit.

        Uncached free blocks go first; then least recently used cached blocks are evicted.
        """
        free = self._free
        if count > len(free) + len(self._cached):
            return None
        if count <= len(free):
            taken = free[len(free) - count :].tolist()
            del free[len(free) - count :]
        else:
            taken = free.tolist()
            del free[:]
            for _ in range(count - len(taken)):
                taken.append(self._evict_oldest())
        refcount = self._refcount
        for block in taken:
            refcount[block] = 1
        return taken

    def _evict_oldest(self) -> int:
        block, _ = self._cached.popitem(last=False)
        self._paged[block] = 0
        block_hash = self._hash_of[block]
        self._hash_of[block] = 0
        del self._block_of[block_hash]
        self._emit(KvEventKind.REMOVED, (block_hash,))
        return block

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; unreferenced blocks become free or cached.

        Callers pass a sequence's blocks tail first, so its tail is evicted before its prefix.
        Raises BlockPoolError for a block that has no reference.
        """
        refcount = self._refcount
        hash_of = self._hash_of
        for block in block_ids:
            count = refcount[block]
            if count <= 0:
                raise BlockPoolError(f"block {block} freed with refcount {count}")
            refcount[block] = count - 1
            if count == 1:
                if hash_of[block]:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    # ---- prefix cache ----------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[int]) -> list[int]:
        """Return the blocks of the longest cached prefix of `block_hashes` (no references taken)."""
        if not self.caching:
            return []
        return longest_prefix(self._block_of, block_hashes)

    def count_unreferenced(self, block_ids: Iterable[int]) -> int:
        """Return how many of `block_ids` sit in the cached LRU (acquiring them uses up capacity)."""
        refcount = self._refcount
        return sum(1 for block in block_ids if refcount[block] == 0)

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take a reference on each (cached or used) block, e.g. a prefix-cache hit."""
        refcount = self._refcount
        for block in block_ids:
            if refcount[block] == 0:
                if block not in self._cached:
                    raise BlockPoolError(f"block {block} is free, not cached: nothing to share")
                del self._cached[block]
            refcount[block] += 1

    def register(self, block_id: int, block_hash: int, parent_hash: int, token_ids: Sequence[int] = ()) -> bool:
        """Record the hash of a full, computed block; return True when it was newly stored.

        `token_ids` (the block's tokens) go into the STORED event as they are; empty: the event has none.
        A hash that another block already holds keeps the first one (the duplicate stays uncached).
        """
        if not self.caching or self._hash_of[block_id] or block_hash in self._block_of:
            return False
        if self._refcount[block_id] <= 0:
            raise BlockPoolError(f"block {block_id} registered without a reference")
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        self._paged[block_id] = 0  # new KV (a block is registered while referenced: not in the LRU)
        self._emit(KvEventKind.STORED, (block_hash,), parent_hash, tuple(token_ids) if token_ids else ())
        return True

    def reset_cache(self) -> None:
        """Forget every hash (cached blocks become free) and emit ALL_CLEARED."""
        for block in self._cached:
            self._free.append(block)
        self._cached.clear()
        self._block_of.clear()
        self._hash_of = array("Q", bytes(8 * self.num_blocks))
        self._paged = bytearray(self.num_blocks)
        self._emit(KvEventKind.ALL_CLEARED, ())

    def to_page_out(self, zone: int) -> list[tuple[int, int]]:
        """Mark and return (block, hash) of those of the `zone` least recently used cached blocks (the next to be
        evicted) that the host tier does not hold yet, to copy out before they are."""
        out: list[tuple[int, int]] = []
        paged, hash_of = self._paged, self._hash_of
        for seen, block in enumerate(self._cached):
            if seen >= zone:
                break
            if not paged[block]:
                paged[block] = 1
                out.append((block, hash_of[block]))
        return out

    def unpage(self, block_hash: int) -> None:
        """The host tier no longer holds `block_hash` (evicted, or its copy failed or found no room)."""
        block = self._block_of.get(block_hash)
        if block is not None:
            self._paged[block] = 0

    def paged_block_ids(self) -> tuple[int, ...]:
        """Return the blocks marked as held by the host tier; for invariant checks."""
        return tuple(block for block in range(self.num_blocks) if self._paged[block])

    def cached_hashes(self) -> tuple[int, ...]:
        """Return the hash of every block that holds one (used or cached)."""
        return tuple(self._block_of)

    # ---- readers ---------------------------------------------------------------------------
    def pin(self, block_ids: Iterable[int]) -> None:
        """Hold `block_ids` for an explicit reader: they are never handed out until unpinned."""
        block_ids = list(block_ids)
        self.acquire(block_ids)
        pins = self._pins
        for block in block_ids:
            pins[block] += 1

    def unpin(self, block_ids: Iterable[int]) -> None:
        """Release pins taken with `pin`. Raises BlockPoolError for a block that is not pinned."""
        block_ids = list(block_ids)
        pins = self._pins
        for block in block_ids:
            if pins[block] <= 0:
                raise BlockPoolError(f"block {block} unpinned without a pin")
        for block in block_ids:
            pins[block] -= 1
        self.free(block_ids)

    # ---- events ----------------------------------------------------------------------------
    def _emit(self, kind: KvEventKind, hashes: tuple[int, ...], parent_hash: int = 0,
              token_ids: tuple[int, ...] = (), medium: KvMedium = KvMedium.GPU) -> None:
        self.last_event_id += 1
        self._events.append(_new_kv_event(self.last_event_id, kind, hashes, parent_hash, token_ids, medium))

    def emit_host(self, kind: KvEventKind, hashes: Sequence[int], parent_hash: int = 0) -> None:
        """Emit a STORED or REMOVED event for host (CPU) copies of blocks; nothing for no hashes.

        The pool does not own host blocks (HostBlocks does); it only numbers their events with the
        device's, so that a consumer sees one gap-free sequence of event ids per replica.
        """
        if hashes and self.caching:
            self._emit(kind, tuple(hashes), parent_hash, (), KvMedium.CPU)

    @property
    def has_events(self) -> bool:
        """Return True when KV events are waiting for `take_events`."""
        return bool(self._events)

    def take_events(self) -> list[KvEvent]:
        """Return and clear the KV events emitted since the last call."""
        events, self._events = self._events, []
        return events
