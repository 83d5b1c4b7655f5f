"""Capacity under SLO: the highest arrival rate at which a configuration still meets its SLO.

The field's comparison (DistServe, OSDI'24): a configuration's capacity is the largest request
rate at which at least `goal` (default 90%) of requests meet both the TTFT and the TPOT target.
Goodput at one offered rate cannot exceed that rate, so it cannot rank configurations that all
keep up; capacity can.

The search is over a rate *scale* of one fixed workload (the same requests, arrivals compressed
or stretched), so every probe serves the same mix. It assumes attainment falls as the rate rises
(true of every queueing system here up to noise): it brackets the goal by doubling or halving
from scale 1, then bisects until the bracket is within `tolerance` (relative). Every probe is
kept, so a report can plot attainment against rate. The probe itself is a callable, so the
simulator (`sluice sim --capacity`) and a live stack (`sluice bench --capacity`) share the search.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


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

    def to_dict(self) -> dict[str, object]:
        """Return a JSON-ready summary."""
        return {
            "goal": self.goal, "capacity_rps": self.capacity_rps, "scale": self.scale,
            "p99_ttft_s": self.p99_ttft_s, "prefix_hit_rate": self.prefix_hit_rate, "bracketed": self.bracketed,
            "probes": [vars(p) for p in sorted(self.probes, key=lambda p: p.scale)],
        }


def find_capacity(probe: Callable[[float], Probe], search: CapacitySearch = CapacitySearch()) -> CapacityResult:
    """Return the highest rate scale whose attainment is >= `search.goal`, found by bracketing and bisection.

    `probe(scale)` runs the workload at that scale. Raises ValueError for a goal outside (0, 1].
    """
    if not 0 < search.goal <= 1:
        raise ValueError(f"attainment goal must be in (0, 1], got {search.goal}")
    probes: list[Probe] = []

    def run(scale: float) -> Probe:
        result = probe(scale)
        probes.append(result)
        return result

    first = run(1.0)
    passing, failing = _bracket(run, first, search, probes)
    while (passing is not None and failing is not None and len(probes) < search.max_probes
           and failing.scale / passing.scale > 1 + search.tolerance):
        middle = run((passing.scale * failing.scale) ** 0.5)  # geometric: the scale is a ratio
        if middle.attainment >= search.goal:
            passing = middle
        else:
            failing = middle
    bracketed = passing is not None and failing is not None
    if passing is None:
        return CapacityResult(search.goal, 0.0, 0.0, None, None, probes, bracketed)
    return CapacityResult(search.goal, passing.rate_rps, passing.scale, passing.p99_ttft_s,
                          passing.prefix_hit_rate, probes, bracketed)


def _bracket(run: Callable[[float], Probe], first: Probe, search: CapacitySearch,
             probes: list[Probe]) -> tuple[Probe | None, Probe | None]:
    """Return (highest passing, lowest failing) probes after doubling or halving from the first."""
    passing = first if first.attainment >= search.goal else None
    failing = None if passing is not None else first
    step = 2.0 if passing is not None else 0.5
    current = first
    while len(probes) < search.max_probes:
        scale = current.scale * step
        if not search.min_scale <= scale <= search.max_scale:
            break
        current = run(scale)
        if current.attainment >= search.goal:
            passing = current
            if step < 1:
                break
        else:
            failing = current
            if step > 1:
                break
    return passing, failing
