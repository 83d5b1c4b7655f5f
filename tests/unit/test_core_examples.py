"""DESIGN.md's worked examples, reproduced with exactly those numbers through SchedulerCore."""

from __future__ import annotations

import pytest
from core_factories import FakeExecutor, check_invariants, make_core, make_request, step

from scheduler_svc.core.config import Policy
from sluice.types import Finished, NewRequest, RequestStatus

# Prompt lengths chosen so that A holds 6 blocks, B 5 and C needs 7 (block size 16) and no
# decode in the example crosses a block boundary.
A_LEN, B_LEN, C_LEN = 90, 75, 100


@pytest.mark.parametrize("caching", [False, True])
def test_kv_pool_cancel_released_after_in_flight_round(caching: bool) -> None:
    """B's blocks stay allocated while a round reads them after its cancel, and C is placed after the result."""
    core = make_core(num_blocks=16, enable_prefix_caching=caching)
    for rid, length in (("A", A_LEN), ("B", B_LEN), ("C", C_LEN)):
        core.submit(make_request(rid, length, max_tokens=4), 0.0)
    executor = FakeExecutor()
    plan, _ = step(core, 0.0, executor)
    assert [s.request_id for s in plan.seqs] == ["A", "B"]
    assert (len(core.requests.live["A"].block_ids), len(core.requests.live["B"].block_ids)) == (6, 5)
    assert core.pool.num_allocatable == 5 and core.request_status("C") is RequestStatus.WAITING

    in_flight = core.schedule(1.0)
    assert [s.request_id for s in in_flight.seqs] == ["A", "B"], "C (7 blocks) cannot be resident"
    assert core.cancel("B", 1.0) is RequestStatus.CANCELLING
    assert core.pool.num_allocatable == 5, "a round still reads B's blocks"
    if not caching:
        assert core.stats().kv_blocks_free == 5

    events = core.on_round_result(executor.run(in_flight), 2.0)
    assert core.pool.num_allocatable == 10
    if not caching:
        assert core.stats().kv_blocks_free == 10
    assert [f.status for f in events.finished] == [RequestStatus.CANCELLED]
    assert events.dropped_results == 1, "B's token from the in-flight round is dropped"

    placed = core.schedule(3.0)
    assert [s.request_id for s in placed.seqs] == ["A", "C"]
    assert len(core.requests.live["C"].block_ids) == 7
    check_invariants(core)


def test_round_budget_two_decodes_and_a_prefill_chunk() -> None:
    """With 8 query tokens per round and two running decodes, 2 go to the decodes and 6 to a prefill chunk."""
    core = make_core(max_num_batched_tokens=8, max_prefill_chunk=512)
    core.submit(make_request("d1", 4, max_tokens=10), 0.0)
    core.submit(make_request("d2", 4, max_tokens=10), 0.0)
    step(core, 0.0)  # both prompts (8 tokens) prefilled, both now decoding
    core.submit(make_request("p", 20, max_tokens=10), 0.0)
    plan = core.schedule(1.0)
    by_id = {s.request_id: s for s in plan.seqs}
    assert len(by_id["d1"].token_ids) == len(by_id["d2"].token_ids) == 1
    assert len(by_id["p"].token_ids) == 6 and not by_id["p"].sample
    budget = plan.budget
    assert budget is not None
    assert (budget.num_decode_tokens, budget.num_prefill_tokens, budget.used_query_tokens) == (2, 6, 8)


def _run_one_at_a_time(policy: Policy, arrivals: list[tuple[float, NewRequest]], chunk: int) -> list[Finished]:
    """Drive a core with a fixed-time executor: 1 ms per computed token, one sequence per round."""
    core = make_core(max_num_seqs=1, max_num_batched_tokens=64, max_prefill_chunk=chunk, policy=policy)
    executor, finished, now = FakeExecutor(), [], 0.0
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or core.has_unfinished():
        while pending and pending[0][0] <= now:
            core.submit(pending.pop(0)[1], now)
        plan = core.schedule(now)
        if plan.is_empty:
            now = pending[0][0]
            continue
        now += 0.001 * sum(len(s.token_ids) for s in plan.seqs)
        finished += core.on_round_result(executor.run(plan), now).finished
    return finished


def _abc(at_b: float) -> list[tuple[float, NewRequest]]:
    return [
        (0.0, make_request("A", 8, max_tokens=1, arrival=0.0)),
        (at_b, make_request("B", 2, max_tokens=1, arrival=at_b, priority=1)),
        (at_b, make_request("C", 2, max_tokens=1, arrival=at_b, priority=1)),
    ]


@pytest.mark.parametrize(
    ("policy", "waits_ms"),
    [(Policy.FCFS, {"A": 0, "B": 8, "C": 10}), (Policy.PRIORITY, {"A": 4, "B": 0, "C": 2})],
)
def test_fcfs_versus_priority_waits_and_makespan(policy: Policy, waits_ms: dict[str, int]) -> None:
    """FCFS waits 0/8/10 ms and priority 0/2/4 ms (B, C first); both finish all work at 12 ms."""
    finished = _run_one_at_a_time(policy, _abc(0.0), chunk=512)
    waits = {f.request_id: (f.first_scheduled_time or 0) - f.arrival_time for f in finished}
    assert waits == {rid: pytest.approx(ms / 1000) for rid, ms in waits_ms.items()}
    assert max(f.finish_time for f in finished) == pytest.approx(0.012)


def test_running_non_preemptible_request_is_not_overtaken() -> None:
    """A, running in 2-token chunks, keeps its seat when high-priority B and C arrive at 1 ms."""
    finished = {f.request_id: f for f in _run_one_at_a_time(Policy.PRIORITY, _abc(0.001), chunk=2)}
    assert finished["A"].finish_time == pytest.approx(0.008)
    assert finished["B"].first_scheduled_time == pytest.approx(0.008)
    assert finished["C"].first_scheduled_time == pytest.approx(0.010)
    assert max(f.finish_time for f in finished.values()) == pytest.approx(0.012)
