"""The planner's pure core: how many replicas, and which one to retire.

Theory of operation
-------------------
`planner.observe(observation)` feeds a snapshot; `planner.decide(now)` returns one decision as data:
`ScaleUp(n)`, `ScaleDown(replica_id)` or `Hold(reason)`. The caller carries it out (connectors.py)
and the next observations show the result. Rules, in the order `decide` applies them:

0. Fleet. Replicas being drained (a scale-down under way) are not counted and not chosen again;
   warming ones are counted (they are coming), ready ones are counted and carry the load.
1. Bounds. Fewer replicas than `min_replicas` (one died): ScaleUp to the minimum at once. More than
   `max_replicas`: ScaleDown one at once. Bounds repairs ignore the window and the cooldown.
2. Window. Fewer than `min_observations` snapshots in the last `window_s` seconds: Hold.
3. Cooldown. Less than `cooldown_s` since the last change: Hold.
4. Pressure (signals.py): the largest of the demand, queue, backlog, TTFT, TPOT and KV ratios, each
   1.0 at its target. Replicas still loading add no capacity yet but will: the effective pressure is
   the measured one x ready / all replicas, so a replica on its way is not asked for twice.
5. Load-time rule. A new replica helps only `load_time_s + warmup_s` from now. The planner projects
   the arrival rate to then along the window's least-squares trend and scales the pressure by
   projected rate / current rate. The trend is used only when it explains the rate (r squared >=
   `trend_min_r2`): the first snapshots of a step, or noise around a flat rate, are taken as flat,
   so the onset of a burst is judged by the window mean, not by a line extrapolated from it. It scales up when the *projected* pressure exceeds
   `scale_up_pressure`: a burst whose trend falls back before a new replica would be ready starts
   none (Hold BURST_ENDS_BEFORE_READY), and a ramp starts one before the SLO is breached.
   Scale-up asks for enough replicas to bring the projected pressure to `target_pressure`.
6. Hysteresis. Scale down only when both the effective and the projected pressure are below
   `scale_down_pressure`, and the pressure on one replica fewer would stay below `scale_up_pressure`
   (otherwise the next decision would undo this one). Between the thresholds: Hold IN_BAND.
7. Victim. Scale-down removes the replica whose removal costs least: fewest in-flight requests (work
   to finish or migrate), then fewest cached prefix blocks that no other replica holds (prefill
   the fleet would redo), then the shortest queue, then the smallest id (deterministic).

Pure: no clock, no I/O; `now` is an argument.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner_svc.config import PlannerConfig
from planner_svc.signals import Observation, ReplicaLoad, Signals, Window, compute_signals

SignalsFn = Callable[[list[Observation], PlannerConfig], Signals]
"""(window of observations, config) -> signals: `compute_signals`, or a pool's own (planner_svc/pools.py)."""


class HoldReason(enum.Enum):
    """Why the planner changes nothing this time."""

    NO_OBSERVATIONS = "no_observations"
    WINDOW_NOT_FULL = "window_not_full"
    COOLDOWN = "cooldown"
    IN_BAND = "in_band"
    """Pressure between the thresholds, or one replica fewer would cross the upper one."""
    AT_MAX = "at_max"
    AT_MIN = "at_min"
    BURST_ENDS_BEFORE_READY = "burst_ends_before_ready"
    """Pressure is high now, but the trend says it is gone before a new replica would be ready."""


@dataclass(frozen=True)
class ScaleUp:
    """Start `n` more replicas."""

    n: int
    signal: str = ""
    """The signal that drove it ("bounds" for a bounds repair)."""
    pressure: float = 0.0
    """The projected pressure it acted on."""


@dataclass(frozen=True)
class ScaleDown:
    """Drain and retire this replica."""

    replica_id: str
    signal: str = ""
    pressure: float = 0.0


@dataclass(frozen=True)
class Hold:
    """Change nothing, and why."""

    reason: HoldReason
    signal: str = ""
    pressure: float = 0.0


Decision = ScaleUp | ScaleDown | Hold


def choose_victim(replicas: Sequence[ReplicaLoad]) -> str:
    """The id of the replica whose removal costs least (rule 7). Raises ValueError if there is none."""
    if not replicas:
        raise ValueError("no replica to remove")
    holders = Counter(block for replica in replicas for block in replica.cached_blocks)

    def cost(replica: ReplicaLoad) -> tuple[int, int, int, str]:
        exclusive = sum(1 for block in replica.cached_blocks if holders[block] == 1)
        return replica.in_flight, exclusive, replica.queue_length, replica.replica_id

    return min(replicas, key=cost).replica_id


class Planner:
    """Decides the replica count from a window of observations (module docstring: the rules)."""

    def __init__(self, config: PlannerConfig, signals: SignalsFn = compute_signals) -> None:
        self.config = config
        self._signals = signals
        self._window = Window(config.window_s)
        self._last_change_at: float | None = None
        self.last_signals: Signals | None = None
        """The signals of the last decision that got as far as computing them (for metrics)."""

    @property
    def last_change_at(self) -> float | None:
        """When the planner last returned a ScaleUp or ScaleDown (None: never)."""
        return self._last_change_at

    def observe(self, observation: Observation) -> None:
        """Add a snapshot to the window. Raises ValueError if it is older than the newest one."""
        self._window.add(observation)

    def step(self, observation: Observation) -> Decision:
        """Observe, then decide at the observation's time."""
        self.observe(observation)
        return self.decide(observation.at)

    def decide(self, now: float) -> Decision:
        """Apply the rules of the module docstring to the window ending at `now`; return one decision."""
        observations = self._window.current(now)
        if not observations:
            return Hold(HoldReason.NO_OBSERVATIONS)
        # A draining replica is already on its way out: not counted, not chosen again.
        replicas = [replica for replica in observations[-1].replicas if not replica.draining]
        repair = self._repair_bounds(replicas, now)
        if repair is not None:
            return repair
        if len(observations) < self.config.min_observations:
            return Hold(HoldReason.WINDOW_NOT_FULL)
        self.last_signals = self._signals(observations, self.config)
        if self._last_change_at is not None and now - self._last_change_at < self.config.cooldown_s:
            return Hold(HoldReason.COOLDOWN)
        return self._size(replicas, self.last_signals, now)

    def _repair_bounds(self, replicas: Sequence[ReplicaLoad], now: float) -> Decision | None:
        total, c = len(replicas), self.config
        if total < c.min_replicas:
            return self._changed(ScaleUp(c.min_replicas - total, signal="bounds"), now)
        if total > c.max_replicas:
            return self._changed(ScaleDown(choose_victim(replicas), signal="bounds"), now)
        return None

    def _size(self, replicas: Sequence[ReplicaLoad], signals: Signals, now: float) -> Decision:
        c, total = self.config, len(replicas)
        ready = sum(1 for replica in replicas if replica.serving)
        effective = signals.pressure * max(1, ready) / max(1, total)
        trusted = signals.rate_fit >= c.trend_min_r2 and signals.rate_now > 0
        growth = signals.rate_at(c.ready_delay_s) / signals.rate_now if trusted else 1.0
        projected = effective * growth
        signal = signals.dominant
        # A fleet scaled to zero has no capacity at all: any load at the ready time needs a replica.
        if projected > c.scale_up_pressure or (total == 0 and projected > 0):
            if total >= c.max_replicas:
                return Hold(HoldReason.AT_MAX, signal, projected)
            wanted = math.ceil(max(1, total) * projected / c.target_pressure) - total
            return self._changed(ScaleUp(min(c.max_replicas - total, max(1, wanted)), signal, projected), now)
        if effective > c.scale_up_pressure:
            return Hold(HoldReason.BURST_ENDS_BEFORE_READY, signal, projected)
        return self._maybe_shrink(replicas, max(effective, projected), signal, now)

    def _maybe_shrink(self, replicas: Sequence[ReplicaLoad], worst: float, signal: str, now: float) -> Decision:
        c, total = self.config, len(replicas)
        if worst >= c.scale_down_pressure:
            return Hold(HoldReason.IN_BAND, signal, worst)
        if total <= c.min_replicas:
            return Hold(HoldReason.AT_MIN, signal, worst)
        # Hysteresis: the pressure on one replica fewer must stay under the upper threshold, and the
        # last replica goes (min_replicas 0) only when there is no load at all.
        after = worst * total / (total - 1) if total > 1 else (math.inf if worst > 0 else 0.0)
        if after > c.scale_up_pressure:
            return Hold(HoldReason.IN_BAND, signal, worst)
        return self._changed(ScaleDown(choose_victim(replicas), signal, worst), now)

    def _changed(self, decision: Decision, now: float) -> Decision:
        self._last_change_at = now
        return decision
