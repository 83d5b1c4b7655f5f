"""PlanEncoder builds each round's wire plan from the round before's messages, byte for byte as plan_to_proto."""

from __future__ import annotations

import random

from sluice import convert
from sluice.plan_encoder import PlanEncoder
from sluice.types import PENDING_TOKEN, BlockCopy, RoundPlan, SamplingParams, ScheduledSeq

GREEDY = SamplingParams(max_tokens=64, ignore_eos=True)
STOPS = SamplingParams(max_tokens=64, stop_strings=("x",))


def _plans(rng: random.Random, rounds: int) -> list[RoundPlan]:
    """Rounds of a changing batch: decodes that grow into new blocks, a block replaced, prefill chunks, restarts with a new epoch
    and new blocks, sampling changes, stop-string tails, pending tokens, requests leaving and coming back."""
    state: dict[str, list] = {}  # request id -> [epoch, position, blocks, sampling, output index]
    plans = []
    for round_id in range(1, rounds + 1):
        seqs = []
        for i in range(12):
            rid = f"r{i}"
            if rng.random() < 0.15:
                continue  # skips this round (preempted, or not scheduled)
            st = state.setdefault(rid, [0, 0, [], GREEDY, 0])
            roll = rng.random()
            if roll < 0.05:  # restarted: a new epoch, new blocks
                st[:] = [st[0] + 1, 0, [], GREEDY, 0]
            elif roll < 0.08 and st[2]:  # a block replaced in place (copy on write): not a growth
                st[2][0] = rng.randrange(1000)
            elif roll < 0.12:
                st[3] = STOPS if st[3] is GREEDY else SamplingParams(max_tokens=64, ignore_eos=True)  # equal, new
            chunk = rng.choice((1, 1, 1, 5, 17)) if st[1] else rng.choice((3, 16, 40))
            while len(st[2]) * 4 < st[1] + chunk:
                st[2].append(rng.randrange(1000))
            tokens = (PENDING_TOKEN,) if chunk == 1 and rng.random() < 0.3 else tuple(
                rng.randrange(100) for _ in range(chunk))
            recent = tuple(rng.randrange(100) for _ in range(3)) if st[3] is STOPS else ()
            seqs.append(ScheduledSeq(rid, st[0], tokens, st[1], tuple(st[2]), st[3], rng.random() < 0.8, st[4], recent))
            st[1] += chunk
            st[4] += 1
        swaps = (BlockCopy(1, 2),) if round_id % 7 == 0 else ()
        plans.append(RoundPlan(round_id, tuple(seqs), swap_out=swaps, swap_in=swaps[::-1]))
    plans.insert(rounds // 2, RoundPlan(rounds + 1, ()))  # an empty round forgets everything
    return plans


def test_incremental_plans_serialize_exactly_like_fresh_ones() -> None:
    """Over 400 rounds of a changing batch every encoded plan equals plan_to_proto's, message and bytes."""
    encoder = PlanEncoder()
    for plan in _plans(random.Random(11), 400):
        got, want = encoder.encode(plan), convert.plan_to_proto(plan)
        assert got == want, plan.round_id
        assert got.SerializeToString() == want.SerializeToString()
        assert convert.plan_from_proto(got).seqs == plan.seqs


def test_a_plan_sent_is_not_changed_by_encoding_the_next() -> None:
    """The returned message is a copy: encoding round N+1 leaves round N's message as it was."""
    encoder = PlanEncoder()
    first = RoundPlan(1, (ScheduledSeq("a", 0, (5,), 8, (1, 2, 3), GREEDY, True, 1),))
    second = RoundPlan(2, (ScheduledSeq("a", 0, (6,), 9, (1, 2, 3, 4), GREEDY, True, 2),))
    sent = encoder.encode(first)
    encoder.encode(second)
    assert sent == convert.plan_to_proto(first)
