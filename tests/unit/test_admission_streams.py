"""The token streams of one admission process (admission_svc/streams.py): coalescing, wake-ups, the reader loop."""

from __future__ import annotations

import asyncio
import contextlib

from admission_svc.streams import RequestStream, StreamItem, StreamRegistry, token_reader_loop
from sluice.v1 import common_pb2, events_pb2


def _delta(request_id: str, index: int, *tokens: int) -> events_pb2.TokenDelta:
    return events_pb2.TokenDelta(request_id=request_id, index=index, token_ids=list(tokens))


def _completion(request_id: str, outputs: int) -> events_pb2.Completion:
    completion = events_pb2.Completion(request_id=request_id, status=common_pb2.FINISHED_LENGTH)
    completion.usage.output_tokens = outputs
    return completion


def test_tokens_ready_together_go_out_as_one_item_in_order_then_the_completion() -> None:
    """Deltas of three rounds that arrive before the follower runs are coalesced into one item (in order, from
    the first one's index and stamp); later tokens come as their own item, then the completion ends the stream."""
    async def play() -> list[StreamItem]:
        registry = StreamRegistry()
        stream = registry.open("r")
        items: list[StreamItem] = []

        async def follower() -> None:
            items.extend([item async for item in stream.follow()])

        task = asyncio.create_task(follower())
        await asyncio.sleep(0)  # the follower waits for its first tokens
        for index, token in enumerate((5, 6, 7)):
            registry.on_delta(_delta("r", index, token), 100.0 + index)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        registry.on_delta(_delta("r", 3, 8), 104.0)
        registry.on_completion(_completion("r", 4))
        await asyncio.wait_for(task, 2)
        return items

    items = asyncio.run(play())
    assert [(i.index, i.tokens, i.emitted_unix_s) for i in items[:2]] == [(0, (5, 6, 7), 100.0), (3, (8,), 104.0)]
    assert len(items) == 3 and items[2].completion is not None and items[2].index == 4


def test_a_waiting_follower_is_woken_by_every_change_and_several_followers_see_the_same_tokens() -> None:
    """Two followers parked on an idle stream are both woken by one delta (no wake-up is lost between their
    checks and their waits) and both get every token once; a late follower replays them from the start."""
    async def play() -> tuple[list[int], list[int], list[int]]:
        registry = StreamRegistry()
        stream = registry.open("r")

        async def tokens() -> list[int]:
            return [t async for item in stream.follow() for t in item.tokens]

        first, second = asyncio.create_task(tokens()), asyncio.create_task(tokens())
        for index in range(3):
            await asyncio.sleep(0)
            registry.on_delta(_delta("r", index, 40 + index), 0.0)
        registry.on_completion(_completion("r", 3))
        late = await tokens()
        return await asyncio.wait_for(first, 2), await asyncio.wait_for(second, 2), late

    assert asyncio.run(play()) == ([40, 41, 42],) * 3


def test_a_completion_waits_out_missing_tokens_for_the_grace_period_then_ends_counting_them() -> None:
    """A completion that counts a token which never arrives ends the stream after grace_s, with the token
    counted as missing (never silently)."""
    async def play() -> tuple[list[StreamItem], int]:
        registry = StreamRegistry()
        stream = registry.open("r")
        registry.on_delta(_delta("r", 0, 9), 0.0)
        registry.on_completion(_completion("r", 2))
        items = [item async for item in stream.follow(grace_s=0.05)]
        return items, stream.missing_tokens

    items, missing = asyncio.run(play())
    assert [i.tokens for i in items] == [(9,), ()] and items[-1].completion is not None and missing == 1


def _reader_order(deltas_in_first_read: int, yield_max_deltas: int = 64) -> list[str]:
    """Run the reader loop over one read of `deltas_in_first_read` deltas of request "r" (then an empty read
    that stops it); return the order of the reads and of the follower's first item."""
    async def play() -> list[str]:
        registry = StreamRegistry()
        stream = registry.open("r")
        order: list[str] = []
        stop = asyncio.Event()
        reads = 0

        async def read_tokens(name: str, last_id: str, count: int, block_ms: int) -> list[tuple[str, list]]:
            nonlocal reads
            reads += 1
            order.append(f"read {reads}")
            if reads == 1:
                return [("1-0", [_delta("r", i, i + 1) for i in range(deltas_in_first_read)])]
            stop.set()
            return []

        async def follower() -> None:
            async for item in stream.follow():
                order.append(f"tokens {len(item.tokens)}")
                return

        task = asyncio.create_task(follower())
        await asyncio.sleep(0)
        await token_reader_loop(read_tokens, "tokens:a", registry, stop, yield_max_deltas=yield_max_deltas)
        await task
        return order

    return asyncio.run(play())


def test_the_reader_loop_lets_woken_followers_run_before_its_next_read_after_a_small_read() -> None:
    """After dispatching a small read, the reader loop yields so the followers it woke take their tokens (all of
    a read's deltas for one request as one item) before it reads again: the next XREAD does not delay a lone
    request's chunk. After a big read it reads first, so the next entries can join the followers' chunks."""
    assert _reader_order(1) == ["read 1", "tokens 1", "read 2"]
    assert _reader_order(3) == ["read 1", "tokens 3", "read 2"]
    assert _reader_order(3, yield_max_deltas=2) == ["read 1", "read 2", "tokens 3"]


def test_a_lost_delta_breaks_the_stream_off_without_filling_the_hole_until_it_is_retargeted() -> None:
    """A delta past the next expected index (entries lost on the bus) is not taken, nor are later ones of that
    attempt: the stream keeps only its exact tokens, tells the gap handler once, and takes the tokens of the
    attempt it is retargeted to from where it broke off."""
    registry = StreamRegistry()
    stream = registry.open("r")
    gaps: list[int | None] = []
    registry.on_gap = lambda s: gaps.append(s.gap_at)
    registry.on_delta(_delta("r", 0, 10, 11), 0.0)
    registry.on_delta(_delta("r", 4, 14), 0.0)
    registry.on_delta(_delta("r", 5, 15), 0.0)
    assert (stream.tokens, stream.gap_at, gaps, stream.missing_tokens) == ([10, 11], 2, [2], 2)
    registry.retarget(stream, "r#1", len(stream.tokens))
    registry.on_delta(_delta("r#1", 0, 12, 13), 0.0)
    assert (stream.tokens, stream.gap_at) == ([10, 11, 12, 13], None)
    assert -1 not in stream.tokens


class _Tap:
    """A tap that takes tokens while `open` (recording them), refuses otherwise, or fails when `broken`."""

    def __init__(self) -> None:
        self.position = 0
        self.open = True
        self.broken = False
        self.taken: list[tuple[int, tuple[int, ...]]] = []

    def take(self, stream: RequestStream) -> bool:
        if self.broken:
            raise RuntimeError("tap failed")
        if not self.open:
            return False
        batch = tuple(stream.tokens[self.position:])
        self.taken.append((self.position, batch))
        self.position += len(batch)
        return True


def test_a_parked_followers_tap_takes_tokens_at_once_without_waking_it_and_it_resumes_after_them() -> None:
    """Tokens that arrive while the tapped follower is parked go to the tap in the delta's call, one take per
    delta, and the follower is not woken by them (no item); what the tap refuses the follower yields from where
    the tap stopped, and the completion ends it. A plain follower beside it still gets every token."""
    async def play() -> tuple[_Tap, list[StreamItem], list[int], list[int]]:
        registry = StreamRegistry()
        stream = registry.open("r")
        tap = _Tap()
        items: list[StreamItem] = []
        wakes: list[int] = []

        async def tapped() -> None:
            async for item in stream.follow(tap=tap):
                items.append(item)

        async def plain() -> list[int]:
            return [t async for item in stream.follow() for t in item.tokens]

        task, other = asyncio.create_task(tapped()), asyncio.create_task(plain())
        await asyncio.sleep(0)
        registry.on_delta(_delta("r", 0, 5), 1.0)
        registry.on_delta(_delta("r", 1, 6, 7), 2.0)
        wakes.append(len(items))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        wakes.append(len(items))  # still parked: nothing was yielded
        tap.open = False
        registry.on_delta(_delta("r", 3, 8), 3.0)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        tap.open = True  # the follower yielded 8 and parked again with the tap at 4
        registry.on_delta(_delta("r", 4, 9), 4.0)
        registry.on_completion(_completion("r", 5))
        await asyncio.wait_for(task, 2)
        return tap, items, wakes, await asyncio.wait_for(other, 2)

    tap, items, wakes, plain_tokens = asyncio.run(play())
    assert wakes == [0, 0]
    assert tap.taken == [(0, (5,)), (1, (6, 7)), (4, (9,))]
    assert [(i.index, i.tokens) for i in items[:-1]] == [(3, (8,))]
    assert items[-1].completion is not None and items[-1].index == 5
    assert plain_tokens == [5, 6, 7, 8, 9]


def test_one_tap_a_stream_a_broken_tap_wakes_its_follower_and_closing_a_parked_follower_removes_its_tap() -> None:
    """A follower parking while another's tap is set parks without its own; a tap that raises is logged, the
    delta's tokens are kept and its follower yields them and every later one itself (the reader is not
    disturbed); a follower closed while parked takes its tap away, and the other follower's tap takes the next
    tokens."""
    async def play() -> tuple[_Tap, _Tap, list[int], list[int], bool]:
        registry = StreamRegistry()
        stream = registry.open("r")
        first, second = _Tap(), _Tap()
        got_first: list[int] = []
        got_second: list[int] = []

        async def follow(tap: _Tap, into: list[int]) -> None:
            async for item in stream.follow(tap=tap):
                into.extend(item.tokens)

        a = asyncio.create_task(follow(first, got_first))
        await asyncio.sleep(0)
        b = asyncio.create_task(follow(second, got_second))
        await asyncio.sleep(0)
        registry.on_delta(_delta("r", 0, 1), 1.0)  # first's tap takes it; second is woken and yields it
        await asyncio.sleep(0)
        first.broken = True
        registry.on_delta(_delta("r", 1, 2), 2.0)  # raises in the tap: kept, both followers woken
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        first_untapped = stream._tap is not first  # noqa: SLF001 - parked again, without its failed tap
        first.broken = False
        registry.on_delta(_delta("r", 2, 3), 3.0)  # first yields it itself; second's tap takes it
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        a.cancel()
        await asyncio.gather(a, return_exceptions=True)
        await asyncio.sleep(0)
        tap_is_seconds = stream._tap is second  # noqa: SLF001 - the state this test is about
        registry.on_delta(_delta("r", 3, 4), 4.0)
        registry.on_completion(_completion("r", 4))
        await asyncio.wait_for(b, 2)
        return first, second, got_first, got_second, tap_is_seconds and first_untapped

    first, second, got_first, got_second, taps_as_said = asyncio.run(play())
    assert first.taken == [(0, (1,))] and got_first == [2, 3]
    assert got_second == [1, 2] and second.taken == [(2, (3,)), (3, (4,))] and taps_as_said


def test_with_a_stream_interval_the_first_token_goes_at_once_then_tokens_wait_for_the_interval_or_the_end() -> None:
    """`follow(interval=3)` with one token a delta: the first token is an item of its own at once, the next ones are
    held until 3 wait, and the completion takes the 1 left; a plain follower beside it gets every token as it comes.
    A tap set by an interval follower holds too: it is told the interval and whether anything was handed on."""
    async def play() -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], list[tuple[int, int, bool]]]:
        registry = StreamRegistry()
        stream = registry.open("r")
        held: list[tuple[int, ...]] = []
        plain: list[tuple[int, ...]] = []

        async def follow(into: list[tuple[int, ...]], interval: int) -> None:
            into.extend([item.tokens async for item in stream.follow(interval=interval) if item.completion is None])

        tasks = [asyncio.create_task(follow(held, 3)), asyncio.create_task(follow(plain, 1))]
        for index in range(8):
            await asyncio.sleep(0)
            registry.on_delta(_delta("r", index, 100 + index), 0.0)
            await asyncio.sleep(0)
        registry.on_completion(_completion("r", 8))
        await asyncio.gather(*tasks)

        told: list[tuple[int, int, bool]] = []

        class Recorder:
            position, interval, sent = 0, 1, False

            def take(self, stream: RequestStream) -> bool:
                told.append((self.position, self.interval, self.sent))
                return True

        other = registry.open("s")
        follower = other.follow(interval=5, tap=Recorder())  # type: ignore[arg-type]
        step = asyncio.ensure_future(follower.__anext__())
        await asyncio.sleep(0)  # parked with its tap before any token
        registry.on_delta(_delta("s", 0, 1), 0.0)
        step.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await step
        await follower.aclose()
        return held, plain, told

    held, plain, told = asyncio.run(play())
    assert held == [(100,), (101, 102, 103), (104, 105, 106), (107,)]
    assert plain == [(100 + i,) for i in range(8)]
    assert told == [(0, 5, False)]
