"""The one client of `make bench-peers`: replays a workload over the OpenAI API, streamed, at fixed arrival times.

Every front end gets the same client: `AsyncOpenAI(...).completions.create(stream=True)` with
`stream_options.include_usage` and `ignore_eos` (so each request generates exactly `max_tokens`), no retries
(a refusal is counted, not hidden), one connection pool per target URL. With several targets the client itself
alternates them (round-robin, no router); with one target the front end behind it decides.

Outcome of a request, as `sluice_tools.metrics.RequestRecord.status`:
- "ok": the stream ended with every token asked;
- "rejected": the front end answered with an HTTP error status (an explicit refusal: 4xx/5xx with a body);
- "timed_out": nothing finished within `timeout_s`;
- "failed": the connection broke or the stream ended short, without an explicit status (`detail` says which).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence

import openai

from sluice_tools.bench_peers_workload import Req
from sluice_tools.metrics import RequestRecord


def make_clients(targets: Sequence[str], timeout_s: float, api_key: str = "none") -> list[openai.AsyncOpenAI]:
    """Return one AsyncOpenAI client per base URL (`http://host:port`), retries off."""
    return [
        openai.AsyncOpenAI(base_url=f"{url.rstrip('/')}/v1", api_key=api_key, max_retries=0, timeout=timeout_s)
        for url in targets
    ]


async def _stream(client: openai.AsyncOpenAI, model: str, req: Req, record: RequestRecord, t0: float) -> None:
    """Send one request and fill `record` from what its stream delivers (times relative to `t0`)."""
    times: list[float] = []
    usage_tokens = None
    stream = await client.completions.create(
        model=model, prompt=req.prompt, max_tokens=req.max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        now = time.perf_counter() - t0
        if chunk.choices:  # one chunk per token (its text is empty while a UTF-8 sequence is incomplete)
            times.append(now)
        if chunk.usage is not None:
            usage_tokens = chunk.usage.completion_tokens
    record.finish_s = time.perf_counter() - t0
    record.token_times = times
    record.first_token_s = times[0] if times else None
    record.output_tokens = usage_tokens if usage_tokens is not None else len(times)
    if record.output_tokens < req.max_tokens or not times:
        record.status, record.detail = "failed", f"stream ended after {record.output_tokens}/{req.max_tokens} tokens"


async def _one(client: openai.AsyncOpenAI, model: str, req: Req, index: int, t0: float,
               timeout_s: float) -> RequestRecord:
    """Wait for the request's arrival time, send it and return its record."""
    delay = req.arrival_s - (time.perf_counter() - t0)
    if delay > 0:
        await asyncio.sleep(delay)
    record = RequestRecord(request_id=f"r{index}", arrival_s=req.arrival_s, input_tokens=len(req.prompt),
                           tenant=req.group if req.group.startswith("tenant") else "default")
    try:
        await asyncio.wait_for(_stream(client, model, req, record, t0), timeout_s)
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
                 api_key: str = "none") -> list[RequestRecord]:
    """Send every request at its arrival time (request i to target i mod len(targets)); return the records
    in workload order. Raises ValueError without a target."""
    if not targets:
        raise ValueError("replay needs at least one target URL")
    clients = make_clients(targets, timeout_s, api_key)
    t0 = time.perf_counter()
    try:
        cycle = itertools.cycle(clients)
        tasks = [_one(next(cycle), model, req, i, t0, timeout_s) for i, req in enumerate(reqs)]
        return list(await asyncio.gather(*tasks))
    finally:
        for client in clients:
            await client.close()
