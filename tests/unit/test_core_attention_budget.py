"""The round's attention charge: a deep prefill chunk pays for its attention out of the token budget
(SchedulerConfig.attention_pairs_per_token), decodes come first, and every prompt keeps moving."""

from __future__ import annotations

import pytest

from scheduler_svc.core import SchedulerCore
from sluice.types import RoundPlan, Stage
from tests.unit.core_factories import FakeExecutor, check_invariants, make_core, make_request, step

DEEP = {"num_blocks": 512, "block_size": 16, "max_num_batched_tokens": 256, "max_prefill_chunk": 2048,
        "max_model_len": 8192, "attention_pairs_per_token": 1024, "attention_free_context": 64}
"""A round of 256 tokens whose chunks pay one token per 1,024 pairs of attention deeper than 64 tokens."""


def _chunk(plan: RoundPlan, request_id: str) -> tuple[int, int]:
    """Return (start, tokens) of `request_id`'s sequence in `plan`."""
    seq = next(s for s in plan.seqs if s.request_id == request_id)
    return seq.start_position, len(seq.token_ids)


def _decoding_core(**overrides: object) -> SchedulerCore:
    """Return a core with request "d" decoding (prefilled and sampled once) and nothing else."""
    core = make_core(**{**DEEP, **overrides})
    core.submit(make_request("d", 8, max_tokens=50), 0.0)
    step(core, 0.0)
    return core


def test_a_deep_chunk_shrinks_to_what_its_attention_leaves_of_the_round() -> None:
    """Beside one decode, a prompt's first chunk (start 0: nothing deeper than 64 to pay for) takes the 255
    tokens left; its second, at start 255, attends 191 tokens deeper: 214 tokens + ceil(214 * 191 / 1024) = 40
    tokens of attention fill the 255 (215 would need 256). Without the charge it takes all 255."""
    for per_token, expected in ((1024, 214), (None, 255)):
        core = _decoding_core(attention_pairs_per_token=per_token)
        core.submit(make_request("p", 4000, max_tokens=4), 0.0)
        plan, _ = step(core, 1.0)
        assert _chunk(plan, "p") == (0, 255)
        plan, _ = step(core, 2.0)
        assert _chunk(plan, "p") == (255, expected)
        assert _chunk(plan, "d")[1] == 1, "the decode keeps its token"
        budget = plan.budget
        assert budget is not None
        assert budget.attention_tokens == (40 if per_token else 0)
        assert budget.used_query_tokens == 1 + expected
        assert budget.used_query_tokens + budget.attention_tokens <= 256
        check_invariants(core)


def test_deeper_chunks_get_smaller_and_the_prompt_still_finishes() -> None:
    """Each chunk of a 4,000-token prompt is at most what its depth leaves (n + ceil(n * (start - 64) / 1024)
    <= the tokens left), so chunks shrink as the prompt gets deeper; the prompt still reaches its first token."""
    core = _decoding_core()
    core.submit(make_request("p", 4000, max_tokens=4), 0.0)
    sizes, now = [], 1.0
    while True:
        plan, _ = step(core, now)
        now += 1.0
        start, num = _chunk(plan, "p")
        budget = plan.budget
        assert budget is not None and budget.used_query_tokens + budget.attention_tokens <= 256
        sizes.append(num)
        if start + num == 4000:
            break
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[1] // 2
    assert core.requests.live["p"].num_computed == 4000 or core.requests.live["p"].in_flight_round is None
    check_invariants(core)


def test_a_shallow_chunk_is_not_charged() -> None:
    """A prompt within the free context (64 tokens) plans exactly as without the charge: same chunks, no
    attention tokens, no attention attribute on its PREFILL_CHUNK event."""
    plans = {}
    for per_token in (1024, None):
        core = make_core(**{**DEEP, "max_num_batched_tokens": 48, "attention_pairs_per_token": per_token})
        core.submit(make_request("p", 100, max_tokens=4), 0.0)
        first, events = step(core, 0.0)
        second, _ = step(core, 1.0)
        plans[per_token] = [(_chunk(p, "p"), p.budget.attention_tokens if p.budget else None) for p in (first, second)]
        chunk_events = [e for e in events.lifecycle if e.stage is Stage.PREFILL_CHUNK]
        assert [dict(e.detail) for e in chunk_events] == [{"tokens": 48, "start": 0}]
    assert plans[1024] == plans[None] == [((0, 48), 0), ((48, 48), 0)]


def test_the_charge_is_reported_on_the_prefill_chunk_event() -> None:
    """The PREFILL_CHUNK event of a charged chunk carries the tokens its attention paid (the span event)."""
    core = _decoding_core()
    core.submit(make_request("p", 4000, max_tokens=4), 0.0)
    step(core, 1.0)
    _, events = step(core, 2.0)
    (event,) = [e for e in events.lifecycle if e.stage is Stage.PREFILL_CHUNK]
    assert dict(event.detail) == {"tokens": 214, "start": 255, "attention_tokens": 40}


def test_a_decode_after_a_deep_chunk_is_not_starved() -> None:
    """Decodes come first: a request that started after a prompt still in its prefill keeps its one token a
    round once the prompt is deep enough that its chunk plus its charge would fill the round. Here "p" starts
    first with 128-token chunks (shallow, uncharged, room to spare: "d" is admitted behind it); past ~1,100
    tokens the charge, not the 128 cap, sizes p's chunk, and every round still holds d's decode."""
    core = make_core(**{**DEEP, "max_prefill_chunk": 128})
    core.submit(make_request("p", 3000, max_tokens=4), 0.0)
    core.submit(make_request("d", 8, max_tokens=40), 0.0)
    plan, _ = step(core, 0.0)
    assert [_chunk(plan, r) for r in ("p", "d")] == [(0, 128), (0, 8)]
    charged = 0
    for now in range(1, 30):
        plan, _ = step(core, float(now))
        assert [s.request_id for s in plan.seqs] == ["p", "d"], "running order: p started first"
        assert _chunk(plan, "d")[1] == 1
        budget = plan.budget
        assert budget is not None and budget.used_query_tokens + budget.attention_tokens <= 256
        charged += _chunk(plan, "p")[1] < 128
    assert charged > 10, "the charge, not the cap, sized most of p's deep chunks"
    check_invariants(core)


def test_a_prompt_deeper_than_the_budget_pays_for_still_moves_a_block_a_round() -> None:
    """When even one token's attention would not fit (32-token rounds at one token per 16 pairs, chunks 500+
    tokens deep), the chunk is floored at one block (16 tokens) rather than shrunk to nothing, so the prompt
    advances every round and reaches its first token (no livelock); the overdraw is not charged."""
    core = make_core(**{**DEEP, "max_num_batched_tokens": 32, "attention_pairs_per_token": 16,
                        "attention_free_context": 0})
    core.submit(make_request("p", 1000, max_tokens=2), 0.0)
    computed, now, rounds = 0, 0.0, 0
    executor = FakeExecutor()
    while core.requests.live["p"].num_computed < 1000:
        plan, _ = step(core, now, executor)
        now, rounds = now + 1.0, rounds + 1
        start, num = _chunk(plan, "p")
        assert start == computed and num >= min(16, 1000 - start)
        budget = plan.budget
        assert budget is not None and budget.used_query_tokens + budget.attention_tokens <= 32
        computed = start + num
    assert rounds <= 1000 // 16 + 2
    check_invariants(core)


def test_a_deep_chunk_placed_ahead_is_charged_too() -> None:
    """With overlap, the chunk placed ahead of an in-flight chunk is sized by the same rule: at start 256, 192
    tokens past the free context, 215 tokens + ceil(215 * 192 / 1024) = 41 fill the 256-token round."""
    core = make_core(**DEEP)
    core.submit(make_request("p", 4000, max_tokens=4), 0.0)
    first = core.schedule(0.0, overlap=True)
    ahead = core.schedule(0.5, overlap=True)
    assert _chunk(first, "p") == (0, 256) and _chunk(ahead, "p") == (256, 215)
    assert ahead.budget is not None and ahead.budget.attention_tokens == 41
    worker = FakeExecutor()
    core.on_round_result(worker.run(first), 1.0)
    core.on_round_result(worker.run(ahead), 1.5)
    assert core.requests.live["p"].num_computed == 471
    check_invariants(core)


@pytest.mark.parametrize(("field", "value"), [("attention_pairs_per_token", 0), ("attention_free_context", -1)])
def test_a_charge_setting_out_of_range_is_refused_naming_it(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        make_core(**{**DEEP, field: value})
