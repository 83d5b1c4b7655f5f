"""The pure parts of admission's hand-off: which routes make a prefill half, and which completion ends one."""

from __future__ import annotations

from opentelemetry.trace import INVALID_SPAN

from admission_svc.calls import HandOff, Tracked
from admission_svc.handoff import is_prefill_done, pair_of
from admission_svc.streams import RequestStream
from sluice.v1 import common_pb2, events_pb2, router_pb2


def make_record(attempt: str = "r") -> Tracked:
    record = Tracked("r", "t", 40, RequestStream("r"), INVALID_SPAN, 0.0)
    record.attempt_id = attempt
    return record


def test_a_pair_with_two_ends_makes_a_prefill_half_unless_one_token_is_asked() -> None:
    """A route naming another decode replica makes the current attempt a prefill half (its KV held there); no decode
    replica, the same replica at both ends, or one token left makes none."""
    record = make_record("r#2")
    pair = router_pb2.RouteResponse(replica_id="p", scheduler_address="p:1", decode_replica_id="d",
                                    decode_scheduler_address="d:1", decode_incarnation="i-d")
    assert pair_of(record, pair, 16) == HandOff("r#2", "p", "p:1", "d", "d:1", "i-d")
    assert pair_of(record, pair, 1) is None
    assert pair_of(record, router_pb2.RouteResponse(replica_id="p", scheduler_address="p:1"), 16) is None
    same = router_pb2.RouteResponse(replica_id="b", scheduler_address="b:1", decode_replica_id="b")
    assert pair_of(record, same, 16) is None


def test_only_the_prefill_attempts_length_end_starts_the_decode_half() -> None:
    """FINISHED_LENGTH of the prefill attempt hands off; a stop token, a cancel, another attempt's completion, or a
    record without a pending hand-off ends the request as usual."""
    record = make_record()
    record.handoff = HandOff("r", "p", "p:1", "d", "d:1")

    def done(status: int, request_id: str = "r") -> events_pb2.Completion:
        return events_pb2.Completion(request_id=request_id, status=status)  # type: ignore[arg-type]

    assert is_prefill_done(record, done(common_pb2.FINISHED_LENGTH))
    assert not is_prefill_done(record, done(common_pb2.FINISHED_STOP))
    assert not is_prefill_done(record, done(common_pb2.CANCELLED))
    assert not is_prefill_done(record, done(common_pb2.FINISHED_LENGTH, "r#1"))
    record.handoff = None
    assert not is_prefill_done(record, done(common_pb2.FINISHED_LENGTH))
