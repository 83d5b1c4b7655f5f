"""What the OpenAI HTTP edge adds per token compared with gRPC, at the same load, in one run.

Starts a stack (cost model, emulated GPU time, so tokens come at a real model's pace without a GPU)
with the HTTP edge, then drives it with `--concurrency` gRPC clients (sluice.client.AsyncClient) and as
many HTTP clients (httpx2 streaming /v1/completions, the transport the openai client uses) at the same
time, each sending the same prompts (token ids, fixed lengths, ignore_eos). Per streamed piece it
records the receive time minus the time the scheduler stamped on its first token (gRPC:
`created_unix_s` of each chunk; HTTP: the `sluice_token_times` extension), i.e. scheduler -> Redis ->
admission -> client, and per request the TTFT from the client's send. Prints one JSON object with
p50/p99 per protocol and their difference.

    PYTHONPATH=. .venv/bin/python scripts/bench_http_vs_grpc.py --concurrency 8 --requests 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx2

from sluice import client as sdk
from sluice_tools.stack import Stack, StackConfig


@dataclass
class Samples:
    """What one protocol measured."""

    per_token_s: list[float] = field(default_factory=list)
    """Receive time minus creation time of each streamed piece."""
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50_ms": round(pick(0.5) * 1e3, 3), "p99_ms": round(pick(0.99) * 1e3, 3),
            "mean_ms": round(statistics.fmean(ordered) * 1e3, 3), "n": len(ordered)}


async def _grpc_worker(stack: Stack, prompts: list[list[int]], output: int, out: Samples) -> None:
    async with sdk.AsyncClient(stack.endpoint, api_key=stack.api_key) as client:
        for prompt in prompts:
            sent, last = time.time(), 0.0
            async for chunk in client.generate(prompt, max_tokens=output, ignore_eos=True, timeout=300):
                if not chunk.token_ids:
                    continue
                now = time.time()
                out.ttft_s.append(now - sent) if not last else out.itl_s.append(now - last)
                last = now
                out.tokens += len(chunk.token_ids)
                if chunk.created_unix_s:
                    out.per_token_s.append(now - chunk.created_unix_s)
            out.requests += 1


async def _http_worker(stack: Stack, prompts: list[list[int]], output: int, out: Samples) -> None:
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    async with httpx2.AsyncClient(base_url=stack.http_base_url, headers=headers, timeout=300) as client:
        for prompt in prompts:
            body = {"model": stack.model_id, "prompt": prompt, "max_tokens": output, "stream": True,
                    "ignore_eos": True, "sluice_token_times": True, "stream_options": {"include_usage": True}}
            sent, last = time.time(), 0.0
            async with client.stream("POST", "/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.time()
                    chunk: dict[str, Any] = json.loads(line[6:])
                    if chunk.get("usage"):
                        out.tokens += chunk["usage"]["completion_tokens"]
                    created = chunk.get("sluice", {}).get("created_unix_s")
                    if not created:
                        continue
                    out.ttft_s.append(now - sent) if not last else out.itl_s.append(now - last)
                    last = now
                    out.per_token_s.append(now - created)
            out.requests += 1


async def _drive(stack: Stack, args: argparse.Namespace) -> dict[str, Samples]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, 250) for _ in range(args.input)] for _ in range(args.concurrency * args.requests)]
    results = {"grpc": Samples(), "http": Samples()}
    workers = []
    for i in range(args.concurrency):
        mine = prompts[i * args.requests:(i + 1) * args.requests]
        workers.append(_grpc_worker(stack, mine, args.output, results["grpc"]))
        workers.append(_http_worker(stack, mine, args.output, results["http"]))
    await asyncio.gather(*workers)
    return results


def main() -> None:
    """Start the stack, drive both protocols side by side, print the JSON summary."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8, help="clients per protocol (default 8)")
    parser.add_argument("--requests", type=int, default=8, help="requests per client (default 8)")
    parser.add_argument("--input", type=int, default=256, help="prompt tokens (default 256)")
    parser.add_argument("--output", type=int, default=128, help="output tokens (default 128)")
    parser.add_argument("--model", default="llama-3-8b", help="cost-model shape (default llama-3-8b)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with Stack(StackConfig(backend="costmodel", model=args.model, emulate_time=True, http_port=0,
                           log_level="WARNING")) as stack:
        started = time.monotonic()
        results = asyncio.run(_drive(stack, args))
        elapsed = time.monotonic() - started
    summary: dict[str, Any] = {"load": vars(args), "elapsed_s": round(elapsed, 2)}
    for name, samples in results.items():
        summary[name] = {"requests": samples.requests, "output_tokens": samples.tokens,
                         "path_latency_per_piece": _percentiles(samples.per_token_s),
                         "ttft": _percentiles(samples.ttft_s), "itl": _percentiles(samples.itl_s)}
    summary["http_minus_grpc_ms"] = {
        metric: {q: round(summary["http"][metric][q] - summary["grpc"][metric][q], 3) for q in ("p50_ms", "p99_ms")}
        for metric in ("path_latency_per_piece", "ttft", "itl")}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
