"""Sluice in front of real vLLM engines, measured: prefix prediction, cache hits, fair share, added latency.

    PYTHONPATH=. .venv/bin/python scripts/bench_vllm.py [--json out/bench-vllm.json] [--quick]

Starts one stack (Redis, router, admission, 2 unmodified vLLM CPU servers of the tiny model, each behind its
Sluice agent; vLLM's own FCFS scheduler, no Sluice class inside) and runs, in one process, side by side:

1. prefix: a shared-prefix workload (G groups x R requests, a 4-block prefix per group + a unique 16-token
   suffix, 4 at a time) through Sluice. Per request: the router's predicted cached tokens (the `routed` span
   event's cached_blocks x block size, from SLUICE_TRACE_FILE) against what vLLM reports
   (usage.prompt_tokens_details.cached_tokens, via the completion record). Mean absolute error as a share of
   prompt tokens.
2. hit rate: the same workload with the engines' prefix caches reset, once through Sluice and once straight
   to the engines in round-robin order: vllm:prefix_cache_hits_total / queries_total deltas, summed.
3. fair share: tenants gold (weight 2) and bronze (1), 16 streams each, saturating both engines, once through
   Sluice (agents with --policy fair --max-inflight 4, engines --max-num-seqs 4) and once straight to the
   engines round-robin: weighted tokens served gold / bronze.
4. latency: requests one at a time, alternating straight to an engine and through Sluice's OpenAI HTTP edge
   (the same SSE client for both): TTFT and ITL p50 / p99 of each, and the difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from sluice import client as sdk
from sluice.telemetry import read_span_file
from sluice_tools.stack import Stack, StackConfig

BLOCK = 32
CONFIG = '[tenants.gold]\napi_keys = ["k-gold"]\nweight = 2.0\n[tenants.bronze]\napi_keys = ["k-bronze"]\nweight = 1.0\n'


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as reply:  # noqa: S310 (loopback)
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def reset_caches(urls: list[str]) -> None:
    for url in urls:
        urllib.request.urlopen(urllib.request.Request(f"{url}/reset_prefix_cache", method="POST"), timeout=10).close()


def hit_rate(urls: list[str], before: list[tuple[float, float]]) -> float:
    hits = sum(metric(u, "vllm:prefix_cache_hits_total") - b[0] for u, b in zip(urls, before, strict=True))
    queries = sum(metric(u, "vllm:prefix_cache_queries_total") - b[1] for u, b in zip(urls, before, strict=True))
    return hits / queries if queries else 0.0


def counters(urls: list[str]) -> list[tuple[float, float]]:
    return [(metric(u, "vllm:prefix_cache_hits_total"), metric(u, "vllm:prefix_cache_queries_total")) for u in urls]


def prefix_workload(groups: int, per_group: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 250) for _ in range(4 * BLOCK)] for _ in range(groups)]
    prompts = [p + [rng.randrange(1, 250) for _ in range(16)] for p in prefixes for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


def run_threads(target: Any, items: list[Any], concurrency: int) -> list[Any]:
    results: list[Any] = [None] * len(items)
    lock, cursor = threading.Lock(), [0]

    def worker() -> None:
        while True:
            with lock:
                index = cursor[0]
                cursor[0] += 1
            if index >= len(items):
                return
            results[index] = target(items[index])

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def through_sluice(stack: Stack, prompt: list[int]) -> sdk.Generation:
    with sdk.Client(stack.endpoint, api_key="k-gold") as client:
        return client.generate_text(prompt, max_tokens=8, timeout=120)


def direct(url: str, prompt: list[int], max_tokens: int = 8, tenant: str = "") -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    headers = {"Content-Type": "application/json", "X-Request-Id": f"{tenant or 'default'}:{uuid.uuid4().hex}"}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=120) as reply:  # noqa: S310
        result: dict[str, Any] = json.loads(reply.read())
    return result


def measure_prefix(stack: Stack, urls: list[str], trace_file: Path, prompts: list[list[int]]) -> dict[str, Any]:
    reset_caches(urls)
    before = counters(urls)
    generations = run_threads(lambda p: through_sluice(stack, p), prompts, 4)
    sluice_rate = hit_rate(urls, before)
    time.sleep(2.0)  # admission's root spans are exported when they end
    predicted: dict[str, int] = {}
    for span in read_span_file(trace_file):
        request_id = span["attributes"].get("sluice.request_id")
        for event in span["events"]:
            if request_id and event["name"] == "routed":
                predicted[request_id] = int(event["attributes"].get("sluice.cached_blocks", 0)) * BLOCK
    errors = [abs(predicted[g.request_id] - g.usage.cached_tokens) / len(p)
              for g, p in zip(generations, prompts, strict=True) if g.request_id in predicted]
    exact = sum(1 for g in generations if predicted.get(g.request_id) == g.usage.cached_tokens)
    reset_caches(urls)
    before = counters(urls)
    turn = iter(range(len(prompts)))
    run_threads(lambda p: direct(urls[next(turn) % len(urls)], p), prompts, 4)
    rr_rate = hit_rate(urls, before)
    return {"requests": len(prompts), "matched_predictions": len(errors), "exact_predictions": exact,
            "mae_share_of_prompt": statistics.fmean(errors) if errors else None,
            "reported_cached_tokens_mean": statistics.fmean(g.usage.cached_tokens for g in generations),
            "hit_rate_sluice": sluice_rate, "hit_rate_round_robin": rr_rate,
            "ideal_hit_rate": ideal_hit_rate(prompts)}


def ideal_hit_rate(prompts: list[list[int]]) -> float:
    """The hit rate of one infinite cache: every prompt after the first of its group hits its 4 prefix blocks."""
    seen, hits = set(), 0
    for prompt in prompts:
        key = tuple(prompt[:4 * BLOCK])
        hits += 4 * BLOCK if key in seen else 0
        seen.add(key)
    return hits / sum(len(p) for p in prompts)


def served_share(stack: Stack, urls: list[str], mode: str, window_s: float) -> float:
    """Weighted tokens (prompt x1 + output x2) gold / bronze over `window_s`, 16 streams a tenant, saturating."""
    served: Counter[str] = Counter()
    stop, lock = threading.Event(), threading.Lock()
    turn, start_at = [0], [0.0]

    def stream(tenant: str, seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            prompt = [rng.randrange(1, 250) for _ in range(32)]
            if mode == "sluice":
                with sdk.Client(stack.endpoint, api_key=f"k-{tenant}") as client:
                    tokens = len(client.generate_text(prompt, max_tokens=32, ignore_eos=True, timeout=120).token_ids)
            else:
                with lock:
                    turn[0] += 1
                    url = urls[turn[0] % len(urls)]
                tokens = direct(url, prompt, 32, tenant)["usage"]["completion_tokens"]
            if start_at[0] and time.monotonic() < start_at[0] + window_s:
                with lock:
                    served[tenant] += 32 + 2 * tokens

    threads = [threading.Thread(target=stream, args=(t, s), daemon=True) for s, t in enumerate(["gold", "bronze"] * 16)]
    for thread in threads:
        thread.start()
    time.sleep(4.0)
    start_at[0] = time.monotonic()
    time.sleep(window_s)
    stop.set()
    for thread in threads:
        thread.join(60)
    return served["gold"] / max(served["bronze"], 1)


async def sse_latency(session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: dict[str, Any]
                      ) -> tuple[float, list[float]]:
    start = time.perf_counter()
    stamps = []
    async with session.post(url, json=body, headers=headers) as reply:
        async for line in reply.content:
            if line.startswith(b"data: {") and b'"choices":[{' in line:  # one event per streamed chunk, both ways
                stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


async def measure_latency(stack: Stack, engine: str, rounds: int) -> dict[str, Any]:
    rng = random.Random(3)
    samples: dict[str, dict[str, list[float]]] = {"direct": {"ttft": [], "itl": []}, "sluice": {"ttft": [], "itl": []}}
    async with aiohttp.ClientSession() as session:
        for _ in range(rounds):
            prompt = [rng.randrange(1, 250) for _ in range(64)]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            for name, url, headers in (
                    ("direct", f"{engine}/v1/completions", {}),
                    ("sluice", f"{stack.http_base_url}/completions", {"Authorization": "Bearer k-gold"})):
                ttft, itl = await sse_latency(session, url, headers, {**body, "prompt": list(prompt)})
                samples[name]["ttft"].append(ttft * 1000)
                samples[name]["itl"].extend(x * 1000 for x in itl)
    out: dict[str, Any] = {}
    for name, values in samples.items():
        for kind, xs in values.items():
            xs.sort()
            out[f"{name}_{kind}_ms_p50"] = xs[len(xs) // 2]
            out[f"{name}_{kind}_ms_p99"] = xs[min(len(xs) - 1, int(len(xs) * 0.99))]
    for kind in ("ttft", "itl"):
        for q in ("p50", "p99"):
            out[f"added_{kind}_ms_{q}"] = out[f"sluice_{kind}_ms_{q}"] - out[f"direct_{kind}_ms_{q}"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="", help="write the results here too")
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    args = parser.parse_args()
    run_dir = Path(f"/tmp/sluice-bench-vllm-{uuid.uuid4().hex[:8]}")
    run_dir.mkdir(parents=True)
    trace_file = run_dir / "spans.jsonl"
    (run_dir / "sluice.toml").write_text(CONFIG)
    config = StackConfig(replicas=2, engine="vllm", model="tiny", run_dir=run_dir, http_port=0, start_timeout_s=900,
                         config_file=str(run_dir / "sluice.toml"),
                         scheduler_args=("--policy", "fair", "--max-inflight", "4"), engine_args=("--max-num-seqs", "4"),
                         env=(("SLUICE_TRACE_FILE", str(trace_file)),))
    started = time.monotonic()
    results: dict[str, Any] = {}
    with Stack(config) as stack:
        results["stack_start_s"] = time.monotonic() - started
        urls = [r.engine.url for r in stack.replicas.values()]
        groups, per_group = (4, 4) if args.quick else (8, 6)
        results["prefix"] = measure_prefix(stack, urls, trace_file, prefix_workload(groups, per_group, 1))
        print(json.dumps(results["prefix"]), file=sys.stderr, flush=True)
        results["latency"] = asyncio.run(measure_latency(stack, urls[0], 10 if args.quick else 40))
        print(json.dumps(results["latency"]), file=sys.stderr, flush=True)
        window = 10.0 if args.quick else 20.0
        results["fair_share"] = {f"gold_over_bronze_{mode}": served_share(stack, urls, mode, window)
                                 for mode in ("sluice", "round_robin")}
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
