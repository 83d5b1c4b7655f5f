"""The worker gRPC service on loopback with the cost-model backend: Execute, ExecuteStream, Info, health."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice import convert
from sluice.errors import details_of
from sluice.types import PENDING_TOKEN, RoundPlan, RoundResult, SamplingParams, ScheduledSeq
from sluice.v1 import worker_pb2, worker_pb2_grpc
from tests.round_streams import KINDS, RoundStream
from worker_svc.costmodel import CostModel
from worker_svc.server import SERVICE_NAME, RunningWorker, WorkerRuntime, start_worker_server


def _plan(round_id: int, n_decodes: int = 3) -> RoundPlan:
    seqs = tuple(ScheduledSeq(f"r{i}", 0, (10 + i,), 5, (i,), SamplingParams(max_tokens=8), True, 1)
                 for i in range(n_decodes))
    return RoundPlan(round_id, seqs)


async def _health(channel: grpc.aio.Channel, service: str = SERVICE_NAME) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
    return int(reply.status)


async def _started(runtime: WorkerRuntime) -> tuple[RunningWorker, grpc.aio.Channel]:
    worker = await start_worker_server(runtime)
    await asyncio.wait_for(worker.loading, 30)
    return worker, grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")


@pytest.mark.parametrize("kind", KINDS)
def test_execute_and_stream_return_the_backends_tokens(kind: str) -> None:
    """Execute and ExecuteStream (or the round link) return, for each plan, exactly the tokens the cost model
    computes."""
    async def body() -> None:
        model = CostModel("llama-3-8b", "h200")
        worker, channel = await _started(WorkerRuntime(lambda: model))
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        plan = _plan(7)
        unary = convert.result_from_proto(await stub.Execute(convert.plan_to_proto(plan)))
        assert unary.round_id == 7 and not unary.error
        assert unary.outputs == model.execute(plan).outputs
        call = await RoundStream.open(kind, worker, channel)
        streamed: list[RoundResult] = []
        for round_id in range(1, 4):
            await call.write(convert.plan_to_proto(_plan(round_id, round_id)))
            streamed.append(convert.result_from_proto(await call.read()))
        await call.done_writing()
        assert [r.round_id for r in streamed] == [1, 2, 3]
        assert [r.outputs for r in streamed] == [model.execute(_plan(i, i)).outputs for i in range(1, 4)]
        await channel.close()
        await worker.stop()
    asyncio.run(body())


def test_info_reports_capacity_with_num_blocks_override() -> None:
    """Info returns the backend's model and block size, with num_blocks lowered to the operator's override."""
    async def body() -> None:
        worker, channel = await _started(WorkerRuntime(lambda: CostModel("llama-3-8b", "h200"), num_blocks=64))
        info = await worker_pb2_grpc.WorkerServiceStub(channel).Info(worker_pb2.InfoRequest())
        assert (info.model_id, info.num_blocks, info.block_size, info.backend) == (
            "llama-3-8b", 64, 16, "costmodel")
        await channel.close()
        await worker.stop()
    asyncio.run(body())


def test_health_is_not_serving_until_loaded_and_warmed_up() -> None:
    """Health is NOT_SERVING and Execute is UNAVAILABLE while the backend loads; SERVING once warm-up ran."""
    gate = threading.Event()

    def slow_load() -> CostModel:
        gate.wait(10)
        return CostModel("llama-3-8b", "h200")

    async def body() -> None:
        runtime = WorkerRuntime(slow_load)
        worker = await start_worker_server(runtime)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")
        assert await _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await _health(channel, "") == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await worker_pb2_grpc.WorkerServiceStub(channel).Execute(convert.plan_to_proto(_plan(1)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert details_of(err.value).reason == "WORKER_LOADING"
        gate.set()
        await asyncio.wait_for(worker.loading, 10)
        assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
        await channel.close()
        await worker.stop()
    asyncio.run(body())


class _FailingOn(CostModel):
    """The cost model with an injected fault: a round containing request "boom" raises."""

    def execute(self, plan: RoundPlan) -> RoundResult:
        if any(s.request_id == "boom" for s in plan.seqs):
            raise RuntimeError("device fault")
        return super().execute(plan)


def test_a_backend_exception_fails_the_round_not_the_service() -> None:
    """A round whose backend call raises comes back with `error` set, and the next round succeeds."""
    async def body() -> None:
        worker, channel = await _started(WorkerRuntime(lambda: _FailingOn("llama-3-8b", "h200")))
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        bad = RoundPlan(3, (ScheduledSeq("boom", 0, (1,), 0, (0,), SamplingParams(), True, 0),))
        failed = await stub.Execute(convert.plan_to_proto(bad))
        assert failed.round_id == 3 and "device fault" in failed.error and not failed.outputs
        ok = await stub.Execute(convert.plan_to_proto(_plan(4)))
        assert not ok.error and len(ok.outputs) == 3
        await channel.close()
        await worker.stop()
    asyncio.run(body())


def test_emulate_time_makes_a_round_take_its_modelled_time() -> None:
    """With emulate_time, a round takes at least the cost model's elapsed_s of wall time."""
    async def body() -> None:
        model = CostModel("llama-3-70b", "h100")
        worker, channel = await _started(WorkerRuntime(lambda: model, emulate_time=True))
        plan = _plan(1, 8)
        start = time.perf_counter()
        result = await worker_pb2_grpc.WorkerServiceStub(channel).Execute(convert.plan_to_proto(plan))
        assert time.perf_counter() - start >= result.elapsed_s > 0
        await channel.close()
        await worker.stop()
    asyncio.run(body())


def test_a_time_scale_stretches_the_emulated_round_and_a_bad_one_is_refused() -> None:
    """With time_scale 4 a round takes at least four times the cost model's elapsed_s (the bench's slower device);
    a scale of 0, below 0 or infinite is refused when the runtime is built."""
    async def body() -> float:
        model = CostModel("llama-3-70b", "h100")
        worker, channel = await _started(WorkerRuntime(lambda: model, emulate_time=True, time_scale=4.0))
        start = time.perf_counter()
        result = await worker_pb2_grpc.WorkerServiceStub(channel).Execute(convert.plan_to_proto(_plan(1, 8)))
        took = time.perf_counter() - start
        assert took >= 4 * result.elapsed_s > 0, (took, result.elapsed_s)
        await channel.close()
        await worker.stop()
        return took
    asyncio.run(body())
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="time_scale"):
            WorkerRuntime(lambda: CostModel("llama-3-8b", "h200"), emulate_time=True, time_scale=bad)


@pytest.mark.e2e
def test_worker_refuses_a_time_scale_that_is_not_positive_naming_the_flag(subprocess_env) -> None:  # type: ignore[no-untyped-def]
    """`--emulate-time-scale 0` ends the worker with exit status 2 and a line naming the flag, no traceback."""
    refused = subprocess.run([sys.executable, "-m", "worker_svc", "--backend", "costmodel", "--port", "0",
                              "--emulate-time", "--emulate-time-scale", "0", "--metrics-port", "0"],
                             capture_output=True, text=True, timeout=120, env=subprocess_env, check=False)
    assert refused.returncode == 2, refused.stderr
    assert "--emulate-time-scale must be a finite number > 0, got 0.0" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.e2e
def test_worker_process_turns_serving_and_exits_on_sigterm(free_port, subprocess_env) -> None:  # type: ignore[no-untyped-def]
    """`python -m worker_svc --backend costmodel` reports SERVING over gRPC health and exits 0 on SIGTERM."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "worker_svc", "--backend", "costmodel", "--model",
                             "llama-3-8b", "--port", str(port), "--num-blocks", "128"], env=subprocess_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline, status = time.monotonic() + 30, None
            while time.monotonic() < deadline and status != health_pb2.HealthCheckResponse.SERVING:
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1).status
                except grpc.RpcError:
                    time.sleep(0.1)
            assert status == health_pb2.HealthCheckResponse.SERVING
            info = worker_pb2_grpc.WorkerServiceStub(channel).Info(worker_pb2.InfoRequest(), timeout=5)
            assert info.num_blocks == 128
        proc.terminate()
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_torch_tiny_engine_serves_rounds_over_both_rpcs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The torch engine with the tiny preset answers a greedy prefill round with one in-vocabulary token, and
    Execute and ExecuteStream give the same token for the same round."""
    torch_backend = pytest.importorskip("worker_svc.torch_backend")
    from worker_svc.models import resolve_model

    def load():  # type: ignore[no-untyped-def]
        return torch_backend.TorchBackend(resolve_model("tiny", home=tmp_path), device="cpu", num_blocks=32)

    async def body() -> None:
        worker, channel = await _started(WorkerRuntime(load))
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        info = await stub.Info(worker_pb2.InfoRequest())
        assert (info.backend, info.num_blocks) == ("torch", 32)
        plan = RoundPlan(1, (ScheduledSeq("p", 0, tuple(range(3, 23)), 0, (0, 1), SamplingParams(), True, 0),))
        unary = await stub.Execute(convert.plan_to_proto(plan))
        call = stub.ExecuteStream()
        await call.write(convert.plan_to_proto(plan))
        streamed = await call.read()
        await call.done_writing()
        assert not unary.error and len(unary.outputs) == 1 and len(unary.outputs[0].token_ids) == 1
        assert 0 <= unary.outputs[0].token_ids[0] < info.vocab_size
        assert streamed.outputs[0].token_ids == unary.outputs[0].token_ids
        await channel.close()
        await worker.stop()
    asyncio.run(body())


@pytest.mark.gpu
def test_torch_tiny_engine_serves_on_cuda(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """On a CUDA device the worker service loads the tiny preset there, turns SERVING and answers a round."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from worker_svc.models import resolve_model
    from worker_svc.torch_backend import TorchBackend

    async def body() -> None:
        worker, channel = await _started(WorkerRuntime(
            lambda: TorchBackend(resolve_model("tiny", home=tmp_path), device="cuda", num_blocks=64)))
        assert await _health(channel) == health_pb2.HealthCheckResponse.SERVING
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        assert (await stub.Info(worker_pb2.InfoRequest())).device.startswith("cuda")
        plan = RoundPlan(1, (ScheduledSeq("g", 0, tuple(range(3, 23)), 0, (0, 1), SamplingParams(), True, 0),))
        result = await stub.Execute(convert.plan_to_proto(plan))
        assert not result.error and len(result.outputs[0].token_ids) == 1
        await channel.close()
        await worker.stop()
    asyncio.run(body())


class _Recording:
    """The cost model, keeping the plans it was given (to see what the runtime handed the backend)."""

    def __init__(self) -> None:
        self.model = CostModel("llama-3-8b", "h200")
        self.plans: list[RoundPlan] = []

    def info(self):  # type: ignore[no-untyped-def]
        return self.model.info()

    def execute(self, plan: RoundPlan) -> RoundResult:
        self.plans.append(plan)
        return self.model.execute(plan)


@pytest.mark.parametrize("kind", KINDS)
def test_pipelined_rounds_get_their_pending_tokens_and_the_idle_gap_is_measured(kind: str) -> None:
    """Two plans queued on the stream: the second's pending token becomes the token the first sampled, and
    the gap between the rounds is observed by sluice_worker_idle_seconds; a pending token nobody sampled fails
    its round."""
    async def body() -> None:
        backend = _Recording()
        runtime = WorkerRuntime(lambda: backend)
        worker, channel = await _started(runtime)
        call = await RoundStream.open(kind, worker, channel)
        ahead = ScheduledSeq("r0", 0, (PENDING_TOKEN,), 6, (0,), SamplingParams(max_tokens=8), True, 2)
        await call.write(convert.plan_to_proto(_plan(1, 1)))
        await call.write(convert.plan_to_proto(RoundPlan(2, (ahead,))))
        first = convert.result_from_proto(await call.read())
        second = convert.result_from_proto(await call.read())
        assert not first.error and not second.error
        assert backend.plans[-1].seqs[0].token_ids == first.outputs[0].token_ids
        orphan = ScheduledSeq("nobody", 0, (PENDING_TOKEN,), 6, (1,), SamplingParams(max_tokens=8), True, 2)
        await call.write(convert.plan_to_proto(RoundPlan(3, (orphan,))))
        assert "pending token" in convert.result_from_proto(await call.read()).error
        await call.done_writing()
        idle = runtime.metrics.registry.get_sample_value("sluice_worker_idle_seconds_count")
        assert idle is not None and idle >= 3  # warm-up, 1, 2, 3: a gap before each round after the first
        await channel.close()
        await worker.stop()
    asyncio.run(body())
