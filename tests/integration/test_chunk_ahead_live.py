"""Prefill chunks placed ahead, live: the real core drives the torch worker over ExecuteStream, two rounds in flight.

A chunk placed ahead carries its real token ids and reads the KV that the round before it writes; the worker runs
rounds in order, so the greedy tokens must be the full-recompute reference's.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from scheduler_svc.core import SchedulerCore
from scheduler_svc.core.config import SchedulerConfig
from sluice import convert
from sluice.types import PENDING_TOKEN, NewRequest, RoundPlan, SamplingParams
from sluice.v1 import worker_pb2_grpc
from worker_svc.server import WorkerRuntime, start_worker_server

PROMPTS = [list(b"Shared system prompt: alpha"), list(b"Shared system prompt: bravo!"), list(b"short")]
MAX_TOKENS = 6


def test_chunks_placed_ahead_give_the_reference_tokens_on_the_torch_worker(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With 8-token chunks and round N+1 written to ExecuteStream before N answers, long prompts get their next chunk
    placed ahead (real tokens) and every request still gets the full-recompute reference's greedy tokens."""
    torch_backend = pytest.importorskip("worker_svc.torch_backend")
    from worker_svc.engine.manual import reference_greedy
    from worker_svc.models import resolve_model

    model_dir = resolve_model("tiny", home=tmp_path)
    backend = torch_backend.TorchBackend(model_dir, device="cpu", dtype="float32", block_size=4, num_blocks=64)
    core = SchedulerCore(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=24, max_prefill_chunk=8,
                                         enable_prefix_caching=True))
    for i, prompt in enumerate(PROMPTS):
        core.submit(NewRequest(f"r{i}", tuple(prompt), SamplingParams(max_tokens=MAX_TOKENS), eos_token_id=None), 0.0)

    async def body() -> tuple[dict[str, list[int]], int]:
        worker = await start_worker_server(WorkerRuntime(lambda: backend))
        await asyncio.wait_for(worker.loading, 60)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")
        call = worker_pb2_grpc.WorkerServiceStub(channel).ExecuteStream()
        outputs: dict[str, list[int]] = {}
        chunks_ahead, in_flight = 0, []

        async def send(plan: RoundPlan) -> None:
            nonlocal chunks_ahead
            earlier = {s.request_id for p in in_flight for s in p.seqs}
            chunks_ahead += sum(1 for s in plan.seqs if s.request_id in earlier and s.token_ids != (PENDING_TOKEN,))
            in_flight.append(plan)
            await call.write(convert.plan_to_proto(plan))

        await send(core.schedule(0.0, overlap=True))
        while in_flight:
            ahead = core.schedule(0.0, overlap=True)
            if not ahead.is_empty:
                await send(ahead)
            result = convert.result_from_proto(await call.read())
            assert result.round_id == in_flight.pop(0).round_id and not result.error, result.error
            for rid, _, token in core.on_round_result(result, 0.0).tokens:
                outputs.setdefault(rid, []).append(token)
            if not in_flight:
                plan = core.schedule(0.0, overlap=True)
                if not plan.is_empty:
                    await send(plan)
        await call.done_writing()
        await channel.close()
        await worker.stop()
        return outputs, chunks_ahead

    outputs, chunks_ahead = asyncio.run(body())
    assert chunks_ahead >= 4, "the long prompts' chunks were placed ahead"
    assert not core.has_unfinished() and core.stats().kv_blocks_used == 0
    reference = torch_backend.TorchBackend(model_dir, device="cpu", dtype="float32", num_blocks=8)
    for i, prompt in enumerate(PROMPTS):
        expected = reference_greedy(reference.model, prompt, MAX_TOKENS, reference.sampling_vocab)
        assert outputs[f"r{i}"] == expected, f"r{i}"
