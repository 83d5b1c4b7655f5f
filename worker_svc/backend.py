"""The interface every execution backend implements (torch engine, cost model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from scheduler_svc.core.types import RoundPlan, RoundResult


@dataclass(frozen=True)
class BackendInfo:
    """What a worker tells its scheduler (and WorkerService.Info) about itself."""

    model_id: str
    model_version: str
    block_size: int
    num_blocks: int
    num_host_blocks: int
    dtype: str
    device: str
    max_model_len: int
    vocab_size: int
    eos_token_id: int
    backend: str
    """"torch" or "costmodel"."""


class Backend(Protocol):
    def info(self) -> BackendInfo:
        """Return the worker's model and capacity."""
        ...

    def execute(self, plan: RoundPlan) -> RoundResult:
        """Run one round (swaps first, then one forward) and return the sampled tokens.

        `RoundResult.elapsed_s` is the measured time (torch) or the modelled time (cost model).
        """
        ...
