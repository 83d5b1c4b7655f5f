"""SchedulerCore: one replica's sans-I/O scheduler, composed of parts.

  requests   RequestTable   live requests by id and place, statuses of ended ones (table.py)
  backlog    Backlog        the waiting queue (a policy) and the pending-prefill ledger (backlog.py)
  deadlines  DeadlineHeap   queue and total deadlines (deadlines.py)
  pool       BlockPool      device KV blocks, prefix cache, KV events (block_pool.py)
  host       HostBlocks     host blocks for swap-mode preemption (host_blocks.py)
  outbox     Outbox         events since the last take and the counters (outbox.py)
  endings    Endings        cancel, timeout, finish and failure, each exactly once (endings.py)
  outcomes   RoundOutcomes  in-flight rounds and what their results or losses do (outcomes.py)
  batcher    Batcher        builds each round; its victim rule picks whom to preempt (batcher.py, victims.py)

The round builder and the outcome keeper get the parts they share as one `CoreParts` (parts.py).
The core owns the parts, checks submissions, and is the one API the services and the simulator
call: `submit`, `schedule`, `on_round_result`, `on_round_lost`, `on_worker_restarted`, `cancel`,
`expire`, `next_deadline`, `take_events`, `stats`. Time is always an argument.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from scheduler_svc.core import bulk
from scheduler_svc.core.backlog import Backlog
from scheduler_svc.core.batcher import Batcher
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.deadlines import QUEUE_DEADLINE, TOTAL_DEADLINE, DeadlineHeap
from scheduler_svc.core.endings import Endings
from scheduler_svc.core.handoffs import HandOffs
from scheduler_svc.core.host_blocks import HostBlocks
from scheduler_svc.core.outbox import Outbox
from scheduler_svc.core.outcomes import RoundOutcomes
from scheduler_svc.core.parts import CoreParts
from scheduler_svc.core.policies import make_queue
from scheduler_svc.core.request import Request, block_hashes_upto
from scheduler_svc.core.retype import retyping_constructor
from scheduler_svc.core.table import RequestTable
from sluice.core_errors import RequestRejected
from sluice.hashing import salt_of
from sluice.types import (
    CoreEvents,
    CoreStats,
    NewRequest,
    RejectReason,
    RequestStatus,
    RoundPlan,
    RoundResult,
    Stage,
)

# Built once per round (events) and per heartbeat or sample (stats): see retype.py.
_new_core_events = retyping_constructor(CoreEvents)
_new_core_stats = retyping_constructor(CoreStats)


class SchedulerCore:
    """The scheduler of one replica: requests in, round plans and events out. Time is an argument."""

    def __init__(self, config: SchedulerConfig, replica_id: str = "r0") -> None:
        if config.block_size < 1 or config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("block_size, max_num_batched_tokens and max_num_seqs must be >= 1")
        if config.max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be >= 1, got {config.max_prefill_chunk}")
        if config.attention_pairs_per_token is not None and config.attention_pairs_per_token < 1:
            raise ValueError(f"attention_pairs_per_token must be >= 1 or None, got {config.attention_pairs_per_token}")
        if config.host_page_out_blocks < 0 or config.host_load_blocks < 0:
            raise ValueError(f"host_page_out_blocks and host_load_blocks must be >= 0, got "
                             f"{config.host_page_out_blocks} and {config.host_load_blocks}")
        if config.host_prefix_cache and (config.num_host_blocks < 1 or not config.enable_prefix_caching):
            raise ValueError(f"host_prefix_cache needs num_host_blocks >= 1 (got {config.num_host_blocks}) and "
                             f"enable_prefix_caching (got {config.enable_prefix_caching})")
        if config.attention_free_context < 0:
            raise ValueError(f"attention_free_context must be >= 0, got {config.attention_free_context}")
        self.config = config
        self.replica_id = replica_id
        self._block_size = config.block_size
        self._salt = salt_of(config.model_id, config.adapter_version)
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self.requests = RequestTable()
        self.backlog = Backlog(make_queue(config.policy, config))
        self.deadlines = DeadlineHeap(self.requests)
        self.host = HostBlocks(config.num_host_blocks, self.pool, config.host_prefix_cache)
        self.outbox = Outbox()
        self.handoffs = HandOffs(self.pool, config.kv_hold_s, config.block_size)
        self.endings = Endings(self.requests, self.backlog, self.pool, self.host, self.outbox, self.deadlines,
                               self.handoffs)
        parts = CoreParts(config, self.requests, self.backlog, self.pool, self.host, self.outbox, self.endings)
        self.outcomes = RoundOutcomes(parts)
        self.batcher = Batcher(parts, self.outcomes)

    # ---- submission ------------------------------------------------------------------------
    def submit(self, request: NewRequest, now: float, prompt_hashes: Sequence[int] = (), hashes_salt: int = 0) -> None:
        """Queue a new request. Raises RequestRejected (and changes nothing) when it is refused.

        `prompt_hashes`: the block-hash chain of the prompt's full blocks (`sluice.hashing.hash_chain` of the
        prompt with this core's block size and the salt `hashes_salt`), when the caller computed it already
        for routing (the simulator does): used instead of hashing the prompt again when `hashes_salt` is the
        request's own salt, else ignored. Trusted: a wrong chain makes wrong prefix-cache hits.
        """
        self._check_admissible(request)
        try:
            live = Request(request, self.requests.next_arrival_seq())
        except (OverflowError, TypeError) as error:
            raise RequestRejected(
                request.request_id, RejectReason.INVALID, f"token ids must be 64-bit integers: {error}"
            ) from None
        live.salt = (salt_of(self.config.model_id, self.config.adapter_version, request.cache_salt)
                     if request.cache_salt else self._salt)
        if prompt_hashes and hashes_salt == live.salt and self.pool.caching:
            # Exactly the blocks the cache lookup below would hash, so the chain is what hashing gives.
            live.block_hashes.extend(prompt_hashes[: (len(live.tokens) - 1) // self._block_size])
        self.requests.add(live)
        if request.hold_kv:
            self.handoffs.want(live.request_id)
        if self.backlog.account is not None:
            self.backlog.queue.on_live(live.tenant, 1, now)
            if request.tenant_weight is not None:
                self.backlog.queue.set_tenant_weight(live.tenant, request.tenant_weight)
        self.backlog.enqueue(live, self._cached_prefix_tokens(live))
        if request.queue_deadline is not None:
            self.deadlines.push(request.queue_deadline, QUEUE_DEADLINE, live)
        if request.deadline is not None:
            self.deadlines.push(request.deadline, TOTAL_DEADLINE, live)
        self.outbox.event(live, Stage.ENQUEUED, now)

    def _check_admissible(self, request: NewRequest) -> None:
        config = self.config
        if request.tenant_weight is not None and not (request.tenant_weight > 0 and math.isfinite(request.tenant_weight)):
            raise RequestRejected(request.request_id, RejectReason.INVALID,
                                  f"tenant_weight must be a positive finite number, got {request.tenant_weight}")
        rid = request.request_id

        def reject(reason: RejectReason, detail: str) -> RequestRejected:
            return RequestRejected(rid, reason, detail)

        if rid in self.requests.live:
            raise reject(RejectReason.DUPLICATE, "a live request already has this id")
        prompt_len, max_tokens = len(request.prompt_token_ids), request.sampling.max_tokens
        if prompt_len == 0:
            raise reject(RejectReason.INVALID, "empty prompt")
        if max_tokens < 1:
            raise reject(RejectReason.INVALID, f"max_tokens must be >= 1, got {max_tokens}")
        total = prompt_len + max_tokens
        if total > config.max_model_len:
            raise reject(
                RejectReason.INVALID,
                f"prompt {prompt_len} + max_tokens {max_tokens} = {total} > max_model_len {config.max_model_len}",
            )
        blocks = -(-total // config.block_size)
        if blocks > config.num_blocks:
            raise reject(
                RejectReason.NEVER_FITS,
                f"prompt {prompt_len} + max_tokens {max_tokens} needs {blocks} blocks of "
                f"{config.block_size} tokens, the replica has {config.num_blocks}",
            )
        if config.max_kv_read_tokens is not None and total > config.max_kv_read_tokens:
            raise reject(
                RejectReason.NEVER_FITS,
                f"prompt {prompt_len} + max_tokens {max_tokens} = {total} > max_kv_read_tokens "
                f"{config.max_kv_read_tokens}: its decodes could never run",
            )
        # A preemption sends a running (or swapped-out) request back to the queue without asking, so the
        # bound counts them as well: the queue then never holds more than max_waiting, whatever is preempted.
        table = self.requests
        claims = len(self.backlog) + len(table.running) + len(table.swapping)
        if claims >= config.max_waiting:
            raise reject(RejectReason.QUEUE_FULL, f"{len(self.backlog)} waiting + {claims - len(self.backlog)} "
                         f"that a preemption may requeue, max_waiting {config.max_waiting}")

    def _cached_prefix_tokens(self, request: Request) -> int:
        """Return the prompt tokens the prefix cache holds now (an estimate until it is admitted).

        Why: the pending prefill a replica reports should not count work its cache already did;
        the hashes are kept on the request, so admission does not compute them again.
        """
        if not self.pool.caching:
            return 0
        size = self._block_size
        hashes = block_hashes_upto(request, (len(request.tokens) - 1) // size, size, request.salt)
        found = len(self.pool.lookup(hashes))
        if self.host.prefix_cache and found < len(hashes):
            found += len(self.host.lookup(hashes[found:]))
        return found * size

    # ---- the step cycle --------------------------------------------------------------------
    def schedule(self, now: float, overlap: bool = False) -> RoundPlan:
        """Build the next round; return its plan (possibly empty: `plan.is_empty`).

        Requests in a round that is still in flight are skipped. With `overlap` (the round is planned
        while the previous one executes), a running request whose in-flight round samples its last
        known token is placed once more, ahead: a decode of `PENDING_TOKEN` (the worker fills in the
        token it sampled for it), as if that round produced exactly one token; if it produces a stop
        instead, the request ends at once and the later round's output for it is dropped. At most two
        rounds read a request. A non-empty plan must be answered with `on_round_result` carrying its
        `round_id`; with overlap, in plan order.
        """
        return self.batcher.schedule(now, overlap)

    def on_round_result(self, result: RoundResult, now: float) -> CoreEvents:
        """Apply a worker's result for a planned round and return the drained outbox.

        Outputs for unknown rounds, requests that are gone or cancelling, or older epochs are
        dropped and counted (`dropped_results`); they never resurrect a request.
        """
        self.outcomes.on_round_result(result, now)
        return self.take_events()

    def on_round_lost(self, round_id: int, now: float) -> CoreEvents:
        """The worker went away with round `round_id` in flight; return the drained outbox.

        Nothing of that round is known to have been computed and the worker's KV is gone, so each
        running request of the round is preempted by recompute (PREEMPTED with mode "recompute" and
        cause "worker_lost") and waits again in its place; cancelling ones are released; swap copies
        of the round count as not done. The rest of the worker's KV is gone too: running requests
        outside any in-flight round are recomputed as well, and swapped-out waiting requests drop
        their host copies. A request lost in more than `max_lost_rounds` consecutive
        rounds fails instead, so a plan that kills the worker cannot loop forever. A late result
        for the round is dropped (unknown round, older epoch). An unknown round changes nothing.
        """
        if round_id in self.outcomes.in_flight:
            self.handoffs.release_all()  # the worker's KV is gone: no held prompt is there any more
        self.outcomes.on_round_lost(round_id, now)
        return self.take_events()

    def on_worker_restarted(self, now: float) -> CoreEvents:
        """The worker is back empty (restarted); return the drained outbox.

        Running requests that no in-flight round reads are recomputed (PREEMPTED, cause
        "worker_lost"), swapped-out waiting requests drop their host copies, and the prefix cache
        forgets every hash (ALL_CLEARED; only free cached blocks are released). After
        `on_round_lost` this is only the cache reset; it matters when the worker was found dead
        between rounds, with no round lost.
        """
        self.outcomes.forget_worker_kv(now)
        self.handoffs.release_all()  # a held prompt's KV went with the worker
        self.pool.reset_cache()
        self.host.forget_hashes()
        return self.take_events()

    # ---- steady decode runs in bulk (bulk.py) -----------------------------------------------
    def steady_decodes(self, min_cycles: int = 1, max_cycles: int = 1 << 62) -> tuple[list[Request], int] | None:
        """Return (running requests in plan order, cycles `advance_decodes` may take, at most `max_cycles`)
        when the next rounds are steady pipelined decodes and at least `min_cycles` can go in bulk, else None.

        Steady: two rounds in flight, both plain decodes of every running request, nothing queued,
        swapping or waiting in the outbox (see bulk.py). A cycle stops being steady at a first or last
        token, the KV read cap, or a block the free list cannot give without an eviction.
        """
        return bulk.steady_decodes(self, min_cycles, max_cycles)

    def decode_run_limit(self, running: list[Request]) -> int:
        """Return how many steady cycles `advance_decodes` may apply for `running` (0 when not steady)."""
        return bulk.decode_run_limit(self, running)

    def advance_decodes(self, running: list[Request], tokens: list[list[int]], token_events: bool = True) -> tuple[
            CoreEvents, RoundPlan | None, RoundPlan, list[tuple[int, int]]]:
        """Apply k steady cycles at once, exactly as k `on_round_result` + `schedule(now, overlap=True)` pairs.

        `running` is `steady_decodes()[0]`; `tokens[i]` holds request i's next k sampled tokens (the
        older in-flight round's token first). Returns what the k results' drained outboxes would have
        held, concatenated (token events; STORED and REMOVED events, in order); the plans of the two
        rounds left in flight (the older one None when k == 1: it is the plan the caller already
        holds); the pool's (free, cached) blocks after each cycle. The last placements ahead leave
        their evictions in the pool, as `schedule` does. Raises ValueError, changing nothing, past
        `decode_run_limit`. `token_events=False` leaves the token events out (the caller has the tokens).
        """
        return bulk.advance_decodes(self, running, tokens, token_events)

    # ---- terminations ----------------------------------------------------------------------
    def cancel(self, request_id: str, now: float, detail: str = "") -> RequestStatus | None:
        """Cancel a request and return its status afterwards (None for an unknown id).

        Waiting or idle requests end at once; one read by an in-flight round is CANCELLING
        until that round's result arrives. Cancelling again, or a finished request, changes nothing.
        `detail` goes into its Finished record.
        """
        return self.endings.cancel(request_id, now, detail)

    def expire(self, now: float) -> list[str]:
        """Time out every request whose queue or total deadline is <= now and end the KV holds past their expiry
        (`handoffs.py`); return the ids of the requests timed out."""
        if self.handoffs.held_blocks:
            self.handoffs.expire(now)
        return self.endings.expire(now)

    def next_deadline(self) -> float | None:
        """Return the earliest pending queue or total deadline or KV hold expiry, or None when there is none."""
        deadline = self.deadlines.next()
        if not self.handoffs.held_blocks:
            return deadline
        expiry = self.handoffs.next_expiry()
        return expiry if deadline is None or (expiry is not None and expiry < deadline) else deadline

    # ---- prefill/decode hand-offs (handoffs.py) ----------------------------------------------
    def held_kv(self, request_id: str) -> tuple[int, ...] | None:
        """Return the full prompt blocks a finished prefill request holds for its decode replica, or None."""
        held = self.handoffs.held(request_id)
        return None if held is None else held.block_ids

    def release_held_kv(self, request_id: str) -> int:
        """End a prefill request's hold (its decode replica has the blocks, or gave up); return the blocks
        unpinned (0: nothing was held)."""
        return self.handoffs.release(request_id)

    # ---- views -----------------------------------------------------------------------------
    def take_events(self) -> CoreEvents:
        """Return everything that happened since the last call and start a new outbox."""
        outbox = self.outbox
        # Outbox.take's two lines, inlined: this runs once per round.
        events, outbox.events = outbox.events, _new_core_events([], [], [], [], 0, {})
        if self.pool.has_events:
            events.kv_events.extend(self.pool.take_events())
        return events

    def stats(self) -> CoreStats:
        """Return counters and ledger sizes (O(1))."""
        pool, outbox, requests, host = self.pool, self.outbox, self.requests, self.host
        ended = requests.ended_counts
        free, cached = pool.num_free, pool.num_cached
        return _new_core_stats(
            len(self.backlog),
            len(requests.running),
            pool.num_blocks,
            pool.num_blocks - free - cached,
            free,
            cached,
            host.total,
            host.num_used,
            outbox.preemptions,
            outbox.recomputed_tokens,
            outbox.dropped_total,
            outbox.rounds,
            self.backlog.queued_prefill_tokens,
            ended.get(RequestStatus.FINISHED_STOP, 0) + ended.get(RequestStatus.FINISHED_LENGTH, 0),
            ended.get(RequestStatus.CANCELLED, 0),
            ended.get(RequestStatus.TIMED_OUT, 0),
            outbox.prefix_hit_tokens,
            outbox.prefix_query_tokens,
            outbox.host_hit_tokens,
            host.num_cached,
        )

    def kv_snapshot(self) -> tuple[int, tuple[int, ...]]:
        """Return (last KV event id, hashes of every cached or stored block)."""
        return self.pool.last_event_id, self.pool.cached_hashes()

    def host_hashes(self) -> tuple[int, ...]:
        """Return the hashes the host prefix tier holds (reported STORED on CPU), as of `kv_snapshot`'s event id."""
        return self.host.cached_hashes()

    def has_unfinished(self) -> bool:
        """Return True while any request is not terminal."""
        return bool(self.requests.live)

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue (new and preempted)."""
        return len(self.backlog)

    @property
    def num_running(self) -> int:
        """Requests holding device blocks and taking part in rounds."""
        return len(self.requests.running)

    def request_status(self, request_id: str) -> RequestStatus | None:
        """Return a request's status, or None for an id the core does not know (or has forgotten)."""
        return self.requests.status(request_id)
