"""The runtime's round helpers, off its hot class: pending-token fill-in, the warm-up plan, emulated time, and
the metric label of a refused field."""

from __future__ import annotations

import time

from sluice.slots import slot_constructor
from sluice.types import PENDING_TOKEN, BackendInfo, RoundPlan, SamplingParams, ScheduledSeq, SeqOutput

__all__ = ["PENDING", "field_kind", "filled", "wait_until", "warmup_plan"]

PENDING = (PENDING_TOKEN,)
"""The token_ids of a pipelined decode: the token this worker sampled for the request in the round before."""
_new_seq = slot_constructor(ScheduledSeq)


def wait_until(deadline: float, spin_s: float = 0.00025) -> None:
    """Block the backend thread until `deadline` (perf_counter): sleep, then spin the last `spin_s`.

    Why: an emulated round must take its modelled time and no more; asyncio.sleep and a plain sleep
    overshoot by up to milliseconds on a busy host, which read as control-plane time. The spin costs CPU
    the rest of the stack shares (1 ms of it was a quarter of the worker's CPU per round at batch 1);
    0.25 ms covers a plain sleep's usual overshoot (p50 85 us, p90 107 us on the shared 2-core VM)."""
    remaining = deadline - time.perf_counter()
    if remaining > spin_s:
        time.sleep(remaining - spin_s)
    while time.perf_counter() < deadline:
        time.sleep(0)  # lets the event loop thread have the GIL while this one spins


def field_kind(field_name: str) -> str:
    """Return a refused field's name without the sequence's index ("seqs[3].token_ids" -> "token_ids"): a
    metric label of a few values."""
    return field_name.split(".", 1)[-1]


def filled(seq: ScheduledSeq, sampled: dict[str, SeqOutput]) -> ScheduledSeq:
    """Return `seq` with its pending token replaced by the token sampled for it in the round before.
    Raises LookupError when that round sampled none for the request's epoch."""
    out = sampled.get(seq.request_id)
    if out is None or out.epoch != seq.epoch or not out.token_ids:
        raise LookupError(f"request {seq.request_id}: a pending token, but the round before sampled none for "
                          f"epoch {seq.epoch}")
    return _new_seq(seq.request_id, seq.epoch, out.token_ids[-1:], seq.start_position, seq.block_table,
                    seq.sampling, seq.sample, seq.output_index, seq.recent_output_ids,
                    seq.prompt_token_ids)


def warmup_plan(info: BackendInfo) -> RoundPlan:
    """A one-sequence prefill of a few tokens in block 0 that samples one token (block 0 is rewritten later)."""
    n = max(1, min(4, info.block_size, info.max_model_len - 1))
    tokens = tuple(1 + (i % max(1, info.vocab_size - 1)) for i in range(n))
    seq = ScheduledSeq(request_id="__warmup__", epoch=0, token_ids=tokens, start_position=0, block_table=(0,),
                       sampling=SamplingParams(max_tokens=1), sample=True, output_index=0)
    return RoundPlan(round_id=0, seqs=(seq,))
