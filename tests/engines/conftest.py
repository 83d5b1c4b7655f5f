"""One stack of real vLLM engines for the whole session: 2 unmodified vLLM CPU servers under Sluice.

Started once (vLLM takes 15-190 s to be ready: torch.compile with an on-disk cache) and shared by every test
in this folder; the tests that kill or drain an engine come last in test_vllm_engines.py. The engines run
`--max-num-seqs 4` with Sluice's scheduler class inside (fair share, weights gold=2, bronze=1), and each
agent dispatches at most 4 requests (`--max-inflight 4`): the gateway's queue decides the order behind Sluice,
the class decides it for requests sent straight to an engine. The router spreads each tenant's requests evenly
(`--tenant-spread 1`), so that every agent's fair queue sees both tenants.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice_tools.stack import Stack, StackConfig
from sluice_tools.vllm_engine import vllm_python

CONFIG = """
[tenants.gold]
api_keys = ["k-gold"]
weight = 2.0
[tenants.bronze]
api_keys = ["k-bronze"]
weight = 1.0
"""

WEIGHTS = "gold=2,bronze=1,burst-gold=2,burst-bronze=1"
"""The engines' tenant weights: gold and bronze for the traffic through Sluice, and a pair of tenants of their own for
the burst sent straight to an engine (tests/engines/test_vllm_engines.py), so that no earlier test's traffic leaves
them anything owed."""


@pytest.fixture(scope="session")
def vllm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Redis, router, admission (HTTP too) and 2 vLLM replicas, each an engine + its Sluice agent; supervised."""
    vllm_python()  # a clear FileNotFoundError (run `make setup-vllm`) rather than an engine that never starts
    run_dir = tmp_path_factory.mktemp("vllm-stack")
    config = run_dir / "sluice.toml"
    config.write_text(CONFIG)
    stack_config = StackConfig(
        replicas=2, engine="vllm", model="tiny", config_file=str(config), run_dir=run_dir, http_port=0,
        start_timeout_s=900, drain_timeout_s=5, router_args=("--tenant-spread", "1"), scheduler_args=("--policy", "fair", "--max-inflight", "4", "--drain-timeout", "3"),
        engine_args=("--max-num-seqs", "4"), vllm_scheduler_cls="scheduler_svc.engines.vllm.sched_cls.SluiceScheduler",
        env=(("SLUICE_VLLM_POLICY", "fair"), ("SLUICE_TENANT_WEIGHTS", WEIGHTS)))
    with Stack(stack_config) as stack:
        stack.fleet.start_supervising()
        yield stack


def engine_url(stack: Stack, index: int) -> str:
    """The OpenAI base URL of engine `index` (straight to vLLM, not through Sluice)."""
    return str(stack.replicas[f"replica-{index}"].engine.url)


def engine_metric(stack: Stack, index: int, name: str) -> float:
    """Sum of a vllm:* metric over its label sets, read from the engine's /metrics."""
    with urllib.request.urlopen(f"{engine_url(stack, index)}/metrics", timeout=5) as reply:  # noqa: S310
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def direct_completion(stack: Stack, index: int, prompt: list[int], max_tokens: int,
                      request_id: str = "", timeout: float = 120) -> dict[str, Any]:
    """A non-streamed greedy completion straight from engine `index`: the unfaulted reference."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    headers = {"Content-Type": "application/json"}
    if request_id:
        headers["X-Request-Id"] = request_id
    request = urllib.request.Request(f"{engine_url(stack, index)}/v1/completions", data=json.dumps(body).encode(),
                                     headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310 (loopback)
        result: dict[str, Any] = json.loads(reply.read())
    return result


def log_of(stack: Stack, name: str) -> Path:
    return stack.run_dir / f"{name}.log"
