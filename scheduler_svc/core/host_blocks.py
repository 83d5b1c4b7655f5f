"""Host (CPU) blocks for swap-mode preemption: a free list, handed out and returned whole.

A swap-out copy of registered (hashed) blocks is reported as KV events with medium CPU, numbered by the
device pool: STORED once the round that copies them has answered (`stored`), REMOVED when the copy is
released after that. A copy released before it was confirmed (its round failed, or the request was
cancelled first) was never reported, so it is not reported removed either.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from scheduler_svc.core.block_pool import BlockPool
from sluice.types import KvEventKind


class HostBlocks:
    """Fixed pool of `total` host blocks; a swap-out takes some, the round after the swap-in frees them."""

    __slots__ = ("total", "_free", "_pool", "_hash_of", "_reported")

    def __init__(self, total: int, pool: BlockPool | None = None) -> None:
        self.total = total
        # Reversed so that host block 0 is handed out first (plans are easier to read).
        self._free = list(range(total - 1, -1, -1))
        self._pool = pool
        self._hash_of: dict[int, int] = {}
        """Host block -> hash of the device block it copies (registered blocks only)."""
        self._reported: set[int] = set()
        """Host blocks whose copy was reported STORED (and not yet REMOVED)."""

    @property
    def num_free(self) -> int:
        """Return the number of host blocks not holding a copy."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Return the number of host blocks holding (or about to hold) a copy."""
        return self.total - len(self._free)

    def take(self, count: int, hashes: Sequence[int] = ()) -> list[int]:
        """Return `count` host blocks; the first len(hashes) will hold the blocks with those hashes.

        The caller checks `num_free` first (IndexError otherwise).
        """
        free = self._free
        taken = [free.pop() for _ in range(count)]
        if self._pool is not None:
            for block, block_hash in zip(taken, hashes, strict=False):
                self._hash_of[block] = block_hash
        return taken

    def stored(self, blocks: Sequence[int]) -> None:
        """The copies into `blocks` are done: report their hashed blocks STORED on the CPU medium."""
        hashed = [block for block in blocks if block in self._hash_of]
        if self._pool is None or not hashed:
            return
        self._reported.update(hashed)
        self._pool.emit_host(KvEventKind.STORED, [self._hash_of[block] for block in hashed])

    def release(self, blocks: Iterable[int]) -> None:
        """Return host blocks whose copy is no longer needed (REMOVED on CPU for reported ones)."""
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
        """Forget what was reported (after ALL_CLEARED, which covers the host copies too)."""
        self._hash_of.clear()
        self._reported.clear()

    def free_ids(self) -> tuple[int, ...]:
        """Return the free host block ids; for invariant checks."""
        return tuple(self._free)
