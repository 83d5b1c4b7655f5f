"""The round link between a real worker server and the scheduler's WorkerLink on loopback: bad peers on either end,
mutual TLS, a link that cannot be opened, and the rounds of a closed link."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from pathlib import Path

import grpc
import pytest

from scheduler_svc.worker_link import RoundLinkTarget, WorkerLink
from sluice import convert, round_link, tls
from sluice.prom import SchedulerMetrics
from sluice.tls import TlsFiles
from sluice.types import RoundPlan, RoundResult, SamplingParams, ScheduledSeq
from sluice.v1 import worker_pb2, worker_pb2_grpc
from tests.round_streams import RoundStream
from worker_svc.costmodel import CostModel
from worker_svc.server import RunningWorker, WorkerRuntime, start_worker_server


def _plan(round_id: int, request_id: str = "r") -> RoundPlan:
    return RoundPlan(round_id, (ScheduledSeq(request_id, 0, (10,), 5, (0,), SamplingParams(max_tokens=8), True, 1),))


async def _worker(tls_files: TlsFiles | None = None, runtime: WorkerRuntime | None = None) -> RunningWorker:
    worker = await start_worker_server(runtime or WorkerRuntime(lambda: CostModel("llama-3-8b", "h200")),
                                       tls_files=tls_files)
    await asyncio.wait_for(worker.loading, 30)
    assert worker.round_link is not None
    return worker


def _errors(worker: RunningWorker, reason: str) -> float:
    return float(worker.runtime.metrics.round_link_errors.labels(reason)._value.get())


async def _closed_by_peer(reader: asyncio.StreamReader) -> bytes:
    """Read until the worker closes (or resets) the connection; return what it sent (its preface, at most)."""
    try:
        return await asyncio.wait_for(reader.read(), 10)
    except ConnectionResetError:
        return b""


async def _one_round(worker: RunningWorker, channel: grpc.aio.Channel) -> RoundResult:
    stream = await RoundStream.open("round_link", worker, channel)
    await stream.write(convert.plan_to_proto(_plan(9)))
    result = convert.result_from_proto(await stream.read())
    await stream.done_writing()
    return result


FRAME_TOO_LARGE = round_link.PREFACE + struct.pack(">I", 2**31)
NOT_A_PLAN = round_link.PREFACE + struct.pack(">I", 3) + b"\xff\xff\xff"


@pytest.mark.parametrize(("sent", "reason"), [
    (b"GET / HTTP/1.1\r\nHost: worker\r\n\r\n", "bad_preface"),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "bad_preface"),  # a gRPC client on the wrong port
    (FRAME_TOO_LARGE, "frame_too_large"),
    (NOT_A_PLAN, "not_a_plan"),
])
def test_a_peer_that_sends_no_round_link_frames_is_refused_by_name_and_the_worker_serves_on(
        sent: bytes, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    """Bytes that are not a round link (an HTTP or gRPC client, a 2 GiB length, a frame that is not a RoundPlan) get
    the connection closed by the worker, an error log naming the peer and the reason, and a count under
    sluice_worker_round_link_errors_total{reason}; the worker still runs rounds on the next link."""
    async def body() -> None:
        worker = await _worker()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")
        reader, writer = await asyncio.open_connection("127.0.0.1", worker.round_link.port)  # type: ignore[union-attr]
        writer.write(sent)
        await writer.drain()
        assert (await _closed_by_peer(reader)) in (b"", round_link.PREFACE)
        writer.close()
        for _ in range(100):
            if _errors(worker, reason):
                break
            await asyncio.sleep(0.02)
        assert _errors(worker, reason) == 1
        refusals = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and "refused" in r.getMessage()]
        assert len(refusals) == 1 and f"({reason})" in refusals[0] and "127.0.0.1:" in refusals[0]
        result = await _one_round(worker, channel)
        assert (result.round_id, result.error, len(result.outputs)) == (9, "", 1)
        await channel.close()
        await worker.stop()
    with caplog.at_level(logging.INFO):
        asyncio.run(body())


def test_a_worker_end_that_answers_a_frame_that_is_not_a_result_loses_the_round_with_the_reason(
        caplog: pytest.LogCaptureFixture) -> None:
    """A peer on the worker's side that answers a plan with bytes that are not a RoundResult: the scheduler's link
    reports the round lost (None), logs what came, and drops the link (the next round opens another)."""
    async def body() -> None:
        loop = asyncio.get_running_loop()
        streams: list[round_link.FrameStream] = []

        def accept() -> round_link.FrameStream:
            stream = round_link.FrameStream()
            streams.append(stream)

            async def answer() -> None:
                await stream.read()
                stream.write(b"\xff\xff\xff")
            loop.create_task(answer())
            return stream

        server = await loop.create_server(accept, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        channel = grpc.aio.insecure_channel("127.0.0.1:1")  # unused: the round link answers the rounds
        link = WorkerLink(worker_pb2_grpc.WorkerServiceStub(channel), metrics=SchedulerMetrics(),
                          round_link=RoundLinkTarget("127.0.0.1", port))
        assert await link.send(_plan(1), lambda: None)
        assert await link.receive(1) is None
        assert link._stream is None
        lost = [r.getMessage() for r in caplog.records if "round 1" in r.getMessage()]
        assert lost and "not a RoundResult" in lost[0]
        server.close()
        await channel.close()
    asyncio.run(body())


def test_a_round_link_that_cannot_be_opened_sends_the_rounds_over_execute_stream() -> None:
    """A worker whose advertised round link does not answer (a port nothing listens on): the round is not lost, it
    goes over ExecuteStream, the link kind says so, and the round link is tried again after the next Info."""
    async def body() -> None:
        worker = await _worker(runtime=WorkerRuntime(lambda: CostModel("llama-3-8b", "h200")))
        assert worker.round_link is not None
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")
        metrics = SchedulerMetrics()
        nothing = socket.socket()  # bound, not listening: connecting is refused
        nothing.bind(("127.0.0.1", 0))
        link = WorkerLink(worker_pb2_grpc.WorkerServiceStub(channel), metrics=metrics,
                          round_link=RoundLinkTarget("127.0.0.1", nothing.getsockname()[1]))
        assert await link.send(_plan(1), lambda: None)
        result = await link.receive(1)
        assert result is not None and not result.error
        assert metrics.worker_link.labels("grpc_stream")._value.get() == 1
        assert link.round_link_port == 0
        assert await link.incarnation()  # Info: the worker's real round link port
        assert link.round_link_port == worker.round_link.port
        link.drop_stream()
        assert await link.send(_plan(2), lambda: None)
        assert (await link.receive(2)) is not None
        assert metrics.worker_link.labels("round_link")._value.get() == 1
        assert metrics.worker_link.labels("grpc_stream")._value.get() == 0
        link.drop_stream()
        nothing.close()
        await channel.close()
        await worker.stop()
    asyncio.run(body())


def test_round_link_under_mutual_tls_admits_the_scheduler_only(tmp_path: Path) -> None:
    """With the deployment's TLS files the worker's round link is mutual TLS: the scheduler's WorkerLink runs rounds
    on it (frames counted on both ends); a peer with another role's certificate (admission) is refused and counted
    `forbidden`; a plaintext peer never gets a preface."""
    pki = tls.write_local_pki(tmp_path / "pki")

    async def body() -> None:
        worker = await _worker(TlsFiles.of(pki, "worker"))
        scheduler_files = TlsFiles.of(pki, "scheduler")
        channel = tls.aio_channel(f"127.0.0.1:{worker.port}", scheduler_files)
        info = await worker_pb2_grpc.WorkerServiceStub(channel).Info(worker_pb2.InfoRequest())
        metrics = SchedulerMetrics()
        link = WorkerLink(worker_pb2_grpc.WorkerServiceStub(channel), metrics=metrics, round_link=RoundLinkTarget.of(
            f"127.0.0.1:{worker.port}", info.round_link_port, round_link.client_ssl(scheduler_files)))
        for round_id in (1, 2):
            assert await link.send(_plan(round_id), lambda: None)
            result = await link.receive(round_id)
            assert result is not None and not result.error and result.round_id == round_id
        assert metrics.worker_link.labels("round_link")._value.get() == 1
        assert metrics.round_link_frames.totals() == (2, 2, *metrics.round_link_frames.totals()[2:])
        assert worker.runtime.metrics.round_link_frames.totals()[:2] == (2, 2)
        link.drop_stream()

        with pytest.raises(ConnectionError):
            stream = await round_link.open_stream("127.0.0.1", info.round_link_port,
                                                  round_link.client_ssl(TlsFiles.of(pki, "admission")))
            # The worker closes the link after the handshake: a role that may not run rounds.
            await asyncio.wait_for(stream.read(), 5)
        for _ in range(100):
            if _errors(worker, "forbidden"):
                break
            await asyncio.sleep(0.02)
        assert _errors(worker, "forbidden") == 1

        with pytest.raises((ConnectionError, TimeoutError)):
            await round_link.open_stream("127.0.0.1", info.round_link_port, None, timeout_s=2)
        await channel.close()
        await worker.stop()
    asyncio.run(body())


class _Slow:
    """The cost model, taking 0.2 s a round and counting the rounds it started."""

    def __init__(self) -> None:
        self.model = CostModel("llama-3-8b", "h200")
        self.started = 0
        self.lock = threading.Lock()

    def info(self):  # type: ignore[no-untyped-def]
        return self.model.info()

    def execute(self, plan: RoundPlan) -> RoundResult:
        with self.lock:
            self.started += 1
        time.sleep(0.2)
        return self.model.execute(plan)


def test_rounds_queued_on_a_closed_link_that_have_not_started_do_not_run() -> None:
    """Five pipelined plans on a round link, closed while the first runs: the rounds that had not started are
    cancelled (as on a closed ExecuteStream), so the device does not run work nobody will read."""
    async def body() -> None:
        backend = _Slow()
        worker = await _worker(runtime=WorkerRuntime(lambda: backend))
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")
        warm = backend.started
        stream = await RoundStream.open("round_link", worker, channel)
        for round_id in range(1, 6):
            await stream.write(convert.plan_to_proto(_plan(round_id, f"r{round_id}")))
        while backend.started == warm:
            await asyncio.sleep(0.01)
        await stream.done_writing()
        await asyncio.sleep(1.2)  # the five rounds would have run by now
        assert backend.started - warm <= 2
        assert worker.runtime.metrics.round_links._value.get() == 0
        await channel.close()
        await worker.stop()
    asyncio.run(body())
