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

from sluice_tools.stack import Stack, StackConfig


@dataclass(frozen=True)
class SluiceConfig:
    """One Sluice configuration the bench runs."""

    description: str
    scheduler_args: tuple[str, ...] = ()
    """Flags of every replica's agent (`python -m scheduler_svc --engine vllm ...`)."""
    router_args: tuple[str, ...] = ()


SLUICE_CONFIGS: dict[str, SluiceConfig] = {
    "sluice": SluiceConfig("Sluice with its defaults (score router, fcfs gateway queue, 16 in flight per engine)"),
    "sluice_best": SluiceConfig(
        "Sluice, srpf gateway queue (least remaining prefill first, aged) and 8 in flight per engine, so more of "
        "the queue waits where Sluice orders it and the router sees it",
        scheduler_args=("--policy", "srpf", "--max-inflight", "8"),
    ),
}


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
    run_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(StackConfig(replicas=2, engine="vllm", model=model, run_dir=run_dir, http_port=0,
                              start_timeout_s=900.0, drain_timeout_s=5.0, scheduler_args=config.scheduler_args,
                              router_args=config.router_args, engine_args=tuple(engine_args)))
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
