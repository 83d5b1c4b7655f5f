"""The pure scheduling core: no asyncio, grpc, redis, clock or environment. `now` is an argument.

Its modules import compiled (mypyc) when `make compiled` built exactly these sources (sluice/compiled.py),
else from source; `COMPILED` says which.
"""

from sluice.compiled import use

COMPILED = use(__name__, __path__)
"""Whether this process runs the core's modules compiled by mypyc (the same code; see sluice.compiled)."""

from scheduler_svc.core.scheduler import SchedulerCore  # noqa: E402 (after the path is set)

__all__ = ["COMPILED", "SchedulerCore"]
