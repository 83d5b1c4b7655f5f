"""The backlog: the waiting queue (a policy) plus the replica's pending prefill tokens.

Each live request carries `pending_prefill`, the prefill tokens it still adds to the replica's
reported load; the backlog keeps their sum in one counter moved by each request's delta, so
stats() stays O(1). A request waiting in the queue counts what is not computed (less what the
prefix cache held at submission); a running one counts the unscheduled rest of its prompt.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler_svc.core.policies import WaitingQueue
from scheduler_svc.core.request import Request


class Backlog:
    """The waiting queue and the pending-prefill ledger of one replica."""

    __slots__ = ("queue", "account", "queued_prefill_tokens")

    def __init__(self, queue: WaitingQueue) -> None:
        self.queue = queue
        self.account: Callable[[str, int, int], None] | None = queue.on_service if queue.tracks_service else None
        """`queue.on_service` when the policy charges served tokens (fair share), else None."""
        self.queued_prefill_tokens = 0

    def __len__(self) -> int:
        return len(self.queue)

    def enqueue(self, request: Request, cached_tokens: int = 0) -> None:
        """Queue `request`; its pending prefill is what is not computed, less `cached_tokens`."""
        # Pending first: a queue may order by it (SRPF).
        self.set_pending(request, len(request.tokens) - request.num_computed - cached_tokens)
        self.queue.push(request)

    def dequeue(self, request: Request, served: bool = False) -> None:
        """Take `request` out of the queue; `served` when it is the head being scheduled.

        A served request keeps its pending prefill: it is work this replica still has to do,
        and the round builder takes it off chunk by chunk.
        """
        if served:
            head = self.queue.pop()
            assert head is request, "only the head of the queue is scheduled"
        else:
            self.queue.remove(request)
            self.set_pending(request, 0)

    def set_pending(self, request: Request, tokens: int) -> None:
        """Set `request`'s pending prefill to `tokens`, moving the replica's counter by the delta."""
        self.queued_prefill_tokens += tokens - request.pending_prefill
        request.pending_prefill = tokens
