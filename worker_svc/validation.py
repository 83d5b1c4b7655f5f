"""A round plan checked against the worker's own limits before any of it runs.

The scheduler only ever sends plans that fit; anything else reaching the port is a bug or an
attacker. Without these checks a plan with `start_position` 2^31-1 makes an emulated-time cost model
sleep for hours (and a real engine index out of its KV cache), holding the one device lock every
other round waits on. Rules, each refused with INVALID_ARGUMENT naming the field.

Of one sequence (`_check_seq`): that sequence is refused (a `RefusedSeq` in the result) and the rest
of the round runs, so one bad sequence disturbs no other request:

- positions: 0 <= start_position and start_position + len(token_ids) <= max_model_len;
- tokens: every token id (and recent output id) in [0, vocab_size), except the one PENDING_TOKEN of a
  pipelined decode (filled in from the previous round's sample);
- KV: the block table covers the positions it is meant to cover, with device blocks in [0, num_blocks);
- sampling: temperature finite and >= 0, top_p finite, top_k >= 0; penalties, min_p, logit_bias (ids in the
  vocabulary, biases in [-100, 100]) and logprobs (0..MAX_LOGPROBS) in vLLM's ranges.

Of the round as a whole (raised: the round fails):

- swaps: device blocks in [0, num_blocks), host blocks in [0, num_host_blocks);
- identity: a request appears at most once in a round;
- KV slots: the sequences that run compute at most num_blocks * block_size tokens (one KV slot each).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sluice.errors import InvalidArgument
from sluice.types import (
    MAX_LOGPROBS,
    PENDING_TOKEN,
    BackendInfo,
    BlockCopy,
    RefusedSeq,
    RoundPlan,
    SamplingParams,
    ScheduledSeq,
)

_PENDING = (PENDING_TOKEN,)

__all__ = ["validate_plan"]


def validate_plan(plan: RoundPlan, info: BackendInfo) -> tuple[RefusedSeq, ...]:
    """Return the sequences of `plan` that do not fit the worker described by `info` (empty: all fit).

    Raises InvalidArgument naming the field for a fault of the round as a whole (swaps, a request twice,
    more tokens than KV slots in the sequences that run)."""
    _check_swaps("swap_out", plan.swap_out, info.num_blocks, info.num_host_blocks)
    _check_swaps("swap_in", plan.swap_in, info.num_host_blocks, info.num_blocks)
    seen: set[str] = set()
    refused: list[RefusedSeq] = []
    total_tokens = 0
    for index, seq in enumerate(plan.seqs):
        if seq.request_id in seen:
            raise InvalidArgument(f"request {seq.request_id[:64]!r} appears twice in round {plan.round_id}",
                                  field_name=f"seqs[{index}].request_id")
        seen.add(seq.request_id)
        try:
            _check_seq(index, seq, info)
        except InvalidArgument as exc:
            refused.append(RefusedSeq(seq.request_id, exc.field_name, str(exc)))
            continue
        total_tokens += len(seq.token_ids)
    slots = info.num_blocks * info.block_size
    if total_tokens > slots:
        raise InvalidArgument(f"round {plan.round_id} computes {total_tokens} tokens, more than the "
                              f"{slots} KV slots of this worker", field_name="seqs")
    return tuple(refused)


def _check_seq(index: int, seq: ScheduledSeq, info: BackendInfo) -> None:
    name = f"seqs[{index}]"
    end = seq.start_position + len(seq.token_ids)
    if seq.start_position < 0 or end > info.max_model_len:
        raise InvalidArgument(f"{name} covers positions {seq.start_position}..{end}, outside the model's "
                              f"0..{info.max_model_len}", field_name=f"{name}.start_position")
    if seq.token_ids != _PENDING:  # a pipelined decode: the token this worker sampled last round
        _check_ids(f"{name}.token_ids", seq.token_ids, info.vocab_size)
    _check_ids(f"{name}.recent_output_ids", [t for t in seq.recent_output_ids if t != PENDING_TOKEN], info.vocab_size)
    needed = -(-end // info.block_size)
    if len(seq.block_table) < needed:
        raise InvalidArgument(f"{name} needs {needed} blocks for positions up to {end}, its block table has "
                              f"{len(seq.block_table)}", field_name=f"{name}.block_table")
    _check_ids(f"{name}.block_table", seq.block_table[:needed], info.num_blocks, what="device block")
    sampling = seq.sampling
    if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):
        raise InvalidArgument(f"{name}: temperature must be finite and >= 0, got {sampling.temperature}",
                              field_name=f"{name}.sampling.temperature")
    if not math.isfinite(sampling.top_p) or sampling.top_k < 0:
        raise InvalidArgument(f"{name}: top_p must be finite and top_k >= 0, got {sampling.top_p} and "
                              f"{sampling.top_k}", field_name=f"{name}.sampling")
    _check_ids(f"{name}.prompt_token_ids", seq.prompt_token_ids, info.vocab_size)
    _check_penalties(name, sampling, info.vocab_size)


def _check_penalties(name: str, sampling: SamplingParams, vocab_size: int) -> None:
    """Refuse penalties, min_p, logit_bias and logprobs outside vLLM's ranges (admission checks them first)."""
    ranges = (("presence_penalty", sampling.presence_penalty, -2.0, 2.0),
              ("frequency_penalty", sampling.frequency_penalty, -2.0, 2.0),
              ("repetition_penalty", sampling.repetition_penalty, 1e-30, math.inf),
              ("min_p", sampling.min_p, 0.0, 1.0))
    for field, value, low, high in ranges:
        if not (math.isfinite(value) and low <= value <= high):
            raise InvalidArgument(f"{name}: {field} {value} is outside its range", field_name=f"{name}.sampling.{field}")
    if sampling.logit_bias:
        _check_ids(f"{name}.sampling.logit_bias", [t for t, _ in sampling.logit_bias], vocab_size)
        if not all(math.isfinite(b) and -100.0 <= b <= 100.0 for _, b in sampling.logit_bias):
            raise InvalidArgument(f"{name}: a logit_bias value is outside [-100, 100]",
                                  field_name=f"{name}.sampling.logit_bias")
    if sampling.logprobs is not None and not 0 <= sampling.logprobs <= MAX_LOGPROBS:
        raise InvalidArgument(f"{name}: logprobs {sampling.logprobs} is outside 0..{MAX_LOGPROBS}",
                              field_name=f"{name}.sampling.logprobs")


def _check_ids(name: str, ids: Sequence[int], limit: int, what: str = "token id") -> None:
    if ids and (min(ids) < 0 or max(ids) >= limit):
        bad = next(i for i in ids if not 0 <= i < limit)
        raise InvalidArgument(f"{name}: {what} {bad} is outside 0..{limit - 1}", field_name=name)


def _check_swaps(name: str, copies: Sequence[BlockCopy], src_limit: int, dst_limit: int) -> None:
    for index, copy in enumerate(copies):
        if not (0 <= copy.src < src_limit and 0 <= copy.dst < dst_limit):
            raise InvalidArgument(f"{name}[{index}] copies block {copy.src} to {copy.dst}; the limits are "
                                  f"{src_limit} and {dst_limit}", field_name=f"{name}[{index}]")
