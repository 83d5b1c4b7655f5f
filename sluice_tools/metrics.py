"""Per-request records and the summary every report is built from (`sluice sim` and `sluice bench`).

One `RequestRecord` per request, whatever produced it: the simulator fills it from the scheduler
core's `Finished` records, the load generator from what the client saw. `summarize` turns a list
of records (plus optional replica-level series) into one plain dict that is JSON-serialisable.

Conventions (so numbers from the simulator and from a real run mean the same thing):
- all times are seconds on one clock; `arrival_s` is when the request reached the front door;
- TTFT = first_token_s - arrival_s; E2E = finish_s - arrival_s;
- TPOT = (finish_s - first_token_s) / (output_tokens - 1), defined for output_tokens >= 2;
- ITL = the gaps between consecutive token times, when `token_times` is given;
- percentiles interpolate linearly between closest ranks (numpy's default method);
- latency figures cover requests with status "ok" only; the other statuses are counted;
- a request "meets the SLO" when it is ok, TTFT <= slo_ttft_s and (TPOT <= slo_tpot_s or it has a
  single output token); goodput = such requests per second of the run; SLO attainment = their
  fraction of ALL records (a rejection is a miss, not a request that vanished);
- fairness: per-tenant weighted service and Jain's index over the whole run, plus a windowed
  Jain's index among tenants that have requests waiting (see `windowed_jain_index`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

STATUSES = ("ok", "rejected", "timed_out", "cancelled", "failed")
PERCENTILES = (50, 90, 95, 99)


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request, on one clock (seconds)."""

    request_id: str
    tenant: str = "default"
    priority: int = 0
    """0 is normal priority; larger is more urgent."""
    arrival_s: float = 0.0
    first_scheduled_s: float | None = None
    """When the request first got work in a round (None if it never did)."""
    first_token_s: float | None = None
    finish_s: float | None = None
    """Time of the terminal state (finish, rejection, timeout, cancellation)."""
    token_times: Sequence[float] | None = None
    """Absolute time of every output token, when known (gives ITL); else only TPOT is reported."""
    status: str = "ok"
    """One of STATUSES."""
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    preemptions: int = 0
    recomputed_tokens: int = 0
    retries: int = 0
    replica: str = ""
    detail: str = ""
    """Why it was rejected or failed, in words."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")

    @property
    def ttft_s(self) -> float | None:
        """Return the time to first token, or None when no token came."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        """Return the end-to-end latency, or None when the request has no finish time."""
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Return the mean time per output token after the first, or None below two tokens."""
        if self.first_token_s is None or self.finish_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def wait_s(self) -> float | None:
        """Return the queueing delay: until first scheduled (or first token, or the end if never run)."""
        start = self.first_scheduled_s if self.first_scheduled_s is not None else self.first_token_s
        if start is None:
            start = self.finish_s
        return None if start is None else start - self.arrival_s


def percentiles(values: Iterable[float], points: Sequence[int] = PERCENTILES) -> dict[str, float | None]:
    """Return {"p50": ..., "p90": ..., "mean": ..., "max": ..., "count": n}; None values when empty."""
    # An array as it is: fromiter would take the inter-token gaps (millions) one Python float at a time.
    array = np.asarray(values, dtype=float) if isinstance(values, np.ndarray) else np.fromiter(values, dtype=float)
    out: dict[str, float | None] = {"count": float(array.size)}
    if array.size == 0:
        out.update({f"p{p}": None for p in points})
        out.update({"mean": None, "max": None})
        return out
    for point, value in zip(points, np.percentile(array, points), strict=True):
        out[f"p{point}"] = float(value)
    out["mean"] = float(array.mean())
    out["max"] = float(array.max())
    return out


def jain_index(values: Sequence[float]) -> float | None:
    """Return Jain's fairness index (sum x)^2 / (n * sum x^2) in [1/n, 1]; None when empty or all zero."""
    array = np.asarray(values, dtype=float)
    square_sum = float((array * array).sum())
    if array.size == 0 or square_sum == 0.0:
        return None
    return float(array.sum() ** 2 / (array.size * square_sum))


def prediction_error(records: Iterable[RequestRecord], predicted: Mapping[str, tuple[float, float]]) -> dict[str, object]:
    """Return how the router's predicted TTFT compared with the actual one, per ok request with a first token.

    `predicted` maps a request id to (time it was routed, predicted TTFT); the actual TTFT is
    first_token_s - that time (a retried request's last routing). "ratio" is actual / predicted;
    "under" the fraction of requests whose actual TTFT exceeded the prediction.
    """
    ratios = []
    for record in records:
        routed = predicted.get(record.request_id)
        if routed is None or record.status != "ok" or record.first_token_s is None:
            continue
        at, ttft = routed
        ratios.append((record.first_token_s - at) / max(ttft, 1e-9))
    under = sum(1 for r in ratios if r > 1.0)
    return {"requests": len(ratios), "ratio": percentiles(ratios),
            "under": under / len(ratios) if ratios else None}


def _inter_token_gaps(records: Sequence[RequestRecord]) -> np.ndarray:
    """Return every request's gaps between consecutive token times, request after request.

    One `diff` over all the times, less the differences across two requests (the same gaps in the same
    order as a `diff` per request: a whole trace has ~20,000 requests, and a numpy call each added up)."""
    series = [r.token_times for r in records if r.token_times is not None and len(r.token_times) > 1]
    if not series:
        return np.empty(0)
    times = np.concatenate([np.asarray(t, dtype=float) for t in series])
    firsts = np.cumsum([len(t) for t in series])[:-1]  # where each request after the first starts
    return np.delete(np.diff(times), firsts - 1)


@dataclass(frozen=True)
class FairnessWeights:
    """How service is counted per tenant (the same weights as the scheduler's fair policy)."""

    input_weight: float = 1.0
    """Cost of one prompt token."""
    output_weight: float = 2.0
    """Cost of one output token."""
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    """Share weight per tenant; unnamed tenants weigh 1."""
    window_s: float = 10.0
    """Window of the windowed Jain's index."""


def tenant_shares(records: Sequence[RequestRecord], weights: FairnessWeights) -> dict[str, object]:
    """Return per-tenant served tokens, weighted service, share of the total, and Jain's index.

    Service counts the tokens actually processed (every status: a cancelled request consumed
    what it generated). Jain's index is over service divided by tenant weight, so a perfectly
    weighted split scores 1.0.
    """
    service: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    for record in records:
        if record.status == "rejected":
            continue
        cost = record.input_tokens * weights.input_weight + record.output_tokens * weights.output_weight
        service[record.tenant] = service.get(record.tenant, 0.0) + cost
        counts = tokens.setdefault(record.tenant, [0, 0])
        counts[0] += record.input_tokens
        counts[1] += record.output_tokens
    total = sum(service.values())
    per_tenant = {
        tenant: {
            "input_tokens": tokens[tenant][0],
            "output_tokens": tokens[tenant][1],
            "weighted_service": value,
            "weight": weights.tenant_weights.get(tenant, 1.0),
            "share": value / total if total else 0.0,
        }
        for tenant, value in sorted(service.items())
    }
    normalised = [v / weights.tenant_weights.get(t, 1.0) for t, v in service.items()]
    return {
        "tenants": per_tenant,
        "jain_index": jain_index(normalised),
        "windowed_jain_index": windowed_jain_index(records, weights),
        "window_s": weights.window_s,
    }


def windowed_jain_index(records: Sequence[RequestRecord], weights: FairnessWeights) -> float | None:
    """Return the mean over time windows of Jain's index of weighted service among active tenants.

    Over a whole run where everything completes, each tenant's service equals its demand whatever
    the policy; fairness shows while tenants compete. So time is cut into `window_s` windows; a
    tenant is backlogged in a window when one of its requests waits in it (arrived, not yet
    scheduled: what a fair queue arbitrates); its service there is (prompt tokens at the first token + output tokens at their times) / weight.
    Windows with fewer than two backlogged tenants are skipped; None when none remain. Output tokens
    need `token_times`; without them a request's output counts at its finish.
    """
    if len({r.tenant for r in records if r.status != "rejected"}) < 2:
        return None  # no window can have two backlogged tenants (one numpy call per request spared)
    window = weights.window_s
    service: dict[tuple[int, str], float] = {}
    active: dict[int, set[str]] = {}
    for r in records:
        if r.status == "rejected":
            continue
        scale = 1.0 / weights.tenant_weights.get(r.tenant, 1.0)
        if r.first_token_s is not None:
            key = (int(r.first_token_s // window), r.tenant)
            service[key] = service.get(key, 0.0) + r.input_tokens * weights.input_weight * scale
        times = (
            r.token_times
            if r.token_times is not None
            else [r.finish_s] * r.output_tokens
            if r.finish_s
            else []
        )
        if len(times):
            buckets, counts = np.unique(
                (np.asarray(times, dtype=float) // window).astype(np.int64), return_counts=True
            )
            for bucket, count in zip(buckets.tolist(), counts.tolist(), strict=True):
                key = (bucket, r.tenant)
                service[key] = service.get(key, 0.0) + count * weights.output_weight * scale
        waited_until = r.arrival_s + (r.wait_s or 0.0)
        for bucket in range(int(r.arrival_s // window), int(waited_until // window) + 1):
            active.setdefault(bucket, set()).add(r.tenant)
    values = [
        index
        for bucket, tenants in active.items()
        if len(tenants) > 1
        and (index := jain_index([service.get((bucket, t), 0.0) for t in tenants])) is not None
    ]
    return float(np.mean(values)) if values else None


def _series_summary(
    series: Mapping[str, Sequence[tuple[float, float]]],
) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for name, points in series.items():
        values = np.asarray([v for _, v in points], dtype=float)
        if values.size == 0:
            out[name] = {"mean": None, "max": None, "last": None}
        else:
            out[name] = {"mean": float(values.mean()), "max": float(values.max()), "last": float(values[-1])}
    return out


def meets_slo(record: RequestRecord, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    """Return True when the request finished ok within the TTFT and TPOT targets."""
    if record.status != "ok" or record.ttft_s is None or record.ttft_s > slo_ttft_s:
        return False
    tpot = record.tpot_s
    return tpot is None or tpot <= slo_tpot_s


def summarize(
    records: Sequence[RequestRecord],
    slo_ttft_s: float,
    slo_tpot_s: float,
    *,
    duration_s: float | None = None,
    fairness: FairnessWeights | None = None,
    series: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    replica_stats: Mapping[str, float] | None = None,
    include_series: bool = True,
) -> dict[str, object]:
    """Return the summary of a run as a JSON-serialisable dict (see the module docstring).

    `duration_s` defaults to first arrival .. last finish. `series` maps a name (e.g.
    "queue_len", "kv_used_frac") to (time, value) samples; `replica_stats` are totals such as
    preemptions or prefix hit rate, copied through. Raises ValueError when an SLO is not positive.
    """
    if slo_ttft_s <= 0 or slo_tpot_s <= 0:
        raise ValueError(f"SLO targets must be positive, got ttft={slo_ttft_s} tpot={slo_tpot_s}")
    ok = [r for r in records if r.status == "ok"]
    counts = {status: 0 for status in STATUSES}
    for record in records:
        counts[record.status] += 1
    if duration_s is None:
        duration_s = _run_duration(records)
    good = sum(1 for r in ok if meets_slo(r, slo_ttft_s, slo_tpot_s))
    normal_waits = [
        w for r in records if r.priority == 0 and r.status != "rejected" and (w := r.wait_s) is not None
    ]
    summary: dict[str, object] = {
        "requests": len(records),
        "counts": counts,
        "retried": sum(1 for r in records if r.retries > 0),
        "duration_s": duration_s,
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
        "goodput_rps": good / duration_s if duration_s > 0 else 0.0,
        "slo_attainment": good / len(records) if records else 0.0,
        "throughput_rps": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration_s if duration_s > 0 else 0.0,
        "ttft_s": percentiles(r.ttft_s for r in ok if r.ttft_s is not None),
        "tpot_s": percentiles(t for r in ok if (t := r.tpot_s) is not None),
        "itl_s": percentiles(_inter_token_gaps(ok)),
        "e2e_s": percentiles(r.e2e_s for r in ok if r.e2e_s is not None),
        "max_normal_priority_wait_s": max(normal_waits) if normal_waits else None,
        "tokens": {
            "input": sum(r.input_tokens for r in records if r.status != "rejected"),
            "output": sum(r.output_tokens for r in records),
            "cached": sum(r.cached_tokens for r in records),
            "recomputed": sum(r.recomputed_tokens for r in records),
        },
        "preemptions": sum(r.preemptions for r in records),
        "fairness": tenant_shares(records, fairness or FairnessWeights()),
        "replica_stats": dict(replica_stats or {}),
        "series_summary": _series_summary(series or {}),
    }
    summary.update(_class_summaries(records, slo_ttft_s, slo_tpot_s))
    if include_series and series:
        summary["series"] = {name: [list(p) for p in points] for name, points in series.items()}
    return summary


def _class_summaries(records: Sequence[RequestRecord], slo_ttft_s: float, slo_tpot_s: float) -> dict[str, object]:
    """Return `by_priority` / `by_tenant` (requests, SLO attainment, TTFT percentiles of ok ones).

    Each appears only when the run has more than one priority / tenant: a single class would
    repeat the headline figures.
    """
    out: dict[str, object] = {}
    for key, attribute in (("by_priority", "priority"), ("by_tenant", "tenant")):
        groups: dict[str, list[RequestRecord]] = {}
        for record in records:
            groups.setdefault(str(getattr(record, attribute)), []).append(record)
        if len(groups) < 2:
            continue
        out[key] = {
            name: {
                "requests": len(group),
                "slo_attainment": sum(1 for r in group if meets_slo(r, slo_ttft_s, slo_tpot_s)) / len(group),
                "ttft_s": percentiles(r.ttft_s for r in group if r.status == "ok" and r.ttft_s is not None),
            }
            for name, group in sorted(groups.items())
        }
    return out


def _run_duration(records: Sequence[RequestRecord]) -> float:
    if not records:
        return 0.0
    start = min(r.arrival_s for r in records)
    end = max((r.finish_s if r.finish_s is not None else r.arrival_s) for r in records)
    return max(end - start, 0.0)
