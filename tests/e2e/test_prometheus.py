"""A real Prometheus 2.x (Debian's 2.42, whose Accept header prefers OpenMetrics) scraping a running stack
stores the `vllm:*` names with their colon, and every query of the Grafana dashboard returns data."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.client import Client
from sluice_tools.stack import Stack, StackConfig
from tests.prometheus_server import Prometheus

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420)]
ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "sluice-dashboard.json"
VLLM_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
              "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
              "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
              "vllm:prefix_cache_hits_total", "vllm:request_success_total")


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Prometheus]]:
    """A small stack (two cost-model replicas, an HTTP port) under a little load, scraped by a real Prometheus."""
    work = tmp_path_factory.mktemp("prom")
    stack = Stack(StackConfig(backend="costmodel", model="llama-3-8b", replicas=2, run_dir=work / "run",
                              http_port=0, emulate_time=True)).start()
    prometheus, planner = None, None
    try:
        targets: dict[str, list[str]] = {}
        for proc in stack.procs:
            if proc.metrics_url:
                job = re.sub(r"-\d+$", "", proc.name)
                targets.setdefault(job, []).append(proc.metrics_url.split("/")[2])
        planner = start_planner(stack, work)
        targets["planner"] = [planner_url.split("/")[2] for planner_url in [planner[1]]]
        prometheus = Prometheus(work / "prometheus", targets)
        with Client(stack.endpoint, api_key=stack.api_key) as client:
            for i in range(12):
                client.generate_text(f"shared prefix for the prometheus test, request {i % 3}", max_tokens=8)
        refused_and_abandoned(stack)
        prometheus.wait_targets_up(scrapes=4)
        yield stack, prometheus
    finally:
        if prometheus is not None:
            prometheus.stop()
        if planner is not None:
            planner[0].terminate()
            planner[0].wait(10)
        stack.stop()


def refused_and_abandoned(stack: Stack) -> None:
    """A request for an unknown model (a rejection) and a streamed one whose client leaves (a cancellation)."""
    headers = {"Authorization": f"Bearer {stack.api_key}", "Content-Type": "application/json"}
    unknown = urllib.request.Request(f"{stack.http_base_url}/completions", method="POST", headers=headers,
                                     data=json.dumps({"model": "no-such-model", "prompt": "x"}).encode())
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(unknown, timeout=30)
    body = {"model": "llama-3-8b", "prompt": "a long one", "max_tokens": 2000, "stream": True}
    streamed = urllib.request.Request(f"{stack.http_base_url}/completions", method="POST", headers=headers,
                                      data=json.dumps(body).encode())
    with urllib.request.urlopen(streamed, timeout=30) as reply:
        reply.readline()  # the first event; then the client goes away
    time.sleep(1)


def start_planner(stack: Stack, work: Path) -> tuple[subprocess.Popen[str], str]:
    """The deployed planner (python -m planner_svc, publishing only) watching the stack; its process and metrics URL."""
    assert stack.router is not None
    process = subprocess.Popen([sys.executable, "-m", "planner_svc", "--port", "0", "--metrics-port", "0",
                                "--router", stack.router.address, "--connector", "prometheus", "--period", "1"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("metrics on "), line
    return process, line.removeprefix("metrics on ").strip()


def test_prometheus_2_stores_vllm_names_with_their_colon(scraped: tuple[Stack, Prometheus]) -> None:
    """Every vLLM-compatible name the schedulers export is queryable as `vllm:...`; nothing was stored as `vllm_...`."""
    _stack, prometheus = scraped
    missing = [name for name in VLLM_NAMES if not prometheus.query(name)]
    assert missing == [], missing
    assert prometheus.query('{__name__=~"vllm_.+"}') == []
    assert {s["metric"]["model_name"] for s in prometheus.query("vllm:num_requests_running")} == {"llama-3-8b"}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, query) of every query in the dashboard."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def substitute(expr: str, variables: dict[str, str]) -> str:
    """The query as Grafana sends it: `$__rate_interval` and the dashboard's variables replaced."""
    expr = expr.replace("$__rate_interval", "1m")
    for name, value in variables.items():
        expr = expr.replace(f"${name}", value)
    return expr


def variable_values(prometheus: Prometheus) -> dict[str, str]:
    """Every dashboard variable's "All" value, as Grafana renders a multi-value variable into a regex."""
    templating = json.loads(DASHBOARD.read_text())["templating"]["list"]
    values: dict[str, str] = {}
    for variable in templating:
        if variable["type"] != "query":
            continue
        found = re.match(r"label_values\((.+),\s*(\w+)\)$", variable["query"]["query"]
                         if isinstance(variable["query"], dict) else variable["query"])
        assert found, variable
        series = prometheus.api("series", **{"match[]": substitute(found.group(1), values)})
        seen = sorted({s[found.group(2)] for s in series if found.group(2) in s})
        assert seen, f"variable {variable['name']} has no values"
        # Grafana's regex escaping of each value, then PromQL's string escaping of the backslashes.
        values[variable["name"]] = "(" + "|".join(re.escape(v).replace("\\", "\\\\") for v in seen) + ")"
    return values


def test_every_dashboard_query_returns_data_on_a_running_stack(scraped: tuple[Stack, Prometheus]) -> None:
    """Each query of the dashboard, as Grafana sends it with every variable on All, answers at least one series:
    none is excused. The counters of rare events this run does not cause (drains, migrations, re-routes,
    unreachable reports, a scheduler's own refusals) answer 0, since every known label value is exported from
    the start (sluice.prom.zero_series); a misspelt name or label answers nothing and fails here."""
    _stack, prometheus = scraped
    time.sleep(2)  # one more scrape after the load, so rates over the window have two points
    variables = variable_values(prometheus)
    queries = dashboard_queries()
    empty = [(title, expr) for title, expr in queries if not prometheus.query(substitute(expr, variables))]
    assert empty == [], "\n".join(f"{title}: {expr}" for title, expr in empty)
    print(json.dumps({"dashboard_queries": len(queries), "with_data": len(queries) - len(empty)}))


def test_the_deployed_planner_sees_the_load_s_lengths_and_latencies(scraped: tuple[Stack, Prometheus]) -> None:
    """The deployed planner takes its demand, TTFT and TPOT signals from the schedulers' running totals (Stats):
    under the fixture's load each rose above 0 in the window Prometheus holds (before, all three stayed 0 in a
    deployment: no length or latency was observed)."""
    _stack, prometheus = scraped
    for signal in ("demand", "ttft", "tpot"):
        [series] = prometheus.query(f'max_over_time(sluice_planner_pressure{{signal="{signal}"}}[10m])')
        assert float(series["value"][1]) > 0, signal
