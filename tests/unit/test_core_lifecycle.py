"""Request lifecycles through SchedulerCore: rejections, cancel, late and stale results, timeouts, finishes."""

from __future__ import annotations

import pytest
from core_factories import FakeExecutor, check_invariants, make_core, make_request, step, token_for

from sluice.core_errors import RequestRejected
from sluice.hashing import hash_chain, salt_of
from sluice.types import RejectReason, RequestStatus, RoundResult, SeqOutput, Stage

# ---- rejections --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_kwargs", "reason", "numbers"),
    [
        ({"prompt_len": 60, "max_tokens": 10}, RejectReason.NEVER_FITS, "needs 5 blocks of 16 tokens, the replica has 4"),
        ({"prompt_len": 100, "max_tokens": 30}, RejectReason.INVALID, "= 130 > max_model_len 128"),
        ({"prompt_len": 0}, RejectReason.INVALID, "empty prompt"),
        ({"max_tokens": 0}, RejectReason.INVALID, "max_tokens must be >= 1"),
    ],
)
def test_rejected_submission_changes_nothing(request_kwargs: dict, reason: RejectReason, numbers: str) -> None:
    """A refused submission raises RequestRejected with the reason and numbers, and leaves the core as it was."""
    core = make_core(num_blocks=4, max_model_len=128)
    with pytest.raises(RequestRejected) as info:
        core.submit(make_request("x", **request_kwargs), 0.0)
    assert info.value.reason is reason and numbers in info.value.detail
    assert core.num_waiting == 0 and not core.has_unfinished()
    assert core.take_events().lifecycle == [] and core.request_status("x") is None


def test_token_ids_outside_64_bits_are_invalid() -> None:
    """A prompt with a token id that is not a 64-bit integer is refused as INVALID and changes nothing."""
    core = make_core()
    with pytest.raises(RequestRejected) as info:
        core.submit(make_request("x", prompt=(1, 2**70)), 0.0)
    assert info.value.reason is RejectReason.INVALID and "64-bit" in info.value.detail
    assert not core.has_unfinished() and core.take_events().lifecycle == []
    core.submit(make_request("x"), 0.0)


def test_queue_full_and_duplicate_are_rejected() -> None:
    """A full waiting queue gives QUEUE_FULL and a live id gives DUPLICATE; the queue is unchanged."""
    core = make_core(max_waiting=2)
    core.submit(make_request("a"), 0.0)
    core.submit(make_request("b"), 0.0)
    with pytest.raises(RequestRejected) as full:
        core.submit(make_request("c"), 0.0)
    with pytest.raises(RequestRejected) as dup:
        core.submit(make_request("a"), 0.0)
    assert (full.value.reason, dup.value.reason) == (RejectReason.QUEUE_FULL, RejectReason.DUPLICATE)
    assert core.num_waiting == 2 and core.stats().queued_prefill_tokens == 16


def test_kv_read_cap_rejects_requests_that_could_never_decode() -> None:
    """With max_kv_read_tokens, a request whose context could exceed the cap is refused as NEVER_FITS."""
    core = make_core(max_kv_read_tokens=64)
    with pytest.raises(RequestRejected) as info:
        core.submit(make_request("x", 60, max_tokens=10), 0.0)
    assert info.value.reason is RejectReason.NEVER_FITS and "max_kv_read_tokens 64" in info.value.detail


# ---- cancel ------------------------------------------------------------------------------


def test_cancel_waiting_is_immediate_and_idempotent() -> None:
    """Cancelling a waiting request ends it at once with one Finished record; again returns CANCELLED."""
    core = make_core()
    core.submit(make_request("a"), 0.0)
    assert core.cancel("a", 1.0) is RequestStatus.CANCELLED
    assert core.cancel("a", 2.0) is RequestStatus.CANCELLED
    assert core.cancel("nope", 2.0) is None
    events = core.take_events()
    assert [(f.request_id, f.finish_reason) for f in events.finished] == [("a", "cancelled")]
    assert core.num_waiting == 0 and core.stats().cancelled == 1 and core.stats().queued_prefill_tokens == 0
    assert core.schedule(3.0).is_empty


def test_cancel_running_between_rounds_releases_at_once() -> None:
    """A running request that no round reads is released by cancel itself."""
    core = make_core()
    core.submit(make_request("a", 20), 0.0)
    step(core, 0.0)
    assert core.stats().kv_blocks_used == 2
    assert core.cancel("a", 1.0) is RequestStatus.CANCELLED
    assert core.stats().kv_blocks_used == 0
    stages = [e.stage for e in core.take_events().lifecycle]
    assert stages[-3:] == [Stage.CANCEL_REQUESTED, Stage.FINISHED, Stage.KV_RELEASED]


def test_late_result_after_cancel_is_dropped_and_never_resurrects() -> None:
    """The in-flight round's token for a cancelled request is dropped and counted; the request stays cancelled."""
    core, executor = make_core(), FakeExecutor()
    core.submit(make_request("a", 4, max_tokens=8), 0.0)
    plan = core.schedule(0.0)
    assert core.cancel("a", 0.5) is RequestStatus.CANCELLING
    assert core.cancel("a", 0.6) is RequestStatus.CANCELLING
    events = core.on_round_result(executor.run(plan), 1.0)
    assert events.tokens == [] and events.dropped_results == 1
    assert [f.status for f in events.finished] == [RequestStatus.CANCELLED]
    again = core.on_round_result(executor.run(plan), 2.0)
    assert again.dropped_results == 1 and again.finished == [], "a repeated result is unknown and dropped"
    assert core.request_status("a") is RequestStatus.CANCELLED and core.stats().dropped_results == 2
    check_invariants(core)


@pytest.mark.parametrize("stale_first", [True, False])
def test_stale_epoch_output_is_dropped(stale_first: bool) -> None:
    """An extra output with an older epoch than the request's is dropped and counted; the current one is used."""
    core = make_core()
    core.submit(make_request("a", 4, max_tokens=8), 0.0)
    core.requests.live["a"].epoch = 2  # as after two preemptions
    plan = core.schedule(0.0)
    stale, fresh = SeqOutput("a", 1, (7,)), SeqOutput("a", 2, (token_for("a", 0),))
    outputs = (stale, fresh) if stale_first else (fresh, stale)
    events = core.on_round_result(RoundResult(plan.round_id, outputs), 1.0)
    assert events.tokens == [("a", 0, token_for("a", 0))] and events.dropped_results == 1


def test_missing_token_fails_the_request_exactly_once() -> None:
    """A sampled sequence with no (current) output fails its request with a detail, once."""
    core = make_core()
    core.submit(make_request("a", 4, max_tokens=8), 0.0)
    plan = core.schedule(0.0)
    events = core.on_round_result(RoundResult(plan.round_id, (SeqOutput("a", 5, (1,)),)), 1.0)
    (finished,) = events.finished
    assert finished.status is RequestStatus.FAILED and "no token" in finished.detail
    assert events.dropped_results == 1 and core.stats().kv_blocks_used == 0


def test_round_error_fails_every_request_in_it_and_releases_blocks() -> None:
    """A result with an error fails each request of the round once and returns their blocks."""
    core = make_core()
    core.submit(make_request("a", 20), 0.0)
    core.submit(make_request("b", 20), 0.0)
    plan = core.schedule(0.0)
    core.cancel("b", 0.1)
    events = core.on_round_result(RoundResult(plan.round_id, (), error="CUDA error: device lost"), 1.0)
    statuses = {f.request_id: (f.status, f.detail) for f in events.finished}
    assert statuses["a"][0] is RequestStatus.FAILED and "device lost" in statuses["a"][1]
    assert statuses["b"][0] is RequestStatus.CANCELLED, "a cancel that came first still wins"
    assert core.stats().kv_blocks_used == 0 and not core.has_unfinished()


# ---- scheduling while a round is in flight ---------------------------------------------


def test_schedule_skips_requests_of_an_in_flight_round() -> None:
    """A second schedule() while a round is in flight plans only requests that are not in it."""
    core = make_core()
    core.submit(make_request("a"), 0.0)
    first = core.schedule(0.0)
    core.submit(make_request("b"), 0.0)
    second = core.schedule(0.0)
    assert [s.request_id for s in first.seqs] == ["a"] and [s.request_id for s in second.seqs] == ["b"]
    assert core.schedule(0.0).is_empty


# ---- timeouts ----------------------------------------------------------------------------


def test_queue_deadline_times_out_only_unscheduled_requests() -> None:
    """A request not first scheduled by its queue deadline is TIMED_OUT; one already scheduled is not."""
    core = make_core(max_num_seqs=1)
    core.submit(make_request("a", queue_deadline=5.0), 0.0)
    core.submit(make_request("b", queue_deadline=5.0), 0.0)
    step(core, 0.0)
    assert core.next_deadline() == 5.0
    assert core.expire(4.9) == []
    assert core.expire(5.0) == ["b"]
    finished = core.take_events().finished
    assert [(f.request_id, f.status, f.finish_reason) for f in finished] == [("b", RequestStatus.TIMED_OUT, "timeout")]
    assert core.next_deadline() is None and core.request_status("a") is RequestStatus.RUNNING


def test_total_deadline_in_flight_behaves_like_cancel() -> None:
    """A request past its deadline during an in-flight round is CANCELLING, then TIMED_OUT with its blocks back."""
    core, executor = make_core(), FakeExecutor()
    core.submit(make_request("a", 20, max_tokens=50, deadline=2.0), 0.0)
    core.submit(make_request("b", 20, max_tokens=50, deadline=3.0), 0.0)
    step(core, 0.0, executor)
    plan = core.schedule(1.0)
    assert core.expire(2.5) == ["a"] and core.request_status("a") is RequestStatus.CANCELLING
    assert core.stats().kv_blocks_used == 4
    events = core.on_round_result(executor.run(plan), 2.6)
    assert [(f.request_id, f.status) for f in events.finished] == [("a", RequestStatus.TIMED_OUT)]
    assert core.stats().kv_blocks_used == 2
    assert core.expire(3.0) == ["b"] and core.stats().kv_blocks_used == 0 and core.stats().timed_out == 2


# ---- finishing ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "stop_at", "status"),
    [
        ({"eos_token_id": token_for("x", 2)}, 2, RequestStatus.FINISHED_STOP),
        ({"eos_token_id": token_for("x", 2), "ignore_eos": True}, 9, RequestStatus.FINISHED_LENGTH),
        ({"stop_token_ids": (token_for("x", 4),)}, 4, RequestStatus.FINISHED_STOP),
        ({}, 9, RequestStatus.FINISHED_LENGTH),
    ],
)
def test_finish_conditions(fields: dict, stop_at: int, status: RequestStatus) -> None:
    """EOS (unless ignored) and stop tokens finish with STOP including the token; max_tokens with LENGTH."""
    core = make_core()
    core.submit(make_request("x", 4, max_tokens=10, **fields), 0.0)
    tokens, finished = [], []
    for now in range(12):
        _, events = step(core, float(now))
        tokens += events.tokens
        finished += events.finished
    assert [index for _, index, _ in tokens] == list(range(stop_at + 1)), "in order, never twice"
    (record,) = finished
    assert record.status is status and len(record.output_token_ids) == stop_at + 1
    assert record.usage.output_tokens == stop_at + 1 and record.usage.input_tokens == 4


def test_stop_string_hit_and_recent_output_tail() -> None:
    """Seqs carry the last (longest stop string bytes + 1) outputs; a stop_string_hit finishes with STOP."""
    core = make_core()
    core.submit(make_request("x", 4, max_tokens=10, stop_strings=("ab", "héé")), 0.0)
    core.submit(make_request("y", 4, max_tokens=10), 0.0)
    executor = FakeExecutor()
    for now in range(7):
        step(core, float(now), executor)
    seq_x, seq_y = core.schedule(7.0).seqs
    assert seq_x.recent_output_ids == tuple(token_for("x", i) for i in range(1, 7)) and seq_y.recent_output_ids == ()
    result = RoundResult(core.batcher.next_round_id - 1, (SeqOutput("x", 0, (1,), stop_string_hit=True), SeqOutput("y", 0, (2,))))
    (finished,) = core.on_round_result(result, 8.0).finished
    assert (finished.request_id, finished.status) == ("x", RequestStatus.FINISHED_STOP)


def test_lifecycle_stages_and_finished_record() -> None:
    """A plain request reports enqueued, first_scheduled, prefill chunks, first_token, finished, kv_released."""
    core = make_core(max_prefill_chunk=16)
    core.submit(make_request("a", 40, max_tokens=2, arrival=0.0), 0.0)
    stages = [e.stage for e in core.take_events().lifecycle]
    for now in range(1, 6):
        stages += [e.stage for e in step(core, float(now))[1].lifecycle]
    assert stages == [
        Stage.ENQUEUED,
        Stage.FIRST_SCHEDULED,
        Stage.PREFILL_CHUNK,
        Stage.PREFILL_CHUNK,
        Stage.PREFILL_CHUNK,
        Stage.FIRST_TOKEN,
        Stage.FINISHED,
        Stage.KV_RELEASED,
    ]


# ---- prefix cache ------------------------------------------------------------------------


def test_prefix_cache_hit_skips_whole_cached_blocks_but_computes_the_last_token() -> None:
    """A second request with the same 32-token prompt reuses one block (16 tokens), never all 32."""
    core = make_core()
    prompt = tuple(range(100, 132))
    core.submit(make_request("a", prompt=prompt, max_tokens=1), 0.0)
    _, events = step(core, 0.0)
    stored = [e.block_hashes[0] for e in events.kv_events]
    assert len(stored) == 2 and core.kv_snapshot() == (2, tuple(stored))
    assert stored == hash_chain(prompt, 16, salt_of("tiny")), "the router's hash chain names the same blocks"
    core.submit(make_request("b", prompt=prompt, max_tokens=1), 1.0)
    plan = core.schedule(1.0)
    (seq,) = plan.seqs
    assert (seq.start_position, len(seq.token_ids)) == (16, 16)
    assert core.stats().prefix_hit_tokens == 16 and core.stats().prefix_query_tokens == 64


def test_deadline_heap_drops_entries_of_ended_requests() -> None:
    """Deadlines of requests that already ended are compacted away instead of piling up."""
    core = make_core()
    for i in range(3000):
        core.submit(make_request(f"r{i}", deadline=1e9, queue_deadline=1e9), 0.0)
        core.cancel(f"r{i}", 0.0)
    assert len(core.deadlines) < 1100 and core.next_deadline() is None


# ---- reported load -------------------------------------------------------------------------


def test_pending_prefill_counts_the_unscheduled_rest_of_a_running_prompt() -> None:
    """A request halfway through a chunked prefill still reports its unscheduled prompt tokens, down to 0 at decode."""
    core = make_core(num_blocks=64, max_prefill_chunk=32, max_num_batched_tokens=32)
    core.submit(make_request("long", 100, max_tokens=3), 0.0)
    assert core.stats().queued_prefill_tokens == 100
    seen = []
    for now in range(6):
        step(core, float(now))
        seen.append(core.stats().queued_prefill_tokens)
        check_invariants(core)
    assert core.num_waiting == 0 and seen == [68, 36, 4, 0, 0, 0]


def test_pending_prefill_excludes_cached_blocks_and_returns_on_cancel() -> None:
    """Tokens the prefix cache holds are no pending work, waiting or running; a cancelled running request leaves none behind."""
    core = make_core(max_prefill_chunk=16, max_num_batched_tokens=16)
    shared = tuple(range(1000, 1064))
    core.submit(make_request("first", prompt=shared, max_tokens=2), 0.0)
    for now in range(6):
        step(core, float(now))
    core.submit(make_request("second", prompt=shared[:48] + tuple(range(5000, 5032)), max_tokens=2), 10.0)
    assert core.stats().queued_prefill_tokens == 80 - 48, "already waiting, the cached blocks are no work"
    plan = core.schedule(10.0)
    assert plan.seqs[0].start_position == 48
    assert core.stats().queued_prefill_tokens == 80 - 48 - 16
    core.cancel("second", 10.5)
    assert core.stats().queued_prefill_tokens == 0
    check_invariants(core)
