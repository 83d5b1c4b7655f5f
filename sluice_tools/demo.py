"""`make demo` (`python -m sluice_tools.demo`): the whole stack on this machine, a short workload, a report.

What it does, as a new user would: start embedded Redis, a router, two replicas (worker + scheduler)
of the tiny torch model and admission, each its own process; replay the first 40 requests of the
Azure conversation trace (lengths scaled to fit the tiny model, arrivals compressed to ~8 s; without the
trace beside the repository, a built-in synthetic workload, and it says so) from three tenants with two priorities, cancel one request mid-stream; print the report and where the
JSON and the logs are; shut everything down (drain, then stop).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sluice.options import HelpFormatter, output_dir, positive_float, positive_int
from sluice_tools.commands.bench import Outcome, drive, fit_lengths, summarize_run
from sluice_tools.report import format_table, write_json
from sluice_tools.stack import Stack, StackConfig
from sluice_tools.workload import Workload, WorkloadError, WorkloadRequest, load_workload

TENANTS = {"alice": "sk-demo-alice", "bob": "sk-demo-bob", "carol": "sk-demo-carol"}
SLO_TTFT_S = 2.0
SLO_TPOT_S = 0.2
CONFIG = "\n".join(f'[tenants.{name}]\napi_keys = ["{key}"]\nweight = {1.0 if name != "alice" else 2.0}\n'
                   for name, key in TENANTS.items())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Return the demo's options (all have working defaults)."""
    p = argparse.ArgumentParser(prog="python -m sluice_tools.demo", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--requests", type=positive_int, default=40, help="requests to replay")
    p.add_argument("--replicas", type=positive_int, default=2, help="worker + scheduler pairs")
    p.add_argument("--arrival-span", type=positive_float, default=8.0, help="seconds over which requests arrive")
    p.add_argument("--out", type=output_dir, default=None,
                   help="directory for the JSON report and logs (default: a new temp dir)")
    return p.parse_args(argv)


# Used when the Azure trace is not beside the repository (a fresh clone has no ../shared): lengths drawn like
# the conversation trace's (a lognormal prompt around 1,000 tokens, answers around 250), Poisson arrivals.
BUILT_IN_WORKLOAD = "synthetic:poisson?rate=5&n={count}&input=lognormal:1000:0.8:4000&output=lognormal:250:0.7:800"


def demo_workload(count: int) -> tuple[Workload, str]:
    """Return the first `count` requests of the Azure conversation trace and where they came from, or, when the
    trace is absent, the built-in synthetic workload and a sentence saying so (the demo prints it)."""
    try:
        return load_workload("azure-conv", max_requests=count), "the first requests of the Azure LLM conversation trace"
    except WorkloadError as missing:
        workload = load_workload(BUILT_IN_WORKLOAD.format(count=count), max_requests=count)
        return workload, (f"a built-in synthetic workload ({missing}; set $SLUICE_TRACES_DIR to use the trace): "
                          f"{BUILT_IN_WORKLOAD.format(count=count)}")


def demo_requests(count: int, span_s: float) -> list[WorkloadRequest]:
    """Return the demo workload: Azure conversation lengths scaled down, 3 tenants, 2 priorities, 1 cancel."""
    return shape_requests(demo_workload(count)[0], span_s)


def shape_requests(workload: Workload, span_s: float) -> list[WorkloadRequest]:
    """Return the workload's requests fitted to the demo: arrivals over `span_s`, lengths scaled to the tiny
    model, 3 tenants taking turns, every 5th request at priority 1, one request cancelled mid-stream."""
    natural = max(workload.duration_s, 1e-3)
    requests = [dataclasses.replace(r, arrival_s=r.arrival_s * span_s / natural) for r in workload.requests]
    requests = fit_lengths(requests, 0.25, 192, 24)
    names = list(TENANTS)
    out = []
    for i, r in enumerate(requests):
        out.append(dataclasses.replace(r, tenant=names[i % len(names)], priority=1 if i % 5 == 0 else 0,
                                       output_length=max(r.output_length, 8)))
    # One request is cancelled by its client shortly after it starts streaming.
    middle = len(out) // 2
    out[middle] = dataclasses.replace(out[middle], output_length=1000, cancel_after_s=0.3)
    return out


def _chat_over_http(stack: Stack) -> str:
    """Send one chat through the OpenAI-compatible HTTP API (the model's chat template) and describe the answer."""
    import json
    import urllib.request

    body = {"model": stack.model_id, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello?"}]}
    request = urllib.request.Request(f"{stack.http_base_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {TENANTS['alice']}",
                                              "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            answer = json.loads(reply.read())
    except OSError as exc:
        return f"chat over HTTP failed: {exc}"
    usage, choice = answer["usage"], answer["choices"][0]
    return (f"chat over the OpenAI HTTP API ({stack.http_base_url}): {usage['prompt_tokens']} prompt tokens from the "
            f"chat template, {usage['completion_tokens']} generated, finish_reason {choice['finish_reason']}: "
            f"{choice['message']['content']!r}")


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when every request ended as expected, 1 otherwise."""
    args = parse_args(argv)
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="sluice-demo-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "sluice.toml"
    config_path.write_text(CONFIG)
    started = time.monotonic()
    print(f"Starting the stack: embedded Redis, router, {args.replicas} x (worker + scheduler) of the tiny torch "
          f"model (random weights: its text is gibberish), admission...", flush=True)
    stack = Stack(StackConfig(replicas=args.replicas, backend="torch", model="tiny", config_file=str(config_path),
                              run_dir=out_dir / "logs", mtls=True, http_port=0))
    workload, source = demo_workload(args.requests)
    requests = shape_requests(workload, args.arrival_span)
    with stack:
        print(f"ready in {time.monotonic() - started:.1f}s; each service is its own process:", flush=True)
        print(stack.describe(), flush=True)
        _print_workload(requests, args.arrival_span, source)
        outcomes = asyncio.run(drive(stack.endpoint, TENANTS, requests, max_concurrency=32, timeout=90.0))
        chat = _chat_over_http(stack)
        stats = stack.scheduler_stats()
        print("stopping: draining the replicas, then stopping every process...", flush=True)
        stopping = time.monotonic()
    left = [proc.name for proc in stack.procs if proc.alive()]
    print(f"stopped in {time.monotonic() - stopping:.1f}s; "
          + (f"still running: {', '.join(left)}" if left else "no process left") + ".\n", flush=True)
    ns = argparse.Namespace(slo_ttft=SLO_TTFT_S, slo_tpot=SLO_TPOT_S)
    summary = summarize_run(requests, outcomes, ns, {
        "workload": f"{source} (lengths x0.25 capped at 192 in / 24 out)",
        "replica_stats": {s.replica_id: {"finished": s.finished, "cancelled": s.cancelled,
                                         "kv_blocks_used": s.kv_blocks_used, "kv_blocks_cached": s.kv_blocks_cached,
                                         "kv_blocks_total": s.kv_blocks_total,
                                         "prefix_hit_rate": s.prefix_hit_rate, "preemptions": s.preemptions}
                          for s in stats}})
    print(format_table(summary, title=f"Sluice demo: {len(requests)} requests, {args.replicas} replicas"))
    _print_extras(summary, outcomes, requests)
    print(chat)
    print(f"\nJSON report: {write_json(summary, out_dir / 'report.json')}\nlogs: {out_dir / 'logs'}")
    bad = [o for o, r in zip(outcomes, requests, strict=True)
           if o.status != ("cancelled" if r.cancel_after_s is not None else "ok")]
    verdict = "every request ended as expected" if not bad else f"{len(bad)} request(s) did not end as expected"
    print(f"total wall time {time.monotonic() - started:.1f}s; {verdict}.")
    return 1 if bad else 0


def _print_workload(requests: list[WorkloadRequest], span_s: float, source: str) -> None:
    weights = {name: 2.0 if name == "alice" else 1.0 for name in TENANTS}
    print(f"Workload: {len(requests)} requests, {source}; arrivals compressed "
          f"to ~{span_s:.0f}s, lengths scaled to the tiny model;\n"
          f"  tenants {', '.join(f'{t} (weight {w:g})' for t, w in weights.items())}, taking turns; "
          f"every 5th request has priority 1; one client cancels its request 0.3s into the stream.", flush=True)


def _print_extras(summary: dict[str, Any], outcomes: list[Outcome], requests: list[WorkloadRequest]) -> None:
    lat = summary["path_latency_per_token_s"]
    assert isinstance(lat, dict)
    if lat.get("p50") is not None:
        print(f"latency the path adds per token (scheduler -> client): p50 {lat['p50'] * 1e3:.2f} ms, "
              f"p99 {lat['p99'] * 1e3:.2f} ms")
    for outcome, request in zip(outcomes, requests, strict=True):
        if request.cancel_after_s is not None:
            print(f"cancelled request {outcome.request_id}: status {outcome.status} after "
                  f"{len(outcome.token_times)} of {request.output_length} tokens")
    by_tenant: dict[str, int] = {}
    for outcome, request in zip(outcomes, requests, strict=True):
        by_tenant[request.tenant] = by_tenant.get(request.tenant, 0) + len(outcome.token_times)
    print("output tokens by tenant: " + ", ".join(f"{t} {n}" for t, n in sorted(by_tenant.items())))
    print(f"SLO: first token within {SLO_TTFT_S:g}s and {SLO_TPOT_S * 1e3:g} ms per output token "
          "(the cancelled request counts as missed)")
    for name, stats in summary.get("replica_stats", {}).items():
        print(f"{name}: {stats['finished']} finished, {stats['cancelled']} cancelled, {stats['preemptions']} "
              f"preemptions; KV blocks {stats['kv_blocks_used']} in use, {stats['kv_blocks_cached']} cached for "
              f"prefix reuse, of {stats['kv_blocks_total']}; prefix hit rate {stats['prefix_hit_rate']:.0%}")


if __name__ == "__main__":
    sys.exit(main())
