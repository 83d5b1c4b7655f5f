"""The scheduler's round loop around the pure `SchedulerCore`.

Theory of operation
- The loop: wait for work -> `core.schedule(now)` -> the worker executes the plan (`WorkerLink`, one
  long-lived stream of rounds: the worker's round link, else ExecuteStream) -> `core.on_round_result(result, now)`
  -> hand the events over -> repeat.
  The clock is `time.time()`, read here only; the core gets it as `now`.
- Pipelined (the default; `pipeline=False` or the unary link give the serial loop): round N+1 is planned
  while round N executes (`core.schedule(now, overlap=True)`: each running decode is assumed to produce
  one token, and the plan is corrected when the result arrives) and written on the stream before N's
  answer is read, so the worker finds the next plan queued when a round ends. Two rounds at most are in
  flight; answers come back in order. After N's answer its tokens are queued to the publisher at once (a
  small round's go to Redis before N+2 is planned, since N+1 is already queued at the worker) and the rest
  of its events are handed over once the next plan is on its way (off the critical path).
- Events are handed to the `Reporter`: bookkeeping (span events, metrics, lifecycle timestamps) at
  once, publications to Redis (token deltas per owner, completions, KV event batches) queued to the
  `Publisher`, so round N's events go out while round N+1 executes, in order.
- Submit and Cancel (RPCs) call the core directly: the event loop is single-threaded, so they
  interleave with the loop only at its awaits, which the core allows (a cancel while a round is in
  flight leaves the request CANCELLING until the result arrives).
- Idle: with nothing to plan, the loop sleeps on one future that Submit, Cancel, the worker link and `stop`
  resolve (`wake_up`), so a new request's first round is planned one loop turn after its Submit.
- Deadlines: the loop sleeps at most until `core.next_deadline()` and calls `expire` then.
- The worker: a call that breaks loses the round in flight, and so does a worker marked down by a failed
  health probe while a round is in flight (its stream is dropped). Nothing of it is known to be computed
  and the worker's KV is gone, so `core.on_round_lost` re-queues its requests to be recomputed
  (a request lost in more than `max_lost_rounds` consecutive rounds fails; cancelling ones end).
  The loop then runs no rounds until the worker answers again: queued requests wait (their
  deadlines still apply), `worker_serving` is False (Submit refuses new work and the router is told
  UNHEALTHY through `worker_changed`), and the worker's health is probed every `worker_retry_s`.
  The agent also probes it before each heartbeat, so an idle replica notices a dead worker too. On
  recovery the prefix cache is reset (a restarted worker holds no KV; the router gets ALL_CLEARED).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable

from grpc_health.v1 import health_pb2_grpc
from opentelemetry.context import Context

from scheduler_svc.core import SchedulerCore
from scheduler_svc.publisher import Publisher
from scheduler_svc.reporting import Reporter
from scheduler_svc.worker_link import RoundLinkTarget, WorkerLink
from sluice import convert
from sluice.bus import Bus
from sluice.core_errors import RequestRejected
from sluice.glue import RoundRates
from sluice.prom import SchedulerMetrics
from sluice.types import CoreEvents, RequestStatus, RoundPlan
from sluice.v1 import scheduler_pb2, worker_pb2_grpc

__all__ = ["Driver"]

log = logging.getLogger(__name__)


class Driver:
    """Runs one replica's rounds and hands over what the core reports. See the module docstring."""

    def __init__(self, core: SchedulerCore, worker: worker_pb2_grpc.WorkerServiceStub, bus: Bus, *,
                 replica_id: str, model_id: str, eos_token_id: int, metrics: SchedulerMetrics | None = None,
                 clock: Callable[[], float] = time.time, use_stream: bool = True,
                 worker_retry_s: float = 0.5, worker_health: health_pb2_grpc.HealthStub | None = None,
                 publish_first_max_tokens: int = 64, vocab_size: int = 0, pipeline: bool = True,
                 structured_output: bool = False, worker_incarnation: str = "",
                 round_link: RoundLinkTarget | None = None, kv_linger_s: float = 0.0,
                 publish_interval_s: float = 0.0) -> None:
        self.core = core
        self.worker_incarnation = worker_incarnation
        """The worker's incarnation (WorkerInfo.incarnation) whose KV cache the core's blocks describe: updated when
        a restarted worker is found back, in the same step that forgets the old cache (so a hold never names the
        wrong one; the KV hand-off's pull is fenced by it)."""
        self.vocab_size = vocab_size
        """The worker's vocabulary size, for Submit's token id check; 0: unknown, not checked."""
        self.structured_output = structured_output
        """The worker honours SamplingParams.json_schema (WorkerInfo.structured_output); else Submit refuses it."""
        self.structured_resume = True
        """The worker's grammar replays json_prefix_ids, so a migrated structured request resumes mid-document."""
        self.bus = bus
        self.replica_id = replica_id
        self.model_id = model_id
        self.eos_token_id = eos_token_id
        self.metrics = metrics or SchedulerMetrics()
        self.metrics.bind_model(model_id)
        self.clock = clock
        self.worker_retry_s = worker_retry_s
        self.accepting = True
        self.rates = RoundRates()
        self.publish_first_max_tokens = publish_first_max_tokens
        """A round with at most this many tokens publishes them before the next round is planned; a bigger
        one sends the next plan first (its tokens wait ~ a plan conversion, the worker does not)."""
        self.pipeline = pipeline and use_stream
        """Plan round N+1 while round N executes (needs the round stream)."""
        self._last_done = 0.0
        self._idle: asyncio.Future[None] | None = None
        """While the loop sleeps for want of work: the one future whatever gives it work resolves."""
        self.link = WorkerLink(worker, metrics=self.metrics, health=worker_health, use_stream=use_stream,
                               on_change=self.wake_up, round_link=round_link)
        """The rounds' link: the worker's round link when `round_link` names one, else ExecuteStream."""
        self.publisher = Publisher(bus, kv_linger_s=kv_linger_s, on_kv_entry=self.metrics.kv_entry_published,
                                   token_interval_s=publish_interval_s, on_spaced=self.metrics.publication_spaced)
        self.reporter = Reporter(core, self.publisher, self.metrics, replica_id)
        self.on_scheduled: Callable[[], None] | None = None
        """Called after each round is planned (the KV hand-off's receiver drops the references of received blocks
        whose request the core has placed: scheduler_svc/handoff.py)."""

    @property
    def worker_serving(self) -> bool:
        """False while the worker is unreachable (no rounds run; Submit refuses; the router is told)."""
        return self.link.serving

    @property
    def worker_changed(self) -> asyncio.Event:
        """Set whenever `worker_serving` changes (the agent heartbeats at once)."""
        return self.link.changed

    async def probe_worker(self) -> bool:
        """Ask the worker whether it serves and return the answer (marks it down when not)."""
        return await self.link.probe()

    async def flush(self) -> bool:
        """Wait until every publication queued so far has been handed to Redis, at most the publisher's grace;
        return whether it was (Publisher.flush)."""
        return await self.publisher.flush()

    # ---- requests -------------------------------------------------------------------------
    def submit(self, msg: scheduler_pb2.SubmitRequest, parent: Context | None) -> int:
        """Queue a request; return its queue position. Raises RequestRejected (counted by reason)."""
        now = self.clock()
        request = convert.new_request_from_proto(msg, now, self.eos_token_id)
        try:
            self.core.submit(request, now)
        except RequestRejected as exc:
            self.metrics.rejections.labels(exc.reason.value).inc()
            raise
        self.reporter.track_submitted(msg, request, parent, now, self.model_id, "sluice")
        self.reporter.handle(self.core.take_events(), now)
        self.wake_up()
        return self.core.num_waiting

    def cancel(self, request_id: str, detail: str = "") -> RequestStatus | None:
        """Cancel a request; return its status afterwards (None for an id the core does not know)."""
        now = self.clock()
        status = self.core.cancel(request_id, now, detail)
        self.reporter.handle(self.core.take_events(), now)
        self.wake_up()
        return status

    def live_request_ids(self) -> list[str]:
        """Return the ids of requests not yet terminal."""
        return self.reporter.live_request_ids()

    # ---- the loop -------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Schedule rounds until `stop` is set; then flush every queued publication and return."""
        publisher = asyncio.create_task(self.publisher.run())
        stopped = asyncio.create_task(stop.wait())  # `stop` wakes an idle loop like a submit does
        stopped.add_done_callback(lambda _: self.wake_up())
        try:
            await (self._run_pipelined(stop) if self.pipeline else self._run_serial(stop))
        finally:
            stopped.cancel()
            self.link.drop_stream()
            self.reporter.flush_deferred()
            await self.publisher.close()
            await self.publisher.wait_closed(publisher)  # bounded: Redis may be gone

    async def _run_pipelined(self, stop: asyncio.Event) -> None:
        """The pipelined loop: plan and send round N+1, then read round N's answer (see the module docstring)."""
        reporter = self.reporter
        in_flight: tuple[RoundPlan, float] | None = None
        while not stop.is_set():
            if not self.link.serving:
                if in_flight is not None:
                    # Marked down (a failed probe) with a round in flight: its answer would come on the stream
                    # dropped below, so it is lost like any round of a broken stream (its requests recomputed).
                    self._lost(in_flight[0].round_id)
                    in_flight = None
                reporter.flush_deferred()
                self.link.drop_stream()
                await self._await_worker(stop)
                continue
            now = self.clock()
            deadline = self.core.next_deadline()
            if deadline is not None and deadline <= now:
                self.core.expire(now)
            plan = self.core.schedule(now, overlap=in_flight is not None)
            self._count_charge(plan)
            if self.on_scheduled is not None:
                self.on_scheduled()
            scheduled = self.core.take_events()
            if plan.is_empty:
                reporter.handle(scheduled, now)
                if in_flight is None:
                    await self._wait_for_work(stop)
                    continue
            elif not await self.link.send(plan, functools.partial(reporter.handle, scheduled, now),
                                          reporter.round_traces(plan)):
                self._lost((in_flight or (plan, now))[0].round_id)
                in_flight = None
                continue
            if in_flight is not None and not plan.is_empty:
                self.metrics.rounds_ahead.inc()
            if in_flight is not None and not await self._answer(*in_flight, ahead=not plan.is_empty):
                in_flight = None
                continue
            in_flight = None if plan.is_empty else (plan, now)

    async def _answer(self, plan: RoundPlan, sent_at: float, ahead: bool = False) -> bool:
        """Read round `plan`'s answer and apply it; False when the round was lost with the worker.

        `ahead`: the next round is already queued at the worker, so a small round's tokens can go to Redis
        before the round after is planned (the device does not wait for that plan, the client's tokens
        do not wait for it either)."""
        result = await self.link.receive(plan.round_id)
        done = self.clock()
        elapsed = done - max(sent_at, self._last_done)  # the round's own time, not the one queued before it
        self._last_done = done
        self.metrics.round_duration.observe(elapsed)
        if result is None:
            self._lost(plan.round_id)
            return False
        events = self.core.on_round_result(result, done)
        if not result.error:
            self.rates.observe(plan, elapsed)
            # The tokens go out at once (the publisher runs while the next answer is awaited); the rest is
            # handed over once the next plan is on its way.
            few = len(events.tokens) <= self.publish_first_max_tokens
            if self.reporter.queue_tokens(events, done) and ahead and few:
                await self._let_publisher_send()
        self.reporter.defer(events, done)
        return True

    def _count_charge(self, plan: RoundPlan) -> None:
        """Count the tokens a plan's deep prefill chunks paid for their attention (sluice_attention_charged_tokens)."""
        budget = plan.budget
        if budget is not None and budget.attention_tokens:
            self.metrics.attention_tokens.inc(budget.attention_tokens)

    @staticmethod
    async def _let_publisher_send() -> None:
        """Let the publisher put the tokens just queued on the wire before any other work. Two turns of the
        loop: on one server `Bus.append` writes at the publisher's first step; on a cluster it goes through
        redis-py's XADD, which wrote at the second step when every server went that way."""
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    def _lost(self, round_id: int) -> None:
        """The worker went away with round `round_id` (and any later one) in flight: re-queue their requests."""
        now = self.clock()
        self.reporter.handle(self.core.on_round_lost(round_id, now), now)
        self.link.set_serving(False, self.core.num_waiting)

    async def _run_serial(self, stop: asyncio.Event) -> None:
        """The serial loop: plan, execute, apply, one round at a time."""
        while not stop.is_set():
            if not self.link.serving:
                self.reporter.flush_deferred()
                self.link.drop_stream()
                await self._await_worker(stop)
                continue
            now = self.clock()
            deadline = self.core.next_deadline()
            if deadline is not None and deadline <= now:
                self.core.expire(now)
            plan = self.core.schedule(now)
            self._count_charge(plan)
            if self.on_scheduled is not None:
                self.on_scheduled()
            scheduled = self.core.take_events()
            if plan.is_empty:
                self.reporter.handle(scheduled, now)
                await self._wait_for_work(stop)
                continue
            await self._round(plan, now, scheduled)

    async def _round(self, plan: RoundPlan, now: float, scheduled: CoreEvents) -> None:
        """Execute one round and hand its events over."""
        reporter = self.reporter
        # The previous round's deferred events and this round's scheduling events are handed over once the
        # plan is on its way to the worker: that work overlaps the worker's.
        result = await self.link.execute(plan, lambda: reporter.handle(scheduled, now), reporter.round_traces(plan))
        done = self.clock()
        self.metrics.round_duration.observe(done - now)
        if result is None:  # lost with the worker: its requests wait to be recomputed
            reporter.handle(self.core.on_round_lost(plan.round_id, done), done)
            self.link.set_serving(False, self.core.num_waiting)
            return
        events = self.core.on_round_result(result, done)
        if result.error:
            reporter.handle(events, done)
            return
        self.rates.observe(plan, done - now)
        if len(events.tokens) > self.publish_first_max_tokens:
            # A big round: building and sending its deltas would keep the worker waiting for the next
            # plan (measured ~0.85 ms at 256 sequences); they go out right after that plan instead.
            reporter.defer(events, done)
            return
        if reporter.queue_tokens(events, done):
            await self._let_publisher_send()
        reporter.handle(events, done)

    # ---- the worker coming back -----------------------------------------------------------
    async def _await_worker(self, stop: asyncio.Event) -> None:
        """Run no rounds until the worker serves again (or `stop`); queued requests still time out."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.worker_retry_s)
            now = self.clock()
            deadline = self.core.next_deadline()
            if deadline is not None and deadline <= now:
                self.core.expire(now)
                self.reporter.handle(self.core.take_events(), now)
            if not stop.is_set() and await self.link.probe():
                incarnation = await self.link.incarnation()
                if incarnation is None:  # serving, but its Info did not answer: try again (the fence needs it)
                    continue
                self._on_worker_back(incarnation)
                return

    def _on_worker_back(self, incarnation: str | None = None) -> None:
        # A restarted worker holds no KV: running requests are recomputed, host copies are dropped, the
        # cached prefixes are forgotten (the router gets ALL_CLEARED) and every KV hold ends; no await between
        # the new incarnation and the reset, so no HeldKv answer pairs old blocks with the new incarnation.
        if incarnation is not None:
            self.worker_incarnation = incarnation
        if self.core.num_running:
            log.warning("the worker is back while %d requests were running: they are recomputed",
                        self.core.num_running)
        now = self.clock()
        self.reporter.handle(self.core.on_worker_restarted(now), now)
        self.link.set_serving(True)

    def wake_up(self) -> None:
        """Wake the loop if it sleeps for want of work (a submit, a cancel, the worker changing, `stop`)."""
        idle = self._idle
        if idle is not None and not idle.done():
            idle.set_result(None)

    async def _wait_for_work(self, stop: asyncio.Event) -> None:
        """Sleep until a submit/cancel, `stop`, or the next deadline.

        One future that `wake_up` resolves: a new request starts its round one loop turn after Submit (no task
        per sleep, no asyncio.wait). Nothing awaits between the empty plan and here, so no wake-up is missed."""
        if stop.is_set():
            return
        loop = asyncio.get_running_loop()
        self._idle = idle = loop.create_future()
        deadline = self.core.next_deadline()
        timer = None if deadline is None else loop.call_later(max(0.0, deadline - self.clock()), self.wake_up)
        try:
            await idle
        finally:
            self._idle = None
            if timer is not None:
                timer.cancel()
