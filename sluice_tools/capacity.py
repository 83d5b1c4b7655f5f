"""Capacity under SLO: the highest arrival rate at which a configuration still meets its SLO.

The field's comparison (DistServe, OSDI'24): a configuration's capacity is the largest request
rate at which at least `goal` (default 90%) of requests meet both the TTFT and the TPOT target.
Goodput at one offered rate cannot exceed that rate, so it cannot rank configurations that all
keep up; capacity can.

Counting requests alone rewards shedding: a configuration that refuses the few longest prompts
(admission's early TTFT refusal does exactly that under load) keeps 90% of the requests within SLO
while serving far less of the work. So a probe passes only when both the share of requests and
the share of offered tokens (each request's prompt + output tokens, whatever happened to it)
served within SLO reach the goal (`Probe.passes`); refused, failed and timed-out requests are
misses in both. The request-only capacity (DistServe's figure) is searched too, from the same
probes where they coincide, and reported beside it (`CapacityResult.request_capacity_rps`).

The search is over a rate *scale* of one fixed workload (the same requests, arrivals compressed
or stretched), so every probe serves the same mix. It assumes attainment falls as the rate rises
(true of every queueing system here up to noise): it brackets the goal by doubling or halving
from scale 1, then bisects until the bracket is within `tolerance` (relative). Every probe is
kept, so a report can plot attainment against rate. The probe itself is a callable, so the
simulator (`sluice sim --capacity`) and a live stack (`sluice bench --capacity`) share the search.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sluice_tools.metrics import RequestRecord
    from sluice_tools.workload import WorkloadRequest


@dataclass(frozen=True)
class Probe:
    """One run at one rate."""

    scale: float
    """Arrival-rate multiplier of the workload."""
    rate_rps: float
    """Offered requests per second at this scale."""
    attainment: float
    """Fraction of all requests (rejected ones included) that met both SLO targets."""
    p99_ttft_s: float | None
    """p99 TTFT of completed requests at this rate."""
    prefix_hit_rate: float | None = None
    """Prefix-cache hit rate of the run, when the probe reports one."""
    token_attainment: float | None = None
    """Fraction of the offered tokens (prompt + output of every request) in requests that met both SLO
    targets; None when the probe does not know the offered tokens (then requests alone decide)."""

    def passes(self, goal: float) -> bool:
        """Return True when both the request share and the offered-token share within SLO reach `goal`."""
        return self.attainment >= goal and (self.token_attainment is None or self.token_attainment >= goal)

    def passes_requests(self, goal: float) -> bool:
        """Return True when the request share alone reaches `goal` (the request-only criterion)."""
        return self.attainment >= goal


def token_attainment(outcomes: Iterable[tuple[WorkloadRequest, RequestRecord | None]],
                     slo_ttft_s: float, slo_tpot_s: float) -> float:
    """Return the share of the offered tokens (input + output length of each request) in requests whose
    record met both SLO targets, over (request, its record) pairs; a request without a record, or refused,
    failed or late, is a miss."""
    from sluice_tools.metrics import meets_slo

    offered = served = 0
    for request, record in outcomes:
        tokens = request.input_length + request.output_length
        offered += tokens
        if record is not None and meets_slo(record, slo_ttft_s, slo_tpot_s):
            served += tokens
    return served / offered if offered else 0.0


def paired(requests: Iterable[WorkloadRequest], records: Iterable[RequestRecord]) -> list[
        tuple[WorkloadRequest, RequestRecord | None]]:
    """Return each request with its record by request id (None when it has none), for `token_attainment`."""
    by_id = {r.request_id: r for r in records}
    return [(request, by_id.get(request.request_id)) for request in requests]


@dataclass(frozen=True)
class CapacitySearch:
    """How to search: the attainment goal and when to stop."""

    goal: float = 0.9
    """Fraction of requests that must meet the SLO (DistServe: 90%)."""
    tolerance: float = 0.05
    """Stop when the passing and failing scales are within this fraction of each other."""
    max_probes: int = 14
    """Probes at most (bracketing and bisection together)."""
    min_scale: float = 1 / 64
    max_scale: float = 64.0


@dataclass
class CapacityResult:
    """The capacity (highest passing rate found) and every probe made."""

    goal: float
    capacity_rps: float
    """Highest offered rate that met the goal; 0 when even `min_scale` failed."""
    scale: float
    p99_ttft_s: float | None
    """p99 TTFT at the capacity point."""
    prefix_hit_rate: float | None
    probes: list[Probe] = field(default_factory=list)
    bracketed: bool = True
    """False when the goal held even at `max_scale` (capacity is at least the figure) or failed at `min_scale`."""
    request_capacity_rps: float | None = None
    """Highest rate at which the request share alone met the goal (DistServe's measure, which shedding
    the longest requests can inflate); None when not searched."""
    attainment: float | None = None
    """Request share within SLO at the capacity point."""
    token_attainment: float | None = None
    """Offered-token share within SLO at the capacity point."""

    def to_dict(self) -> dict[str, object]:
        """Return a JSON-ready summary."""
        return {
            "goal": self.goal, "capacity_rps": self.capacity_rps, "scale": self.scale,
            "request_capacity_rps": self.request_capacity_rps, "attainment": self.attainment,
            "token_attainment": self.token_attainment,
            "p99_ttft_s": self.p99_ttft_s, "prefix_hit_rate": self.prefix_hit_rate, "bracketed": self.bracketed,
            "probes": [vars(p) for p in sorted(self.probes, key=lambda p: p.scale)],
        }


def find_capacity(probe: Callable[[float], Probe], search: CapacitySearch = CapacitySearch()) -> CapacityResult:
    """Return the highest rate scale whose probe passes (`Probe.passes`: requests and offered tokens within
    SLO both >= `search.goal`), found by bracketing and bisection; `request_capacity_rps` is the same search
    on the request share alone, reusing the probes already run at a scale.

    `probe(scale)` runs the workload at that scale. Raises ValueError for a goal outside (0, 1].
    """
    if not 0 < search.goal <= 1:
        raise ValueError(f"attainment goal must be in (0, 1], got {search.goal}")
    goal = search.goal
    probes: list[Probe] = []
    known: dict[float, Probe] = {}

    def run(scale: float) -> Probe:
        if scale not in known:
            known[scale] = probe(scale)
            probes.append(known[scale])
        return known[scale]

    both, bracketed = _search(run, lambda p: p.passes(goal), search)
    alone = both
    if any(p.token_attainment is not None for p in probes):
        alone, _ = _search(run, lambda p: p.passes_requests(goal), search)
    request_rps = alone.rate_rps if alone is not None else 0.0
    if both is None:
        return CapacityResult(goal, 0.0, 0.0, None, None, probes, bracketed, request_capacity_rps=request_rps)
    return CapacityResult(goal, both.rate_rps, both.scale, both.p99_ttft_s, both.prefix_hit_rate, probes, bracketed,
                          request_capacity_rps=request_rps, attainment=both.attainment,
                          token_attainment=both.token_attainment)


def _search(run: Callable[[float], Probe], passes: Callable[[Probe], bool],
            search: CapacitySearch) -> tuple[Probe | None, bool]:
    """Return (the highest passing probe or None, whether the goal was bracketed) for one criterion.

    Each criterion gets `search.max_probes` probes of its own (a probe run already, at the same scale, is
    reused and counted)."""
    count = [0]

    def counted(scale: float) -> Probe:
        count[0] += 1
        return run(scale)

    first = counted(1.0)
    passing, failing = _bracket(counted, first, passes, search, count)
    while (passing is not None and failing is not None and count[0] < search.max_probes
           and failing.scale / passing.scale > 1 + search.tolerance):
        middle = counted((passing.scale * failing.scale) ** 0.5)  # geometric: the scale is a ratio
        if passes(middle):
            passing = middle
        else:
            failing = middle
    return passing, passing is not None and failing is not None


def _bracket(run: Callable[[float], Probe], first: Probe, passes: Callable[[Probe], bool], search: CapacitySearch,
             count: list[int]) -> tuple[Probe | None, Probe | None]:
    """Return (highest passing, lowest failing) probes after doubling or halving from the first."""
    passing = first if passes(first) else None
    failing = None if passing is not None else first
    step = 2.0 if passing is not None else 0.5
    current = first
    while count[0] < search.max_probes:
        scale = current.scale * step
        if not search.min_scale <= scale <= search.max_scale:
            break
        current = run(scale)
        if passes(current):
            passing = current
            if step < 1:
                break
        else:
            failing = current
            if step > 1:
                break
    return passing, failing
