"""One glue: how a scheduler replica's rounds and stats become the router's load view.

The scheduler service (`Driver` measures, `ReplicaAgent` reports), the router service
(`RouterServicer.Heartbeat` reconciles) and the simulator (`sluice_tools.sim.cluster`) all call
these functions; none of them has its own version. tests/unit/test_glue_drift.py feeds the
simulator and the services the same events and checks they agree on loads and routing decisions.

Theory of operation
-------------------
* `RoundRates` measures what rounds take (EWMA of the decode round and of prefill tokens/s) from
  each successful round's plan and wall time: the rates the router's TTFT prediction uses.
* `replica_load(stats, rates)` is the load a heartbeat carries; `reported_state(state, serving)`
  the state (UNHEALTHY instead of WARMING/READY while the worker is down);
  `heartbeat_report` puts them together.
* `reconcile(current, reported)` is the router's reaction to a reported state, kept as a table
  (`HEARTBEAT_INPUTS`): READY warms a WARMING or UNHEALTHY replica, UNHEALTHY faults a WARMING or
  READY one, DRAINING drains any that is not draining yet, GONE retires a DRAINING one (a drained
  replica's last heartbeat: it leaves the table); every other pair changes nothing.
  `apply_heartbeat` applies it to a router and records the load.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sluice.slots import retyping_constructor
from sluice.types import CoreStats, HeartbeatReport, ReplicaInput, ReplicaLoad, ReplicaState, RoundPlan

__all__ = [
    "HEARTBEAT_INPUTS", "LoadView", "RoundRates", "apply_heartbeat", "heartbeat_report", "reconcile",
    "replica_load", "reported_state",
]


# Positional constructors (sluice/slots.py, through a shell class): a frozen dataclass's __init__ pays
# object.__setattr__ per field, and the simulator sends a heartbeat per busy replica every 50 ms.
_new_load = retyping_constructor(ReplicaLoad)
_new_report = retyping_constructor(HeartbeatReport)


@dataclass
class RoundRates:
    """What a replica's rounds take, as exponentially weighted averages, for the router's TTFT.

    A round's wall time is modelled as one decode round (when it has decodes) plus its prefill tokens
    at the prefill rate. Decode-only rounds update `decode_round_s`; a round with prefill tokens
    counts its time less one decode round (at least a tenth of the round, so that a noisy decode
    average cannot make the rate absurd). The rate is averaged tokens over averaged seconds, so that
    small chunks do not dominate it.
    """

    alpha: float = 0.2
    """Weight of the newest round."""
    decode_round_s: float = 0.0
    """Average decode-only round, seconds; 0 until one was seen."""
    prefill_tokens: float = 0.0
    """Average prefill tokens of rounds that had some."""
    prefill_s: float = 0.0
    """Average seconds those rounds spent on prefill."""

    @property
    def prefill_tokens_per_s(self) -> float:
        """Return the measured prefill rate in tokens/s; 0 until a round with prefill was seen."""
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    def observe(self, plan: RoundPlan, wall_s: float) -> None:
        """Fold one successful round (its plan and its wall seconds) into the averages."""
        budget = plan.budget
        if budget is not None:  # the core's count: the same split, without a walk over the sequences
            prefill_tokens, decodes = budget.num_prefill_tokens, budget.num_decode_tokens
        else:
            prefill_tokens = decodes = 0
            for seq in plan.seqs:
                if seq.sample and seq.output_index > 0 and len(seq.token_ids) == 1:
                    decodes += 1
                else:
                    prefill_tokens += len(seq.token_ids)
        if prefill_tokens == 0:
            if decodes:  # `_average` inlined: a simulated trace observes millions of decode rounds
                old = self.decode_round_s
                self.decode_round_s = wall_s if old == 0.0 else old + self.alpha * (wall_s - old)
            return
        spent = max(wall_s - (self.decode_round_s if decodes else 0.0), wall_s / 10)
        self.prefill_tokens = self._average(self.prefill_tokens, prefill_tokens)
        self.prefill_s = self._average(self.prefill_s, spent)

    def observe_decodes(self, walls: Sequence[float]) -> list[float]:
        """Fold decode-only rounds' wall seconds, in order: exactly `observe` of each such round; return
        `decode_round_s` after each one."""
        old, alpha = self.decode_round_s, self.alpha
        after = []
        for wall_s in walls:
            old = wall_s if old == 0.0 else old + alpha * (wall_s - old)
            after.append(old)
        self.decode_round_s = old
        return after

    def _average(self, old: float, sample: float) -> float:
        return sample if old == 0.0 else old + self.alpha * (sample - old)


def replica_load(stats: CoreStats, rates: RoundRates) -> ReplicaLoad:
    """Return the load a heartbeat reports: the scheduler core's queues and free blocks, the measured rates.

    Free blocks are the allocatable ones: free plus cached-but-unreferenced (evictable on demand),
    so a replica whose memory holds a warm prefix cache does not look full to the router.
    """
    return _new_load(stats.waiting, stats.running, stats.queued_prefill_tokens,
                     stats.kv_blocks_free + stats.kv_blocks_cached, rates.prefill_tokens_per_s, rates.decode_round_s)


def reported_state(state: ReplicaState, worker_serving: bool) -> ReplicaState:
    """Return the state to heartbeat: UNHEALTHY instead of WARMING/READY while the worker is down."""
    if not worker_serving and state in (ReplicaState.WARMING, ReplicaState.READY):
        return ReplicaState.UNHEALTHY
    return state


def heartbeat_report(replica_id: str, state: ReplicaState, worker_serving: bool, stats: CoreStats,
                     rates: RoundRates) -> HeartbeatReport:
    """Return the heartbeat a replica sends: its reported state and its load."""
    return _new_report(replica_id, reported_state(state, worker_serving), replica_load(stats, rates))



HEARTBEAT_INPUTS: dict[tuple[ReplicaState, ReplicaState], ReplicaInput] = {
    (ReplicaState.WARMING, ReplicaState.READY): ReplicaInput.WARMED,
    (ReplicaState.UNHEALTHY, ReplicaState.READY): ReplicaInput.WARMED,
    (ReplicaState.WARMING, ReplicaState.UNHEALTHY): ReplicaInput.FAULT,
    (ReplicaState.READY, ReplicaState.UNHEALTHY): ReplicaInput.FAULT,
    (ReplicaState.WARMING, ReplicaState.DRAINING): ReplicaInput.DRAIN,
    (ReplicaState.READY, ReplicaState.DRAINING): ReplicaInput.DRAIN,
    (ReplicaState.UNHEALTHY, ReplicaState.DRAINING): ReplicaInput.DRAIN,
    (ReplicaState.DRAINING, ReplicaState.GONE): ReplicaInput.REMOVE,
}
"""(state the router holds, state the heartbeat reports) -> the input the router applies."""


def reconcile(current: ReplicaState | None, reported: ReplicaState | None) -> ReplicaInput | None:
    """Return the input that brings the router's state in line with a reported one, or None (no change).

    An unknown replica (`current` None) or an unspecified report changes nothing here.
    """
    if current is None or reported is None:
        return None
    return HEARTBEAT_INPUTS.get((current, reported))


class LoadView(Protocol):
    """What `apply_heartbeat` needs of a router (RouterCore has it)."""

    def state_of(self, replica_id: str) -> ReplicaState | None: ...

    def transition(self, replica_id: str, event: ReplicaInput, now: float) -> ReplicaState: ...

    def heartbeat(self, replica_id: str, load: ReplicaLoad, now: float) -> ReplicaState: ...


def apply_heartbeat(router: LoadView, report: HeartbeatReport, now: float) -> tuple[ReplicaState | None,
                                                                                     ReplicaState]:
    """Reconcile the replica's state with the report, then record its load; return (state before, after).

    Raises UnknownReplica (the replica must register again) or IllegalReplicaTransition.
    """
    before = router.state_of(report.replica_id)
    event = reconcile(before, report.state)
    if event is not None and router.transition(report.replica_id, event, now) is ReplicaState.GONE:
        return before, ReplicaState.GONE  # retired: removed from the table, no load to record
    return before, router.heartbeat(report.replica_id, report.load, now)
