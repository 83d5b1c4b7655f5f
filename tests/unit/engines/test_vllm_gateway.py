"""The gateway core in front of a vLLM engine: bounded dispatch, fair order, deferred cancel, hand-off, no resurrection."""

from __future__ import annotations

import pytest

from scheduler_svc.core.config import Policy
from scheduler_svc.engines.vllm.gateway import EngineView, GatewayConfig, GatewayCore
from sluice.core_errors import RequestRejected
from sluice.types import DRAIN_HANDOFF, NewRequest, RejectReason, RequestStatus, SamplingParams, Stage


def make_core(**overrides: object) -> GatewayCore:
    settings: dict[str, object] = {"model_id": "tiny", "block_size": 4, "max_model_len": 256, "max_inflight": 2}
    settings.update(overrides)
    return GatewayCore(GatewayConfig(**settings))  # type: ignore[arg-type]


def make_request(request_id: str, tenant: str = "default", prompt: int = 8, max_tokens: int = 4, **kw: object) -> NewRequest:
    return NewRequest(request_id=request_id, prompt_token_ids=tuple(range(1, prompt + 1)),
                      sampling=SamplingParams(max_tokens=max_tokens), tenant=tenant, **kw)  # type: ignore[arg-type]


def test_dispatch_is_bounded_by_max_inflight_and_the_rest_waits() -> None:
    """Only max_inflight requests go to the engine; the next goes when one ends."""
    core = make_core()
    for i in range(3):
        core.submit(make_request(f"r{i}"), 0.0)
    assert [r.request_id for r in core.dispatch(1.0)] == ["r0", "r1"]
    assert core.dispatch(1.0) == [] and core.num_waiting == 1
    core.on_tokens("r0", [5], 2.0)
    core.on_finished("r0", True, 2.0)
    assert [r.request_id for r in core.dispatch(2.0)] == ["r2"]


def test_fair_share_dispatches_two_to_one_by_weight() -> None:
    """With weights 2:1 and both tenants backlogged, dispatch (and so service) follows 2:1."""
    core = make_core(policy=Policy.FAIR, max_inflight=1, tenant_weights=(("gold", 2.0), ("bronze", 1.0)))
    for i in range(30):
        core.submit(make_request(f"g{i}", "gold"), 0.0)
        core.submit(make_request(f"b{i}", "bronze"), 0.0)
    served = {"gold": 0, "bronze": 0}
    for step in range(30):
        (request,) = core.dispatch(float(step))
        core.on_tokens(request.request_id, [1, 2, 3, 4], float(step))
        core.on_finished(request.request_id, False, float(step))
        served[request.tenant] += 1
    assert served == {"gold": 20, "bronze": 10}


def test_cancel_of_a_dispatched_request_waits_for_the_engines_abort() -> None:
    """A cancel while on the engine is CANCELLING until the abort is done; only then does it end, exactly once."""
    core = make_core()
    core.submit(make_request("a"), 0.0)
    core.dispatch(0.0)
    core.take_events()
    assert core.cancel("a", 1.0) is RequestStatus.CANCELLING
    assert core.take_aborts() == ["a"]
    assert core.take_events().finished == []
    assert core.on_tokens("a", [9], 1.5) is False  # a late token never reaches the client
    assert core.on_aborted("a", 2.0)
    events = core.take_events()
    assert [(f.request_id, f.status) for f in events.finished] == [("a", RequestStatus.CANCELLED)]
    assert Stage.KV_RELEASED in {e.stage for e in events.lifecycle}
    assert events.tokens == []
    assert core.on_aborted("a", 3.0) is False and core.cancel("a", 3.0) is None


def test_cancel_of_a_queued_request_ends_it_at_once() -> None:
    """A request still queued here is cancelled without touching the engine."""
    core = make_core(max_inflight=1)
    core.submit(make_request("a"), 0.0)
    core.submit(make_request("b"), 0.0)
    core.dispatch(0.0)
    assert core.cancel("b", 1.0) is RequestStatus.CANCELLED
    assert core.take_aborts() == []
    assert [f.request_id for f in core.take_events().finished] == ["b"]


def test_engine_lost_hands_every_live_request_to_migration() -> None:
    """Queued and dispatched requests end CANCELLED with DRAIN_HANDOFF (admission migrates them); tokens after are dropped."""
    core = make_core(max_inflight=1)
    core.submit(make_request("a"), 0.0)
    core.submit(make_request("b"), 0.0)
    core.dispatch(0.0)
    core.on_tokens("a", [7, 8], 0.5)
    core.take_events()
    assert sorted(core.on_engine_lost(1.0)) == ["a", "b"]
    finished = core.take_events().finished
    assert {(f.request_id, f.status, f.detail) for f in finished} == {
        ("a", RequestStatus.CANCELLED, DRAIN_HANDOFF), ("b", RequestStatus.CANCELLED, DRAIN_HANDOFF)}
    assert next(f for f in finished if f.request_id == "a").output_token_ids == (7, 8)
    assert core.on_tokens("a", [9], 1.1) is False and core.live_request_ids() == []


def test_tokens_past_max_tokens_never_reach_the_client() -> None:
    """The engine streaming more than max_tokens is cut at max_tokens, and the end says length."""
    core = make_core()
    core.submit(make_request("a", max_tokens=3), 0.0)
    core.dispatch(0.0)
    core.on_tokens("a", [1, 2], 0.1)
    core.on_tokens("a", [3, 4, 5], 0.2)
    core.on_finished("a", True, 0.3)
    events = core.take_events()
    assert [t for _, _, t in events.tokens] == [1, 2, 3]
    assert [i for _, i, _ in events.tokens] == [0, 1, 2]
    assert events.finished[0].status is RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize(("request_kw", "reason"), [
    ({"prompt": 250, "max_tokens": 10}, RejectReason.NEVER_FITS),
    ({"prompt": 8, "max_tokens": 0}, RejectReason.INVALID),
])
def test_submissions_the_engine_could_never_serve_are_refused_unchanged(request_kw: dict[str, int],
                                                                      reason: RejectReason) -> None:
    """Over the model length or without output: refused with the reason, nothing queued."""
    core = make_core()
    with pytest.raises(RequestRejected) as caught:
        core.submit(make_request("x", **request_kw), 0.0)
    assert caught.value.reason is reason and core.num_waiting == 0 and core.live_request_ids() == []


def test_a_full_queue_refuses_and_a_duplicate_id_is_refused() -> None:
    """The gateway's queue is bounded (QUEUE_FULL) and ids are unique while live (DUPLICATE)."""
    core = make_core(max_waiting=1, max_inflight=1)
    core.submit(make_request("a"), 0.0)
    with pytest.raises(RequestRejected) as dup:
        core.submit(make_request("a"), 0.0)
    assert dup.value.reason is RejectReason.DUPLICATE
    with pytest.raises(RequestRejected) as full:
        core.submit(make_request("b"), 0.0)
    assert full.value.reason is RejectReason.QUEUE_FULL


def test_deadlines_time_out_queued_at_once_and_dispatched_after_the_abort() -> None:
    """A queue deadline ends a waiting request TIMED_OUT; a total deadline aborts a running one first."""
    core = make_core(max_inflight=1)
    core.submit(make_request("run", deadline=5.0), 0.0)
    core.submit(make_request("wait", queue_deadline=2.0), 0.0)
    core.dispatch(0.0)
    assert core.next_deadline() == 2.0
    core.expire(2.0)
    assert [(f.request_id, f.status) for f in core.take_events().finished] == [("wait", RequestStatus.TIMED_OUT)]
    core.expire(5.0)
    assert core.take_aborts() == ["run"]
    core.on_aborted("run", 5.1)
    assert [f.status for f in core.take_events().finished] == [RequestStatus.TIMED_OUT]


def test_stats_combine_the_queue_here_with_the_engines_view() -> None:
    """Waiting counts this queue and the engine's; KV use and prefix counters come from the engine since the first view."""
    core = make_core(num_blocks=100, max_inflight=1)
    core.submit(make_request("a"), 0.0)
    core.submit(make_request("b"), 0.0)
    core.dispatch(0.0)
    core.on_engine_view(EngineView(prefix_hit_tokens=10, prefix_query_tokens=40))
    core.on_engine_view(EngineView(waiting=2, running=1, kv_usage=0.25, prefix_hit_tokens=30, prefix_query_tokens=80))
    stats = core.stats()
    assert (stats.waiting, stats.running, stats.kv_blocks_used, stats.kv_blocks_free) == (3, 1, 25, 75)
    assert (stats.prefix_hit_tokens, stats.prefix_query_tokens) == (20, 40)
    assert stats.queued_prefill_tokens == 16


def test_a_restarted_engines_counters_never_take_the_replicas_totals_back() -> None:
    """vLLM's counters start from 0 again after a restart: the replica's totals keep what was counted before."""
    core = make_core()
    core.on_engine_view(EngineView(prefix_hit_tokens=100, prefix_query_tokens=400, preemptions=3))
    core.on_engine_view(EngineView(prefix_hit_tokens=150, prefix_query_tokens=500, preemptions=4))
    core.on_engine_view(EngineView(prefix_hit_tokens=10, prefix_query_tokens=20, preemptions=0))  # restarted
    stats = core.stats()
    assert (stats.prefix_hit_tokens, stats.prefix_query_tokens, stats.preemptions) == (60, 120, 1)


def test_a_requests_stream_interval_is_kept_while_it_lives_and_forgotten_however_it_ends() -> None:
    """What the agent asks vLLM for per request: kept from submit to the end, whether it finished, was cancelled in
    the queue or handed over with a lost engine (nothing left behind)."""
    core = make_core(max_inflight=1)
    core.submit(make_request("a"), 0.0, stream_interval=6)
    core.submit(make_request("b"), 0.0, stream_interval=3)
    core.submit(make_request("c"), 0.0)
    core.submit(make_request("d"), 0.0, stream_interval=5)
    assert [core.stream_interval(i) for i in "abcd"] == [6, 3, 1, 5]
    assert [r.request_id for r in core.dispatch(1.0)] == ["a"]
    core.on_tokens("a", [5], 2.0)
    core.on_finished("a", True, 2.0)
    core.cancel("b", 2.0)
    core.on_engine_lost(3.0)
    assert core.live_request_ids() == []
    assert [core.stream_interval(i) for i in "abcd"] == [1, 1, 1, 1]
    assert core._stream_intervals == {}  # noqa: SLF001 (nothing held for ended requests)
