"""`make bench-peers` end to end, in miniature, on the session's real vLLM engines (tests/engines/conftest.py).

SLOW: shares the engines of the `vllm_stack` fixture (60-190 s to start, once per session); the bench part adds
about a minute (three runs of 12 requests, a fresh sglang-router for one, and the router's venv the first time,
made by the Makefile target `make bench-peers` uses).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sluice_tools.bench_peers import Plan, run_one
from sluice_tools.bench_peers_fronts import Binaries, Engines, Started
from sluice_tools.bench_peers_sluice import front_pids, target
from sluice_tools.bench_peers_workload import ChatShape, chat_requests
from sluice_tools.stack import Stack
from sluice_tools.stack_parts import REPO_ROOT
from tests.engines.conftest import engine_url

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

SGLANG_ROUTER = REPO_ROOT / ".venv-peers" / "sglang" / "bin" / "sglang-router"


@pytest.fixture(scope="module")
def sglang_router() -> str:
    """The sglang-router binary, installed by the Makefile's own rule when missing."""
    if not SGLANG_ROUTER.exists():
        subprocess.run(["make", "-C", str(REPO_ROOT), str(SGLANG_ROUTER.relative_to(REPO_ROOT))], check=True,
                       timeout=600)
    return str(SGLANG_ROUTER)


def _plan(tmp_path: Path) -> Plan:
    return Plan(fronts=(), workloads=("chat",), duration_s=3.0, slo_ttft_s=10.0, slo_tpot_s=1.0, timeout_s=120.0,
                trace=tmp_path / "unused.jsonl")


def test_round_robin_sglang_router_and_sluice_serve_the_same_chat_mix(vllm_stack: Stack, sglang_router: str,
                                                                      tmp_path: Path) -> None:
    """Round-robin, sglang-router cache_aware and Sluice each stream every token of the same 12 chat turns from
    the same engines, and the bench reads the engines' prefix hits, token shares and the front end's CPU."""
    engines = Engines(tuple(engine_url(vllm_stack, i) for i in range(2)))
    reqs = chat_requests(12, 4.0, ChatShape(system_tokens=256, turns=3, assistant_tokens=16))
    plan, bins = _plan(tmp_path), Binaries(sglang_router=sglang_router)
    sluice = Started([target(vllm_stack)], other_pids=front_pids(vllm_stack), api_key="k-gold")
    runs = {
        "round_robin": run_one("round_robin", reqs, engines, bins, plan, tmp_path),
        "sglang_cache_aware": run_one("sglang_cache_aware", reqs, engines, bins, plan, tmp_path),
        "sluice": run_one("sluice", reqs, engines, bins, plan, tmp_path, sluice),
    }
    for name, (summary, records) in runs.items():
        assert [r.status for r in records] == ["ok"] * 12, (name, [r.detail for r in records])
        assert all(r.output_tokens == 16 for r in records), name
        head = summary["headline"]
        # the 256-token system prompt repeats: after a cache reset, only its first sight on each engine misses
        assert head["prefix_hit_rate"] is not None and head["prefix_hit_rate"] > 0.3, (name, head)
        assert sum(head["token_share"]) == pytest.approx(1.0), name
    assert runs["round_robin"][0]["headline"]["cpu_ms_per_request"] is None
    assert runs["sglang_cache_aware"][0]["front_cpu"]["seconds"] is not None
    assert runs["sluice"][0]["front_cpu"]["seconds"] > 0.0
