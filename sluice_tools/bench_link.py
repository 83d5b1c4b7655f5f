"""CPU per round of the scheduler <-> worker round exchange: grpc.aio's ExecuteStream against the round link.

    PYTHONPATH=. .venv/bin/python -m sluice_tools.bench_link [--rounds 800] [--trials 3] [--seqs 16] [--gap-ms 4.8]

Two processes under uvloop, as in a replica: this one plays the scheduler's link (pipelined like the driver: plan
N+1 is written before round N's answer is read; the plan built by the real `PlanEncoder`, the answer converted by
`convert.result_from_proto`), a child plays the worker (each plan parsed and converted by `convert.plan_from_proto`,
answered `--gap-ms` after the round before ends, as a GPU would, with a result of one token per sequence converted
by `convert.result_to_proto`). The same child serves both links: the real `WorkerService` gRPC server
(`sluice.serve.grpc_server`, ExecuteStream) and a round link (`sluice.round_link`). What differs between the two
modes is only the transport. CPU is each process's own `time.process_time()` (every thread: grpc.aio's poller
included) over the trial; the modes alternate, and their order flips every trial.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from sluice import convert, round_link, serve
from sluice.plan_encoder import PlanEncoder
from sluice.types import PENDING_TOKEN, RoundPlan, RoundResult, SamplingParams, ScheduledSeq, SeqOutput
from sluice.v1 import worker_pb2, worker_pb2_grpc

__all__ = ["main"]

BLOCK = 16
PROMPT = 32


def make_plan(round_id: int, seqs: int, sampling: SamplingParams) -> RoundPlan:
    """A pipelined decode round of `seqs` requests, each `round_id` tokens past a 32-token prompt."""
    position = PROMPT + round_id % 128
    table = tuple(range(position // BLOCK + 1))
    return RoundPlan(round_id, tuple(
        ScheduledSeq(f"req-{i:04d}-{round_id // 128}", 0, (PENDING_TOKEN,), position, tuple(b + i * 64 for b in table),
                     sampling, True, round_id % 128) for i in range(seqs)))


def make_result(plan: RoundPlan) -> RoundResult:
    return RoundResult(plan.round_id, tuple(SeqOutput(s.request_id, s.epoch, (1234,)) for s in plan.seqs), 0.0048)


# ---- the worker (child process) ------------------------------------------------------------------------------
class _Gpu:
    """Rounds back to back, `gap_s` each, as a device would run them."""

    def __init__(self, gap_s: float) -> None:
        self.gap_s = gap_s
        self.free_at = 0.0

    def run(self, wire: worker_pb2.RoundPlan) -> asyncio.Future[bytes]:
        loop = asyncio.get_running_loop()
        plan = convert.plan_from_proto(wire)
        start = max(loop.time(), self.free_at)
        self.free_at = end = start + self.gap_s
        done: asyncio.Future[bytes] = loop.create_future()

        def answer() -> None:
            if not done.done():
                done.set_result(convert.result_to_proto(make_result(plan)).SerializeToString())
        loop.call_at(end, answer)
        return done


class _Servicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, gpu: _Gpu) -> None:
        self.gpu = gpu

    async def ExecuteStream(self, request_iterator: AsyncIterator[worker_pb2.RoundPlan],  # noqa: N802
                            context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.RoundResult]:
        queued: asyncio.Queue[asyncio.Future[bytes] | None] = asyncio.Queue()

        async def read() -> None:
            async for wire in request_iterator:
                queued.put_nowait(self.gpu.run(wire))
            queued.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (future := await queued.get()) is not None:
                yield worker_pb2.RoundResult.FromString(await future)
        finally:
            reader.cancel()


async def _serve_link(gpu: _Gpu, stream: round_link.FrameStream) -> None:
    queued: asyncio.Queue[asyncio.Future[bytes] | None] = asyncio.Queue()

    async def read() -> None:
        try:
            while True:
                queued.put_nowait(gpu.run(worker_pb2.RoundPlan.FromString(await stream.read())))
        except ConnectionError:
            queued.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        while (future := await queued.get()) is not None:
            stream.write(worker_pb2.RoundResult.FromString(await future).SerializeToString())
    finally:
        reader.cancel()


async def _worker(gap_s: float) -> None:
    gpu = _Gpu(gap_s)
    server = serve.grpc_server("sluice.v1.WorkerService")
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(_Servicer(gpu), server)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    def accept() -> round_link.FrameStream:
        stream = round_link.FrameStream()
        task = loop.create_task(_serve_link(gpu, stream))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return stream

    link = await loop.create_server(accept, "127.0.0.1", 0)
    link_port = link.sockets[0].getsockname()[1]
    print(f"ports {grpc_port} {link_port}", flush=True)
    done: asyncio.Future[None] = loop.create_future()

    def answer() -> None:  # a thread: "cpu" lines on stdin are answered with this process's CPU seconds
        for line in sys.stdin:
            if line.strip() == "cpu":
                print(f"cpu {time.process_time()}", flush=True)
        loop.call_soon_threadsafe(done.cancel)

    threading.Thread(target=answer, daemon=True).start()
    with contextlib.suppress(asyncio.CancelledError):
        await done


# ---- the scheduler (this process) ----------------------------------------------------------------------------
class _Child:
    def __init__(self, gap_ms: float) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "sluice_tools.bench_link", "--serve", "--gap-ms",
                                      str(gap_ms)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        _, grpc_port, link_port = self.proc.stdout.readline().split()
        self.grpc_port, self.link_port = int(grpc_port), int(link_port)

    def cpu(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("cpu\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline().split()[1])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


async def _rounds(mode: str, child: _Child, rounds: int, seqs: int) -> dict[str, float]:
    sampling = SamplingParams(max_tokens=128, ignore_eos=True)
    encoder = PlanEncoder()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{child.grpc_port}")
    call: Any = None
    stream: round_link.FrameStream | None = None
    if mode == "grpc":
        call = worker_pb2_grpc.WorkerServiceStub(channel).ExecuteStream()
    else:
        stream = await round_link.open_stream("127.0.0.1", child.link_port)

    async def send(round_id: int) -> None:
        wire = encoder.encode(make_plan(round_id, seqs, sampling))
        if call is not None:
            await call.write(wire)
        else:
            assert stream is not None
            stream.write(wire.SerializeToString())

    async def receive() -> RoundResult:
        if call is not None:
            return convert.result_from_proto(await call.read())
        assert stream is not None
        return convert.result_from_proto(worker_pb2.RoundResult.FromString(await stream.read()))

    warm = 50
    await send(0)
    for round_id in range(1, warm):
        await send(round_id)
        await receive()
    cpu, child_cpu, wall = time.process_time(), child.cpu(), time.perf_counter()
    for round_id in range(warm, warm + rounds):
        await send(round_id)
        result = await receive()
        assert len(result.outputs) == seqs
    cpu, child_cpu, wall = time.process_time() - cpu, child.cpu() - child_cpu, time.perf_counter() - wall
    await receive()
    if call is not None:
        call.cancel()
    if stream is not None:
        stream.close()
    await channel.close()
    return {"scheduler_us": cpu / rounds * 1e6, "worker_us": child_cpu / rounds * 1e6, "round_ms": wall / rounds * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice_tools.bench_link", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=800)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--gap-ms", type=float, default=4.8, help="the worker's round time (a GPU's pace)")
    parser.add_argument("--json", help="write the trials and medians here")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    serve.use_event_loop(serve.default_event_loop())
    if args.serve:
        asyncio.run(_worker(args.gap_ms / 1e3))
        return 0
    child = _Child(args.gap_ms)
    trials: dict[str, list[dict[str, float]]] = {"grpc": [], "link": []}
    try:
        for trial in range(args.trials):
            for mode in (("grpc", "link") if trial % 2 == 0 else ("link", "grpc")):
                figures = asyncio.run(_rounds(mode, child, args.rounds, args.seqs))
                trials[mode].append(figures)
                print(f"trial {trial} {mode:5s} " + " ".join(f"{k} {v:.1f}" for k, v in figures.items()), flush=True)
    finally:
        child.close()
    medians = {mode: {key: round(statistics.median(t[key] for t in runs), 1) for key in runs[0]}
               for mode, runs in trials.items()}
    for key in ("scheduler_us", "worker_us"):
        ratio = medians["link"][key] / medians["grpc"][key]
        print(f"{key}: grpc {medians['grpc'][key]:.1f}  link {medians['link'][key]:.1f}  ({ratio:.2f}x)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"args": vars(args), "trials": trials, "medians": medians}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
