"""Prefill and decode pools sized apart (prefill/decode disaggregation, docs/disaggregation.md).

Theory of operation
-------------------
A disaggregated fleet has two kinds of replica (`ReplicaLoad.role`), and what loads one says nothing about the
other: a prefill replica is loaded by prompts waiting to be computed, a decode replica by the KV its running
requests hold and by how many decode at once. So each pool gets a `Planner` of its own (the same rules: window,
cooldown, load-time projection, hysteresis, cheapest victim; planner_svc/core.py), fed the observations with
only that pool's replicas, and judged by its own signals (each 1.0 at its target, as in signals.py):

  prefill pool   backlog         queued prefill tokens per ready prefill replica / prefill rate / TTFT SLO
                 queue           queued requests per ready prefill replica / queue_per_replica
                 ttft            max(observed, predicted) TTFT / TTFT SLO
                 prefill_demand  arrival rate x mean input tokens / ready prefill replicas / prefill rate
  decode pool    kv              mean KV use of ready decode replicas / kv_target
                 decode_load     requests in flight per ready decode replica / decode_seqs_per_replica
                 tpot            max(observed, predicted) TPOT / TPOT SLO, observed on the decode replicas
                 decode_demand   arrival rate x w x mean output tokens / ready decode replicas / replica rate

`step(observation)` returns a `PoolDecisions`: one decision per pool (ScaleUp n replicas *of that role*,
ScaleDown that pool's cheapest replica, or Hold and why). BOTH replicas belong to neither pool: this planner
sizes a disaggregated fleet (an aggregated one has the one `Planner`).

Pure: no clock, no I/O; time comes in with each observation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner_svc.config import PlannerConfig
from planner_svc.core import Decision, Planner, SignalsFn
from planner_svc.signals import Observation, Signals, compute_signals
from sluice.types import ReplicaRole

__all__ = ["PREFILL_SIGNALS", "DECODE_SIGNALS", "PoolDecisions", "PoolPlanner", "PoolsConfig", "decode_signals",
           "pool_observation", "prefill_signals"]

PREFILL_SIGNALS = ("backlog", "queue", "ttft", "prefill_demand")
DECODE_SIGNALS = ("kv", "decode_load", "tpot", "decode_demand")


@dataclass(frozen=True)
class PoolsConfig:
    """The two pools' planners. Loaded once at start; never mutated."""

    prefill: PlannerConfig = PlannerConfig()
    """Bounds, thresholds and timings of the prefill pool (its `prefill_tokens_per_s` is one prefill replica's)."""
    decode: PlannerConfig = PlannerConfig()
    """Bounds, thresholds and timings of the decode pool (its `replica_tokens_per_s`: one decode replica's output
    rate in weighted tokens; `kv_target` its KV use at pressure 1)."""
    decode_seqs_per_replica: float = 128.0
    """Requests in flight on one decode replica that count as decode-load pressure 1."""

    def __post_init__(self) -> None:
        if not self.decode_seqs_per_replica > 0:
            raise ValueError(f"decode_seqs_per_replica must be > 0, got {self.decode_seqs_per_replica}")


@dataclass(frozen=True)
class PoolDecisions:
    """What each pool should do now."""

    prefill: Decision
    decode: Decision


def pool_observation(observation: Observation, role: ReplicaRole) -> Observation:
    """Return `observation` with only the replicas of `role` (the fleet-wide rates and latencies are kept, but for
    the decode pool's TPOT: the decode replicas' own, `decode_tpot_observed_s`). The TPOT a client sees includes the
    hand-off (the gap between the prefill replica's first token and the decode replica's next), which grows with a
    busy prefill pool; counted as decode pressure it grew the decode pool under a prefill-heavy load."""
    replicas = tuple(r for r in observation.replicas if r.role is role)
    if role is ReplicaRole.DECODE:
        return replace(observation, replicas=replicas, tpot_observed_s=observation.decode_tpot_observed_s)
    return replace(observation, replicas=replicas)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _ready(observation: Observation) -> int:
    return max(1, sum(1 for r in observation.replicas if r.serving))


def _kept(signals: Signals, names: tuple[str, ...], extra: dict[str, float]) -> Signals:
    pressures = {name: signals.pressures[name] for name in names if name in signals.pressures}
    pressures.update(extra)
    return Signals(pressures, signals.rate_now, signals.rate_slope, signals.rate_fit)


def prefill_signals(observations: list[Observation], config: PlannerConfig) -> Signals:
    """Return the prefill pool's signals (module docstring) from observations holding only prefill replicas."""
    demand = [o.arrival_rate * o.mean_input_tokens / _ready(o) / config.prefill_tokens_per_s for o in observations]
    return _kept(compute_signals(observations, config), PREFILL_SIGNALS, {"prefill_demand": _mean(demand)})


def decode_signals(seqs_per_replica: float) -> SignalsFn:
    """Return the decode pool's signals function (module docstring), with decode load at `seqs_per_replica`."""
    def signals(observations: list[Observation], config: PlannerConfig) -> Signals:
        load = [sum(r.in_flight for r in o.replicas) / _ready(o) / seqs_per_replica for o in observations]
        demand = [o.arrival_rate * config.output_token_weight * o.mean_output_tokens / _ready(o)
                  / config.replica_tokens_per_s for o in observations]
        return _kept(compute_signals(observations, config), DECODE_SIGNALS,
                     {"decode_load": _mean(load), "decode_demand": _mean(demand)})
    return signals


class PoolPlanner:
    """One Planner per pool, each fed its own replicas and judged by its own signals."""

    def __init__(self, config: PoolsConfig) -> None:
        self.config = config
        self.prefill = Planner(config.prefill, signals=prefill_signals)
        self.decode = Planner(config.decode, signals=decode_signals(config.decode_seqs_per_replica))

    def step(self, observation: Observation) -> PoolDecisions:
        """Observe a fleet snapshot and decide for each pool at its time."""
        return PoolDecisions(
            self.prefill.step(pool_observation(observation, ReplicaRole.PREFILL)),
            self.decode.step(pool_observation(observation, ReplicaRole.DECODE)),
        )
