"""End to end: `sluice up --disagg P:D --autoscale MIN:MAX`, the pool planner under a running disaggregated stack.

Real processes (router, admission, Redis, cost-model workers with modelled time, schedulers with their roles); the
planner is planner_svc/pools.py's `PoolPlanner` through `PoolPlannerLoop`, with the quick timings of
`quick_pools_config` (replicas that start in about a second). Under a prefill-heavy load (prompts of 10 blocks,
computed 32 tokens a round, 24 output tokens) the prefill pool grows and the decode pool does not; when the load
stops, the prefill pool drains back within itself. Every request ends once with the cost model's exact tokens.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from sluice import client as sdk
from sluice.v1 import scheduler_pb2, scheduler_pb2_grpc
from sluice_tools.autoscale import PoolAutoscaler, quick_pools_config
from sluice_tools.stack import REPO_ROOT, Stack, StackConfig
from sluice_tools.supervisor import Supervisor
from tests.processes import read_until, wait_until
from worker_svc.costmodel import CostModel

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MODEL = "llama-3-8b"
PROMPT_TOKENS = 160
MAX_TOKENS = 24


class Load:
    """Closed-loop clients sending prompts of `prompt_tokens` for `max_tokens` each; each outcome (status, exact
    tokens) is kept."""

    def __init__(self, stack: Stack, clients: int, prompt_tokens: int = PROMPT_TOKENS,
                 max_tokens: int = MAX_TOKENS) -> None:
        self.stack = stack
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.outcomes: list[tuple[str, bool]] = []
        self.stopped = threading.Event()
        self.model = CostModel(MODEL)
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]

    def _client(self, i: int) -> None:
        with sdk.Client(self.stack.endpoint, api_key=self.stack.api_key) as client:
            n = 0
            while not self.stopped.is_set():
                n += 1
                prompt = [1 + (i * 31 + n * 7 + j * 13) % 250 for j in range(self.prompt_tokens)]
                status, request_id, tokens = "NO_STATUS", "", []
                try:
                    for chunk in client.generate(prompt, max_tokens=self.max_tokens, ignore_eos=True, timeout=60):
                        request_id = chunk.request_id
                        status = chunk.status or status
                        tokens.extend(chunk.token_ids)
                except sdk.SluiceError as exc:
                    status = exc.code.name
                exact = tokens == [self.model.token_for(request_id, self.prompt_tokens + k)
                                   for k in range(self.max_tokens)]
                self.outcomes.append((status, exact))

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(90)


def _finished(stack: Stack, replica_id: str) -> int:
    """Requests the replica's scheduler has finished (0 when it does not answer)."""
    replica = stack.replicas.get(replica_id)
    scheduler = replica.scheduler if replica is not None else None
    if scheduler is None:
        return 0
    with stack.channel(scheduler.address) as channel:
        try:
            return scheduler_pb2_grpc.SchedulerServiceStub(channel).Stats(scheduler_pb2.StatsRequest(),
                                                                          timeout=2).finished
        except grpc.RpcError:
            return 0


def _scrape(url: str) -> dict[str, float]:
    """The pool planner's samples, by their full name with labels."""
    with urllib.request.urlopen(url, timeout=5) as reply:  # noqa: S310 (our own loopback endpoint)
        return {name: float(value) for line in reply.read().decode().splitlines()
                if line.startswith("sluice_planner_pool") for name, _, value in [line.rpartition(" ")]}


def test_prefill_heavy_load_grows_the_prefill_pool_only(tmp_path: Path) -> None:
    """From 1:1 (each pool 1..3), a prefill-heavy load makes the planner add prefill replicas (they register as
    prefill and serve prompts) and no decode replica; when it stops, a prefill replica is drained and retired;
    every request finished with exact tokens."""
    lines: list[str] = []
    config = StackConfig(backend="costmodel", model=MODEL, emulate_time=True, run_dir=tmp_path, disagg=(1, 1),
                         scheduler_args=("--max-num-batched-tokens", "32", "--max-prefill-chunk", "32"),
                         start_timeout_s=60)
    with Stack(config) as stack:
        stack.fleet.supervisor = Supervisor(stack, on_event=lines.append)
        # 10 clients put at most 10 requests on the decode pool: at 16 a replica, decode load stays under its target
        # once the prefill pool has grown (at quick_pools_config's 8 it would rightly grow the decode pool too).
        pools = replace(quick_pools_config(1, 3), decode_seqs_per_replica=16.0)
        autoscaler = PoolAutoscaler(stack, pools, period_s=0.5, on_event=lines.append)
        roles: dict[str, str] = {}  # every replica the fleet had, with its role (a retired one leaves stack.replicas)
        stack.fleet.supervisor.hooks.append(lambda _: roles.update({rid: r.role for rid, r in list(stack.replicas.items())}))
        stack.fleet.supervisor.hooks.append(autoscaler.tick)
        metrics_url = autoscaler.serve_metrics()
        stack.fleet.start_supervising(0.1)
        with Load(stack, clients=10) as load:
            assert wait_until(lambda: any(e[1:3] == ("prefill", "scale_up") for e in autoscaler.events), 40), \
                "\n".join(lines)
            # One of the prefill replicas it added (the planner may retire one again before it serves) serves prompts.
            assert wait_until(lambda: any(_finished(stack, r.replica_id) > 0 for r in list(stack.replicas.values())
                                          if r.role == "prefill" and r.replica_id != "replica-0"), 40), "\n".join(lines)
            scraped = _scrape(metrics_url)
            assert sum(v for k, v in scraped.items() if k.startswith("sluice_planner_pool_decisions_total")
                       and 'kind="scale_up"' in k and 'pool="prefill"' in k) >= 1, scraped
        assert not [e for e in autoscaler.events if e[1] == "decode"], lines
        assert list(roles.values()).count("decode") == 1
        assert wait_until(lambda: any(e[1:3] == ("prefill", "scale_down") for e in autoscaler.events)
                          and any(" retired (" in line for line in lines), 60), "\n".join(lines)
        retired = {line.split()[0] for line in lines if " retired (" in line}
        assert retired and all(roles[rid] == "prefill" for rid in retired), (retired, roles)  # drained in its pool
        assert "replica-1" in stack.replicas  # the decode replica was never touched
        statuses = [status for status, _ in load.outcomes]
        assert load.outcomes and all(status == "FINISHED_LENGTH" for status in statuses), sorted(set(statuses))
        assert all(exact for _, exact in load.outcomes)
        scraped = _scrape(metrics_url)
        assert scraped['sluice_planner_pool_current_replicas{pool="decode"}'] == 1.0, scraped
        print("\n".join(lines))
        print(f"requests: {len(load.outcomes)}, all finished and exact")


def test_decode_heavy_load_grows_the_decode_pool_only(tmp_path: Path) -> None:
    """From 1:1 (each pool 1..3), a decode-heavy load (12 clients, 20-token prompts, 150 output tokens: nearly every
    request decoding at once, 12 in flight against a decode-load target of 8) makes the planner add decode replicas
    (they register as decode and receive hand-offs) and no prefill replica; every request finished exact."""
    lines: list[str] = []
    config = StackConfig(backend="costmodel", model=MODEL, emulate_time=True, run_dir=tmp_path, disagg=(1, 1),
                         start_timeout_s=60)
    with Stack(config) as stack:
        stack.fleet.supervisor = Supervisor(stack, on_event=lines.append)
        autoscaler = PoolAutoscaler(stack, quick_pools_config(1, 3), period_s=0.5, on_event=lines.append)
        stack.fleet.supervisor.hooks.append(autoscaler.tick)
        stack.fleet.start_supervising(0.1)
        with Load(stack, clients=12, prompt_tokens=20, max_tokens=150) as load:
            assert wait_until(lambda: any(e[1:3] == ("decode", "scale_up") for e in autoscaler.events), 40), \
                "\n".join(lines)
            # One of the decode replicas it added receives hand-offs and decodes them.
            assert wait_until(lambda: any(_finished(stack, r.replica_id) > 0 for r in list(stack.replicas.values())
                                          if r.role == "decode" and r.replica_id != "replica-1"), 40), "\n".join(lines)
            roles = [r.role for r in stack.replicas.values()]
        assert not [e for e in autoscaler.events if e[1] == "prefill"], lines
        assert roles.count("prefill") == 1
        statuses = [status for status, _ in load.outcomes]
        assert load.outcomes and all(status == "FINISHED_LENGTH" for status in statuses), sorted(set(statuses))
        assert all(exact for _, exact in load.outcomes)
        print("\n".join(lines))
        print(f"requests: {len(load.outcomes)}, all finished and exact")


def test_disagg_with_autoscale_starts_from_the_command_line(tmp_path: Path) -> None:
    """`sluice up --disagg 1:1 --autoscale 1:2` starts (the two went together only as a refusal before) and says
    that each pool is sized apart."""
    up = subprocess.Popen([sys.executable, "-m", "sluice_tools.cli", "up", "--disagg", "1:1", "--autoscale", "1:2",
                           "--backend", "costmodel", "--model", MODEL, "--port", "0", "--http-port", "-1",
                           "--run-dir", str(tmp_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    try:
        lines = read_until(up, "replicas in each pool", 120)
        assert any("1 to 2 replicas in each pool (prefill, decode)" in line for line in lines), "".join(lines)
    finally:
        up.send_signal(2)
        up.communicate(timeout=60)
    assert up.returncode == 0
