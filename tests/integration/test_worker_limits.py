"""A real worker refuses plans that do not fit it, and malformed bytes, with INVALID_ARGUMENT before running them:
a sequence that does not fit is taken out of its round (the rest runs), a round that does not fit as a whole fails."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from sluice import convert
from sluice.errors import details_of
from sluice.types import PENDING_TOKEN, RefusedSeq, RoundPlan, SamplingParams, ScheduledSeq
from sluice.v1 import worker_pb2, worker_pb2_grpc
from tests.round_streams import KINDS, RoundStream
from worker_svc.costmodel import CostModel
from worker_svc.server import WorkerRuntime, start_worker_server


def _seq(request_id: str = "a", start: int = 0, tokens: tuple[int, ...] = (1, 2, 3),
         blocks: tuple[int, ...] = (0,)) -> ScheduledSeq:
    return ScheduledSeq(request_id, 0, tokens, start, blocks, SamplingParams(max_tokens=4), True, 0)


async def _refusal(stub: worker_pb2_grpc.WorkerServiceStub, plan: RoundPlan) -> tuple[grpc.StatusCode, str, float]:
    began = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Execute(convert.plan_to_proto(plan), timeout=10)
    details = details_of(err.value)
    return details.code, details.field_name, time.monotonic() - began


def test_plans_past_the_workers_limits_are_refused_at_once() -> None:
    """An emulated llama-3-8b worker refuses start_position 2^31-1 (hours of modelled time), bad ids and blocks
    with INVALID_ARGUMENT naming the field, within a second (a sequence in the result's `refused`, the rest of its
    round run; a round that does not fit as a whole as the call's status), and still runs the next valid round."""
    async def body() -> None:
        worker = await start_worker_server(WorkerRuntime(lambda: CostModel("llama-3-8b", "h200"),
                                                         num_blocks=64, emulate_time=True))
        await asyncio.wait_for(worker.loading, 30)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            sequences = {
                "seqs[0].start_position": RoundPlan(1, (_seq(start=2**31 - 1),)),
                "seqs[1].token_ids": RoundPlan(2, (_seq(), _seq("b", tokens=(10**9,)))),
                "seqs[0].block_table": RoundPlan(3, (_seq(start=40, blocks=(0,)),)),
            }
            for field_name, plan in sequences.items():
                began = time.monotonic()
                result = convert.result_from_proto(await stub.Execute(convert.plan_to_proto(plan), timeout=10))
                (refused,) = result.refused
                assert refused.detail.startswith(f"INVALID_ARGUMENT ({field_name}): ")
                assert refused.request_id == plan.seqs[int(field_name[5])].request_id and not result.error
                assert [o.request_id for o in result.outputs] == [s.request_id for s in plan.seqs
                                                                  if s.request_id != refused.request_id]
                assert time.monotonic() - began < 1.0
            rounds = {
                "seqs[1].request_id": RoundPlan(4, (_seq(), _seq())),
                "seqs": RoundPlan(5, tuple(_seq(f"r{i}", tokens=(1,) * 200, blocks=tuple(range(13)))
                                           for i in range(6))),
            }
            for field_name, plan in rounds.items():
                code, named, elapsed = await _refusal(stub, plan)
                assert (code, named) == (grpc.StatusCode.INVALID_ARGUMENT, field_name)
                assert elapsed < 1.0
            ok = await stub.Execute(convert.plan_to_proto(RoundPlan(9, (_seq(),))), timeout=10)
            assert not ok.error and len(ok.outputs) == 1 and not ok.refused
            refusals = worker.runtime.metrics.refused_seqs
            assert {kind: refusals.labels(kind)._value.get() for kind in ("start_position", "token_ids",
                                                                          "block_table")} == dict.fromkeys(
                ("start_position", "token_ids", "block_table"), 1.0)
        await worker.stop()
    asyncio.run(body())


def test_malformed_bytes_are_invalid_argument_on_unary_and_stream_calls() -> None:
    """Bytes that are no RoundPlan answer INVALID_ARGUMENT (reason malformed_message), not UNKNOWN, on
    Execute and on ExecuteStream, and the worker serves a valid plan afterwards."""
    async def body() -> None:
        worker = await start_worker_server(WorkerRuntime(lambda: CostModel("tiny", "h200")))
        await asyncio.wait_for(worker.loading, 30)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            raw = {"request_serializer": None, "response_deserializer": None}
            for call in (channel.unary_unary("/sluice.v1.WorkerService/Execute", **raw)(b"\x0a\xff\xff", timeout=5),
                         channel.stream_stream("/sluice.v1.WorkerService/ExecuteStream", **raw)(
                             iter([b"\x80"]), timeout=5).read()):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                details = details_of(err.value)
                assert (details.code, details.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "malformed_message")
                assert "RoundPlan" in details.message
            ok = await worker_pb2_grpc.WorkerServiceStub(channel).Execute(
                convert.plan_to_proto(RoundPlan(1, (_seq(),))), timeout=5)
            assert not ok.error
            info = await worker_pb2_grpc.WorkerServiceStub(channel).Info(worker_pb2.InfoRequest(), timeout=5)
            assert info.model_id == "tiny"
        await worker.stop()
    asyncio.run(body())


@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_stream_round_is_answered_and_the_round_behind_it_runs_without_its_pending_decodes(kind: str) -> None:
    """On ExecuteStream (and the round link) a plan refused as a whole is answered with a failed round (INVALID_ARGUMENT and the field in
    `error`) instead of ending the stream; the pipelined round queued behind it drops its pending decodes of the
    refused round's requests (nothing was sampled for them) and runs the rest; later rounds run as before."""
    async def body() -> None:
        worker = await start_worker_server(WorkerRuntime(lambda: CostModel("llama-3-8b", "h200"), num_blocks=64))
        await asyncio.wait_for(worker.loading, 30)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stream = await RoundStream.open(kind, worker, channel)
            pending = ScheduledSeq("a", 0, (PENDING_TOKEN,), 3, (0,), SamplingParams(max_tokens=4), True, 1)
            for plan in (RoundPlan(1, (_seq("a"), _seq("b"), _seq("b"))),  # refused as a whole: b twice
                         RoundPlan(2, (pending, _seq("c", blocks=(1,)))),  # a's pending decode of round 1
                         RoundPlan(3, (_seq("d", blocks=(2,)),))):
                await stream.write(convert.plan_to_proto(plan))
            refused, behind, later = [await stream.read() for _ in range(3)]
            assert refused.round_id == 1 and not refused.outputs
            assert refused.error.startswith("INVALID_ARGUMENT (seqs[2].request_id)")
            assert (behind.round_id, behind.error, [o.request_id for o in behind.outputs]) == (2, "", ["c"])
            assert (later.round_id, later.error, [o.request_id for o in later.outputs]) == (3, "", ["d"])
            assert worker.runtime.metrics.round_errors._value.get() == 1
            await stream.done_writing()
        await worker.stop()
    asyncio.run(body())


@pytest.mark.parametrize("kind", KINDS)
def test_one_bad_sequence_on_the_stream_is_refused_alone_and_its_pending_decode_behind_it_dropped(kind: str) -> None:
    """On ExecuteStream (and the round link), a round whose middle sequence has an out-of-range token id runs its other sequences (they
    get their outputs) and names the bad one in `refused` with its field and INVALID_ARGUMENT message; the pipelined
    round queued behind it decodes a's pending token and drops b's (nothing was sampled for b); the refusal is
    counted by field."""
    async def body() -> None:
        worker = await start_worker_server(WorkerRuntime(lambda: CostModel("llama-3-8b", "h200"), num_blocks=64))
        await asyncio.wait_for(worker.loading, 30)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stream = await RoundStream.open(kind, worker, channel)
            decode = {rid: ScheduledSeq(rid, 0, (PENDING_TOKEN,), 3, (block,), SamplingParams(max_tokens=4), True, 1)
                      for rid, block in (("a", 0), ("b", 1), ("c", 2))}
            for plan in (RoundPlan(1, (_seq("a"), _seq("b", tokens=(1, 10**9, 2), blocks=(1,)),
                                       _seq("c", blocks=(2,)))),
                         RoundPlan(2, (decode["a"], decode["b"], decode["c"])),  # queued before round 1 answers
                         RoundPlan(3, (_seq("d", blocks=(3,)),))):
                await stream.write(convert.plan_to_proto(plan))
            first, behind, later = [convert.result_from_proto(await stream.read()) for _ in range(3)]
            assert (first.round_id, first.error, [o.request_id for o in first.outputs]) == (1, "", ["a", "c"])
            assert all(len(o.token_ids) == 1 for o in first.outputs)
            (refused,) = first.refused
            assert (refused.request_id, refused.field_name) == ("b", "seqs[1].token_ids")
            assert refused.detail == "INVALID_ARGUMENT (seqs[1].token_ids): seqs[1].token_ids: token id 1000000000 " \
                                     "is outside 0..128255"
            assert (behind.round_id, behind.error, behind.refused) == (2, "", ())
            assert [o.request_id for o in behind.outputs] == ["a", "c"]
            assert (later.round_id, later.error, [o.request_id for o in later.outputs]) == (3, "", ["d"])
            assert worker.runtime.metrics.round_errors._value.get() == 0
            assert worker.runtime.metrics.refused_seqs.labels("token_ids")._value.get() == 1
            await stream.done_writing()
        await worker.stop()
    asyncio.run(body())


@pytest.mark.parametrize("kind", KINDS)
def test_a_round_whose_every_sequence_is_refused_answers_without_running(kind: str) -> None:
    """A stream round whose only sequence is refused answers at once with it in `refused` and no outputs (nothing
    reaches the backend), and the stream serves the next round."""
    async def body() -> None:
        worker = await start_worker_server(WorkerRuntime(lambda: CostModel("tiny", "h200")))
        await asyncio.wait_for(worker.loading, 30)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stream = await RoundStream.open(kind, worker, channel)
            bad = ScheduledSeq("x", 0, (1,), 0, (0,), SamplingParams(max_tokens=4, temperature=float("nan")), True, 0)
            for plan in (RoundPlan(1, (bad,)), RoundPlan(2, (_seq(),))):
                await stream.write(convert.plan_to_proto(plan))
            alone, next_round = [convert.result_from_proto(await stream.read()) for _ in range(2)]
            assert alone.outputs == () and alone.error == ""
            assert [(r.request_id, r.field_name) for r in alone.refused] == [("x", "seqs[0].sampling.temperature")]
            assert isinstance(alone.refused[0], RefusedSeq) and next_round.outputs and not next_round.refused
            await stream.done_writing()
        await worker.stop()
    asyncio.run(body())
