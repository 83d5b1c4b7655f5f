"""The router's predicted time to first token (`predict_ttft`): each term, pinned by its value."""

from __future__ import annotations

import pytest

from router_svc.core import ReplicaLoad, ReplicaSpec, RouteQuery, RouterConfig, RouterCore
from router_svc.scoring import predict_ttft, prefill_rounds
from tests.unit.core_factories import make_core, make_request, step

RATE = 10_000.0  # prefill tokens/s
DECODE_S = 0.01  # the spec's decode round
CHUNK = 1000  # max_num_batched_tokens


def replica(load: ReplicaLoad | None = None, pair_s: float = 0.0, inflight: int = 0):  # type: ignore[no-untyped-def]
    """Return the router's row of one READY replica with that load and `inflight` requests routed to it."""
    router = RouterCore(RouterConfig())
    router.register(ReplicaSpec("r", "m", max_num_batched_tokens=CHUNK, prefill_tokens_per_s=RATE,
                                decode_round_s=DECODE_S, prefill_pair_s=pair_s), now=0.0)
    router.mark_ready("r", now=0.0)
    if load is not None:
        router.heartbeat("r", load, now=0.0)
    for i in range(inflight):
        router.route(RouteQuery(f"in{i}", "m", prompt_tokens=0), now=0.0)
    return router.fleet.get("r")


def ask(tokens: int) -> RouteQuery:
    return RouteQuery("q", "m", prompt_tokens=tokens)


def test_idle_replica_predicts_the_prefill_at_the_registered_rate() -> None:
    """An idle replica: no queue, no decodes; 2,500 tokens at 10k tokens/s = 0.25 s (three rounds, above the floor)."""
    ttft, queue, prefill = predict_ttft(replica(), ask(2500), cached=0)
    assert (ttft, queue, prefill) == pytest.approx((0.25, 0.0, 0.25))


def test_no_round_is_shorter_than_a_decode_round() -> None:
    """A 10-token prompt on an idle replica takes one round: the decode round (0.01 s), not 10 / rate (0.001 s)."""
    ttft, _, prefill = predict_ttft(replica(), ask(10), cached=0)
    assert prefill == pytest.approx(0.001)
    assert ttft == pytest.approx(DECODE_S)


def test_long_prompts_pay_attention_to_the_whole_prompt() -> None:
    """With prefill_pair_s, 4,000 tokens of which 1,000 cached (16-token blocks) add pair_s * (4000^2 - 992^2) / 2."""
    pair_s = 1e-9
    cached_blocks = 62  # 992 tokens
    _, _, prefill = predict_ttft(replica(pair_s=pair_s), ask(4000), cached=cached_blocks)
    assert prefill == pytest.approx((4000 - 992) / RATE + pair_s * 0.5 * (4000**2 - 992**2))


def test_queue_with_running_decodes_costs_a_decode_round_per_chunk_and_the_round_planned_ahead() -> None:
    """2,500 queued tokens while decodes run: 0.25 s at the rate + 3 chunks of decodes + 1.5 rounds in flight
    (1,000 tokens + a decode round each); the own 500 tokens add 0.05 s and one round of decodes."""
    load = ReplicaLoad(running=4, queued_prefill_tokens=2500)
    ttft, queue, prefill = predict_ttft(replica(load), ask(500), cached=0)
    ahead = CHUNK / RATE + DECODE_S
    assert queue == pytest.approx(0.25 + 3 * DECODE_S + 1.5 * ahead)
    assert prefill == pytest.approx(0.05)
    assert ttft == pytest.approx(queue + 0.05 + DECODE_S)


def test_routed_requests_count_as_busy_before_any_heartbeat() -> None:
    """A replica with requests routed but not yet reported is busy: the rounds in flight are paid."""
    ttft, queue, _ = predict_ttft(replica(inflight=1), ask(500), cached=0)
    assert queue == pytest.approx(1.5 * DECODE_S)  # routed prompts of 0 tokens: an empty queue, decode rounds in flight
    assert ttft == pytest.approx(1.5 * DECODE_S + 0.05 + DECODE_S)


def test_a_measured_rate_goes_with_the_decode_round_it_was_measured_net_of() -> None:
    """Measured 20k tokens/s with no decode-only round seen (decode 0): the queue's chunks add no decode rounds,
    since the measured rate already holds them; the rounds in flight still take the registered decode round."""
    load = ReplicaLoad(running=4, queued_prefill_tokens=2500, prefill_tokens_per_s=20_000.0)
    ttft, queue, prefill = predict_ttft(replica(load), ask(500), cached=0)
    assert queue == pytest.approx(2500 / 20_000 + 1.5 * (CHUNK / 20_000 + DECODE_S))
    assert ttft == pytest.approx(queue + 500 / 20_000)
    measured = ReplicaLoad(running=4, queued_prefill_tokens=2500, prefill_tokens_per_s=20_000.0, decode_round_s=0.02)
    _, queue2, _ = predict_ttft(replica(measured), ask(500), cached=0)
    assert queue2 == pytest.approx(2500 / 20_000 + 3 * 0.02 + 1.5 * (CHUNK / 20_000 + 0.02))



def _core_prefill_rounds(start: int, end: int, charge: dict[str, int]) -> tuple[int, int]:
    """Rounds the scheduler core takes to prefill a prompt of `end` tokens whose first `start` are cached (a request
    with that prefix ran before), alone on the replica; and where its first chunk started."""
    core = make_core(num_blocks=2048, block_size=16, max_num_batched_tokens=256, max_prefill_chunk=2048,
                     max_model_len=16384, **charge)
    prompt = tuple(range(1, end + 1))
    now = 0.0
    if start:
        core.submit(make_request("prefix", prompt=prompt[:start], max_tokens=1), now)
        while core.num_waiting or core.num_running:
            step(core, now)
            now += 1.0
    core.submit(make_request("p", prompt=prompt, max_tokens=2), now)
    rounds, first = 0, -1
    while True:
        plan, _ = step(core, now)
        now += 1.0
        seq = next(s for s in plan.seqs if s.request_id == "p")
        first = seq.start_position if first < 0 else first
        rounds += 1
        if seq.start_position + len(seq.token_ids) >= end:
            return rounds, first


@pytest.mark.parametrize(("start", "end"), [(0, 4000), (0, 1000), (1504, 6000), (3008, 3300), (0, 12000)])
def test_prefill_rounds_count_the_chunks_the_attention_charge_leaves(start: int, end: int) -> None:
    """Under the scheduler's attention charge the router counts the rounds a prompt's prefill takes as the core
    cuts them: a prompt whose first `start` tokens are cached, alone on the scheduler core with the same budget and
    charge, takes what `prefill_rounds` says within 5% (or one round); without the charge, ceil(tokens / budget)."""
    charge = {"attention_pairs_per_token": 1024, "attention_free_context": 64}
    rounds, first = _core_prefill_rounds(start, end, charge)
    assert first == start, "the cached prefix is not prefilled again"
    predicted = prefill_rounds(ReplicaSpec("r", "m", block_size=16, max_num_batched_tokens=256, **charge), start, end)
    assert abs(predicted - rounds) <= max(1.0, 0.05 * rounds), (predicted, rounds)
    plain_rounds, _ = _core_prefill_rounds(start, end, {})
    assert prefill_rounds(ReplicaSpec("r", "m", block_size=16, max_num_batched_tokens=256), start, end) == plain_rounds
