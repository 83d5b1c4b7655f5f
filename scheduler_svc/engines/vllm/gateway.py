"""The gateway core: a bounded, policy-ordered queue in front of an engine that schedules for itself.

Theory of operation
- vLLM runs its own continuous batching; what it lacks is governance across tenants (its queue is FCFS or
  strict priority). So the agent holds requests here and hands them to the engine only while it has room:
  at most `max_inflight` requests dispatched and not yet ended (llm-d calls this flow control). The order
  of dispatch is Sluice's queue policy (scheduler_svc.core.policies: FCFS, priority with aging, weighted
  fair share, EDF), the very classes the Sluice scheduler runs. With the engine's batch bounded, the order
  of dispatch is the order of service, so fair shares hold on an engine that knows nothing of tenants.
- Fair share is charged with what the engine served: input tokens at dispatch, each output token as it
  streams back (the FairQueue's virtual counters).
- States: the scheduler core's table (scheduler_svc.core.state). WAITING (here) --SCHEDULE (dispatched)-->
  RUNNING --STOP/LENGTH/FAIL--> terminal. A cancel or a deadline while RUNNING is deferred (CANCELLING):
  the driver aborts the engine's request (`take_aborts`), and the request ends when the abort is done
  (`on_aborted`), since only then is the engine's KV free. A terminal state is entered exactly once; tokens
  or ends that arrive for a request that is not RUNNING are dropped and counted (late results never
  resurrect a request).
- The engine lost (process dead, stream broken): every live request ends CANCELLED with detail
  DRAIN_HANDOFF, which admission takes as the hand-off to migration (prompt + streamed tokens elsewhere).
- KV events: the engine's (kv.py translates them) pass through `on_kv` into the events, in order.

Pure: `now` comes in, `CoreEvents` and abort lists go out; the driver (driver.py) does the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.core.config import Policy, SchedulerConfig
from scheduler_svc.core.policies import make_queue
from scheduler_svc.core.request import Request
from scheduler_svc.core.state import Input, apply
from scheduler_svc.engines.vllm.kv import EngineKvEvent, KvTranslator
from sluice.core_errors import RequestRejected
from sluice.types import (
    DRAIN_HANDOFF,
    CoreEvents,
    CoreStats,
    Finished,
    LifecycleEvent,
    NewRequest,
    RejectReason,
    RequestStatus,
    Stage,
    TokenLogprobs,
)

__all__ = ["EngineView", "GatewayConfig", "GatewayCore"]

_FINISH_REASON = {
    RequestStatus.FINISHED_STOP: "stop", RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.CANCELLED: "cancelled", RequestStatus.TIMED_OUT: "timeout", RequestStatus.FAILED: "error",
}


@dataclass(frozen=True)
class GatewayConfig:
    """How the gateway in front of one engine queues and dispatches (frozen; from the agent's flags)."""

    model_id: str
    """The model the engine serves (the router's compatibility key and the block-hash salt)."""
    block_size: int
    """The engine's KV block size in tokens."""
    max_model_len: int
    """Prompt + max_tokens at most (the engine's --max-model-len)."""
    num_blocks: int = 0
    """The engine's KV blocks (vLLM's cache_config_info num_gpu_blocks); 0: unknown."""
    adapter_version: str = ""
    """The adapter the engine serves ("" none)."""
    policy: Policy = Policy.FCFS
    """Order of dispatch."""
    aging_rate: float = 1.0
    """PRIORITY: priority gained per second of waiting."""
    fair_input_weight: float = 1.0
    """FAIR: weight of an input token in a tenant's virtual counter."""
    fair_output_weight: float = 2.0
    """FAIR: weight of an output token in a tenant's virtual counter."""
    tenant_weights: tuple[tuple[str, float], ...] = ()
    """FAIR: weights by tenant (admission's configuration overrides them per request)."""
    max_waiting: int = 4096
    """Requests held here at most; more are refused with QUEUE_FULL."""
    max_inflight: int = 16
    """Requests dispatched to the engine and not yet ended, at most."""
    max_num_batched_tokens: int = 2048
    """The engine's round token budget (reported to the router)."""
    max_num_seqs: int = 256
    """The engine's sequences per round (reported)."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_model_len < 1 or self.max_inflight < 1 or self.max_waiting < 0:
            raise ValueError(f"block_size {self.block_size}, max_model_len {self.max_model_len} and max_inflight "
                             f"{self.max_inflight} must be >= 1 and max_waiting {self.max_waiting} >= 0")

    def queue_config(self) -> SchedulerConfig:
        """The settings the queue policies read, in the scheduler core's configuration type."""
        return SchedulerConfig(num_blocks=1, policy=self.policy, aging_rate=self.aging_rate,
                               fair_input_weight=self.fair_input_weight, fair_output_weight=self.fair_output_weight,
                               tenant_weights=self.tenant_weights, model_id=self.model_id)


@dataclass(frozen=True)
class EngineView:
    """What the engine's own metrics last said (vLLM's /metrics); counters are totals since it started."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    preemptions: int = 0


@dataclass
class _Counters:
    finished: int = 0
    cancelled: int = 0
    timed_out: int = 0
    dispatched: int = 0
    dropped_results: int = 0


class GatewayCore:
    """The queue and the record of one engine's requests; see the module docstring."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.kv = KvTranslator(config.model_id, config.block_size)
        self.engine = EngineView()
        self._queue = make_queue(config.policy, config.queue_config())
        self._live: dict[str, Request] = {}
        self._stream_intervals: dict[str, int] = {}
        """Live requests whose stream may come in chunks of more than one token (SubmitRequest.stream_interval)."""
        self._running: dict[str, Request] = {}
        self._aborts: list[str] = []
        self._details: dict[str, str] = {}
        self._events = CoreEvents()
        self._counters = _Counters()
        self._seq = 0
        self._seen_view = False
        self._totals = (0, 0, 0)
        """Prefix-cache hit tokens, query tokens and preemptions the engine counted since the first view."""

    # ---- requests in ------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests queued here, not yet dispatched."""
        return len(self._queue)

    def submit(self, new: NewRequest, now: float, stream_interval: int = 1) -> None:
        """Queue a request, whose client takes its tokens `stream_interval` at a time after the first. Raises
        RequestRejected (nothing changed) when it is a duplicate, invalid, longer than the model allows, or the
        queue is full."""
        prompt, max_tokens = len(new.prompt_token_ids), new.sampling.max_tokens
        if new.request_id in self._live:
            raise RequestRejected(new.request_id, RejectReason.DUPLICATE, "a live request has this id")
        if prompt == 0 or max_tokens < 1:
            raise RequestRejected(new.request_id, RejectReason.INVALID,
                                  f"prompt of {prompt} tokens (>= 1) and max_tokens {max_tokens} (>= 1)")
        if prompt + max_tokens > self.config.max_model_len:
            raise RequestRejected(new.request_id, RejectReason.NEVER_FITS,
                                  f"prompt {prompt} + max_tokens {max_tokens} tokens exceed the engine's "
                                  f"max_model_len {self.config.max_model_len}")
        if len(self._queue) >= self.config.max_waiting:
            raise RequestRejected(new.request_id, RejectReason.QUEUE_FULL,
                                  f"{len(self._queue)} requests wait for this engine (max {self.config.max_waiting})")
        self._seq += 1
        request = Request(new, self._seq)
        request.pending_prefill = prompt
        if new.tenant_weight is not None:
            self._queue.set_tenant_weight(new.tenant, new.tenant_weight)
        self._queue.on_live(new.tenant, 1, now)
        self._queue.push(request)
        self._live[new.request_id] = request
        if stream_interval > 1:
            self._stream_intervals[new.request_id] = stream_interval
        self._lifecycle(request, Stage.ENQUEUED, now)

    def dispatch(self, now: float) -> list[Request]:
        """Return the requests to send to the engine now (RUNNING from here on), in policy order."""
        out: list[Request] = []
        queue, limit = self._queue, self.config.max_inflight
        while len(self._running) < limit and len(queue):
            request = queue.pop()
            apply(request, Input.SCHEDULE)
            request.first_scheduled_time = now
            request.pending_prefill = 0
            self._running[request.request_id] = request
            self._queue.on_service(request.tenant, request.num_prompt, 0)
            self._counters.dispatched += 1
            self._lifecycle(request, Stage.FIRST_SCHEDULED, now)
            out.append(request)
        return out

    # ---- what the engine says ---------------------------------------------------------------------------
    def on_tokens(self, request_id: str, token_ids: list[int], now: float,
                  logprobs: list[TokenLogprobs] | None = None) -> bool:
        """Record output tokens the engine streamed; False (dropped, counted) when the request is not RUNNING.

        Tokens past max_tokens are dropped too: the client never gets more than it asked for."""
        request = self._running.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            self._counters.dropped_results += 1
            return False
        room = request.max_tokens - request.num_outputs
        accepted = token_ids[:max(room, 0)]
        if len(accepted) < len(token_ids):
            self._counters.dropped_results += 1
        if not accepted:
            return not token_ids
        index = request.num_outputs
        if index == 0:
            request.first_token_time = now
            self._lifecycle(request, Stage.FIRST_TOKEN, now)
        request.tokens.extend(accepted)
        self._events.tokens.extend((request_id, index + i, token) for i, token in enumerate(accepted))
        if logprobs is not None:
            for i, entry in enumerate(logprobs[:len(accepted)]):
                self._events.logprobs[(request_id, index + i)] = entry
        self._queue.on_service(request.tenant, 0, len(accepted))
        return True

    def on_finished(self, request_id: str, stopped: bool, now: float, cached_tokens: int = 0) -> bool:
        """The engine ended the request (`stopped`: a stop token or string; else its length). False when it
        was not RUNNING (dropped, counted)."""
        request = self._running.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            self._counters.dropped_results += 1
            return False
        request.usage.cached_tokens = cached_tokens
        stop = stopped and request.num_outputs < request.max_tokens or request.num_outputs == 0
        self._end(request, Input.STOP if stop else Input.LENGTH, now)
        return True

    def on_failed(self, request_id: str, detail: str, now: float) -> bool:
        """The engine refused or broke this one request (FAILED with `detail`); False when not RUNNING."""
        request = self._running.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            return False
        self._end(request, Input.FAIL, now, detail)
        return True

    def on_aborted(self, request_id: str, now: float) -> bool:
        """The engine's request was aborted (its KV is free): a CANCELLING request ends now."""
        request = self._running.get(request_id)
        if request is None or request.status is not RequestStatus.CANCELLING:
            return False
        release = request.release_input
        assert isinstance(release, Input)
        self._end(request, release, now, self._details.pop(request_id, ""))
        return True

    def on_engine_lost(self, now: float) -> list[str]:
        """The engine is gone: every live request ends CANCELLED with DRAIN_HANDOFF (admission migrates it).
        Returns their ids."""
        ended = list(self._live)
        for request in list(self._live.values()):
            if request.status is RequestStatus.CANCELLING:
                release = request.release_input
                assert isinstance(release, Input)
                self._end(request, release, now, self._details.pop(request.request_id, ""))
            else:
                self._end(request, Input.CANCEL, now, DRAIN_HANDOFF)
        return ended

    def on_engine_view(self, view: EngineView) -> None:
        """Record what the engine's metrics say. Its counters are totals since it started: what they gained since
        the last view is added here (the first view is the base), and a counter that went down is a restarted
        engine counting from 0 again, so the replica's own totals never go back."""
        if self._seen_view:
            last, totals = self.engine, self._totals
            gained = [now - before if now >= before else now for now, before in (
                (view.prefix_hit_tokens, last.prefix_hit_tokens), (view.prefix_query_tokens, last.prefix_query_tokens),
                (view.preemptions, last.preemptions))]
            self._totals = (totals[0] + gained[0], totals[1] + gained[1], totals[2] + gained[2])
        self._seen_view = True
        self.engine = view

    def on_kv(self, events: list[EngineKvEvent]) -> None:
        """Translate a batch of the engine's KV events into the replica's (kv.py)."""
        self._events.kv_events.extend(self.kv.translate(events))

    def kv_reset(self) -> None:
        """The engine's events had a gap replay could not fill (or it restarted): ALL_CLEARED."""
        self._events.kv_events.append(self.kv.reset())

    def kv_snapshot(self) -> tuple[int, list[int]]:
        """Return (last event id, the hashes of every block the engine holds) for the router's snapshot."""
        return self.kv.last_event_id, self.kv.snapshot()

    def host_hashes(self) -> tuple[int, ...]:
        """Return the host-tier hashes for the snapshot: none (the engine's own CPU blocks are not tracked here)."""
        return ()

    # ---- cancel and deadlines ---------------------------------------------------------------------------
    def cancel(self, request_id: str, now: float, detail: str = "") -> RequestStatus | None:
        """Cancel a request: at once if queued here, after the engine's abort if dispatched. Returns its status
        afterwards (CANCELLED or CANCELLING), or None for an id that is not live."""
        request = self._live.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.WAITING:
            self._end(request, Input.CANCEL, now, detail)
        elif request.status is RequestStatus.RUNNING:
            self._defer(request, Input.CANCEL_DEFERRED, Input.RELEASE_CANCELLED, now, detail)
        return request.status

    def expire(self, now: float) -> None:
        """End what is past its deadline: TIMED_OUT (a dispatched request after the engine's abort)."""
        for request in list(self._live.values()):
            due = _due(request, now)
            if not due:
                continue
            if request.status is RequestStatus.WAITING:
                self._end(request, Input.TIMEOUT, now, due)
            elif request.status is RequestStatus.RUNNING and request.deadline is not None and now >= request.deadline:
                self._defer(request, Input.TIMEOUT_DEFERRED, Input.RELEASE_TIMED_OUT, now, due)

    def next_deadline(self) -> float | None:
        """Return the earliest deadline among live requests that could still time out (None: none)."""
        times = [t for r in self._live.values() for t in _deadlines(r)]
        return min(times) if times else None

    def take_aborts(self) -> list[str]:
        """Return (and forget) the dispatched requests whose engine request must be aborted now."""
        aborts, self._aborts = self._aborts, []
        return aborts

    def take_events(self) -> CoreEvents:
        """Return everything to report since the last call (tokens, ends, lifecycle, KV events)."""
        events, self._events = self._events, CoreEvents()
        events.dropped_results, self._counters.dropped_results = self._counters.dropped_results, 0
        return events

    def live_request_ids(self) -> list[str]:
        """Ids of the requests not yet terminal."""
        return list(self._live)

    def stream_interval(self, request_id: str) -> int:
        """Tokens the client of a live request takes at a time after its first, as submitted (1 when unknown)."""
        return self._stream_intervals.get(request_id, 1)

    def stats(self) -> CoreStats:
        """The replica's counters: the queue here plus the engine's own view of its batch and KV."""
        engine, counters, total = self.engine, self._counters, self.config.num_blocks
        used = round(engine.kv_usage * total)
        hits, queries, preemptions = self._totals
        return CoreStats(
            waiting=len(self._queue) + engine.waiting, running=len(self._running), kv_blocks_total=total,
            kv_blocks_used=used, kv_blocks_free=max(total - used, 0), kv_blocks_cached=len(self.kv),
            host_blocks_total=0, host_blocks_used=0, preemptions=preemptions, recomputed_tokens=0,
            dropped_results=0, rounds=counters.dispatched, queued_prefill_tokens=self._queued_prefill(),
            finished=counters.finished, cancelled=counters.cancelled, timed_out=counters.timed_out,
            prefix_hit_tokens=hits, prefix_query_tokens=queries, host_hit_tokens=0, host_blocks_cached=0)

    def _queued_prefill(self) -> int:
        """Prompt tokens queued here and dispatched but not yet answered with a first token."""
        waiting = sum(r.num_prompt for r in self._live.values() if r.status is RequestStatus.WAITING)
        return waiting + sum(r.num_prompt for r in self._running.values() if r.first_token_time is None)

    # ---- internals --------------------------------------------------------------------------------------
    def _defer(self, request: Request, event: Input, release: Input, now: float, detail: str) -> None:
        apply(request, event)
        request.release_input = release
        self._details[request.request_id] = detail
        self._aborts.append(request.request_id)
        self._lifecycle(request, Stage.CANCEL_REQUESTED, now)

    def _end(self, request: Request, event: Input, now: float, detail: str = "") -> None:
        was_queued = request.status is RequestStatus.WAITING
        status = apply(request, event)
        if was_queued:
            self._queue.remove(request)
        dispatched = self._running.pop(request.request_id, None) is not None
        del self._live[request.request_id]
        self._stream_intervals.pop(request.request_id, None)
        self._queue.on_live(request.tenant, -1, now)
        counters = self._counters
        if status is RequestStatus.CANCELLED:
            counters.cancelled += 1
        elif status is RequestStatus.TIMED_OUT:
            counters.timed_out += 1
        else:
            counters.finished += 1
        request.usage.output_tokens = request.num_outputs
        self._events.finished.append(Finished(
            request.request_id, request.tenant, status, _FINISH_REASON[status], request.usage, request.arrival_time,
            request.first_scheduled_time, request.first_token_time, now, request.output_ids, detail))
        self._lifecycle(request, Stage.FINISHED, now, (("status", status.value),))
        if dispatched:
            self._lifecycle(request, Stage.KV_RELEASED, now)

    def _lifecycle(self, request: Request, stage: Stage, now: float,
                   detail: tuple[tuple[str, int | str], ...] = ()) -> None:
        self._events.lifecycle.append(LifecycleEvent(request.request_id, stage, now, detail))


def _deadlines(request: Request) -> list[float]:
    times = [request.deadline] if request.deadline is not None else []
    if request.status is RequestStatus.WAITING and request.queue_deadline is not None:
        times.append(request.queue_deadline)
    return [t for t in times if t is not None]


def _due(request: Request, now: float) -> str:
    """Why `request` has timed out at `now` ("" if it has not)."""
    if request.deadline is not None and now >= request.deadline:
        return "deadline"
    if request.status is RequestStatus.WAITING and request.queue_deadline is not None and now >= request.queue_deadline:
        return "queue deadline"
    return ""
