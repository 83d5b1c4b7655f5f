"""`make bench-cost`: CPU per streamed token of each process of the path, Sluice beside vLLM's own API server.

    PYTHONPATH=. .venv/bin/python -m sluice_tools.bench_cost [--concurrency 1 16 256] [--repeats 2]
        [--vllm-python .venv-vllm/bin/python | --no-vllm] [--json out/bench-cost.json]

What runs, side by side in one run:
- **Sluice**: a local stack (`Stack`) of one replica with the cost-model worker (Llama-3-8B on an H200, emulated
  time), so tokens come at a GPU's pace and cost no model CPU: what is measured is the front door. Streamed
  over the OpenAI HTTP edge (`sluice_http`) and over gRPC with the SDK (`sluice_grpc`).
- **vLLM**: an unmodified vLLM OpenAI server (`sluice_tools.vllm_engine`, the tiny model on CPU). Its API server
  (the process the command starts) is measured apart from its engine core and worker (its child processes).

Each measurement: a client process (`sluice_tools.bench_cost_client`) connects, then every process's utime+stime
is read from /proc/PID/stat, the client streams `requests` completions of `max_tokens` tokens (ignore_eos) at the
given concurrency, and the CPU is read again. CPU per token = CPU seconds over the window / tokens streamed.
Targets alternate within each concurrency (and their order flips every repeat), so a change in the machine's
load reaches both. The medians over repeats go into the table and the JSON, and so do the ratios of the first
Sluice target's path to every other target's (vLLM's API server, a `--baseline`): per repeat, from the two
measured in that repeat, and their median (`ratios`).

Sluice's "path" is admission (with its HTTP edge) + router + scheduler (with its worker link) + Redis; the
worker is listed apart (with a real GPU it is the engine's own cost, the counterpart of vLLM's engine core).
"front" is the part that has a counterpart in vLLM's API server process: admission + router + Redis (vLLM's
scheduler runs in its engine core, which is not counted as its API server's).

A front's CPU per token depends on how fast tokens come, not only on the front: what it spends per unit of
time (a loop's turns, timers, polls) is shared by fewer tokens when the engine is slow. vLLM's tiny engine on this
CPU streams anywhere from ~1,000 to ~6,500 tokens/s at concurrency 16 as the machine's load moves, and its API
server's CPU per token moves with it (~35 µs plus ~130 ms of CPU per second); Sluice's emulated H200 streams
~3,300. `--match-rate` adds pairs that stream at the same pace: in each repeat and at each concurrency vLLM is
measured, then a Sluice stack whose emulated device is slowed down or sped up to vLLM's rate just measured
(the worker's --emulate-time-scale: Sluice's own rate at scale 1 over vLLM's), and the pair's ratio is reported
with both rates (`rate_matched` in the JSON).

`--in-front-of-vllm 1 8` adds Sluice in front of real vLLM servers (the tiny model, one stack per N, its agent
asking vLLM for a chunk per N tokens: docs/engines.md, "Tokens on the bus"): targets `sluice_vllm` and
`sluice_vllm_si8`, whose path is Sluice's front (admission, router, the agent, Redis) plus that engine's own API
server, against `vllm`'s API server alone (the ratio says what going through Sluice costs per token on top).

`--baseline DIR` adds a second Sluice stack that runs the services of another checkout, alternated with this one:
a lever's before and after in one run. `--scale-out 1 2` instead: Sluice alone, one stack per number of admission processes (`admission_procs`,
sharing one port and the caps), alternated, at the highest concurrency: tokens/s and CPU per token of each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.config import DEFAULT_API_KEY
from sluice.redis_server import free_port
from sluice.serve import EVENT_LOOP_ENV, default_event_loop
from sluice_tools.bench_peers_procs import CpuMeter, Proc, descendants, spawn, wait_http
from sluice_tools.stack import REPO_ROOT, Stack, StackConfig

__all__ = ["Target", "build_parser", "main", "measure", "no_matched_pairs", "pair_table", "ratio_table", "ratios"]

SLUICE_PATH = ("admission", "router", "scheduler", "redis")
"""The processes whose sum is Sluice's path."""
SLUICE_FRONT = ("admission", "router", "redis")
"""The processes whose counterpart is vLLM's API server process."""


@dataclass
class Target:
    """One front end to drive: how the client reaches it and which processes to meter (name -> root pids;
    a meter counts a root with all its descendants unless its name ends in `(self)`)."""

    name: str
    client_args: list[str]
    processes: dict[str, list[int]]
    path: tuple[str, ...]
    """The processes summed as this front end's path."""
    front: tuple[str, ...] = ()
    """The processes summed as its front (what vLLM's API server does); () = the path."""
    own_only: set[str] = field(default_factory=set)
    """Processes metered without their descendants (vLLM's API server, whose children are the engine)."""


class _OwnCpu(CpuMeter):
    """utime+stime of the roots alone (no descendants)."""

    def _read(self) -> dict[int, float]:
        from sluice_tools.bench_peers_procs import TICK, _stat_fields

        out = {}
        for pid in self.roots:
            fields = _stat_fields(pid)
            if fields:
                out[pid] = (int(fields[11]) + int(fields[12])) / TICK
        return out


def measure(target: Target, concurrency: int, requests: int, max_tokens: int) -> dict[str, Any]:
    """Run one client against `target`; return tokens, events, wall seconds and CPU µs per token per process.
    Raises RuntimeError when the client fails or a stream fails."""
    command = [sys.executable, "-m", "sluice_tools.bench_cost_client", *target.client_args,
               "--concurrency", str(concurrency), "--requests", str(requests), "--max-tokens", str(max_tokens)]
    client = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    assert client.stdin is not None and client.stdout is not None
    if client.stdout.readline().strip() != "ready":
        client.kill()
        raise RuntimeError(f"{target.name} client did not start ({client.wait()})")
    meters = {name: (_OwnCpu(pids) if name in target.own_only else CpuMeter(pids))
              for name, pids in target.processes.items()}
    for meter in meters.values():
        meter.start()
    client.stdin.write("go\n")
    client.stdin.flush()
    line = client.stdout.readline()
    cpu = {name: meter.stop() for name, meter in meters.items()}
    client.wait(30)
    result = json.loads(line)
    if result["failed"] or not result["tokens"]:
        raise RuntimeError(f"{target.name} at concurrency {concurrency}: {result['failed']} failed streams "
                           f"({result['first_error']})")
    tokens = result["tokens"]
    per_token = {name: 1e6 * seconds / tokens for name, seconds in cpu.items()}
    per_token["client"] = 1e6 * result["cpu_s"] / tokens
    per_token["path"] = sum(per_token[name] for name in target.path)
    per_token["front"] = sum(per_token[name] for name in target.front or target.path)
    return {"tokens": tokens, "events": result["events"], "wall_s": result["wall_s"],
            "tokens_per_s": tokens / result["wall_s"], "us_per_token": per_token}


def _median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    names = runs[0]["us_per_token"].keys()
    return {"runs": len(runs), "tokens": runs[0]["tokens"],
            "events_per_token": round(statistics.median(r["events"] / r["tokens"] for r in runs), 3),
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 1),
            "us_per_token": {n: round(statistics.median(r["us_per_token"][n] for r in runs), 1) for n in names},
            "path_us_per_token_each_run": [round(r["us_per_token"]["path"], 1) for r in runs],
            "us_per_token_each_run": {n: [round(r["us_per_token"][n], 1) for r in runs] for n in names}}


def sluice_targets(stack: Stack, grpc: bool) -> list[Target]:
    """The stack's HTTP edge (and gRPC endpoint) as targets, each with the stack's processes."""
    assert stack.admission is not None and stack.router is not None and stack.redis is not None
    processes = {"admission": [_pid(p) for p in stack.admissions], "router": [_pid(stack.router)],
                 "scheduler": [_pid(p) for p in stack.schedulers], "worker": [_pid(p) for p in stack.workers],
                 "redis": [int(stack.redis.pid or 0)]}
    common = ["--model", stack.model_id, "--api-key", stack.api_key]
    targets = [Target("sluice_http", ["--url", stack.http_base_url.removesuffix("/v1"), *common], processes,
                      SLUICE_PATH, SLUICE_FRONT)]
    if grpc:
        targets.append(Target("sluice_grpc", ["--grpc", stack.endpoint, *common], processes, SLUICE_PATH,
                              SLUICE_FRONT))
    return targets


VLLM_FRONT = ("admission", "router", "agent", "redis")
"""Sluice's processes in front of a vLLM engine (the agent is the replica's scheduler)."""


def _budgets_file(run_dir: Path) -> Path:
    """Write UNBINDING_BUDGETS into `run_dir` (made if needed) for a stack's admission; return the file."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = run_dir / "budgets.toml"
    config.write_text(UNBINDING_BUDGETS)
    return config


def vllm_stack_config(run_dir: Path, engine_stream_interval: int = 1) -> StackConfig:
    """A Sluice stack of one replica in front of an unmodified vLLM server on the tiny model, its agent asking vLLM
    for a chunk per `engine_stream_interval` tokens (--engine-stream-interval, when above 1)."""
    config = _budgets_file(run_dir)
    return StackConfig(engine="vllm", model="tiny", http_port=0, log_level="WARNING", run_dir=run_dir,
                       config_file=str(config), start_timeout_s=900.0,
                       scheduler_args=(("--engine-stream-interval", str(engine_stream_interval))
                                       if engine_stream_interval > 1 else ()))


def vllm_stack_target(stack: Stack, engine_stream_interval: int = 1) -> Target:
    """The HTTP edge of a stack in front of vLLM (`vllm_stack_config`) as a target: its path is Sluice's front and
    the engine's own API server (what a token costs on its way through Sluice), its front Sluice's part alone;
    the engine core (the API server's children) is listed apart."""
    assert stack.admission is not None and stack.router is not None and stack.redis is not None
    servers = [_pid(p) for p in stack.workers]
    processes = {"admission": [_pid(p) for p in stack.admissions], "router": [_pid(stack.router)],
                 "agent": [_pid(p) for p in stack.schedulers], "redis": [int(stack.redis.pid or 0)],
                 "api_server": servers, "engine": [child for pid in servers for child in descendants(pid)]}
    name = "sluice_vllm" if engine_stream_interval == 1 else f"sluice_vllm_si{engine_stream_interval}"
    return Target(name, ["--url", stack.http_base_url.removesuffix("/v1"), "--model", stack.model_id,
                         "--api-key", stack.api_key], processes, (*VLLM_FRONT, "api_server"), VLLM_FRONT,
                  own_only={"api_server"})


def _pid(proc: Any) -> int:
    assert proc.popen is not None
    return int(proc.popen.pid)


def vllm_spec(run_dir: Path, stream_interval: int = 1) -> Any:
    """The bench's vLLM server (sluice_tools.vllm_engine.VllmEngineSpec): the tiny model, free ports, and its
    --stream-interval when it is above 1."""
    from sluice_tools.vllm_engine import VllmEngineSpec
    from worker_svc.models import resolve_model

    return VllmEngineSpec(model_dir=str(resolve_model("tiny")), port=free_port(),
                          kv_socket=str(run_dir / "vllm-kv.sock"), replay_port=free_port(), dev_mode=False,
                          extra_args=("--stream-interval", str(stream_interval)) if stream_interval > 1 else ())


def start_vllm(python: str, run_dir: Path, stream_interval: int = 1) -> tuple[Proc, Target]:
    """Start vLLM's OpenAI server on the tiny model; return it and its target (API server apart from engine).
    `stream_interval` > 1: its --stream-interval (as Sluice admission's, `--stream-interval` of the bench)."""
    from sluice_tools.vllm_engine import vllm_command, vllm_env

    spec = vllm_spec(run_dir, stream_interval)
    proc = spawn("vllm", vllm_command(spec, python), run_dir, env=vllm_env(spec), url=spec.url)
    wait_http(proc, "/health", timeout_s=600)
    root = proc.popen.pid
    children = descendants(root)
    target = Target("vllm", ["--url", spec.url, "--model", spec.served_name],
                    {"api_server": [root], "engine": children}, ("api_server",), own_only={"api_server"})
    return proc, target


def run(targets: Sequence[Target], levels: Sequence[int], repeats: int, max_tokens: int,
        requests_of: Callable[[int], int]) -> dict[str, Any]:
    """Measure every target at every concurrency, alternated; return {target: {concurrency: medians}}."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {t.name: {c: [] for c in levels} for t in targets}
    for target in targets:  # warm-up: first connections, caches, compiled paths
        measure(target, 4, 8, 16)
    for repeat in range(repeats):
        for concurrency in levels:
            order = list(targets) if repeat % 2 == 0 else list(reversed(targets))
            for target in order:
                result = measure(target, concurrency, requests_of(concurrency), max_tokens)
                runs[target.name][concurrency].append(result)
                print(f"# {target.name} c={concurrency} run {repeat + 1}: path "
                      f"{result['us_per_token']['path']:.1f} us/token, {result['tokens_per_s']:.0f} tokens/s",
                      file=sys.stderr, flush=True)
    return {name: {str(c): _median_runs(r) for c, r in by_level.items()} for name, by_level in runs.items()}


def table(results: dict[str, Any]) -> str:
    """Return the results as a Markdown table: one row per target, concurrency and process."""
    lines = ["| target | concurrency | process | CPU µs/token |", "|---|---:|---|---:|"]
    for name, by_level in results.items():
        for level, figures in by_level.items():
            for process, value in figures["us_per_token"].items():
                bold = f"**{value}**" if process in ("path", "front") else str(value)
                lines.append(f"| {name} | {level} | {process} | {bold} |")
            lines.append(f"| {name} | {level} | (tokens/s, SSE events per token) | "
                         f"{figures['tokens_per_s']}, {figures['events_per_token']} |")
    return "\n".join(lines)


def ratios(results: dict[str, Any], reference: str = "sluice_http") -> dict[str, dict[str, dict[str, Any]]]:
    """Return the reference target's path over every other target's, per concurrency: for each repeat (the two
    measured in the same repeat, alternated, so a change in the machine's load reaches both) and the median of
    those. {"<reference> / <target>": {concurrency: {"each_run": [...], "median": x}}}; {} without the reference."""
    mine = results.get(reference)
    if mine is None:
        return {}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, by_level in results.items():
        if name == reference:
            continue
        per_level: dict[str, dict[str, Any]] = {}
        for level, figures in by_level.items():
            ours = mine.get(level)
            if ours is None:
                continue
            pairs = [a / b for a, b in zip(ours["path_us_per_token_each_run"], figures["path_us_per_token_each_run"],
                                           strict=False) if b > 0]
            if pairs:
                per_level[level] = {"each_run": [round(p, 3) for p in pairs],
                                    "median": round(statistics.median(pairs), 3)}
        out[f"{reference} / {name}"] = per_level
    return out


def ratio_table(by_pair: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Return `ratios` as a Markdown table: one row per pair of targets and concurrency."""
    lines = ["| path over path | concurrency | each repeat | median |", "|---|---:|---|---:|"]
    for pair, by_level in by_pair.items():
        for level, figures in by_level.items():
            each = ", ".join(f"{r:.2f}" for r in figures["each_run"])
            lines.append(f"| {pair} | {level} | {each} | **{figures['median']:.2f}** |")
    return "\n".join(lines)


UNBINDING_BUDGETS = f"""
[budgets]
max_active_requests = 8192
max_queue_length = 8192
max_pending_input_tokens = 16777216
max_reserved_output_tokens = 16777216
[tenants.default]
api_keys = ["{DEFAULT_API_KEY}"]
"""
"""Caps far above any load of the bench: what is measured is the path, never a refusal. (With caps that bind,
N processes hold cap/N each, and an uneven spread of connections over them refuses early: admission_svc/shares.py.)"""


def _stack_config(run_dir: Path, admission_procs: int = 1, code: Path | None = None,
                  event_loop: str = "", time_scale: float = 1.0, stream_interval: int = 1,
                  publish_interval_ms: float = 0.0) -> StackConfig:
    """The bench's stack; `code`: a checkout whose services it runs instead of this one's (a lever's before);
    `event_loop`: $SLUICE_EVENT_LOOP of its services ("": their default); `time_scale`: its worker's
    --emulate-time-scale (a slower or faster device); `stream_interval`: admission's --stream-interval;
    `publish_interval_ms`: the scheduler's --publish-interval-ms."""
    config = _budgets_file(run_dir)
    env: tuple[tuple[str, str], ...] = ((EVENT_LOOP_ENV, event_loop),)
    if code is not None:
        # The stack starts its services with `python -m` in this checkout's root, and -m puts the working
        # directory first on sys.path: without PYTHONSAFEPATH the "baseline" would import this checkout's code.
        env += (("PYTHONPATH", str(code.resolve())), ("PYTHONSAFEPATH", "1"))
    worker_args = ("--emulate-time-scale", repr(time_scale)) if time_scale != 1.0 else ()
    return StackConfig(backend="costmodel", model="llama-3-8b", emulate_time=True, http_port=0, log_level="WARNING",
                       run_dir=run_dir, admission_procs=admission_procs, config_file=str(config), env=env,
                       worker_args=worker_args,
                       admission_args=("--stream-interval", str(stream_interval)) if stream_interval > 1 else (),
                       scheduler_args=("--publish-interval-ms", repr(publish_interval_ms)) if publish_interval_ms else ())


def rate_matched(vllm_target: Target, levels: Sequence[int], repeats: int, max_tokens: int,
                 requests_of: Callable[[int], int], sluice_rates: dict[int, float], run_dir: Path,
                 event_loop: str = "", stream_interval: int = 1, publish_interval_ms: float = 0.0) -> dict[str, Any]:
    """Pairs that stream at the same pace (see the module docstring): for each repeat and concurrency, vLLM, then a
    Sluice stack whose device is scaled to the rate vLLM just streamed at (`sluice_rates`: Sluice's own at scale
    1). Returns {"results": {"vllm": ..., "sluice_http": ...} medians per concurrency, "ratios": ..., "pairs":
    [{concurrency, scale, rates, paths}]}."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {"sluice_http": {c: [] for c in levels},
                                                        "vllm": {c: [] for c in levels}}
    pairs: list[dict[str, Any]] = []
    for repeat in range(repeats):
        for concurrency in levels:
            theirs = measure(vllm_target, concurrency, requests_of(concurrency), max_tokens)
            scale = round(sluice_rates[concurrency] / theirs["tokens_per_s"], 3)
            with Stack(_stack_config(run_dir / f"matched-{concurrency}-{repeat}", event_loop=event_loop,
                                     time_scale=scale, stream_interval=stream_interval,
                                     publish_interval_ms=publish_interval_ms)) as stack:
                target = sluice_targets(stack, grpc=False)[0]
                measure(target, 4, 8, 16)
                ours = measure(target, concurrency, requests_of(concurrency), max_tokens)
            runs["vllm"][concurrency].append(theirs)
            runs["sluice_http"][concurrency].append(ours)
            pair = {"concurrency": concurrency, "time_scale": scale,
                    "tokens_per_s": {"sluice_http": round(ours["tokens_per_s"]), "vllm": round(theirs["tokens_per_s"])},
                    "path_us_per_token": {"sluice_http": round(ours["us_per_token"]["path"], 1),
                                          "vllm": round(theirs["us_per_token"]["path"], 1)}}
            pairs.append(pair)
            print(f"# rate-matched c={concurrency} run {repeat + 1}: scale {scale}, Sluice {pair['tokens_per_s']['sluice_http']}"
                  f" tokens/s path {pair['path_us_per_token']['sluice_http']} us/token, vLLM {pair['tokens_per_s']['vllm']}"
                  f" tokens/s path {pair['path_us_per_token']['vllm']}", file=sys.stderr, flush=True)
    results = {name: {str(c): _median_runs(r) for c, r in by_level.items()} for name, by_level in runs.items()}
    return {"results": results, "ratios": ratios(results), "pairs": pairs}


def scale_out(procs: Sequence[int], concurrency: int, repeats: int, max_tokens: int, requests: int,
              run_dir: Path, event_loop: str = "") -> dict[str, Any]:
    """Measure Sluice's HTTP edge with each number of admission processes (a stack each), alternated; return
    {procs: medians}."""
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in procs}
    for repeat in range(repeats):
        for n in procs if repeat % 2 == 0 else list(reversed(procs)):
            with Stack(_stack_config(run_dir / f"stack-{n}", n, event_loop=event_loop)) as stack:
                target = sluice_targets(stack, grpc=False)[0]
                measure(target, 4, 8, 16)
                result = measure(target, concurrency, requests, max_tokens)
                runs[n].append(result)
                print(f"# {n} admission processes c={concurrency} run {repeat + 1}: {result['tokens_per_s']:.0f} "
                      f"tokens/s, path {result['us_per_token']['path']:.1f} us/token", file=sys.stderr, flush=True)
    return {f"admission_procs={n}": {str(concurrency): _median_runs(r)} for n, r in runs.items()}


def no_matched_pairs(args: argparse.Namespace) -> str | None:
    """Why `--match-rate` has no pairs to measure in this run (printed, and the pairs left out), or None."""
    if not args.match_rate:
        return None
    if args.no_vllm:
        return "--no-vllm"
    if args.scale_out:
        return "--scale-out"
    if not Path(args.vllm_python).exists():
        return f"no vLLM at {args.vllm_python} (make setup-vllm)"
    return None


def build_parser() -> argparse.ArgumentParser:
    """Return the command line's parser."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-per-stream", type=int, default=2,
                        help="requests per concurrent stream (at least 8 in all)")
    parser.add_argument("--vllm-python", default=str(REPO_ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--no-vllm", action="store_true", help="Sluice only")
    parser.add_argument("--no-grpc", action="store_true", help="HTTP only")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--event-loop", choices=("asyncio", "uvloop"), default=default_event_loop(),
                        help="the Sluice services' event loop ($SLUICE_EVENT_LOOP; default: the services' own, "
                             "uvloop when installed)")
    parser.add_argument("--baseline-event-loop", choices=("asyncio", "uvloop"), default=None,
                        help="also a Sluice stack of this checkout on this event loop, alternated: the loop's lever")
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="also a Sluice stack running the services of checkout DIR (e.g. `git worktree add DIR "
                             "HEAD~1`), alternated with this one: a lever's before and after in one run")
    parser.add_argument("--match-rate", action="store_true",
                        help="also pairs streaming at the same pace: vLLM, then Sluice with its emulated device scaled "
                             "to the rate vLLM just streamed at (see above)")
    parser.add_argument("--stream-interval", type=int, default=1, metavar="N",
                        help="both fronts send a stream's tokens N at a time after its first (Sluice admission's and "
                             "vLLM's --stream-interval); default 1: every token as it comes")
    parser.add_argument("--publish-interval-ms", type=float, default=0.0, metavar="MS",
                        help="Sluice's schedulers let rounds' tokens queued within MS of their last publication "
                             "wait MS for later rounds' (their --publish-interval-ms; not the baseline's, so "
                             "`--baseline DIR` with it measures the lever); default 0: every round as it comes")
    parser.add_argument("--in-front-of-vllm", type=int, nargs="+", metavar="N", default=[],
                        help="also Sluice in front of an unmodified vLLM server (the tiny model), one stack per N, its "
                             "agent asking vLLM for a chunk per N tokens (--engine-stream-interval; 1: every "
                             "token): targets sluice_vllm and sluice_vllm_siN, beside vLLM alone (unless --no-vllm)")
    parser.add_argument("--scale-out", type=int, nargs="+", metavar="N",
                        help="Sluice only: tokens/s and CPU with N admission processes (one stack each), alternated")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Start Sluice (and vLLM), measure, print the table; JSON to --json."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.stream_interval < 1:
        parser.error(f"--stream-interval must be at least 1, got {args.stream_interval}")
    if not 0 <= args.publish_interval_ms < math.inf:
        parser.error(f"--publish-interval-ms must be a finite number >= 0, got {args.publish_interval_ms}")
    if any(n < 1 for n in args.in_front_of_vllm):
        parser.error(f"--in-front-of-vllm takes stream intervals of at least 1, got {args.in_front_of_vllm}")
    if args.in_front_of_vllm and not Path(args.vllm_python).exists():
        parser.error(f"--in-front-of-vllm needs vLLM: none at {args.vllm_python} (make setup-vllm)")
    skipped = no_matched_pairs(args)
    if skipped:
        print(f"# {skipped}: no rate-matched pairs", file=sys.stderr)
        args.match_rate = False

    def requests_of(concurrency: int) -> int:
        return max(8, concurrency * args.requests_per_stream)

    run_dir = Path(REPO_ROOT / "out" / "bench-cost")
    run_dir.mkdir(parents=True, exist_ok=True)
    vllm: Proc | None = None
    matched: dict[str, Any] | None = None
    started = time.monotonic()
    if args.scale_out:
        level = max(args.concurrency)
        results = scale_out(args.scale_out, level, args.repeats, args.max_tokens,
                            max(8, level * args.requests_per_stream), run_dir, args.event_loop)
        _report(args, results, started)
        return
    try:
        with Stack(_stack_config(run_dir / "stack", event_loop=args.event_loop, stream_interval=args.stream_interval,
                                 publish_interval_ms=args.publish_interval_ms)) as stack, \
                contextlib.ExitStack() as more:
            targets = sluice_targets(stack, grpc=not args.no_grpc)
            if args.baseline is not None or args.baseline_event_loop is not None:
                base = more.enter_context(Stack(_stack_config(run_dir / "baseline", code=args.baseline,
                                                              event_loop=args.baseline_event_loop or args.event_loop,
                                                              stream_interval=args.stream_interval)))
                for target in sluice_targets(base, grpc=not args.no_grpc):
                    target.name += "_baseline"
                    targets.append(target)
            if not args.no_vllm and Path(args.vllm_python).exists():
                vllm, vllm_target = start_vllm(args.vllm_python, run_dir, args.stream_interval)
                targets.insert(1, vllm_target)
            elif not args.no_vllm:
                print(f"# no vLLM at {args.vllm_python} (make setup-vllm): Sluice only", file=sys.stderr)
            for interval in args.in_front_of_vllm:
                fronted = more.enter_context(Stack(vllm_stack_config(run_dir / f"vllm-stack-{interval}", interval)))
                targets.append(vllm_stack_target(fronted, interval))
            results = run(targets, args.concurrency, args.repeats, args.max_tokens, requests_of)
        if args.match_rate and vllm is not None:
            matched = rate_matched(vllm_target, args.concurrency, args.repeats, args.max_tokens, requests_of,
                                   {c: results["sluice_http"][str(c)]["tokens_per_s"] for c in args.concurrency},
                                   run_dir, args.event_loop, args.stream_interval, args.publish_interval_ms)
    finally:
        if vllm is not None:
            vllm.stop()
    _report(args, results, started, matched)


def _report(args: argparse.Namespace, results: dict[str, Any], started: float,
            matched: dict[str, Any] | None = None) -> None:
    report = {"load": {"concurrency": args.concurrency, "repeats": args.repeats, "max_tokens": args.max_tokens,
                       "requests_per_stream": args.requests_per_stream, "scale_out": args.scale_out,
                       "stream_interval": args.stream_interval, "publish_interval_ms": args.publish_interval_ms,
                       "elapsed_s": round(time.monotonic() - started)},
              "results": results, "ratios": ratios(results)}
    for name in [n for n in results if n.startswith("sluice_vllm") and "vllm" in results]:
        # what a token costs through Sluice (its front and vLLM's API server) over straight from vLLM's API server
        report["ratios"].update(ratios({name: results[name], "vllm": results["vllm"]}, name))
    if matched is not None:
        report["rate_matched"] = matched
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(table(results))
    if report["ratios"]:
        print()
        print(ratio_table(report["ratios"]))
    if matched is not None:
        print("\nAt the same pace (Sluice's device scaled to the rate vLLM streamed at just before):\n")
        print(pair_table(matched["pairs"]))
        print()
        print(ratio_table(matched["ratios"]))


def pair_table(pairs: Sequence[dict[str, Any]]) -> str:
    """Return the rate-matched pairs as a Markdown table (tokens/s and path per token of each, in run order)."""
    lines = ["| concurrency | time scale | tokens/s Sluice / vLLM | path µs/token Sluice / vLLM |",
             "|---:|---:|---|---|"]
    for pair in pairs:
        rate, path = pair["tokens_per_s"], pair["path_us_per_token"]
        lines.append(f"| {pair['concurrency']} | {pair['time_scale']} | {rate['sluice_http']} / {rate['vllm']} | "
                     f"{path['sluice_http']} / {path['vllm']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
