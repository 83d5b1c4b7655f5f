"""The one client of `make bench-peers`: replays a workload over the OpenAI API, streamed, at fixed arrival times.

Every front end gets the same client: `AsyncOpenAI(...).completions.create(stream=True)` with
`stream_options.include_usage` and `ignore_eos` (so each request generates exactly `max_tokens`), no retries
(a refusal is counted, not hidden), one connection pool per target URL. With several targets the client itself
alternates them (round-robin, no router); with one target the front end behind it decides.

Outcome of a request, as `sluice_tools.metrics.RequestRecord.status`:
- "ok": the stream ended with every token asked;
- "rejected": the front end answered with an HTTP error status (an explicit refusal: 4xx/5xx with a body);
- "timed_out": nothing finished within `timeout_s`;
- "failed": the connection broke or the stream ended short, without an explicit status (`detail` says which);
- "cancelled": still running at `stop_at_s` (the fairness cell bounds its runs), closed by the client.

Tenants: a request of tenant T is sent with T's API key (`api_keys`, else the run's key); its priority goes in the
body (`"priority"`) only with `send_priority`, since a vLLM engine scheduling fcfs refuses a nonzero one.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Mapping, Sequence

import openai

from sluice_tools.bench_peers_workload import Req
from sluice_tools.metrics import RequestRecord


def make_clients(targets: Sequence[str], timeout_s: float, api_key: str = "none") -> list[openai.AsyncOpenAI]:
    """Return one AsyncOpenAI client per base URL (`http://host:port`), retries off."""
    return [
        openai.AsyncOpenAI(base_url=f"{url.rstrip('/')}/v1", api_key=api_key, max_retries=0, timeout=timeout_s)
        for url in targets
    ]


async def _stream(client: openai.AsyncOpenAI, model: str, req: Req, record: RequestRecord, t0: float,
                  send_priority: bool) -> None:
    """Send one request and fill `record` from what its stream delivers (times relative to `t0`)."""
    times: list[float] = []
    record.token_times = times  # filled as tokens come, so a run cut short keeps what was served
    usage_tokens = None
    extra: dict[str, object] = {"ignore_eos": True}
    if send_priority and req.priority:
        extra["priority"] = req.priority
    stream = await client.completions.create(
        model=model, prompt=req.prompt, max_tokens=req.max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra,
    )
    async for chunk in stream:
        now = time.perf_counter() - t0
        if chunk.choices:  # one chunk per token (its text is empty while a UTF-8 sequence is incomplete)
            times.append(now)
            if record.first_token_s is None:
                record.first_token_s = now
        if chunk.usage is not None:
            usage_tokens = chunk.usage.completion_tokens
    record.finish_s = time.perf_counter() - t0
    record.token_times = times
    record.first_token_s = times[0] if times else None
    record.output_tokens = usage_tokens if usage_tokens is not None else len(times)
    if record.output_tokens < req.max_tokens or not times:
        record.status, record.detail = "failed", f"stream ended after {record.output_tokens}/{req.max_tokens} tokens"


async def _one(client: openai.AsyncOpenAI, model: str, req: Req, record: RequestRecord, t0: float,
               timeout_s: float, send_priority: bool) -> RequestRecord:
    """Wait for the request's arrival time, send it and fill its record (returned)."""
    delay = req.arrival_s - (time.perf_counter() - t0)
    if delay > 0:
        await asyncio.sleep(delay)
    try:
        await asyncio.wait_for(_stream(client, model, req, record, t0, send_priority), timeout_s)
    except TimeoutError:
        record.status, record.detail = "timed_out", f"no end within {timeout_s:g} s"
    except openai.APIStatusError as exc:
        record.status, record.detail = "rejected", f"HTTP {exc.status_code}: {str(exc)[:160]}"
    except (openai.APIError, OSError) as exc:
        record.status, record.detail = "failed", f"{type(exc).__name__}: {str(exc)[:160]}"
    if record.finish_s is None:
        record.finish_s = time.perf_counter() - t0
    return record


async def replay(reqs: Sequence[Req], targets: Sequence[str], model: str, timeout_s: float = 60.0,
                 api_key: str = "none", *, api_keys: Mapping[str, str] | None = None, send_priority: bool = False,
                 stop_at_s: float | None = None) -> list[RequestRecord]:
    """Send every request at its arrival time (request i to target i mod len(targets)), each with its tenant's
    key; at `stop_at_s` after the start, close what still runs (status "cancelled", tokens so far kept).
    Return the records in workload order. Raises ValueError without a target."""
    if not targets:
        raise ValueError("replay needs at least one target URL")
    keys = dict(api_keys or {})
    clients = {key: make_clients(targets, timeout_s, key) for key in {api_key, *keys.values()}}
    records = [RequestRecord(request_id=f"r{i}", arrival_s=req.arrival_s, input_tokens=len(req.prompt),
                             tenant=req.tenant or "default", priority=req.priority) for i, req in enumerate(reqs)]
    t0 = time.perf_counter()
    try:
        cycles = {key: itertools.cycle(group) for key, group in clients.items()}
        tasks = [asyncio.ensure_future(_one(next(cycles[keys.get(req.tenant, api_key)]), model, req, record, t0,
                                            timeout_s, send_priority))
                 for req, record in zip(reqs, records, strict=True)]
        _, pending = await asyncio.wait(tasks, timeout=stop_at_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        now = time.perf_counter() - t0
        for record, task in zip(records, tasks, strict=True):
            if task.cancelled():
                record.status, record.detail, record.finish_s = "cancelled", f"still running at {stop_at_s:g} s", now
                record.output_tokens = len(record.token_times or ())
        return records
    finally:
        for group in clients.values():
            for client in group:
                await client.close()
