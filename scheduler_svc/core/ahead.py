"""Overlap scheduling: placing a running request ahead, in the round planned while its round executes.

The batcher inlines the common case (a decode in flight); `place_ahead` is the general one (a prefill
chunk in flight that reaches the last known token). A prefill chunk in flight that does not reach it is
followed by the next chunk of known tokens (`chunk_ahead`), so a long prompt advances a chunk every
round. See docs/scheduler-core.md, "Overlap scheduling".
"""

from __future__ import annotations

from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.request import Request
from scheduler_svc.core.round import InFlightRound, RoundBuilder, chunk_tokens, new_scheduled_seq
from sluice.types import PENDING_TOKEN, RequestStatus

PENDING = (PENDING_TOKEN,)
"""The token ids of a sequence placed ahead: the one its in-flight round will sample."""


def place_ahead(request: Request, rnd: RoundBuilder, in_flight: dict[int, InFlightRound], pool: BlockPool,
            block_size: int) -> bool:
    """Place a decode of the token that `request`'s in-flight round samples; return whether it was placed.

    Only a running request whose one in-flight round samples its last known token, with no stop
    strings (the worker needs the output tail) and not at its last token, is placed ahead; its block
    for the new position comes from the pool without preempting anyone (else it waits a round).
    Its KV read budget is taken from `rnd.kv_left`; the caller counts the token and the sequence.
    """
    if request.status is not RequestStatus.RUNNING or request.stop_tail:
        return False
    start = len(request.tokens)
    if start + 1 - request.num_prompt >= request.max_tokens or rnd.kv_left <= start:
        return False
    record = in_flight.get(request.in_flight_round)  # type: ignore[arg-type]
    if record is None:
        return False
    num, sample = record.entry(request)
    if not sample or request.num_computed + num != start:
        return False
    if len(request.block_ids) * block_size <= start:
        blocks = pool.allocate(1)
        if blocks is None:
            return False
        request.block_ids.extend(blocks)
        request.block_table += tuple(blocks)  # not tuple(block_ids): see Batcher._grow
    rnd.seqs.append(new_scheduled_seq(request.request_id, request.epoch, PENDING, start,
                                      request.block_table, request.sampling, True,
                                      start + 1 - request.num_prompt, (), ()))
    rnd.entries.append(request)
    request.in_flight_prev = request.in_flight_round
    request.in_flight_round = rnd.round_id
    rnd.kv_left -= start + 1
    return True


def chunk_ahead(request: Request, rnd: RoundBuilder, in_flight: dict[int, InFlightRound], pool: BlockPool,
                config: SchedulerConfig, reserve: int) -> tuple[int, int] | None:
    """Return (start, tokens) of the prefill chunk to place ahead of `request`'s in-flight chunk, or None.

    Only a running request whose one in-flight round computes a chunk that does not sample (its
    prompt tokens after it are known) gets one: the next chunk, sized as the batcher sizes a chunk
    (`round.chunk_tokens`, with `reserve` tokens kept for the running requests after it). Its blocks come
    from the pool without preempting anyone (else it waits a round); the caller places it (`Batcher._place`).
    """
    if request.status is not RequestStatus.RUNNING:
        return None
    record = in_flight.get(request.in_flight_round)  # type: ignore[arg-type]
    if record is None:
        return None
    num, sample = record.entry(request)
    if sample:
        return None
    start = request.num_computed + num
    num = chunk_tokens(config, rnd, start, len(request.tokens) - start, reserve)
    if num <= 0:
        return None
    need = -(-(start + num) // config.block_size) - len(request.block_ids)
    if need > 0:
        blocks = pool.allocate(need)
        if blocks is None:
            return None
        request.block_ids.extend(blocks)
        request.block_table += tuple(blocks)  # not tuple(block_ids): see Batcher._grow
    return start, num
