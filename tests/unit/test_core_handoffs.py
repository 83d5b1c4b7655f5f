"""The prefill side of a disaggregated pair: a finished prompt's KV blocks held for the decode replica's transfer."""

from __future__ import annotations

import pytest
from core_factories import FakeExecutor, check_invariants, make_core, make_request, step

from sluice.hashing import hash_chain, salt_of
from sluice.types import KV_HELD, RequestStatus


def _prefilled(core, request_id: str = "p", prompt_len: int = 40, **fields: object):  # noqa: ANN001, ANN202
    """Submit a hold_kv request with max_tokens 1 and run it to its end; return its Finished record."""
    core.submit(make_request(request_id, prompt_len, max_tokens=1, hold_kv=True, **fields), 0.0)
    _, events = step(core, 0.0)
    (finished,) = events.finished
    return finished


def test_finished_prefill_holds_its_prompts_full_blocks_pinned() -> None:
    """A hold_kv request that ends FINISHED_LENGTH keeps its 2 full blocks (of a 40-token prompt) pinned and used,
    frees the partial one, and says so in its completion's detail."""
    core = make_core(num_blocks=8, block_size=16)
    finished = _prefilled(core)
    assert (finished.status, finished.detail) == (RequestStatus.FINISHED_LENGTH, KV_HELD)
    held = core.held_kv("p")
    assert held is not None and len(held) == 2
    assert all(core.pool.pin_count(b) == 1 and core.pool.refcount(b) == 1 for b in held)
    assert core.stats().kv_blocks_used == 2 and core.handoffs.held_blocks == 2
    check_invariants(core)


def test_held_blocks_are_never_handed_out() -> None:
    """With the pool's other blocks taken, a request that needs the held ones cannot be placed until the release."""
    core = make_core(num_blocks=4, block_size=16)
    _prefilled(core, prompt_len=40)  # holds 2 of 4 blocks
    core.submit(make_request("next", 40, max_tokens=8), 1.0)  # needs 3 blocks
    plan, _ = step(core, 1.0)
    assert plan.is_empty, "a held block was handed out"
    assert core.release_held_kv("p") == 2
    plan, _ = step(core, 2.0)
    assert [s.request_id for s in plan.seqs] == ["next"]
    check_invariants(core)


def test_release_leaves_the_full_blocks_in_the_prefix_cache() -> None:
    """After the release the held blocks are unpinned, unreferenced and still found by their hashes."""
    core = make_core(num_blocks=8, block_size=16)
    request = make_request("p", 40, max_tokens=1, hold_kv=True)
    core.submit(request, 0.0)
    step(core, 0.0)
    held = core.held_kv("p")
    assert core.release_held_kv("p") == 2 and core.release_held_kv("p") == 0
    assert core.held_kv("p") is None and core.stats().kv_blocks_used == 0
    hashes = hash_chain(list(request.prompt_token_ids[:32]), 16, salt_of(core.config.model_id, ""))
    assert core.pool.lookup(hashes) == list(held or ())
    check_invariants(core)


@pytest.mark.parametrize("ending", ["stop_token", "no_hold_flag", "cancelled", "short_prompt"])
def test_other_ends_hold_nothing(ending: str) -> None:
    """A stop token, a request without hold_kv, a cancel before its end and a prompt with no full block hold nothing."""
    core = make_core(num_blocks=8, block_size=16)
    if ending == "stop_token":
        core.submit(make_request("p", 40, max_tokens=1, hold_kv=True, stop_token_ids=(10_000,)), 0.0)
        step(core, 0.0)
    elif ending == "no_hold_flag":
        core.submit(make_request("p", 40, max_tokens=1), 0.0)
        step(core, 0.0)
    elif ending == "cancelled":
        core.submit(make_request("p", 40, max_tokens=1, hold_kv=True), 0.0)
        core.cancel("p", 0.0)
    else:
        core.submit(make_request("p", 10, max_tokens=1, hold_kv=True), 0.0)
        step(core, 0.0)
    assert core.held_kv("p") is None and core.handoffs.held_blocks == 0
    assert core.stats().kv_blocks_used == 0
    check_invariants(core)


def test_cancel_of_a_held_request_releases_its_blocks() -> None:
    """Cancelling a finished, held request (its client went away during the transfer) unpins its blocks."""
    core = make_core(num_blocks=8, block_size=16)
    _prefilled(core)
    assert core.cancel("p", 1.0) is RequestStatus.FINISHED_LENGTH  # it ended; the cancel only ends the hold
    assert core.held_kv("p") is None and core.stats().kv_blocks_used == 0
    check_invariants(core)


def test_a_hold_expires_after_kv_hold_s() -> None:
    """Nobody releases the hold: it is a deadline of the core (next_deadline) and `expire` ends it then, not before."""
    core = make_core(num_blocks=8, block_size=16, kv_hold_s=30.0)
    _prefilled(core)
    assert core.next_deadline() == pytest.approx(30.0)
    core.expire(29.9)
    assert core.held_kv("p") is not None
    core.expire(30.0)
    assert core.held_kv("p") is None and core.handoffs.expired == 1 and core.stats().kv_blocks_used == 0
    assert core.next_deadline() is None
    check_invariants(core)


def test_holds_across_many_requests_keep_the_ledgers() -> None:
    """Several prefill requests held and released in another order keep every invariant, and leave no pin."""
    core = make_core(num_blocks=32, block_size=16)
    executor = FakeExecutor()
    for i in range(4):
        core.submit(make_request(f"p{i}", 20 + 16 * i, max_tokens=1, hold_kv=True), 0.0)
    step(core, 0.0, executor)
    check_invariants(core)
    assert core.handoffs.held_blocks == sum((20 + 16 * i) // 16 for i in range(4))
    for i in (2, 0, 3, 1):
        core.release_held_kv(f"p{i}")
        check_invariants(core)
    assert all(core.pool.pin_count(b) == 0 for b in range(32)) and core.stats().kv_blocks_used == 0


@pytest.mark.parametrize("loss", ["round_lost", "worker_restarted"])
def test_a_lost_worker_ends_every_hold(loss: str) -> None:
    """The worker's KV is gone (a round lost with it, or it came back empty): no hold may name those blocks any more,
    or a decode replica would pull a prompt that is not there."""
    core = make_core(num_blocks=16, block_size=16)
    _prefilled(core)
    core.submit(make_request("other", 20, max_tokens=4), 1.0)
    plan = core.schedule(1.0)
    if loss == "round_lost":
        core.on_round_lost(plan.round_id, 1.1)
    else:
        core.on_worker_restarted(1.1)
    assert core.held_kv("p") is None and core.handoffs.held_blocks == 0
    check_invariants(core)
