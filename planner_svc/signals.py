"""What the planner sees: observations over a sliding window, and the pressures derived from them.

Theory of operation
-------------------
* An `Observation` is one snapshot of the fleet at time `at`: the arrival rate since the previous
  snapshot, the length mix of the requests that arrived, TTFT and TPOT (observed on finished
  requests and predicted by the router for queued ones), and each replica's queue, queued prefill
  tokens, in-flight requests, KV use and cached prefix blocks. GPU utilisation is deliberately not an
  input: a busy GPU says nothing about whether requests meet their SLO.
* "Per ready replica" counts replicas that serve now (ready, not draining); the queues of draining
  replicas still count, since their work lands on the others if it is migrated.
* `Window` keeps the snapshots of the last `window_s` seconds. Each signal is a window average,
  divided by its target, so 1.0 means "exactly at target" whatever the unit:
    demand   arrival rate x (input tokens + w x output tokens) / (ready replicas x replica rate)
    queue    queued requests per ready replica / queue_per_replica
    backlog  queued prefill tokens per ready replica / prefill rate / TTFT SLO
    ttft     max(observed, predicted) TTFT / TTFT SLO
    tpot     max(observed, predicted) TPOT / TPOT SLO
    kv       mean KV use of ready replicas / kv_target
  The pressure is the largest of them, and the signal that gave it is named in every decision.
* The arrival trend is a least-squares line through (at, arrival rate) over the window, with its r
  squared; the planner uses it to project the rate to the moment a new replica would be ready.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from planner_svc.config import PlannerConfig
from sluice.types import ReplicaRole


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as the planner sees it in one observation."""

    replica_id: str
    ready: bool = True
    """False while it loads or warms up: it takes no traffic yet, so it adds no capacity yet."""
    queue_length: int = 0
    queued_prefill_tokens: int = 0
    in_flight: int = 0
    """Requests queued or running on it: what a drain would have to finish or migrate."""
    kv_used_fraction: float = 0.0
    cached_blocks: frozenset[int] = frozenset()
    """Block hashes of its prefix cache (as the router's prefix index knows them)."""
    draining: bool = False
    """A scale-down is under way: it takes no new work and is leaving the fleet."""
    role: ReplicaRole = ReplicaRole.BOTH
    """Prefill, decode or both: which pool it belongs to when the pools are sized apart (planner_svc/pools.py)."""

    @property
    def serving(self) -> bool:
        """Ready and not draining: it adds capacity now."""
        return self.ready and not self.draining


@dataclass(frozen=True)
class Observation:
    """One snapshot of load and latency at time `at` (seconds, any monotonic origin)."""

    at: float
    arrival_rate: float
    """Requests per second that arrived since the previous observation."""
    replicas: tuple[ReplicaLoad, ...]
    mean_input_tokens: float = 0.0
    mean_output_tokens: float = 0.0
    """Length mix of the arriving requests (max_tokens asked, or predicted output length)."""
    ttft_observed_s: float | None = None
    ttft_predicted_s: float | None = None
    tpot_observed_s: float | None = None
    tpot_predicted_s: float | None = None
    """None when nothing was measured or predicted in this interval (it then adds no pressure)."""
    decode_tpot_observed_s: float | None = None
    """A disaggregated fleet's TPOT as its decode replicas measured it (first to last token there, so the hand-off
    from the prefill pool is not in it); the decode pool is judged by it (planner_svc/pools.py)."""


@dataclass(frozen=True)
class Signals:
    """Window averages, each divided by its target (1.0 = at target), and the arrival trend."""

    pressures: dict[str, float]
    rate_now: float
    """Arrival rate of the trend line at the newest observation."""
    rate_slope: float
    """Change of the arrival rate per second, fitted over the window."""
    rate_fit: float = 0.0
    """r squared of that line: the share of the rate's variance it explains (0 for a flat rate)."""

    @property
    def pressure(self) -> float:
        return max(self.pressures.values(), default=0.0)

    @property
    def dominant(self) -> str:
        return max(self.pressures, key=lambda name: self.pressures[name]) if self.pressures else ""

    def rate_at(self, seconds_ahead: float) -> float:
        """The trend line's arrival rate `seconds_ahead` after the newest observation, never below 0."""
        return max(0.0, self.rate_now + self.rate_slope * seconds_ahead)


class Window:
    """The observations of the last `window_s` seconds, oldest first."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._observations: deque[Observation] = deque()

    def add(self, observation: Observation) -> None:
        """Append a snapshot. Raises ValueError if it is older than the newest one held."""
        if self._observations and observation.at < self._observations[-1].at:
            raise ValueError(f"observation at {observation.at} is older than {self._observations[-1].at}")
        self._observations.append(observation)

    def current(self, now: float) -> list[Observation]:
        """Drop snapshots older than `now - window_s` and return those left."""
        while self._observations and self._observations[0].at < now - self.window_s:
            self._observations.popleft()
        return list(self._observations)


def _mean(values: Iterable[float]) -> float:
    items = list(values)
    return sum(items) / len(items) if items else 0.0


def _trend(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares (value at the last x, slope, r squared); flat through the mean when x does not vary."""
    mean_x = _mean(x for x, _ in points)
    mean_y = _mean(y for _, y in points)
    spread_x = sum((x - mean_x) ** 2 for x, _ in points)
    spread_y = sum((y - mean_y) ** 2 for _, y in points)
    if spread_x == 0 or spread_y == 0:
        return mean_y, 0.0, 0.0
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in points)
    slope = covariance / spread_x
    return mean_y + slope * (points[-1][0] - mean_x), slope, covariance**2 / (spread_x * spread_y)


def _latency_ratio(observations: list[Observation], observed: str, predicted: str, slo_s: float) -> float:
    worst = [max(v for v in (getattr(o, observed), getattr(o, predicted)) if v is not None)
             for o in observations if getattr(o, observed) is not None or getattr(o, predicted) is not None]
    return _mean(worst) / slo_s


def _per_ready(observation: Observation, value: float) -> float:
    return value / max(1, sum(1 for r in observation.replicas if r.serving))


def compute_signals(observations: list[Observation], config: PlannerConfig) -> Signals:
    """Reduce a window of observations to pressures (1.0 = at target) and the arrival-rate trend."""
    c = config
    demand = [_per_ready(o, o.arrival_rate * (o.mean_input_tokens + c.output_token_weight * o.mean_output_tokens))
              / c.replica_tokens_per_s for o in observations]
    queue = [_per_ready(o, sum(r.queue_length for r in o.replicas)) / c.queue_per_replica for o in observations]
    backlog = [_per_ready(o, sum(r.queued_prefill_tokens for r in o.replicas)) / c.prefill_tokens_per_s
               / c.ttft_slo_s for o in observations]
    kv = [_mean(r.kv_used_fraction for r in o.replicas if r.serving) / c.kv_target for o in observations]
    pressures = {
        "demand": _mean(demand),
        "queue": _mean(queue),
        "backlog": _mean(backlog),
        "ttft": _latency_ratio(observations, "ttft_observed_s", "ttft_predicted_s", c.ttft_slo_s),
        "tpot": _latency_ratio(observations, "tpot_observed_s", "tpot_predicted_s", c.tpot_slo_s),
        "kv": _mean(kv),
    }
    rate_now, slope, fit = _trend([(o.at, o.arrival_rate) for o in observations]) if observations else (0, 0, 0)
    return Signals(pressures=pressures, rate_now=max(0.0, rate_now), rate_slope=slope, rate_fit=fit)
