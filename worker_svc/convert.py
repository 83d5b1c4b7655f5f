"""Wire <-> core conversions of the worker: round plans and results, sampling parameters, worker info.

Both directions live here because the scheduler (the worker's client) uses the inverse ones;
one way to convert each type.
"""

from __future__ import annotations

from scheduler_svc.core.types import (
    BlockCopy,
    RoundPlan,
    RoundResult,
    SamplingParams,
    ScheduledSeq,
    SeqOutput,
)
from sluice.v1 import common_pb2, worker_pb2
from worker_svc.backend import BackendInfo

__all__ = [
    "info_from_proto", "info_to_proto", "plan_from_proto", "plan_to_proto", "result_from_proto",
    "result_to_proto", "sampling_from_proto", "sampling_to_proto",
]


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Return the core SamplingParams of a wire message (top_p 0 is read as 1.0, an unset seed as None)."""
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.top_p > 0 else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        stop_strings=tuple(msg.stop_strings),
        ignore_eos=msg.ignore_eos,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Return the wire form of core SamplingParams."""
    msg = common_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        max_tokens=params.max_tokens, stop_token_ids=params.stop_token_ids,
        stop_strings=params.stop_strings, ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def plan_from_proto(msg: worker_pb2.RoundPlan) -> RoundPlan:
    """Return the core RoundPlan of a wire plan (the budget is not on the wire: None)."""
    cache: dict[bytes, SamplingParams] = {}
    seqs = []
    for s in msg.seqs:
        # Many seqs of one batch share sampling settings; parse each distinct one once.
        key = s.sampling.SerializeToString()
        sampling = cache.get(key)
        if sampling is None:
            sampling = cache[key] = sampling_from_proto(s.sampling)
        seqs.append(ScheduledSeq(
            request_id=s.request_id, epoch=s.epoch, token_ids=tuple(s.token_ids),
            start_position=s.start_position, block_table=tuple(s.block_table), sampling=sampling,
            sample=s.sample, output_index=s.output_index, recent_output_ids=tuple(s.recent_output_ids),
        ))
    return RoundPlan(
        round_id=msg.round_id, seqs=tuple(seqs),
        swap_out=tuple(BlockCopy(c.src, c.dst) for c in msg.swap_out),
        swap_in=tuple(BlockCopy(c.src, c.dst) for c in msg.swap_in),
    )


def plan_to_proto(plan: RoundPlan) -> worker_pb2.RoundPlan:
    """Return the wire form of a core RoundPlan (its budget is local to the scheduler and not sent)."""
    # Requests of a batch mostly share equal (frozen, hashable) sampling settings: convert each once.
    cache: dict[SamplingParams, common_pb2.SamplingParams] = {}
    seqs = []
    for s in plan.seqs:
        sampling = cache.get(s.sampling)
        if sampling is None:
            sampling = cache[s.sampling] = sampling_to_proto(s.sampling)
        seqs.append(worker_pb2.ScheduledSeq(
            request_id=s.request_id, epoch=s.epoch, token_ids=s.token_ids, start_position=s.start_position,
            block_table=s.block_table, sampling=sampling, sample=s.sample, output_index=s.output_index,
            recent_output_ids=s.recent_output_ids,
        ))
    return worker_pb2.RoundPlan(
        round_id=plan.round_id, seqs=seqs,
        swap_out=[worker_pb2.BlockCopy(src=c.src, dst=c.dst) for c in plan.swap_out],
        swap_in=[worker_pb2.BlockCopy(src=c.src, dst=c.dst) for c in plan.swap_in],
    )


def result_to_proto(result: RoundResult) -> worker_pb2.RoundResult:
    """Return the wire form of a core RoundResult."""
    return worker_pb2.RoundResult(
        round_id=result.round_id,
        outputs=[worker_pb2.SeqOutput(request_id=o.request_id, epoch=o.epoch, token_ids=o.token_ids,
                                      stop_string_hit=o.stop_string_hit) for o in result.outputs],
        elapsed_s=result.elapsed_s, error=result.error,
    )


def result_from_proto(msg: worker_pb2.RoundResult) -> RoundResult:
    """Return the core RoundResult of a wire result."""
    return RoundResult(
        round_id=msg.round_id,
        outputs=tuple(SeqOutput(o.request_id, o.epoch, tuple(o.token_ids), o.stop_string_hit)
                      for o in msg.outputs),
        elapsed_s=msg.elapsed_s, error=msg.error,
    )


def info_to_proto(info: BackendInfo) -> worker_pb2.WorkerInfo:
    """Return the wire WorkerInfo of a backend's info."""
    return worker_pb2.WorkerInfo(
        model_id=info.model_id, model_version=info.model_version, block_size=info.block_size,
        num_blocks=info.num_blocks, num_host_blocks=info.num_host_blocks, dtype=info.dtype,
        device=info.device, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
        eos_token_id=info.eos_token_id, backend=info.backend,
    )


def info_from_proto(msg: worker_pb2.WorkerInfo) -> BackendInfo:
    """Return the BackendInfo carried by a wire WorkerInfo."""
    return BackendInfo(
        model_id=msg.model_id, model_version=msg.model_version, block_size=msg.block_size,
        num_blocks=msg.num_blocks, num_host_blocks=msg.num_host_blocks, dtype=msg.dtype, device=msg.device,
        max_model_len=msg.max_model_len, vocab_size=msg.vocab_size, eos_token_id=msg.eos_token_id,
        backend=msg.backend,
    )
