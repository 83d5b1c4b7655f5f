"""CPU seconds per generated token of each process of a spawned stack (a benchmark; prints one JSON line).

The load-independent measure of the control plane's cost on the live path: the same closed-loop workload as
`python -m sluice_tools.fidelity batch` (one replica, costmodel backend with emulated H200 time, Llama-3-8B,
512-token prompts, 128-token outputs), with utime+stime of every spawned process (and getrusage of this one,
the bench client) read before and after the run, divided by the tokens generated. Also prints live TPOT/TTFT
p50 against the model and the worker's idle-gap shares, like `fidelity batch`.

Run the code before and after side by side by choosing the tree with PYTHONPATH:

  PYTHONPATH=/work/wt/base python scripts/bench_live_cpu.py --batch 256
  PYTHONPATH=$PWD          python scripts/bench_live_cpu.py --batch 256

`--profile DIR` records the scheduler, worker, admission and router with py-spy (if installed) for the run.
`--ttft-hops N` instead sends N lone requests (512 distinct prompt tokens, 4 output tokens, 0.3 s apart) and
prints the median time (ms) from the client's call to each lifecycle stamp admission reports (GetRequest) and to
the first token at the client: where TTFT goes at batch 1, hop by hop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from sluice.client import AsyncClient
from sluice_tools.commands.bench import drive, records_of
from sluice_tools.fidelity import MODEL, figures, idle_gaps, modelled, workload
from sluice_tools.metrics import summarize
from sluice_tools.stack import Stack, StackConfig

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """Return utime+stime of process `pid` (seconds), 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def self_cpu_s() -> float:
    """Return this process's user+system CPU time (seconds; every thread)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pids(stack: Stack) -> dict[str, int]:
    """Return name -> pid of every spawned process (Redis included)."""
    out = {p.name: p.popen.pid for p in stack.procs if p.popen is not None}
    if stack.redis is not None and stack.redis.pid is not None:
        out["redis"] = stack.redis.pid
    return out


def profile(procs: dict[str, int], out_dir: str, seconds: int) -> list[subprocess.Popen[bytes]]:
    """Start py-spy (not a dependency: `pip install py-spy==0.4.1`) on each process but Redis for `seconds`;
    it writes collapsed stacks (`-f raw`), one file per process."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    os.makedirs(out_dir, exist_ok=True)
    started = []
    for name, pid in procs.items():
        if name == "redis":
            continue
        path = os.path.join(out_dir, f"{name}.txt")
        started.append(subprocess.Popen([spy, "record", "-p", str(pid), "-d", str(seconds), "-r", "200", "-f", "raw",
                                         "-o", path, "--nonblocking"], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL))
    return started


def run(size: int, pipeline: bool, profile_dir: str | None) -> dict[str, Any]:
    """Run the batch-`size` workload once; return figures, idle gaps and CPU ms per token per process."""
    requests = workload(1.0, 12) if size == 1 else workload(100_000.0, 3 * size)
    args = () if pipeline else ("--no-pipeline",)
    stack = Stack(StackConfig(replicas=1, backend="costmodel", model=MODEL, emulate_time=True,
                              scheduler_args=args, log_level="WARNING")).start()
    try:
        procs = pids(stack)
        before = {name: cpu_s(pid) for name, pid in procs.items()}
        client_before, wall = self_cpu_s(), time.perf_counter()
        spies = profile({**procs, "client": os.getpid()}, profile_dir, 60) if profile_dir else []
        outcomes = asyncio.run(drive(stack.endpoint, stack.api_key, requests,
                                     max_concurrency=size if size > 1 else 1024, timeout=300.0, progress=False))
        after = {name: cpu_s(pid) for name, pid in procs.items()}
        client = self_cpu_s() - client_before
        wall = time.perf_counter() - wall
        for spy in spies:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=30)
        gaps = idle_gaps([w.metrics_url for w in stack.workers])
    finally:
        stack.stop()
    tokens = sum(o.output_tokens for o in outcomes)
    messages = sum(len(o.path_latencies) for o in outcomes)  # one stamp per streamed chunk with tokens
    cpu = {name.split("-")[0]: 1e3 * (after[name] - before[name]) / max(tokens, 1) for name in procs}
    cpu["client"] = 1e3 * client / max(tokens, 1)
    cpu["total"] = sum(cpu.values())
    figs = figures(summarize(records_of(requests, outcomes), 10.0, 1.0))
    return {"batch": size, "pipeline": pipeline, "tree": os.environ.get("PYTHONPATH", ""), "tokens": tokens,
            "wall_s": round(wall, 2), "model": modelled(size), "tpot_p50": round(figs["tpot_p50"], 2),
            "ttft_p50": round(figs["ttft_p50"], 2), "tokens_per_message": round(tokens / max(messages, 1), 3),
            "cpu_ms_per_token": {k: round(v, 4) for k, v in cpu.items()},
            "idle_gaps": gaps, "load": os.getloadavg()[0]}


STAGES = ("received", "admitted", "routed", "enqueued", "first_scheduled", "first_token")
"""The lifecycle stamps of the TTFT path, in order (admission, router, scheduler: LifecycleTimestamps)."""


async def _hops(endpoint: str, api_key: str, count: int) -> list[dict[str, float]]:
    """Send `count` lone requests (after 2 unmeasured ones); return each one's stamps (ms after the call)."""
    rows = []
    async with AsyncClient(endpoint, api_key=api_key) as client:
        for i in range(count + 2):
            await asyncio.sleep(0.3)
            prompt = [(j * 31 + 7 * i + j * j * (i + 1)) % 250 for j in range(512)]  # no prefix-cache hits
            start, first, request_id = time.time(), 0.0, ""
            async for chunk in client.generate(prompt, max_tokens=4, ignore_eos=True):
                request_id = chunk.request_id
                first = first or (chunk.received_s if chunk.token_ids else 0.0)
            stamps = (await client.get_request(request_id)).timestamps
            if i >= 2:
                rows.append({**{k: 1e3 * (stamps.get(k, start) - start) for k in STAGES},
                             "client": 1e3 * (first - start)})
    return rows


def ttft_hops(count: int) -> dict[str, Any]:
    """Return the median ms from the client's call to each TTFT stage at batch 1, and the modelled prefill."""
    stack = Stack(StackConfig(replicas=1, backend="costmodel", model=MODEL, emulate_time=True,
                              log_level="WARNING")).start()
    try:
        rows = asyncio.run(_hops(stack.endpoint, stack.api_key, count))
    finally:
        stack.stop()
    return {"tree": os.environ.get("PYTHONPATH", ""), "requests": len(rows), "prefill_ms": modelled(1)["ttft_p50"],
            "median_ms": {k: round(statistics.median(r[k] for r in rows), 2) for k in (*STAGES, "client")},
            "load": os.getloadavg()[0]}


def main() -> None:
    """Entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--serial", action="store_true", help="run the serial loop (--no-pipeline)")
    parser.add_argument("--profile", default=None, help="a folder for py-spy's raw stacks of each process")
    parser.add_argument("--ttft-hops", type=int, default=0, metavar="N",
                        help="instead: the TTFT path's stage times at batch 1, medians of N lone requests")
    args = parser.parse_args()
    result = ttft_hops(args.ttft_hops) if args.ttft_hops else run(args.batch, not args.serial, args.profile)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
