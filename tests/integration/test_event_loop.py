"""$SLUICE_EVENT_LOOP (sluice/serve.py): the services' libraries work on uvloop, and a bad value stops a service."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sluice import serve

pytestmark = pytest.mark.redis


def test_grpc_and_redis_round_trips_run_on_uvloop(redis_url: str) -> None:
    """Under `use_event_loop("uvloop")` the loop is libuv's, and a grpc.aio server and client and the asyncio Redis
    client (what every service runs on) answer on it."""
    async def scenario() -> str:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            client = aioredis.Redis.from_url(redis_url)
            assert await client.ping()
            await client.aclose()
        finally:
            await server.stop(None)
        return type(asyncio.get_running_loop()).__module__

    serve.use_event_loop("uvloop")
    try:
        assert asyncio.run(scenario()).startswith("uvloop")
    finally:
        serve.use_event_loop("asyncio")
    assert asyncio.run(asyncio.sleep(0, "ok")) == "ok"


def test_a_service_runs_on_uvloop_unless_told_otherwise() -> None:
    """With $SLUICE_EVENT_LOOP unset a service runs on uvloop (installed by the server extra); `asyncio` is the
    way back to asyncio's own loop."""
    code = ("import asyncio, os; from sluice import serve; "
            "serve.use_event_loop(os.environ.get(serve.EVENT_LOOP_ENV) or serve.default_event_loop()); "
            "print(asyncio.run(asyncio.sleep(0, type(asyncio.new_event_loop()).__module__)))")
    unset = {k: v for k, v in os.environ.items() if k != serve.EVENT_LOOP_ENV}
    for env, expected in ((unset, "uvloop"), ({**unset, serve.EVENT_LOOP_ENV: "asyncio"}, "asyncio")):
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().startswith(expected), done.stdout


def test_an_unknown_event_loop_stops_the_service_with_the_variable_named() -> None:
    """SLUICE_EVENT_LOOP=tokio: the router exits 2 at once, its message naming the variable and the choices."""
    env = {**os.environ, serve.EVENT_LOOP_ENV: "tokio", "SLUICE_REDIS_URL": "redis://127.0.0.1:1/0"}
    done = subprocess.run([sys.executable, "-m", "router_svc", "--port", "0"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "$SLUICE_EVENT_LOOP must be asyncio or uvloop, got 'tokio'" in done.stderr
    assert "Traceback" not in done.stderr
