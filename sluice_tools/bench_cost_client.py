"""The client process of `make bench-cost`: streams completions at a fixed concurrency and reports what it got.

Run as its own process so that its CPU is measured apart from the front end's: `python -m
sluice_tools.bench_cost_client --url URL ...` (OpenAI HTTP, streamed, `stream_options.include_usage`,
`ignore_eos`) or `--grpc HOST:PORT` (the Sluice SDK). It imports and connects first, prints `ready`, waits for
one line on stdin (the parent reads every process's CPU in between), runs `--concurrency` workers that send
`--requests` requests in all, then prints one JSON object: requests, streamed tokens (the usage each stream
ended with), SSE events or gRPC chunks received, failures, wall seconds and its own CPU seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ClientResult", "main"]


@dataclass
class ClientResult:
    """What one client run got."""

    requests: int = 0
    tokens: int = 0
    """Output tokens the streams delivered (each stream's final usage)."""
    events: int = 0
    """Stream messages received: SSE events (HTTP) or chunks (gRPC); fewer than tokens when tokens are coalesced."""
    failed: int = 0
    first_error: str = ""
    wall_s: float = 0.0
    cpu_s: float = 0.0


async def _http_one(session: Any, url: str, body: dict[str, Any], out: ClientResult) -> None:
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
        tokens = 0
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            out.events += 1
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
    if tokens != body["max_tokens"]:
        raise RuntimeError(f"stream ended with {tokens} of {body['max_tokens']} tokens")
    out.tokens += tokens


async def _grpc_one(client: Any, prompt: list[int], max_tokens: int, out: ClientResult) -> None:
    tokens = 0
    async for chunk in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True, timeout=600):
        out.events += 1
        tokens += len(chunk.token_ids)
    if tokens != max_tokens:
        raise RuntimeError(f"stream ended with {tokens} of {max_tokens} tokens")
    out.tokens += tokens


async def _run(args: argparse.Namespace) -> ClientResult:
    out = ClientResult()
    prompts = [[(7 * i + j) % 200 + 1 for j in range(args.prompt_tokens)] for i in range(args.requests)]
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)

    async def worker(send: Any) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            try:
                await send(prompt)
                out.requests += 1
            except Exception as exc:  # counted and reported: a failed stream is a failed measurement
                out.failed += 1
                out.first_error = out.first_error or f"{type(exc).__name__}: {exc}"[:300]

    if args.grpc:
        from sluice.client import AsyncClient

        async with AsyncClient(args.grpc, api_key=args.api_key) as client:
            await _go()
            started, cpu = time.perf_counter(), time.process_time()
            await asyncio.gather(*(worker(lambda p: _grpc_one(client, p, args.max_tokens, out))
                                   for _ in range(args.concurrency)))
    else:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0)
        headers = {"Authorization": f"Bearer {args.api_key}"}
        async with aiohttp.ClientSession(connector=connector, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=600)) as session:
            await _go()
            started, cpu = time.perf_counter(), time.process_time()

            def send(prompt: list[int]) -> Any:
                body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0,
                        "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
                return _http_one(session, args.url, body, out)

            await asyncio.gather(*(worker(send) for _ in range(args.concurrency)))
    out.wall_s = time.perf_counter() - started
    out.cpu_s = time.process_time() - cpu
    return out


async def _go() -> None:
    """Say `ready`, then wait for the parent's line on stdin (it reads the processes' CPU meanwhile)."""
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, run, print the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="OpenAI base URL without /v1 (http://host:port)")
    target.add_argument("--grpc", help="Sluice admission address (host:port)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    result = asyncio.run(_run(args))
    print(json.dumps(asdict(result)), flush=True)


if __name__ == "__main__":
    main()
