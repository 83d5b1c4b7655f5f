"""The one conversion between the contract's types (sluice.types) and their wire forms (sluice.v1).

Every rule is written once here: top_p 0 on the wire means 1.0, an unset seed is None, deadlines
of 0 mean none, request status maps by one table. The services' own `convert` modules only
handle their private types (the router's replica registry, admission's client chunks) and call
these for everything shared.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence

from sluice.slots import slot_constructor
from sluice.types import (
    BackendInfo,
    BlockCopy,
    CoreStats,
    Finished,
    HeartbeatReport,
    KvEvent,
    KvEventKind,
    KvMedium,
    NewRequest,
    RefusedSeq,
    ReplicaLoad,
    ReplicaRole,
    ReplicaState,
    RequestStatus,
    RequestTotals,
    RoundPlan,
    RoundResult,
    SamplingParams,
    ScheduledSeq,
    SeqOutput,
    TokenLogprobs,
)
from sluice.v1 import common_pb2, events_pb2, router_pb2, scheduler_pb2, worker_pb2


def wire_top_p(top_p: float) -> float:
    """Return the top_p a wire value means: 0 (unset) is 1.0, no nucleus cut."""
    return top_p if top_p > 0 else 1.0


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Return the core SamplingParams of a wire message (an unset seed is None)."""
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=wire_top_p(msg.top_p),
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        stop_strings=tuple(msg.stop_strings),
        ignore_eos=msg.ignore_eos,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0,
        min_p=msg.min_p,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        json_schema=msg.json_schema, json_prefix_ids=tuple(msg.json_prefix_ids),
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Return the wire form of core SamplingParams."""
    msg = common_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        max_tokens=params.max_tokens, stop_token_ids=params.stop_token_ids,
        stop_strings=params.stop_strings, ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=0.0 if params.repetition_penalty == 1.0 else params.repetition_penalty,
        min_p=params.min_p, logit_bias=dict(params.logit_bias), json_schema=params.json_schema,
        json_prefix_ids=params.json_prefix_ids,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def logprobs_to_proto(logprobs: TokenLogprobs) -> common_pb2.TokenLogprobs:
    """Return the wire form of one token's log-probabilities."""
    return common_pb2.TokenLogprobs(logprob=logprobs.logprob, top_token_ids=logprobs.top_token_ids,
                                    top_logprobs=logprobs.top_logprobs)


def logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> TokenLogprobs:
    """Return one token's log-probabilities from the wire."""
    return TokenLogprobs(msg.logprob, tuple(msg.top_token_ids), tuple(msg.top_logprobs))


_new_seq = slot_constructor(ScheduledSeq)


def plan_from_proto(msg: worker_pb2.RoundPlan) -> RoundPlan:
    """Return the core RoundPlan of a wire plan (the budget is not on the wire: None)."""
    # Per round, once per sequence (256 and more): hence the positional constructor and `tuple(x[:])` (a repeated
    # field's slice is a list built in C, about half the cost of iterating the field into a tuple).
    cache: dict[bytes, SamplingParams] = {}
    seqs: list[ScheduledSeq] = []
    append = seqs.append
    new = _new_seq
    for s in msg.seqs:
        # Many seqs of one batch share sampling settings; parse each distinct one once.
        key = s.sampling.SerializeToString()
        sampling = cache.get(key)
        if sampling is None:
            sampling = cache[key] = sampling_from_proto(s.sampling)
        recent, prompt = s.recent_output_ids, s.prompt_token_ids
        append(new(s.request_id, s.epoch, tuple(s.token_ids[:]), s.start_position, tuple(s.block_table[:]), sampling,
                   s.sample, s.output_index, tuple(recent[:]) if recent else (), tuple(prompt[:]) if prompt else ()))
    return RoundPlan(
        round_id=msg.round_id, seqs=tuple(seqs),
        swap_out=tuple(BlockCopy(c.src, c.dst) for c in msg.swap_out),
        swap_in=tuple(BlockCopy(c.src, c.dst) for c in msg.swap_in),
    )


def plan_to_proto(plan: RoundPlan) -> worker_pb2.RoundPlan:
    """Return the wire form of a core RoundPlan (its budget is local to the scheduler and not sent)."""
    # Requests of a batch mostly share equal (frozen, hashable) sampling settings: convert each once.
    cache: dict[SamplingParams, common_pb2.SamplingParams] = {}
    msg = worker_pb2.RoundPlan(
        round_id=plan.round_id,
        swap_out=[worker_pb2.BlockCopy(src=c.src, dst=c.dst) for c in plan.swap_out],
        swap_in=[worker_pb2.BlockCopy(src=c.src, dst=c.dst) for c in plan.swap_in],
    )
    add = msg.seqs.add  # built in place: a list of messages passed to the constructor would be copied again
    for s in plan.seqs:
        sampling = cache.get(s.sampling)
        if sampling is None:
            sampling = cache[s.sampling] = sampling_to_proto(s.sampling)
        add(request_id=s.request_id, epoch=s.epoch, token_ids=s.token_ids, start_position=s.start_position,
            block_table=s.block_table, sampling=sampling, sample=s.sample, output_index=s.output_index,
            recent_output_ids=s.recent_output_ids, prompt_token_ids=s.prompt_token_ids)
    return msg


def result_to_proto(result: RoundResult) -> worker_pb2.RoundResult:
    """Return the wire form of a core RoundResult."""
    msg = worker_pb2.RoundResult(round_id=result.round_id, elapsed_s=result.elapsed_s, error=result.error)
    add = msg.outputs.add
    for o in result.outputs:
        wire = add(request_id=o.request_id, epoch=o.epoch, token_ids=o.token_ids, stop_string_hit=o.stop_string_hit)
        if o.logprobs is not None:
            wire.logprobs.CopyFrom(logprobs_to_proto(o.logprobs))
    if result.refused:
        refuse = msg.refused.add
        for r in result.refused:
            refuse(request_id=r.request_id, field_name=r.field_name, message=r.message)
    return msg


_new_output = slot_constructor(SeqOutput)


def result_from_proto(msg: worker_pb2.RoundResult) -> RoundResult:
    """Return the core RoundResult of a wire result."""
    new = _new_output
    return RoundResult(
        round_id=msg.round_id,
        outputs=tuple([new(o.request_id, o.epoch, tuple(o.token_ids[:]), o.stop_string_hit,
                           logprobs_from_proto(o.logprobs) if o.HasField("logprobs") else None) for o in msg.outputs]),
        elapsed_s=msg.elapsed_s, error=msg.error,
        refused=tuple([RefusedSeq(r.request_id, r.field_name, r.message) for r in msg.refused]),
    )


def info_to_proto(info: BackendInfo) -> worker_pb2.WorkerInfo:
    """Return the wire WorkerInfo of a backend's info."""
    return worker_pb2.WorkerInfo(
        model_id=info.model_id, model_version=info.model_version, block_size=info.block_size,
        num_blocks=info.num_blocks, num_host_blocks=info.num_host_blocks, dtype=info.dtype,
        device=info.device, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
        eos_token_id=info.eos_token_id, backend=info.backend, structured_output=info.structured_output,
    )


def info_from_proto(msg: worker_pb2.WorkerInfo) -> BackendInfo:
    """Return the BackendInfo carried by a wire WorkerInfo."""
    return BackendInfo(
        model_id=msg.model_id, model_version=msg.model_version, block_size=msg.block_size,
        num_blocks=msg.num_blocks, num_host_blocks=msg.num_host_blocks, dtype=msg.dtype, device=msg.device,
        max_model_len=msg.max_model_len, vocab_size=msg.vocab_size, eos_token_id=msg.eos_token_id,
        backend=msg.backend, structured_output=msg.structured_output,
    )


_STATUS: dict[RequestStatus, common_pb2.RequestStatus] = {
    status: common_pb2.RequestStatus.Value(status.name) for status in RequestStatus
}


def status_to_proto(status: RequestStatus | None) -> common_pb2.RequestStatus:
    """Return the wire RequestStatus (UNSPECIFIED for None, an unknown request)."""
    return _STATUS[status] if status is not None else common_pb2.REQUEST_STATUS_UNSPECIFIED


def new_request_from_proto(msg: scheduler_pb2.SubmitRequest, now: float, default_eos: int) -> NewRequest:
    """Return the core NewRequest of a Submit call, arriving at `now`.

    Deadlines of 0 mean none; an eos_token_id of 0 means the model's (`default_eos`, from the worker).
    """
    return NewRequest(
        request_id=msg.request_id,
        prompt_token_ids=tuple(msg.prompt_token_ids),
        sampling=sampling_from_proto(msg.sampling),
        tenant=msg.tenant or "default",
        priority=msg.priority,
        arrival_time=now,
        deadline=msg.deadline_unix_s or None,
        queue_deadline=msg.queue_deadline_unix_s or None,
        eos_token_id=msg.eos_token_id or default_eos,
        tenant_weight=msg.tenant_weight if msg.tenant_weight > 0 else None,
        cache_salt=msg.cache_salt,
        hold_kv=msg.hold_kv,
    )


def stats_to_proto(stats: CoreStats, replica_id: str, max_num_batched_tokens: int,
                   max_num_seqs: int) -> scheduler_pb2.SchedulerStats:
    """Return the wire SchedulerStats of the core's counters."""
    hit_rate = stats.prefix_hit_tokens / stats.prefix_query_tokens if stats.prefix_query_tokens else 0.0
    return scheduler_pb2.SchedulerStats(
        replica_id=replica_id, waiting=stats.waiting, running=stats.running,
        kv_blocks_total=stats.kv_blocks_total, kv_blocks_used=stats.kv_blocks_used,
        kv_blocks_free=stats.kv_blocks_free, kv_blocks_cached=stats.kv_blocks_cached,
        host_blocks_total=stats.host_blocks_total, host_blocks_used=stats.host_blocks_used,
        host_blocks_cached=stats.host_blocks_cached,
        preemptions=stats.preemptions, recomputed_tokens=stats.recomputed_tokens,
        dropped_results=stats.dropped_results, rounds=stats.rounds,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        queued_prefill_tokens=stats.queued_prefill_tokens, finished=stats.finished, cancelled=stats.cancelled,
        timed_out=stats.timed_out, prefix_hit_rate=hit_rate,
    )


def totals_to_proto(totals: RequestTotals, stats: scheduler_pb2.SchedulerStats) -> None:
    """Write a scheduler's running totals into its wire SchedulerStats."""
    stats.input_tokens, stats.max_output_tokens = totals.input_tokens, totals.max_output_tokens
    stats.ttft_seconds_sum, stats.ttft_count = totals.ttft_s, totals.ttft_count
    stats.tpot_seconds_sum, stats.tpot_count = totals.tpot_s, totals.tpot_count


def totals_from_proto(stats: scheduler_pb2.SchedulerStats) -> RequestTotals:
    """Return the running totals a wire SchedulerStats carries."""
    return RequestTotals(stats.input_tokens, stats.max_output_tokens, stats.ttft_seconds_sum, stats.ttft_count,
                         stats.tpot_seconds_sum, stats.tpot_count)


def lora_id_of(lora_name: str) -> int | None:
    """Return the integer LoRA id KV events carry for adapter `lora_name` (None for no adapter).

    Sluice names adapters and has no integer ids; vLLM's events (and indexers keyed on them) want one,
    so it is derived from the name: the first 63 bits of its SHA-256, equal on every replica.
    """
    if not lora_name:
        return None
    return int.from_bytes(hashlib.sha256(lora_name.encode()).digest()[:8], "big") >> 1


def kv_batch_to_proto(replica_id: str, events: Sequence[KvEvent], *, block_size: int = 0, lora_name: str = "",
                      ts: float = 0.0) -> events_pb2.KvEventBatch:
    """Return one `kv` stream entry holding the replica's events, in order, in vLLM's shape.

    `block_size` and `lora_name` (the replica's adapter version) go into every BlockStored; `ts` (Unix
    seconds) is the batch's time. docs/kv-events.md maps each field to vLLM's.
    """
    batch = events_pb2.KvEventBatch(replica_id=replica_id, ts=ts)
    lora_id = lora_id_of(lora_name)
    for event in events:
        wire = batch.events.add(event_id=event.event_id)
        if event.kind is KvEventKind.STORED:
            stored = wire.block_stored
            if event.parent_hash:
                stored.parent_block_hash = event.parent_hash
            stored.block_hashes.extend(event.block_hashes)
            stored.token_ids.extend(event.token_ids)
            stored.block_size = block_size
            stored.medium = event.medium.value
            stored.lora_name = lora_name
            if lora_id is not None:
                stored.lora_id = lora_id
        elif event.kind is KvEventKind.REMOVED:
            wire.block_removed.block_hashes.extend(event.block_hashes)
            wire.block_removed.medium = event.medium.value
        else:
            wire.all_blocks_cleared.SetInParent()
    return batch


def completion_to_proto(finished: Finished, *, replica_id: str, owner: str,
                        timestamps: common_pb2.LifecycleTimestamps) -> events_pb2.Completion:
    """Return the `completions` record of a terminal request.

    `timestamps` carries the stages before the replica (received, admitted, routed) and the ones the
    driver saw (cancel_requested, kv_released); the core's own times are filled in here.
    """
    ts = common_pb2.LifecycleTimestamps()
    ts.CopyFrom(timestamps)
    ts.enqueued = finished.arrival_time
    ts.first_scheduled = finished.first_scheduled_time or 0.0
    ts.first_token = finished.first_token_time or 0.0
    ts.finished = finished.finish_time
    u = finished.usage
    return events_pb2.Completion(
        request_id=finished.request_id, tenant=finished.tenant, replica_id=replica_id,
        status=status_to_proto(finished.status), finish_reason=finished.finish_reason, detail=finished.detail,
        usage=common_pb2.Usage(input_tokens=u.input_tokens, output_tokens=u.output_tokens,
                               cached_tokens=u.cached_tokens, recomputed_tokens=u.recomputed_tokens,
                               preemptions=u.preemptions),
        timestamps=ts, owner=owner,
    )


def token_delta_batches(tokens: Sequence[tuple[str, int, int]], created_unix_s: float,
                        owner_of: Callable[[str], str | None],
                        logprobs: Mapping[tuple[str, int], TokenLogprobs] | None = None,
                        ) -> dict[str, events_pb2.TokenDeltaBatch]:
    """Group the core's (request id, output index, token) triples into one delta per run of consecutive tokens
    of a request, in order, in one TokenDeltaBatch per owner. `owner_of(request_id)` is called once per delta
    (None: the delta is left out). `logprobs` ((request id, index) -> the token's) go with their tokens."""
    if logprobs:
        with_logprobs = token_delta_batches(tokens, created_unix_s, owner_of)
        for each in with_logprobs.values():
            for delta in each.deltas:
                for offset in range(len(delta.token_ids)):
                    found = logprobs.get((delta.request_id, delta.index + offset))
                    if found is not None:
                        delta.logprobs.append(logprobs_to_proto(found))
        return with_logprobs
    batches: dict[str, events_pb2.TokenDeltaBatch] = {}
    last: events_pb2.TokenDelta | None = None
    last_id, next_index = "", -1
    for request_id, index, token in tokens:
        if last is not None and request_id == last_id and index == next_index:
            last.token_ids.append(token)
            next_index += 1
            continue
        owner = owner_of(request_id)
        if owner is None:
            last = None
            continue
        batch = batches.get(owner)
        if batch is None:
            batch = batches[owner] = events_pb2.TokenDeltaBatch()
        last = batch.deltas.add(request_id=request_id, index=index, token_ids=(token,), created_unix_s=created_unix_s)
        last_id, next_index = request_id, index + 1
    return batches


def kv_events_from_proto(batch: events_pb2.KvEventBatch) -> list[KvEvent]:
    """Return the core KvEvents of a batch, in order (an empty medium reads as GPU).

    Raises ValueError on an event with no kind or an unknown medium.
    """
    out: list[KvEvent] = []
    for event in batch.events:
        kind = event.WhichOneof("kind")
        if kind == "block_stored":
            stored = event.block_stored
            out.append(KvEvent(event.event_id, KvEventKind.STORED, tuple(stored.block_hashes),
                               stored.parent_block_hash, tuple(stored.token_ids),
                               _medium(stored.medium, event.event_id, batch.replica_id)))
        elif kind == "block_removed":
            removed = event.block_removed
            out.append(KvEvent(event.event_id, KvEventKind.REMOVED, tuple(removed.block_hashes),
                               medium=_medium(removed.medium, event.event_id, batch.replica_id)))
        elif kind == "all_blocks_cleared":
            out.append(KvEvent(event.event_id, KvEventKind.ALL_CLEARED))
        else:
            raise ValueError(f"KV event {event.event_id} of replica {batch.replica_id!r} has no kind")
    return out


def _medium(name: str, event_id: int, replica_id: str) -> KvMedium:
    try:
        return KvMedium(name or KvMedium.GPU.value)
    except ValueError:
        raise ValueError(f"KV event {event_id} of replica {replica_id!r} has unknown medium {name!r}; "
                         f"known: {[m.value for m in KvMedium]}") from None


# ---- a replica's presence at the router ---------------------------------------------------------

_REPLICA_STATE_TO_PROTO: dict[ReplicaState, router_pb2.ReplicaState] = {
    ReplicaState.WARMING: router_pb2.WARMING,
    ReplicaState.READY: router_pb2.READY,
    ReplicaState.DRAINING: router_pb2.DRAINING,
    ReplicaState.GONE: router_pb2.GONE,
    ReplicaState.UNHEALTHY: router_pb2.UNHEALTHY,
}
_REPLICA_STATE_FROM_PROTO: dict[int, ReplicaState] = {int(v): k for k, v in _REPLICA_STATE_TO_PROTO.items()}


def replica_state_to_proto(state: ReplicaState | None) -> router_pb2.ReplicaState:
    """Return the wire ReplicaState (None, an unknown replica, is GONE)."""
    return _REPLICA_STATE_TO_PROTO[state] if state is not None else router_pb2.GONE


def replica_state_from_proto(value: int) -> ReplicaState | None:
    """Return the ReplicaState of a wire value (None for UNSPECIFIED)."""
    return _REPLICA_STATE_FROM_PROTO.get(value)


_ROLE_TO_PROTO: dict[ReplicaRole, router_pb2.ReplicaRole] = {
    ReplicaRole.BOTH: router_pb2.REPLICA_ROLE_BOTH,
    ReplicaRole.PREFILL: router_pb2.REPLICA_ROLE_PREFILL,
    ReplicaRole.DECODE: router_pb2.REPLICA_ROLE_DECODE,
}
_ROLE_FROM_PROTO: dict[int, ReplicaRole] = {int(v): k for k, v in _ROLE_TO_PROTO.items()}


def role_to_proto(role: ReplicaRole) -> router_pb2.ReplicaRole:
    """Return the wire ReplicaRole."""
    return _ROLE_TO_PROTO[role]


def role_from_proto(value: int) -> ReplicaRole:
    """Return the core ReplicaRole of a wire value; raises ValueError naming it when it is not one."""
    try:
        return _ROLE_FROM_PROTO[int(value)]
    except KeyError:
        raise ValueError(f"unknown replica role {value}; known: {sorted(_ROLE_FROM_PROTO)}") from None


def load_to_proto(load: ReplicaLoad) -> router_pb2.ReplicaLoad:
    """Return the wire form of a heartbeat's load."""
    return router_pb2.ReplicaLoad(waiting=load.waiting, running=load.running,
                                  queued_prefill_tokens=load.queued_prefill_tokens,
                                  kv_blocks_free=load.kv_blocks_free,
                                  prefill_tokens_per_s=load.prefill_tokens_per_s,
                                  decode_round_s=load.decode_round_s)


def load_from_proto(msg: router_pb2.ReplicaLoad) -> ReplicaLoad:
    """Return the ReplicaLoad of a heartbeat's load (measured rates 0 when the replica has none yet)."""
    return ReplicaLoad(waiting=msg.waiting, running=msg.running, queued_prefill_tokens=msg.queued_prefill_tokens,
                       kv_blocks_free=msg.kv_blocks_free, prefill_tokens_per_s=max(msg.prefill_tokens_per_s, 0.0),
                       decode_round_s=max(msg.decode_round_s, 0.0))


def heartbeat_to_proto(report: HeartbeatReport) -> router_pb2.HeartbeatRequest:
    """Return the Heartbeat call of a replica's report (an unspecified state stays UNSPECIFIED)."""
    state = router_pb2.REPLICA_STATE_UNSPECIFIED if report.state is None else replica_state_to_proto(report.state)
    return router_pb2.HeartbeatRequest(replica_id=report.replica_id, state=state, load=load_to_proto(report.load))


def heartbeat_from_proto(msg: router_pb2.HeartbeatRequest) -> HeartbeatReport:
    """Return the report a Heartbeat call carries."""
    return HeartbeatReport(msg.replica_id, replica_state_from_proto(msg.state), load_from_proto(msg.load))
