"""Start a vLLM replica's agent: wait for the engine, size the gateway from it, serve, register, run.

The engine is asked what it is (GET /v1/models: the served name and max_model_len; /metrics'
vllm:cache_config_info: block size and KV blocks), so the router learns the engine's real block size and
capacity, and admission hashes prompts in the engine's blocks. The gRPC server, the router agent and the
retire path are the Sluice scheduler's (scheduler_svc.server), unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from grpc_health.v1.health import aio as health_aio

from scheduler_svc import server as scheduler_server
from scheduler_svc.core.config import Policy
from scheduler_svc.driver import Driver
from scheduler_svc.engines.vllm.driver import VllmDriver
from scheduler_svc.engines.vllm.gateway import GatewayConfig, GatewayCore
from scheduler_svc.engines.vllm.link import EngineGone, EngineLink, KvSubscriber
from sluice import tls
from sluice.bus import Bus
from sluice.prom import SchedulerMetrics
from sluice.tls import TlsFiles
from sluice.v1 import router_pb2, router_pb2_grpc

__all__ = ["EngineSettings", "discover", "start_vllm_replica"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    """Where the engine is and how the gateway in front of it behaves (from the agent's flags)."""

    url: str
    """The engine's OpenAI server, http://HOST:PORT."""
    kv_events: str = ""
    """Its KV-event PUB endpoint (vLLM's kv_events_config endpoint); empty: no prefix-aware routing."""
    kv_replay: str = ""
    """Its replay ROUTER endpoint; empty: gaps clear the replica's blocks at the router."""
    model_id: str = ""
    """The model id the router and admission know it by; empty: the engine's served model name."""
    policy: Policy = Policy.FCFS
    """Order of dispatch."""
    tenant_weights: tuple[tuple[str, float], ...] = ()
    """Fair-share weights by tenant."""
    max_inflight: int = 16
    """Requests on the engine at once, at most (the rest wait here, in policy order)."""
    max_waiting: int = 4096
    """Requests waiting here at most."""
    priority_passthrough: bool = False
    """Send the request's priority to vLLM (needs its --scheduling-policy priority)."""
    startup_timeout_s: float = 600.0
    """How long to wait for the engine to answer at start (vLLM compiles for minutes on a cold cache)."""
    stream_interval: int = 1
    """Tokens per streamed chunk asked of vLLM for each request (EngineLink.stream_interval)."""


async def discover(link: EngineLink, timeout_s: float) -> tuple[str, int, int, int]:
    """Wait until the engine answers; return (served model name, max_model_len, block size, KV blocks).

    Raises TimeoutError when it does not answer within `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        if await link.healthy():
            try:
                entry = (await link.models())[0]
                _, cache_info = await link.metrics()
                return (str(entry["id"]), int(entry.get("max_model_len") or 0),
                        int(cache_info.get("block_size") or 16), int(cache_info.get("num_gpu_blocks") or 0))
            except (EngineGone, KeyError, IndexError, ValueError, TypeError) as exc:
                log.info("the engine answers but is not ready: %s", exc)
        if loop.time() > deadline:
            raise TimeoutError(f"the engine at {link.url} did not answer within {timeout_s:.0f} s")
        await asyncio.sleep(1.0)


async def start_vllm_replica(*, replica_id: str, engine: EngineSettings, bus: Bus, router_address: str = "",
                             port: int = 0, host: str = "127.0.0.1", advertise_host: str = "127.0.0.1",
                             metrics: SchedulerMetrics | None = None, heartbeat_interval_s: float = 1.0,
                             prefill_tokens_per_s: float = 10_000.0, decode_round_s: float = 0.01,
                             tls_files: TlsFiles | None = None, bus_alive: Callable[[], bool] = lambda: True,
                             drain_timeout_s: float = 30.0, kv_linger_s: float = 0.0,
                             publish_interval_s: float = 0.0) -> scheduler_server.RunningReplica:
    """Wait for the engine, then serve the scheduler contract in front of it and register with the router.

    Raises TimeoutError (the engine never answered), ValueError (bad settings), RuntimeError (port taken)."""
    link = EngineLink(engine.url, priority_passthrough=engine.priority_passthrough,
                      stream_interval=engine.stream_interval)
    served, max_model_len, block_size, num_blocks = await discover(link, engine.startup_timeout_s)
    link.served_model = served
    config = GatewayConfig(model_id=engine.model_id or served, block_size=block_size,
                           max_model_len=max_model_len or 4096, num_blocks=num_blocks, policy=engine.policy,
                           tenant_weights=engine.tenant_weights, max_inflight=engine.max_inflight,
                           max_waiting=engine.max_waiting)
    kv = KvSubscriber(engine.kv_events, engine.kv_replay) if engine.kv_events else None
    driver = VllmDriver(GatewayCore(config), link, bus, replica_id=replica_id, kv=kv, metrics=metrics,
                        kv_linger_s=kv_linger_s, publish_interval_s=publish_interval_s)
    as_driver = cast(Driver, driver)  # the same surface (see VllmDriver's docstring)
    health = health_aio.HealthServicer()
    server, bound = await scheduler_server.start_scheduler_server(as_driver, health, port, host, tls_files, bus_alive)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(driver.run(stop))]
    channels = []
    agent = None
    if router_address:
        router_channel = tls.aio_channel(router_address, tls_files)
        channels.append(router_channel)
        replica = router_pb2.Replica(
            replica_id=replica_id, model=config.model_id, scheduler_address=f"{advertise_host}:{bound}",
            state=router_pb2.WARMING, block_size=block_size, num_blocks=num_blocks,
            max_num_batched_tokens=config.max_num_batched_tokens, prefill_tokens_per_s=prefill_tokens_per_s,
            decode_round_s=decode_round_s)
        agent = scheduler_server.ReplicaAgent(as_driver, router_pb2_grpc.RouterServiceStub(router_channel), replica,
                                              heartbeat_interval_s, drain_timeout_s=drain_timeout_s)
        ready = asyncio.Event()
        ready.set()  # discover returned: the engine answers
        tasks.append(asyncio.create_task(agent.run(ready, stop)))
        tasks.append(asyncio.create_task(scheduler_server._not_serving_when_retired(agent, health, stop)))  # noqa: SLF001
    log.info("replica %s: vLLM engine %s (%s, block %d, %d blocks, max_model_len %d), %s", replica_id, engine.url,
             served, block_size, num_blocks, config.max_model_len, config.policy.value)
    return scheduler_server.RunningReplica(server, bound, as_driver, agent, stop, tasks, channels, health)
