"""The front ends `make bench-peers` compares, each started fresh for a run in front of the same engines.

A front end is a name plus a way to start it: it returns the URLs the client sends to (the engines themselves
for round-robin, the router's one URL otherwise) and the processes whose CPU time is its cost. Policies are a
table (`FRONTS`) of small factories; an unknown name raises ValueError listing the known ones.

Peer routers run with their defaults but for the policy and loopback binds (their Prometheus exporters too).
Sluice's front ends (`bench_peers_sluice.SLUICE_CONFIGS`) are not in this table: Sluice starts its own engines.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sluice_tools.bench_peers_procs import Proc, spawn, wait_http
from sluice_tools.bench_peers_sluice import SLUICE_CONFIGS


@dataclass(frozen=True)
class Binaries:
    """Where the peer routers and engines live (the venvs `make bench-peers` makes)."""

    sglang_router: str = ".venv-peers/sglang/bin/sglang-router"
    vllm_router: str = ".venv-peers/vllm/bin/vllm-router"
    zmq_python: str = ".venv-vllm/bin/python"
    """A Python with pyzmq, for the KV-event forwarders of kv_aware (vLLM's venv has it)."""


@dataclass(frozen=True)
class Engines:
    """The running engines a front end is put in front of."""

    urls: tuple[str, ...]
    kv_events: tuple[str, ...] = ()
    """Each engine's KV-event PUB endpoint (kv_aware)."""
    kv_replay: tuple[str, ...] = ()
    """Each engine's KV-event replay endpoint."""
    block_size: int = 32
    model: str = "tiny"


@dataclass
class Started:
    """A running front end."""

    targets: list[str]
    procs: list[Proc] = field(default_factory=list)
    other_pids: list[int] = field(default_factory=list)
    """Processes of the front end that this bench did not spawn (a Sluice stack's)."""
    api_key: str = "none"

    def pids(self) -> list[int]:
        """The front end's own processes (their descendants are counted by the CPU meter)."""
        return [p.popen.pid for p in self.procs] + self.other_pids

    def stop(self) -> None:
        """Stop every process of the front end."""
        for proc in self.procs:
            proc.stop()


def free_port() -> int:
    """Return a TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _router(name: str, argv: list[str], port: int, log_dir: Path) -> Started:
    """Start a router binary listening on `port`; wait for its /health, then for its /readiness (both routers
    answer /health before their workers pass their health checks, and refuse with 503 until then)."""
    proc = spawn(name, argv, log_dir, url=f"http://127.0.0.1:{port}")
    try:
        wait_http(proc, "/health", timeout_s=60.0)
        wait_http(proc, "/readiness", timeout_s=60.0)
    except RuntimeError:
        proc.stop()
        raise
    return Started([proc.url], [proc])


def _common(port: int, engines: Engines, policy: str) -> list[str]:
    return ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *engines.urls, "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]


def round_robin(engines: Engines, bins: Binaries, log_dir: Path) -> Started:
    """No router: the client alternates the engines itself (nothing to start, no CPU of its own)."""
    return Started(list(engines.urls))


def sglang_cache_aware(engines: Engines, bins: Binaries, log_dir: Path) -> Started:
    """sglang-router, policy cache_aware (an approximate radix tree over the request text)."""
    port = free_port()
    return _router("sglang-router", [bins.sglang_router, "launch", *_common(port, engines, "cache_aware")],
                   port, log_dir)


def vllm_router_cache_aware(engines: Engines, bins: Binaries, log_dir: Path) -> Started:
    """vllm-router, policy cache_aware (tokenizes through the engines' /v1/completions/render)."""
    port = free_port()
    return _router("vllm-router", [bins.vllm_router, *_common(port, engines, "cache_aware")], port, log_dir)


def vllm_router_kv_aware(engines: Engines, bins: Binaries, log_dir: Path) -> Started:
    """vllm-router, policy kv_aware, subscribed to every engine's KV events (through a loopback forwarder each,
    see bench_peers_kvproxy) and to their replay sockets."""
    if len(engines.kv_events) != len(engines.urls) or len(engines.kv_replay) != len(engines.urls):
        raise ValueError("vllm_router_kv_aware needs a KV-event and a replay endpoint per engine")
    proxy = str(Path(__file__).with_name("bench_peers_kvproxy.py"))
    forwarders, sources = [], []
    for i, pub in enumerate(engines.kv_events):
        bound = f"tcp://127.0.0.1:{free_port()}"
        forwarders.append(spawn(f"kv-forwarder-{i}", [bins.zmq_python, proxy, pub, bound], log_dir))
        sources.append(bound)
    port = free_port()
    argv = [bins.vllm_router, *_common(port, engines, "kv_aware"), "--kv-event-block-size", str(engines.block_size),
            "--kv-event-model", engines.model]
    for url, pub, replay in zip(engines.urls, sources, engines.kv_replay, strict=True):
        argv += ["--kv-event-source", f"{url}={pub}", "--kv-event-replay-source", f"{url}={replay}"]
    try:
        started = _router("vllm-router-kv", argv, port, log_dir)
    except RuntimeError:
        for forwarder in forwarders:
            forwarder.stop()
        raise
    started.procs.extend(forwarders)
    return started


StartFront = Callable[[Engines, Binaries, Path], Started]
FRONTS: dict[str, StartFront] = {
    "round_robin": round_robin,
    "sglang_cache_aware": sglang_cache_aware,
    "vllm_router_cache_aware": vllm_router_cache_aware,
    "vllm_router_kv_aware": vllm_router_kv_aware,
}


def front_factory(name: str) -> StartFront:
    """Return the start function of peer front end `name`; raises ValueError for an unknown one (the Sluice
    front ends are started by the bench as a stack: bench_peers_sluice)."""
    if name in FRONTS:
        return FRONTS[name]
    raise ValueError(f"unknown front end {name!r}; known: {sorted(FRONTS) + sorted(SLUICE_CONFIGS)}")


def check_fronts(names: Sequence[str]) -> list[str]:
    """Return the reasons the named front ends cannot run ([] when all can)."""
    return [f"unknown front end {n!r}; known: {sorted(FRONTS) + sorted(SLUICE_CONFIGS)}"
            for n in names if n not in FRONTS and n not in SLUICE_CONFIGS]
