"""The interface every execution backend implements (torch engine, cost model)."""

from __future__ import annotations

from typing import Protocol

from sluice.types import BackendInfo, RoundPlan, RoundResult


class Backend(Protocol):
    def info(self) -> BackendInfo:
        """Return the worker's model and capacity."""
        ...

    def execute(self, plan: RoundPlan) -> RoundResult:
        """Run one round (swaps first, then one forward) and return the sampled tokens.

        `RoundResult.elapsed_s` is the measured time (torch) or the modelled time (cost model).
        """
        ...
