"""The replica's one Redis publisher: token deltas per owner, completions and KV event batches, in order.

Batches are queued by the loop (`put`) and go out from one task (`run`), so round N's events are
published while round N+1 executes. Whatever queued up while a publication was in flight goes out
merged: each owner's token deltas as one TokenDeltaBatch, one Redis entry (one XADD) per owner, however
many requests and rounds it holds, so under load the queue drains in a few round trips instead of growing.
A publication's entries (tokens per owner, then completions, then KV events) go out in one round trip
(`Bus.append`: the XADDs written together on the bus's own connection, the replies read in order).
A Redis failure is retried until it succeeds, resuming at the first entry Redis did not confirm (the one
in flight may be repeated: token readers drop deltas they have, completion consumers and the routers'
KV index are idempotent): events are delayed, never dropped, and never reordered.

KV event batches are coalesced in time: after one goes out, the next waits until `kv_interval_s` has passed
(whatever arrives meanwhile joins it, in order), so the routers read a few entries per second instead of
one per round (each costs them a read and an acknowledgement). The routers lose nothing by the wait: they
count their own routing decisions as cached for `prediction_ttl_s` (2 s), and `flush` and `close` send
what is held at once. `kv_interval_s` 0 publishes every batch as it comes.

Every completion queued is also remembered (`recent`: the last `recent_limit`, by request id), because
publishing is not delivery: a Redis restart loses entries nobody had read yet. Admission's watchdog asks
for the completion of a request that went quiet (the Lookup RPC) and so gets it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.context import Context

from sluice.bus import Bus, Entry
from sluice.v1 import events_pb2

__all__ = ["DEFAULT_KV_INTERVAL_S", "Outgoing", "Publisher", "merge"]

log = logging.getLogger(__name__)

DEFAULT_KV_INTERVAL_S = 0.05
"""KV event publications at most every 50 ms: under load a router reads ~20 KV entries per second per
replica instead of one per round (a round is 5-30 ms), and 50 ms is 1/40 of the time it counts its own
decisions as cached."""


@dataclass
class Outgoing:
    """One batch of Redis publications, in the order they must go out."""

    tokens: dict[str, events_pb2.TokenDeltaBatch] = field(default_factory=dict)
    """Token deltas per owner (admission process), in order."""
    completions: list[tuple[events_pb2.Completion, Context]] = field(default_factory=list)
    kv: events_pb2.KvEventBatch | None = None


def merge(batches: list[Outgoing]) -> Outgoing:
    """Return one batch with everything of `batches`, in order (per owner for tokens; KV events concatenated)."""
    if len(batches) == 1:
        return batches[0]
    merged = Outgoing()
    for batch in batches:
        for owner, deltas in batch.tokens.items():
            have = merged.tokens.get(owner)
            if have is None:
                merged.tokens[owner] = deltas
            else:
                have.deltas.extend(deltas.deltas)
        merged.completions += batch.completions
        if batch.kv is not None:
            if merged.kv is None:
                merged.kv = batch.kv
            else:
                merged.kv.events.extend(batch.kv.events)
    return merged


class Publisher:
    """Publishes queued batches in order from one task. See the module docstring."""

    def __init__(self, bus: Bus, recent_limit: int = 4096, kv_interval_s: float = DEFAULT_KV_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bus = bus
        self.kv_interval_s = kv_interval_s
        """The least time between two KV event publications (see the module docstring)."""
        self.clock = clock
        self._outbox: asyncio.Queue[Outgoing | None] = asyncio.Queue()
        self._kv_held: events_pb2.KvEventBatch | None = None
        """KV events waiting for `kv_interval_s` to pass since the last KV publication."""
        self._kv_sent_at = -float("inf")
        self._kv_timer: asyncio.TimerHandle | None = None
        self._kv_now = False
        """Send held KV events with the next publication, whatever the interval (`flush`)."""
        self.recent_limit = recent_limit
        self.recent: OrderedDict[str, events_pb2.Completion] = OrderedDict()
        """The last `recent_limit` completions queued, by request id (oldest first)."""

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

    async def flush(self) -> None:
        """Wait until every batch queued so far, held KV events included, has been handed to Redis."""
        self._kv_now = True  # read by the iteration of `run` that takes this marker (or the items before it)
        self._outbox.put_nowait(Outgoing())
        await self._outbox.join()

    def _hold_kv(self, out: Outgoing, last: bool) -> None:
        """Keep `out`'s KV events back while the interval since the last KV publication runs (merged with any
        held before, in order); put the held ones into `out` once it has passed, or at the end."""
        now, self._kv_now = last or self._kv_now, False
        if last and self._kv_timer is not None:
            self._kv_timer.cancel()
            self._kv_timer = None
        if self._kv_held is not None:
            if out.kv is not None:
                self._kv_held.events.extend(out.kv.events)
            out.kv, self._kv_held = self._kv_held, None
        if out.kv is None:
            return
        wait = self._kv_sent_at + self.kv_interval_s - self.clock()
        if wait <= 0 or now:
            return
        self._kv_held, out.kv = out.kv, None
        if self._kv_timer is None:  # an empty batch wakes `run` when the interval is over
            self._kv_timer = asyncio.get_running_loop().call_later(wait, self._kv_due)

    def _kv_due(self) -> None:
        self._kv_timer = None
        self._outbox.put_nowait(Outgoing())

    async def run(self) -> None:
        """Publish queued batches in order until `close`; retry Redis failures forever."""
        while True:
            batches = [await self._outbox.get()]
            while not self._outbox.empty():
                batches.append(self._outbox.get_nowait())
            last = batches[-1] is None
            out = merge([b for b in batches if b is not None] or [Outgoing()])
            self._hold_kv(out, last)
            entries = self._entries(out)
            try:
                delay = 0.05
                while entries:
                    try:
                        await self.bus.append(entries)  # one round trip; a retry resumes at the first unconfirmed
                        if out.kv is not None:
                            self._kv_sent_at = self.clock()
                    except Exception as exc:  # Redis down: keep what is left of the batch, in order
                        log.error("publishing to Redis failed (%s); retrying in %.2f s", exc, delay)
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 2.0)
            finally:
                for _ in batches:
                    self._outbox.task_done()
            if last:
                return

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
