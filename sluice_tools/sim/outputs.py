"""What the cores said, delivered as the services do, and what a run reports (the Simulator's, cluster.py).

`absorb` takes one drained outbox of a replica: tokens and terminal records to the request records,
`Finished` to admission and the router (`Simulator._finish`, which the fleet simulator extends), KV events
to the router's index (a gap asks for `kv_snapshot`). `sample` appends one point of each time series.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sluice.types import CoreEvents, RequestStatus, Stage
from sluice_tools.sim import fastforward

if TYPE_CHECKING:
    from sluice_tools.sim.cluster import Simulator
    from sluice_tools.sim.replica import Replica

STATUS = {
    RequestStatus.FINISHED_STOP: "ok",
    RequestStatus.FINISHED_LENGTH: "ok",
    RequestStatus.CANCELLED: "cancelled",
    RequestStatus.TIMED_OUT: "timed_out",
    RequestStatus.FAILED: "failed",
    RequestStatus.REJECTED: "rejected",
}
"""A request record's status for each terminal core status."""


def absorb(sim: Simulator, replica: Replica, events: CoreEvents) -> None:
    """Deliver one drained outbox of `replica` (once per round: most carry a token or two and nothing else)."""
    tokens = events.tokens
    delay = sim._token_delay if sim._cpu is None else sim._cpu.token_delay(sim.now, sim._token_delay, len(tokens),
                                                                           replica.index)
    now = sim.now + delay
    if tokens:
        records, times, grow = sim.records, sim._token_times, sim._growth_signal
        for request_id, index, _token in tokens:
            times[request_id].append(now)
            if index == 0 and records[request_id].first_token_s is None:  # a migrated attempt starts at 0 again
                records[request_id].first_token_s = now
                sim.admission.mark_started(request_id, now)
            if grow is not None:
                grow(request_id, index, now)  # admission: the growth signal
    for event in events.lifecycle:
        if event.stage is Stage.FIRST_SCHEDULED:
            sim.records[event.request_id].first_scheduled_s = event.time
    for finished in events.finished:
        sim._finish(replica, finished)  # the method: the fleet simulator extends it
    if events.kv_events and not sim.router.apply_kv_events(replica.replica_id, events.kv_events, now):
        last_event_id, hashes = replica.core.kv_snapshot()
        sim.router.apply_snapshot(replica.replica_id, last_event_id, hashes, now, replica.core.host_hashes())
        sim.kv_snapshots += 1
    sim.dropped_results += events.dropped_results


def finish(sim: Simulator, replica: Replica, finished: Any) -> None:
    """Close the record of a request the core finished; tell admission and the router."""
    rid, now = finished.request_id, sim.now
    record = sim.records[rid]
    usage = finished.usage
    record.status = STATUS[finished.status]
    record.finish_s = finished.finish_time + (sim._token_delay if sim._cpu is None else sim._cpu.token_delay(
        sim.now, sim._token_delay, 0, replica.index))
    record.output_tokens = usage.output_tokens
    record.cached_tokens = usage.cached_tokens
    record.preemptions = usage.preemptions
    record.recomputed_tokens = usage.recomputed_tokens
    record.detail = finished.detail
    record.token_times = sim._token_times.pop(rid, None)
    sim._placement.pop(rid, None)
    finished_ok = record.status == "ok"  # admission learns the lengths of finished requests only
    sim.front_door.release(rid, now, usage.output_tokens if finished_ok else None)
    sim.router.on_request_done(replica.replica_id, rid, now, ran=finished.status is not RequestStatus.REJECTED)


def finish_stragglers(sim: Simulator) -> None:
    """Requests still live when nothing can happen any more are failures, said so plainly."""
    for rid, replica in list(sim._placement.items()):
        record = sim.records[rid]
        status = replica.core.request_status(rid)
        record.status, record.finish_s = "failed", sim.now
        record.detail = f"simulation ended with the request {status.value if status else 'unknown'} on an idle replica"
        record.token_times = sim._token_times.pop(rid, None)
        record.output_tokens = len(record.token_times or ())


def sample(sim: Simulator) -> None:
    """Append one point to each time series (`Simulator.series`) at the current time."""
    now, series = sim.now, sim.series
    # A replica in a bulk run reads as of now (fastforward.load_at: its blocks; the rest is constant in the run).
    stats = [r.core.stats() if r.rates_log is None else fastforward.load_at(r, now)[1] for r in sim.replicas]
    total = sum(s.kv_blocks_total for s in stats) or 1
    series["waiting"].append((now, float(sum(s.waiting for s in stats))))
    series["running"].append((now, float(sum(s.running for s in stats))))
    series["kv_used_frac"].append((now, sum(s.kv_blocks_used for s in stats) / total))
    ready = sum(1 for v in sim.router.replicas() if v.state.value == "ready")
    series["replicas_ready"].append((now, float(ready)))
    series["admission_active"].append((now, float(sim.admission.stats(now).active)))
    hit, query = sum(s.prefix_hit_tokens for s in stats), sum(s.prefix_query_tokens for s in stats)
    series["prefix_hit_rate"].append((now, hit / query if query else 0.0))  # cumulative
    series["preemptions"].append((now, float(sum(s.preemptions for s in stats))))
    series["recomputed_tokens"].append((now, float(sum(s.recomputed_tokens for s in stats))))


def replica_stats(sim: Simulator) -> dict[str, float]:
    """Return totals over replicas: preemptions, recomputed tokens, prefix hit rate, rounds."""
    stats = [r.core.stats() for r in sim.replicas]
    hit, query = sum(s.prefix_hit_tokens for s in stats), sum(s.prefix_query_tokens for s in stats)
    return {
        "rounds": float(sim.rounds),
        "preemptions": float(sum(s.preemptions for s in stats)),
        "recomputed_tokens": float(sum(s.recomputed_tokens for s in stats)),
        "prefix_hit_rate": hit / query if query else 0.0,
        "dropped_results": float(sim.dropped_results),
        "kv_snapshots": float(sim.kv_snapshots),
        "num_blocks_per_replica": float(sim.num_blocks),
        "max_model_len": float(sim.max_model_len),
    }
