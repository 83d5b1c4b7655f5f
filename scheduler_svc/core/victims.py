"""Preemption victims: whom to take off the device when a running request needs a block and none is free.

Small classes behind the `VictimPolicy` enum and `make_victim_rule`. A rule ranks requests; the
core offers the running requests no in-flight round reads (ones placed in the round being built
included) and the needy request itself, and preempts the lowest ranked. `needy` wins ties: it is
taken itself only when no candidate ranks strictly below it, so a request never preempts one that
ranks above it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from scheduler_svc.core.config import VictimPolicy
from scheduler_svc.core.request import Request
from sluice.choices import enum_member


class VictimRule(ABC):
    """Interface of every preemption victim rule."""

    @abstractmethod
    def rank(self, request: Request) -> tuple[float, ...]:
        """Return `request`'s rank: the smallest rank is preempted first."""

    def choose(self, needy: Request, candidates: Iterable[Request]) -> Request:
        """Return the victim among `candidates` and `needy` (needy unless a candidate ranks strictly lower)."""
        rank = self.rank
        victim, victim_rank = needy, rank(needy)
        for request in candidates:
            request_rank = rank(request)
            if request_rank < victim_rank:
                victim, victim_rank = request, request_rank
        return victim


class LowestPriorityFirst(VictimRule):
    """Lowest priority first, then the latest arrival (the one that has waited least)."""

    def rank(self, request: Request) -> tuple[float, ...]:
        return (request.priority, -request.arrival_time, -request.arrival_seq)


class LatestArrivalFirst(VictimRule):
    """The latest arrival first whatever its priority (vLLM's rule under FCFS)."""

    def rank(self, request: Request) -> tuple[float, ...]:
        return (-request.arrival_time, -request.arrival_seq)


def make_victim_rule(policy: VictimPolicy | str) -> VictimRule:
    """Return the victim rule for `policy` (an enum member or its value).

    Raises ValueError naming the known policies when `policy` is unknown.
    """
    policy = enum_member(VictimPolicy, policy, "victim policy")
    factories = {
        VictimPolicy.LOWEST_PRIORITY: LowestPriorityFirst,
        VictimPolicy.LATEST_ARRIVAL: LatestArrivalFirst,
    }
    return factories[policy]()
