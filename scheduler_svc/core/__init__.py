"""The pure scheduling core: no asyncio, grpc, redis, clock or environment. `now` is an argument."""

from scheduler_svc.core.scheduler import SchedulerCore

__all__ = ["SchedulerCore"]
