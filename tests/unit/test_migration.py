"""The pure parts of migration: the watchdog's rule, attempt ids, and a stream retargeted to its next attempt."""

from __future__ import annotations

import asyncio

from admission_svc.migration import Listed, MigrationCause, Stalled, attempt_id, decide
from admission_svc.streams import StreamRegistry
from sluice.types import origin_request_id
from sluice.v1 import events_pb2, router_pb2


def test_decide_moves_a_stalled_request_only_when_its_replica_is_lost() -> None:
    """Gone or unlisted -> REPLICA_GONE, UNHEALTHY -> WORKER_DOWN, a scheduler failing its probe -> SCHEDULER_GONE;
    a READY or DRAINING replica whose scheduler answers keeps its (merely queued) request; without the router's
    listing only the probe decides."""
    stalled = [Stalled("gone", "r-gone", "a"), Stalled("unlisted", "r-x", "a"), Stalled("sick", "r-sick", "a"),
               Stalled("dead", "r-dead", "b"), Stalled("queued", "r-ok", "a"), Stalled("draining", "r-drain", "a")]
    states = {"r-gone": Listed(router_pb2.GONE), "r-sick": Listed(router_pb2.UNHEALTHY),
              "r-dead": Listed(router_pb2.READY), "r-ok": Listed(router_pb2.READY),
              "r-drain": Listed(router_pb2.DRAINING)}
    assert decide(stalled, states, {"a": True, "b": False}) == [
        ("gone", MigrationCause.REPLICA_GONE), ("unlisted", MigrationCause.REPLICA_GONE),
        ("sick", MigrationCause.WORKER_DOWN), ("dead", MigrationCause.SCHEDULER_GONE)]
    assert decide(stalled, None, {"a": True, "b": False}) == [("dead", MigrationCause.SCHEDULER_GONE)]
    assert decide([], states, {}) == []


def test_decide_names_a_dead_scheduler_even_when_a_report_made_its_replica_unhealthy() -> None:
    """A replica that ReportUnreachable made UNHEALTHY (its scheduler died) moves its requests as SCHEDULER_GONE
    when the probe is refused too, and as WORKER_DOWN while its scheduler answers."""
    stalled = [Stalled("dead", "r-1", "a"), Stalled("sick", "r-2", "b")]
    states = {"r-1": Listed(router_pb2.UNHEALTHY), "r-2": Listed(router_pb2.UNHEALTHY)}
    assert decide(stalled, states, {"a": False, "b": True}) == [
        ("dead", MigrationCause.SCHEDULER_GONE), ("sick", MigrationCause.WORKER_DOWN)]


def test_decide_moves_a_request_whose_replica_is_listed_under_another_incarnation() -> None:
    """A READY replica whose scheduler answers, but listed under another incarnation than the request was routed
    to (its scheduler restarted on the same address), loses the request: REPLICA_RESTARTED. The same incarnation,
    or one side not reporting any, keeps it."""
    stalled = [Stalled("lost", "r-1", "a", "inc-old"), Stalled("kept", "r-2", "a", "inc-2"),
               Stalled("unreported", "r-1", "a", "")]
    states = {"r-1": Listed(router_pb2.READY, "inc-new"), "r-2": Listed(router_pb2.READY, "inc-2")}
    assert decide(stalled, states, {"a": True}) == [("lost", MigrationCause.REPLICA_RESTARTED)]


def test_attempt_ids_name_the_request_they_continue() -> None:
    """Attempt 0 is the request id itself; attempt n is `id#n`, whose origin is the id."""
    assert attempt_id("req", 0) == "req" and attempt_id("req", 2) == "req#2"
    assert origin_request_id("req#2") == "req" == origin_request_id("req")


def test_a_retargeted_stream_continues_its_indices_and_drops_the_old_attempts_tokens() -> None:
    """After retarget(id#1, 3) the new attempt's token 0 is output index 3; a late delta of the old attempt is
    dropped as stale, and the stream holds every token once, in order."""
    async def play() -> list[int]:
        registry = StreamRegistry()
        stream = registry.open("req")
        registry.on_delta(events_pb2.TokenDelta(request_id="req", index=0, token_ids=[10, 11, 12]), 0.0)
        registry.retarget(stream, "req#1", len(stream.tokens))
        registry.on_delta(events_pb2.TokenDelta(request_id="req", index=3, token_ids=[99]), 0.0)
        registry.on_delta(events_pb2.TokenDelta(request_id="req#1", index=0, token_ids=[13, 14]), 0.0)
        registry.on_delta(events_pb2.TokenDelta(request_id="req#1", index=1, token_ids=[14, 15]), 0.0)
        assert (registry.stale_deltas, stream.duplicates, stream.missing_tokens) == (1, 1, 0)
        return stream.tokens

    assert asyncio.run(play()) == [10, 11, 12, 13, 14, 15]
