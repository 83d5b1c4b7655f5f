"""A client that leaves just as its request completes adds nothing to the request's ended span.

The race behind `Tried calling _add_event on an ended span` (about once per 75 HTTP requests): the last
follower of a stream goes away, the front door schedules a Cancel for the request nobody follows, and before
that task runs the completion lands and ends the span. The Cancel must then see that the request has ended.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from admission_svc.calls import Caller, GenerateCall
from admission_svc.frontdoor import FrontDoor
from sluice.bus import Bus
from sluice.types import SamplingParams
from sluice.v1 import common_pb2, events_pb2
from tests.integration.admission_harness import OWNER, StandInReplica, run, settle

pytestmark = pytest.mark.redis


def test_a_follower_leaving_as_the_completion_lands_adds_no_event_after_the_span_ended(
        tmp_path: Path, redis_url: str, namespace: str, span_exporter: InMemorySpanExporter,
        caplog: pytest.LogCaptureFixture) -> None:
    """The Cancel scheduled when the last follower left finds the request ended: no span event, no Cancel RPC."""

    async def body(_target: str, door: FrontDoor, replica: StandInReplica, _bus: Bus) -> None:
        replica.output = [104]  # one token, then (unconsumed here) its completion
        record = await door.start(GenerateCall(prompt="hi", sampling=SamplingParams(max_tokens=1)),
                                  Caller(api_key="k-acme"))
        follower = door.stream(record)
        first = await follower.__anext__()
        assert first.token_ids == (104,) or list(first.token_ids) == [104]
        await follower.aclose()  # the client leaves: the front door schedules a Cancel nobody waits for
        door.complete(record.request_id, record, events_pb2.Completion(  # ...and the completion lands first
            request_id=record.request_id, tenant=record.tenant, status=common_pb2.FINISHED_LENGTH,
            finish_reason="length", owner=OWNER, usage=common_pb2.Usage(input_tokens=2, output_tokens=1)))
        assert record.ended
        await asyncio.sleep(0.2)  # the scheduled Cancel runs now
        assert await settle(lambda: not door._tasks)
        assert replica.cancelled == []

    with caplog.at_level(logging.WARNING, logger="opentelemetry.sdk.trace"):
        run(tmp_path, redis_url, namespace, body, consume=False)
    assert [r.getMessage() for r in caplog.records if "ended span" in r.getMessage()] == []
    spans = [s for s in span_exporter.get_finished_spans() if s.attributes.get("sluice.status") == "FINISHED_LENGTH"]
    assert len(spans) == 1
    assert [e.name for e in spans[0].events][-1] == "completed"
