"""KV events in vLLM's shape: token ids when asked for, block size, LoRA name and id, medium GPU/CPU for swap
copies, one gap-free id sequence per replica, a lossless wire round trip, and a router that keeps CPU blocks apart.

Swap scenario (block size 4, 7 blocks, 3 host blocks; see test_core_preemption.py): B is swapped out in
round 5 and swapped back in round 10.
"""

from __future__ import annotations

import pytest
from core_factories import FakeExecutor, check_invariants, make_core, make_request, step

from router_svc.prefix_index import PrefixIndex, ReplicaCache
from scheduler_svc.core import SchedulerCore
from scheduler_svc.core.config import PreemptionMode
from sluice import convert
from sluice.hashing import hash_chain, salt_of
from sluice.types import KvEvent, KvEventKind, KvMedium, RoundResult
from sluice.v1 import events_pb2


def _all_events(core: SchedulerCore, rounds: int) -> list[KvEvent]:
    executor, events = FakeExecutor(), []
    for now in range(rounds):
        _, out = step(core, float(now), executor)
        events += out.kv_events
        check_invariants(core)
    return events


def _swap_run() -> list[KvEvent]:
    core = make_core(num_blocks=7, block_size=4, preemption_mode=PreemptionMode.SWAP, num_host_blocks=3)
    core.submit(make_request("A", 8, max_tokens=10, arrival=0.0), 0.0)
    core.submit(make_request("B", 8, max_tokens=10, arrival=0.5), 0.0)
    return _all_events(core, 16)


def test_stored_events_carry_no_token_ids_by_default() -> None:
    """Without kv_event_token_ids a STORED event names hashes only (no per-block token cost)."""
    core = make_core(block_size=4)
    core.submit(make_request("a", 12, max_tokens=1), 0.0)
    stored = [e for e in _all_events(core, 2) if e.kind is KvEventKind.STORED]
    assert len(stored) == 3 and all(e.token_ids == () for e in stored)


def test_stored_events_carry_each_blocks_tokens_when_asked() -> None:
    """With kv_event_token_ids each STORED event carries its block's block_size tokens, and its hash is the
    chain hash of exactly those tokens after its parent."""
    core = make_core(block_size=4, kv_event_token_ids=True)
    request = make_request("a", 12, max_tokens=1)
    core.submit(request, 0.0)
    stored = [e for e in _all_events(core, 2) if e.kind is KvEventKind.STORED]
    prompt = list(request.prompt_token_ids)
    assert [e.token_ids for e in stored] == [tuple(prompt[i : i + 4]) for i in (0, 4, 8)]
    chain = hash_chain(prompt, 4, salt_of("tiny"))
    assert [e.block_hashes for e in stored] == [(h,) for h in chain]
    assert [e.parent_hash for e in stored] == [0, chain[0], chain[1]]


def test_wire_batch_has_vllm_fields_and_round_trips() -> None:
    """The protobuf batch has ts, block_size, medium, lora_name and a stable lora_id, an absent parent for a
    first block, and converts back to the same core events."""
    events = [
        KvEvent(1, KvEventKind.STORED, (11,), 0, (1, 2, 3, 4)),
        KvEvent(2, KvEventKind.STORED, (12,), 11, (5, 6, 7, 8)),
        KvEvent(3, KvEventKind.STORED, (12,), 11, (), KvMedium.CPU),
        KvEvent(4, KvEventKind.REMOVED, (12,), medium=KvMedium.CPU),
        KvEvent(5, KvEventKind.REMOVED, (11,)),
        KvEvent(6, KvEventKind.ALL_CLEARED),
    ]
    batch = convert.kv_batch_to_proto("r1", events, block_size=4, lora_name="sql-v2", ts=1700000000.5)
    wire = events_pb2.KvEventBatch.FromString(batch.SerializeToString())
    assert wire.ts == 1700000000.5 and not wire.HasField("data_parallel_rank")
    first, second = wire.events[0].block_stored, wire.events[1].block_stored
    assert not first.HasField("parent_block_hash") and second.parent_block_hash == 11
    assert (first.block_size, first.medium, first.lora_name, list(first.token_ids)) == (4, "GPU", "sql-v2", [1, 2, 3, 4])
    assert first.lora_id == convert.lora_id_of("sql-v2") == second.lora_id and 0 < first.lora_id < 2**63
    assert wire.events[3].block_removed.medium == "CPU"
    assert [e.WhichOneof("kind") for e in wire.events] == [
        "block_stored", "block_stored", "block_stored", "block_removed", "block_removed", "all_blocks_cleared"]
    assert convert.kv_events_from_proto(wire) == events
    no_adapter = convert.kv_batch_to_proto("r1", events[:1], block_size=4).events[0].block_stored
    assert not no_adapter.HasField("lora_id") and no_adapter.lora_name == ""


def test_unknown_medium_is_refused_with_its_name() -> None:
    """An event on a medium Sluice does not know is a ValueError naming it, not a silent GPU block."""
    batch = events_pb2.KvEventBatch(replica_id="r9")
    batch.events.add(event_id=1).block_removed.medium = "DISK"
    with pytest.raises(ValueError, match="'DISK'"):
        convert.kv_events_from_proto(batch)


def test_swap_out_copies_are_stored_and_removed_on_cpu_in_one_id_sequence() -> None:
    """B's registered blocks are STORED on CPU once the swap-out round answers and REMOVED on CPU once the
    swap-in round answers; GPU and CPU events share one gap-free id sequence."""
    events = _swap_run()
    assert [e.event_id for e in events] == list(range(1, len(events) + 1))
    cpu = [(e.kind, e.block_hashes) for e in events if e.medium is KvMedium.CPU]
    assert len(cpu) == 2
    (stored_kind, stored), (removed_kind, removed) = cpu
    assert (stored_kind, removed_kind) == (KvEventKind.STORED, KvEventKind.REMOVED)
    b_chain = hash_chain(list(make_request("B", 8, max_tokens=10).prompt_token_ids), 4, salt_of("tiny"))
    assert stored == removed and stored[:2] == tuple(b_chain), "B's prompt blocks are the first copies"


def test_failed_swap_out_reports_no_cpu_copy() -> None:
    """A swap-out whose round fails never held trustworthy copies: no CPU event at all."""
    core = make_core(num_blocks=7, block_size=4, preemption_mode=PreemptionMode.SWAP, num_host_blocks=3)
    core.submit(make_request("A", 8, max_tokens=10), 0.0)
    core.submit(make_request("B", 8, max_tokens=10, arrival=0.5), 0.0)
    events = _all_events(core, 5)
    plan = core.schedule(5.0)
    assert plan.swap_out
    events += core.on_round_result(RoundResult(plan.round_id, (), error="copy failed"), 6.0).kv_events
    events += _all_events(core, 20)
    assert all(e.medium is KvMedium.GPU for e in events)
    assert [e.event_id for e in events] == list(range(1, len(events) + 1))


def test_router_index_keeps_cpu_blocks_apart_and_counts_them_as_held() -> None:
    """The router's prefix index advances its event id over CPU events (no false gap) and keeps host copies in a
    set of their own: a GPU REMOVED (an eviction to the host tier) leaves the host copy counted, a CPU REMOVED
    takes it away, and a prefix that runs from the device into the host is held whole."""
    index, cache = PrefixIndex(ttl_s=1.0), ReplicaCache("r1")
    assert index.apply_events(cache, [KvEvent(1, KvEventKind.STORED, (7,)),
                                      KvEvent(2, KvEventKind.STORED, (8,), 7, (), KvMedium.CPU),
                                      KvEvent(3, KvEventKind.STORED, (9,), 8, (), KvMedium.CPU)])
    assert cache.last_event_id == 3 and (cache.hashes, cache.host) == ({7}, {8, 9})
    assert index.cached(cache, [7, 8, 9, 10], now=0.0) == 3
    assert index.apply_events(cache, [KvEvent(4, KvEventKind.REMOVED, (9,), medium=KvMedium.CPU),
                                      KvEvent(5, KvEventKind.STORED, (9,), 8, (), KvMedium.CPU),
                                      KvEvent(6, KvEventKind.REMOVED, (7,))])
    assert (cache.hashes, cache.host) == (set(), {8, 9})
    assert index.cached(cache, [7, 8], now=0.0) == 0, "a chain is held from its first block"
    assert index.cached(cache, [8, 9], now=0.0) == 2
    index.apply_snapshot(cache, 9, [7], host_hashes=[8])
    assert (cache.hashes, cache.host, cache.last_event_id) == ({7}, {8}, 9)
    assert index.apply_events(cache, [KvEvent(10, KvEventKind.ALL_CLEARED, ())]) and cache.host == set()


def test_index_holders_are_the_replicas_sets() -> None:
    """Two replicas sharing hashes: the holders, the distinct count and each replica's lookup follow their STORED,
    REMOVED, ALL_CLEARED events and snapshots (the index keeps no map of its own beside the replicas' sets)."""
    index, a, b = PrefixIndex(ttl_s=0.0), ReplicaCache("a"), ReplicaCache("b")
    assert index.apply_events(a, [KvEvent(1, KvEventKind.STORED, (1, 2, 3)), KvEvent(2, KvEventKind.STORED, (4,))])
    assert index.apply_events(b, [KvEvent(1, KvEventKind.STORED, (1, 2))])
    assert index.holders() == {1: ["a", "b"], 2: ["a", "b"], 3: ["a"], 4: ["a"]} and len(index) == 4
    assert (index.cached(a, (1, 2, 3, 4), 0.0), index.cached(b, (1, 2, 3, 4), 0.0)) == (4, 2)
    assert index.apply_events(a, [KvEvent(3, KvEventKind.REMOVED, (3, 4))])
    assert index.holders() == {1: ["a", "b"], 2: ["a", "b"]} and len(index) == 2
    assert index.cached(a, (1, 2, 3, 4), 0.0) == 2
    assert index.apply_events(b, [KvEvent(2, KvEventKind.ALL_CLEARED), KvEvent(3, KvEventKind.STORED, (9,))])
    assert index.holders() == {1: ["a"], 2: ["a"], 9: ["b"]} and index.cached(b, (1, 2), 0.0) == 0
    index.apply_snapshot(a, 7, [5, 6])
    assert index.holders() == {5: ["a"], 6: ["a"], 9: ["b"]} and len(index) == 3 and a.last_event_id == 7
    index.purge(b)
    assert index.holders() == {5: ["a"], 6: ["a"]} and index.cached(b, (9,), 0.0) == 0
