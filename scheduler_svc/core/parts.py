"""The parts of one core that its round builder and its outcome keeper share, as one bundle."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.core.backlog import Backlog
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.endings import Endings
from scheduler_svc.core.host_blocks import HostBlocks
from scheduler_svc.core.outbox import Outbox
from scheduler_svc.core.table import RequestTable


@dataclass(frozen=True, slots=True)
class CoreParts:
    """What `Batcher` and `RoundOutcomes` are built from (the core owns every part)."""

    config: SchedulerConfig
    """The replica's scheduler settings."""
    table: RequestTable
    """Live requests by id and place."""
    backlog: Backlog
    """The waiting queue and the pending-prefill ledger."""
    pool: BlockPool
    """Device KV blocks, the prefix cache and KV events."""
    host: HostBlocks
    """Host blocks for swap-mode preemption."""
    outbox: Outbox
    """Events since the last take, and the counters."""
    endings: Endings
    """Cancel, timeout, finish and failure, each exactly once."""
