"""Sluice's queue policies as a vLLM waiting queue (vLLM's RequestQueue interface), without importing vLLM.

vLLM's V1 scheduler keeps its waiting requests in `self.waiting`, an object with add_request, pop_request,
peek_request, prepend_request(s), remove_request(s), __len__, __bool__ and __iter__. `PolicyRequestQueue`
is that object over Sluice's own queue classes (scheduler_svc.core.policies), so that weighted fair share
with aging, priority with aging and EDF order vLLM's queue inside the engine process (sched_cls.py plugs it
into vLLM's scheduler; this module is pure and imports neither vLLM nor any I/O).

- Each engine request gets a shadow `Request` of the Sluice core (tenant, priority, arrival, prompt length,
  deadline), queued by the policy; a preempted request prepended again gets its shadow's place back.
- The tenant is the prefix of vLLM's request id up to the first ":" (the agent sends `X-Request-Id:
  {tenant}:{id}`; a client calling vLLM directly can do the same), after vLLM's "cmpl-"/"chatcmpl-" prefix;
  without one the tenant is "default". Weights come from the constructor (sched_cls reads them from
  $SLUICE_TENANT_WEIGHTS in the engine process).
- Service is charged as it happens: input tokens when the request first leaves the queue (a request vLLM
  pops, skips and puts back is charged once), output tokens as the engine samples them (`on_output`). A
  tenant counts as active from its request's arrival until the engine is done with it (`forget`), running
  included, as in the Sluice scheduler: a tenant whose queue empties for a moment while its requests run keeps
  its place instead of being lifted to the others' counters (measured inside vLLM, counting only queued
  requests served 2:1 weights 1.7:1 when a busy API server let the queue run dry).
- Sluice's priority is "larger runs first"; vLLM's "smaller first": the shadow's priority is the negation.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from scheduler_svc.core.config import Policy, SchedulerConfig
from scheduler_svc.core.policies import make_queue
from scheduler_svc.core.request import Request
from sluice.types import NewRequest, SamplingParams

__all__ = ["PolicyRequestQueue", "parse_weights", "tenant_of"]

_PREFIXES = ("chatcmpl-", "cmpl-")


def tenant_of(request_id: str) -> str:
    """Return the tenant a vLLM request id names (see the module docstring); "default" when it names none."""
    for prefix in _PREFIXES:
        if request_id.startswith(prefix):
            request_id = request_id[len(prefix):]
            break
    tenant, colon, _ = request_id.partition(":")
    return tenant if colon and tenant else "default"


def parse_weights(text: str) -> tuple[tuple[str, float], ...]:
    """Parse "a=2,b=1" into tenant weights. Raises ValueError naming a bad entry (weights must be > 0)."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        tenant, equals, weight = item.partition("=")
        try:
            value = float(weight)
        except ValueError:
            value = 0.0
        if not equals or not tenant or not value > 0:
            raise ValueError(f"tenant weight {item!r}: expected TENANT=WEIGHT with WEIGHT > 0")
        out.append((tenant, value))
    return tuple(out)


class PolicyRequestQueue:
    """vLLM's waiting-queue interface over a Sluice queue policy (see the module docstring)."""

    def __init__(self, policy: Policy | str = Policy.FAIR, tenant_weights: tuple[tuple[str, float], ...] = (),
                 aging_rate: float = 1.0) -> None:
        config = SchedulerConfig(num_blocks=1, tenant_weights=tenant_weights, aging_rate=aging_rate)
        self._queue = make_queue(policy, config)
        self._shadows: dict[str, Request] = {}
        self._engine: dict[str, Any] = {}
        self._charged: set[str] = set()
        self._seq = 0

    # ---- vLLM's RequestQueue interface ------------------------------------------------------------------
    def add_request(self, request: Any) -> None:
        """Queue a new (or re-queued) engine request by the policy."""
        shadow = self._shadows.get(request.request_id)
        if shadow is None:
            shadow = self._shadow(request)
            self._queue.on_live(shadow.tenant, 1, time.monotonic())
        self._engine[request.request_id] = request
        self._queue.push(shadow)

    def prepend_request(self, request: Any) -> None:
        """A request put back (preempted, or skipped this step): it keeps its place by the policy's key."""
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Any]) -> None:
        for request in requests:
            self.add_request(request)

    def peek_request(self) -> Any:
        """Return the next request without removing it. Raises IndexError when empty (as vLLM's do)."""
        shadow = self._queue.peek()
        if shadow is None:
            raise IndexError("peek from an empty queue")
        return self._engine[shadow.request_id]

    def pop_request(self) -> Any:
        """Remove and return the next request, charging its tenant its prompt. Raises IndexError when empty."""
        if not len(self._queue):
            raise IndexError("pop from an empty queue")
        shadow = self._queue.pop()
        if shadow.request_id not in self._charged:
            self._charged.add(shadow.request_id)
            self._queue.on_service(shadow.tenant, shadow.num_prompt, 0)
        return self._engine.pop(shadow.request_id)

    def remove_request(self, request: Any) -> None:
        """Take a queued request out (aborted while waiting)."""
        shadow = self._shadows.get(request.request_id)
        if shadow is not None and request.request_id in self._engine and self._queue.remove(shadow):
            del self._engine[request.request_id]

    def remove_requests(self, requests: Iterable[Any]) -> None:
        for request in requests:
            self.remove_request(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return len(self._queue) > 0

    def __iter__(self) -> Iterator[Any]:
        """The queued requests (in no particular order: vLLM iterates only to inspect or count)."""
        return iter([self._engine[s.request_id] for s in self._queue.live() if s.request_id in self._engine])

    # ---- service ----------------------------------------------------------------------------------------
    def on_output(self, request_id: str, tokens: int) -> None:
        """Charge the tenant of `request_id` for `tokens` sampled output tokens."""
        shadow = self._shadows.get(request_id)
        if shadow is not None and tokens:
            self._queue.on_service(shadow.tenant, 0, tokens)

    def forget(self, request_id: str) -> None:
        """The engine is done with a request (finished or aborted): its tenant has one live request fewer."""
        shadow = self._shadows.pop(request_id, None)
        if shadow is None:
            return
        if request_id in self._engine and self._queue.remove(shadow):  # aborted while queued
            del self._engine[request_id]
        self._charged.discard(request_id)
        self._queue.on_live(shadow.tenant, -1, time.monotonic())

    def _shadow(self, request: Any) -> Request:
        self._seq += 1
        new = NewRequest(request_id=request.request_id, prompt_token_ids=(0,) * int(request.num_prompt_tokens),
                         sampling=SamplingParams(max_tokens=1), tenant=tenant_of(request.request_id),
                         priority=-int(getattr(request, "priority", 0) or 0),
                         arrival_time=float(request.arrival_time))
        shadow = Request(new, self._seq)
        self._shadows[request.request_id] = shadow
        return shadow
