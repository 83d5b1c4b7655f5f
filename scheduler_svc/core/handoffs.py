"""KV blocks a prefill replica holds for a decode replica's transfer (prefill/decode disaggregation).

Rules
-----
* A request submitted with `hold_kv` is the prefill half of a pair. When it ends FINISHED_LENGTH (its first
  token sampled, max_tokens reached), the blocks of its prompt's *full* blocks are pinned (`BlockPool.pin`, the
  explicit reader's pin a swap copy takes) before its own references go: the request ends as any finished
  request does, but those blocks stay used until the hand-off's reader is done. Any other end (a stop token, a
  cancel, a timeout, a failure) holds nothing: there is no decode half to feed.
* Only full blocks are held: the decode side registers them under their hash chain and finds them through its
  prefix cache, so its first round computes the partial last block and the new token only.
* A hold ends exactly once: `release` (the decode side has the blocks, or gave up), `cancel` of the request id,
  `expire` once `hold_s` has passed since it began (a decode side that died or never asked), or `release_all`
  when the worker's KV is lost (a lost round, a restarted worker: the blocks no longer hold that prompt). Each unpins
  every held block; the full ones stay in the prefix cache as any freed full block does.

Pure: no clock (`now` is an argument), no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.core.block_pool import BlockPool

__all__ = ["HandOffs", "HeldKv"]


@dataclass(frozen=True)
class HeldKv:
    """One finished prefill request's held blocks."""

    block_ids: tuple[int, ...]
    """The prompt's full blocks, in order (block i holds positions [i*block_size, (i+1)*block_size))."""
    expires_at: float
    """When the hold lapses if nobody released it."""


class HandOffs:
    """The holds of one core (see the module docstring)."""

    __slots__ = ("_pool", "hold_s", "_block_size", "_wanted", "_held", "held_blocks", "released", "expired")

    def __init__(self, pool: BlockPool, hold_s: float, block_size: int) -> None:
        self._pool = pool
        self.hold_s = hold_s
        self._block_size = block_size
        self._wanted: set[str] = set()
        """Live requests submitted with hold_kv."""
        self._held: dict[str, HeldKv] = {}
        self.held_blocks = 0
        """Blocks pinned by holds now (a gauge)."""
        self.released = 0
        """Holds ended by `release` or `cancel`."""
        self.expired = 0
        """Holds ended by `expire`."""

    def want(self, request_id: str) -> None:
        """Mark a live request as the prefill half of a pair."""
        self._wanted.add(request_id)

    def on_end(self, request_id: str, finished_length: bool, block_ids: tuple[int, ...], num_prompt: int,
               now: float) -> bool:
        """A request ends, before its blocks are freed: hold its prompt's full blocks when it asked for it and
        ended FINISHED_LENGTH; return whether it did."""
        if request_id not in self._wanted:
            return False
        self._wanted.discard(request_id)
        full = block_ids[: num_prompt // self._block_size]
        if not finished_length or not full:
            return False
        self._pool.pin(full)
        self._held[request_id] = HeldKv(full, now + self.hold_s)
        self.held_blocks += len(full)
        return True

    def held(self, request_id: str) -> HeldKv | None:
        """Return the request's hold, or None when it holds nothing (never did, released or expired)."""
        return self._held.get(request_id)

    def release(self, request_id: str) -> int:
        """End the request's hold; return the blocks unpinned (0: it held none)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return 0
        self._unpin(held)
        self.released += 1
        return len(held.block_ids)

    def expire(self, now: float) -> list[str]:
        """End every hold past its expiry; return their request ids."""
        lapsed = [rid for rid, held in self._held.items() if held.expires_at <= now]
        for rid in lapsed:
            self._unpin(self._held.pop(rid))
            self.expired += 1
        return lapsed

    def release_all(self) -> int:
        """End every hold (the worker's KV is gone: what they name is no longer there); return how many ended."""
        ended = list(self._held)
        for rid in ended:
            self._unpin(self._held.pop(rid))
        self.released += len(ended)
        return len(ended)

    def next_expiry(self) -> float | None:
        """Return the earliest expiry of a hold, or None when nothing is held."""
        return min((held.expires_at for held in self._held.values()), default=None)

    def holds(self) -> list[HeldKv]:
        """Return every hold now (for invariant checks)."""
        return list(self._held.values())

    def __len__(self) -> int:
        return len(self._held)

    def _unpin(self, held: HeldKv) -> None:
        self._pool.unpin(reversed(held.block_ids))  # tail first, as a sequence's blocks are freed
        self.held_blocks -= len(held.block_ids)
