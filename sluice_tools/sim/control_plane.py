"""A load-dependent control plane for the simulator: the live stack's processes sharing a few CPU cores.

The fitted constants (`SimConfig.round_gap_s`, `submit_delay_s`, `token_delay_s`) are the control plane's
delays on an idle machine. Live, every process (client, admission, router, a scheduler and a worker per
replica, Redis) shares the same cores, so each delay grows with the work in flight. This module models those
cores as one processor-sharing server of `cores` CPUs:

- work arrives as CPU seconds: `request_cpu_s` per request (admission, routing, Submit, the client's call),
  `token_cpu_s` per delivered token (Redis, admission, the client's stream), and per round `round_cpu_s` +
  `seq_cpu_s` per sequence in it (the scheduler's plan and result, the worker's conversion);
- the offered load is the work of the last `window_s` or so (an exponentially decaying sum, divided by
  `window_s`): utilisation rho = load / cores + `background` (other work on the machine), at most `max_rho`;
- under processor sharing every job takes 1 / (1 - rho) times its idle-machine time (the M/M/1-PS stretch),
  so each constant delay (the idle machine's) is multiplied by the stretch at the time it starts. A round's
  own CPU is not added to its gap: the pipelined loop plans a round while the one before executes, and live
  the device's idle gap stays under 0.25 ms in 88-98 % of rounds even at batch 256; what is on the critical
  path is the fitted `round_gap_s`, and that is stretched like the other two.

Optionally (`replica_cores` > 0) each replica also has a pool of its own (its scheduler is one Python process),
charged its rounds' CPU, whose stretch multiplies that replica's round gap and token delay.

Off by default (`SimConfig.control_plane` None): the constants then apply unchanged. Sans-I/O: `now` is an
argument everywhere. The defaults are the per-token CPU split of `scripts/bench_live_cpu.py` at batch 32 and
256 (docs/operations.md "Control-plane CPU per token"), except the fixed per-round cost: bench_live_cpu's batch-1
figure is mostly idle polling, so `round_cpu_s` is fitted instead. `sluice_tools.fidelity table` fits `scale`
(all CPU costs times one factor, which also absorbs the machine's other work) on one loaded live run with one
replica, and `round_cpu_s` on one with two (twice the rounds per token at about the same token rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ControlPlaneConfig:
    """The shared CPU of the control plane and what each unit of work costs on it."""

    cores: float = 2.0
    """CPU cores the whole live stack shares."""
    request_cpu_s: float = 3e-3
    """CPU per request on the way in (admission, routing, the Submit RPC, the client's call)."""
    token_cpu_s: float = 150e-6
    """CPU per delivered token (Redis stream, admission, the client's stream: 147 us at batch 32)."""
    round_cpu_s: float = 0.0005
    """CPU per round, whatever its size (the scheduler's plan and result, the worker's round; fitted)."""
    seq_cpu_s: float = 48e-6
    """CPU per sequence in a round (scheduler and worker: 48 us/token at batch 256)."""
    scale: float = 1.0
    """Multiplier on every CPU cost above (fitted on a live run: the machine's speed and other work)."""
    background: float = 0.0
    """Utilisation of the cores by work outside the modelled stack (0..1)."""
    window_s: float = 0.25
    """Time constant of the offered-load estimate (seconds)."""
    max_rho: float = 0.95
    """Cap on the utilisation (the stretch 1 / (1 - rho) stays finite past saturation)."""
    replica_cores: float = 0.0
    """Cores of each replica's own pool (its scheduler is one Python process: 1), charged its rounds' CPU and
    stretching its round gap and token delay on top of the shared cores; 0: no per-replica pool."""

    def __post_init__(self) -> None:
        """Refuse a config that would divide by zero or stretch time backwards."""
        if self.cores <= 0 or self.replica_cores < 0 or self.window_s <= 0 or not 0 <= self.max_rho < 1 or self.scale < 0:
            raise ValueError(f"invalid control-plane config: {self}")


class ControlPlane:
    """The shared CPU's state: the decaying sum of recent work, and the delays it implies."""

    __slots__ = ("config", "_work", "_at", "_busy_s", "_replicas")

    def __init__(self, config: ControlPlaneConfig) -> None:
        """Start idle."""
        self.config = config
        self._work = 0.0
        """Decayed CPU seconds of recent work, as of `_at`."""
        self._at = 0.0
        self._busy_s = 0.0
        """Total CPU seconds charged (a measure for reports and tests)."""
        self._replicas: dict[int, list[float]] = {}
        """Per replica: [decayed CPU seconds of its own recent work, as of time] (with `replica_cores`)."""

    @property
    def busy_s(self) -> float:
        """Return the CPU seconds charged so far."""
        return self._busy_s

    def charge(self, now: float, cpu_s: float) -> None:
        """Add `cpu_s` seconds of work (before scaling) at `now`."""
        work = cpu_s * self.config.scale
        self._decay(now)
        self._work += work
        self._busy_s += work

    def _decay(self, now: float) -> None:
        if now > self._at:
            self._work *= math.exp((self._at - now) / self.config.window_s)
            self._at = now

    def utilization(self, now: float) -> float:
        """Return rho: the recent offered load over the cores, plus the background, capped at `max_rho`."""
        self._decay(now)
        cfg = self.config
        return min(cfg.max_rho, self._work / cfg.window_s / cfg.cores + cfg.background)

    def stretch(self, now: float) -> float:
        """Return 1 / (1 - rho): how much longer a job takes than on an idle machine (processor sharing)."""
        return 1.0 / (1.0 - self.utilization(now))

    def replica_stretch(self, now: float, replica: int | None, cpu_s: float = 0.0) -> float:
        """Charge `cpu_s` (before scaling) to `replica`'s own pool; return that pool's stretch (1 without one)."""
        cfg = self.config
        if replica is None or cfg.replica_cores <= 0:
            return 1.0
        state = self._replicas.setdefault(replica, [0.0, now])
        if now > state[1]:
            state[0] *= math.exp((state[1] - now) / cfg.window_s)
            state[1] = now
        state[0] += cpu_s * cfg.scale
        rho = min(cfg.max_rho, state[0] / cfg.window_s / cfg.replica_cores)
        return 1.0 / (1.0 - rho)

    def submit_delay(self, now: float, base_s: float) -> float:
        """Charge one request's way in; return its delay from arrival to the replica's submit."""
        self.charge(now, self.config.request_cpu_s)
        return base_s * self.stretch(now)

    def token_delay(self, now: float, base_s: float, tokens: int, replica: int | None = None) -> float:
        """Charge `tokens` delivered tokens of one round (of `replica`); return their delay from the round to the
        client."""
        if tokens:
            self.charge(now, tokens * self.config.token_cpu_s)
        return base_s * self.stretch(now) * self.replica_stretch(now, replica)

    def round_gap(self, now: float, base_s: float, seqs: int, replica: int | None = None) -> float:
        """Charge one round of `seqs` sequences (on `replica`); return the device's idle time before it."""
        cfg = self.config
        cpu = cfg.round_cpu_s + cfg.seq_cpu_s * seqs
        self.charge(now, cpu)
        return base_s * self.stretch(now) * self.replica_stretch(now, replica, cpu)
