"""Wire <-> core conversions of the scheduler: submissions, statuses, stats, KV events, completions, tokens.

Round plans and results are converted by `worker_svc.convert` (one way to convert each type).
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.types import CoreStats, Finished, KvEvent, KvEventKind, NewRequest, RequestStatus
from sluice.v1 import common_pb2, events_pb2, scheduler_pb2
from worker_svc.convert import sampling_from_proto

__all__ = [
    "completion_to_proto", "kv_batch_to_proto", "new_request_from_proto", "stats_to_proto", "status_to_proto",
    "token_deltas",
]

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
    )


def stats_to_proto(stats: CoreStats, replica_id: str, config: SchedulerConfig) -> scheduler_pb2.SchedulerStats:
    """Return the wire SchedulerStats of the core's counters."""
    hit_rate = stats.prefix_hit_tokens / stats.prefix_query_tokens if stats.prefix_query_tokens else 0.0
    return scheduler_pb2.SchedulerStats(
        replica_id=replica_id, waiting=stats.waiting, running=stats.running,
        kv_blocks_total=stats.kv_blocks_total, kv_blocks_used=stats.kv_blocks_used,
        kv_blocks_free=stats.kv_blocks_free, kv_blocks_cached=stats.kv_blocks_cached,
        host_blocks_total=stats.host_blocks_total, host_blocks_used=stats.host_blocks_used,
        preemptions=stats.preemptions, recomputed_tokens=stats.recomputed_tokens,
        dropped_results=stats.dropped_results, rounds=stats.rounds,
        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
        queued_prefill_tokens=stats.queued_prefill_tokens, finished=stats.finished, cancelled=stats.cancelled,
        timed_out=stats.timed_out, prefix_hit_rate=hit_rate,
    )


def kv_batch_to_proto(replica_id: str, events: Sequence[KvEvent]) -> events_pb2.KvEventBatch:
    """Return one `kv` stream entry holding the replica's events, in order."""
    batch = events_pb2.KvEventBatch(replica_id=replica_id)
    for event in events:
        wire = batch.events.add(event_id=event.event_id)
        if event.kind is KvEventKind.STORED:
            wire.stored.parent_hash = event.parent_hash
            wire.stored.block_hashes.extend(event.block_hashes)
        elif event.kind is KvEventKind.REMOVED:
            wire.removed.block_hashes.extend(event.block_hashes)
        else:
            wire.all_cleared.SetInParent()
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


def token_deltas(tokens: Sequence[tuple[str, int, int]], created_unix_s: float) -> list[events_pb2.TokenDelta]:
    """Group the core's (request id, output index, token) triples into one delta per run of consecutive
    tokens of a request, in order."""
    deltas: list[events_pb2.TokenDelta] = []
    last: events_pb2.TokenDelta | None = None
    for request_id, index, token in tokens:
        if last is not None and last.request_id == request_id and last.index + len(last.token_ids) == index:
            last.token_ids.append(token)
            continue
        last = events_pb2.TokenDelta(request_id=request_id, index=index, token_ids=[token],
                                     created_unix_s=created_unix_s)
        deltas.append(last)
    return deltas
