"""The planner's configuration: bounds, thresholds, timings and the SLO targets it plans against.

Defaults are for a GPU fleet serving an 8B model; `docs/planner.md` says where each timing comes from.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlannerConfig:
    """How the planner sizes the fleet. Loaded once at start; never mutated."""

    min_replicas: int = 1
    """Fewest replicas the planner keeps, whatever the load."""
    max_replicas: int = 4
    """Most replicas the planner asks for, whatever the load."""
    window_s: float = 60.0
    """Observation window: signals are averages (and the arrival trend a fit) over this many seconds."""
    min_observations: int = 3
    """Fewer observations than this in the window and the planner holds (too little to judge)."""
    trend_min_r2: float = 0.5
    """The arrival trend is used only if the line explains this share of the rate's variance (else flat)."""
    cooldown_s: float = 120.0
    """Least time between two changes of the replica count (bounds repairs excepted)."""
    scale_up_pressure: float = 0.9
    """Scale up when the pressure projected to a new replica's ready time exceeds this."""
    scale_down_pressure: float = 0.5
    """Scale down only when the pressure is below this (hysteresis band up to `scale_up_pressure`)."""
    target_pressure: float = 0.7
    """Scale-up sizes the fleet so the pressure lands here (between the two thresholds)."""
    load_time_s: float = 60.0
    """Time from start to weights loaded on a new replica (see docs/planner.md for the source)."""
    warmup_s: float = 15.0
    """Time from weights loaded to the first routed request (warm-up rounds, graph capture)."""
    ttft_slo_s: float = 1.0
    """Time-to-first-token target; observed or predicted TTFT over it is pressure above 1."""
    tpot_slo_s: float = 0.1
    """Time-per-output-token target; observed or predicted TPOT over it is pressure above 1."""
    prefill_tokens_per_s: float = 10_000.0
    """One replica's prefill throughput: turns queued prefill tokens into seconds of queue wait."""
    replica_tokens_per_s: float = 20_000.0
    """One replica's sustainable work rate, in weighted tokens per second (demand pressure 1)."""
    output_token_weight: float = 8.0
    """Cost of one output token in prefill-token units (a decode step is dearer per token)."""
    queue_per_replica: float = 16.0
    """Queued requests per ready replica that count as pressure 1."""
    kv_target: float = 0.9
    """KV-cache use fraction that counts as pressure 1."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, "
                             f"got {self.min_replicas}..{self.max_replicas}")
        if not 0 < self.scale_down_pressure < self.target_pressure < self.scale_up_pressure:
            raise ValueError("need 0 < scale_down_pressure < target_pressure < scale_up_pressure, got "
                             f"{self.scale_down_pressure} < {self.target_pressure} < {self.scale_up_pressure}")
        positive = {"window_s": self.window_s, "ttft_slo_s": self.ttft_slo_s, "tpot_slo_s": self.tpot_slo_s,
                    "prefill_tokens_per_s": self.prefill_tokens_per_s, "kv_target": self.kv_target,
                    "replica_tokens_per_s": self.replica_tokens_per_s, "queue_per_replica": self.queue_per_replica}
        bad = [name for name, value in positive.items() if value <= 0]
        if not 0 <= self.trend_min_r2 <= 1:
            bad.append("trend_min_r2")
        if bad or self.cooldown_s < 0 or self.load_time_s < 0 or self.warmup_s < 0 or self.min_observations < 1:
            raise ValueError(f"planner config out of range: {bad or 'a time is negative or min_observations < 1'}")

    @property
    def ready_delay_s(self) -> float:
        """Seconds from asking for a replica to its first routed request: load plus warm-up."""
        return self.load_time_s + self.warmup_s
