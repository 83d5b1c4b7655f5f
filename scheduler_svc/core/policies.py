"""Orders of the waiting queue: small classes behind the `Policy` enum and `make_queue`.

Every queue keys a request by data fixed at submission, so a preempted request pushed back gets
its original place (FCFS: the front; priority: where its key puts it). Removal is lazy: an entry
is live only while `request.queue_seq` equals the entry's sequence number, so `remove` is O(1)
and dead entries are dropped when they reach the top of a heap.

PRIORITY with aging: effective priority = priority + aging_rate * (now - arrival). For two waiting
requests the difference of effective priorities does not depend on `now`, so the order is the
static key priority - aging_rate * arrival. A request R that arrived at t is overtaken only by a
request of priority p_R + delta arriving before t + delta / aging_rate: later arrivals rank below.

SRPF (least remaining prefill first, aged): key arrival + pending prefill / srpf_tokens_per_s, the
pending prefill being what is left to compute when the request is queued (less what the prefix cache
held). A request with P tokens to prefill is overtaken only by requests arriving less than
P / srpf_tokens_per_s after it, so nothing starves; a preempted request (already scheduled once)
counts no prefill and goes back by its arrival, ahead of everything that came later.

FAIR: each tenant has a virtual token counter, charged (input tokens * fair_input_weight + output
tokens * fair_output_weight) / tenant weight through `on_service`; the next request comes from the
backlogged tenant with the smallest counter (FCFS within a tenant). A tenant that becomes
backlogged has its counter lifted to the smallest counter of the other active tenants (those with
any live request, queued or running; with none, to the counter of the last tenant that went
inactive). A tenant back within `fair_return_window_s` of its last live request's end (or that
still had one running) is lifted only to that minimum less `fair_return_credit`: it keeps up to
that much of what it was owed. After a longer gap, or for a tenant never seen, idleness banks
nothing. Why the credit: with closed-loop clients the tenant served faster has more of its
requests between one's end and the next one's Submit, and a queue emptied for that moment forfeited
everything it was owed (2:1 weights served 1.2-1.6:1 through the vLLM gateway; 2.0 with the credit).
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod

from scheduler_svc.core.config import Policy, SchedulerConfig
from scheduler_svc.core.request import Request
from sluice.choices import enum_member


class WaitingQueue(ABC):
    """Interface of every waiting-queue policy."""

    tracks_service = False
    """True when the core must report served tokens through `on_service`."""

    def __init__(self) -> None:
        self._next_seq = 0
        self.length = 0
        """How many requests are queued: `len(queue)` without the call (read it, never write it)."""

    def __len__(self) -> int:
        return self.length

    def _new_seq(self, request: Request) -> int:
        self._next_seq += 1
        request.queue_seq = self._next_seq
        self.length += 1
        return self._next_seq

    @abstractmethod
    def push(self, request: Request) -> None:
        """Queue `request` at the place its static key gives it."""

    @abstractmethod
    def peek(self) -> Request | None:
        """Return the request that would be popped next, or None when the queue is empty."""

    def pop(self) -> Request:
        """Remove and return the head. Raises IndexError on an empty queue."""
        request = self.peek()
        if request is None:
            raise IndexError("pop from an empty waiting queue")
        self.remove(request)
        return request

    def remove(self, request: Request) -> bool:
        """Drop `request` (lazily); return False when it was not queued."""
        if request.queue_seq < 0:
            return False
        request.queue_seq = -1
        self.length -= 1
        return True

    def on_service(self, tenant: str, input_tokens: int, output_tokens: int) -> None:  # noqa: B027
        """Account tokens served to `tenant` (only FAIR uses it)."""

    def on_live(self, tenant: str, delta: int, now: float) -> None:  # noqa: B027
        """Note that `tenant` has `delta` more live requests in the core at `now` (only FAIR uses it)."""

    def set_tenant_weight(self, tenant: str, weight: float) -> None:  # noqa: B027
        """Take `tenant`'s share weight as a request carried it from admission (only FAIR uses it)."""

    @abstractmethod
    def live(self) -> list[Request]:
        """Return the queued requests (O(n); for checks and snapshots, not the hot path)."""


class _HeapQueue(WaitingQueue):
    """A heap of (key..., seq, request) entries with lazy deletion."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple] = []

    @abstractmethod
    def _key(self, request: Request) -> tuple:
        """Return the heap order of `request` (smallest first), fixed for its life in the queue."""

    def push(self, request: Request) -> None:
        seq = self._new_seq(request)
        heapq.heappush(self._heap, (*self._key(request), seq, request))

    def peek(self) -> Request | None:
        heap = self._heap
        while heap:
            entry = heap[0]
            request = entry[-1]
            if request.queue_seq == entry[-2]:
                return request
            heapq.heappop(heap)
        return None

    def live(self) -> list[Request]:
        return [entry[-1] for entry in sorted(self._heap) if entry[-1].queue_seq == entry[-2]]


class FcfsQueue(_HeapQueue):
    """First come, first served (by arrival time, then submission order)."""

    def _key(self, request: Request) -> tuple:
        return (request.arrival_time, request.arrival_seq)


class PriorityQueue(_HeapQueue):
    """Larger priority first, with linear aging (static key, see the module docstring)."""

    def __init__(self, aging_rate: float) -> None:
        super().__init__()
        if aging_rate < 0:
            raise ValueError(f"aging_rate must be >= 0, got {aging_rate}")
        self.aging_rate = aging_rate

    def _key(self, request: Request) -> tuple:
        return (self.aging_rate * request.arrival_time - request.priority, request.arrival_seq)


class EdfQueue(_HeapQueue):
    """Earliest deadline first; requests without a deadline last; ties by arrival."""

    def _key(self, request: Request) -> tuple:
        deadline = math.inf if request.deadline is None else request.deadline
        return (deadline, request.arrival_time, request.arrival_seq)


class SrpfQueue(_HeapQueue):
    """Least remaining prefill first, aged by arrival (static key, see the module docstring)."""

    def __init__(self, tokens_per_s: float) -> None:
        super().__init__()
        if not tokens_per_s > 0:
            raise ValueError(f"srpf_tokens_per_s must be > 0, got {tokens_per_s}")
        self.tokens_per_s = tokens_per_s

    def _key(self, request: Request) -> tuple:
        pending = request.pending_prefill if request.first_scheduled_time is None else 0
        return (request.arrival_time + pending / self.tokens_per_s, request.arrival_seq)


class FairQueue(WaitingQueue):
    """Weighted fair share across tenants by virtual token counters (FCFS within a tenant)."""

    tracks_service = True

    def __init__(self, input_weight: float, output_weight: float, tenant_weights: dict[str, float],
                 return_credit: float = 0.0, return_window_s: float = 0.0) -> None:
        super().__init__()
        for tenant, weight in tenant_weights.items():
            if weight <= 0:
                raise ValueError(f"tenant weight must be > 0, got {weight} for {tenant!r}")
        if not (return_credit >= 0 and math.isfinite(return_credit)):
            raise ValueError(f"fair_return_credit must be a finite number >= 0, got {return_credit}")
        if not (return_window_s >= 0 and math.isfinite(return_window_s)):
            raise ValueError(f"fair_return_window_s must be a finite number >= 0, got {return_window_s}")
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.return_credit = return_credit
        self.return_window_s = return_window_s
        self._inactive_since: dict[str, float] = {}
        """When each tenant's last live request ended (dropped when it has one again)."""
        self._credited: set[str] = set()
        """Tenants whose next lift keeps the credit: live again within the window, or live since their last lift."""
        self.tenant_weights = tenant_weights
        self.counters: dict[str, float] = {}
        self._heaps: dict[str, list[tuple]] = {}
        self._tenant_len: dict[str, int] = {}
        self._tenant_live: dict[str, int] = {}
        """Requests per tenant anywhere in the core (queued, running, swapping): who is active."""
        self._idle_floor = 0.0
        """Counter of the last tenant to become inactive: the floor when no other tenant is active."""

    def push(self, request: Request) -> None:
        tenant = request.tenant
        if not self._tenant_len.get(tenant):
            self._lift(tenant)
        seq = self._new_seq(request)
        self._tenant_len[tenant] = self._tenant_len.get(tenant, 0) + 1
        heapq.heappush(self._heaps.setdefault(tenant, []), (request.arrival_time, request.arrival_seq, seq, request))

    def _lift(self, tenant: str) -> None:
        # Why: a tenant that was idle must not claim the service it missed. The reference is every
        # other active tenant, running ones included: a tenant with nothing queued but requests
        # still decoding is being served right now (its counter grows with each token), so its
        # counter is as current as a queued tenant's.
        counters = self.counters
        active = {t for t, n in self._tenant_len.items() if n}
        active.update(self._tenant_live)
        active.discard(tenant)
        others = [counters.get(t, 0.0) for t in active]
        floor = min(others) if others else self._idle_floor
        own = counters.get(tenant)
        # Why the credit: a tenant whose queue emptied for a moment (its clients' next requests on their way)
        # keeps up to `return_credit` of what it was owed; a new tenant, or one back after a long gap, nothing.
        if own is None:
            counters[tenant] = floor
        elif tenant in self._credited:
            counters[tenant] = max(own, floor - self.return_credit)
        else:
            counters[tenant] = max(own, floor)
        if tenant in self._tenant_live:  # live from here on: a later lift (queue empty, requests running) keeps it
            self._credited.add(tenant)

    def on_live(self, tenant: str, delta: int, now: float) -> None:
        live = self._tenant_live.get(tenant, 0) + delta
        if live > 0:
            if delta > 0 and live == delta:  # back: credited when its last request ended within the window
                since = self._inactive_since.pop(tenant, None)
                if since is not None and now - since <= self.return_window_s:
                    self._credited.add(tenant)
            self._tenant_live[tenant] = live
            return
        # Forgetting idle tenants keeps `_lift` proportional to the active ones, not to history.
        self._tenant_live.pop(tenant, None)
        self._credited.discard(tenant)
        self._inactive_since[tenant] = now
        self._idle_floor = self.counters.get(tenant, self._idle_floor)

    def _head(self, tenant: str) -> Request | None:
        heap = self._heaps[tenant]
        while heap:
            entry = heap[0]
            if entry[-1].queue_seq == entry[-2]:
                return entry[-1]
            heapq.heappop(heap)
        return None

    def peek(self) -> Request | None:
        best: Request | None = None
        best_key: tuple = ()
        for tenant, count in self._tenant_len.items():
            if not count:
                continue
            head = self._head(tenant)
            key = (self.counters[tenant], head.arrival_time, head.arrival_seq) if head else ()
            if head is not None and (best is None or key < best_key):
                best, best_key = head, key
        return best

    def remove(self, request: Request) -> bool:
        if not super().remove(request):
            return False
        self._tenant_len[request.tenant] -= 1
        return True

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        # Admission's configuration is the one source of tenant weights; the newest request wins.
        self.tenant_weights[tenant] = weight

    def on_service(self, tenant: str, input_tokens: int, output_tokens: int) -> None:
        cost = input_tokens * self.input_weight + output_tokens * self.output_weight
        weight = self.tenant_weights.get(tenant, 1.0)
        self.counters[tenant] = self.counters.get(tenant, self._idle_floor) + cost / weight

    def live(self) -> list[Request]:
        return [e[-1] for heap in self._heaps.values() for e in sorted(heap) if e[-1].queue_seq == e[-2]]


def make_queue(policy: Policy | str, config: SchedulerConfig) -> WaitingQueue:
    """Return an empty waiting queue for `policy` (an enum member or its name/value).

    Raises ValueError naming the known policies when `policy` is unknown.
    """
    policy = enum_member(Policy, policy, "policy")
    factories = {
        Policy.FCFS: lambda: FcfsQueue(),
        Policy.PRIORITY: lambda: PriorityQueue(config.aging_rate),
        Policy.FAIR: lambda: FairQueue(
            config.fair_input_weight, config.fair_output_weight, dict(config.tenant_weights),
            config.fair_return_credit, config.fair_return_window_s
        ),
        Policy.EDF: lambda: EdfQueue(),
        Policy.SRPF: lambda: SrpfQueue(config.srpf_tokens_per_s),
    }
    return factories[policy]()
