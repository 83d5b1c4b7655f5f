"""Probe: does one client's huge prompt delay other clients' tokens at admission? Prints JSON.

Starts a real admission process (`python -m admission_svc` from `--root`, so an older checkout
can be measured the same way), an embedded Redis, and in this process a stand-in router and
scheduler that stream one token every `--token-interval-ms` onto the bus. A probe client streams
requests back to back and records each token's path latency (client receipt minus the stand-in's
creation stamp) in two phases: quiet, then while a second client sends `--attack-bytes` prompts
back to back. Reports p50/p99/max of both phases and what the attacker got.

    python scripts/probe_admission_stall.py --root /work/base --attack-bytes 4000000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import redis.asyncio as aioredis

from sluice.bus import Bus
from sluice.redis_server import EmbeddedRedis, free_port
from sluice.tokenizer import build_byte_tokenizer
from sluice.v1 import (
    admission_pb2,
    admission_pb2_grpc,
    common_pb2,
    events_pb2,
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)

API_KEY = "sk-sluice-local"


class StandIn(router_pb2_grpc.RouterServiceServicer, scheduler_pb2_grpc.SchedulerServiceServicer):
    """Routes to itself and streams `tokens` tokens per request, one per interval, onto the bus."""

    def __init__(self, bus: Bus, interval_s: float) -> None:
        self.bus, self.interval_s, self.address = bus, interval_s, ""

    async def Route(self, request: Any, context: Any) -> router_pb2.RouteResponse:
        return router_pb2.RouteResponse(replica_id="r0", scheduler_address=self.address)

    async def ListReplicas(self, request: Any, context: Any) -> router_pb2.ListReplicasResponse:
        return router_pb2.ListReplicasResponse(replicas=[router_pb2.Replica(
            replica_id="r0", model="tiny", block_size=16, state=router_pb2.READY)])

    async def Submit(self, request: scheduler_pb2.SubmitRequest, context: Any) -> scheduler_pb2.SubmitResponse:
        asyncio.get_running_loop().create_task(self._run(request))
        return scheduler_pb2.SubmitResponse()

    async def _run(self, request: scheduler_pb2.SubmitRequest) -> None:
        count = request.sampling.max_tokens
        for index in range(count):
            await asyncio.sleep(self.interval_s)
            await self.bus.publish_tokens(request.owner, [events_pb2.TokenDelta(
                request_id=request.request_id, index=index, token_ids=[104], created_unix_s=time.time())])
        await self.bus.publish_completion(events_pb2.Completion(
            request_id=request.request_id, tenant=request.tenant, status=common_pb2.FINISHED_LENGTH,
            finish_reason="length", owner=request.owner,
            usage=common_pb2.Usage(input_tokens=len(request.prompt_token_ids), output_tokens=count)))


def _model_dir(root: Path) -> Path:
    directory = root / "tiny"
    directory.mkdir()
    build_byte_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps({"vocab_size": 258, "eos_token_id": 257,
                                                       "max_position_embeddings": 4096}))
    return directory


async def _probe(target: str, stop: threading.Event, samples: list[tuple[float, float]]) -> None:
    """Stream 32-token requests back to back; append (receipt time, path latency) per token."""
    metadata = (("authorization", f"Bearer {API_KEY}"),)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)
        while not stop.is_set():
            request = admission_pb2.GenerateRequest(prompt="probe", sampling=common_pb2.SamplingParams(max_tokens=32))
            async for chunk in stub.Generate(request, metadata=metadata, timeout=60):
                now = time.time()
                if chunk.token_ids and chunk.created_unix_s:
                    samples.append((now, now - chunk.created_unix_s))


def _attack(target: str, size: int, count: int, out: list[dict[str, Any]], window: list[float]) -> None:
    """Send `count` prompts of `size` bytes one after the other (blocking client, own thread)."""
    metadata = (("authorization", f"Bearer {API_KEY}"),)
    with grpc.insecure_channel(target) as channel:
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)
        window.append(time.time())
        for _ in range(count):
            request = admission_pb2.GenerateRequest(prompt="a" * size,
                                                    sampling=common_pb2.SamplingParams(max_tokens=4))
            start = time.perf_counter()
            try:
                for _chunk in stub.Generate(request, metadata=metadata, timeout=120):
                    pass
                code, message = "OK", ""
            except grpc.RpcError as exc:
                code, message = exc.code().name, (exc.details() or "")[:160]
            out.append({"code": code, "seconds": round(time.perf_counter() - start, 3), "message": message})
        window.append(time.time())


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    return {"count": len(ordered), "p50_ms": round(statistics.median(ordered) * 1e3, 2),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 2),
            "max_ms": round(ordered[-1] * 1e3, 2)}


async def _measure(args: argparse.Namespace, target: str) -> dict[str, Any]:
    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    probe = asyncio.create_task(_probe(target, stop, samples))
    quiet_start = time.time()
    await asyncio.sleep(args.quiet_s)
    quiet_end = time.time()
    outcomes: list[dict[str, Any]] = []
    window: list[float] = []
    await asyncio.to_thread(_attack, target, args.attack_bytes, args.attacks, outcomes, window)
    await asyncio.sleep(0.5)
    stop.set()
    await probe
    quiet = [lat for at, lat in samples if quiet_start + 0.5 <= at <= quiet_end]
    attacked = [lat for at, lat in samples if window[0] <= at <= window[1] + 0.5]
    return {"root": str(args.root), "attack_bytes": args.attack_bytes, "attacks": outcomes,
            "probe_quiet": _stats(quiet), "probe_under_attack": _stats(attacked),
            "attack_window_s": round(window[1] - window[0], 3)}


async def _run(args: argparse.Namespace, redis_url: str, workdir: Path) -> dict[str, Any]:
    client = aioredis.from_url(redis_url)
    namespace = f"probe{os.getpid()}"
    replica = StandIn(Bus(client, namespace), args.token_interval_ms / 1000)
    downstream = grpc.aio.server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(replica, downstream)
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(replica, downstream)
    replica.address = f"127.0.0.1:{downstream.add_insecure_port('127.0.0.1:0')}"
    await downstream.start()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(args.root)}
    env.pop("SLUICE_CONFIG", None)
    proc = subprocess.Popen([sys.executable, "-m", "admission_svc", "--port", str(port), "--router", replica.address,
                             "--redis-url", redis_url, "--namespace", namespace, "--model", str(_model_dir(workdir)),
                             "--model-id", "tiny", "--log-level", "WARNING"],
                            cwd=args.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = await asyncio.to_thread(proc.stdout.readline)
        if "listening" not in line:
            raise RuntimeError(f"admission did not start: {line!r}")
        return await _measure(args, f"127.0.0.1:{port}")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        await downstream.stop(None)
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="checkout whose admission_svc runs (default: this one)")
    parser.add_argument("--attack-bytes", type=int, default=4_000_000)
    parser.add_argument("--attacks", type=int, default=3)
    parser.add_argument("--quiet-s", type=float, default=3.0)
    parser.add_argument("--token-interval-ms", type=float, default=10.0)
    args = parser.parse_args()
    with EmbeddedRedis() as redis_server, tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(asyncio.run(_run(args, redis_server.url, Path(tmp))), indent=1))


if __name__ == "__main__":
    main()
