"""Both sides of a KV hand-off at the scheduler service: a prefill replica "p" and a decode replica "d", each a real
cost-model worker and scheduler on loopback, publishing on a real Redis (no router, no admission: the test plays
admission's part with the two Submits a pair gets)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import redis.asyncio as aioredis

from scheduler_svc.server import RunningReplica, start_replica
from sluice.bus import Bus
from sluice.types import KV_HELD
from sluice.v1 import common_pb2, events_pb2, scheduler_pb2, scheduler_pb2_grpc
from worker_svc.costmodel import CostCoefficients, CostModel
from worker_svc.server import RunningWorker, WorkerRuntime, start_worker_server

pytestmark = pytest.mark.redis

PROMPT = list(range(1, 41))  # 2 full blocks of 16 and 8 tokens in a third


@dataclass
class Side:
    replica: RunningReplica
    stub: scheduler_pb2_grpc.SchedulerServiceStub
    worker: RunningWorker
    address: str


@contextlib.asynccontextmanager
async def _pair(redis_url: str, namespace: str, decode_blocks: int = 64, decode_round_s: float = 0.0,
                room_wait_s: float = 5.0) -> AsyncIterator[tuple[Side, Side, Bus]]:
    """The two replicas; `decode_round_s` adds that much to each of the decode worker's (emulated) rounds;
    `room_wait_s`: the decode side's --kv-room-wait."""
    client = aioredis.Redis.from_url(redis_url)
    bus = Bus(client, namespace)
    sides = []
    for replica_id, blocks, overhead in (("p", 64, 0.0005), ("d", decode_blocks, 0.0005 + decode_round_s)):
        model = CostModel("llama-3-8b", "h200", coefficients=CostCoefficients(overhead_s=overhead))
        worker = await start_worker_server(WorkerRuntime(lambda model=model: model, num_blocks=blocks,  # type: ignore[misc]
                                                         emulate_time=True))
        replica = await start_replica(replica_id=replica_id, worker_address=f"127.0.0.1:{worker.port}", bus=bus,
                                      core_overrides={"max_model_len": 4096}, kv_room_wait_s=room_wait_s)
        address = f"127.0.0.1:{replica.port}"
        sides.append(Side(replica, scheduler_pb2_grpc.SchedulerServiceStub(grpc.aio.insecure_channel(address)),
                          worker, address))
    try:
        yield sides[0], sides[1], bus
    finally:
        for side in sides:
            await side.replica.stop(drain_timeout_s=2)
            await side.worker.stop()
        await client.aclose()


def _submit(request_id: str, prompt: list[int], max_tokens: int, **fields: object) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(request_id=request_id, tenant="t", owner="adm-1", prompt_token_ids=prompt,
                                       sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                       **fields)  # type: ignore[arg-type]


async def _completion(bus: Bus, request_id: str, timeout: float = 20.0) -> events_pb2.Completion:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        for _, payload, _ in await bus.read_stream("completions", "0", count=10_000, block_ms=50):
            completion = events_pb2.Completion.FromString(payload)
            if completion.request_id == request_id:
                return completion
    raise AssertionError(f"no completion for {request_id}")


async def _tokens(bus: Bus, request_id: str) -> list[int]:
    """Return a request's streamed tokens (tokens:adm-1), each index once and in order."""
    tokens: list[int] = []
    for _, deltas in await bus.read_tokens(bus.tokens_stream("adm-1"), "0", count=10_000, block_ms=10):
        for delta in deltas:
            if delta.request_id == request_id:
                assert delta.index == len(tokens)
                tokens += delta.token_ids
    return tokens


def _expected(start: int, count: int) -> list[int]:
    model = CostModel("llama-3-8b")
    return [model.token_for("x", start + i) for i in range(count)]


async def _prefill(prefill: Side, bus: Bus) -> int:
    """Run the prefill half of "x" (max_tokens 1, hold_kv); return its first token."""
    await prefill.stub.Submit(_submit("x", PROMPT, 1, hold_kv=True))
    done = await _completion(bus, "x")
    assert (done.status, done.detail, done.usage.output_tokens) == (common_pb2.FINISHED_LENGTH, KV_HELD, 1)
    tokens = await _tokens(bus, "x")
    assert tokens == _expected(40, 1)
    return tokens[0]


def _decode_half(first: int, source_request: str = "x") -> scheduler_pb2.SubmitRequest:
    return _submit("x#1", [*PROMPT, first], 7, kv_source=scheduler_pb2.KvSource(
        replica_id="p", scheduler_address="", request_id=source_request))


def _counter(side: Side, name: str, **labels: str) -> float:
    value = side.replica.driver.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def test_the_decode_side_pulls_the_held_blocks_and_the_prefill_side_lets_them_go(
        redis_url: str, namespace: str, span_exporter) -> None:  # type: ignore[no-untyped-def]
    """The prefill half holds its 2 full blocks (Stats.kv_blocks_held, HeldKv); the decode half pulls them, finds them
    in its prefix cache (cached_tokens 32), gives the cost model's tokens, and the prefill side's hold is released;
    the transfer's span has transfer_started and transfer_done."""
    async def body() -> None:
        async with _pair(redis_url, namespace) as (prefill, decode, bus):
            first = await _prefill(prefill, bus)
            assert (await prefill.stub.Stats(scheduler_pb2.StatsRequest())).kv_blocks_held == 2
            held = await prefill.stub.HeldKv(scheduler_pb2.HeldKvRequest(request_id="x"))
            assert len(held.block_ids) == 2 and held.worker_address == f"127.0.0.1:{prefill.worker.port}"
            half = _decode_half(first)
            half.kv_source.scheduler_address = prefill.address
            await decode.stub.Submit(half)
            done = await _completion(bus, "x#1")
            model = CostModel("llama-3-8b")
            assert done.status == common_pb2.FINISHED_LENGTH and done.usage.cached_tokens == 32
            assert await _tokens(bus, "x#1") == _expected(41, 7)
            assert _counter(decode, "sluice_kv_transfers_total", outcome="received") == 1
            assert _counter(decode, "sluice_kv_transfer_bytes_total") == 2 * model.kv_block_bytes
            await asyncio.sleep(0.2)  # the release is sent in the background
            assert (await prefill.stub.Stats(scheduler_pb2.StatsRequest())).kv_blocks_held == 0
            assert _counter(prefill, "sluice_kv_holds_ended_total", reason="received") == 1
            [span] = [s for s in span_exporter.get_finished_spans() if s.name == "replica.kv_transfer"]
            assert [e.name for e in span.events] == ["transfer_started", "transfer_done"]
    asyncio.run(body())


def test_no_hold_at_the_source_recomputes_on_the_decode_side(redis_url: str, namespace: str) -> None:
    """A kv_source that holds nothing (HeldKv NOT_FOUND): the decode half is queued anyway and recomputes the prompt,
    with the same tokens; the outcome is counted failed."""
    async def body() -> None:
        async with _pair(redis_url, namespace) as (prefill, decode, bus):
            first = await _prefill(prefill, bus)
            half = _decode_half(first, source_request="nobody")
            half.kv_source.scheduler_address = prefill.address
            await decode.stub.Submit(half)
            done = await _completion(bus, "x#1")
            assert done.status == common_pb2.FINISHED_LENGTH and done.usage.cached_tokens == 0
            assert await _tokens(bus, "x#1") == _expected(41, 7)
            assert _counter(decode, "sluice_kv_transfers_total", outcome="failed") == 1
    asyncio.run(body())


async def _fill_decode_pool(decode: Side) -> None:
    """Submit a 120-token prompt with 8 output tokens: all 8 of the decode pool's blocks; return once it holds them."""
    await decode.stub.Submit(_submit("filler", list(range(100, 220)), 8))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while (await decode.stub.Stats(scheduler_pb2.StatsRequest())).kv_blocks_free > 0:
        assert loop.time() < deadline, "the filler never took the decode pool"
        await asyncio.sleep(0.01)


def test_no_room_on_the_decode_side_recomputes_and_releases_the_source(redis_url: str, namespace: str) -> None:
    """With --kv-room-wait 0, the decode replica's pool taken by a long request (8 of 8 blocks, 50 ms rounds): the
    transfer is not made (no_room) and not waited for, the source's hold is released at once, and the decode half
    recomputes once room frees, with the same tokens."""
    async def body() -> None:
        async with _pair(redis_url, namespace, decode_blocks=8, decode_round_s=0.05, room_wait_s=0.0) as (
                prefill, decode, bus):
            first = await _prefill(prefill, bus)
            await _fill_decode_pool(decode)
            half = _decode_half(first)
            half.kv_source.scheduler_address = prefill.address
            await decode.stub.Submit(half)
            assert _counter(decode, "sluice_kv_transfers_total", outcome="no_room") == 1
            assert _counter(decode, "sluice_kv_room_wait_seconds_count") == 0
            await asyncio.sleep(0.2)
            assert (await prefill.stub.Stats(scheduler_pb2.StatsRequest())).kv_blocks_held == 0
            done = await _completion(bus, "x#1", timeout=30)
            assert done.status == common_pb2.FINISHED_LENGTH and done.usage.cached_tokens == 0
            assert await _tokens(bus, "x#1") == _expected(41, 7)
    asyncio.run(body())


def test_a_full_decode_side_waits_for_room_then_receives_the_blocks(
        redis_url: str, namespace: str, span_exporter) -> None:  # type: ignore[no-untyped-def]
    """The decode pool full (a filler of 8 tokens, 50 ms rounds: ~0.4 s): the hand-off waits for room instead of
    recomputing, pulls the blocks once the filler ends (cached_tokens 32, tokens exact), and the wait is counted
    (room) with its span events."""
    async def body() -> None:
        async with _pair(redis_url, namespace, decode_blocks=8, decode_round_s=0.05) as (prefill, decode, bus):
            first = await _prefill(prefill, bus)
            await _fill_decode_pool(decode)
            half = _decode_half(first)
            half.kv_source.scheduler_address = prefill.address
            await decode.stub.Submit(half)
            assert _counter(decode, "sluice_kv_transfers_total", outcome="received") == 1
            assert _counter(decode, "sluice_kv_transfers_total", outcome="no_room") == 0
            assert _counter(decode, "sluice_kv_room_waits_total", outcome="room") == 1
            assert 0.05 < _counter(decode, "sluice_kv_room_wait_seconds_sum") < 5.0
            done = await _completion(bus, "x#1", timeout=30)
            assert done.status == common_pb2.FINISHED_LENGTH and done.usage.cached_tokens == 32
            assert await _tokens(bus, "x#1") == _expected(41, 7)
            [span] = [s for s in span_exporter.get_finished_spans() if s.name == "replica.kv_transfer"]
            assert [e.name for e in span.events] == ["transfer_started", "waiting_for_room", "room_found",
                                                     "transfer_done"]
    asyncio.run(body())


def test_a_wait_for_room_is_bounded_then_the_prompt_is_recomputed(redis_url: str, namespace: str) -> None:
    """--kv-room-wait 0.3 s against a filler that holds the pool for ~2.4 s (8 tokens of 300 ms rounds): the wait
    ends after ~0.3 s (timeout), the hold is released, and the decode half recomputes with the same tokens."""
    async def body() -> None:
        async with _pair(redis_url, namespace, decode_blocks=8, decode_round_s=0.3, room_wait_s=0.3) as (
                prefill, decode, bus):
            first = await _prefill(prefill, bus)
            await _fill_decode_pool(decode)
            half = _decode_half(first)
            half.kv_source.scheduler_address = prefill.address
            await decode.stub.Submit(half)
            assert _counter(decode, "sluice_kv_transfers_total", outcome="no_room") == 1
            assert _counter(decode, "sluice_kv_room_waits_total", outcome="timeout") == 1
            assert 0.25 < _counter(decode, "sluice_kv_room_wait_seconds_sum") < 1.0
            await asyncio.sleep(0.2)
            assert (await prefill.stub.Stats(scheduler_pb2.StatsRequest())).kv_blocks_held == 0
            done = await _completion(bus, "x#1", timeout=30)
            assert done.status == common_pb2.FINISHED_LENGTH and done.usage.cached_tokens == 0
            assert await _tokens(bus, "x#1") == _expected(41, 7)
    asyncio.run(body())


def test_a_prompt_shorter_than_a_block_moves_nothing(redis_url: str, namespace: str) -> None:
    """A 10-token prompt fills no block: the prefill side holds nothing and the decode side asks for nothing (outcome
    empty, not failed), computing its few tokens itself."""
    async def body() -> None:
        async with _pair(redis_url, namespace) as (prefill, decode, bus):
            await prefill.stub.Submit(_submit("s", PROMPT[:10], 1, hold_kv=True))
            done = await _completion(bus, "s")
            assert done.status == common_pb2.FINISHED_LENGTH and done.detail == ""
            [first] = await _tokens(bus, "s")
            await decode.stub.Submit(_submit("s#1", [*PROMPT[:10], first], 3, kv_source=scheduler_pb2.KvSource(
                replica_id="p", scheduler_address=prefill.address, request_id="s")))
            done = await _completion(bus, "s#1")
            assert done.status == common_pb2.FINISHED_LENGTH
            assert _counter(decode, "sluice_kv_transfers_total", outcome="empty") == 1
            assert _counter(decode, "sluice_kv_transfers_total", outcome="failed") == 0
    asyncio.run(body())
