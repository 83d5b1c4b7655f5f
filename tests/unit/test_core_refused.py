"""A result that refuses some sequences (`RoundResult.refused`) fails exactly those requests; the rest go on."""

from __future__ import annotations

from core_factories import FakeExecutor, check_invariants, make_core, make_request, step

from scheduler_svc.core import SchedulerCore
from sluice.types import PENDING_TOKEN, RefusedSeq, RequestStatus, RoundPlan, RoundResult, SeqOutput

BAD = RefusedSeq("b", "seqs[1].token_ids", "seqs[1].token_ids: token id 1000000000 is outside 0..31999")


def _answer(plan: RoundPlan, refused: tuple[RefusedSeq, ...]) -> RoundResult:
    """The worker's answer to `plan` with the `refused` sequences taken out (their requests get no output)."""
    ids = {seq.request_id for seq in refused}
    ran = FakeExecutor().run(RoundPlan(plan.round_id, tuple(s for s in plan.seqs if s.request_id not in ids)))
    return RoundResult(plan.round_id, ran.outputs, refused=refused)


def _three(core: SchedulerCore) -> None:
    for rid in ("a", "b", "c"):
        core.submit(make_request(rid, prompt_len=20, max_tokens=3), 0.0)


def test_a_refused_sequence_fails_its_request_only_and_the_others_finish() -> None:
    """Of a three-request round whose middle sequence the worker refused, b ends FAILED once with the refusal
    (field and message) as detail and its blocks freed; a and c get their first token and run to completion."""
    core = make_core(block_size=16)
    _three(core)
    plan = core.schedule(0.0)
    assert [s.request_id for s in plan.seqs] == ["a", "b", "c"]
    events = core.on_round_result(_answer(plan, (BAD,)), 0.1)
    (failed,) = events.finished
    assert (failed.request_id, failed.status) == ("b", RequestStatus.FAILED)
    assert failed.detail == f"round {plan.round_id} refused its sequence: INVALID_ARGUMENT (seqs[1].token_ids): " \
                            f"{BAD.message}"
    assert [(rid, index) for rid, index, _ in events.tokens] == [("a", 0), ("c", 0)]
    assert core.stats().kv_blocks_used == 4 and events.dropped_results == 0  # a's and c's two blocks each
    check_invariants(core)
    finished = []
    for now in (0.2, 0.3, 0.4):
        finished += step(core, now)[1].finished
        check_invariants(core)
    assert sorted((f.request_id, f.status) for f in finished) == [("a", RequestStatus.FINISHED_LENGTH),
                                                                  ("c", RequestStatus.FINISHED_LENGTH)]
    assert core.request_status("b") is RequestStatus.FAILED and core.stats().kv_blocks_used == 0


def test_a_refusal_pairs_the_other_outputs_by_request_even_in_another_order() -> None:
    """With a refusal the outputs no longer line up with the plan: they are paired by request id, so a and c get
    their own tokens whatever order the worker answers in, and an output for an unknown request is dropped."""
    core = make_core()
    _three(core)
    plan = core.schedule(0.0)
    outputs = (SeqOutput("c", 0, (31,)), SeqOutput("zz", 0, (5,)), SeqOutput("a", 0, (11,)))
    events = core.on_round_result(RoundResult(plan.round_id, outputs, refused=(BAD,)), 0.1)
    assert sorted((rid, token) for rid, _, token in events.tokens) == [("a", 11), ("c", 31)]
    assert events.dropped_results == 1 and [f.request_id for f in events.finished] == ["b"]
    check_invariants(core)


def _two_rounds_in_flight() -> tuple[SchedulerCore, RoundPlan, RoundPlan]:
    """Return a core with a and b decoding and two pipelined rounds planned (N, and N+1 with pending decodes)."""
    core = make_core(block_size=4)
    for rid in ("a", "b"):
        core.submit(make_request(rid, prompt_len=4, max_tokens=4), 0.0)
    step(core, 0.0)
    return core, core.schedule(0.1, overlap=True), core.schedule(0.1, overlap=True)


def test_a_refused_request_the_round_ahead_reads_ends_once_and_its_blocks_wait_for_that_round() -> None:
    """Pipelined: b is refused in round N while round N+1 already holds its pending decode. b ends FAILED at N's
    result with its blocks still pinned; N+1's answer (without b: the worker dropped its pending decode) releases
    them and ends nothing twice, while a decodes on to the end."""
    core, first, ahead = _two_rounds_in_flight()
    assert [s.token_ids for s in ahead.seqs] == [(PENDING_TOKEN,)] * 2
    refused = (RefusedSeq("b", "seqs[1].block_table", "seqs[1]: device block 99 is outside 0..63"),)
    events = core.on_round_result(_answer(first, refused), 0.2)
    assert [(f.request_id, f.status) for f in events.finished] == [("b", RequestStatus.FAILED)]
    assert "INVALID_ARGUMENT (seqs[1].block_table)" in events.finished[0].detail
    assert core.stats().kv_blocks_used == 4, "b's blocks stay pinned while the round ahead reads them"
    check_invariants(core)
    events = core.on_round_result(_answer(ahead, refused), 0.3)  # the worker drops b's pending decode
    assert not [f for f in events.finished if f.request_id == "b"] and events.dropped_results == 0
    assert [rid for rid, _, _ in events.tokens] == ["a"]
    assert core.stats().kv_blocks_used == 2
    check_invariants(core)
    _, events = step(core, 0.4)
    assert [(f.request_id, f.status) for f in events.finished] == [("a", RequestStatus.FINISHED_LENGTH)]
    assert core.stats().kv_blocks_used == 0 and not core.has_unfinished()
    check_invariants(core)


def test_a_late_output_or_second_refusal_for_a_refused_request_never_resurrects_it() -> None:
    """If round N+1 answers with an output for the request refused in N (or refuses it again), the output is
    dropped and counted, the request stays FAILED with one Finished record, and its pinned blocks are released."""
    for late in ("output", "refusal"):
        core, first, ahead = _two_rounds_in_flight()
        refused = (RefusedSeq("b", "seqs[1].sampling", "seqs[1]: top_p must be finite"),)
        assert [f.request_id for f in core.on_round_result(_answer(first, refused), 0.2).finished] == ["b"]
        if late == "output":
            result = FakeExecutor().run(ahead)
            assert [o.request_id for o in result.outputs] == ["a", "b"]
        else:
            result = _answer(ahead, refused)
        events = core.on_round_result(result, 0.3)
        assert not events.finished and [rid for rid, _, _ in events.tokens] == ["a"], late
        assert events.dropped_results == (1 if late == "output" else 0), late
        assert core.request_status("b") is RequestStatus.FAILED and core.stats().kv_blocks_used == 2, late
        check_invariants(core)


def test_a_refused_request_cancelled_meanwhile_ends_cancelled_and_an_unknown_refusal_changes_nothing() -> None:
    """A request cancelled while its round was in flight ends CANCELLED when that round refuses it (it was no
    longer running); a refusal naming a request the round did not carry is ignored."""
    core = make_core()
    _three(core)
    plan = core.schedule(0.0)
    assert core.cancel("b", 0.05) is RequestStatus.CANCELLING
    ghost = RefusedSeq("ghost", "seqs[7].token_ids", "not in this round")
    events = core.on_round_result(_answer(plan, (BAD, ghost)), 0.1)
    assert [(f.request_id, f.status) for f in events.finished] == [("b", RequestStatus.CANCELLED)]
    assert sorted(rid for rid, _, _ in events.tokens) == ["a", "c"]
    assert core.stats().kv_blocks_used == 4
    check_invariants(core)


def test_a_round_that_fails_as_a_whole_still_fails_every_request() -> None:
    """A result with `error` (a fault of the round as a whole, e.g. a request twice) fails all its requests, refused
    ones included, each once."""
    core = make_core()
    _three(core)
    plan = core.schedule(0.0)
    error = "INVALID_ARGUMENT (seqs[1].request_id): request 'b' appears twice"
    events = core.on_round_result(RoundResult(plan.round_id, (), error=error, refused=(BAD,)), 0.1)
    assert sorted((f.request_id, f.status) for f in events.finished) == [
        (rid, RequestStatus.FAILED) for rid in ("a", "b", "c")]
    assert all(error in f.detail for f in events.finished) and core.stats().kv_blocks_used == 0
    check_invariants(core)
