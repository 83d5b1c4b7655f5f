"""The discrete-event simulator: the real admission, router and scheduler cores on a virtual clock.

Theory of operation. The simulator adds exactly three things to the cores the services run:
a clock, an event heap ordered by (time, seq) with a per-simulator counter (so equal times
resolve in the order events were created, and a run is deterministic for a seed), and the GPU
cost model. Everything that decides anything is the cores' code, unchanged:

- arrival: `AdmissionCore.validate` + `admit` (bounded budgets, explicit rejections), then
  `RouterCore.route`, then admission's early TTFT refusal, then `SchedulerCore.submit` on the chosen
  replica (the front door's calls into the admission core are in sluice_tools/sim/admission.py);
- a replica with no round in flight calls `schedule(now)`; a non-empty plan is executed by the
  cost model, whose modelled time puts the round's result on the heap at now + gap + t; the result
  goes to `on_round_result` and the replica schedules again. `round_gap_s` is the device's idle time
  between rounds that the live loop leaves (the worker's `sluice_worker_idle_seconds`);
- `submit_delay_s` and `token_delay_s`: what the live stack adds outside the rounds, on the way in
  (admission, routing, the Submit RPC) and out (Redis stream, admission, the client); the fidelity
  benchmark (`sluice_tools.fidelity`) fits them, with `round_gap_s`, on one live run;
- pipelining, as the live driver does by default (`SimConfig.pipeline`): when a round starts, the
  next one is planned at once with `schedule(now, overlap=True)` and starts when the first one's
  result has been applied, so arrivals during a round wait for the round after next, as they do live;
- the core's events are delivered as a service would: tokens and terminal records to the request
  records, `Finished` to `AdmissionCore.release` and `RouterCore.on_request_done`, KV events to
  `RouterCore.apply_kv_events` (a gap asks for `kv_snapshot`);
- every `heartbeat_interval_s` each replica heartbeats as the services do, through the one glue
  (`sluice.glue`): `heartbeat_report` from its core's `stats()` and the `RoundRates` measured from
  its rounds' modelled times, then `apply_heartbeat` (the router servicer's reconciliation); only a
  heartbeat that would change nothing the router holds, or whose writes the next tick redoes before any
  route reads them, is skipped (`_on_heartbeat`);
- a request refused after routing (admission's early TTFT refusal) or by the replica's core is
  forgotten by `RouterCore.on_request_done`, the path the router service takes for the REJECTED
  completion admission publishes: its routed work is taken back at once;
- cancellations (`cancel_after_s`) call `cancel`; deadlines are the core's, polled at
  `next_deadline()` with `expire`; replicas start WARMING and heartbeat READY after `warmup_s`.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from admission_svc.core import AdmissionCore, InvalidRequest, OverBudget
from router_svc.core import NoReplicaAvailable, ReplicaSpec, RouteDecision, RouteQuery, RouterCore
from scheduler_svc.collector import tune_collector
from scheduler_svc.core import SchedulerCore
from sluice import glue
from sluice.core_errors import RequestRejected
from sluice.hashing import hash_packed, salt_of
from sluice.types import CoreEvents, NewRequest, ReplicaState, RoundPlan, SamplingParams
from sluice_tools.metrics import RequestRecord
from sluice_tools.sim import fastforward, outputs
from sluice_tools.sim.admission import SimAdmission
from sluice_tools.sim.config import DEFAULT_MAX_MODEL_LEN, SimConfig
from sluice_tools.sim.control_plane import ControlPlane
from sluice_tools.sim.replica import Replica as _Replica
from sluice_tools.sim.replica import replica_spec
from sluice_tools.workload import WorkloadRequest
from worker_svc.costmodel import CostModel

# Event kinds, in no particular order (the heap orders by time, then creation).
_ARRIVAL, _ROUND_DONE, _CANCEL, _DEADLINE, _HEARTBEAT, _SAMPLE, _READY, _RETRY, _SUBMIT = range(9)
_FAST_KINDS = (_ROUND_DONE, _HEARTBEAT, _SAMPLE)  # what fastforward.py needs to know of the heap

PROMPT_BATCH = 128
"""Prompts made at once, for an arrival and the ones after it (`Simulator._prompt`): ~1.5 MB of ids and hashes
on the Azure trace. In-process per arrival, --max-requests 3000: 32 about 106 us, 128 about 90, 512 no better."""

class Simulator:
    """One simulated deployment; `run()` plays a workload through it and returns the records."""

    superseded_heartbeats = True
    """Leave out a replica's heartbeat that the next tick replaces before anything reads the router's loads (a
    route: an arrival or a retry), see `_on_heartbeat`. A subclass whose own events read them sets this False."""

    def __init__(self, config: SimConfig, requests: Sequence[WorkloadRequest]) -> None:
        """Build the cores and the cost model; raises ValueError for unknown names or a bad config."""
        self.config = config
        self.cost = CostModel(config.model, config.gpu, block_size=config.scheduler.block_size,
                              coefficients=config.cost_coefficients, host_kv_bytes=config.host_kv_bytes)
        info = self.cost.info()
        self.vocab_size = info.vocab_size
        self.num_blocks = config.num_blocks or info.num_blocks
        self.max_model_len = config.max_model_len or DEFAULT_MAX_MODEL_LEN.get(
            config.model, info.max_model_len
        )
        scheduler_config = config.scheduler_config(self.num_blocks, info.num_host_blocks, self.max_model_len)
        self.admission = AdmissionCore(config.admission_config(self.max_model_len))
        self.router = RouterCore(config.router_config())
        self.replicas = [
            _Replica(i, f"replica-{i}", SchedulerCore(scheduler_config, f"replica-{i}"))
            for i in range(config.replicas)
        ]
        self.requests = sorted(requests, key=lambda r: r.arrival_s)
        self.records: dict[str, RequestRecord] = {}
        self.predicted: dict[str, tuple[float, float]] = {}
        """Admitted request id -> (time routed, the router's predicted TTFT), for the prediction error."""
        self.series: dict[str, list[tuple[float, float]]] = {k: [] for k in (
            "waiting", "running", "kv_used_frac", "replicas_ready", "admission_active", "prefix_hit_rate",
            "preemptions", "recomputed_tokens")}
        self.now = 0.0
        self.on_progress: Callable[[float], None] | None = None
        """Called with the simulated time at every sample (`sluice sim --progress`)."""
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._next_arrival = 0
        self._arrival_at = float("inf")
        """When the arrival on the heap is (one at a time); inf once every request arrived."""
        self._retries = 0
        """Retries on the heap (each one routes again)."""
        self._token_times: dict[str, array] = {}
        self._prompts: dict[str, tuple[WorkloadRequest, array, tuple[int, ...]]] = {}
        """Prompts made ahead of their arrival (`_prompt`): request id -> (request, prompt, hash chain)."""
        self._placement: dict[str, _Replica] = {}
        self._hash_prompts = config.router.policy.uses_prefix
        self._salt = salt_of(config.model)
        # admission: the front door's calls into the core (client max_tokens, KV hashes, TTFT refusal, growth)
        self.front_door = SimAdmission(self.admission, config.model, config.client_max_tokens, self.max_model_len,
                                       config.scheduler.block_size, self._salt, self.vocab_size)
        self._growth_signal = self.front_door.on_token if self.front_door.grows else None
        self._pipeline = config.pipeline
        # Steady decode rounds in bulk (fastforward.py): pipelined, without per-token admission calls.
        # The load-dependent control plane (sim/control_plane.py) stretches the delays per round and token.
        self._cpu = None if config.control_plane is None else ControlPlane(config.control_plane)
        self._fast = (config.pipeline and self._growth_signal is None and fastforward.enabled()
                      and self._cpu is None)
        self._gap = config.round_gap_s
        self._token_delay = config.token_delay_s
        self.rounds = 0
        self.dropped_results = 0
        self.kv_snapshots = 0
        self.wall_s = 0.0
        self.end_s = 0.0
        """Simulated time of the last terminal state."""

    # ---- the heap ---------------------------------------------------------------------------
    def push(self, when: float, kind: int, payload: object = None) -> None:
        """Schedule an event at `when` (never in the past)."""
        self._seq += 1
        heapq.heappush(self._heap, (max(when, self.now), self._seq, kind, payload))

    # ---- the run ----------------------------------------------------------------------------
    def run(self) -> list[RequestRecord]:
        """Play every request to a terminal state; return the records in arrival order.

        The garbage collector is tuned as in the scheduler (`scheduler_svc.collector`), for the rounds of
        every replica in flight at once (two each when pipelined), and restored afterwards."""
        thresholds = gc.get_threshold()
        in_flight = len(self.replicas) * (2 if self._pipeline else 1)
        tune_collector(self.config.scheduler.max_num_seqs * in_flight)
        try:
            return self._run()
        finally:
            gc.set_threshold(*thresholds)

    def _run(self) -> list[RequestRecord]:
        started = time.perf_counter()
        for replica in self.replicas:
            self._register(replica)
            self.push(self.config.warmup_s, _READY, replica)
        self.push(0.0, _HEARTBEAT)
        self.push(0.0, _SAMPLE)
        self._push_next_arrival()
        handlers = self._handlers()
        heap, pop = self._heap, heapq.heappop
        while heap:
            when, _, kind, payload = pop(heap)
            self.now = when
            handlers[kind](payload)
        outputs.finish_stragglers(self)
        self.end_s = max((r.finish_s or 0.0 for r in self.records.values()), default=0.0)
        self.wall_s = time.perf_counter() - started
        return list(self.records.values())

    def _handlers(self) -> dict[int, Callable[[Any], None]]:
        return {
            _ARRIVAL: self._on_arrival,
            _ROUND_DONE: self._on_round_done,
            _CANCEL: self._on_cancel,
            _DEADLINE: self._on_deadline,
            _HEARTBEAT: self._on_heartbeat,
            _SAMPLE: self._on_sample,
            _READY: self._on_ready,
            _RETRY: self._on_retry,
            _SUBMIT: self._on_submit,
        }

    def _busy(self) -> bool:
        """True while anything but the periodic events can still change a request."""
        if self._next_arrival < len(self.requests):
            return True
        if any(r.busy or r.core.has_unfinished() for r in self.replicas):
            return True
        # Cancel and deadline events of requests already gone are no-ops; retries are not.
        return any(kind == _RETRY for _, _, kind, _ in self._heap)

    def _push_next_arrival(self) -> None:
        if self._next_arrival < len(self.requests):
            request = self.requests[self._next_arrival]
            self._next_arrival += 1
            self._arrival_at = max(request.arrival_s, self.now)  # as push() puts it
            self.push(request.arrival_s, _ARRIVAL, request)
        else:
            self._arrival_at = float("inf")

    # ---- arrivals ---------------------------------------------------------------------------
    def _on_arrival(self, request: WorkloadRequest) -> None:
        self._push_next_arrival()
        record = RequestRecord(
            request.request_id,
            tenant=request.tenant,
            priority=request.priority,
            arrival_s=self.now,
            input_tokens=request.input_length,
        )
        self.records[request.request_id] = record
        self._admit(request, record)

    def _on_retry(self, payload: tuple[WorkloadRequest, RequestRecord]) -> None:
        request, record = payload
        self._retries -= 1
        record.retries += 1
        record.status = "ok"
        self._admit(request, record)

    def _reject(
        self, request: WorkloadRequest, record: RequestRecord, detail: str, retry_after: float | None
    ) -> None:
        if retry_after is not None and record.retries < self.config.max_retries:
            self._retries += 1
            self.push(self.now + retry_after, _RETRY, (request, record))
            return
        record.status, record.finish_s, record.detail = "rejected", self.now, detail

    def _admit(self, request: WorkloadRequest, record: RequestRecord) -> None:
        rid, now = request.request_id, self.now
        try:
            self.front_door.admit(request, now)
        except InvalidRequest as error:
            self._reject(request, record, f"invalid: {error.detail}", None)
            return
        except OverBudget as error:
            self._reject(request, record, f"over budget {error.budget}", error.retry_after_s)
            return
        prompt, hashes = self._prompt(request, fresh=record.retries == 0)
        query = RouteQuery(rid, self.config.model, "", hashes, request.input_length, request.output_length)
        try:
            decision = self._route(query)
        except NoReplicaAvailable as error:
            self.admission.release(rid, now)
            self._reject(request, record, f"unavailable: {error}", max(self.config.warmup_s - now, 0.1))
            return
        replica = self.replicas[int(decision.replica_id.rsplit("-", 1)[1])]
        refusal = self.front_door.refused_early(rid, decision.predicted_ttft_s, now)  # admission: TTFT SLO
        if refusal is not None:
            self._forget_routed(replica, rid)
            self._reject(request, record, f"over budget {refusal.budget}", refusal.retry_after_s)
            return
        self.predicted[rid] = (now, decision.predicted_ttft_s)
        delay = self.config.submit_delay_s
        if self._cpu is not None:
            delay = self._cpu.submit_delay(now, delay)
        if delay > 0:
            self.push(now + delay, _SUBMIT, (replica, request, record, prompt, hashes))
            return
        self._submit(replica, request, record, prompt, hashes)

    def _prompt(self, request: WorkloadRequest, fresh: bool) -> tuple[array, tuple[int, ...]]:
        """Return the request's prompt as the core takes it and, when the router scores prefixes, its hash chain.

        A fresh arrival's comes from a batch made for it and the next `PROMPT_BATCH - 1` arrivals in one loop:
        each is a function of its request alone, so the values are the same, and in a loop numpy's generator
        set-up and the hashing run with warm caches (`prompt_ids` on the first 3,000 requests: 88 us a call
        between two events' work, 37 us in a loop). What a batch made for requests that were refused before
        this step is dropped with it.
        """
        made = self._prompts.pop(request.request_id, None)
        if made is not None and made[0] is request:  # (ids are unique in a workload; the object says so for sure)
            return made[1], made[2]
        if not fresh:  # a retry: its prompt was taken at its first admission
            return self._make_prompt(request)
        self._prompts.clear()
        upcoming = self.requests[self._next_arrival - 1 : self._next_arrival - 1 + PROMPT_BATCH - 1]
        for later in upcoming:  # the arrival on the heap and those after it (this one was popped)
            if later is not request:
                self._prompts[later.request_id] = (later, *self._make_prompt(later))
        return self._make_prompt(request)

    def _make_prompt(self, request: WorkloadRequest) -> tuple[array, tuple[int, ...]]:
        # The ids as an array: packed for hashing and copied into the core's own array as bytes, no int per token.
        ids = request.prompt_ids(self.vocab_size)
        prompt = array("q", ids.tobytes())
        hashes = tuple(hash_packed(ids.astype("<i4").tobytes(), self.config.scheduler.block_size, self._salt)
                       ) if self._hash_prompts else ()
        return prompt, hashes

    def _on_submit(
        self, payload: tuple[_Replica, WorkloadRequest, RequestRecord, Sequence[int], tuple[int, ...]]
    ) -> None:
        self._submit(*payload)

    def _submit(
        self, replica: _Replica, request: WorkloadRequest, record: RequestRecord, prompt: Sequence[int],
        hashes: tuple[int, ...] = (),
    ) -> None:
        """Submit to the replica's core; `hashes`, the prompt's chain hashed for routing, spares the core hashing it again."""
        rid, now = request.request_id, self.now
        replica.reported_idle = False  # the router counted this request as unreported work
        deadline = None if request.deadline_s is None else record.arrival_s + request.deadline_s
        new = NewRequest(
            rid,
            prompt,
            SamplingParams(max_tokens=request.output_length, ignore_eos=True),
            tenant=request.tenant,
            priority=request.priority,
            arrival_time=now,
            deadline=deadline,
            eos_token_id=None,
            tenant_weight=self.admission.tenant_weight(request.tenant),  # as admission_svc sends it
        )
        try:
            replica.core.submit(new, now, hashes, self._salt)
        except RequestRejected as error:
            self.admission.release(rid, now)
            self._forget_routed(replica, rid)
            self._reject(request, record, f"{error.reason.value}: {error.detail}", None)
            return
        record.replica = replica.replica_id
        self._placement[rid] = replica
        self._token_times[rid] = array("d")
        if request.cancel_after_s is not None:
            self.push(record.arrival_s + request.cancel_after_s, _CANCEL, rid)
        self._absorb(replica, replica.core.take_events())
        self._watch_deadline(replica)
        self._kick(replica)

    # ---- replicas ---------------------------------------------------------------------------
    def _kick(self, replica: _Replica) -> None:
        """Start a round on an idle replica if its scheduler has work for one."""
        if replica.busy:
            return
        now = self.now
        plan = replica.core.schedule(now)
        if plan.is_empty:
            return
        self._start(replica, plan)

    def _start(self, replica: _Replica, plan: RoundPlan) -> None:
        """Execute `plan` now (its result after the gap and its modelled time); plan the next one ahead."""
        now = self.now
        result = self.cost.execute(plan)
        replica.busy = True
        self.rounds += 1
        # push() inlined: this runs once per simulated round
        self._seq += 1
        gap = self._gap if self._cpu is None else self._cpu.round_gap(now, self._gap, len(plan.seqs), replica.index)
        heapq.heappush(self._heap, (now + gap + result.elapsed_s, self._seq, _ROUND_DONE,
                                    (replica, plan, result)))
        if self._pipeline:
            ahead = replica.core.schedule(now, overlap=True)
            replica.ahead = None if ahead.is_empty else ahead

    def _on_round_done(self, payload: tuple[_Replica, RoundPlan, Any]) -> None:
        replica, plan, result = payload
        if self._fast and replica.ahead is not None and fastforward.fast_forward(self, replica, plan, result, _FAST_KINDS):
            return
        replica.busy = False
        replica.rates.observe(plan, result.elapsed_s)
        self._absorb(replica, replica.core.on_round_result(result, self.now))
        ahead = replica.ahead
        if ahead is not None:
            replica.ahead = None
            self._start(replica, ahead)
        else:
            self._kick(replica)

    def _on_cancel(self, request_id: str) -> None:
        replica = self._placement.get(request_id)
        if replica is None:
            return
        replica.core.cancel(request_id, self.now)
        self._absorb(replica, replica.core.take_events())
        self._kick(replica)

    def _watch_deadline(self, replica: _Replica) -> None:
        deadline = replica.core.next_deadline()
        if deadline is not None and (replica.deadline_at is None or deadline < replica.deadline_at):
            replica.deadline_at = deadline
            self.push(deadline, _DEADLINE, replica)

    def _on_deadline(self, replica: _Replica) -> None:
        if replica.deadline_at is not None and replica.deadline_at > self.now:
            return  # superseded by an earlier watch that already ran
        replica.deadline_at = None
        replica.core.expire(self.now)
        self._absorb(replica, replica.core.take_events())
        self._watch_deadline(replica)
        self._kick(replica)

    def _on_ready(self, replica: _Replica) -> None:
        replica.state = ReplicaState.READY
        self._heartbeat(replica)  # as the scheduler's agent does once its worker serves

    def _on_heartbeat(self, _: object) -> None:
        now = self.now
        fleet = self.router.fleet
        busy = self._busy()
        following = now + self.config.heartbeat_interval_s
        # Superseded: the next tick comes before the next route (the only reader of the loads a heartbeat writes;
        # what else touches the router meanwhile, completions and KV events, comes out the same after it).
        superseded = busy and self.superseded_heartbeats and following < self._next_route_at()
        for replica in self.replicas:
            if replica.reported_idle and not replica.busy and not replica.core.has_unfinished():
                seen = fleet.find(replica.replica_id)
                if seen is None or not seen.unreported:
                    # Live, every replica heartbeats. This one would report the (empty) load the router holds,
                    # no round since moved its rates, and the router holds no routed-but-unreported work for
                    # it: the heartbeat would change no routing decision (only the heartbeat time, which the
                    # simulator never expires), so it is skipped, which saves most of the heartbeat cost on a
                    # lightly loaded fleet. Work routed here since (refused, or not yet submitted) is reset by
                    # the heartbeat as live.
                    continue
            if superseded and self._replaced_by_next(replica, now):
                continue
            self._heartbeat(replica)
        if busy:
            self.push(following, _HEARTBEAT)

    def _next_route_at(self) -> float:
        """Return the time of the next event that routes (the arrival on the heap, or a retry)."""
        if not self._retries:
            return self._arrival_at
        return min(self._arrival_at, *(when for when, _, kind, _ in self._heap if kind == _RETRY))

    def _replaced_by_next(self, replica: _Replica, now: float) -> bool:
        """True when the replica's heartbeat now does nothing the next one (before any route) does not redo: the load,
        the heartbeat time and the reset of unreported work are written again, read by no one in between. Not so
        for a state change (the report reconciles it) or an idle report that would forget stale routes."""
        seen = self.router.fleet.find(replica.replica_id)
        if seen is None or seen.state is not ReplicaState.READY or replica.state is not ReplicaState.READY:
            return False
        return not seen.routed_at or min(seen.routed_at.values()) >= now - self.router.config.heartbeat_timeout_s

    def _on_sample(self, _: object) -> None:
        outputs.sample(self)
        if self.on_progress is not None:
            self.on_progress(self.now)
        if self._busy():
            self.push(self.now + self.config.sample_interval_s, _SAMPLE)

    # ---- the router, through the services' glue ---------------------------------------------
    def _register(self, replica: _Replica) -> None:
        """Register the replica with the router (WARMING), as the scheduler's agent does at start."""
        self.router.register(self._replica_spec(replica), self.now)

    def _replica_spec(self, replica: _Replica) -> ReplicaSpec:
        cfg = self.config.scheduler
        spec = replica_spec(replica.replica_id, self.config.model, self.cost, cfg.block_size, self.num_blocks,
                            cfg.max_num_batched_tokens)
        return dataclasses.replace(spec, attention_pairs_per_token=cfg.attention_pairs_per_token or 0,
                                   attention_free_context=cfg.attention_free_context)

    def _heartbeat(self, replica: _Replica) -> None:
        """Send one heartbeat of the replica: the services' report and reconciliation (sluice.glue)."""
        core = replica.core
        rates, stats = (replica.rates, core.stats()) if replica.rates_log is None else fastforward.load_at(replica, self.now)
        report = glue.heartbeat_report(replica.replica_id, replica.state, True, stats, rates)
        glue.apply_heartbeat(self.router, report, self.now)
        replica.reported_idle = not replica.busy and not core.has_unfinished()

    def _forget_routed(self, replica: _Replica, request_id: str) -> None:
        """A routed request was refused before it ran: the router takes its work back, as the router service
        does for the REJECTED completion admission publishes (`RouterRuntime.on_completion`)."""
        self.router.on_request_done(replica.replica_id, request_id, self.now, ran=False)

    def _route(self, query: RouteQuery) -> RouteDecision:
        """Route one request (the router servicer's Route, without the wire)."""
        return self.router.route(query, self.now)

    # ---- what the cores said ----------------------------------------------------------------
    def _absorb(self, replica: _Replica, events: CoreEvents) -> None:
        outputs.absorb(self, replica, events)

    def _finish(self, replica: _Replica, finished: Any) -> None:
        outputs.finish(self, replica, finished)

    # ---- results ----------------------------------------------------------------------------
    def replica_stats(self) -> dict[str, float]:
        """Return totals over replicas: preemptions, recomputed tokens, prefix hit rate, rounds."""
        return outputs.replica_stats(self)
