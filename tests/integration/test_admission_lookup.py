"""Completions the watchdog fetches with Lookup are judged by their bus copy, not called lost at the fetch.

A real admission gRPC server and Redis bus, with the watchdog running, in front of a stand-in scheduler that answers
Lookup and holds back (or never publishes) a completion's bus copy (tests/integration/admission_harness.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from admission_svc.frontdoor import FrontDoor, FrontDoorConfig
from sluice import client as sdk
from sluice.bus import Bus
from tests.integration.admission_harness import StandInReplica, run, settle

pytestmark = pytest.mark.redis

NO_RETRY = sdk.RetryPolicy(max_attempts=1)
LOST_WARNING = "lost on the bus"


def _watchful(grace_s: float) -> FrontDoorConfig:
    """A front door whose watchdog looks up a request quiet for 0.3 s, and waits `grace_s` for a bus copy."""
    return FrontDoorConfig(stall_timeout_s=0.3, watch_interval_s=0.1, completion_fetch_grace_s=grace_s)


@contextlib.asynccontextmanager
async def _watchdog(door: FrontDoor) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(door.migrator.watch(stop))
    try:
        yield
    finally:
        stop.set()
        await task


def _fetched(door: FrontDoor, outcome: str) -> float:
    return door.metrics.completions_fetched.labels(outcome)._value.get()


def _lines(caplog: pytest.LogCaptureFixture, text: str, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and text in r.getMessage()]


def test_a_completion_whose_bus_copy_comes_after_the_fetch_is_late_and_warns_of_nothing(
        tmp_path: Path, redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture,
        span_exporter: InMemorySpanExporter) -> None:
    """The scheduler's completion reaches the bus 3 s after it ended: the watchdog fetches it first and the client
    gets its end from the fetch; when the bus copy comes, the fetch is counted late (not lost), no WARNING is
    logged, the fetch is an INFO line and a `completion_fetched` span event, and nothing stays remembered."""
    caplog.set_level(logging.DEBUG, logger="admission_svc")

    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.completion_delay_s = 3.0
        async with _watchdog(door), sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            generation = await client.generate_text("hi", max_tokens=11)
            assert (generation.finish_reason, generation.usage.output_tokens) == ("length", 11)
            assert _fetched(door, "late") == 0  # the client's end came from the fetch, before the bus copy
            assert await settle(lambda: _fetched(door, "late") == 1, timeout_s=8.0)
        assert (_fetched(door, "lost"), _fetched(door, "unresolved"), len(door.lookups.fetches)) == (0, 0, 0)
        assert await settle(lambda: door.core.stats(0).active == 0) and door.core.released == 1
        request_id = generation.request_id
        assert len(_lines(caplog, f"request {request_id}: its completion was fetched", logging.INFO)) == 1
        assert len(_lines(caplog, f"request {request_id}: the bus copy of its fetched completion came",
                          logging.DEBUG)) == 1
        root = [s for s in span_exporter.get_finished_spans() if s.parent is None]
        assert [e.attributes["sluice.attempt_id"] for s in root for e in s.events
                if e.name == "completion_fetched"] == [request_id]

    run(tmp_path, redis_url, namespace, body, door_config=_watchful(grace_s=10.0))
    assert _lines(caplog, LOST_WARNING, logging.WARNING) == []


def test_a_completion_never_published_on_the_bus_is_lost_after_the_grace_with_a_warning(
        tmp_path: Path, redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    """The scheduler's completion never reaches the bus (as a Redis restart loses it): the fetch ends the request
    at once, and once the grace has passed with no bus copy it is counted lost, with one WARNING naming the request
    and the seconds since the fetch, and not before."""
    caplog.set_level(logging.INFO, logger="admission_svc")

    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.completion_delay_s = None
        async with _watchdog(door), sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            generation = await client.generate_text("hi", max_tokens=11)
            assert (generation.finish_reason, generation.usage.output_tokens) == ("length", 11)
            assert (_fetched(door, "lost"), len(door.lookups.fetches)) == (0, 1)  # within the grace: unjudged
            assert _lines(caplog, LOST_WARNING, logging.WARNING) == []
            assert await settle(lambda: _fetched(door, "lost") == 1, timeout_s=8.0)
        assert (_fetched(door, "late"), _fetched(door, "unresolved"), len(door.lookups.fetches)) == (0, 0, 0)
        assert await settle(lambda: door.core.stats(0).active == 0) and door.core.released == 1
        warnings = _lines(caplog, LOST_WARNING, logging.WARNING)
        assert len(warnings) == 1 and warnings[0].startswith(f"request {generation.request_id}: "), warnings
        assert "fetched from its scheduler" in warnings[0]
        assert float(warnings[0].split("scheduler ")[1].split(" s ago")[0]) >= 2.0

    run(tmp_path, redis_url, namespace, body, door_config=_watchful(grace_s=2.0))


def test_a_bus_copy_that_comes_while_the_lookup_is_under_way_is_no_fetch(
        tmp_path: Path, redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    """The bus copy reaches admission while the Lookup that also returns the completion is under way: the request
    ended from the bus, so the Lookup's copy supplied nothing: not counted late nor lost, no fetch logged, no
    WARNING after the grace."""
    caplog.set_level(logging.INFO, logger="admission_svc")

    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.completion_delay_s, replica.lookup_publishes_first = None, True
        async with _watchdog(door), sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            generation = await client.generate_text("hi", max_tokens=11)
            assert (generation.finish_reason, generation.usage.output_tokens) == ("length", 11)
            assert await settle(lambda: door.core.stats(0).active == 0) and door.core.released == 1
            await asyncio.sleep(1.0)  # past the grace and a few ticks
        assert [_fetched(door, o) for o in ("late", "lost", "unresolved")] == [0, 0, 0]
        assert len(door.lookups.fetches) == 0
        assert _lines(caplog, "its completion was fetched", logging.INFO) == []

    run(tmp_path, redis_url, namespace, body, door_config=_watchful(grace_s=0.5))
    assert _lines(caplog, LOST_WARNING, logging.WARNING) == []


def test_fetched_completions_waiting_for_their_bus_copy_stay_bounded(
        tmp_path: Path, redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    """With room for 2 fetched completions waiting, a third fetch forgets the oldest, counted unresolved (neither
    lost nor late): what admission remembers of fetches never grows past the bound, whatever the grace."""
    caplog.set_level(logging.INFO, logger="admission_svc")

    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.completion_delay_s = None
        async with _watchdog(door), sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            for _ in range(3):
                generation = await client.generate_text("hi", max_tokens=11)
                assert generation.usage.output_tokens == 11
        assert (_fetched(door, "unresolved"), len(door.lookups.fetches)) == (1, 2)
        assert (_fetched(door, "late"), _fetched(door, "lost")) == (0, 0)

    config = FrontDoorConfig(stall_timeout_s=0.3, watch_interval_s=0.1, completion_fetch_grace_s=60.0,
                             max_fetches_awaited=2)
    run(tmp_path, redis_url, namespace, body, door_config=config)
    assert _lines(caplog, LOST_WARNING, logging.WARNING) == []


def test_a_bus_copy_held_while_its_last_token_comes_is_no_fetch_either(
        tmp_path: Path, redis_url: str, namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    """The bus copy comes during the Lookup but overtook the request's last token, so the request holds it (open)
    until that token comes: the Lookup's copy still supplied nothing, and is not counted, logged or warned of."""
    caplog.set_level(logging.INFO, logger="admission_svc")

    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.completion_delay_s, replica.lookup_publishes_first, replica.last_token_delay_s = None, True, 1.0
        async with _watchdog(door), sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            generation = await client.generate_text("hi", max_tokens=11)
            assert (generation.finish_reason, generation.usage.output_tokens) == ("length", 11)
            assert generation.text == "hello world"
            await asyncio.sleep(1.0)  # past the grace and a few ticks
        assert [_fetched(door, o) for o in ("late", "lost", "unresolved")] == [0, 0, 0]
        assert _lines(caplog, "its completion was fetched", logging.INFO) == []
        assert door.metrics.migrations.labels("token_gap")._value.get() == 0

    run(tmp_path, redis_url, namespace, body, door_config=_watchful(grace_s=0.5))
    assert _lines(caplog, LOST_WARNING, logging.WARNING) == []
