"""The fairness cell of `make bench-peers` and the fixed Mooncake window: workload, client and figures.

The client is driven against a small streaming OpenAI completions server on 127.0.0.1 (aiohttp) that records
the key and body of each request and streams one chunk per token at a fixed pace.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from aiohttp import web

from sluice_tools.bench_peers import Plan, build_workload
from sluice_tools.bench_peers_client import replay
from sluice_tools.bench_peers_report import best_sluice, format_tenants, sluice_best_rows, tenant_figures
from sluice_tools.bench_peers_workload import ChatShape, Req, tenant_requests
from sluice_tools.metrics import RequestRecord
from tests.processes import serve_on_loopback


def _trace(path: Path, rows: int) -> Path:
    with path.open("w") as out:
        for i in range(rows):
            out.write(json.dumps({"timestamp": i * 100, "input_length": 1024, "output_length": 8 + i,
                                  "hash_ids": [i % 5, 1000 + i]}) + "\n")
    return path


def test_mooncake_is_one_window_of_rows_at_every_rate(tmp_path: Path) -> None:
    """Light, near and over replay the same trace rows (same prompts and outputs), only their arrivals are
    stretched: the window is the trace's last `mooncake_rows` rows whatever the rate and duration."""
    plan = Plan((), ("mooncake",), 10.0, 1.0, 0.1, 60.0, _trace(tmp_path / "t.jsonl", 50), mooncake_rows=20)
    light, near, over = (build_workload("mooncake", rate, plan) for rate in (3.0, 10.0, 15.0))
    assert len(light) == len(near) == len(over) == 20
    assert [r.prompt for r in light] == [r.prompt for r in over] and [r.max_tokens for r in near][0] == 38 // 4
    assert light[-1].arrival_s > near[-1].arrival_s > over[-1].arrival_s


def test_tenant_cell_has_two_tenants_at_the_rate_each_gold_with_priority() -> None:
    """Each tenant sends its own chat mix (own system prompt) at the rate asked; gold carries priority 1."""
    reqs = tenant_requests(4.0, 10.0, ChatShape(system_tokens=64, turns=2, assistant_tokens=8))
    gold = [r for r in reqs if r.tenant == "gold"]
    bronze = [r for r in reqs if r.tenant == "bronze"]
    assert len(gold) == len(bronze) == 40
    assert {r.priority for r in gold} == {1} and {r.priority for r in bronze} == {0}
    assert gold[0].prompt[:80] != bronze[0].prompt[:80]
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)


async def _serve(seen: list[dict[str, Any]]) -> tuple[web.AppRunner, str]:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({"key": request.headers.get("Authorization", ""), "body": body})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(body["max_tokens"]):
            await asyncio.sleep(0.05)
            chunk = {"id": "c", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [{"index": 0, "text": "x", "finish_reason": None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [],
                 "usage": {"prompt_tokens": 1, "completion_tokens": body["max_tokens"], "total_tokens": 2}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return await serve_on_loopback(app)


def test_replay_sends_tenant_keys_and_priority_and_cuts_at_the_stop_time() -> None:
    """Each request carries its tenant's key (the run's key for the default tenant) and, with send_priority, its
    nonzero priority; at stop_at_s what still streams is closed as "cancelled" with the tokens it got kept."""
    reqs = [Req(0.0, "a", 3, "g", "gold", 1), Req(0.0, "b", 3, "b", "bronze", 0), Req(0.0, "c", 3, "d"),
            Req(0.0, "d", 100, "g", "gold", 1)]
    seen: list[dict[str, Any]] = []

    async def body() -> list[RequestRecord]:
        runner, url = await _serve(seen)
        try:
            return await replay(reqs, [url], "m", 30.0, "k-default", api_keys={"gold": "k-g", "bronze": "k-b"},
                                send_priority=True, stop_at_s=1.0)
        finally:
            await runner.cleanup()

    records = asyncio.run(body())
    keys = {s["body"]["prompt"]: s["key"] for s in seen}
    assert keys == {"a": "Bearer k-g", "b": "Bearer k-b", "c": "Bearer k-default", "d": "Bearer k-g"}
    priorities = {s["body"]["prompt"]: s["body"].get("priority") for s in seen}
    assert priorities == {"a": 1, "b": None, "c": None, "d": 1}
    assert [r.status for r in records] == ["ok", "ok", "ok", "cancelled"]
    assert [r.tenant for r in records] == ["gold", "bronze", "default", "gold"]
    assert 5 <= records[3].output_tokens < 100 and records[3].first_token_s is not None


def _record(tenant: str, arrival: float, first: float | None, tokens: list[float]) -> RequestRecord:
    return RequestRecord(request_id=f"{tenant}{arrival}", tenant=tenant, arrival_s=arrival, first_token_s=first,
                         token_times=tokens, status="ok" if first is not None else "cancelled")


def test_tenant_figures_count_tokens_served_within_the_window_and_ttft_per_tenant() -> None:
    """Served tokens count only the tokens streamed by the window's end; TTFT percentiles are per tenant, and a
    request that never streamed is counted apart."""
    records = [_record("gold", 0.0, 0.5, [0.5, 1.0, 1.5, 9.0]), _record("bronze", 0.0, 2.0, [2.0, 9.5]),
               _record("gold", 1.0, 1.2, [1.2]), _record("bronze", 3.0, None, [])]
    figures = tenant_figures(records, window_end_s=5.0)
    assert figures["tenants"] == ["gold", "bronze"]
    assert figures["gold"]["served_tokens_in_window"] == 4 and figures["bronze"]["served_tokens_in_window"] == 1
    assert figures["served_ratio"] == 4.0
    assert figures["gold"]["ttft_p99_ms"] == 500.0 and figures["bronze"]["ttft_p99_ms"] == 2000.0
    assert figures["bronze"]["no_first_token"] == 1
    assert "| sluice_fair | 4.00 | 500 |" in format_tenants([{"front": "sluice_fair", "tenants": figures}])


def test_sluice_best_is_the_config_with_most_goodput_at_near_and_over_per_workload() -> None:
    """Per workload the configuration with the highest near + over goodput is copied as `sluice_best`."""
    def run(workload: str, load: str, front: str, goodput: float) -> dict[str, Any]:
        return {"workload": workload, "load": load, "front": front, "headline": {"goodput_rps": goodput}}

    runs = [run("chat", "near", "sluice", 3.0), run("chat", "over", "sluice", 1.0), run("chat", "light", "sluice", 9.0),
            run("chat", "near", "sluice_pw4", 2.0), run("chat", "over", "sluice_pw4", 2.5),
            run("mooncake", "near", "sluice", 5.0), run("mooncake", "near", "sluice_pw4", 1.0),
            run("chat", "near", "round_robin", 99.0)]
    best = best_sluice(runs, ["sluice", "sluice_pw4"])
    assert best == {"chat": "sluice_pw4", "mooncake": "sluice"}
    copies = sluice_best_rows(runs, best)
    assert {(r["workload"], r["load"], r["config"]) for r in copies} == {
        ("chat", "near", "sluice_pw4"), ("chat", "over", "sluice_pw4"), ("mooncake", "near", "sluice")}
    assert all(r["front"] == "sluice_best" for r in copies)
