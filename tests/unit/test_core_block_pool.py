"""The KV block pool: ledgers, sharing by hash, lazy LRU eviction, pins and KV events."""

from __future__ import annotations

import pytest

from scheduler_svc.core.block_pool import BlockPool, BlockPoolError
from sluice.types import KvEventKind


def _ledgers(pool: BlockPool) -> tuple[int, int, int]:
    assert pool.num_free + pool.num_used + pool.num_cached == pool.num_blocks
    return pool.num_free, pool.num_used, pool.num_cached


def test_allocation_that_does_not_fit_returns_none_and_changes_nothing() -> None:
    """Asking for more blocks than free + cached returns None and leaves every ledger as it was."""
    pool = BlockPool(4)
    assert pool.allocate(3) is not None
    assert pool.allocate(2) is None
    assert _ledgers(pool) == (1, 3, 0)


def test_freed_hashed_blocks_stay_findable_until_evicted() -> None:
    """A registered block with refcount 0 is cached and shareable; eviction is lazy and emits REMOVED."""
    pool = BlockPool(3)
    a, b = pool.allocate(2) or []
    assert pool.register(a, 111, 0) and pool.register(b, 222, 111)
    pool.free([b, a])
    assert _ledgers(pool) == (1, 0, 2)
    assert pool.lookup([111, 222, 333]) == [a, b]
    pool.acquire([a])
    assert pool.refcount(a) == 1 and _ledgers(pool) == (1, 1, 1)
    fresh = pool.allocate(2) or []
    assert fresh[0] not in (a, b), "uncached free blocks are used first"
    assert fresh[1] == b, "then the least recently used cached block is evicted"
    kinds = [(e.kind, e.block_hashes) for e in pool.take_events()]
    assert kinds == [(KvEventKind.STORED, (111,)), (KvEventKind.STORED, (222,)), (KvEventKind.REMOVED, (222,))]
    assert pool.lookup([111, 222]) == [a]


def test_equal_prefixes_share_blocks_by_reference_count() -> None:
    """Two holders of one cached block raise its refcount to 2; it is free only after both let go."""
    pool = BlockPool(2)
    (block,) = pool.allocate(1) or []
    pool.register(block, 7, 0)
    pool.acquire(pool.lookup([7]))
    assert pool.refcount(block) == 2
    pool.free([block])
    assert _ledgers(pool) == (1, 1, 0)
    pool.free([block])
    assert _ledgers(pool) == (1, 0, 1)


def test_double_free_raises() -> None:
    """Freeing a block that has no reference is a bookkeeping bug and raises BlockPoolError."""
    pool = BlockPool(2)
    (block,) = pool.allocate(1) or []
    pool.free([block])
    with pytest.raises(BlockPoolError):
        pool.free([block])


def test_pinned_block_is_never_handed_out() -> None:
    """A pinned block whose owner freed it stays used until unpinned, so allocation cannot reuse it."""
    pool = BlockPool(2)
    (block,) = pool.allocate(1) or []
    pool.pin([block])
    pool.free([block])
    assert pool.allocate(2) is None
    other = pool.allocate(1) or []
    assert block not in other
    pool.unpin([block])
    assert pool.refcount(block) == 0 and _ledgers(pool) == (1, 1, 0)
    with pytest.raises(BlockPoolError):
        pool.unpin([block])


def test_event_ids_are_monotonic_and_reset_clears_all() -> None:
    """Every KV event gets the next id; reset_cache empties the cache and emits ALL_CLEARED."""
    pool = BlockPool(4)
    blocks = pool.allocate(3) or []
    for i, block in enumerate(blocks):
        pool.register(block, 100 + i, 0)
    pool.free(blocks)
    pool.reset_cache()
    events = pool.take_events()
    assert [e.event_id for e in events] == [1, 2, 3, 4]
    assert events[-1].kind is KvEventKind.ALL_CLEARED
    assert _ledgers(pool) == (4, 0, 0) and pool.cached_hashes() == ()


def test_duplicate_hash_keeps_the_first_block() -> None:
    """A second block computed with an already stored hash stays uncached (no second STORED event)."""
    pool = BlockPool(2)
    a, b = pool.allocate(2) or []
    assert pool.register(a, 5, 0)
    assert not pool.register(b, 5, 0)
    pool.free([a, b])
    assert _ledgers(pool) == (1, 0, 1)


def test_caching_disabled_never_stores() -> None:
    """With prefix caching off, register stores nothing and freed blocks are plainly free."""
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.allocate(1) or []
    assert not pool.register(block, 9, 0)
    pool.free([block])
    assert pool.lookup([9]) == [] and _ledgers(pool) == (2, 0, 0)
