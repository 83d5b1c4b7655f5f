"""One simulated replica: its scheduler core and what the simulator keeps of it (see cluster.py)."""

from __future__ import annotations

from typing import NamedTuple

from router_svc.core import ReplicaSpec
from scheduler_svc.core import SchedulerCore
from sluice import glue
from sluice.types import ReplicaState, RoundPlan
from worker_svc.costmodel import CostModel, RoundShape


class RatesLog(NamedTuple):
    """After each round of a replica's last bulk run (fastforward.load_at): three lists, one entry per round."""

    times: list[float]
    """When the round ended, ascending."""
    decode_round_s: list[float]
    """`RoundRates.decode_round_s` after it."""
    blocks: list[tuple[int, int]]
    """The pool's (free, cached) blocks after it."""


class Replica:
    """A replica's scheduler core, its router-facing state and its rounds in flight."""

    __slots__ = ("index", "replica_id", "core", "busy", "deadline_at", "reported_idle", "state", "rates", "ahead",
                 "rates_log")

    def __init__(self, index: int, replica_id: str, core: SchedulerCore) -> None:
        self.index = index
        self.replica_id = replica_id
        self.core = core
        self.busy = False
        self.deadline_at: float | None = None
        self.reported_idle = False
        """The router's view of this replica is already 'empty' (last heartbeat had no work)."""
        self.state = ReplicaState.WARMING
        """What its heartbeats report (the scheduler's ReplicaAgent.state)."""
        self.rates = glue.RoundRates()
        """Measured from its rounds' modelled times, as the scheduler's driver measures wall times."""
        self.ahead: RoundPlan | None = None
        """The round planned while the one in flight executes (pipelining)."""
        self.rates_log: RatesLog | None = None
        """The rates and blocks after each round of the last bulk run, while a heartbeat may fall in it."""


def replica_spec(replica_id: str, model: str, cost: CostModel, block_size: int, num_blocks: int,
                 max_num_batched_tokens: int) -> ReplicaSpec:
    """Return what the replica registers with the router: its shape and the cost model's nominal rates."""
    chunk = min(max_num_batched_tokens, 2048)
    prefill_s = cost.shape_time(RoundShape(chunk, chunk * (chunk + 1) // 2, chunk, chunk, 1))
    decode_s = cost.shape_time(RoundShape(32, 32 * 1000, 32 * 1000, 32, 32))
    far = 32 * chunk  # the same chunk behind a long context: what each context token adds to its attention
    far_s = cost.shape_time(RoundShape(chunk, chunk * far + chunk * (chunk + 1) // 2, far + chunk, chunk, 1))
    return ReplicaSpec(
        replica_id=replica_id,
        model=model,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        prefill_tokens_per_s=chunk / prefill_s,
        decode_round_s=decode_s,
        prefill_pair_s=max(far_s - prefill_s, 0.0) / (chunk * far),
    )
