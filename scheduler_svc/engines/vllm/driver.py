"""The agent's loop around the pure `GatewayCore`: dispatch to vLLM, stream back, publish, watch the engine.

Theory of operation
- The same surface as scheduler_svc.driver.Driver (what SchedulerServicer and ReplicaAgent use): submit,
  cancel, live_request_ids, accepting, worker_serving, worker_changed, probe_worker, rates, flush, core
  (stats, config, kv_snapshot). The servicer, the router agent, the Reporter and the Publisher are the
  Sluice scheduler's own, unchanged: tokens, completions, KV events, spans and metrics take one path
  whatever the engine.
- The loop: `core.expire(now)`, `core.dispatch(now)` (one streaming task per dispatched request), the
  aborts the core asks for (the stream task is cancelled: the connection closes and vLLM aborts the request),
  then the events go to the Reporter. Stream tasks only record into the core and wake the loop, so the tokens
  of every stream that advanced since the last turn go out as one publication per owner.
- The engine: its /metrics are read every `metrics_interval_s` into the core's EngineView (waiting, running,
  KV use, prefix-cache counters); the core's own record of what it sent is what bounds dispatch between reads.
  A broken stream or a failed probe marks the engine down: every live request is handed to migration
  (CANCELLED, DRAIN_HANDOFF), Submit answers UNAVAILABLE, the router is told UNHEALTHY; /health is probed
  every `worker_retry_s` and the engine is routed to again only once it answers (and its KV is cleared at
  the router: a restarted engine holds none).
- A request's stream interval N (tokens a chunk carries after the first) is the larger of the link's
  (--engine-stream-interval) and the request's own (SubmitRequest.stream_interval: what admission holds its
  client's tokens to), so vLLM formats and the agent reads no more chunks than the client gets.
- Rates for the router's TTFT prediction: decode rounds from the gaps between a stream's full chunks (N tokens:
  N rounds since the chunk before; a chunk with more was merged while vLLM's API server lagged, a last one may
  have fewer), divided by N; prefill from the time to first token of dispatches that found the engine idle
  (exponential averages, sluice.glue).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, cast

from opentelemetry.context import Context

from scheduler_svc.core import SchedulerCore
from scheduler_svc.core.request import Request
from scheduler_svc.engines.vllm.gateway import GatewayCore
from scheduler_svc.engines.vllm.link import EngineGone, EngineLink, EngineRefused, KvSubscriber
from scheduler_svc.publisher import Publisher
from scheduler_svc.reporting import Reporter
from sluice import convert
from sluice.bus import Bus
from sluice.core_errors import RequestRejected
from sluice.glue import RoundRates
from sluice.prom import SchedulerMetrics
from sluice.types import RequestStatus
from sluice.v1 import scheduler_pb2

__all__ = ["VllmDriver"]

log = logging.getLogger(__name__)


class VllmDriver:
    """Runs one vLLM engine's gateway; see the module docstring."""

    def __init__(self, core: GatewayCore, link: EngineLink, bus: Bus, *, replica_id: str,
                 kv: KvSubscriber | None = None, metrics: SchedulerMetrics | None = None,
                 clock: Callable[[], float] = time.time, worker_retry_s: float = 1.0,
                 metrics_interval_s: float = 0.5, kv_linger_s: float = 0.0, publish_interval_s: float = 0.0) -> None:
        self.core = core
        self.link = link
        self.kv = kv
        self.replica_id = replica_id
        self.model_id = core.config.model_id
        self.vocab_size = 0
        """Token ids are the engine's to check (it refuses an id out of its vocabulary: that request fails)."""
        self.structured_output = True
        """vLLM applies structured output itself (the link passes the schema through)."""
        self.structured_resume = False
        """vLLM's grammar starts at the document's start: a migrated structured request is refused, not resumed
        into a wrong document."""
        self.metrics = metrics or SchedulerMetrics()
        self.metrics.bind_model(self.model_id)
        self.clock = clock
        self.worker_retry_s = worker_retry_s
        self.metrics_interval_s = metrics_interval_s
        self.accepting = True
        self.rates = RoundRates()
        self.publisher = Publisher(bus, kv_linger_s=kv_linger_s, on_kv_entry=self.metrics.kv_entry_published,
                                   token_interval_s=publish_interval_s, on_spaced=self.metrics.publication_spaced)
        self.reporter = Reporter(cast(SchedulerCore, core), self.publisher, self.metrics, replica_id)
        self.worker_changed = asyncio.Event()
        self._serving = True
        self._streams: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self.engine_losses = 0

    @property
    def worker_serving(self) -> bool:
        """False while the engine does not answer (nothing is dispatched; Submit refuses; the router is told)."""
        return self._serving

    async def probe_worker(self) -> bool:
        """Ask the engine whether it serves (marks it down when not); return the answer."""
        ok = await self.link.healthy()
        if not ok and self._serving:
            self._engine_down("GET /health failed")
        return ok

    async def flush(self) -> bool:
        """Wait until every publication queued so far has been handed to Redis, at most the publisher's grace;
        return whether it was (Publisher.flush)."""
        self._hand_over()
        return await self.publisher.flush()

    def wake_up(self) -> None:
        self._wake.set()

    # ---- requests -------------------------------------------------------------------------------------
    def submit(self, msg: scheduler_pb2.SubmitRequest, parent: Context | None) -> int:
        """Queue a request; return its queue position. Raises RequestRejected (counted by reason)."""
        now = self.clock()
        request = convert.new_request_from_proto(msg, now, msg.eos_token_id)
        try:
            self.core.submit(request, now, msg.stream_interval)
        except RequestRejected as exc:
            self.metrics.rejections.labels(exc.reason.value).inc()
            raise
        self.reporter.track_submitted(msg, request, parent, now, self.model_id, "vllm")
        self._hand_over(now)
        self.wake_up()
        return self.core.num_waiting

    def cancel(self, request_id: str, detail: str = "") -> RequestStatus | None:
        """Cancel a request; return its status afterwards (None for an id that is not live)."""
        now = self.clock()
        status = self.core.cancel(request_id, now, detail)
        self._hand_over(now)
        self.wake_up()
        return status

    def live_request_ids(self) -> list[str]:
        """Return the ids of requests not yet terminal."""
        return self.reporter.live_request_ids()

    # ---- the loop -------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Dispatch and publish until `stop`; then flush every queued publication and return."""
        tasks = [asyncio.create_task(self.publisher.run()), asyncio.create_task(self._watch_engine(stop))]
        if self.kv is not None:
            tasks.append(asyncio.create_task(self.kv.run(self._on_kv, self._on_kv_gap, stop)))
        stopped = asyncio.create_task(stop.wait())
        stopped.add_done_callback(lambda _: self.wake_up())
        try:
            while not stop.is_set():
                self._turn()
                deadline = self.core.next_deadline()
                timeout = None if deadline is None else max(deadline - self.clock(), 0.0) + 0.001
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                self._wake.clear()
        finally:
            stopped.cancel()
            for task in list(self._streams.values()):
                task.cancel()
            await asyncio.gather(*self._streams.values(), return_exceptions=True)
            self._hand_over()
            await self.publisher.flush()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.link.close()

    def _turn(self) -> None:
        now = self.clock()
        core = self.core
        core.expire(now)
        for request_id in core.take_aborts():
            task = self._streams.get(request_id)
            if task is not None:
                task.cancel()  # its `finally` reports the abort once the connection is closed
            else:
                core.on_aborted(request_id, now)
        if self._serving:
            for request in core.dispatch(now):
                self._streams[request.request_id] = asyncio.create_task(self._stream(request))
        self._hand_over(now)

    def _hand_over(self, now: float | None = None) -> None:
        self.reporter.handle(self.core.take_events(), self.clock() if now is None else now)

    async def _stream(self, request: Request) -> None:
        """Stream one request from the engine into the core (see EngineLink.stream for what it raises)."""
        request_id, core = request.request_id, self.core
        idle = core.engine.running == 0 and len(self._streams) <= 1
        started = last = self.clock()
        per_chunk = max(self.link.stream_interval, core.stream_interval(request_id))
        try:
            async for chunk in self.link.stream(request, per_chunk):
                now = self.clock()
                if chunk.token_ids:
                    if request.num_outputs == 0:
                        self._observe_prefill(request, now - started, idle)
                    elif len(chunk.token_ids) == per_chunk:
                        self._observe_decode((now - last) / per_chunk)
                    self.metrics.engine_stream_chunks.inc()
                    core.on_tokens(request_id, chunk.token_ids, now, chunk.logprobs)
                    last = now
                if chunk.finish_reason is not None:
                    core.on_finished(request_id, chunk.finish_reason == "stop", now, chunk.cached_tokens)
                self.wake_up()
        except EngineRefused as exc:
            core.on_failed(request_id, str(exc), self.clock())
        except EngineGone as exc:
            if request.status is RequestStatus.RUNNING:
                self._engine_down(str(exc))
        except Exception as exc:  # a fault of the agent's own: the request fails, named, rather than run forever
            log.exception("reading request %s from %s failed", request_id, self.link.url)
            core.on_failed(request_id, f"the agent failed reading the engine's stream: {exc!r}"[:300], self.clock())
        finally:
            self._streams.pop(request_id, None)
            core.on_aborted(request_id, self.clock())  # a no-op unless the request was CANCELLING
            self.wake_up()

    def _observe_prefill(self, request: Request, seconds: float, idle: bool) -> None:
        if idle and seconds > 0:
            rates = self.rates
            tokens = float(request.num_prompt)
            if rates.prefill_s == 0.0:
                rates.prefill_tokens, rates.prefill_s = tokens, seconds
            else:
                rates.prefill_tokens += rates.alpha * (tokens - rates.prefill_tokens)
                rates.prefill_s += rates.alpha * (seconds - rates.prefill_s)

    def _observe_decode(self, seconds: float) -> None:
        rates = self.rates
        old = rates.decode_round_s
        rates.decode_round_s = seconds if old == 0.0 else old + rates.alpha * (seconds - old)

    # ---- the engine -----------------------------------------------------------------------------------
    def _engine_down(self, why: str) -> None:
        """Hand every live request to migration and stop dispatching until the engine answers again."""
        if not self._serving:
            return
        log.warning("engine %s of %s is gone (%s): handing %d requests to migration", self.link.url,
                    self.replica_id, why, len(self.core.live_request_ids()))
        self._serving = False
        self.engine_losses += 1
        handed = self.core.on_engine_lost(self.clock())
        self.metrics.handed_off.inc(len(handed))
        for task in list(self._streams.values()):
            task.cancel()
        self.worker_changed.set()
        self.wake_up()

    def _engine_back(self) -> None:
        log.info("engine %s of %s answers again", self.link.url, self.replica_id)
        self.core.kv_reset()
        self._serving = True
        self.worker_changed.set()
        self.wake_up()

    async def _watch_engine(self, stop: asyncio.Event) -> None:
        """Read the engine's metrics while it serves; probe its health while it does not."""
        while not stop.is_set():
            if self._serving:
                try:
                    view, _ = await self.link.metrics()
                    self.core.on_engine_view(view)
                except EngineGone as exc:
                    if not await self.link.healthy():
                        self._engine_down(str(exc))
                interval = self.metrics_interval_s
            else:
                if await self.link.healthy():
                    self._engine_back()
                interval = self.worker_retry_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    def _on_kv(self, events: list[Any]) -> None:
        self.core.on_kv(events)
        self.wake_up()

    def _on_kv_gap(self) -> None:
        self.core.kv_reset()
        self.wake_up()
