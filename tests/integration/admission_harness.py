"""The admission harness shared by the integration tests: a real admission gRPC server (the production
`build_server` around a FrontDoor) on loopback, a real Redis bus, and a stand-in router and scheduler
that are small real gRPC servers publishing tokens and completions on the bus the way a replica does.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import redis.asyncio as aioredis

from admission_svc.__main__ import admission_config
from admission_svc.core import AdmissionCore
from admission_svc.frontdoor import FrontDoor, FrontDoorConfig
from admission_svc.server import DEFAULT_MAX_MESSAGE_BYTES, build_server
from admission_svc.streams import token_reader_loop
from sluice import errors
from sluice.bus import Bus
from sluice.config import Budgets, ServiceConfig, TenantConfig
from sluice.model_spec import load_model_spec
from sluice.tokenizer import build_byte_tokenizer
from sluice.v1 import common_pb2, events_pb2, router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

OWNER = "adm-test"
OUTPUT = list(b"hello world")


class StandInReplica(router_pb2_grpc.RouterServiceServicer, scheduler_pb2_grpc.SchedulerServiceServicer):
    """Routes everything to itself; 'generates' OUTPUT one token per 20 ms onto the bus."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.address = ""
        self.submitted: list[scheduler_pb2.SubmitRequest] = []
        self.submitted_at: dict[str, float] = {}
        """When each Submit arrived, by request id (the loop's clock)."""
        self.cancelled: list[str] = []
        self.released: list[str] = []
        """ReleaseKv calls received (request ids)."""
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.ready = True
        self.end_status: int | None = None
        """When set, each request ends after one token with this status instead of finishing."""
        self.end_first_attempts_only = False
        """With `end_status`: only first attempts end so (a moved attempt, `id#n`, runs to its end)."""
        self.predicted_ttft_s = 0.0
        """The time to first token the stand-in router predicts for every request."""
        self.output = OUTPUT
        """What each request generates (one token per 20 ms) when it runs to its max_tokens."""
        self.end_detail = "the replica gave up"
        """The detail of such an end."""
        self.dead_routes = 0
        """Route answers this many more calls with replica "r-dead" at `dead_address`, where nothing listens."""
        self.dead_address = ""
        self.reports: list[router_pb2.ReportUnreachableRequest] = []
        """ReportUnreachable calls received."""
        self.pair = False
        """Route answers a prefill/decode pair (decode replica "r1", this same stand-in): a prefill half follows."""
        self.decode_address = ""
        """With `pair`: the decode scheduler's address the pair names ("": this stand-in's own)."""
        self.on_report: Callable[[], Awaitable[None]] | None = None
        """Awaited by each ReportUnreachable before it answers (e.g. a scheduler brought back on its address)."""
        self.prefill_completion_copies = 1
        """A prefill half (hold_kv) publishes its token, then its completion this many times, 50 ms apart (the bus
        delivers at least once; a Lookup fetches a copy of a completion that Redis held up, and the bus's own
        arrives after it)."""
        self.refused_decode_halves = 0
        """Submit refuses this many more decode halves (kv_source set) UNAVAILABLE, as a decode scheduler that lost
        Redis does."""
        self.refused_submits = 0
        """Submit refuses this many more submissions of any kind UNAVAILABLE with `refusal_retry_after_s` (a scheduler
        whose Redis is away)."""
        self.submit_times: list[float] = []
        """When each Submit arrived, in order, refused ones included (the loop's clock)."""
        self.refusal_retry_after_s: float | None = None
        """The retry delay (RetryInfo) those refusals name; None: none (a real scheduler without Redis says 1 s)."""
        self.report_delay_s = 0.0
        """ReportUnreachable answers this late (a router busy probing)."""
        self.submit_reply_delay_s = 0.0
        """Submit answers this long after the request started generating (as a busy scheduler's reply can lag
        its first token on the bus)."""
        self.live: set[str] = set()
        """Requests generating now (Lookup answers them `live`)."""
        self.recent: dict[str, events_pb2.Completion] = {}
        """Every completion made, by request id (Lookup answers them `recent`, as a scheduler's publisher
        does)."""
        self.completion_delay_s: float | None = 0.0
        """A completion is published on the bus this long after it is made (a copy Redis held up); None: never
        (lost on the bus). Lookup knows it from the start either way."""
        self.last_token_delay_s = 0.0
        """The last token is published this long after its request ended (a completion that overtakes its last
        delta on the bus)."""
        self.later: set[asyncio.Task[None]] = set()
        """Those late publications under way."""
        self.lookup_publishes_first = False
        """A Lookup first publishes on the bus each completion it answers with, then answers 0.3 s later (the
        bus copy reaches admission while the Lookup is under way)."""

    async def Route(self, request: Any, context: Any) -> router_pb2.RouteResponse:
        if not self.ready:
            await asyncio.sleep(0.2)  # long enough for an idempotent retry to attach meanwhile
            await errors.abort(context, errors.Unavailable("no READY replica of model 'tiny'", retry_after_s=0.5))
        if self.dead_routes > 0:
            self.dead_routes -= 1
            return router_pb2.RouteResponse(replica_id="r-dead", scheduler_address=self.dead_address)
        if self.pair:
            return router_pb2.RouteResponse(replica_id="r0", scheduler_address=self.address,
                                            decode_replica_id="r1",
                                            decode_scheduler_address=self.decode_address or self.address,
                                            predicted_ttft_s=self.predicted_ttft_s)
        return router_pb2.RouteResponse(replica_id="r0", scheduler_address=self.address,
                                        predicted_ttft_s=self.predicted_ttft_s)

    async def ReportUnreachable(self, request: router_pb2.ReportUnreachableRequest,
                                context: Any) -> router_pb2.ReportUnreachableResponse:
        self.reports.append(request)
        if self.on_report is not None:
            await self.on_report()
        await asyncio.sleep(self.report_delay_s)
        return router_pb2.ReportUnreachableResponse(state=router_pb2.UNHEALTHY)

    async def ListReplicas(self, request: Any, context: Any) -> router_pb2.ListReplicasResponse:
        return router_pb2.ListReplicasResponse(replicas=[router_pb2.Replica(
            replica_id="r0", model="tiny", block_size=4, state=router_pb2.READY)])

    async def Submit(self, request: scheduler_pb2.SubmitRequest, context: Any) -> scheduler_pb2.SubmitResponse:
        self.submitted.append(request)
        self.submitted_at[request.request_id] = asyncio.get_running_loop().time()
        self.submit_times.append(self.submitted_at[request.request_id])
        if self.refused_submits > 0:
            self.refused_submits -= 1
            await errors.abort(context, errors.Unavailable("Redis does not answer", reason="bus_unavailable",
                                                           retry_after_s=self.refusal_retry_after_s))
        if request.HasField("kv_source") and self.refused_decode_halves > 0:
            self.refused_decode_halves -= 1
            await errors.abort(context, errors.Unavailable("Redis does not answer",
                                                           retry_after_s=self.refusal_retry_after_s))
        self.live.add(request.request_id)
        self.tasks[request.request_id] = asyncio.create_task(self._run(request))
        if self.submit_reply_delay_s:
            await asyncio.sleep(self.submit_reply_delay_s)
        return scheduler_pb2.SubmitResponse()

    async def _run(self, request: scheduler_pb2.SubmitRequest) -> None:
        if request.hold_kv and self.prefill_completion_copies > 1:
            await self._prefill_completed_more_than_once(request)
            return
        produced = 0
        status, reason = common_pb2.FINISHED_LENGTH, "length"
        count = min(request.sampling.max_tokens, len(self.output))
        held_back: events_pb2.TokenDelta | None = None
        try:
            for index in range(count):
                if self.end_status is not None and index == 1 and not (
                        self.end_first_attempts_only and "#" in request.request_id):
                    status, reason = self.end_status, "error"
                    break
                await asyncio.sleep(0.02)
                delta = events_pb2.TokenDelta(request_id=request.request_id, index=index,
                                              token_ids=[self.output[index]])
                if index == count - 1 and self.last_token_delay_s:
                    held_back = delta
                else:
                    await self.bus.publish_tokens(request.owner, [delta])
                produced += 1
        except asyncio.CancelledError:
            status, reason = common_pb2.CANCELLED, "cancelled"
        completion = events_pb2.Completion(
            request_id=request.request_id, tenant=request.tenant, status=status, finish_reason=reason,
            owner=request.owner, detail=self.end_detail if self.end_status is not None else "",
            usage=common_pb2.Usage(input_tokens=len(request.prompt_token_ids), output_tokens=produced))
        self.recent[request.request_id] = completion
        self.live.discard(request.request_id)
        if held_back is not None:
            self.later.add(asyncio.create_task(self._publish_later(request.owner, held_back)))
        if self.completion_delay_s is None:
            return
        if self.completion_delay_s:
            await asyncio.sleep(self.completion_delay_s)
        await self.bus.publish_completion(completion)

    async def _publish_later(self, owner: str, delta: events_pb2.TokenDelta) -> None:
        await asyncio.sleep(self.last_token_delay_s)
        await self.bus.publish_tokens(owner, [delta])

    async def Lookup(self, request: scheduler_pb2.LookupRequest,
                     context: Any) -> scheduler_pb2.LookupResponse:
        reply = scheduler_pb2.LookupResponse(
            live=[i for i in request.request_ids if i in self.live],
            recent=[self.recent[i] for i in request.request_ids if i in self.recent])
        if self.lookup_publishes_first and reply.recent:
            for completion in reply.recent:
                await self.bus.publish_completion(completion)
            await asyncio.sleep(0.3)
        return reply

    async def _prefill_completed_more_than_once(self, request: scheduler_pb2.SubmitRequest) -> None:
        await self.bus.publish_tokens(request.owner, [events_pb2.TokenDelta(
            request_id=request.request_id, index=0, token_ids=[self.output[0]])])
        done = events_pb2.Completion(request_id=request.request_id, tenant=request.tenant,
                                     status=common_pb2.FINISHED_LENGTH, finish_reason="length", owner=request.owner,
                                     usage=common_pb2.Usage(input_tokens=len(request.prompt_token_ids),
                                                            output_tokens=1))
        self.live.discard(request.request_id)
        for _ in range(self.prefill_completion_copies):
            await asyncio.sleep(0.05)
            await self.bus.publish_completion(done)

    async def ReleaseKv(self, request: scheduler_pb2.ReleaseKvRequest,
                        context: Any) -> scheduler_pb2.ReleaseKvResponse:
        self.released.append(request.request_id)
        return scheduler_pb2.ReleaseKvResponse()

    async def Cancel(self, request: scheduler_pb2.CancelRequest, context: Any) -> scheduler_pb2.CancelResponse:
        self.cancelled.append(request.request_id)
        task = self.tasks.get(request.request_id)
        if task is not None and not task.done():
            task.cancel()
        return scheduler_pb2.CancelResponse(status=common_pb2.CANCELLING)


def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "tiny"
    directory.mkdir()
    build_byte_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps({"vocab_size": 258, "eos_token_id": 257,
                                                       "max_position_embeddings": 64}))
    return directory


CONFIG = ServiceConfig(tenants=(TenantConfig("acme", ("k-acme",)), TenantConfig("beta", ("k-beta",))),
                       budgets=Budgets(max_active_requests=2))
Body = Callable[[str, FrontDoor, StandInReplica, Bus], Awaitable[None]]


async def _serve(tmp_path: Path, redis_url: str, namespace: str, body: Body, consume: bool,
                 door_config: FrontDoorConfig | None, max_message_bytes: int, config: ServiceConfig) -> None:
    redis = aioredis.from_url(redis_url)
    bus = Bus(redis, namespace)
    replica = StandInReplica(bus)
    downstream = grpc.aio.server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(replica, downstream)
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(replica, downstream)
    replica.address = f"127.0.0.1:{downstream.add_insecure_port('127.0.0.1:0')}"
    with socket.socket() as closed:  # a port bound once and closed: a dead scheduler's address
        closed.bind(("127.0.0.1", 0))
        replica.dead_address = f"127.0.0.1:{closed.getsockname()[1]}"
    await downstream.start()
    model = load_model_spec(model_dir(tmp_path), "tiny")
    door = FrontDoor(AdmissionCore(admission_config(config, model.max_model_len)), model, replica.address, OWNER,
                     config=door_config)
    server = build_server(door, max_message_bytes)
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(token_reader_loop(
        lambda s, last, count, block: bus.read_tokens(s, last, count=count, block_ms=block),
        bus.tokens_stream(OWNER), door.registry, stop, block_ms=50))]
    if consume:
        tasks.append(asyncio.create_task(bus.consume("completions", "admission", "c1", door.on_completion,
                                                     stop=stop, block_ms=50)))
    try:
        await body(target, door, replica, bus)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.stop(None)
        await downstream.stop(None)
        await door.close()
        await redis.aclose()


def run(tmp_path: Path, redis_url: str, namespace: str, body: Body, consume: bool = True,
        door_config: FrontDoorConfig | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        config: ServiceConfig = CONFIG) -> None:
    asyncio.run(_serve(tmp_path, redis_url, namespace, body, consume, door_config, max_message_bytes, config))


async def settle(condition: Callable[[], bool], timeout_s: float = 3.0) -> bool:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return True
        await asyncio.sleep(0.02)
    return condition()
