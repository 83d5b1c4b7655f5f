"""`sluice bench`: replay a workload against a running stack (or one it spawns) and report.

Open loop: each request starts at its arrival time whatever happened to the others (a
`--max-concurrency` cap holds a request back when that many are in flight; its latency still
counts from its arrival). Every request goes through the AsyncClient; per request we record
arrival, first token, each token's arrival, finish and status, and summarise with the same code
as `sluice sim` (sluice_tools.metrics / sluice_tools.report).

`--capacity` searches the highest rate (by rate scale of the same workload) at which `--capacity-goal`
of requests meet both SLO targets, probe by probe against the stack (sluice_tools/live_capacity.py);
with `--spawn --compare round_robin,score` each configuration gets a stack of its own.

Latency the path adds per token: every GenerateChunk carries `created_unix_s`, the time the
scheduler stamped on the token (or, when it does not stamp, the time Redis appended its delta,
millisecond resolution); the client's receive time minus that is the worker -> scheduler ->
Redis -> admission -> client cost, reported as p50/p99 under `path_latency_per_token_s`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

DEFAULT_SLO_TTFT_S = 2.0
DEFAULT_SLO_TPOT_S = 0.2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of `sluice bench`: every value is checked here, before a stack starts or a request goes."""
    from sluice.options import (
        non_negative_int,
        output_dir,
        output_file,
        positive_float,
        positive_int,
    )
    from sluice_tools.workload import TRACE_NAMES

    parser.add_argument("workload", help=f"{', '.join(TRACE_NAMES)}, a trace path or 'synthetic:...'")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--target", default=None,
                       help="admission HOST:PORT of a running stack (default: localhost:50051)")
    where.add_argument("--spawn", action="store_true", help="start a stack for the run (see --replicas ...)")
    parser.add_argument("--replicas", type=positive_int, default=1, help="with --spawn: replicas")
    parser.add_argument("--backend", choices=("torch", "costmodel"), default="torch", help="with --spawn: engine")
    parser.add_argument("--model", default="tiny", help="with --spawn: the model (a preset, a directory or a shape)")
    parser.add_argument("--emulate-time", action="store_true",
                        help="with --spawn --backend costmodel: each round takes its modelled GPU time")
    parser.add_argument("--api-key", default=os.environ.get("SLUICE_API_KEY", "sk-sluice-local"),
                        help="API key of every request (default: $SLUICE_API_KEY, else sk-sluice-local)")
    parser.add_argument("--tls-ca", default=os.environ.get("SLUICE_TLS_CA"),
                        help="CA certificate (PEM) of a TLS admission endpoint (default: $SLUICE_TLS_CA, else plaintext)")
    parser.add_argument("--max-concurrency", type=positive_int, default=64,
                        help="requests in flight at most (a later one waits; its latency still counts)")
    parser.add_argument("--rate-scale", type=positive_float, default=1.0, help="arrival rate multiplier")
    parser.add_argument("--max-requests", type=positive_int, default=None, help="replay only the first N requests")
    parser.add_argument("--duration", type=positive_float, default=None, help="seconds of the (scaled) trace to replay")
    parser.add_argument("--length-scale", type=positive_float, default=1.0, help="multiply input and output lengths")
    parser.add_argument("--max-input-tokens", type=positive_int, default=None, help="cap prompt lengths (fit the model)")
    parser.add_argument("--max-output-tokens", type=positive_int, default=None, help="cap output lengths")
    parser.add_argument("--vocab-size", type=positive_int, default=256, help="prompt token ids are drawn below this")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the workload's prompts and draws")
    parser.add_argument("--timeout", type=positive_float, default=120.0, help="per-request deadline (s)")
    parser.add_argument("--slo-ttft", type=positive_float, default=DEFAULT_SLO_TTFT_S, help="TTFT target (s)")
    parser.add_argument("--slo-tpot", type=positive_float, default=DEFAULT_SLO_TPOT_S, help="TPOT target (s)")
    parser.add_argument("--slo-ttft-ms", type=positive_float, default=None,
                        help="TTFT target in ms (as sluice sim; wins over --slo-ttft)")
    parser.add_argument("--slo-tpot-ms", type=positive_float, default=None,
                        help="TPOT target in ms (as sluice sim; wins over --slo-tpot)")
    parser.add_argument("--json", type=output_file, default=None,
                        help="write the summary here (a missing directory is made before the run, and said)")
    parser.add_argument("--plots", type=output_dir, default=None, help="write latency CDF plots into this directory")
    parser.add_argument("--compare", nargs="+", default=[], metavar="JSON",
                        help="earlier runs' --json files to overlay on the plots (one line per run); with "
                             "--capacity --spawn: configurations, e.g. round_robin,score (one stack each)")
    parser.add_argument("--name", default=None, help="this run's name in plots and --compare (default: the setup)")
    from sluice_tools.live_capacity import add_capacity_arguments

    add_capacity_arguments(parser)


@dataclasses.dataclass
class Outcome:
    """What the client saw of one request (before it becomes a RequestRecord)."""

    arrival_s: float
    first_token_s: float | None = None
    finish_s: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    path_latencies: list[float] = dataclasses.field(default_factory=list)
    scheduler_stamped: bool = False
    """True when some chunk carried a sub-millisecond (scheduler) stamp rather than a Redis entry time."""
    status: str = "ok"
    output_tokens: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    request_id: str = ""
    detail: str = ""


def fit_lengths(requests: Sequence[Any], scale: float, max_input: int | None, max_output: int | None) -> list[Any]:
    """Return the requests with lengths multiplied by `scale` and capped (at least one token each)."""
    out = []
    for r in requests:
        length_in = max(1, round(r.input_length * scale))
        length_out = max(1, round(r.output_length * scale))
        out.append(dataclasses.replace(r, input_length=min(length_in, max_input or length_in),
                                       output_length=min(length_out, max_output or length_out),
                                       prefix_tokens=None if r.prefix_tokens is None
                                       else min(r.prefix_tokens, max_input or r.prefix_tokens)))
    return out


def _status_of(exc: BaseException) -> str:
    from sluice import client as sdk

    if isinstance(exc, sdk.ResourceExhausted | sdk.Unavailable):
        return "rejected"
    if isinstance(exc, sdk.Cancelled):
        return "cancelled"
    if isinstance(exc, sdk.DeadlineExceeded):
        return "timed_out"
    return "failed"


async def _one(client: Any, request: Any, t0: float, vocab_size: int, timeout: float, limit: asyncio.Semaphore,
               outcome: Outcome) -> None:
    """Run one request at its arrival time; fills `outcome` (never raises for a request's failure)."""
    await asyncio.sleep(max(0.0, t0 + request.arrival_s - time.time()))
    async with limit:
        cancel_task = None
        try:
            stream = client.generate(list(request.prompt_token_ids(vocab_size)), max_tokens=request.output_length,
                                     priority=request.priority, ignore_eos=True,
                                     timeout=request.deadline_s or timeout)
            async for chunk in stream:
                outcome.request_id = chunk.request_id
                if request.cancel_after_s is not None and cancel_task is None:
                    delay = t0 + request.arrival_s + request.cancel_after_s - time.time()
                    cancel_task = asyncio.create_task(_cancel_later(client, chunk.request_id, delay))
                if chunk.token_ids:
                    outcome.first_token_s = outcome.first_token_s or chunk.received_s
                    outcome.token_times.extend([chunk.received_s] * len(chunk.token_ids))
                    if chunk.created_unix_s > 0:
                        outcome.path_latencies.append(chunk.received_s - chunk.created_unix_s)
                        millis = chunk.created_unix_s * 1000.0
                        outcome.scheduler_stamped |= abs(millis - round(millis)) > 1e-3
                if chunk.usage is not None:
                    _take_usage(outcome, chunk.usage)
        except Exception as exc:  # a failed request is a result of the benchmark, not a crash
            outcome.status = _status_of(exc)
            outcome.detail = str(exc)[:200]
        finally:
            outcome.finish_s = time.time()
            outcome.output_tokens = max(outcome.output_tokens, len(outcome.token_times))
            if cancel_task is not None:
                cancel_task.cancel()


async def _cancel_later(client: Any, request_id: str, delay_s: float) -> None:
    await asyncio.sleep(max(0.0, delay_s))
    try:
        await client.cancel(request_id)
    except Exception as exc:  # already finished: nothing to cancel
        print(f"\ncancel of {request_id} failed: {exc}", file=sys.stderr)


def _take_usage(outcome: Outcome, usage: Any) -> None:
    outcome.output_tokens = usage.output_tokens
    outcome.input_tokens = usage.input_tokens
    outcome.cached_tokens = usage.cached_tokens
    outcome.preemptions = usage.preemptions
    outcome.recomputed_tokens = usage.recomputed_tokens


async def _progress(outcomes: list[Outcome], total: int, done: asyncio.Event) -> None:
    """Keep one status line on stderr (rewritten in place on a terminal, a line per 10% otherwise)."""
    tty = sys.stderr.isatty()
    start, end = ("\r", "") if tty else ("", "\n")
    shown = -1
    while not done.is_set():
        finished = sum(1 for o in outcomes if o.finish_s is not None)
        failed = sum(1 for o in outcomes if o.finish_s is not None and o.status != "ok")
        step = finished if tty else finished * 10 // max(total, 1)
        if step != shown:
            shown = step
            print(f"{start}[bench] {finished}/{total} done, {failed} not ok", end=end, file=sys.stderr, flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 0.5)
    print(f"{start}[bench] {total}/{total} done" + " " * 20, file=sys.stderr, flush=True)


async def drive(target: str, api_key: str | Mapping[str, str], requests: Sequence[Any], *,
                max_concurrency: int = 64, vocab_size: int = 256, timeout: float = 120.0,
                progress: bool = True, tls_ca: str | None = None) -> list[Outcome]:
    """Replay `requests` open-loop against `target`; returns one Outcome per request, in order.

    `api_key` is one key for every request, or a map tenant -> key (each request uses its tenant's).
    `tls_ca`: the CA (PEM file) of a TLS endpoint; None speaks plaintext.
    """
    from sluice.client import AsyncClient, RetryPolicy

    keys = dict(api_key) if isinstance(api_key, Mapping) else {r.tenant: api_key for r in requests}
    limit = asyncio.Semaphore(max_concurrency)
    t0 = time.time() + 0.05
    outcomes = [Outcome(arrival_s=t0 + r.arrival_s) for r in requests]
    done = asyncio.Event()
    # No retries: a rejection is part of what a benchmark measures.
    clients = {tenant: AsyncClient(target, api_key=key, retry=RetryPolicy(max_attempts=1), tls_ca=tls_ca)
               for tenant, key in keys.items()}
    # The load generator's own full collections (25-55 ms over the workload and imports, measured with
    # gc.callbacks) would be charged to the path latency: keep what exists now out of the collector.
    gc.freeze()
    try:
        bar = asyncio.create_task(_progress(outcomes, len(requests), done)) if progress else None
        await asyncio.gather(*(_one(clients[r.tenant], r, t0, vocab_size, timeout, limit, o)
                               for r, o in zip(requests, outcomes, strict=True)))
        done.set()
        if bar is not None:
            await bar
    finally:
        for client in clients.values():
            await client.close()
    return outcomes


def records_of(requests: Sequence[Any], outcomes: Sequence[Outcome]) -> list[Any]:
    """Return sluice_tools.metrics.RequestRecord for each (request, outcome)."""
    from sluice_tools.metrics import RequestRecord

    return [RequestRecord(request_id=o.request_id or r.request_id, tenant=r.tenant, priority=r.priority,
                          arrival_s=o.arrival_s, first_token_s=o.first_token_s, finish_s=o.finish_s,
                          token_times=o.token_times, status=o.status, input_tokens=o.input_tokens or r.input_length,
                          output_tokens=o.output_tokens, cached_tokens=o.cached_tokens, preemptions=o.preemptions,
                          recomputed_tokens=o.recomputed_tokens, detail=o.detail)
            for r, o in zip(requests, outcomes, strict=True)]


def path_latency(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Return p50/p99 (and count) of the per-token path latency seen by the client, in seconds."""
    from sluice_tools.metrics import percentiles

    values = [v for o in outcomes for v in o.path_latencies]
    out: dict[str, Any] = dict(percentiles(values, (50, 99)))
    out["created_by"] = ("scheduler stamp" if any(o.scheduler_stamped for o in outcomes) else
                         "redis entry id (1 ms resolution, truncated: adds 0.5 ms on average)")
    return out


def summarize_run(requests: Sequence[Any], outcomes: Sequence[Outcome], args: argparse.Namespace,
                  extra: dict[str, Any]) -> dict[str, Any]:
    """Return the summary dict (sluice_tools.metrics.summarize plus the path latency and run facts)."""
    from sluice_tools.metrics import summarize

    summary = summarize(records_of(requests, outcomes), args.slo_ttft, args.slo_tpot)
    summary["path_latency_per_token_s"] = path_latency(outcomes)
    summary.update(extra)
    return summary


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; returns 0, or 2 for a bad workload or flags."""
    from sluice.options import create_output_dirs
    from sluice_tools.report import format_table, records_to_json, write_json, write_plots
    from sluice_tools.workload import WorkloadError, load_workload

    try:
        workload = load_workload(args.workload, seed=args.seed, rate_scale=args.rate_scale,
                                 duration_s=args.duration, max_requests=args.max_requests)
        # The earlier runs to overlay are read before the run, so a bad file fails now, not after it.
        earlier = _earlier_runs(args.compare) if args.plots and not args.capacity else {}
        create_output_dirs("bench", {"--json": args.json}, {"--plots": args.plots})
    except (WorkloadError, OSError, ValueError) as exc:
        print(f"sluice bench: error: {exc}", file=sys.stderr)
        return 2
    if args.spawn:
        # SIGTERM stops what --spawn started in order, as Ctrl-C does (the stacks are stopped on the way out and
        # cli.main reports the interrupt); by default it ended this process at once and left the services to stop
        # on their own through their lifelines.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    args.slo_ttft = args.slo_ttft if args.slo_ttft_ms is None else args.slo_ttft_ms / 1000.0
    args.slo_tpot = args.slo_tpot if args.slo_tpot_ms is None else args.slo_tpot_ms / 1000.0
    if args.capacity:
        from sluice_tools.live_capacity import run_capacity

        return run_capacity(args, workload)
    requests = fit_lengths(workload.requests, args.length_scale, args.max_input_tokens, args.max_output_tokens)
    stack = None
    if args.spawn:
        from sluice_tools.stack import Stack, StackConfig

        stack = Stack(StackConfig(replicas=args.replicas, backend=args.backend, model=args.model,
                                  emulate_time=args.emulate_time)).start()
        target, api_key = stack.endpoint, stack.api_key
    else:
        target, api_key = args.target or "localhost:50051", args.api_key
        problem = unreachable(target, tls_ca=args.tls_ca)
        if problem:
            print(f"sluice bench: error: {problem}", file=sys.stderr)
            return 2
    try:
        outcomes = asyncio.run(drive(target, api_key, requests, max_concurrency=args.max_concurrency,
                                     vocab_size=args.vocab_size, timeout=args.timeout,
                                     tls_ca=None if stack is not None else args.tls_ca))
    finally:
        if stack is not None:
            stack.stop()
    summary = summarize_run(requests, outcomes, args, {"workload": workload.describe(), "target": target})
    print(format_table(summary, title=f"sluice bench {args.workload} ({len(requests)} requests)"))
    lat = summary["path_latency_per_token_s"]
    if lat.get("p50") is not None:
        print(f"path latency per token (scheduler -> client): p50 {lat['p50'] * 1e3:.2f} ms, "
              f"p99 {lat['p99'] * 1e3:.2f} ms over {int(lat['count'])} chunks")
    name = args.name or run_name(args)
    records = records_of(requests, outcomes)
    if args.json:
        print(f"JSON: {write_json({**summary, 'name': name, 'records': records_to_json(records)}, args.json)}")
    if args.plots:
        runs = {**earlier, name: records}
        files = write_plots(runs, {}, Path(args.plots), title=f"{args.workload} ({len(requests)} requests)",
                            slo={"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot})
        print(f"plots: {', '.join(str(f) for f in files)}")
    if requests and not any(outcome.status == "ok" for outcome in outcomes):
        print("sluice bench: error: no request succeeded (see the statuses above)", file=sys.stderr)
        return 1
    return 0


def run_name(args: argparse.Namespace) -> str:
    """Return a run's default name: the spawned setup, or the target it measured."""
    if args.spawn:
        timing = ", emulated time" if args.emulate_time else ""
        return f"{args.replicas} x {args.backend} {args.model}{timing}"
    return args.target or "localhost:50051"


def _earlier_runs(paths: Sequence[str]) -> dict[str, list[Any]]:
    """Return name -> records of earlier `--json` files; raises ValueError naming a file without records."""
    from sluice_tools.report import records_from_json

    runs: dict[str, list[Any]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or "records" not in data:
            raise ValueError(f"--compare {path}: not a `sluice bench --json` file with per-request records")
        runs[str(data.get("name") or Path(path).stem)] = records_from_json(data["records"])
    return runs


def unreachable(target: str, timeout_s: float = 5.0, tls_ca: str | None = None) -> str:
    """Return why admission at `target` cannot be benchmarked ("" when its health check says SERVING).

    `tls_ca`: the endpoint speaks TLS with a certificate from this CA (PEM file); None: plaintext."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from sluice.tls import sync_channel

    with sync_channel(target, None, ca=tls_ca) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            return f"cannot reach admission at {target}: {exc.code().name} ({exc.details()})"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"admission at {target} is not serving (health {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)})"
    return ""
