"""Overlap scheduling (round N+1 planned while N executes): placing ahead, the stop it cannot foresee, pins."""

from __future__ import annotations

from core_factories import FakeExecutor, check_invariants, make_core, make_request

from sluice.types import PENDING_TOKEN, RequestStatus, RoundResult, SeqOutput, Stage

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
