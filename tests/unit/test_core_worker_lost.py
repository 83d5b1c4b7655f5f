"""A round lost with its worker: its requests are re-run by recompute, not failed, within a bounded retry."""

from __future__ import annotations

from core_factories import FakeExecutor, check_invariants, make_core, make_request, step, token_for

from scheduler_svc.core.config import PreemptionMode
from sluice.types import KvEventKind, RequestStatus, RoundResult, SeqOutput, Stage


def test_a_lost_round_requeues_its_requests_and_they_finish_with_the_same_tokens() -> None:
    """Losing a mid-decode round preempts its request by recompute (cause worker_lost, epoch bumped, blocks back),
    a late answer for that round is dropped, and the request then finishes with exactly the tokens it would have had."""
    core = make_core(num_blocks=16, block_size=4)
    core.submit(make_request("A", 10, max_tokens=6), 0.0)
    for now in (1.0, 2.0):
        step(core, now)
    plan = core.schedule(3.0)
    [seq] = plan.seqs
    events = core.on_round_lost(plan.round_id, 3.0)
    [preempted] = [e for e in events.lifecycle if e.stage is Stage.PREEMPTED]
    assert preempted.detail == (("mode", "recompute"), ("cause", "worker_lost"))
    assert not events.finished and not events.tokens
    assert core.request_status("A") is RequestStatus.WAITING
    assert (core.stats().kv_blocks_used, core.num_waiting, core.num_running) == (0, 1, 0)
    check_invariants(core)
    late = core.on_round_result(RoundResult(plan.round_id, (SeqOutput("A", seq.epoch, (7,)),)), 3.5)
    assert late.dropped_results == 1 and not late.tokens
    finished = []
    for now in range(4, 20):
        finished += step(core, float(now))[1].finished
    [done] = finished
    assert done.status is RequestStatus.FINISHED_LENGTH
    assert done.output_token_ids == tuple(token_for("A", i) for i in range(6))
    assert done.usage.preemptions == 1
    check_invariants(core)


def test_a_request_lost_in_more_than_max_lost_rounds_consecutive_rounds_fails() -> None:
    """With max_lost_rounds=2 a request whose round is lost three times in a row ends FAILED with a clear reason."""
    core = make_core(num_blocks=16, block_size=4, max_lost_rounds=2)
    core.submit(make_request("A", 10, max_tokens=6), 0.0)
    details = []
    for now in (1.0, 2.0, 3.0):
        plan = core.schedule(now)
        events = core.on_round_lost(plan.round_id, now)
        details += [f.detail for f in events.finished]
    [detail] = details
    assert "lost in 3 consecutive rounds" in detail and "max_lost_rounds 2" in detail
    assert core.request_status("A") is RequestStatus.FAILED and core.stats().kv_blocks_used == 0
    check_invariants(core)


def test_a_round_that_answers_resets_the_lost_count() -> None:
    """Losses separated by a round that answered are not consecutive: the request survives and finishes."""
    core = make_core(num_blocks=16, block_size=4, max_lost_rounds=1)
    core.submit(make_request("A", 4, max_tokens=3), 0.0)
    now, finished = 1.0, []
    for _ in range(3):
        plan = core.schedule(now)
        core.on_round_lost(plan.round_id, now)
        finished += step(core, now + 0.5)[1].finished
        now += 1.0
    while core.has_unfinished():
        finished += step(core, now)[1].finished
        now += 1.0
    assert [f.status for f in finished] == [RequestStatus.FINISHED_LENGTH]
    assert finished[0].usage.preemptions == 3


def test_a_cancelling_request_in_a_lost_round_is_cancelled_and_swap_copies_count_as_not_done() -> None:
    """A request cancelled while its round is in flight ends CANCELLED when the round is lost; a swap-out
    victim of that round resumes by recompute (its host copy is not trusted) and every host block is back."""
    core = make_core(num_blocks=7, block_size=4, preemption_mode=PreemptionMode.SWAP, num_host_blocks=8)
    core.submit(make_request("A", 8, max_tokens=10, arrival=0.0), 0.0)
    core.submit(make_request("B", 8, max_tokens=10, arrival=0.5), 0.0)
    executor, now = FakeExecutor(), 1.0
    while True:
        plan = core.schedule(now)
        if plan.swap_out:
            break
        core.on_round_result(executor.run(plan), now)
        now += 1.0
    core.cancel("A", now)
    events = core.on_round_lost(plan.round_id, now)
    assert [(f.request_id, f.status) for f in events.finished] == [("A", RequestStatus.CANCELLED)]
    assert core.request_status("B") is RequestStatus.WAITING
    assert core.stats().host_blocks_used == 0
    check_invariants(core)
    finished = []
    while core.has_unfinished():
        finished += step(core, now, executor)[1].finished
        now += 1.0
    assert [(f.request_id, f.output_token_ids) for f in finished] == [("B", tuple(token_for("B", i) for i in range(10)))]


def test_a_restarted_worker_clears_the_cache_and_recomputes_requests_found_running() -> None:
    """on_worker_restarted (the worker was found dead between rounds) recomputes a running request, emits
    ALL_CLEARED and leaves no cached block; the request then finishes with its own tokens."""
    core = make_core(num_blocks=16, block_size=4)
    core.submit(make_request("A", 9, max_tokens=1), 0.0)
    step(core, 1.0)
    core.submit(make_request("B", 9, max_tokens=4), 1.0)
    step(core, 2.0)
    assert core.stats().kv_blocks_cached > 0 and core.num_running == 1
    events = core.on_worker_restarted(3.0)
    assert [e.kind for e in events.kv_events][-1] is KvEventKind.ALL_CLEARED
    assert [(e.request_id, e.detail) for e in events.lifecycle if e.stage is Stage.PREEMPTED] == [
        ("B", (("mode", "recompute"), ("cause", "worker_lost")))]
    assert (core.stats().kv_blocks_cached, core.stats().kv_blocks_used) == (0, 0)
    check_invariants(core)
    finished, now = [], 4.0
    while core.has_unfinished():
        finished += step(core, now)[1].finished
        now += 1.0
    assert [f.output_token_ids for f in finished] == [tuple(token_for("B", i) for i in range(4))]


def test_losing_an_unknown_round_changes_nothing() -> None:
    """on_round_lost for a round the core does not have in flight reports nothing and changes no ledger."""
    core = make_core()
    core.submit(make_request("A", 4), 0.0)
    core.take_events()
    before = core.stats()
    events = core.on_round_lost(99, 1.0)
    assert not events.lifecycle and not events.finished and core.stats() == before


def test_the_rest_of_the_workers_kv_is_forgotten_with_a_lost_round() -> None:
    """A running request outside the lost round (its own round was answered) is recomputed too, without
    counting as lost, while the lost round's request past the bound fails."""
    core = make_core(num_blocks=16, block_size=4, max_lost_rounds=0)
    core.submit(make_request("A", 4, max_tokens=8, arrival=0.0), 0.0)
    lost = core.schedule(1.0)
    core.submit(make_request("B", 4, max_tokens=8, arrival=0.1), 1.0)
    answered = core.schedule(2.0)
    assert [s.request_id for s in answered.seqs] == ["B"]
    core.on_round_result(FakeExecutor().run(answered), 2.0)
    assert core.num_running == 2
    core.take_events()
    events = core.on_round_lost(lost.round_id, 3.0)
    assert [(f.request_id, f.status) for f in events.finished] == [("A", RequestStatus.FAILED)]
    assert [(e.request_id, e.detail) for e in events.lifecycle if e.stage is Stage.PREEMPTED] == [
        ("B", (("mode", "recompute"), ("cause", "worker_lost")))]
    assert core.request_status("B") is RequestStatus.WAITING and core.stats().kv_blocks_used == 0
    check_invariants(core)


def test_a_swapped_out_waiting_request_drops_its_host_copy_when_the_worker_is_lost() -> None:
    """Host copies live in the worker's memory: after a lost round a swapped-out request waiting in the queue
    frees its host blocks, resumes by recompute, and still finishes with its own tokens."""
    core = make_core(num_blocks=7, block_size=4, preemption_mode=PreemptionMode.SWAP, num_host_blocks=8)
    core.submit(make_request("A", 8, max_tokens=10, arrival=0.0), 0.0)
    core.submit(make_request("B", 8, max_tokens=10, arrival=0.5), 0.0)
    executor, now = FakeExecutor(), 1.0
    while core.stats().host_blocks_used == 0 or core.request_status("B") is not RequestStatus.WAITING:
        step(core, now, executor)
        now += 1.0
    plan = core.schedule(now)
    assert [s.request_id for s in plan.seqs] == ["A"] and not plan.swap_in
    core.on_round_lost(plan.round_id, now)
    assert core.stats().host_blocks_used == 0
    check_invariants(core)
    finished = []
    while core.has_unfinished():
        plan, events = step(core, now, executor)
        assert not plan.swap_in, "nothing is swapped in from a host copy that is gone"
        finished += events.finished
        now += 1.0
    assert sorted((f.request_id, f.output_token_ids) for f in finished) == [
        (rid, tuple(token_for(rid, i) for i in range(10))) for rid in ("A", "B")]
