"""Preemption when KV blocks run out: victim choice, recompute with prefix-cache reuse, swap, host capacity.

Scenario (block size 4, 7 blocks): A and B (8-token prompts, 10 output tokens) decode side by side
until both cross position 12 in the same round; only one block is left, so B (the later arrival)
is preempted. A finishes, then B resumes.
"""

from __future__ import annotations

from core_factories import FakeExecutor, check_invariants, make_core, make_request, step, token_for

from scheduler_svc.core.config import PreemptionMode
from sluice.types import BlockCopy, CoreEvents, RequestStatus, RoundPlan, RoundResult, Stage


def _run(mode: PreemptionMode, host_blocks: int = 0) -> tuple[list[tuple[RoundPlan, CoreEvents]], object]:
    core = make_core(num_blocks=7, block_size=4, preemption_mode=mode, num_host_blocks=host_blocks)
    core.submit(make_request("A", 8, max_tokens=10, arrival=0.0), 0.0)
    core.submit(make_request("B", 8, max_tokens=10, arrival=0.5), 0.0)
    executor, rounds, now = FakeExecutor(), [], 1.0
    while core.has_unfinished():
        rounds.append(step(core, now, executor))
        check_invariants(core)
        now += 1.0
    return rounds, core


def _stage(rounds: list[tuple[RoundPlan, CoreEvents]], stage: Stage) -> list[tuple[int, str, tuple]]:
    return [(i, e.request_id, e.detail) for i, (_, ev) in enumerate(rounds) for e in ev.lifecycle if e.stage is stage]


def _outputs(rounds: list[tuple[RoundPlan, CoreEvents]]) -> dict[str, list[int]]:
    return {f.request_id: list(f.output_token_ids) for _, ev in rounds for f in ev.finished}


def test_recompute_preempts_latest_arrival_and_reuses_cached_blocks() -> None:
    """B is preempted (recompute), re-prefills only what the prefix cache lost, and its output is unchanged."""
    rounds, core = _run(PreemptionMode.RECOMPUTE)
    assert _stage(rounds, Stage.PREEMPTED) == [(5, "B", (("mode", "recompute"),))]
    preempting_plan = rounds[5][0]
    assert [s.request_id for s in preempting_plan.seqs] == ["A"], "no waiting request joins a preempting round"
    (resumed,) = _stage(rounds, Stage.RESUMED)
    assert resumed == (10, "B", (("mode", "recompute"), ("cached_tokens", 8)))
    resume_seq = rounds[10][0].seqs[0]
    # B had computed 12 tokens; A's growth evicted B's third cached block, so 4 are recomputed.
    assert (resume_seq.epoch, resume_seq.start_position, len(resume_seq.token_ids)) == (1, 8, 5)
    assert rounds[10][0].budget.num_prefill_tokens == 5  # type: ignore[union-attr]
    stats = core.stats()  # type: ignore[attr-defined]
    assert (stats.preemptions, stats.recomputed_tokens) == (1, 4)
    finished = {f.request_id: f for _, ev in rounds for f in ev.finished}
    assert (finished["B"].usage.preemptions, finished["B"].usage.recomputed_tokens) == (1, 4)
    assert _outputs(rounds)["B"] == [token_for("B", i) for i in range(10)]
    assert core.stats().kv_blocks_used == 0  # type: ignore[attr-defined]


def test_swap_copies_out_pins_until_done_and_swaps_back_in() -> None:
    """Swap mode copies B's 3 blocks to host in the preempting round and back on resume, keeping computed tokens."""
    rounds, core = _run(PreemptionMode.SWAP, host_blocks=3)
    assert _stage(rounds, Stage.PREEMPTED) == [(5, "B", (("mode", "swap"),))]
    swap_out = rounds[5][0].swap_out
    assert [c.dst for c in swap_out] == [0, 1, 2] and len({c.src for c in swap_out}) == 3
    (resumed,) = _stage(rounds, Stage.RESUMED)
    assert resumed[:2] == (10, "B")
    plan = rounds[10][0]
    assert [c.src for c in plan.swap_in] == [0, 1, 2]
    seq = plan.seqs[0]
    assert (seq.epoch, seq.start_position, len(seq.token_ids)) == (1, 12, 1), "computed tokens preserved"
    assert seq.block_table[:3] == tuple(c.dst for c in plan.swap_in)
    stats = core.stats()  # type: ignore[attr-defined]
    assert (stats.preemptions, stats.recomputed_tokens, stats.host_blocks_used) == (1, 0, 0)
    assert _outputs(rounds)["B"] == [token_for("B", i) for i in range(10)]


def test_swapped_out_blocks_are_pinned_while_the_copy_is_in_flight() -> None:
    """The victim's device blocks cannot be handed out before the round that copies them has finished."""
    core = make_core(num_blocks=7, block_size=4, preemption_mode=PreemptionMode.SWAP, num_host_blocks=3)
    core.submit(make_request("A", 8, max_tokens=10), 0.0)
    core.submit(make_request("B", 8, max_tokens=10, arrival=0.5), 0.0)
    executor = FakeExecutor()
    for now in range(5):
        step(core, float(now), executor)
    plan = core.schedule(5.0)
    pinned = [c.src for c in plan.swap_out]
    assert all(core.pool.pin_count(b) == 1 for b in pinned)
    assert core.pool.allocate(1) is None, "only pinned blocks are left"
    core.on_round_result(executor.run(plan), 6.0)
    assert all(core.pool.pin_count(b) == 0 for b in pinned)
    check_invariants(core)


def test_swap_falls_back_to_recompute_when_host_is_full() -> None:
    """With 2 host blocks for a 3-block victim, preemption recomputes instead and host stays empty."""
    rounds, core = _run(PreemptionMode.SWAP, host_blocks=2)
    assert _stage(rounds, Stage.PREEMPTED) == [(5, "B", (("mode", "recompute"),))]
    assert all(not plan.swap_out and not plan.swap_in for plan, _ in rounds)
    assert core.stats().recomputed_tokens == 4  # type: ignore[attr-defined]


def test_victim_is_lowest_priority_first() -> None:
    """Among running requests the lowest priority is preempted, even if it arrived first."""
    core = make_core(num_blocks=7, block_size=4)
    core.submit(make_request("low", 8, max_tokens=10, arrival=0.0, priority=-1), 0.0)
    core.submit(make_request("high", 8, max_tokens=10, arrival=0.5), 0.0)
    executor, preempted = FakeExecutor(), []
    for now in range(8):
        _, events = step(core, float(now), executor)
        preempted += [e.request_id for e in events.lifecycle if e.stage is Stage.PREEMPTED]
    assert preempted == ["low"]


def test_block_copy_type_is_what_plans_carry() -> None:
    """Swap copies are BlockCopy(src, dst) records."""
    rounds, _ = _run(PreemptionMode.SWAP, host_blocks=3)
    assert all(isinstance(c, BlockCopy) for plan, _ in rounds for c in (*plan.swap_out, *plan.swap_in))


def test_failed_swap_out_round_falls_back_to_recompute() -> None:
    """If the round carrying a swap-out fails, the victim drops its host copies and later re-prefills."""
    core = make_core(num_blocks=7, block_size=4, preemption_mode=PreemptionMode.SWAP, num_host_blocks=3)
    core.submit(make_request("A", 8, max_tokens=10), 0.0)
    core.submit(make_request("B", 8, max_tokens=10, arrival=0.5), 0.0)
    executor = FakeExecutor()
    for now in range(5):
        step(core, float(now), executor)
    plan = core.schedule(5.0)
    assert plan.swap_out and core.stats().host_blocks_used == 3
    events = core.on_round_result(RoundResult(plan.round_id, (), error="copy failed"), 6.0)
    assert [f.request_id for f in events.finished] == ["A"], "A was in the failed round; B was only copied"
    assert core.stats().host_blocks_used == 0 and core.request_status("B") is RequestStatus.WAITING
    resumed = core.schedule(7.0)
    (event,) = [e for e in core.take_events().lifecycle if e.stage is Stage.RESUMED]
    assert not resumed.swap_in and dict(event.detail)["mode"] == "recompute", "no swap-in of untrusted copies"
    check_invariants(core)


def test_preempted_requests_never_push_the_waiting_queue_past_its_bound() -> None:
    """With max_waiting 2 and a client submitting before every round, the queue holds at most 2 requests even
    when recompute preemptions send running requests back to it (submissions are refused instead)."""
    from sluice.core_errors import RequestRejected

    core = make_core(num_blocks=7, block_size=4, max_waiting=2)
    executor, now, refused, most = FakeExecutor(), 1.0, 0, 0
    for i in range(40):
        try:
            core.submit(make_request(f"r{i}", 8, max_tokens=10, arrival=now), now)
        except RequestRejected:
            refused += 1
        step(core, now, executor)
        check_invariants(core)
        most = max(most, core.num_waiting)
        now += 1.0
    assert core.stats().preemptions > 0 and refused > 0
    assert most <= 2


def test_a_request_waits_for_the_blocks_a_swap_out_frees_instead_of_preempting_itself() -> None:
    """A (32-token prompt, first) and B (24 tokens) prefill side by side in chunks of 3 on 10 blocks of 4: when A
    needs a block, B is swapped out, but B's computed blocks stay pinned until that copy has run, so nothing is free
    in this round. A must wait a round for them, keeping its work; before, A preempted itself (recompute), B came
    back in, and the two threw their work away by turns for ever (found by the stateful test: 88 preemptions,
    1,470 recomputed tokens, neither finished in 300 rounds)."""
    core = make_core(num_blocks=10, block_size=4, max_num_batched_tokens=16, max_prefill_chunk=3, max_model_len=40,
                     preemption_mode=PreemptionMode.SWAP, num_host_blocks=5, enable_prefix_caching=False)
    core.submit(make_request("A", 32, max_tokens=4, arrival=0.0), 0.0)
    core.submit(make_request("B", 24, max_tokens=4, arrival=0.1), 0.1)
    executor, rounds, now = FakeExecutor(), [], 1.0
    while core.has_unfinished() and len(rounds) < 100:
        rounds.append(step(core, now, executor))
        check_invariants(core)
        now += 1.0
    assert not core.has_unfinished(), "both finish"
    assert [(rid, detail) for _, rid, detail in _stage(rounds, Stage.PREEMPTED)] == [("B", (("mode", "swap"),))]
    assert core.stats().recomputed_tokens == 0, "A kept its work while it waited"
    outputs = [t for _, ev in rounds for t in ev.tokens]
    assert [index for rid, index, _ in outputs if rid == "A"] == [0, 1, 2, 3]
    assert [index for rid, index, _ in outputs if rid == "B"] == [0, 1, 2, 3]
