"""Host (CPU) blocks: copies of swapped-out requests and, optionally, a second tier of the prefix cache.

Swap copies. A swap-out copy of registered (hashed) blocks is reported as KV events with medium CPU,
numbered by the device pool: STORED once the round that copies them has answered (`stored`), REMOVED
when the copy is released after that. A copy released before it was confirmed (its round failed, or
the request was cancelled first) was never reported, so it is not reported removed either.

Prefix tier (`prefix_cache=True`). The device's least recently used cached blocks, the next it will
evict, are copied here (`page_out`) by a round's swap-outs before they are evicted (the round builder's
`_page_out`); a cached block is not allocated in that round and a registered block's KV never changes,
so the copy may run beside the round's forward, and an eviction later costs nothing. The
copy is pending until the round answers (`confirm`: findable, STORED on CPU) or fails (`drop`: freed,
never reported). A later request whose prefix continues past the device's hits into this tier
(`lookup`) gets fresh device blocks and swap-in copies instead of prefill work; the host blocks it reads
are held (`read`) from its admission until the round that copies each in answers, or it lets go of them
(`unread`), so neither a swap-out nor a page-out overwrites them meanwhile. Unread copies sit in an LRU,
evicted (REMOVED on CPU) when a page-out or a swap needs room.
Every host block is in exactly one ledger: free, cached (LRU), pending, read, or a swap copy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from scheduler_svc.core.block_pool import BlockPool, longest_prefix
from sluice.types import KvEventKind


class HostBlocks:
    """Fixed pool of `total` host blocks: swap copies, and with `prefix_cache` an LRU tier of the device's cold blocks."""

    __slots__ = ("total", "prefix_cache", "_free", "_pool", "_hash_of", "_reported", "_cached", "_block_of",
                 "_pending", "_pending_hashes", "_readers", "_stale", "hits", "paged_out", "evicted")

    def __init__(self, total: int, pool: BlockPool | None = None, prefix_cache: bool = False) -> None:
        self.total = total
        self.prefix_cache = prefix_cache and total > 0 and pool is not None and pool.caching
        # Reversed so that host block 0 is handed out first (plans are easier to read).
        self._free = list(range(total - 1, -1, -1))
        self._pool = pool
        self._hash_of: dict[int, int] = {}
        """Host block -> hash of the device block it copies (registered blocks only)."""
        self._reported: set[int] = set()
        """Host blocks whose copy was reported STORED (and not yet REMOVED)."""
        # ---- the prefix tier ----
        self._cached: OrderedDict[int, None] = OrderedDict()
        """Confirmed prefix copies nobody reads, least recently used first (evictable)."""
        self._block_of: dict[int, int] = {}
        """Hash -> host block, for confirmed prefix copies (cached or read)."""
        self._pending: dict[int, int] = {}
        """Host block -> hash, for prefix copies whose round has not answered."""
        self._pending_hashes: set[int] = set()
        """The hashes of `_pending`."""
        self._readers: dict[int, int] = {}
        """Host block -> requests holding it until it is copied in (one per in-flight round or load to come)."""
        self._stale: set[int] = set()
        """Pending or read host blocks whose hash was forgotten (a cache reset): freed when let go."""
        self.hits = 0
        """Blocks found in the prefix tier (`lookup` callers that took them: `read`)."""
        self.paged_out = 0
        """Device blocks copied into the prefix tier."""
        self.evicted = 0
        """Prefix copies evicted from the tier for room."""

    @property
    def num_free(self) -> int:
        """Return the number of host blocks a swap-out can take now (free, or evictable prefix copies)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Return the number of host blocks holding (or about to hold) a copy."""
        return self.total - len(self._free)

    @property
    def num_cached(self) -> int:
        """Return the number of host blocks holding a prefix copy (confirmed, pending or read)."""
        return len(self._cached) + len(self._pending) + len(self._readers)

    def _take_one(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._cached.popitem(last=False)
        block_hash = self._hash_of.pop(block)
        del self._block_of[block_hash]
        self.evicted += 1
        if self._pool is not None:
            self._pool.emit_host(KvEventKind.REMOVED, (block_hash,))
            self._pool.unpage(block_hash)
        return block

    def take(self, count: int, hashes: Sequence[int] = ()) -> list[int]:
        """Return `count` host blocks for a swap-out; the first len(hashes) will hold the blocks with those hashes.

        Prefix copies are evicted for room. The caller checks `num_free` first (IndexError otherwise).
        """
        if count > self.num_free:
            raise IndexError(f"{count} host blocks asked for, {self.num_free} can be had")
        taken = [self._take_one() for _ in range(count)]
        if self._pool is not None:
            for block, block_hash in zip(taken, hashes, strict=False):
                self._hash_of[block] = block_hash
        return taken

    def stored(self, blocks: Sequence[int]) -> None:
        """The swap copies into `blocks` are done: report their hashed blocks STORED on the CPU medium."""
        hashed = [block for block in blocks if block in self._hash_of]
        if self._pool is None or not hashed:
            return
        self._reported.update(hashed)
        self._pool.emit_host(KvEventKind.STORED, [self._hash_of[block] for block in hashed])

    def release(self, blocks: Iterable[int]) -> None:
        """Return host blocks whose swap copy is no longer needed (REMOVED on CPU for reported ones)."""
        blocks = list(blocks)
        self._free.extend(blocks)
        if not self._hash_of:
            return
        removed = [self._hash_of.pop(block) for block in blocks if block in self._hash_of
                   and block in self._reported]
        for block in blocks:
            self._hash_of.pop(block, None)
            self._reported.discard(block)
        if removed and self._pool is not None:
            self._pool.emit_host(KvEventKind.REMOVED, removed)

    def forget_hashes(self) -> None:
        """Forget what was reported (after ALL_CLEARED, which covers the host copies too).

        The prefix tier is emptied: cached copies are freed now, pending and read ones when let go."""
        self._free.extend(self._cached)
        self._cached.clear()
        self._block_of.clear()
        self._stale.update(self._pending)
        self._stale.update(self._readers)
        self._pending_hashes.clear()
        self._hash_of.clear()
        self._reported.clear()

    def free_ids(self) -> tuple[int, ...]:
        """Return the free host block ids; for invariant checks."""
        return tuple(self._free)

    def cached_hashes(self) -> tuple[int, ...]:
        """Return the hashes of the prefix tier's confirmed copies (the ones reported STORED on CPU)."""
        return tuple(self._block_of)

    def tier_ids(self) -> tuple[tuple[int, ...], tuple[int, ...], dict[int, int]]:
        """Return the prefix tier's (cached LRU oldest first, pending, read -> readers); for invariant checks."""
        return tuple(self._cached), tuple(self._pending), dict(self._readers)

    # ---- the prefix tier ---------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[int]) -> list[int]:
        """Return the host blocks of the longest prefix of `block_hashes` the tier holds (nothing taken)."""
        return longest_prefix(self._block_of, block_hashes) if self._block_of else []

    def read(self, blocks: Sequence[int]) -> None:
        """Hold `blocks` (found by `lookup`) for a round that swaps them in, until `unread`."""
        readers = self._readers
        for block in blocks:
            count = readers.get(block, 0)
            if not count:
                del self._cached[block]
            readers[block] = count + 1
        self.hits += len(blocks)

    def unread(self, blocks: Iterable[int]) -> None:
        """Let go of `blocks`: the round that copied them in answered (or failed), or their request will not copy
        them in now. Unless forgotten meanwhile, they are the tier's most recently used."""
        readers = self._readers
        for block in blocks:
            count = readers[block] - 1
            if count:
                readers[block] = count
                continue
            del readers[block]
            if block in self._stale:
                self._stale.discard(block)
                self._free.append(block)
            else:
                self._cached[block] = None

    def page_out(self, block_hash: int) -> int | None:
        """Return the host block to copy a device block with `block_hash` into, or None: the tier holds it (or
        is copying it) already, or nothing can be evicted for room."""
        if self.holds(block_hash) or not (self._free or self._cached):
            return None
        block = self._take_one()
        self._pending[block] = block_hash
        self._pending_hashes.add(block_hash)
        self.paged_out += 1
        return block

    def holds(self, block_hash: int) -> bool:
        """Return True when the tier holds `block_hash` or is copying it."""
        return block_hash in self._block_of or block_hash in self._pending_hashes

    def confirm(self, blocks: Iterable[int]) -> None:
        """The round that copied into `blocks` has answered: they are findable (STORED on CPU)."""
        stored: list[int] = []
        for block in blocks:
            block_hash = self._pending.pop(block)
            self._pending_hashes.discard(block_hash)
            if block in self._stale:
                self._stale.discard(block)
                self._free.append(block)
                continue
            self._hash_of[block] = block_hash
            self._block_of[block_hash] = block
            self._cached[block] = None
            stored.append(block_hash)
        if stored and self._pool is not None:
            self._pool.emit_host(KvEventKind.STORED, stored)

    def drop(self, blocks: Iterable[int]) -> None:
        """The round that copied into `blocks` failed: the copies cannot be trusted and were never reported."""
        for block in blocks:
            block_hash = self._pending.pop(block)
            self._pending_hashes.discard(block_hash)
            if self._pool is not None and block not in self._stale:
                self._pool.unpage(block_hash)
            self._stale.discard(block)
            self._free.append(block)
