"""The host (CPU) prefix tier: the device's least recently used cached blocks are copied to host blocks before
they are evicted, and a later prompt whose prefix continues there is copied back instead of computed.

Scenario (block size 4, 7 device blocks, 8 host blocks): A (12-token prompt, 1 output token) finishes and
leaves its 3 registered blocks cached; B's first round (8 tokens of its own, the free blocks suffice) copies
them out, as the oldest cached blocks; C (27 tokens, 7 blocks) evicts them from the device; D repeats A's
prompt: the device holds nothing of it, the host tier holds its first 2 blocks (a lookup stops one token short
of the prompt's end), so D's round swaps them in and prefills from token 8.
"""

from __future__ import annotations

import pytest
from core_factories import FakeExecutor, check_invariants, make_core, make_request, step

from scheduler_svc.core import SchedulerCore
from scheduler_svc.core.host_blocks import HostBlocks
from sluice.hashing import hash_chain, salt_of
from sluice.types import CoreEvents, KvEvent, KvEventKind, KvMedium, RoundResult, Stage

PROMPT_A = tuple(range(100, 112))
PROMPT_B = tuple(range(200, 208))
PROMPT_C = tuple(range(300, 327))
CHAIN_A = hash_chain(list(PROMPT_A), 4, salt_of("tiny"))


def _core(num_host_blocks: int = 8) -> SchedulerCore:
    return make_core(num_blocks=7, block_size=4, num_host_blocks=num_host_blocks, host_prefix_cache=True,
                     host_page_out_blocks=8)


def _run(core: SchedulerCore, start: float, rounds: int) -> list[CoreEvents]:
    out = []
    for now in range(rounds):
        out.append(step(core, start + now, FakeExecutor())[1])
        check_invariants(core)
    return out


def _until_done(core: SchedulerCore, now: float) -> tuple[list[KvEvent], float]:
    events: list[KvEvent] = []
    while core.has_unfinished():
        events += step(core, now, FakeExecutor())[1].kv_events
        check_invariants(core)
        now += 1.0
    return events, now


def _a_then_b(core: SchedulerCore, fail: bool = False) -> tuple[list[KvEvent], dict[int, int]]:
    """Run A to its end, then plan B's first round and answer it (or fail it); return every KV event and, for
    each of A's device blocks, the host block its copy went to."""
    core.submit(make_request("A", prompt=PROMPT_A, max_tokens=1), 0.0)
    events, now = _until_done(core, 0.0)
    assert core.pool.num_cached == 3
    core.submit(make_request("B", prompt=PROMPT_B, max_tokens=2), now)
    plan = core.schedule(now)
    # A's three cached blocks are the oldest: B's round copies them out (B's own blocks came from the free list).
    copies = {c.src: c.dst for c in plan.swap_out}
    assert sorted(copies) == sorted(core.pool.cached_block_ids()) and len(copies) == 3
    assert not set(copies) & set(plan.seqs[0].block_table), "nothing the round's forward writes is copied"
    result = RoundResult(plan.round_id, (), error="copy failed") if fail else FakeExecutor().run(plan)
    events += core.on_round_result(result, now + 0.5).kv_events
    check_invariants(core)
    more, _ = _until_done(core, now + 1.0)
    return events + more, copies


def _evict_with_c(core: SchedulerCore, now: float) -> list[KvEvent]:
    core.submit(make_request("C", prompt=PROMPT_C, max_tokens=1), now)
    events, _ = _until_done(core, now)
    return events


def test_cold_blocks_are_copied_out_and_reported_on_cpu_once_their_round_answers() -> None:
    core = _core()
    events, copies = _a_then_b(core)
    cpu = [(e.kind, e.block_hashes) for e in events if e.medium is KvMedium.CPU]
    assert len(cpu) == 1 and cpu[0][0] is KvEventKind.STORED and sorted(cpu[0][1]) == sorted(CHAIN_A)
    assert sorted(core.host.lookup(CHAIN_A)) == sorted(copies.values()), "each copy is findable by its hash"
    assert not any(e.kind is KvEventKind.REMOVED for e in events), "nothing was evicted: A is still on the device"
    evicted = _evict_with_c(core, 20.0)
    removed = [e.block_hashes[0] for e in evicted if e.kind is KvEventKind.REMOVED and e.medium is KvMedium.GPU]
    assert set(CHAIN_A) <= set(removed), "C evicted A's blocks from the device ..."
    assert core.host.lookup(CHAIN_A) and not any(e.medium is KvMedium.CPU for e in evicted), "... not from the host"
    assert core.stats().host_blocks_cached >= 3 and core.host.paged_out >= 3


def test_a_prefix_found_on_the_host_is_swapped_in_and_not_computed() -> None:
    core = _core()
    _a_then_b(core)
    _evict_with_c(core, 20.0)
    assert not core.pool.lookup(CHAIN_A)
    on_host = core.host.lookup(CHAIN_A)
    core.submit(make_request("D", prompt=PROMPT_A, max_tokens=1), 40.0)
    load = core.schedule(40.0)
    assert not load.seqs and [c.src for c in load.swap_in] == on_host[:2], "D's round copies its hits in, only"
    events = core.on_round_result(FakeExecutor().run(load), 40.5)
    check_invariants(core)
    assert core.host.tier_ids()[2] == {}, "the host copies are let go when the copying round answers"
    (scheduled,) = [e for e in events.lifecycle if e.stage is Stage.FIRST_SCHEDULED]
    assert dict(scheduled.detail) == {"cached_tokens": 8, "host_cached_tokens": 8}
    assert core.stats().host_hit_tokens == 8
    plan = core.schedule(41.0)
    (seq,) = plan.seqs
    assert seq.start_position == 8 and seq.token_ids == PROMPT_A[8:], "then D computes only what the host lacked"
    assert [c.dst for c in load.swap_in] == list(seq.block_table[:2])
    events = core.on_round_result(FakeExecutor().run(plan), 41.5)
    check_invariants(core)
    stored = [e.block_hashes[0] for e in events.kv_events if e.kind is KvEventKind.STORED and e.medium is KvMedium.GPU]
    assert stored == CHAIN_A, "the copied-in blocks are registered on the device with the rest of the prompt"


def test_a_copy_round_that_fails_leaves_nothing_findable_and_reports_nothing() -> None:
    core = _core()
    events, _ = _a_then_b(core, fail=True)
    assert all(e.medium is KvMedium.GPU for e in events)
    assert core.host.lookup(CHAIN_A) == [] and core.stats().host_blocks_cached == 0
    _evict_with_c(core, 20.0)
    core.submit(make_request("D", prompt=PROMPT_A, max_tokens=1), 40.0)
    plan = core.schedule(40.0)
    assert not plan.swap_in and plan.seqs[0].start_position == 0, "a failed copy is never read back"


def test_a_worker_that_restarts_takes_the_host_tier_with_it() -> None:
    core = _core()
    _a_then_b(core)
    core.on_worker_restarted(30.0)
    check_invariants(core)
    assert core.stats().host_blocks_cached == 0
    core.submit(make_request("D", prompt=PROMPT_A, max_tokens=1), 40.0)
    assert not core.schedule(40.0).swap_in


def test_swap_outs_evict_prefix_copies_for_room() -> None:
    """A preempted request's swap copy outranks a prefix copy: the tier's oldest copies make way (REMOVED on CPU)."""
    from scheduler_svc.core.block_pool import BlockPool
    pool = BlockPool(4)
    host = HostBlocks(3, pool, prefix_cache=True)
    targets = [host.page_out(h) for h in (11, 12, 13)]
    assert targets == [0, 1, 2] and host.page_out(14) is None, "nothing to evict while copies are pending"
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
    assert host.page_out(11) is None, "a hash the tier holds is not copied again"


def test_the_tier_needs_host_blocks_and_the_prefix_cache() -> None:
    with pytest.raises(ValueError, match="num_host_blocks >= 1"):
        make_core(host_prefix_cache=True)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        make_core(host_prefix_cache=True, num_host_blocks=4, enable_prefix_caching=False)


def test_many_requests_sharing_prefixes_keep_every_ledger_whole() -> None:
    """Two prompt families and a filler that evicts them, through a pool smaller than their prompts, with a host
    tier smaller than both families: copies out, host hits, swap-ins and host evictions all happen, and every
    ledger checks out after each round."""
    core = make_core(num_blocks=7, block_size=4, num_host_blocks=6, host_prefix_cache=True, host_page_out_blocks=4)
    families = [tuple(range(100, 116)), tuple(range(500, 516)), tuple(range(700, 716))]
    filler = tuple(range(900, 920))
    now, submitted = 0.0, 0
    for index in range(30):
        prompt = filler if index % 2 else families[(index // 2) % 3] + (index,)
        core.submit(make_request(f"r{index}", prompt=prompt, max_tokens=2), now)
        submitted += 1
        for _ in range(3):
            step(core, now, FakeExecutor())
            check_invariants(core)
            now += 1.0
    while core.has_unfinished():
        step(core, now, FakeExecutor())
        check_invariants(core)
        now += 1.0
    assert core.host.paged_out > 0 and core.host.hits > 0 and core.host.evicted > 0, (
        core.host.paged_out, core.host.hits, core.host.evicted)
    assert core.stats().finished == submitted


def test_big_hits_are_copied_in_over_rounds_of_host_load_blocks_and_computed_after() -> None:
    """With host_load_blocks 2, no round copies more than 2 blocks in; a request computes only once all its hits
    are in and their rounds answered, never in a round that copies into its own blocks; and every request gets
    its tokens."""
    core = make_core(num_blocks=12, block_size=4, num_host_blocks=16, host_prefix_cache=True,
                     max_num_batched_tokens=16, max_prefill_chunk=16, host_load_blocks=2, host_page_out_blocks=8)
    shared = tuple(range(100, 124))  # 6 blocks
    now, finished, loads = 0.0, [], []
    for index, prompt in enumerate([shared + (1,), tuple(range(300, 340)), shared + (2,), tuple(range(400, 440)),
                                    shared + (3,)]):
        core.submit(make_request(f"r{index}", prompt=prompt, max_tokens=2), now)
        while core.has_unfinished():
            plan = core.schedule(now)
            assert not plan.is_empty
            assert len(plan.swap_in) <= 2
            loads.append(len(plan.swap_in))
            read = {block for seq in plan.seqs for block in seq.block_table}
            assert not read & {copy.dst for copy in plan.swap_in}, "a sequence reads a block copied in beside it"
            finished += core.on_round_result(FakeExecutor().run(plan), now).finished
            check_invariants(core)
            now += 1.0
    assert core.host.paged_out and core.stats().host_hit_tokens >= 20, "the shared prompt came back from the host"
    assert all(record.status.value.startswith("finished") for record in finished)
    assert "2,2,1" in ",".join(map(str, loads)), f"a 5-block hit was copied in over 3 rounds: {loads}"
