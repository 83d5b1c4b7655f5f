"""The scheduler's WorkerLink against a real worker server on loopback that goes away between rounds."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from scheduler_svc.worker_link import RoundLinkTarget, WorkerLink
from sluice.prom import SchedulerMetrics
from sluice.types import RoundPlan, SamplingParams, ScheduledSeq
from sluice.v1 import worker_pb2_grpc
from worker_svc.costmodel import CostModel
from worker_svc.server import WorkerRuntime, start_worker_server


def _plan(round_id: int) -> RoundPlan:
    return RoundPlan(round_id, (ScheduledSeq("r", 0, (10,), 5, (0,), SamplingParams(max_tokens=8), True, 1),))


@pytest.mark.parametrize("kind", ["grpc_stream", "round_link"])
def test_a_plan_sent_after_the_worker_ended_the_stream_is_a_lost_round_not_a_crash(kind: str) -> None:
    """The worker stops after answering round 1, so the round stream is over before round 2 is written (grpc.aio
    raises InvalidStateError, not an RPC error, on that write; the round link a ConnectionError): `send` reports the
    round lost (False), calls `sent()` once and drops the stream, so the loop re-queues the round instead of dying
    with the error."""
    async def body() -> None:
        worker = await start_worker_server(WorkerRuntime(lambda: CostModel("llama-3-8b", "h200")))
        await asyncio.wait_for(worker.loading, 30)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")
        metrics = SchedulerMetrics()
        target = RoundLinkTarget.of(f"127.0.0.1:{worker.port}", worker.round_link.port) if (
            kind == "round_link" and worker.round_link is not None) else None
        link = WorkerLink(worker_pb2_grpc.WorkerServiceStub(channel), metrics=metrics, round_link=target)
        calls: list[int] = []
        assert await link.send(_plan(1), lambda: calls.append(1))
        result = await link.receive(1)
        assert result is not None and result.round_id == 1 and not result.error
        assert metrics.worker_link.labels(kind)._value.get() == 1, "the link in use is the one asked for"
        stream = link._stream  # the stream the next plan is written on
        assert stream is not None

        def ended() -> bool:
            assert stream is not None
            return stream.call.done() if kind == "grpc_stream" else stream.stream.error is not None  # type: ignore

        await worker.stop()
        for _ in range(500):
            if ended():
                break
            await asyncio.sleep(0.01)
        assert ended(), "the worker's stop ends the round stream"
        assert await link.send(_plan(2), lambda: calls.append(2)) is False
        assert calls == [1, 2] and link._stream is None
        await channel.close()

    asyncio.run(body())
