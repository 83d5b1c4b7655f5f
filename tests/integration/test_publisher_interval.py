"""Publications spaced by an interval (--publish-interval-ms): rounds' tokens that come faster wait and go out as one
entry, each request's run of tokens as one delta; a request's first tokens, a completion, a flush and stopping go out
at once. `merge`'s rules for joining deltas. Real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from opentelemetry.context import Context

from scheduler_svc.__main__ import parse_args, publish_interval_seconds
from scheduler_svc.publisher import Outgoing, Publisher, merge
from sluice.bus import Bus, redis_client
from sluice.serve import StartupError
from sluice.v1 import common_pb2, events_pb2

pytestmark = pytest.mark.redis

OWNER = "adm-i"


def _tokens(*deltas: tuple[str, int, list[int]], urgent: bool = False, owner: str = OWNER,
            logprobs: bool = False) -> Outgoing:
    batch = events_pb2.TokenDeltaBatch()
    for request_id, index, token_ids in deltas:
        delta = batch.deltas.add(request_id=request_id, index=index, token_ids=token_ids, created_unix_s=index + 0.5)
        if logprobs:
            for token in token_ids:
                delta.logprobs.add(logprob=-1.0, top_token_ids=[token])
    return Outgoing(tokens={owner: batch}, urgent=urgent)


def _runs(out: Outgoing, owner: str = OWNER) -> list[tuple[str, int, list[int], int]]:
    return [(d.request_id, d.index, list(d.token_ids), len(d.logprobs)) for d in out.tokens[owner].deltas]


def test_merge_joins_a_requests_consecutive_deltas_and_nothing_else() -> None:
    """A delta continuing its request's previous one (next index) is appended to it, keeping the first one's stamp;
    a gap, another request, another owner or log-probabilities on one side only keep their own delta."""
    merged = merge([
        _tokens(("a", 0, [10]), ("b", 0, [20])),
        _tokens(("a", 1, [11, 12]), ("b", 2, [22])),  # b skips index 1: kept apart
        _tokens(("a", 3, [13]), ("c", 0, [30])),
        _tokens(("a", 4, [14]), owner="adm-other"),
    ])
    assert _runs(merged) == [("a", 0, [10, 11, 12, 13], 0), ("b", 0, [20], 0), ("b", 2, [22], 0), ("c", 0, [30], 0)]
    assert merged.tokens[OWNER].deltas[0].created_unix_s == 0.5
    assert _runs(merged, "adm-other") == [("a", 4, [14], 0)]
    with_logprobs = merge([_tokens(("a", 0, [10]), logprobs=True), _tokens(("a", 1, [11, 12]), logprobs=True),
                           _tokens(("a", 3, [13]))])
    assert _runs(with_logprobs) == [("a", 0, [10, 11, 12], 3), ("a", 3, [13], 0)]
    assert [lp.top_token_ids[0] for lp in with_logprobs.tokens[OWNER].deltas[0].logprobs] == [10, 11, 12]
    assert not merge([_tokens(("a", 0, [10])), _tokens(("a", 1, [11]))]).urgent
    assert merge([_tokens(("a", 0, [10])), _tokens(("b", 0, [20]), urgent=True)]).urgent


async def _entries(bus: Bus) -> list[list[tuple[str, int, list[int]]]]:
    return [[(d.request_id, d.index, list(d.token_ids)) for d in deltas]
            for _, deltas in await bus.read_tokens(bus.tokens_stream(OWNER), "0", count=1000, block_ms=10)]


async def _until(bus: Bus, count: int, within_s: float) -> list[list[tuple[str, int, list[int]]]]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while len(entries := await _entries(bus)) < count:
        assert loop.time() < deadline, f"{len(entries)} token entries after {within_s} s, {count} expected: {entries}"
        await asyncio.sleep(0.01)
    return entries


def _scenario(redis_url: str, namespace: str, interval_s: float,
              body: Callable[[Bus, Publisher, list[int]], Awaitable[Any]]) -> Any:
    async def run() -> Any:
        bus = Bus(redis_client(redis_url), namespace)
        spaced: list[int] = []
        publisher = Publisher(bus, token_interval_s=interval_s, on_spaced=spaced.append)
        task = asyncio.create_task(publisher.run())
        try:
            return await body(bus, publisher, spaced)
        finally:
            await publisher.close()
            await publisher.wait_closed(task, grace_s=30.0)
            await bus.client.aclose()

    return asyncio.run(run())


@pytest.mark.parametrize("release", ["first_token", "completion", "flush", "close"])
def test_within_the_interval_tokens_wait_until_something_goes_out_at_once(
        redis_url: str, namespace: str, release: str) -> None:
    """The first publication goes out at once; rounds after it wait for the interval (30 s here), merged; a batch with
    a request's first token, a completion, a flush or stopping publishes everything waiting at once, as one entry."""
    async def body(bus: Bus, publisher: Publisher, spaced: list[int]) -> list[list[tuple[str, int, list[int]]]]:
        publisher.put(_tokens(("a", 0, [10]), urgent=True))
        assert await _until(bus, 1, 10.0) == [[("a", 0, [10])]]
        publisher.put(_tokens(("a", 1, [11])))
        publisher.put(_tokens(("a", 2, [12])))
        await asyncio.sleep(0.3)
        assert len(await _entries(bus)) == 1, "rounds within the interval wait"
        if release == "first_token":
            publisher.put(_tokens(("a", 3, [13]), ("b", 0, [20]), urgent=True))
        elif release == "completion":
            publisher.put(Outgoing(completions=[(events_pb2.Completion(request_id="z", replica_id="r",
                                                                      status=common_pb2.FINISHED_STOP), Context())]))
        elif release == "flush":
            assert await publisher.flush(grace_s=10.0)
        else:
            await publisher.close()
        entries = await _until(bus, 2, 10.0)
        assert spaced == [2 + (release == "first_token")], "one publication waited, with the rounds' batches"
        return entries

    entries = _scenario(redis_url, namespace, 30.0, body)
    second = [("a", 1, [11, 12, 13]), ("b", 0, [20])] if release == "first_token" else [("a", 1, [11, 12])]
    assert entries == [[("a", 0, [10])], second]


def test_rounds_slower_than_the_interval_do_not_wait(redis_url: str, namespace: str) -> None:
    """A round that comes after the interval has passed goes out at once, on its own."""
    async def body(bus: Bus, publisher: Publisher, spaced: list[int]) -> list[list[tuple[str, int, list[int]]]]:
        for index in range(3):
            publisher.put(_tokens(("a", index, [10 + index]), urgent=index == 0))
            await _until(bus, index + 1, 10.0)
            await asyncio.sleep(0.06)
        assert spaced == []
        return await _entries(bus)

    assert _scenario(redis_url, namespace, 0.05, body) == [[("a", i, [10 + i])] for i in range(3)]


def test_spaced_rounds_go_out_once_the_interval_has_passed(redis_url: str, namespace: str) -> None:
    """Rounds that come within the interval go out together when it ends, not before, without anything else."""
    async def body(bus: Bus, publisher: Publisher, spaced: list[int]) -> tuple[list[Any], float]:
        loop = asyncio.get_running_loop()
        publisher.put(_tokens(("a", 0, [10]), urgent=True))
        await _until(bus, 1, 10.0)
        began = loop.time()
        publisher.put(_tokens(("a", 1, [11])))
        publisher.put(_tokens(("a", 2, [12])))
        entries = await _until(bus, 2, 10.0)
        return entries, loop.time() - began

    entries, after_s = _scenario(redis_url, namespace, 0.25, body)
    assert entries == [[("a", 0, [10])], [("a", 1, [11, 12])]]
    assert after_s >= 0.2


@pytest.mark.parametrize("interval_ms", ["-1", "nan", "inf"])
def test_a_negative_or_not_finite_interval_is_refused_naming_it(interval_ms: str) -> None:
    """The flag stops the scheduler at start naming it; the publisher refuses such an interval too."""
    with pytest.raises(StartupError, match="--publish-interval-ms"):
        publish_interval_seconds(parse_args(["--replica-id", "r", "--publish-interval-ms", interval_ms]))
    with pytest.raises(ValueError, match="token_interval_s"):
        Publisher(None, token_interval_s=float(interval_ms) / 1000)  # type: ignore[arg-type]
    assert publish_interval_seconds(parse_args(["--replica-id", "r", "--publish-interval-ms", "5"])) == 0.005
