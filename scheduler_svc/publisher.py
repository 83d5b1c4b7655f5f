"""The replica's one Redis publisher: token deltas per owner, completions and KV event batches, in order.

Batches are queued by the loop (`put`) and go out from one task (`run`), so round N's events are
published while round N+1 executes. Whatever queued up while a publication was in flight goes out
merged: each owner's token deltas as one TokenDeltaBatch, one Redis entry (one XADD) per owner, however
many requests and rounds it holds, so under load the queue drains in a few round trips instead of growing.
A publication's entries (tokens per owner, then completions, then KV events) go out in one round trip
(`Bus.append`: the XADDs written together on the bus's own connection, the replies read in order).
A Redis failure is retried until it succeeds, with what Redis did not confirm (after a lost connection
some of it may have gone in and is repeated: token readers drop deltas they have, completion consumers
and the routers' KV index are idempotent): events are delayed, never dropped, and each stream's entries
keep their order.

KV events may linger (`kv_linger_s`, the scheduler's --kv-linger-ms, off by default): a batch of them waits up to
that long for later rounds' events and goes out with them as one `kv` entry, so a replica sends at most one KV entry
per linger whatever its round rate (docs/kv-events.md has what it measured to save). Routing sees a stored prefix
that much later. A completion, a flush (a drain) and stopping take the lingering events out at once, in the same
round trip: a finished request's blocks reach Redis in the same write as its completion, as without a linger, for
the conversation's next turn.

Publications may be spaced (`token_interval_s`, the scheduler's --publish-interval-ms, off by default): a batch
queued less than the interval after the previous publication (rounds come faster than the interval) waits one
interval, and what the rounds queue meanwhile goes out with it, each request's consecutive deltas merged into one
(`merge`). A token then reaches admission at most that much later, and admission, Redis and the client handle one
delta, one entry and one chunk for several rounds' tokens (about interval / round time of them). A batch queued
after a pause as long as the interval goes out at once, so rounds slower than the interval never wait. A batch that
starts a request's stream (its first token here: TTFT is not delayed), a completion, a flush and stopping go out at
once, taking everything waiting with them (the reporter counts a request's first few rounds' tokens as its first:
`FIRST_ROUNDS_AT_ONCE`). The wait is a timer that queues a marker (no task, no timeout per round).

Stopping (`close`, then `wait_closed`) publishes what is queued, but waits for Redis only `PUBLISH_GRACE_S` (and
so does `flush`, which a drain calls; a stop after a flush that gave up, with nothing confirmed since, waits only
`GRACE_AFTER_GIVING_UP_S`, so a drained replica with Redis gone exits one grace after its drain, not two: the
charts give a replica's pod 60 s for a 30 s drain):
a process told to stop while Redis is unreachable logs what it could not publish and stops, instead of
retrying forever and outliving its SIGTERM (admission's watchdog asks the replica's Lookup, or the request
migrates, as when a replica dies).

Every completion queued is also remembered (`recent`: the last `recent_limit`, by request id), because
publishing is not delivery: a Redis restart loses entries nobody had read yet. Admission's watchdog asks
for the completion of a request that went quiet (the Lookup RPC) and so gets it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.context import Context

from sluice.bus import Bus, Entry
from sluice.v1 import events_pb2

__all__ = ["GRACE_AFTER_GIVING_UP_S", "PUBLISH_GRACE_S", "Outgoing", "Publisher", "merge"]

log = logging.getLogger(__name__)

PUBLISH_GRACE_S = 10.0
"""Seconds a stopping publisher keeps trying to publish what is queued when Redis does not answer."""
GRACE_AFTER_GIVING_UP_S = 1.0
"""What a stop waits instead, when a flush has already waited its grace for Redis and Redis has confirmed nothing
since (a drain's flush, then the stop: one grace in all, not two)."""


@dataclass
class Outgoing:
    """One batch of Redis publications, in the order they must go out."""

    tokens: dict[str, events_pb2.TokenDeltaBatch] = field(default_factory=dict)
    """Token deltas per owner (admission process), in order."""
    completions: list[tuple[events_pb2.Completion, Context]] = field(default_factory=list)
    kv: events_pb2.KvEventBatch | None = None
    urgent: bool = False
    """Publish at once, whatever the publication interval (a request's first tokens are among the deltas)."""


def merge(batches: list[Outgoing]) -> Outgoing:
    """Return one batch with everything of `batches`, in order (per owner for tokens; KV events concatenated).

    A request's delta that continues the one before it in the merged batch (the next index, both with log-probabilities
    for every token or neither) is appended to it: one delta per request for several rounds' tokens, stamped with its
    first token's time."""
    if len(batches) == 1:
        return batches[0]
    merged = Outgoing()
    lasts: dict[str, dict[str, events_pb2.TokenDelta]] = {}
    """Per owner: each request's last delta in the merged batch."""
    for batch in batches:
        for owner, deltas in batch.tokens.items():
            have = merged.tokens.get(owner)
            if have is None:
                merged.tokens[owner] = deltas
                lasts[owner] = {delta.request_id: delta for delta in deltas.deltas}
                continue
            last = lasts[owner]
            for delta in deltas.deltas:
                before = last.get(delta.request_id)
                if before is not None and before.index + len(before.token_ids) == delta.index and (
                        not (before.logprobs or delta.logprobs) or _logprobs_continue(before, delta)):
                    before.token_ids.extend(delta.token_ids)
                    before.logprobs.extend(delta.logprobs)
                else:
                    have.deltas.append(delta)
                    last[delta.request_id] = have.deltas[-1]  # the batch's copy (protobuf copies on append)
        merged.completions += batch.completions
        merged.urgent = merged.urgent or batch.urgent
        if batch.kv is not None:
            if merged.kv is None:
                merged.kv = batch.kv
            else:
                merged.kv.events.extend(batch.kv.events)
    return merged


def _logprobs_continue(before: events_pb2.TokenDelta, delta: events_pb2.TokenDelta) -> bool:
    """Whether two consecutive deltas, one of them with log-probabilities, both have them for every token."""
    return len(before.logprobs) == len(before.token_ids) and len(delta.logprobs) == len(delta.token_ids)


class Publisher:
    """Publishes queued batches in order from one task. See the module docstring."""

    def __init__(self, bus: Bus, recent_limit: int = 4096, kv_linger_s: float = 0.0,
                 on_kv_entry: Callable[[int], None] | None = None, token_interval_s: float = 0.0,
                 on_spaced: Callable[[int], None] | None = None) -> None:
        self.bus = bus
        self._outbox: asyncio.Queue[Outgoing | None] = asyncio.Queue()
        self.recent_limit = recent_limit
        self.recent: OrderedDict[str, events_pb2.Completion] = OrderedDict()
        """The last `recent_limit` completions queued, by request id (oldest first)."""
        if not 0 <= kv_linger_s < math.inf:
            raise ValueError(f"kv_linger_s {kv_linger_s}: must be a finite number >= 0")
        self.kv_linger_s = kv_linger_s
        """Seconds KV events may wait for later rounds' to go out with them (0: each publication takes its own)."""
        self.on_kv_entry = on_kv_entry
        """Called with the number of events of each KV entry put on the wire (a metric)."""
        self._kv: events_pb2.KvEventBatch | None = None
        """KV events lingering (merged, in order)."""
        self._kv_timer: asyncio.TimerHandle | None = None
        """Ends their linger (`_kv_wake`)."""
        self._kv_now = False
        """Set by `flush` and the linger's timer: the next publication takes the lingering events out."""
        if not 0 <= token_interval_s < math.inf:
            raise ValueError(f"token_interval_s {token_interval_s}: must be a finite number >= 0")
        self.token_interval_s = token_interval_s
        """How long a batch queued sooner than this after the last publication waits for later rounds' (0: each goes
        out when it can; see the module docstring)."""
        self.on_spaced = on_spaced
        """Called, for each publication that waited for the interval, with the rounds' token batches it carries (a metric)."""
        self._published_at = -math.inf
        """The event loop's time when the last publication went out."""
        self._gave_up = False
        """A flush gave up waiting for Redis, and Redis has confirmed nothing since."""
        self._due: asyncio.TimerHandle | None = None
        """While batches wait for the interval: the timer that ends the wait (`_wait_over`)."""

    def put(self, out: Outgoing) -> None:
        """Queue a batch for publishing (after everything queued before it); remember its completions."""
        for completion, _ in out.completions:
            self.recent[completion.request_id] = completion
            self.recent.move_to_end(completion.request_id)
        while len(self.recent) > self.recent_limit:
            self.recent.popitem(last=False)
        self._outbox.put_nowait(out)

    async def close(self) -> None:
        """Queue the end marker: `run` publishes what is queued before it and returns."""
        await self._outbox.put(None)

    async def wait_closed(self, run: asyncio.Task[None], grace_s: float = PUBLISH_GRACE_S) -> None:
        """After `close`: wait for `run` to publish everything queued before it, up to `grace_s`; past that (Redis
        unreachable) log what is left unpublished and cancel `run`. After a flush that gave up, with nothing
        confirmed since, at most `GRACE_AFTER_GIVING_UP_S`. Raises what `run` raised."""
        if self._gave_up:
            grace_s = min(grace_s, GRACE_AFTER_GIVING_UP_S)
        done, _ = await asyncio.wait([run], timeout=grace_s)
        if done:
            return run.result()
        log.error("stopping with %d queued publications Redis has not confirmed after %.1f s; they are dropped",
                  self._outbox.qsize() + 1, grace_s)  # + the one in flight
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run

    async def flush(self, grace_s: float = PUBLISH_GRACE_S) -> bool:
        """Wait until every batch queued so far has been handed to Redis, at most `grace_s`; return whether it was.
        Bounded because the callers are drains: a replica told to stop while Redis is gone waited here for ever (its
        publications are retried by `run` meanwhile, and `wait_closed` drops what is left when the process stops)."""
        if self.kv_linger_s > 0:  # KV events lingering, or queued and about to: `run` takes them out with this
            self._kv_now = True    # wake-up, which it reads with everything queued before it
        if self.kv_linger_s > 0 or self.token_interval_s > 0:  # and a spaced publication goes out at once
            self._outbox.put_nowait(Outgoing(urgent=True))
        try:
            await asyncio.wait_for(self._outbox.join(), grace_s)
        except TimeoutError:
            log.error("%d publications not confirmed by Redis after %.1f s; going on without them",
                      self._outbox.qsize(), grace_s)
            self._gave_up = True
            return False
        return True

    async def run(self) -> None:
        """Publish queued batches in order until `close`; retry Redis failures forever."""
        waiting: list[Outgoing | None] = []
        while True:
            batches, waited = waiting, bool(waiting)
            batches.append(await self._outbox.get())
            while not self._outbox.empty():
                batches.append(self._outbox.get_nowait())
            if self.token_interval_s > 0:
                if self._wait(batches):
                    waiting = batches
                    continue
                if waited and self.on_spaced is not None:
                    self.on_spaced(sum(1 for b in batches if b is not None and b.tokens))
            waiting = []
            last = batches[-1] is None
            out = merge([b for b in batches if b is not None])
            if self.kv_linger_s > 0:
                self._linger(out, last)
            if out.kv is not None and self.on_kv_entry is not None:
                self.on_kv_entry(len(out.kv.events))
            entries = self._entries(out)
            self._published_at = asyncio.get_running_loop().time()
            try:
                delay = 0.05
                while entries:
                    try:
                        await self.bus.append(entries)  # one round trip; a retry sends what was not confirmed
                        self._gave_up = False
                    except Exception as exc:  # Redis down: keep what is left of the batch, in order
                        log.error("publishing to Redis failed (%s); retrying in %.2f s", exc, delay)
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 2.0)
            finally:
                for _ in batches:
                    self._outbox.task_done()
            if last:
                return

    def _wait(self, batches: list[Outgoing | None]) -> bool:
        """Whether `batches` wait for the interval (see the module docstring): they came less than the interval after
        the last publication and nothing among them goes out at once (a request's first tokens, a completion, a
        flush, the end). The first batch to wait starts the timer that ends the wait."""
        if any(b is None or b.urgent or b.completions for b in batches):
            if self._due is not None:
                self._due.cancel()
                self._due = None
            return False
        if self._due is not None:
            return True
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now - self._published_at >= self.token_interval_s:
            return False
        self._due = loop.call_at(now + self.token_interval_s, self._wait_over)
        return True

    def _wait_over(self) -> None:
        """The interval's timer: what waits goes out with the marker this queues."""
        self._due = None
        self._outbox.put_nowait(Outgoing(urgent=True))

    def _linger(self, out: Outgoing, last: bool) -> None:
        """Hold `out`'s KV events back with those lingering, or put all of them in `out` when they are due: the
        linger's timer or a flush asked, `out` carries a completion, or the publisher stops."""
        asked, self._kv_now = self._kv_now, False
        if out.kv is not None:
            if self._kv is None:
                self._kv, out.kv = out.kv, None
                self._kv_timer = asyncio.get_running_loop().call_later(self.kv_linger_s, self._kv_wake)
            else:
                self._kv.events.extend(out.kv.events)
                out.kv = None
        if self._kv is None:
            return
        if last or asked or out.completions:
            out.kv, self._kv = self._kv, None
            if self._kv_timer is not None:
                self._kv_timer.cancel()
                self._kv_timer = None

    def _kv_wake(self) -> None:
        """The linger's timer: the lingering events go out with the next publication, which this one starts."""
        self._kv_timer, self._kv_now = None, True
        self._outbox.put_nowait(Outgoing(urgent=True))

    def _entries(self, out: Outgoing) -> list[Entry]:
        """Return `out` as the stream entries that publish it, in order: tokens (one entry per owner), then
        completions (an owner never sees a request end before its last tokens), then KV events."""
        bus = self.bus
        entries = [bus.token_batch_entry(owner, deltas) for owner, deltas in out.tokens.items()
                   if owner and deltas.deltas]
        entries += (bus.completion_entry(completion, context) for completion, context in out.completions)
        if out.kv is not None:
            entries.append(bus.kv_entry(out.kv))
        return entries
