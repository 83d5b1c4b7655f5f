"""KV transfer between two real worker servers on loopback: PullKv on the receiver reads the sender's ReadKv stream.

The torch tests prove the receiver computes with the sender's K/V: after the pull, a round on the receiver that
reads the pulled blocks gives the logits the sender itself gives for the same positions, and the same round over
zeroed blocks gives different logits (so the equality is not an accident of a model that ignores its cache).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from sluice.errors import details_of
from sluice.types import RoundPlan, SamplingParams, ScheduledSeq
from sluice.v1 import worker_pb2, worker_pb2_grpc
from worker_svc.costmodel import CostModel
from worker_svc.models import resolve_model
from worker_svc.server import RunningWorker, WorkerRuntime, start_worker_server
from worker_svc.torch_backend import TorchBackend

PROMPT = tuple(5 + (7 * i) % 200 for i in range(40))  # 2 full blocks of 16 and 8 tokens in a third
GREEDY = SamplingParams(max_tokens=8)


async def _serve(backend: object) -> tuple[RunningWorker, grpc.aio.Channel]:
    worker = await start_worker_server(WorkerRuntime(lambda: backend))  # type: ignore[arg-type, return-value]
    await asyncio.wait_for(worker.loading, 60)
    return worker, grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}")


def _prefill(table: tuple[int, ...]) -> RoundPlan:
    return RoundPlan(1, (ScheduledSeq("r", 0, PROMPT, 0, table, GREEDY, True, 0),))


def _tail(table: tuple[int, ...], first_token: int) -> RoundPlan:
    """The decode side's first round: the partial last block's tokens and the first token, over `table`."""
    return RoundPlan(2, (ScheduledSeq("r", 0, (*PROMPT[32:], first_token), 32, table, GREEDY, True, 1),))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model("tiny", home=tmp_path_factory.mktemp("home"))


def test_pulled_blocks_are_the_senders_bytes_and_the_receiver_computes_with_them(model_dir: Path) -> None:
    """PullKv moves the sender's two full blocks byte for byte; the receiver's round over them gives the sender's
    logits, and over zeroed blocks it does not."""
    async def body() -> None:
        sender = TorchBackend(model_dir, device="cpu", dtype="float32", num_blocks=16)
        receiver = TorchBackend(model_dir, device="cpu", dtype="float32", num_blocks=16)
        (src, src_channel), (dst, dst_channel) = await _serve(sender), await _serve(receiver)
        first = sender.execute(_prefill((0, 1, 2))).outputs[0].token_ids[0]
        expected = sender.round_logits(_tail((0, 1, 2), first))[0]
        reply = await worker_pb2_grpc.WorkerServiceStub(dst_channel).PullKv(worker_pb2.PullKvRequest(
            source_address=f"127.0.0.1:{src.port}", source_block_ids=[0, 1], block_ids=[9, 4], blocks_per_message=1))
        assert (reply.blocks, reply.bytes) == (2, 2 * sender.kv_block_bytes)
        assert receiver.read_kv_blocks([9, 4]) == sender.read_kv_blocks([0, 1])
        got = receiver.round_logits(_tail((9, 4, 11), first))[0]
        torch.testing.assert_close(got, expected)
        receiver.write_kv_blocks([9, 4], [bytes(receiver.kv_block_bytes)] * 2)
        zeroed = receiver.round_logits(_tail((9, 4, 11), first))[0]
        assert not torch.allclose(zeroed, expected, atol=1e-3), "the round did not read the transferred blocks"
        for channel in (src_channel, dst_channel):
            await channel.close()
        await src.stop()
        await dst.stop()
    asyncio.run(body())


def test_cost_model_transfer_moves_block_sized_messages() -> None:
    """The cost model holds no tensors but sends block-sized bytes: 2 MiB per Llama-3-8B block, as many per message
    as fit under gRPC's default 4 MiB limit (here one)."""
    async def body() -> None:
        model = CostModel("llama-3-8b", "h200")
        (src, src_channel), (dst, dst_channel) = await _serve(model), await _serve(CostModel("llama-3-8b", "h200"))
        chunks = [chunk async for chunk in worker_pb2_grpc.WorkerServiceStub(src_channel).ReadKv(
            worker_pb2.ReadKvRequest(block_ids=[3, 4, 5]))]
        assert [len(c.data) for c in chunks] == [2 * 2**20] * 3 and [list(c.block_ids) for c in chunks] == [[3], [4], [5]]
        reply = await worker_pb2_grpc.WorkerServiceStub(dst_channel).PullKv(worker_pb2.PullKvRequest(
            source_address=f"127.0.0.1:{src.port}", source_block_ids=[3, 4, 5], block_ids=[7, 8, 9]))
        assert (reply.blocks, reply.bytes) == (3, 3 * model.kv_block_bytes) and model.kv_block_bytes == 2**21
        for channel in (src_channel, dst_channel):
            await channel.close()
        await src.stop()
        await dst.stop()
    asyncio.run(body())


def test_pull_from_an_unreachable_source_is_unavailable_and_bad_requests_name_the_field() -> None:
    """A source that does not answer is UNAVAILABLE (kv_source_unavailable); mismatched ids are INVALID_ARGUMENT
    naming block_ids."""
    async def body() -> None:
        dst, channel = await _serve(CostModel("llama-3-8b", "h200"))
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.PullKv(worker_pb2.PullKvRequest(source_address="127.0.0.1:1", source_block_ids=[1],
                                                       block_ids=[2]), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert details_of(caught.value).reason == "kv_source_unavailable"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.PullKv(worker_pb2.PullKvRequest(source_address="127.0.0.1:1", source_block_ids=[1, 2],
                                                       block_ids=[2]))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert details_of(caught.value).field_name == "block_ids"
        await channel.close()
        await dst.stop()
    asyncio.run(body())


def test_a_pull_for_another_incarnation_of_the_source_is_refused_and_writes_nothing() -> None:
    """The fence: Info names the worker's incarnation (new on every start); ReadKv / PullKv naming another one answer
    FAILED_PRECONDITION (kv_incarnation_changed) and the receiver's blocks stay as they were; naming the right one
    (or none) moves the blocks."""
    async def body() -> None:
        sender = CostModel("llama-3-8b", "h200")
        (src, src_channel), (dst, dst_channel) = await _serve(sender), await _serve(CostModel("llama-3-8b", "h200"))
        source = worker_pb2_grpc.WorkerServiceStub(src_channel)
        incarnation = (await source.Info(worker_pb2.InfoRequest())).incarnation
        assert len(incarnation) == 16 and incarnation == src.runtime.incarnation != dst.runtime.incarnation
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            _ = [chunk async for chunk in source.ReadKv(worker_pb2.ReadKvRequest(block_ids=[1], incarnation="old"))]
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert details_of(caught.value).reason == "kv_incarnation_changed"
        stub = worker_pb2_grpc.WorkerServiceStub(dst_channel)
        pull = worker_pb2.PullKvRequest(source_address=f"127.0.0.1:{src.port}", source_block_ids=[3, 4],
                                        block_ids=[7, 8], source_incarnation="0123456789abcdef")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.PullKv(pull, timeout=10)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert details_of(caught.value).field_name == "source_incarnation"
        assert dst.runtime.metrics.kv_transfer_blocks.labels("received")._value.get() == 0
        pull.source_incarnation = incarnation
        assert (await stub.PullKv(pull, timeout=10)).blocks == 2
        for channel in (src_channel, dst_channel):
            await channel.close()
        await src.stop()
        await dst.stop()


def test_a_batch_too_big_for_one_message_or_negative_is_refused_naming_blocks_per_message() -> None:
    """blocks_per_message that would put more than the message limit in one ReadKv message (protobuf encodes no
    message over 2 GiB: the stream broke with an internal EncodeError) or is negative is INVALID_ARGUMENT naming
    the field, on ReadKv and on PullKv before the source is asked; the worker serves the next request."""
    async def body() -> None:
        src, channel = await _serve(CostModel("llama-3-8b", "h200"))  # 2 MiB blocks
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        for per in (2000, -1):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                _ = [chunk async for chunk in stub.ReadKv(worker_pb2.ReadKvRequest(block_ids=[1, 2],
                                                                                   blocks_per_message=per))]
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
            assert details_of(caught.value).field_name == "blocks_per_message"
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.PullKv(worker_pb2.PullKvRequest(source_address="127.0.0.1:1", source_block_ids=[1],
                                                           block_ids=[2], blocks_per_message=per))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
            assert details_of(caught.value).field_name == "blocks_per_message"
        chunks = [chunk async for chunk in stub.ReadKv(worker_pb2.ReadKvRequest(block_ids=[1, 2],
                                                                                 blocks_per_message=1))]
        assert [list(c.block_ids) for c in chunks] == [[1], [2]]
        await channel.close()
        await src.stop()
    asyncio.run(body())
