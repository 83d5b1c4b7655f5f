"""The host (CPU) prefix tier: registered blocks the device evicts are copied to host blocks by the round
that evicts them, and a later prompt whose prefix continues there is copied back instead of computed.

Scenario (block size 4, 7 device blocks, 8 host blocks): A (12-token prompt, 1 output token) finishes and
leaves its 3 registered blocks cached; B (27 tokens, 7 blocks) evicts them, so B's first round copies them out;
C repeats A's prompt: the device holds nothing of it, the host tier holds its first 2 blocks (a lookup stops
one token short of the prompt's end), so C's round swaps them in and prefills from token 8.
"""

from __future__ import annotations

import pytest
from core_factories import FakeExecutor, check_invariants, make_core, make_request, step

from scheduler_svc.core import SchedulerCore
from scheduler_svc.core.host_blocks import HostBlocks
from sluice.hashing import hash_chain, salt_of
from sluice.types import CoreEvents, KvEvent, KvEventKind, KvMedium, RoundResult, Stage

PROMPT_A = tuple(range(100, 112))
PROMPT_B = tuple(range(200, 227))


def _core(num_host_blocks: int = 8) -> SchedulerCore:
    return make_core(num_blocks=7, block_size=4, num_host_blocks=num_host_blocks, host_prefix_cache=True)


def _run(core: SchedulerCore, start: float, rounds: int) -> list[CoreEvents]:
    out = []
    for now in range(rounds):
        out.append(step(core, start + now, FakeExecutor())[1])
        check_invariants(core)
    return out


def _a_then_b(core: SchedulerCore) -> tuple[list[KvEvent], dict[int, int]]:
    """Run A to its end, then plan B's first round and answer it; return every KV event and, for each of A's
    device blocks, the host block its copy went to."""
    core.submit(make_request("A", prompt=PROMPT_A, max_tokens=1), 0.0)
    events = [e for batch in _run(core, 0.0, 2) for e in batch.kv_events]
    assert core.request_status("A").is_terminal and core.pool.num_cached == 3
    core.submit(make_request("B", prompt=PROMPT_B, max_tokens=1), 2.0)
    plan = core.schedule(2.0)
    # All of A's blocks were evicted for B: host blocks 0, 1, 2 get them, copied by B's round (the worker runs
    # swap-outs before the forward writes B's tokens into the same device blocks).
    copies = {c.src: c.dst for c in plan.swap_out}
    assert sorted(copies) == sorted(copies.values()) == [0, 1, 2]  # A held the device blocks handed out first
    assert sorted(plan.seqs[0].block_table) == list(range(7))
    events += core.on_round_result(FakeExecutor().run(plan), 2.5).kv_events
    check_invariants(core)
    return events, copies


def test_evicted_blocks_are_copied_out_and_reported_on_cpu_once_their_round_answers() -> None:
    core = _core()
    events, copies = _a_then_b(core)
    chain = hash_chain(list(PROMPT_A), 4, salt_of("tiny"))
    cpu = [(e.kind, e.block_hashes) for e in events if e.medium is KvMedium.CPU]
    removed = [e.block_hashes[0] for e in events if e.kind is KvEventKind.REMOVED and e.medium is KvMedium.GPU]
    assert sorted(removed) == sorted(chain), "the device reports the evictions as before"
    assert cpu == [(KvEventKind.STORED, tuple(removed))], "the same blocks, stored on CPU in the order evicted"
    assert sorted(core.host.lookup(chain)) == sorted(copies.values()), "each copy is findable by its hash"
    assert [e.event_id for e in events] == list(range(1, len(events) + 1))
    assert core.stats().host_blocks_cached == 3 and core.host.spilled == 3


def test_a_prefix_found_on_the_host_is_swapped_in_and_not_computed() -> None:
    core = _core()
    _a_then_b(core)
    _run(core, 3.0, 3)  # B ends; its blocks stay cached on the device
    assert core.request_status("B").is_terminal
    on_host = core.host.lookup(hash_chain(list(PROMPT_A), 4, salt_of("tiny")))
    core.submit(make_request("C", prompt=PROMPT_A, max_tokens=1), 6.0)
    plan = core.schedule(6.0)
    (seq,) = plan.seqs
    assert seq.start_position == 8 and seq.token_ids == PROMPT_A[8:], "C computes only what the host lacks"
    assert [c.src for c in plan.swap_in] == on_host[:2] and [c.dst for c in plan.swap_in] == list(seq.block_table[:2])
    events = core.on_round_result(FakeExecutor().run(plan), 6.5)
    check_invariants(core)
    (scheduled,) = [e for e in events.lifecycle if e.stage is Stage.FIRST_SCHEDULED]
    assert dict(scheduled.detail) == {"cached_tokens": 8, "host_cached_tokens": 8}
    stats = core.stats()
    assert (stats.prefix_hit_tokens, stats.host_hit_tokens) == (8, 8)
    chain = hash_chain(list(PROMPT_A), 4, salt_of("tiny"))
    stored = [e.block_hashes[0] for e in events.kv_events if e.kind is KvEventKind.STORED and e.medium is KvMedium.GPU]
    assert stored == chain, "the swapped-in blocks are registered on the device once the round answered"
    assert core.host.tier_ids()[2] == {}, "the host copies are let go when the swap-in round answers"


def test_a_spill_round_that_fails_leaves_nothing_findable_and_reports_nothing() -> None:
    core = _core()
    core.submit(make_request("A", prompt=PROMPT_A, max_tokens=1), 0.0)
    events = [e for batch in _run(core, 0.0, 2) for e in batch.kv_events]
    core.submit(make_request("B", prompt=PROMPT_B, max_tokens=1), 2.0)
    plan = core.schedule(2.0)
    assert len(plan.swap_out) == 3
    events += core.on_round_result(RoundResult(plan.round_id, (), error="copy failed"), 2.5).kv_events
    check_invariants(core)
    assert all(e.medium is KvMedium.GPU for e in events)
    assert len(core.host.free_ids()) == 8 and core.stats().host_blocks_cached == 0
    core.submit(make_request("C", prompt=PROMPT_A, max_tokens=1), 3.0)
    plan = core.schedule(3.0)
    assert not plan.swap_in and plan.seqs[0].start_position == 0, "a failed copy is never read back"


def test_a_worker_that_restarts_takes_the_host_tier_with_it() -> None:
    core = _core()
    _a_then_b(core)
    core.on_worker_restarted(3.0)
    check_invariants(core)
    assert core.stats().host_blocks_cached == 0
    core.submit(make_request("C", prompt=PROMPT_A, max_tokens=1), 4.0)
    assert not core.schedule(4.0).swap_in


def test_swap_outs_evict_prefix_copies_for_room() -> None:
    """A preempted request's swap copy outranks a prefix copy: the tier's oldest copies make way (REMOVED on CPU)."""
    from scheduler_svc.core.block_pool import BlockPool
    pool = BlockPool(4)
    host = HostBlocks(3, pool, prefix_cache=True)
    targets = [host.spill(h) for h in (11, 12, 13)]
    assert targets == [0, 1, 2] and host.spill(14) is None, "nothing to evict while copies are pending"
    host.confirm(targets)
    assert host.num_free == 3 and host.lookup([11, 12, 13]) == [0, 1, 2]
    host.read([0])
    assert host.take(2) == [1, 2], "the unread copies are evicted, oldest first"
    assert host.lookup([11, 12]) == [0] and host.lookup([12]) == []
    removed = [e.block_hashes for e in pool.take_events() if e.kind is KvEventKind.REMOVED]
    assert removed == [(12,), (13,)]
    with pytest.raises(IndexError):
        host.take(1)  # block 0 is being read: it cannot be taken
    host.unread([0])
    assert host.spill(11) is None, "a hash the tier holds is not copied again"


def test_the_tier_needs_host_blocks_and_the_prefix_cache() -> None:
    with pytest.raises(ValueError, match="num_host_blocks >= 1"):
        make_core(host_prefix_cache=True)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        make_core(host_prefix_cache=True, num_host_blocks=4, enable_prefix_caching=False)


def test_many_requests_sharing_prefixes_keep_every_ledger_whole() -> None:
    """Requests with overlapping prefixes through a pool far smaller than their prompts: spills, host hits,
    swap-ins and evictions everywhere, and every ledger checks out after each round."""
    core = _core(num_host_blocks=5)
    prompts = [tuple(range(100, 100 + 4 * k)) + (k,) for k in (2, 3, 4, 5)] + [PROMPT_B[:22]]
    now, submitted = 0.0, 0
    for index in range(30):
        core.submit(make_request(f"r{index}", prompt=prompts[index % len(prompts)], max_tokens=2), now)
        submitted += 1
        for _ in range(3):
            step(core, now, FakeExecutor())
            check_invariants(core)
            now += 1.0
    while core.has_unfinished():
        step(core, now, FakeExecutor())
        check_invariants(core)
        now += 1.0
    assert core.host.spilled > 0 and core.host.hits > 0 and core.host.evicted > 0
    assert core.stats().finished == submitted


def test_charged_copies_stay_within_the_rounds_token_budget() -> None:
    """With host_copy_tokens, every round's query tokens plus its copies (swap-outs and swap-ins, at the charge
    each) fit max_num_batched_tokens, the charge is reported with the round's other non-query tokens, and a hit
    the round has no room for waits for a round without other prefill instead of being computed."""
    core = make_core(num_blocks=12, block_size=4, num_host_blocks=16, host_prefix_cache=True,
                     max_num_batched_tokens=16, max_prefill_chunk=16, host_copy_tokens=1.5)
    shared = tuple(range(100, 124))  # 6 blocks
    now = 0.0
    for index, prompt in enumerate([shared + (1,), tuple(range(300, 340)), shared + (2,), tuple(range(400, 440)),
                                    shared + (3,)]):
        core.submit(make_request(f"r{index}", prompt=prompt, max_tokens=2), now)
        while core.has_unfinished():
            plan = core.schedule(now)
            if plan.is_empty:
                break
            query = sum(len(seq.token_ids) for seq in plan.seqs)
            copies = len(plan.swap_out) + len(plan.swap_in)
            assert query + copies * 1.5 <= 16 + 1, f"round {plan.round_id}: {query} tokens and {copies} copies"
            assert plan.budget.attention_tokens >= int(copies * 1.5) - 1
            core.on_round_result(FakeExecutor().run(plan), now)
            check_invariants(core)
            now += 1.0
    assert core.host.spilled and core.stats().host_hit_tokens >= 20, "the shared prompt came back from the host"
