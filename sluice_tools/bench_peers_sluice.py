"""Sluice as a front end of `make bench-peers`: `sluice up --engine vllm` (a `Stack` with engine "vllm").

Sluice's stack starts its vLLM engines itself (each under a Sluice agent that speaks the scheduler contract:
scheduler_svc/engines/vllm), so Sluice cannot be put in front of the bench's already-running engines the way a
peer router is. The bench therefore runs Sluice in a phase of its own: it stops its engines, starts the stack
with the same engine flags (`sluice_tools.vllm_engine`, same model, block size, KV size, one core each, the
bench's extra flags) and replays the same requests at the same times, emptying the stack's engines' prefix
caches before each run. The front end's CPU is every stack process but the engines (admission with its HTTP
edge, router, agents, Redis).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sluice.config import DEFAULT_API_KEY
from sluice_tools.bench_peers_workload import TENANTS
from sluice_tools.stack import Stack, StackConfig


@dataclass(frozen=True)
class SluiceConfig:
    """One Sluice configuration the bench runs."""

    description: str
    scheduler_args: tuple[str, ...] = ()
    """Flags of every replica's agent (`python -m scheduler_svc --engine vllm ...`)."""
    router_args: tuple[str, ...] = ()
    vllm_scheduler_cls: str = ""
    """vLLM's --scheduler-cls inside every engine ("": vLLM's own)."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment of the stack's processes (the in-vLLM class reads its policy and weights there)."""
    cells: str = "loads"
    """Which cells it runs: "loads" (both workloads at every load) or "tenants" (the fairness cell)."""


WEIGHTS = ",".join(f"{name}={weight:g}" for name, weight, _ in TENANTS)
SLUICE_CONFIGS: dict[str, SluiceConfig] = {
    "sluice": SluiceConfig("Sluice with its defaults (score router, prefill weight 1, fcfs gateway queue, 16 in "
                           "flight per engine)"),
    "sluice_pw4": SluiceConfig(
        "Sluice, router --prefill-weight 4 --ttft-target 1 (a request's own uncached prefill weighs 4x among "
        "replicas predicted to meet the 1 s TTFT SLO: cache hits count more)",
        router_args=("--prefill-weight", "4", "--ttft-target", "1"),
    ),
    "sluice_pw32": SluiceConfig(
        "Sluice, router --prefill-weight 32 --ttft-target 1: on the tiny model a prefill costs milliseconds next "
        "to queue waits of tens, so only a large weight lets a cache hit outweigh a shorter queue",
        router_args=("--prefill-weight", "32", "--ttft-target", "1"),
    ),
    "sluice_pw4_spaced": SluiceConfig(
        "sluice_pw4, and every agent letting tokens that come within 30 ms of its last publication wait 30 ms to go "
        "out together (--publish-interval-ms 30: a request's first tokens and its end at once; Redis, admission and "
        "the client handle one entry, delta and chunk for many of vLLM's chunks)",
        scheduler_args=("--publish-interval-ms", "30"), router_args=("--prefill-weight", "4", "--ttft-target", "1"),
    ),
    "sluice_pw4_chunked": SluiceConfig(
        "sluice_pw4, and every agent asking vLLM for a chunk per 8 tokens (--engine-stream-interval 8: vLLM's "
        "per-request stream_interval; the first token and the end at once): the agent, Redis, admission and vLLM's "
        "API server handle one chunk for 8 tokens",
        scheduler_args=("--engine-stream-interval", "8"), router_args=("--prefill-weight", "4", "--ttft-target", "1"),
    ),
    "sluice_fair": SluiceConfig(
        "Sluice for tenants: fair gateway queue (weights gold=2, bronze=1) with 4 in flight per engine (the backlog "
        "waits where the fair queue orders it), the router spreading each tenant over the replicas "
        "(--tenant-spread 1), Sluice's scheduler class ordering vLLM's own queue by the same policy",
        scheduler_args=("--policy", "fair", "--max-inflight", "4"), router_args=("--tenant-spread", "1"),
        vllm_scheduler_cls="scheduler_svc.engines.vllm.sched_cls.SluiceScheduler",
        env=(("SLUICE_VLLM_POLICY", "fair"), ("SLUICE_TENANT_WEIGHTS", WEIGHTS)), cells="tenants",
    ),
    "sluice_priority": SluiceConfig(
        "Sluice for priorities: priority gateway queue (higher first, aged), 4 in flight per engine so that the "
        "queue is where requests wait",
        scheduler_args=("--policy", "priority", "--max-inflight", "4"), cells="tenants",
    ),
}
"""Every Sluice configuration the bench knows; `sluice_best` in the table is, per workload, the "loads" one with
the highest goodput summed over near and over loads (bench_peers_report.best_sluice)."""

TENANT_CONFIG = "".join(f'[tenants.{name}]\napi_keys = ["k-{name}"]\nweight = {weight:g}\n'
                        for name, weight, _ in TENANTS) + f'[tenants.default]\napi_keys = ["{DEFAULT_API_KEY}"]\n'
"""The stack's tenants: the fairness cell's two (key k-NAME) and the default one every other request uses."""
TENANT_KEYS = {name: f"k-{name}" for name, _, _ in TENANTS}


def is_sluice(name: str) -> bool:
    """True for a Sluice front-end name."""
    return name in SLUICE_CONFIGS


def start_stack(name: str, engine_args: Sequence[str], run_dir: Path, vllm_python: str, model: str = "tiny") -> Stack:
    """Start a Sluice stack of 2 vLLM replicas in configuration `name`, its engines run by `vllm_python`; returns
    it serving (raises StackError, or KeyError listing the configurations for an unknown name)."""
    if name not in SLUICE_CONFIGS:
        raise KeyError(f"unknown Sluice configuration {name!r}; known: {sorted(SLUICE_CONFIGS)}")
    config = SLUICE_CONFIGS[name]
    os.environ["SLUICE_VLLM_PYTHON"] = vllm_python  # where sluice_tools.vllm_engine looks first
    run_dir = run_dir.resolve()  # Redis reads its ACL file after changing into its own directory
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "sluice.toml").write_text(TENANT_CONFIG)
    stack = Stack(StackConfig(replicas=2, engine="vllm", model=model, run_dir=run_dir, http_port=0,
                              start_timeout_s=900.0, drain_timeout_s=5.0, scheduler_args=config.scheduler_args,
                              router_args=config.router_args, engine_args=tuple(engine_args),
                              config_file=str(run_dir / "sluice.toml"), vllm_scheduler_cls=config.vllm_scheduler_cls,
                              env=config.env))
    stack.start()
    return stack


def engine_urls(stack: Stack) -> list[str]:
    """The stack's engines' own URLs (for cache resets and their counters), in replica order."""
    return [str(stack.replicas[k].engine.url) for k in sorted(stack.replicas)]


def front_pids(stack: Stack) -> list[int]:
    """Every process of the stack but its engines (the CPU meter adds their children)."""
    engines = {r.worker.popen.pid for r in stack.replicas.values() if r.worker.popen is not None}
    pids = [p.popen.pid for p in stack.procs if p.popen is not None and p.popen.pid not in engines]
    if stack.redis is not None and stack.redis.pid is not None:
        pids.append(stack.redis.pid)
    return pids


def target(stack: Stack) -> str:
    """The stack's OpenAI base URL without its /v1 (the client adds it)."""
    return stack.http_base_url.removesuffix("/v1")
