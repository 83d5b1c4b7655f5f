"""Overlap scheduling (round N+1 planned while N executes): placing ahead, the stop it cannot foresee, pins."""

from __future__ import annotations

from core_factories import FakeExecutor, check_invariants, make_core, make_request

from scheduler_svc.core import SchedulerCore
from sluice.types import PENDING_TOKEN, CoreEvents, RequestStatus, RoundPlan, RoundResult, SeqOutput, Stage

EOS = 7


def test_a_decode_is_placed_ahead_and_its_token_counted_once() -> None:
    """A request sampled by the in-flight round is placed ahead at the next position, and both tokens go out in order."""
    core, worker = make_core(), FakeExecutor()
    core.submit(make_request("a", prompt_len=5, max_tokens=4), 0.0)
    first = core.schedule(0.0, overlap=True)
    ahead = core.schedule(0.0, overlap=True)
    (seq,) = ahead.seqs
    assert seq.token_ids == (PENDING_TOKEN,) and seq.start_position == 5 and seq.output_index == 1
    assert core.schedule(0.0, overlap=True).is_empty, "at most two rounds read a request"
    assert core.schedule(0.0).is_empty, "without overlap an in-flight request is skipped"
    tokens = core.on_round_result(worker.run(first), 0.1).tokens
    tokens += core.on_round_result(worker.run(ahead), 0.2).tokens
    assert [index for _, index, _ in tokens] == [0, 1]
    check_invariants(core)


def test_no_placement_ahead_for_the_last_token_or_stop_strings() -> None:
    """The token that ends a request by length, and a request with stop strings, are never placed ahead."""
    core = make_core()
    core.submit(make_request("a", prompt_len=5, max_tokens=1), 0.0)
    core.submit(make_request("b", prompt_len=5, max_tokens=9, stop_strings=("x",)), 0.0)
    core.schedule(0.0, overlap=True)
    assert core.schedule(0.0, overlap=True).is_empty


def test_a_stop_drops_the_slot_ahead_and_holds_its_blocks_until_it_answers() -> None:
    """A stop token in round N ends the request at once; round N+1's output for it is dropped and counted, its blocks
    stay pinned until then, and it is never resurrected."""
    core = make_core(num_blocks=4, block_size=4)
    core.submit(make_request("a", prompt_len=4, max_tokens=8, eos_token_id=EOS), 0.0)
    first = core.schedule(0.0, overlap=True)
    ahead = core.schedule(0.0, overlap=True)
    events = core.on_round_result(RoundResult(first.round_id, (SeqOutput("a", 0, (EOS,)),)), 0.1)
    assert [f.status for f in events.finished] == [RequestStatus.FINISHED_STOP]
    assert core.stats().kv_blocks_used == 2, "blocks read by the round ahead stay pinned"
    check_invariants(core)
    events = core.on_round_result(RoundResult(ahead.round_id, (SeqOutput("a", 0, (11,)),)), 0.2)
    assert events.dropped_results == 1 and not events.tokens and not events.finished
    assert core.stats().kv_blocks_used == 0
    check_invariants(core)


def test_losing_a_round_loses_the_one_ahead_and_recomputes_once() -> None:
    """A lost round takes the later in-flight round with it; the request is re-queued once, counted as lost once."""
    core = make_core()
    core.submit(make_request("a", prompt_len=5, max_tokens=4), 0.0)
    first = core.schedule(0.0, overlap=True)
    core.schedule(0.0, overlap=True)
    events = core.on_round_lost(first.round_id, 0.1)
    assert not core.outcomes.in_flight
    assert [e.stage for e in events.lifecycle].count(Stage.PREEMPTED) == 1
    assert core.request_status("a") is RequestStatus.WAITING and core.stats().kv_blocks_used == 0
    check_invariants(core)


def test_a_cancel_between_two_rounds_waits_for_the_later_one() -> None:
    """A request cancelled while two rounds read it stays CANCELLING until the later round answers."""
    core, worker = make_core(), FakeExecutor()
    core.submit(make_request("a", prompt_len=5, max_tokens=4), 0.0)
    first = core.schedule(0.0, overlap=True)
    ahead = core.schedule(0.0, overlap=True)
    assert core.cancel("a", 0.05) is RequestStatus.CANCELLING
    core.on_round_result(worker.run(first), 0.1)
    assert core.request_status("a") is RequestStatus.CANCELLING and core.stats().kv_blocks_used > 0
    core.on_round_result(worker.run(ahead), 0.2)
    assert core.request_status("a") is RequestStatus.CANCELLED and core.stats().kv_blocks_used == 0
    check_invariants(core)


def _first_token_round(core: SchedulerCore, pipelined: bool) -> tuple[int, list[RoundPlan], CoreEvents]:
    """Run `core` to quiescence, serially or pipelined (round N+1 planned while N is in flight, in-order
    answers); return (the round that sampled "p"'s first token, the plans run, every event in order)."""
    worker, plans, seen = FakeExecutor(), [], CoreEvents()
    in_flight = [core.schedule(0.0, overlap=pipelined)]
    first = 0
    while in_flight:
        if pipelined:
            in_flight.append(core.schedule(0.0, overlap=True))
        plan = in_flight.pop(0)
        plans.append(plan)
        events = core.on_round_result(worker.run(plan), 0.0)
        seen.tokens += events.tokens
        seen.kv_events += events.kv_events
        seen.lifecycle += [e for e in events.lifecycle if e.stage is Stage.PREFILL_CHUNK]
        first = first or next((len(plans) for rid, index, _ in events.tokens if (rid, index) == ("p", 0)), 0)
        if not pipelined:
            in_flight.append(core.schedule(0.0))
        in_flight = [p for p in in_flight if not p.is_empty]
    return first, plans, seen


def test_a_long_prompt_advances_one_chunk_every_round_when_pipelined() -> None:
    """A 4-chunk prompt beside a decoding request gets its next chunk placed ahead (real tokens) and its first token
    from the 4th round, as on the serial loop (not the 7th); tokens, chunks and KV events match the serial loop's."""
    runs = {}
    for pipelined in (False, True):
        core = make_core(num_blocks=32, block_size=4, max_prefill_chunk=8, enable_prefix_caching=True)
        core.submit(make_request("d", prompt_len=4, max_tokens=12), 0.0)
        core.submit(make_request("p", prompt_len=32, max_tokens=3), 0.0)
        runs[pipelined] = _first_token_round(core, pipelined)
        check_invariants(core)
        assert core.stats().kv_blocks_used == 0
    (serial_first, serial_plans, serial), (first, plans, seen) = runs[False], runs[True]
    assert serial_first == first == 4, "one chunk a round, pipelined as serially"
    assert len(plans) == len(serial_plans) == 12, "d's 12 tokens take 12 rounds either way"
    prompt = make_request("p", prompt_len=32).prompt_token_ids
    chunks = [s for plan in plans[:4] for s in plan.seqs if s.request_id == "p"]
    assert [(s.start_position, s.token_ids, s.sample) for s in chunks] == [
        (i * 8, prompt[i * 8 : i * 8 + 8], i == 3) for i in range(4)
    ], "each chunk carries its real tokens; only the last samples"
    assert seen.tokens == serial.tokens
    assert seen.kv_events == serial.kv_events and seen.kv_events, "the same blocks stored, in the same order"
    assert [e.detail for e in seen.lifecycle] == [e.detail for e in serial.lifecycle]


def test_a_chunk_ahead_takes_only_free_blocks() -> None:
    """A chunk placed ahead takes free blocks only: when none are left for the next one, that request waits a
    round and nobody is preempted."""
    core = make_core(num_blocks=6, block_size=4, max_prefill_chunk=8)
    core.submit(make_request("p1", prompt_len=16, max_tokens=2), 0.0)
    core.submit(make_request("p2", prompt_len=16, max_tokens=2), 0.0)
    first = core.schedule(0.0, overlap=True)
    assert [(s.request_id, s.start_position) for s in first.seqs] == [("p1", 0), ("p2", 0)]
    ahead = core.schedule(0.0, overlap=True)
    assert [(s.request_id, s.start_position, s.sample) for s in ahead.seqs] == [("p1", 8, True)]
    assert core.stats().kv_blocks_free == 0 and core.num_running == 2
    assert Stage.PREEMPTED not in [e.stage for e in core.take_events().lifecycle]
    check_invariants(core)


def test_cancel_with_two_chunks_in_flight_releases_after_the_later_one() -> None:
    """A request cancelled while two of its chunks are in flight stays CANCELLING (blocks referenced) until the
    later round answers, then releases every block once; no token goes out."""
    core, worker = make_core(block_size=4, max_prefill_chunk=4), FakeExecutor()
    core.submit(make_request("p", prompt_len=16, max_tokens=2), 0.0)
    first = core.schedule(0.0, overlap=True)
    ahead = core.schedule(0.0, overlap=True)
    assert [s.start_position for s in ahead.seqs] == [4]
    assert core.cancel("p", 0.0) is RequestStatus.CANCELLING
    events = core.on_round_result(worker.run(first), 0.1)
    assert core.request_status("p") is RequestStatus.CANCELLING and core.stats().kv_blocks_used == 2
    check_invariants(core)
    events = core.on_round_result(worker.run(ahead), 0.2)
    assert core.request_status("p") is RequestStatus.CANCELLED and core.stats().kv_blocks_used == 0
    assert not events.tokens and [f.status for f in events.finished] == [RequestStatus.CANCELLED]
    check_invariants(core)


def test_a_failed_round_with_a_chunk_ahead_holds_its_blocks_until_the_later_round() -> None:
    """A round that fails ends the request at once; the blocks its chunk ahead reads stay pinned until that round answers."""
    core, worker = make_core(block_size=4, max_prefill_chunk=4), FakeExecutor()
    core.submit(make_request("p", prompt_len=16, max_tokens=2), 0.0)
    first = core.schedule(0.0, overlap=True)
    ahead = core.schedule(0.0, overlap=True)
    events = core.on_round_result(RoundResult(first.round_id, (), error="boom"), 0.1)
    assert [f.status for f in events.finished] == [RequestStatus.FAILED]
    assert core.stats().kv_blocks_used == 2 and core.pool.pin_count(ahead.seqs[0].block_table[1]) == 1
    check_invariants(core)
    core.on_round_result(worker.run(ahead), 0.2)
    assert core.stats().kv_blocks_used == 0
    check_invariants(core)
