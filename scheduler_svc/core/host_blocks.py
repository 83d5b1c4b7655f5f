"""Host (CPU) blocks for swap-mode preemption: a free list, handed out and returned whole."""

from __future__ import annotations

from collections.abc import Iterable


class HostBlocks:
    """Fixed pool of `total` host blocks; a swap-out takes some, the round after the swap-in frees them."""

    __slots__ = ("total", "_free")

    def __init__(self, total: int) -> None:
        self.total = total
        # Reversed so that host block 0 is handed out first (plans are easier to read).
        self._free = list(range(total - 1, -1, -1))

    @property
    def num_free(self) -> int:
        """Return the number of host blocks not holding a copy."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Return the number of host blocks holding (or about to hold) a copy."""
        return self.total - len(self._free)

    def take(self, count: int) -> list[int]:
        """Return `count` host blocks. The caller checks `num_free` first (IndexError otherwise)."""
        free = self._free
        return [free.pop() for _ in range(count)]

    def release(self, blocks: Iterable[int]) -> None:
        """Return host blocks whose copy is no longer needed."""
        self._free.extend(blocks)

    def free_ids(self) -> tuple[int, ...]:
        """Return the free host block ids; for invariant checks."""
        return tuple(self._free)
