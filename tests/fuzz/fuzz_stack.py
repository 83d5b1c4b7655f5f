"""A whole Sluice stack in this process, on loopback, for the fuzz tests to attack.

Worker (cost model of llama-3-8b, emulated time), router, one scheduler replica and admission are each
started by their own `python -m` entry's `start(ctx, options)`, the code a real process runs, each on
its own event loop in a background thread (so that one service's stall does not stall the others, as
with separate processes), against the session's real Redis. The tests talk to them from the main
thread with ordinary synchronous gRPC channels, so a hung servicer shows up as a client deadline.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import admission_svc.__main__ as admission_main
import router_svc.__main__ as router_main
import scheduler_svc.__main__ as scheduler_main
import worker_svc.__main__ as worker_main
from sluice import serve
from sluice.tokenizer import build_byte_tokenizer
from sluice.v1 import router_pb2, router_pb2_grpc

T = TypeVar("T")
REPLICA_ID = "replica-under-fuzz-7f3a"  # a name no strategy produces, so fuzzed Drain/Register miss it
HEARTBEAT_TIMEOUT_S = 3.0
# A real model's shape: its emulated rounds take GPU-like time, so an unbounded plan becomes a hang.
MODEL = "llama-3-8b"  # fuzz-registered replicas that never beat again are GONE after this


@dataclass
class Stack:
    """The running services (each on its own event loop and thread), their gRPC targets and watched tasks."""

    loops: dict[str, tuple[asyncio.AbstractEventLoop, threading.Thread]] = field(default_factory=dict)
    targets: dict[str, str] = field(default_factory=dict)
    started: dict[str, serve.Started] = field(default_factory=dict)
    contexts: dict[str, serve.ServiceContext] = field(default_factory=dict)

    def run(self, name: str, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        """Run `coro` on the loop of service `name` (started on first use) and return its result."""
        if name not in self.loops:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name=f"fuzz-{name}", daemon=True)
            thread.start()
            self.loops[name] = (loop, thread)
        return asyncio.run_coroutine_threadsafe(coro, self.loops[name][0]).result(timeout_s)

    def failed_tasks(self) -> list[str]:
        """Return a description of each watched task of each service that has ended (a crash)."""
        return [f"{name}: {task!r}" for name, started in self.started.items()
                for task in started.watched if task.done()]

    def health(self, name: str) -> int:
        """Return the overall health status ("" service) the service `name` reports now."""
        with grpc.insecure_channel(self.targets[name]) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(reply.status)

    def stop(self) -> None:
        """Signal every service to stop, drain it, close what it opened, and end its loop's thread."""
        async def shutdown(name: str) -> None:
            ctx, started = self.contexts[name], self.started.get(name)
            ctx.stop.set()
            if started is not None and started.drain is not None:
                await asyncio.wait_for(started.drain(), 30)
            await ctx.cleanup.aclose()

        try:
            for name in ("admission", "scheduler", "router", "worker"):
                if name in self.contexts:
                    self.run(name, shutdown(name), 60)
        finally:
            for loop, thread in self.loops.values():
                loop.call_soon_threadsafe(loop.stop)
                thread.join(10)


def _model_dir(root: Path) -> Path:
    """The tokenizer side of the worker's model: a byte tokenizer and the cost model's length."""
    directory = root / MODEL
    directory.mkdir(parents=True, exist_ok=True)
    build_byte_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps({"vocab_size": 258, "eos_token_id": 257,
                                                       "max_position_embeddings": 8192}))
    return directory


def _start(stack: Stack, name: str, options: serve.ServiceOptions, start: Any) -> str:
    async def begin() -> str:
        ctx = serve.ServiceContext(options, asyncio.Event())
        stack.contexts[name] = ctx
        started = await start(ctx, options)
        stack.started[name] = started
        if started.ready is not None and not await started.ready():
            raise RuntimeError(f"{name} did not become ready")
        return f"127.0.0.1:{started.port}"

    stack.targets[name] = stack.run(name, begin(), 120)
    return stack.targets[name]


async def _replica_ready(router: str) -> None:
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        for _ in range(200):
            replicas = (await stub.ListReplicas(router_pb2.ListReplicasRequest())).replicas
            if any(r.replica_id == REPLICA_ID and r.state == router_pb2.READY for r in replicas):
                return
            await asyncio.sleep(0.05)
    raise RuntimeError("the scheduler replica never became READY at the router")


def _start_all(stack: Stack, redis_url: str, namespace: str, root: Path) -> None:
    bus = {"redis_url": redis_url, "namespace": namespace}
    worker = _start(stack, "worker", worker_main.WorkerOptions(
        backend="costmodel", model=MODEL, emulate_time=True), worker_main.start)
    router = _start(stack, "router", router_main.RouterOptions(
        heartbeat_timeout=HEARTBEAT_TIMEOUT_S, **bus), router_main.start)
    _start(stack, "scheduler", scheduler_main.SchedulerOptions(
        replica_id=REPLICA_ID, worker=worker, router=router, heartbeat_interval=0.2, drain_timeout=2.0, **bus),
        scheduler_main.start)
    asyncio.run(_replica_ready(router))
    _start(stack, "admission", admission_main.AdmissionOptions(
        router=router, model=str(_model_dir(root)), model_id=MODEL, owner=f"fuzz-{namespace}", **bus),
        admission_main.start)


def start_stack(redis_url: str, namespace: str, root: Path) -> Stack:
    """Start worker, router, scheduler and admission, each on its own loop thread (as separate processes
    would not share a loop); return them once all serve."""
    stack = Stack()
    try:
        _start_all(stack, redis_url, namespace, root)
    except BaseException:
        stack.stop()
        raise
    return stack
