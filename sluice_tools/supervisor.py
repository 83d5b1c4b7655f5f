"""Supervision of a local stack: a process that dies is restarted, with backoff, instead of ending the stack.

Theory of operation
- `Supervisor.step(now)` is one pass (the caller owns the clock and the period, e.g. 4 per second):
  every process of the stack that is not being retired, and the embedded Redis, is checked.
- A death is logged with its cause (exit code, or the signal that killed it) and the restart is due
  after a backoff: `initial_backoff_s`, doubled for each further death that comes less than
  `stable_after_s` after the previous start, at most `max_backoff_s`. A process that dies
  `max_restarts` times in a row that quickly is given up on: reported plainly, not restarted again.
  Without Redis, the router or admission the stack cannot serve (`failed` says why; `sluice up`
  exits 1); without a replica it runs on the others, degraded.
- A restart uses the same command, address and environment (`StackFleet.relaunch`), the embedded Redis the
  same port and password (`EmbeddedRedis.restart`). Services find each other again by themselves:
  a scheduler re-registers with a restarted router (heartbeat NOT_FOUND), a restarted scheduler
  registers (WARMING) and reports READY only once its worker serves (the worker serves only after
  its warm-up round), a scheduler whose worker died marks its replica UNHEALTHY until the worker is
  back (its KV forgotten), Redis clients reconnect per command.
- A scheduler's death is also told to the router at once (Drain: no routes to a dead replica while it
  restarts; its registration after the restart makes it WARMING, then READY, again).
- Recovery: once restarted, a process is "recovering" until its gRPC health says SERVING (Redis: it
  answers PING); then the time from its death is logged.
- Metrics endpoints: a launch clears the process's `metrics_url` (under `--metrics-port 0` the new
  incarnation binds another port); each pass reads the URL the running one printed, until it has one,
  and tells a restarted process's new URL (also the URL of a replica added while the stack runs).
- `restart_counts()` and `summary()` give the restarts per process (printed by `sluice up` on stop).

The backoff bookkeeping (`Restarts`) is pure: times are arguments.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sluice_tools.stack import Proc, Stack

__all__ = ["RestartPolicy", "Restarts", "Supervisor", "describe_exit"]

CRITICAL = ("redis", "router", "admission")
"""Processes without which the stack cannot serve at all."""


@dataclass(frozen=True)
class RestartPolicy:
    """How dead processes are restarted."""

    initial_backoff_s: float = 0.5
    """Wait before the first restart after a process that ran stably dies."""
    max_backoff_s: float = 16.0
    """The backoff doubles per quick death up to this."""
    stable_after_s: float = 30.0
    """A process that ran this long before dying starts again from the initial backoff."""
    max_restarts: int = 5
    """Quick deaths in a row after which the process is given up on (reported, not restarted)."""


@dataclass
class Restarts:
    """One process's deaths and restarts (pure: `now` is an argument)."""

    policy: RestartPolicy
    started_at: float = 0.0
    streak: int = 0
    """Deaths in a row, each within `stable_after_s` of the previous start."""
    total: int = 0
    """Restarts done."""
    died_at: float | None = None
    due_at: float | None = None
    """When the pending restart is due (None: none pending)."""
    recovering: bool = False
    """Restarted, not yet SERVING."""
    gave_up: bool = False

    def died(self, now: float) -> float | None:
        """Record a death at `now`; return when to restart, or None when it is given up on."""
        if now - self.started_at >= self.policy.stable_after_s:
            self.streak = 0
        self.streak += 1
        self.died_at, self.recovering = now, False
        if self.streak > self.policy.max_restarts:
            self.gave_up, self.due_at = True, None
            return None
        delay = min(self.policy.max_backoff_s, self.policy.initial_backoff_s * 2 ** (self.streak - 1))
        self.due_at = now + delay
        return self.due_at

    def restarted(self, now: float) -> None:
        """Record the restart at `now`."""
        self.started_at, self.due_at, self.total, self.recovering = now, None, self.total + 1, True


def describe_exit(returncode: int | None) -> str:
    """Say how a process ended: `exit code 1`, `killed by SIGKILL`."""
    if returncode is None:
        return "unknown exit"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class Supervisor:
    """Restarts the dead processes of a `Stack` (see the module docstring)."""

    stack: Stack
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    on_event: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))
    """Told one line per death, restart, recovery and give-up."""
    tracks: dict[str, Restarts] = field(default_factory=dict)
    failed: str = ""
    """Why the stack cannot serve any more ("" while it can)."""
    halted: bool = False
    """Set when the stack stops: nothing is restarted any more."""
    hooks: list[Callable[[float], None]] = field(default_factory=list)
    """Called at the end of every pass with `now` (the autoscaler ticks here)."""

    def step(self, now: float) -> None:
        """One pass: note deaths, restart what is due, report recoveries, move replicas along, run hooks."""
        if self.halted:
            return
        if self.stack.redis is not None:
            self._check_redis(now)
        for proc in list(self.stack.procs):
            replica = self.stack.replicas.get(proc.replica_id) if proc.replica_id else None
            if replica is None or not replica.retiring:
                self._check(proc, now)
        for line in self.stack.fleet.advance_replicas():
            self.on_event(line)
        for hook in self.hooks:
            hook(now)

    def _track(self, name: str) -> Restarts:
        return self.tracks.setdefault(name, Restarts(self.policy))

    def _check(self, proc: Proc, now: float) -> None:
        track = self._track(proc.name)
        if proc.alive():
            self._refresh_metrics_url(proc, track)
            if track.recovering and self._serving(proc):
                self._recovered(proc.name, track, now)
            return
        if track.gave_up:
            return
        if track.due_at is None:
            self._died(proc.name, describe_exit(proc.popen.poll() if proc.popen else None), track, now)
            if proc.name.startswith("scheduler-") and proc.replica_id:
                self.stack.fleet.router_drain(proc.replica_id)  # no routes to it while it restarts
            return
        if now >= track.due_at:
            self.stack.fleet.relaunch(proc)
            track.restarted(now)
            pid = proc.popen.pid if proc.popen else "?"
            self.on_event(f"restarted {proc.name} (pid {pid}, restart {track.total})")

    def _refresh_metrics_url(self, proc: Proc, track: Restarts) -> None:
        if proc.metrics_url or not self.stack.config.metrics:
            return
        proc.metrics_url = proc.printed_metrics_url()
        if proc.metrics_url and track.total:
            self.on_event(f"{proc.name} metrics now on {proc.metrics_url}")

    def _check_redis(self, now: float) -> None:
        redis = self.stack.redis
        assert redis is not None
        track = self._track("redis")
        if redis.running:
            if track.recovering:
                self._recovered("redis", track, now)
            return
        if track.gave_up:
            return
        if track.due_at is None:
            self._died("redis", describe_exit(redis.returncode), track, now)
            return
        if now >= track.due_at:
            try:
                redis.restart()  # waits until it answers PING (or raises)
            except Exception as exc:
                self.on_event(f"redis could not be restarted: {exc}")
                track.due_at = None  # counts as another death
                return
            track.restarted(now)
            self.on_event(f"restarted redis on port {redis.port}, same password (pid {redis.pid}, "
                          f"restart {track.total})")

    def _recovered(self, name: str, track: Restarts, now: float) -> None:
        track.recovering = False
        self.on_event(f"{name} serving again, {now - (track.died_at or now):.1f} s after it died")

    def _died(self, name: str, cause: str, track: Restarts, now: float) -> None:
        due = track.died(now)
        if due is not None:
            self.on_event(f"{name} died ({cause}); restarting in {due - now:.1f} s")
            return
        if name in CRITICAL:
            self.failed = (f"{name} keeps dying ({cause}; {track.streak} times in a row, each within "
                           f"{self.policy.stable_after_s:.0f} s of its start): given up; the stack cannot serve")
        else:
            self.on_event(f"{name} keeps dying ({cause}; {track.streak} times in a row): given up; "
                          "the stack runs without it")
        if self.failed:
            self.on_event(self.failed)

    def restart_counts(self) -> dict[str, int]:
        """Restarts done per process name (only those restarted at least once)."""
        return {name: track.total for name, track in sorted(self.tracks.items()) if track.total}

    def _serving(self, proc: Proc) -> bool:
        from sluice_tools.stack_parts import proc_serving

        return proc_serving(proc, timeout_s=0.2, files=self.stack.health_files(proc))

    def summary(self) -> str:
        """One line: restarts per process, or that there were none."""
        counts = self.restart_counts()
        if not counts:
            return "restarts: none"
        return "restarts: " + ", ".join(f"{name} {count}" for name, count in counts.items())
