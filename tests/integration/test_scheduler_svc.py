"""The scheduler service on loopback: a real worker (cost model), real Redis, a real router where needed."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from admission_svc.streams import entry_time_s
from router_svc.core import RouterCore
from router_svc.scoring import prefill_rounds
from router_svc.server import RouterRuntime, start_router_server
from scheduler_svc.__main__ import core_overrides, parse_args, worker_sized_overrides
from scheduler_svc.server import CoreOverrides, RunningReplica, start_replica
from sluice.bus import Bus
from sluice.prom import SchedulerMetrics
from sluice.telemetry import get_tracer, inject_metadata, read_span_file
from sluice.v1 import common_pb2, events_pb2, router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from worker_svc.costmodel import CostModel
from worker_svc.server import RunningWorker, WorkerRuntime, start_worker_server

pytestmark = pytest.mark.redis

ROUND_LINK = True
"""Whether the replicas of a test send rounds over the worker's round link (the `link_kind` fixture sets it)."""


@pytest.fixture(autouse=True, params=["round_link", "grpc_stream"])
def link_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs twice: rounds over the worker's round link, and over gRPC's ExecuteStream."""
    monkeypatch.setattr(sys.modules[__name__], "ROUND_LINK", request.param == "round_link")
    return str(request.param)


def _link_flags() -> list[str]:
    return [] if ROUND_LINK else ["--no-round-link"]


def _assert_link_used(replica: RunningReplica) -> None:
    """The rounds a replica ran went over the link the test asked for."""
    metrics = replica.driver.metrics
    if not replica.driver.link.use_stream or metrics.rounds._value.get() == 0:
        return
    kind = "round_link" if ROUND_LINK else "grpc_stream"
    assert metrics.worker_link.labels(kind)._value.get() == 1, f"rounds went over {kind}"


@dataclass
class Replica:
    replica: RunningReplica
    stub: scheduler_pb2_grpc.SchedulerServiceStub
    bus: Bus
    worker: RunningWorker
    channel: grpc.aio.Channel


@contextlib.asynccontextmanager
async def _replica(redis_url: str, namespace: str, *, num_blocks: int = 64, emulate_time: bool = False,
                   router_address: str = "", core_overrides: CoreOverrides | None = None,
                   pipeline: bool = True, use_stream: bool = True,
                   worker_max_model_len: int | None = None, prefill_pair_s: float = 0.0,
                   kv_linger_s: float = 0.0, metrics: SchedulerMetrics | None = None,
                   publish_interval_s: float = 0.0) -> AsyncIterator[Replica]:
    """A cost-model worker and a scheduler replica "r1" in front of it, publishing on a real Redis."""
    worker = await start_worker_server(WorkerRuntime(
        lambda: CostModel("llama-3-8b", "h200", max_model_len=worker_max_model_len),
        num_blocks=num_blocks, emulate_time=emulate_time))
    client = aioredis.Redis.from_url(redis_url)
    bus = Bus(client, namespace)
    replica = await start_replica(replica_id="r1", worker_address=f"127.0.0.1:{worker.port}", bus=bus,
                                  router_address=router_address, heartbeat_interval_s=0.1, pipeline=pipeline,
                                  use_stream=use_stream, prefill_pair_s=prefill_pair_s, round_link=ROUND_LINK,
                                  kv_linger_s=kv_linger_s, metrics=metrics, publish_interval_s=publish_interval_s,
                                  core_overrides=core_overrides if callable(core_overrides) else
                                  {"max_model_len": 4096, **(core_overrides or {})})
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{replica.port}")
    try:
        handle = Replica(replica, scheduler_pb2_grpc.SchedulerServiceStub(channel), bus, worker, channel)
        yield handle
        _assert_link_used(replica)
    finally:
        await replica.stop(drain_timeout_s=2)
        await channel.close()
        await handle.worker.stop()
        await client.aclose()


def _submit(request_id: str, prompt_len: int = 40, max_tokens: int = 8) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        request_id=request_id, tenant="t", owner="adm-1", prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        timestamps=common_pb2.LifecycleTimestamps(received=1.0, admitted=2.0, routed=3.0))


async def _completions(bus: Bus, want: int, timeout: float = 10.0) -> list[events_pb2.Completion]:
    got: list[events_pb2.Completion] = []
    last = "0"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(got) < want and loop.time() < deadline:
        for entry_id, payload, _ in await bus.read_stream("completions", last, block_ms=50):
            last = entry_id
            got.append(events_pb2.Completion.FromString(payload))
    return got


async def _tokens(bus: Bus, owner: str = "adm-1") -> list[events_pb2.TokenDelta]:
    return [delta for _, deltas in await bus.read_tokens(bus.tokens_stream(owner), "0", count=10_000, block_ms=10)
            for delta in deltas]


async def _output_tokens(bus: Bus, request_id: str) -> list[int]:
    """Return a request's streamed output tokens, checking that each index was sent once and in order."""
    tokens: list[int] = []
    for delta in await _tokens(bus):
        if delta.request_id == request_id:
            assert delta.index == len(tokens), "each output token is streamed once, in order"
            tokens += delta.token_ids
    return tokens


async def _kv_event_kinds(bus: Bus, replica_id: str = "r1") -> list[str]:
    return [str(event.WhichOneof("kind"))
            for _, payload, _ in await bus.read_stream(bus.kv_stream(replica_id), "0", count=10_000, block_ms=10)
            for event in events_pb2.KvEventBatch.FromString(payload).events]


def test_submit_streams_tokens_and_a_complete_completion(redis_url: str, namespace: str) -> None:
    """A submitted request's tokens arrive in order on tokens:{owner}, followed by a FINISHED_LENGTH completion
    with usage and every lifecycle timestamp (the caller's and the replica's, in order)."""
    async def body() -> None:
        async with _replica(redis_url, namespace) as r:
            await r.stub.Submit(_submit("a", max_tokens=8))
            [done] = await _completions(r.bus, 1)
            deltas = await _tokens(r.bus)
            indices = [d.index + i for d in deltas for i in range(len(d.token_ids))]
            assert indices == list(range(8)) and all(d.request_id == "a" for d in deltas)
            assert all(d.created_unix_s > 0 for d in deltas)
            assert (done.request_id, done.status, done.finish_reason, done.owner, done.replica_id) == (
                "a", common_pb2.FINISHED_LENGTH, "length", "adm-1", "r1")
            assert (done.usage.input_tokens, done.usage.output_tokens) == (40, 8)
            ts = done.timestamps
            assert (ts.received, ts.admitted, ts.routed) == (1.0, 2.0, 3.0)
            assert 0 < ts.enqueued <= ts.first_scheduled <= ts.first_token <= ts.finished <= ts.kv_released
    asyncio.run(body())


def test_pipelined_and_serial_loops_stream_the_same_tokens(redis_url: str, namespace: str) -> None:
    """The pipelined loop (rounds planned ahead on pending tokens) streams exactly the serial loop's tokens and
    completions, and rounds were really planned ahead (sluice_rounds_ahead); the serial loop plans none."""
    async def run(pipeline: bool, space: str) -> tuple[dict[str, list[int]], int]:
        async with _replica(redis_url, space, pipeline=pipeline) as r:
            for i in range(4):
                await r.stub.Submit(_submit(f"p{i}", prompt_len=20 + i, max_tokens=6 + i))
            done = await _completions(r.bus, 4)
            assert sorted(c.status for c in done) == [common_pb2.FINISHED_LENGTH] * 4
            tokens = {f"p{i}": await _output_tokens(r.bus, f"p{i}") for i in range(4)}
            ahead = r.replica.driver.metrics.rounds_ahead._value.get()
        return tokens, int(ahead)

    async def body() -> None:
        piped, ahead = await run(True, namespace + "-p")
        serial, none_ahead = await run(False, namespace + "-s")
        assert piped == serial and all(len(piped[f"p{i}"]) == 6 + i for i in range(4))
        assert ahead > 0 and none_ahead == 0
    asyncio.run(body())


def test_the_attention_charge_is_counted_and_the_prompt_still_completes(redis_url: str, namespace: str) -> None:
    """With an attention charge configured (every pair past 32 tokens of context costs 1/64 of a token), a
    300-token prompt's later chunks pay for their attention: sluice_attention_charged_tokens_total counts it, and
    the request still finishes whole. Without the charge the counter stays 0 on the same request."""
    async def run(space: str, overrides: dict[str, object]) -> float:
        async with _replica(redis_url, space, core_overrides={"max_num_batched_tokens": 128, **overrides}) as r:
            await r.stub.Submit(_submit("deep", prompt_len=300, max_tokens=4))
            done = await _completions(r.bus, 1)
            assert done[0].status == common_pb2.FINISHED_LENGTH and done[0].usage.output_tokens == 4
            return float(r.replica.driver.metrics.attention_tokens._value.get())

    async def body() -> None:
        charged = await run(namespace + "-c", {"attention_pairs_per_token": 64, "attention_free_context": 32})
        free = await run(namespace + "-f", {})
        assert charged > 0 and free == 0
    asyncio.run(body())


def test_the_attention_charge_is_sized_for_the_workers_model_length(redis_url: str, namespace: str) -> None:
    """The scheduler's main sizes the charge it derives from --tpot-slo-ms for the deepest chunk the worker's model
    takes (its Info's max_model_len), not for a 131,072-token context: with these rates a 4,096-token model needs no
    charge at all, and a 131,072-token one gets the rate derived for that depth."""
    options = parse_args(["--replica-id", "r1", "--worker", "w:1", "--tpot-slo-ms", "50", "--prefill-tokens-per-s",
                          "10000", "--decode-round-s", "0.01", "--prefill-pair-s", "1e-9"])

    async def charge(space: str, model_len: int) -> int | None:
        async with _replica(redis_url, space, worker_max_model_len=model_len,
                            core_overrides=worker_sized_overrides(options)) as r:
            config = r.replica.driver.core.config
            assert config.max_model_len == model_len
            return config.attention_pairs_per_token

    async def body() -> None:
        assert await charge(namespace + "-short", 4096) is None
        deep = await charge(namespace + "-long", 131072)
        assert deep is not None and deep == core_overrides(options, 131072)["attention_pairs_per_token"]
    asyncio.run(body())


def test_a_kv_read_rate_gives_the_service_a_derived_seat_cap_that_stats_reports(redis_url: str, namespace: str) -> None:
    """With --tpot-slo-ms and --kv-read-s-per-token the service runs with the seats and the KV-read budget derived for
    the worker's model length (not --max-num-seqs 48), and Stats says so; without the rate it keeps 48."""
    flags = ["--replica-id", "r1", "--worker", "w:1", "--tpot-slo-ms", "50", "--prefill-tokens-per-s", "40000",
             "--decode-round-s", "0.006", "--max-num-seqs", "48"]

    async def seats(space: str, extra: list[str]) -> tuple[int, int, int | None]:
        options = parse_args([*flags, *extra])
        async with _replica(redis_url, space, worker_max_model_len=4096,
                            core_overrides=worker_sized_overrides(options)) as r:
            stats = await r.stub.Stats(scheduler_pb2.StatsRequest())
            return stats.max_num_seqs, r.replica.driver.core.config.max_num_seqs, \
                r.replica.driver.core.config.max_kv_read_tokens

    async def body() -> None:
        derived = core_overrides(parse_args([*flags, "--kv-read-s-per-token", "27e-9"]), 4096)
        assert await seats(namespace + "-kv", ["--kv-read-s-per-token", "27e-9"]) == (
            derived["max_num_seqs"], derived["max_num_seqs"], derived["max_kv_read_tokens"])
        assert derived["max_num_seqs"] == 480
        assert (await seats(namespace + "-plain", []))[:2] == (48, 48)
    asyncio.run(body())


@pytest.mark.parametrize(("flag", "named"), [("--seat-context=0", "--seat-context"),
                                              ("--kv-read-s-per-token=nan", "--kv-read-s-per-token"),
                                              ("--kv-read-s-per-token=-1e-9", "--kv-read-s-per-token"),
                                              ("--host-load-blocks=-1", "--host-load-blocks"),
                                              ("--host-page-out-blocks=-1", "--host-page-out-blocks")])
def test_bad_round_flags_refuse_the_start_before_any_worker_answers(flag: str, named: str) -> None:
    """A bad seat context or KV-read rate ends the scheduler at once with exit status 2 and a line naming the flag,
    no traceback: it does not wait for a worker (none listens on port 1) to find out."""
    done = subprocess.run([sys.executable, "-m", "scheduler_svc", "--replica-id", "r", "--worker", "127.0.0.1:1",
                           "--tpot-slo-ms", "50", flag], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2], check=False)
    assert done.returncode == 2, done.stderr
    assert f"scheduler cannot start: {named}" in done.stderr and "Traceback" not in done.stderr


async def _first_token_of(bus: Bus, request_id: str) -> bool:
    return any(d.request_id == request_id for d in await _tokens(bus))


@pytest.mark.parametrize(("pipeline", "use_stream"), [(True, True), (False, True), (False, False)],
                         ids=["pipelined", "serial-stream", "serial-unary"])
def test_a_sequence_the_worker_refuses_fails_its_request_only_and_the_replica_keeps_serving(
        redis_url: str, namespace: str, pipeline: bool, use_stream: bool) -> None:
    """A sequence the worker refuses with INVALID_ARGUMENT (here: positions past the worker's max_model_len, which
    the scheduler believes larger) fails its request only, FAILED with the refusal (field and message) in the
    detail: the request that shared its round decodes on to the end, the worker is never marked lost, no round
    fails as a whole, and requests before and after finish (pipelined, serial, unary)."""
    async def body() -> None:
        async with _replica(redis_url, namespace, num_blocks=256, emulate_time=True, pipeline=pipeline,
                            use_stream=use_stream, worker_max_model_len=256) as r:
            await r.stub.Submit(_submit("ok1", max_tokens=4))
            await _completions(r.bus, 1)
            await r.stub.Submit(_submit("bad1", prompt_len=300, max_tokens=4))  # a round of its own
            await _completions(r.bus, 2)
            await r.stub.Submit(_submit("long", max_tokens=64))
            await _wait_for(lambda: _first_token_of(r.bus, "long"))
            await r.stub.Submit(_submit("bad2", prompt_len=300, max_tokens=4))  # planned with long's decodes
            await _completions(r.bus, 4)
            await r.stub.Submit(_submit("ok2", max_tokens=4))
            done = {c.request_id: c for c in await _completions(r.bus, 5)}
            # long shared bad2's round: only bad2's sequence was refused, long ran on in it and after it
            assert {rid: done[rid].status for rid in ("ok1", "ok2", "long")} == dict.fromkeys(
                ("ok1", "ok2", "long"), common_pb2.FINISHED_LENGTH)
            assert len(await _output_tokens(r.bus, "long")) == 64
            for rid in ("bad1", "bad2"):
                assert done[rid].status == common_pb2.FAILED, rid
                assert "INVALID_ARGUMENT (seqs[" in done[rid].detail, rid
                assert ".start_position): " in done[rid].detail and "outside the model's" in done[rid].detail, rid
            assert r.replica.driver.worker_serving and not r.replica.driver.worker_changed.is_set()
            assert r.replica.driver.metrics.round_errors._value.get() == 0  # no round failed as a whole
    asyncio.run(body())


def test_a_long_prompts_chunks_are_planned_ahead_live(redis_url: str, namespace: str) -> None:
    """A 40-token prompt in 8-token chunks is planned ahead chunk after chunk on the pipelined loop (every round
    but the first: 5 chunks and 3 decodes), and streams the serial loop's tokens."""
    async def run(pipeline: bool, space: str) -> tuple[list[int], int]:
        async with _replica(redis_url, space, pipeline=pipeline, core_overrides={"max_prefill_chunk": 8}) as r:
            await r.stub.Submit(_submit("long", prompt_len=40, max_tokens=4))
            [done] = await _completions(r.bus, 1)
            assert done.status == common_pb2.FINISHED_LENGTH
            return await _output_tokens(r.bus, "long"), int(r.replica.driver.metrics.rounds_ahead._value.get())

    async def body() -> None:
        piped, ahead = await run(True, namespace + "-p")
        serial, _ = await run(False, namespace + "-s")
        assert piped == serial and len(piped) == 4
        assert ahead == 7, "rounds 2-8 of 8 were planned while the one before was in flight"
    asyncio.run(body())


def test_big_rounds_publish_after_the_next_plan_in_order_and_complete(redis_url: str, namespace: str) -> None:
    """With every round's publication deferred until the next plan is sent (the big-round path), each
    request's tokens still arrive complete, in order, and no later than its completion."""
    async def body() -> None:
        async with _replica(redis_url, namespace, num_blocks=512) as r:
            r.replica.driver.publish_first_max_tokens = 0
            await asyncio.gather(*(r.stub.Submit(_submit(f"q{i}", prompt_len=20, max_tokens=12)) for i in range(40)))
            done = await _completions(r.bus, 40)
            assert sorted(c.request_id for c in done) == sorted(f"q{i}" for i in range(40))
            assert all(c.status == common_pb2.FINISHED_LENGTH for c in done)
            entries = await r.bus.read_tokens(r.bus.tokens_stream("adm-1"), "0", count=100_000, block_ms=10)
            seen: dict[str, list[int]] = {}
            last_ms: dict[str, int] = {}
            for entry_id, deltas in entries:
                for delta in deltas:
                    seen.setdefault(delta.request_id, []).extend(range(delta.index, delta.index + len(delta.token_ids)))
                    last_ms[delta.request_id] = int(entry_id.split("-")[0])
            assert all(seen[c.request_id] == list(range(12)) for c in done)
            completions = await r.bus.read_stream("completions", "0", count=1000, block_ms=10)
            for entry_id, payload, _ in completions:
                request_id = events_pb2.Completion.FromString(payload).request_id
                assert last_ms[request_id] <= int(entry_id.split("-")[0])
    asyncio.run(body())


def test_small_rounds_tokens_go_to_redis_before_the_round_after_next_is_planned(redis_url: str,
                                                                               namespace: str) -> None:
    """On the pipelined loop, when the next round is already queued at the worker, a small round's tokens are
    handed to Redis before the round after it is sent (the client's tokens do not wait for a plan the device
    does not need yet); the tokens still arrive complete and in order."""
    async def body() -> None:
        async with _replica(redis_url, namespace, emulate_time=True) as r:
            driver = r.replica.driver
            log: list[str] = []
            send, receive, append = driver.link.send, driver.link.receive, driver.publisher.bus.append

            async def sending(plan, *args, **kwargs):  # type: ignore[no-untyped-def]
                log.append("send")
                return await send(plan, *args, **kwargs)

            async def receiving(round_id):  # type: ignore[no-untyped-def]
                result = await receive(round_id)
                log.append("answer" if result is not None and any(o.token_ids for o in result.outputs) else "idle")
                return result

            async def publishing(entries):  # type: ignore[no-untyped-def]
                if any(":tokens:" in entry.key for entry in entries):
                    log.append("publish")
                return await append(entries)

            driver.link.send, driver.link.receive = sending, receiving  # type: ignore[method-assign]
            driver.publisher.bus.append = publishing  # type: ignore[method-assign]
            # 20 rounds: enough answers read while the next round was queued (a full-suite run with 8 saw only 4
            # such answers, publishing first in 3: the loop's timing under load decides how many there are).
            await r.stub.Submit(_submit("a", max_tokens=20))
            [done] = await _completions(r.bus, 1)
            assert done.status == common_pb2.FINISHED_LENGTH
            assert await _output_tokens(r.bus, "a") and len(await _output_tokens(r.bus, "a")) == 20
            # After an answer with tokens read while the next round was queued (a send just before it), the
            # publisher goes first: the next send (if any, before the next answer) follows a publish, unless the
            # publisher was still busy with the round before's XADD (then nothing could go sooner). The loop
            # without that yield publishes after the send every time.
            ahead = first = 0
            for i, what in enumerate(log):
                if what != "answer" or log[i - 1] != "send":
                    continue
                after = log[i + 1:]
                upto = after[:after.index("answer")] if "answer" in after else after
                if "send" in upto:
                    ahead += 1
                    first += "publish" in upto[:upto.index("send")]
            assert ahead >= 5 and first >= ahead // 2 + 1, " ".join(log)
    asyncio.run(body())


@pytest.mark.parametrize("linger_s", [0.0, 30.0])
def test_with_a_kv_linger_a_requests_kv_events_go_out_as_one_entry_with_its_completion(
        redis_url: str, namespace: str, linger_s: float) -> None:
    """--kv-linger-ms reaches the publisher: with a linger longer than the request, every KV event its rounds made
    goes out as one `kv` entry, with its completion, in event-id order; without one, they take several entries."""
    async def body() -> list[list[int]]:
        async with _replica(redis_url, namespace, emulate_time=True, kv_linger_s=linger_s) as r:
            await r.stub.Submit(_submit("a", prompt_len=40, max_tokens=60))
            [done] = await _completions(r.bus, 1)
            assert done.status == common_pb2.FINISHED_LENGTH
            entries: Any = await r.bus.client.xrange(r.bus.key(r.bus.kv_stream("r1")))
            return [[e.event_id for e in events_pb2.KvEventBatch.FromString(fields[b"p"]).events]
                    for _, fields in entries]

    published = asyncio.run(body())
    ids = [event_id for entry in published for event_id in entry]
    assert len(ids) >= 5 and ids == sorted(ids) and len(set(ids)) == len(ids), published
    if linger_s:
        assert len(published) == 1, published
    else:
        assert len(published) > 1, published


@pytest.mark.parametrize("interval_s", [0.0, 5.0])
def test_a_publication_interval_merges_rounds_tokens_but_never_holds_a_first_token(
        redis_url: str, namespace: str, interval_s: float) -> None:
    """--publish-interval-ms reaches the publisher: with an interval longer than the requests (~5 ms rounds, emulated),
    rounds' tokens wait and go out merged, each request's as one delta, every token once and in order; but a request's
    first tokens (its first rounds') go out at once ("b" starts while "a" decodes, inside an interval: not held until
    "a"'s completion ends the wait), and so does a completion. With no interval every round's tokens go out on their
    own."""
    async def body() -> tuple[list[tuple[float, list[events_pb2.TokenDelta]]], dict[str, events_pb2.Completion]]:
        metrics = SchedulerMetrics()
        async with _replica(redis_url, namespace, emulate_time=True, publish_interval_s=interval_s,
                            metrics=metrics) as r:
            await r.stub.Submit(_submit("a", prompt_len=40, max_tokens=80))
            while not await _tokens(r.bus):
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.03)  # "b" starts while "a" decodes: its first token falls inside an interval
            await r.stub.Submit(_submit("b", prompt_len=40, max_tokens=40))
            done = {c.request_id: c for c in await _completions(r.bus, 2)}
            entries = [(entry_time_s(entry_id), deltas) for entry_id, deltas in
                       await r.bus.read_tokens(r.bus.tokens_stream("adm-1"), "0", count=10_000, block_ms=10)]
            spaced = metrics.registry.get_sample_value("sluice_publications_spaced_total") or 0.0
            assert (spaced > 0) == (interval_s > 0), spaced
            return entries, done

    entries, done = asyncio.run(body())
    for request_id, want in (("a", 80), ("b", 40)):
        deltas = [d for _, ds in entries for d in ds if d.request_id == request_id]
        assert [d.index for d in deltas] == list(itertools.accumulate([0] + [len(d.token_ids) for d in deltas[:-1]]))
        assert sum(len(d.token_ids) for d in deltas) == want == done[request_id].usage.output_tokens
        first_at = next(at for at, ds in entries if any(d.request_id == request_id and d.index == 0 for d in ds))
        assert first_at - done[request_id].timestamps.first_token < 0.15, (request_id, interval_s)
    widest = max(len(d.token_ids) for _, ds in entries for d in ds)
    if interval_s:
        # ~120 rounds in ~0.6 s go out in the few publications the requests' first rounds (4 each) and ends make
        assert len(entries) <= 12 and widest >= 20, (len(entries), widest)
        firsts = [[(d.index, len(d.token_ids)) for d in ds if d.request_id == "a"] for _, ds in entries[:4]]
        assert firsts == [[(0, 1)], [(1, 1)], [(2, 1)], [(3, 1)]], firsts  # "a"'s first 4 rounds, each at once
    else:
        assert len(entries) >= 60 and widest <= 3, (len(entries), widest)


def test_a_submit_wakes_the_idle_loop_at_once_and_an_idle_loop_runs_no_rounds(redis_url: str, namespace: str) -> None:
    """An idle replica runs no rounds while it waits; each new request wakes it at once (its first round is
    scheduled within a few ms of its enqueue), every time, and stopping wakes it too (the fixture returns)."""
    def rounds(r: Replica) -> float:
        samples = r.replica.driver.metrics.round_duration.collect()[0].samples
        return next(s.value for s in samples if s.name.endswith("_count"))

    async def body() -> None:
        async with _replica(redis_url, namespace) as r:
            for i in range(3):
                before = rounds(r)
                await asyncio.sleep(0.2)  # idle: the loop sleeps on its one future
                assert rounds(r) == before
                await r.stub.Submit(_submit(f"w{i}", max_tokens=2))
                done = (await _completions(r.bus, i + 1))[-1]
                assert done.request_id == f"w{i}" and done.status == common_pb2.FINISHED_LENGTH
                assert 0 <= done.timestamps.first_scheduled - done.timestamps.enqueued < 0.05
    asyncio.run(body())


def test_cancel_mid_run_frees_every_kv_block(redis_url: str, namespace: str) -> None:
    """Cancelling a request while it decodes ends it CANCELLED with fewer tokens than asked, and Stats then
    shows no KV block in use."""
    async def body() -> None:
        async with _replica(redis_url, namespace, num_blocks=256, emulate_time=True) as r:
            await r.stub.Submit(_submit("long", prompt_len=100, max_tokens=2000))
            for _ in range(500):
                if await _tokens(r.bus):
                    break
                await asyncio.sleep(0.01)
            busy = await r.stub.Stats(scheduler_pb2.StatsRequest())
            assert busy.running == 1 and busy.kv_blocks_used > 0
            reply = await r.stub.Cancel(scheduler_pb2.CancelRequest(request_id="long"))
            assert reply.status in (common_pb2.CANCELLING, common_pb2.CANCELLED)
            [done] = await _completions(r.bus, 1)
            assert done.status == common_pb2.CANCELLED and 0 < done.usage.output_tokens < 2000
            assert done.timestamps.cancel_requested > 0 and done.timestamps.kv_released > 0
            stats = await r.stub.Stats(scheduler_pb2.StatsRequest())
            assert (stats.kv_blocks_used, stats.running, stats.waiting, stats.cancelled) == (0, 0, 0, 1)
            assert stats.kv_blocks_free + stats.kv_blocks_cached == stats.kv_blocks_total  # cached = reusable
    asyncio.run(body())


def test_kv_events_are_published_with_monotonic_ids(redis_url: str, namespace: str) -> None:
    """KV event batches on the `kv` stream carry ids 1, 2, 3... with no gap or repeat, and KvSnapshot reports
    the last of them with the cached hashes the STORED events announced."""
    async def body() -> None:
        async with _replica(redis_url, namespace) as r:
            for i in range(4):
                await r.stub.Submit(_submit(f"k{i}", prompt_len=50 + 16 * i, max_tokens=4))
            await _completions(r.bus, 4)
            await r.replica.driver.flush()
            ids, stored = [], set()
            for _, payload, _ in await r.bus.read_stream(r.bus.kv_stream("r1"), "0", count=10_000, block_ms=10):
                batch = events_pb2.KvEventBatch.FromString(payload)
                assert batch.replica_id == "r1"
                for event in batch.events:
                    ids.append(event.event_id)
                    stored.update(event.block_stored.block_hashes)
            assert ids == list(range(1, len(ids) + 1)) and ids
            snap = await r.stub.KvSnapshot(scheduler_pb2.KvSnapshotRequest())
            assert snap.last_event_id == ids[-1]
            assert set(snap.block_hashes) <= stored and snap.block_hashes
    asyncio.run(body())


def test_the_host_prefix_tier_copies_evicted_blocks_out_and_back_live(redis_url: str, namespace: str) -> None:
    """With host_prefix_cache on an 8-block replica, a finished prompt's cached blocks are copied to host blocks by
    the next request's rounds (CPU STORED events on the kv stream, host hashes in KvSnapshot); a longer prompt then
    evicts them from the device, and they are copied back for the first one's repeat, which
    counts them as host hits and completes (that the copies hold the right KV is the torch engine's test:
    tests/unit/test_engine_with_scheduler.py)."""
    def submit(request_id: str, prompt: list[int]) -> scheduler_pb2.SubmitRequest:
        request = _submit(request_id, max_tokens=4)
        request.prompt_token_ids[:] = prompt
        return request

    metrics = SchedulerMetrics()

    async def body() -> None:
        async with _replica(redis_url, namespace, num_blocks=8, core_overrides={"host_prefix_cache": True},
                            metrics=metrics) as r:
            first = list(range(1, 41))
            await r.stub.Submit(submit("a", first))
            await _completions(r.bus, 1)
            await r.stub.Submit(submit("x", list(range(300, 320))))  # from the free blocks: a's are copied out
            await _completions(r.bus, 2)
            await r.stub.Submit(submit("b", list(range(500, 620))))  # 120 + 4 tokens: every block of the replica
            await _completions(r.bus, 3)
            await r.stub.Submit(submit("c", first))
            await _completions(r.bus, 4)
            await r.replica.driver.flush()
            mediums = {(event.WhichOneof("kind"), getattr(event, str(event.WhichOneof("kind"))).medium)
                       for _, payload, _ in await r.bus.read_stream(r.bus.kv_stream("r1"), "0", count=10_000,
                                                                    block_ms=10)
                       for event in events_pb2.KvEventBatch.FromString(payload).events
                       if event.WhichOneof("kind") != "all_blocks_cleared"}
            assert ("block_stored", "CPU") in mediums
            stats = r.replica.driver.core.stats()
            assert stats.host_hit_tokens == 32, "a's two full prompt blocks came back from the host"
            snap = await r.stub.KvSnapshot(scheduler_pb2.KvSnapshotRequest())
            assert len(snap.host_block_hashes) == stats.host_blocks_cached > 0
            assert len(await _output_tokens(r.bus, "c")) == 4
            sample = metrics.registry.get_sample_value
            assert sample("sluice_host_prefix_hit_tokens_total") == 32
            assert sample("sluice_host_blocks_cached") == stats.host_blocks_cached
            assert sample("sluice_host_blocks_used") == stats.host_blocks_used >= stats.host_blocks_cached
    asyncio.run(body())


def test_host_prefix_cache_without_host_blocks_refuses_the_start_naming_both_flags(
        free_port: Callable[[], int], subprocess_env: dict[str, str], redis_url: str) -> None:
    """--host-prefix-cache against a worker with no host blocks ends the scheduler with exit status 2 and a line
    naming --host-prefix-cache and the worker's --host-blocks, no traceback."""
    worker_port, env = free_port(), subprocess_env
    worker = subprocess.Popen([sys.executable, "-m", "worker_svc", "--backend", "costmodel", "--port", str(worker_port),
                               "--host-blocks", "0", "--metrics-port", "0"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        done = subprocess.run([sys.executable, "-m", "scheduler_svc", "--replica-id", "r", "--worker",
                               f"127.0.0.1:{worker_port}", "--host-prefix-cache", "--port", "0", "--metrics-port", "0",
                               "--redis-url", redis_url],
                              capture_output=True, text=True, timeout=120, env=env, check=False)
    finally:
        worker.kill()
        worker.wait()
    assert done.returncode == 2, done.stderr
    assert "--host-prefix-cache needs host blocks" in done.stderr and "--host-blocks" in done.stderr
    assert "Traceback" not in done.stderr
    # A negative count of host blocks ends the worker itself the same way, naming its flag.
    refused = subprocess.run([sys.executable, "-m", "worker_svc", "--backend", "costmodel", "--port", "0",
                              "--host-blocks", "-1", "--metrics-port", "0"], capture_output=True, text=True,
                             timeout=120, env=env, check=False)
    assert refused.returncode == 2 and "--host-blocks must be >= 0, got -1" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr


def test_rejections_map_to_precise_statuses(redis_url: str, namespace: str) -> None:
    """A prompt that can never fit the replica's KV is INVALID_ARGUMENT, a duplicate id ALREADY_EXISTS, and a
    negative stream_interval INVALID_ARGUMENT naming it."""
    async def body() -> None:
        async with _replica(redis_url, namespace, num_blocks=8, emulate_time=True) as r:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await r.stub.Submit(_submit("huge", prompt_len=200, max_tokens=8))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "blocks" in err.value.details()
            await r.stub.Submit(_submit("dup", max_tokens=80))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await r.stub.Submit(_submit("dup"))
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            await r.stub.Cancel(scheduler_pb2.CancelRequest(request_id="dup"))
            negative = _submit("neg")
            negative.stream_interval = -3
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await r.stub.Submit(negative)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stream_interval" in err.value.details()
    asyncio.run(body())


def test_replica_span_continues_the_submit_trace(redis_url: str, namespace: str,
                                                  span_exporter) -> None:  # type: ignore[no-untyped-def]
    """The replica's span for a request is a child of the trace sent in Submit metadata and records its
    stages as events, with GenAI usage attributes."""
    async def body() -> None:
        async with _replica(redis_url, namespace) as r:
            with get_tracer("test").start_as_current_span("admission") as parent:
                await r.stub.Submit(_submit("traced", max_tokens=3), metadata=inject_metadata())
            await _completions(r.bus, 1)
        [span] = [s for s in span_exporter.get_finished_spans() if s.name == "replica.request"]
        assert span.context.trace_id == parent.get_span_context().trace_id
        names = [e.name for e in span.events]
        assert names[:3] == ["enqueued", "first_scheduled", "prefill_chunk"]
        assert {"first_token", "finished", "kv_released"} <= set(names)
        assert span.attributes["gen_ai.usage.output_tokens"] == 3
        assert span.attributes["gen_ai.response.finish_reasons"] == ("length",)
    asyncio.run(body())


def test_replica_registers_turns_ready_and_drains_at_the_router(redis_url: str, namespace: str) -> None:
    """A replica registers with the worker's capacity and becomes READY; a Drain at the router makes it DRAINING
    there, reaches the replica in its heartbeat reply, and the replica retires: removed from the router, its
    gRPC health turned from SERVING to NOT_SERVING."""
    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        runtime = RouterRuntime(RouterCore(), Bus(client, namespace), "router-t")
        router, port = await start_router_server(runtime)
        stop = asyncio.Event()
        loop_task = asyncio.create_task(runtime.run(stop, block_ms=20))
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        router_stub = router_pb2_grpc.RouterServiceStub(channel)

        async def states() -> dict[str, tuple[int, int]]:
            listed = await router_stub.ListReplicas(router_pb2.ListReplicasRequest())
            return {x.replica_id: (x.state, x.num_blocks) for x in listed.replicas}

        async with _replica(redis_url, namespace, num_blocks=48, router_address=f"127.0.0.1:{port}") as r:
            for _ in range(100):
                if (await states()).get("r1") == (router_pb2.READY, 48):
                    break
                await asyncio.sleep(0.05)
            assert await states() == {"r1": (router_pb2.READY, 48)}
            routed = await router_stub.Route(router_pb2.RouteRequest(request_id="x", model="llama-3-8b",
                                                                     prompt_tokens=10))
            assert routed.scheduler_address == f"127.0.0.1:{r.replica.port}"
            health = health_pb2_grpc.HealthStub(r.channel)
            check = health_pb2.HealthCheckRequest(service="sluice.v1.SchedulerService")
            assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.SERVING
            drained = await router_stub.Drain(router_pb2.DrainRequest(replica_id="r1"))
            assert drained.state == router_pb2.DRAINING
            assert await states() == {"r1": (router_pb2.DRAINING, 48)}
            # The heartbeat reply carries DRAINING to the replica: it drains (nothing in flight) and retires.
            for _ in range(100):
                if not await states():
                    break
                await asyncio.sleep(0.05)
            assert await states() == {}
            assert r.replica.agent is not None and r.replica.agent.retired.is_set()
            for _ in range(50):
                if (await health.Check(check)).status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.02)
            assert (await health.Check(check)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            await r.replica.agent.drain(1.0)  # a second drain (SIGTERM's) finds it done
        stop.set()
        await loop_task
        await channel.close()
        await router.stop(0)
        await client.aclose()
    asyncio.run(body())


def test_deadlines_time_requests_out_while_the_replica_is_busy(redis_url: str, namespace: str) -> None:
    """A running request past its total deadline and a waiting one past its queue deadline both end
    TIMED_OUT with finish reason "timeout", and their KV blocks are returned."""
    async def body() -> None:
        async with _replica(redis_url, namespace, num_blocks=256, emulate_time=True,
                            core_overrides={"max_num_seqs": 1}) as r:
            now = time.time()
            running = _submit("total", max_tokens=2000)
            running.deadline_unix_s = now + 0.3
            queued = _submit("queued", max_tokens=4)
            queued.queue_deadline_unix_s = now + 0.15
            await r.stub.Submit(running)
            await r.stub.Submit(queued)
            done = {c.request_id: c for c in await _completions(r.bus, 2)}
            assert {k: (c.status, c.finish_reason) for k, c in done.items()} == {
                "total": (common_pb2.TIMED_OUT, "timeout"), "queued": (common_pb2.TIMED_OUT, "timeout")}
            assert done["total"].usage.output_tokens < 2000 and done["queued"].usage.output_tokens == 0
            stats = await r.stub.Stats(scheduler_pb2.StatsRequest())
            assert (stats.timed_out, stats.kv_blocks_used) == (2, 0)
    asyncio.run(body())


@contextlib.asynccontextmanager
async def _router_at(redis_url: str, namespace: str
                     ) -> AsyncIterator[tuple[RouterRuntime, router_pb2_grpc.RouterServiceStub, str]]:
    """A real router (gRPC server + its KV/completion consumers) on loopback."""
    client = aioredis.Redis.from_url(redis_url)
    runtime = RouterRuntime(RouterCore(), Bus(client, namespace), "router-t")
    router, port = await start_router_server(runtime)
    stop = asyncio.Event()
    loop_task = asyncio.create_task(runtime.run(stop, block_ms=20))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield runtime, router_pb2_grpc.RouterServiceStub(channel), f"127.0.0.1:{port}"
    finally:
        stop.set()
        await loop_task
        await channel.close()
        await router.stop(0)
        await client.aclose()


async def _wait_for(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_a_lost_worker_reruns_its_round_makes_the_replica_unhealthy_and_the_queue_waits(
        redis_url: str, namespace: str) -> None:
    """When the worker goes away mid-request, the request in the round is not failed but waits to be recomputed;
    the replica turns UNHEALTHY at the router (Route finds no READY replica) and refuses Submit as UNAVAILABLE;
    once a worker is back on the same address the replica is READY again, the prefix cache is cleared, and both
    the interrupted request (with the tokens it would have had) and the one queued behind finish normally."""
    async def body() -> None:
        async with _router_at(redis_url, namespace) as (runtime, router, address), \
                _replica(redis_url, namespace, num_blocks=256, emulate_time=True, router_address=address,
                         core_overrides={"max_num_seqs": 1}) as r:
            async def state(wanted: int) -> bool:
                listed = await router.ListReplicas(router_pb2.ListReplicasRequest())
                return [x.state for x in listed.replicas] == [wanted]

            route = router_pb2.RouteRequest(request_id="x", model="llama-3-8b", prompt_tokens=10)
            await _wait_for(lambda: state(router_pb2.READY))
            await r.stub.Submit(_submit("interrupted", max_tokens=200))
            await r.stub.Submit(_submit("queued", max_tokens=4))
            await _wait_for(lambda: _tokens(r.bus))
            port = r.worker.port
            await r.worker.stop(grace_s=0)
            await _wait_for(lambda: state(router_pb2.UNHEALTHY))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await router.Route(route)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await r.stub.Submit(_submit("refused"))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "worker" in (err.value.details() or "")
            stats = await r.stub.Stats(scheduler_pb2.StatsRequest())
            assert (stats.waiting, stats.running) == (2, 0)
            assert not await _completions(r.bus, 1, timeout=0.2), "nothing ends while the worker is away"
            r.worker = await start_worker_server(
                WorkerRuntime(lambda: CostModel("llama-3-8b", "h200"), num_blocks=256), port=port)
            await asyncio.wait_for(r.worker.loading, 10)
            done = await _completions(r.bus, 2)
            assert [(c.request_id, c.status) for c in done] == [
                ("interrupted", common_pb2.FINISHED_LENGTH), ("queued", common_pb2.FINISHED_LENGTH)]
            model = CostModel("llama-3-8b", "h200")
            assert await _output_tokens(r.bus, "interrupted") == [model.token_for("interrupted", 40 + i) for i in range(200)]
            assert done[0].usage.preemptions == 1
            assert "all_blocks_cleared" in await _kv_event_kinds(r.bus)
            await _wait_for(lambda: state(router_pb2.READY))
            assert (await router.Route(route)).replica_id == "r1"
    asyncio.run(body())


def test_heartbeats_carry_measured_round_rates_that_the_router_scores_with(redis_url: str, namespace: str) -> None:
    """After a few rounds the replica's heartbeats carry a measured decode round time and prefill rate, and
    the router's predicted TTFT for an idle replica is the prompt at the measured rate (not the registered)."""
    async def body() -> None:
        async with _router_at(redis_url, namespace) as (runtime, router, address), \
                _replica(redis_url, namespace, num_blocks=256, emulate_time=True, router_address=address) as r:
            async def measured() -> bool:
                views = runtime.core.replicas()
                return bool(views) and views[0].load.decode_round_s > 0 and views[0].load.prefill_tokens_per_s > 0

            for i in range(3):
                await r.stub.Submit(_submit(f"m{i}", prompt_len=300, max_tokens=16))
            assert len(await _completions(r.bus, 3)) == 3
            await _wait_for(measured)
            await _wait_for(lambda: _idle(runtime))
            load = runtime.core.replicas()[0].load
            rates = r.replica.driver.rates
            assert load.decode_round_s == pytest.approx(rates.decode_round_s)
            assert load.prefill_tokens_per_s == pytest.approx(rates.prefill_tokens_per_s)
            assert load.prefill_tokens_per_s != 10_000.0  # not the registered default
            routed = await router.Route(router_pb2.RouteRequest(request_id="p", model="llama-3-8b",
                                                                prompt_tokens=1000))
            assert routed.predicted_ttft_s == pytest.approx(1000 / load.prefill_tokens_per_s)
    asyncio.run(body())


def test_a_registered_attention_cost_reaches_the_routers_prediction(redis_url: str, namespace: str) -> None:
    """A scheduler started with prefill_pair_s registers it; the router's prediction for a long prompt on the idle
    replica adds the prompt's attention pairs at that cost (the term the simulator's replicas register)."""
    pair_s = 2e-9

    async def body() -> None:
        async with _router_at(redis_url, namespace) as (runtime, router, address), \
                _replica(redis_url, namespace, router_address=address, prefill_pair_s=pair_s):
            await _wait_for(lambda: _registered(runtime))
            assert runtime.core.replicas()[0].spec.prefill_pair_s == pair_s
            routed = await router.Route(router_pb2.RouteRequest(request_id="p", model="llama-3-8b",
                                                                prompt_tokens=20_000))
            spec = runtime.core.replicas()[0].spec
            assert routed.predicted_ttft_s == pytest.approx(
                20_000 / spec.prefill_tokens_per_s + pair_s * 0.5 * 20_000 ** 2)
    asyncio.run(body())


def test_a_scheduler_registers_its_attention_charge_with_the_router(redis_url: str, namespace: str) -> None:
    """A scheduler whose core charges deep chunks registers the charge; the router's spec carries it, so the rounds
    the router counts for a deep prompt there are the charged ones (more than without the charge)."""
    charge = {"attention_pairs_per_token": 4096, "attention_free_context": 256, "max_num_batched_tokens": 512}

    async def body() -> None:
        async with _router_at(redis_url, namespace) as (runtime, _router, address), \
                _replica(redis_url, namespace, router_address=address, core_overrides=charge):
            await _wait_for(lambda: _registered(runtime))
            spec = runtime.core.replicas()[0].spec
            assert (spec.attention_pairs_per_token, spec.attention_free_context) == (4096, 256)
            assert prefill_rounds(spec, 0, 3000) > prefill_rounds(dataclasses.replace(
                spec, attention_pairs_per_token=0), 0, 3000)
    asyncio.run(body())


async def _registered(runtime: RouterRuntime) -> bool:
    return bool(runtime.core.replicas())


async def _idle(runtime: RouterRuntime) -> bool:
    view = runtime.core.replicas()[0]
    return view.load.running == 0 and view.load.waiting == 0 and view.inflight == 0


def _spawn(module: str, *args: str, env: dict[str, str], logs: Path) -> subprocess.Popen[str]:
    """Start `python -m module` with its output in logs/module.log (a pipe could fill up and block it)."""
    with open(logs / f"{module}.log", "w") as log_file:
        return subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdout=log_file,
                                stderr=subprocess.STDOUT, text=True)


@pytest.mark.e2e
def test_sigterm_drains_the_replica_process(redis_url: str, namespace: str, free_port, subprocess_env,
                                            trace_file) -> None:  # type: ignore[no-untyped-def]
    """A scheduler process given SIGTERM turns DRAINING at the router, still finishes the request it was
    running (all its tokens, FINISHED_LENGTH), writes its span to the trace file, and exits 0."""
    router_port, worker_port, scheduler_port = free_port(), free_port(), free_port()
    env = dict(subprocess_env, SLUICE_TRACE_FILE=str(trace_file))
    logs = trace_file.parent
    common = ["--redis-url", redis_url, "--namespace", namespace]
    procs = [
        _spawn("router_svc", "--port", str(router_port), *common, env=env, logs=logs),
        _spawn("worker_svc", "--port", str(worker_port), "--backend", "costmodel", "--model", "llama-3-8b",
               "--num-blocks", "256", "--emulate-time", env=env, logs=logs),
    ]
    scheduler = _spawn("scheduler_svc", "--port", str(scheduler_port), "--replica-id", "r1", "--worker",
                       f"127.0.0.1:{worker_port}", "--router", f"127.0.0.1:{router_port}", *common,
                       "--heartbeat-interval", "0.2", *_link_flags(), env=env, logs=logs)
    procs.append(scheduler)

    async def body() -> None:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{router_port}")
        router = router_pb2_grpc.RouterServiceStub(channel)

        async def state() -> int | None:
            try:
                listed = await router.ListReplicas(router_pb2.ListReplicasRequest(), timeout=1)
            except grpc.aio.AioRpcError:
                return None
            return next((r.state for r in listed.replicas if r.replica_id == "r1"), None)

        for _ in range(300):
            if await state() == router_pb2.READY:
                break
            await asyncio.sleep(0.1)
        assert await state() == router_pb2.READY
        sched_channel = grpc.aio.insecure_channel(f"127.0.0.1:{scheduler_port}")
        await scheduler_pb2_grpc.SchedulerServiceStub(sched_channel).Submit(_submit("in-flight", max_tokens=150))
        scheduler.send_signal(signal.SIGTERM)
        for _ in range(100):
            if await state() == router_pb2.DRAINING:
                break
            await asyncio.sleep(0.05)
        assert await state() == router_pb2.DRAINING
        client = aioredis.Redis.from_url(redis_url)
        [done] = await _completions(Bus(client, namespace), 1, timeout=30)
        assert (done.request_id, done.status, done.usage.output_tokens) == ("in-flight", common_pb2.FINISHED_LENGTH,
                                                                            150)
        await client.aclose()
        await channel.close()
        await sched_channel.close()

    try:
        asyncio.run(body())
        assert scheduler.wait(30) == 0, (logs / "scheduler_svc.log").read_text()
        spans = [s for s in read_span_file(trace_file) if s["name"] == "replica.request"]
        assert [s["service"] for s in spans] == ["sluice-scheduler"]
        assert spans[0]["attributes"]["sluice.request_id"] == "in-flight"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.e2e
def test_a_killed_worker_process_restarted_on_its_port_lets_the_interrupted_request_finish(
        redis_url: str, namespace: str, free_port, subprocess_env, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A real worker process SIGKILLed mid-round and started again on its port: the request it was running is
    recomputed and completes FINISHED_LENGTH with exactly the cost model's greedy tokens (each streamed once,
    in order), the request queued behind completes too, and nothing ends FAILED."""
    port = free_port()
    args = ["--port", str(port), "--backend", "costmodel", "--model", "llama-3-8b", "--num-blocks", "256",
            "--emulate-time"]
    procs = [_spawn("worker_svc", *args, env=subprocess_env, logs=tmp_path)]

    async def body() -> None:
        client = aioredis.Redis.from_url(redis_url)
        bus = Bus(client, namespace)
        replica = await start_replica(replica_id="r1", worker_address=f"127.0.0.1:{port}", bus=bus,
                                      core_overrides={"max_num_seqs": 1}, worker_timeout_s=60, round_link=ROUND_LINK)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{replica.port}")
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        try:
            await stub.Submit(_submit("interrupted", max_tokens=300))
            await stub.Submit(_submit("queued", max_tokens=4))
            await _wait_for(lambda: _tokens(bus))
            procs[0].kill()
            procs[0].wait(10)
            await _wait_for(lambda: _not_serving(replica))
            procs.append(_spawn("worker_svc", *args, env=subprocess_env, logs=tmp_path))
            done = await _completions(bus, 2, timeout=60)
            assert [(c.request_id, c.status) for c in done] == [
                ("interrupted", common_pb2.FINISHED_LENGTH), ("queued", common_pb2.FINISHED_LENGTH)]
            model = CostModel("llama-3-8b", "h200")
            assert await _output_tokens(bus, "interrupted") == [model.token_for("interrupted", 40 + i) for i in range(300)]
            assert done[0].usage.preemptions == 1 and done[0].usage.output_tokens == 300
            # The restarted worker offers its round link on another free port, found in its Info.
            _assert_link_used(replica)
        finally:
            await replica.stop(drain_timeout_s=2)
            await channel.close()
            await client.aclose()

    try:
        asyncio.run(body())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)


async def _not_serving(replica: RunningReplica) -> bool:
    return not replica.driver.worker_serving


def test_a_request_lost_with_the_worker_more_than_max_lost_rounds_fails_with_the_reason(
        redis_url: str, namespace: str) -> None:
    """With max_lost_rounds=0 the retry bound is reached at the first loss: the request ends FAILED and its
    detail names the lost rounds and the bound, so a plan that kills the worker cannot loop forever."""
    async def body() -> None:
        async with _replica(redis_url, namespace, num_blocks=256, emulate_time=True,
                            core_overrides={"max_lost_rounds": 0}) as r:
            await r.stub.Submit(_submit("doomed", max_tokens=300))
            await _wait_for(lambda: _tokens(r.bus))
            port = r.worker.port
            await r.worker.stop(grace_s=0)
            [failed] = await _completions(r.bus, 1)
            assert (failed.request_id, failed.status) == ("doomed", common_pb2.FAILED)
            assert "lost in 1 consecutive rounds (max_lost_rounds 0)" in failed.detail
            r.worker = await start_worker_server(
                WorkerRuntime(lambda: CostModel("llama-3-8b", "h200"), num_blocks=256), port=port)
    asyncio.run(body())


def test_a_failed_worker_probe_with_rounds_in_flight_loses_them_and_every_request_still_finishes_exactly(
        redis_url: str, namespace: str) -> None:
    """The worker is marked down (as a health probe that timed out under load does) while pipelined rounds are in
    flight, and answers again at once: the loop counts those rounds lost before it drops their stream, so the
    requests they carried are recomputed; no later plan asks the worker for a pending token of a round it never
    answered, and both requests finish FINISHED_LENGTH with exactly the cost model's tokens."""
    async def body() -> None:
        async with _replica(redis_url, namespace, num_blocks=256, emulate_time=True) as r:
            for rid in ("p1", "p2"):
                await r.stub.Submit(_submit(rid, max_tokens=120))

            async def streaming() -> bool:
                return len(await _tokens(r.bus)) >= 20

            await _wait_for(streaming)
            driver = r.replica.driver
            assert driver.core.stats().running == 2
            driver.link.set_serving(False)  # what WorkerLink.probe does when the health check fails
            done = await _completions(r.bus, 2, timeout=30)
            assert sorted((c.request_id, c.status) for c in done) == [
                ("p1", common_pb2.FINISHED_LENGTH), ("p2", common_pb2.FINISHED_LENGTH)]
            model = CostModel("llama-3-8b", "h200")
            for rid in ("p1", "p2"):
                assert await _output_tokens(r.bus, rid) == [model.token_for(rid, 40 + i) for i in range(120)]
            assert all(c.usage.preemptions >= 1 for c in done), "the in-flight rounds were lost and recomputed"
    asyncio.run(body())


def test_stats_report_running_totals_of_lengths_and_latencies(redis_url: str, namespace: str) -> None:
    """Stats carries the totals an observer takes an interval's means from: the prompt tokens and max_tokens of
    the requests submitted, and TTFT and TPOT sums and counts that match each completion's own timestamps."""
    async def body() -> None:
        async with _replica(redis_url, namespace, emulate_time=True) as r:
            await r.stub.Submit(_submit("a", prompt_len=40, max_tokens=6))
            await r.stub.Submit(_submit("b", prompt_len=24, max_tokens=1))
            done = {c.request_id: c for c in await _completions(r.bus, 2)}
            stats = await r.stub.Stats(scheduler_pb2.StatsRequest())
            assert (stats.input_tokens, stats.max_output_tokens) == (64, 7)
            assert stats.ttft_count == 2  # both got a first token
            ttfts = [c.timestamps.first_token - c.timestamps.enqueued for c in done.values()]
            assert stats.ttft_seconds_sum == pytest.approx(sum(ttfts), abs=0.01)
            assert stats.tpot_count == 1  # "b" made one token: no time per output token
            a = done["a"]
            assert stats.tpot_seconds_sum == pytest.approx(
                (a.timestamps.finished - a.timestamps.first_token) / 5, abs=0.005)
    asyncio.run(body())
