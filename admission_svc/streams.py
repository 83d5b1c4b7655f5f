"""Token streams of one admission process: one reader loop, per-request queues, a resume window.

Theory of operation. Schedulers publish token deltas on `tokens:{owner}` (one stream per admission
process; one entry per scheduler publication, a TokenDeltaBatch holding every request's delta of that
round, or an older single TokenDelta) and a Completion per request on `completions`. One reader loop per
process reads the token stream and hands each delta to the request's `RequestStream`; a request's tokens
come from one scheduler in order, but a retried publish may repeat them, so each stream keeps the
next expected index and drops what it has already seen. The completion can overtake the last
deltas (different streams), so a stream is finished only when it holds the completion *and*
`usage.output_tokens` tokens (or after a grace period, counted as missing tokens, never silently).
A finished stream stays for `resume_window_s` so an idempotent retry can replay it.

No fake tokens. A delta whose index is past the next expected one means entries were lost on the way
(a Redis restart loses what nobody had read yet). The stream never fills the hole: it keeps the tokens
before it (all exact), records where it broke (`gap_at`), takes nothing more from that attempt, and the
registry tells its `on_gap` handler (admission_svc/migration.py moves the request, recomputing from the
last exact token). Retargeting to a new attempt clears the break.

Migration. A request moved to another replica runs there as a new *attempt* (its own downstream id,
`attempt_id`), whose output index 0 is the request's output index `offset` (the tokens streamed before
the move). `retarget` switches a stream to its new attempt at once, so a late delta of the old attempt
is dropped (counted as stale) and the client's indices simply continue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.v1 import events_pb2

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StreamItem:
    """A batch of new tokens (`tokens`, starting at `index`) or the terminal record."""

    index: int
    tokens: tuple[int, ...] = ()
    completion: events_pb2.Completion | None = None
    emitted_unix_s: float = 0.0
    """When the tokens were created (scheduler stamp, else their Redis entry time, ms); 0 = unknown."""


class Tap(Protocol):
    """A follower's synchronous taker of new tokens (`RequestStream.follow`)."""

    position: int
    """Output index of the next token the follower hands on (set by `follow`, advanced by `take`)."""
    interval: int
    """Tokens to hold, once some were handed on, before handing more on (set by `follow`: its `interval`; the
    stream holds them and offers nothing to `take` meanwhile)."""
    sent: bool
    """Whether the follower or the tap has handed tokens on (set by `follow`; `take` sets it when it hands some on)."""

    def take(self, stream: RequestStream) -> bool:
        """Hand on `stream.tokens[position:]` now and advance `position` past them (and set `sent`); False (nothing
        done) when that cannot be done now: the follower is woken and yields them."""


class StreamListener(Protocol):
    """Told about a request's stages as tokens arrive, whether or not a client is following."""

    def first_token(self, stream: RequestStream) -> None:
        """The request's first output token has arrived."""

    def progress(self, stream: RequestStream) -> None:
        """New output tokens have arrived (`len(stream.tokens)` so far): the reservation's growth signal."""

    def done(self, stream: RequestStream) -> None:
        """The completion and every token it counts are here (or the wait for them gave up)."""


@dataclass
class RequestStream:
    """Everything one request has produced so far, and the readers waiting for more."""

    request_id: str
    listener: StreamListener | None = None
    tokens: list[int] = field(default_factory=list)
    token_emitted: list[float] = field(default_factory=list)
    completion: events_pb2.Completion | None = None
    done: bool = False
    finished_at: float = 0.0
    missing_tokens: int = 0
    duplicates: int = 0
    completion_at: float = 0.0
    """time.monotonic() when the completion arrived."""
    attempt_id: str = ""
    """Downstream id whose deltas this stream takes ("" = `request_id`, the first attempt)."""
    offset: int = 0
    """Output index of the current attempt's token 0 (tokens streamed before the last migration)."""
    gap_at: int | None = None
    """Output index where the current attempt's tokens broke off (a lost delta); None while they are whole.
    Tokens of that attempt are not taken any more: what follows the hole is not the client's next token."""
    logprobs: dict[int, Any] = field(default_factory=dict)
    """Output index -> that token's log-probabilities (common_pb2.TokenLogprobs), for requests that ask for them."""
    progress_at: float = field(default_factory=time.monotonic)
    """time.monotonic() of the last new token (or of the start/migration): the stall watchdog reads it."""
    _waiters: list[asyncio.Future[None]] = field(default_factory=list)
    """Futures of the followers waiting for a change (a future per wait, none while nobody waits)."""
    _tap: Tap | None = None
    """The tap of the follower parked on `_tap_waiter` (see `follow`), which new tokens go to first."""
    _tap_waiter: asyncio.Future[None] | None = None
    _tap_failed: Tap | None = None
    """The last tap that raised: its follower goes on without it."""

    def add_tokens(self, index: int, token_ids: list[int], emitted_unix_s: float) -> bool:
        """Append the part of a delta not seen yet. Returns True when the delta breaks off the stream (its index
        is past the next expected one: deltas were lost); then nothing of it is taken, nor of later ones, until
        `retarget` (see the module docstring)."""
        if self.done or self.gap_at is not None:
            self.duplicates += len(token_ids) if self.done else 0
            return False
        have = len(self.tokens)
        if index > have:
            log.warning("request %s: token gap %d..%d (deltas lost on the bus): the stream keeps its %d exact "
                        "tokens and takes no more from this attempt", self.request_id, have, index, have)
            self.missing_tokens += index - have
            self.gap_at = have
            self._wake()
            return True
        skip = have - index
        self.duplicates += min(skip, len(token_ids))
        fresh = token_ids[skip:]
        if fresh:
            self.progress_at = time.monotonic()
            first = not self.tokens
            self.tokens.extend(fresh)
            self.token_emitted.extend([emitted_unix_s] * len(fresh))
            self._wake(not self._tapped())
            if self.listener is not None:
                if first:
                    self.listener.first_token(self)
                self.listener.progress(self)
        return False

    def set_completion(self, completion: events_pb2.Completion) -> None:
        """Record the terminal record (the first one wins; later copies are redeliveries)."""
        if self.completion is None:
            self.completion = completion
            self.completion_at = time.monotonic()
            self._wake()

    def complete_if_ready(self, force: bool = False) -> bool:
        """Mark done when the completion and all its tokens are here (or `force`); returns done."""
        if self.done or self.completion is None:
            return self.done
        expected = self.completion.usage.output_tokens
        if len(self.tokens) >= expected or force:
            self.missing_tokens += max(0, expected - len(self.tokens))
            self.done = True
            self.finished_at = time.monotonic()
            self._wake()
            if self.listener is not None:
                self.listener.done(self)
        return self.done

    def _tapped(self) -> bool:
        """Offer the new tokens to the parked follower's tap; True when it took them (its follower stays parked).
        A tap that fails is logged, its follower woken and the tap not used again: the token reader, which every
        request's tokens go through, must not fail with it."""
        tap = self._tap
        if tap is None:
            return False
        if tap.sent and len(self.tokens) - tap.position < tap.interval:
            return True  # held as `follow` holds them: the follower stays parked until enough wait or the end wakes it
        try:
            return tap.take(self)
        except Exception:
            log.exception("request %s: handing tokens on at once failed; its follower takes them from now on",
                          self.request_id)
            self._tap_failed = tap
            return False

    def _wake(self, tapped_too: bool = True) -> None:
        waiters = self._waiters
        if waiters:
            self._waiters = []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
        if tapped_too and self._tap_waiter is not None:
            waiter, self._tap, self._tap_waiter = self._tap_waiter, None, None
            if not waiter.done():
                waiter.set_result(None)

    async def changed(self, timeout_s: float) -> None:
        """Wait until the stream changes (tokens, completion, a break) or `timeout_s` passes."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    async def follow(self, start: int = 0, grace_s: float = 2.0, tap: Tap | None = None,
                     interval: int = 1) -> AsyncIterator[StreamItem]:
        """Yield new tokens from `start` on, then the completion; replays for a late reader.

        Every token that arrived since the last item goes out as one item (tokens of several rounds that
        are ready together are coalesced into one chunk, in order).

        `interval` > 1 (vLLM's --stream-interval): after the first item, tokens are held until `interval` of them
        are waiting; the completion (or the stream's end) takes whatever is held. Fewer items for the same tokens.

        `tap`: while this follower is parked waiting for tokens (whatever it yielded before has been dealt with:
        its consumer is waiting for the next item), tokens that arrive are offered to `tap.take` first, on the
        token reader's call stack; what it takes is not yielded, and the follower stays parked (no wake-up, no
        item per token). It wakes as without a tap for what the tap refused, a completion or a break. One tap a
        stream at a time: a follower that parks while another's tap is set parks without its own."""
        position = start
        tokens = self.tokens
        loop = asyncio.get_running_loop()
        holding = interval > 1
        while True:  # (holding: the first item goes out at once, later ones once `interval` tokens wait)
            if len(tokens) > position and (not holding or position == start or len(tokens) - position >= interval
                                           or self.completion is not None or self.done):
                batch = tuple(tokens[position:])
                yield StreamItem(position, batch, emitted_unix_s=self.token_emitted[position])
                position += len(batch)
                continue
            if self.done:
                yield StreamItem(position, completion=self.completion)
                return
            # No await between the checks above and registering the waiter: no wake-up can be missed.
            waiter = loop.create_future()
            if self.completion is not None:
                self._waiters.append(waiter)
                try:
                    await asyncio.wait_for(waiter, grace_s)
                except TimeoutError:
                    self.complete_if_ready(force=True)
                continue
            if tap is None or self._tap is not None:
                self._waiters.append(waiter)
                await waiter
                continue
            tap.position, tap.interval, tap.sent = position, interval, position > start
            self._tap, self._tap_waiter = tap, waiter
            try:
                await waiter
            finally:
                if self._tap_waiter is waiter:  # closed while parked (the client left)
                    self._tap, self._tap_waiter = None, None
            position = tap.position
            if self._tap_failed is tap:
                tap = None


def entry_time_s(entry_id: Any) -> float:
    """Return the Unix time (s) Redis assigned to a stream entry id `<ms>-<seq>`."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return int(text.split("-", 1)[0]) / 1000.0


class StreamRegistry:
    """The per-request streams of one admission process, with the resume window."""

    def __init__(self, resume_window_s: float = 60.0, listener: StreamListener | None = None,
                 grace_s: float = 2.0) -> None:
        self._streams: dict[str, RequestStream] = {}
        self.resume_window_s = resume_window_s
        self.listener = listener
        self.grace_s = grace_s
        """How long a completion waits for tokens it counts that have not arrived."""
        self.unknown_deltas = 0
        self.stale_deltas = 0
        """Deltas of an attempt the request has moved away from (dropped)."""
        self._attempts: dict[str, RequestStream] = {}
        self.on_gap: Callable[[RequestStream], None] | None = None
        """Told when a stream breaks off (a delta lost on the bus), once per break."""

    def retarget(self, stream: RequestStream, attempt_id: str, offset: int) -> None:
        """Make `attempt_id` the stream's current attempt, its token 0 at output index `offset` (the number of
        tokens the stream holds, every one exact); clears a break."""
        self._attempts[attempt_id] = stream
        stream.attempt_id, stream.offset = attempt_id, offset
        stream.gap_at = None
        stream.progress_at = time.monotonic()

    def open(self, request_id: str) -> RequestStream:
        """Return the stream of `request_id`, creating it (before Submit, so no token is missed)."""
        stream = self._streams.get(request_id)
        if stream is None:
            stream = self._streams[request_id] = RequestStream(request_id, self.listener)
        return stream

    def forget(self, request_id: str) -> None:
        """Drop a request's stream now (its record was forgotten)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._attempts.pop(stream.attempt_id, None)

    def get(self, request_id: str) -> RequestStream | None:
        """Return the stream of `request_id`, or None when unknown or expired."""
        return self._streams.get(request_id)

    def on_delta(self, delta: events_pb2.TokenDelta, emitted_unix_s: float) -> None:
        """Dispatch one TokenDelta to its request (unknown requests are counted, not kept)."""
        attempt = delta.request_id
        stream = self._streams.get(attempt) or self._attempts.get(attempt)
        if stream is None:
            self.unknown_deltas += 1
            return
        if (stream.attempt_id or stream.request_id) != attempt:
            self.stale_deltas += 1
            return
        if delta.logprobs:
            first = stream.offset + delta.index
            for offset, logprobs in enumerate(delta.logprobs):
                stream.logprobs.setdefault(first + offset, logprobs)
        if stream.add_tokens(stream.offset + delta.index, list(delta.token_ids), emitted_unix_s):
            if self.on_gap is not None:
                self.on_gap(stream)
            return
        stream.complete_if_ready()

    def on_completion(self, completion: events_pb2.Completion) -> None:
        """Deliver the terminal record to its request's stream."""
        stream = self._streams.get(completion.request_id)
        if stream is not None:
            stream.set_completion(completion)
            stream.complete_if_ready()

    def expire(self, now: float | None = None) -> int:
        """Give up waiting for overdue tokens (nobody following) and forget streams finished more than
        `resume_window_s` ago; returns how many were forgotten."""
        now = time.monotonic() if now is None else now
        for stream in self._streams.values():
            if not stream.done and stream.completion is not None and now - stream.completion_at > self.grace_s:
                stream.complete_if_ready(force=True)
        old = [rid for rid, s in self._streams.items() if s.done and now - s.finished_at > self.resume_window_s]
        for request_id in old:
            stream = self._streams.pop(request_id)
            self._attempts.pop(stream.attempt_id, None)
        return len(old)


ReadTokens = Callable[[str, str, int, int], Awaitable[list[tuple[Any, list[events_pb2.TokenDelta]]]]]
"""(stream, last id, count, block ms) -> the entries after last id as (entry id, its deltas): `Bus.read_tokens`."""


async def token_reader_loop(read_tokens: ReadTokens, stream_name: str, registry: StreamRegistry,
                            stop: asyncio.Event, block_ms: int = 200, count: int = 512,
                            yield_max_deltas: int = 64) -> None:
    """Read `stream_name` from now on and dispatch every token delta until `stop` is set.

    Reading starts at this process's start time (an explicit id, not "$", so nothing published
    between two reads is missed): a process owns only requests it submitted after it started.
    A transient Redis error is logged and retried after a short pause.
    """
    last_id = f"{int(time.time() * 1000)}-0"
    while not stop.is_set():
        try:
            entries = await read_tokens(stream_name, last_id, count, block_ms)
        except asyncio.CancelledError:
            raise
        except (ConnectionError, TimeoutError, RedisConnectionError, RedisTimeoutError) as exc:
            log.error("reading %s failed (%s); retrying", stream_name, exc)  # Redis away: no traceback each time
            await asyncio.sleep(0.2)
            continue
        except Exception:
            log.exception("reading %s failed; retrying", stream_name)
            await asyncio.sleep(0.2)
            continue
        on_delta = registry.on_delta
        dispatched = 0
        for entry_id, deltas in entries:
            last_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            dispatched += len(deltas)
            for delta in deltas:
                on_delta(delta, delta.created_unix_s or entry_time_s(entry_id))
        if 0 < dispatched <= yield_max_deltas:
            # A few tokens: the followers just woken send them before the next XREAD goes out. Not after a big
            # read: there the XREAD goes out first, so the next entries arrive while the followers send, and a
            # follower that finds several tokens waiting sends them as one chunk (fewer messages under load).
            await asyncio.sleep(0)
