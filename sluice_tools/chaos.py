"""A chaos run: a steady mixed load on a local stack while processes are killed and stalled, then the invariants.

    python -m sluice_tools.chaos [--duration-s 600] [--fault-interval-s 4] [--clients 6] [--http-clients 2]
                                 [--seed 0] [--disagg P:D] [--json FILE]

What it does
- Starts a supervised stack (`sluice_tools.stack.Stack`, cost-model workers with emulated round times, the embedded
  Redis): every process that dies is restarted on its address (sluice_tools/supervisor.py).
- Load: `clients` threads, each issuing one request after another over gRPC, without client retries (each
  request is one attempt, so every outcome is seen): two tenants, output lengths drawn from `max_tokens`,
  greedy with ignore_eos, and a `cancel_fraction` of them dropped by their client after a few tokens.
  `http_clients` more threads do the same over the OpenAI HTTP API (streamed completions on HTTP/1.1, whose text
  chunks admission's token reader writes the moment their tokens arrive): a cost-model token is one printable
  character in admission's tokenizer, so the text is checked as exactly as the tokens; a refusal is its HTTP
  status (`failed:HTTP_<status>`), an error event after the stream started its `code`, a connection refused
  `failed:CONNECTION_REFUSED`, and one that closes before `[DONE]` `failed:CONNECTION_CLOSED` when admission
  went away, but `wrong` when the same admission process lived on (only its death may cut a stream off).
- With `disagg` (P:D), the same run on a disaggregated stack (docs/disaggregation.md, "Live mode"): P prefill and D
  decode replicas, every request's prompt on a prefill replica, its KV blocks pulled by the decode replica's worker.
- With `host_tier`, every replica keeps a host prefix tier (the worker's `--host-blocks`, the scheduler's
  `--host-prefix-cache`) on a device small enough to evict, and half the prompts are drawn from a few shared ones,
  so prompts are paged out to the tier and copied back while the faults land (the report counts the host hits).
- With `publish_interval_ms` the schedulers space their publications (`--publish-interval-ms`: rounds' tokens wait
  and go out merged), and with `stream_interval` admission holds a stream's tokens N at a time (`--stream-interval`):
  tokens held when a process dies must still end every request exactly once.
- Faults, every `fault_interval_s`, one drawn from `faults` (`--faults` picks some: a run without worker kills
  tells whether a worker's memory grows, which its restarts would hide): `kill:<role>` is kill -9 of a worker, scheduler,
  the router, admission or Redis; `stop:<role>` stalls a scheduler or Redis (SIGSTOP for `stall_s`, then SIGCONT).
  A disaggregated run draws each side's workers and schedulers apart (`kill:prefill-worker`,
  `stop:decode-scheduler`...: `faults_for`), so both sides are hit alike whatever the split.
- The invariants, checked once the load stops and the stack has settled:
  every request ended exactly once, as its client saw it: `exact` (FINISHED with exactly the tokens an unfaulted
  run gives: the cost model's token depends only on the request and the position, `CostModel.token_for`),
  `cancelled` (by its own client), or `failed` with an explicit status; `hung` (the client's deadline passed with
  no end) and `wrong` (a token that is not the model's at its index, or an index out of order) must be 0; no
  reservation left in admission, no request or KV block left on a scheduler, no Redis pending entry left in any
  consumer group of `completions`; no KV hold left on a prefill scheduler (`Stats.kv_blocks_held`); no host block
  held beyond the prefix tier's copies (`Stats.host_blocks_used - host_blocks_cached`: swap copies and copies in
  flight end with their requests); the resident memory of every process at the start and the end, sampled every
  `rss_interval_s` (`rss_kb_samples`), and each process's growth over the run's second half, past its warm-up, in
  kB per minute (`rss_growth_kb_per_min`; only for a process that was not restarted in that half).
- Counted from the schedulers' metrics, read every `scrape_interval_s` (a scheduler killed loses what it counted
  since the last read): the hand-offs by outcome (`sluice_kv_transfers_total{outcome}`: received, failed, stale,
  no_room, empty, cancelled) and the holds ended by reason (`sluice_kv_holds_ended_total{reason}`).
- Prints (and with --json writes) one JSON report with the counts.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import signal
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import redis

from sluice import client as sdk
from sluice.model_spec import load_model_spec
from sluice_tools.scrape import Scraper
from sluice_tools.stack import Proc, Stack, StackConfig
from sluice_tools.supervisor import RestartPolicy, Supervisor
from worker_svc.costmodel import CostModel
from worker_svc.models import resolve_model

__all__ = ["DISAGG_FAULTS", "FAULTS", "ChaosConfig", "faults_for", "run", "stack_config"]

FAULTS = ("kill:worker", "kill:scheduler", "kill:router", "kill:admission", "kill:redis", "stop:redis",
          "stop:scheduler")
"""Every fault of an aggregated run (see the module docstring)."""
DISAGG_FAULTS = ("kill:prefill-worker", "kill:decode-worker", "kill:prefill-scheduler", "kill:decode-scheduler",
                 "kill:router", "kill:admission", "kill:redis", "stop:redis", "stop:prefill-scheduler",
                 "stop:decode-scheduler")
"""Every fault of a disaggregated run: each side's workers and schedulers drawn apart."""
HANDOFF_COUNTERS = ("sluice_kv_transfers_total", "sluice_kv_holds_ended_total")
"""The schedulers' hand-off counters the report sums (decode side: by outcome; prefill side: by reason)."""
HOST_HITS = "sluice_host_prefix_hit_tokens_total"
"""The schedulers' host-tier hits, summed into the report's `host_hit_tokens`."""
HOST_TIER_BLOCKS = 64
"""Device blocks per worker of a `host_tier` run: few enough that finished prompts are evicted (and paged out)."""
HOST_TIER_HOST_BLOCKS = 1024
"""Host blocks per worker of a `host_tier` run: the tier holds sixteen devices' worth."""
SHARED_PROMPTS = 4
"""Prompts a `host_tier` run's clients share (half of their requests), so evicted prompts come back as host hits."""
MODEL = "llama-3-8b"
TENANTS = """
[tenants.acme]
api_keys = ["k-acme"]
[tenants.globex]
api_keys = ["k-globex"]
weight = 2.0
"""
KEYS = ("k-acme", "k-globex")
ADMISSION_EXIT_S = 2.0
"""How long a client whose stream was cut off waits for the admission process to be seen gone: a process killed -9
closes its sockets a moment before it can be reaped, so a client that looked at once saw it still running."""


@dataclass(frozen=True)
class ChaosConfig:
    """What the chaos run does."""

    duration_s: float = 600.0
    """How long the load and the faults last."""
    fault_interval_s: float = 4.0
    """Seconds between two faults."""
    clients: int = 6
    """Client threads, each one request at a time."""
    seed: int = 0
    """Seed of the load and of the faults drawn."""
    replicas: int = 2
    """Aggregated replicas (without `disagg`)."""
    disagg: tuple[int, int] | None = None
    """Prefill:decode replicas of a disaggregated stack (None: `replicas` aggregated ones)."""
    max_tokens: tuple[int, ...] = (16, 64, 200, 500)
    """Output lengths drawn from for each request."""
    cancel_fraction: float = 0.15
    """Requests whose client goes away after a few tokens."""
    stall_s: float = 3.0
    """How long a `stop:` fault stalls its process."""
    faults: tuple[str, ...] | None = None
    """The faults drawn from (None: `faults_for(disagg)`)."""
    host_tier: bool = False
    """Every replica with a host prefix tier, and prompts that come back (see the module docstring)."""
    publish_interval_ms: float = 0.0
    """The schedulers' --publish-interval-ms (0: off)."""
    stream_interval: int = 1
    """Admission's --stream-interval (1: every token as it comes)."""
    request_timeout_s: float = 120.0
    """A client's deadline: a request not ended by then counts as hung."""
    settle_s: float = 30.0
    """After the load: how long the stack gets to release everything before the leak checks fail."""
    scrape_interval_s: float = 1.0
    """How often the schedulers' hand-off counters are read."""
    rss_interval_s: float = 30.0
    """How often every process's resident memory is sampled (`rss_kb_samples`, `rss_growth_kb_per_min`)."""
    http_clients: int = 2
    """Client threads over the OpenAI HTTP API (see the module docstring), beside the `clients` over gRPC."""
    run_dir: str | None = None


def faults_for(disagg: tuple[int, int] | None) -> tuple[str, ...]:
    """Return the faults a run draws from: `FAULTS`, or `DISAGG_FAULTS` on a disaggregated stack."""
    return FAULTS if disagg is None else DISAGG_FAULTS


def stack_config(config: ChaosConfig, run_dir: Path, tenants: Path) -> StackConfig:
    """Return the stack a chaos run starts: cost-model workers with emulated round times, `replicas` aggregated
    ones or the `disagg` split."""
    extra: dict[str, Any] = {}
    scheduler_args: tuple[str, ...] = ()
    if config.host_tier:
        extra = {"num_blocks": HOST_TIER_BLOCKS, "worker_args": ("--host-blocks", str(HOST_TIER_HOST_BLOCKS))}
        scheduler_args += ("--host-prefix-cache",)
    if config.publish_interval_ms:
        scheduler_args += ("--publish-interval-ms", repr(config.publish_interval_ms))
    if config.stream_interval > 1:
        extra["admission_args"] = ("--stream-interval", str(config.stream_interval))
    return StackConfig(replicas=config.replicas, disagg=config.disagg, backend="costmodel", model=MODEL,
                       emulate_time=True, run_dir=run_dir, config_file=str(tenants), start_timeout_s=90,
                       http_port=0 if config.http_clients else None, scheduler_args=scheduler_args, **extra)


@dataclass
class Tally:
    """What the clients saw, and the faults injected."""

    outcomes: Counter[str] = field(default_factory=Counter)
    http_outcomes: Counter[str] = field(default_factory=Counter)
    """The outcomes of the requests over the OpenAI HTTP API alone (counted in `outcomes` too)."""
    wrong: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    fault_kinds: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    failure_examples: dict[str, str] = field(default_factory=dict)
    """The first message of each failure code."""

    def note(self, code: str, message: str) -> None:
        with self.lock:
            self.failure_examples.setdefault(code, message[:300])

    def add(self, kind: str, detail: str = "", http: bool = False) -> None:
        with self.lock:
            self.outcomes[kind] += 1
            if http:
                self.http_outcomes[kind] += 1
            if kind in ("wrong", "hung") and len(self.wrong) < 20:
                self.wrong.append(detail)


def _shared_prompt(index: int) -> list[int]:
    """Shared prompt `index` of a `host_tier` run: 192 to 255 tokens (12 to 15 full blocks), the same in every
    client: together they hold about as many blocks as a replica's device has, so they keep evicting one another."""
    rng = random.Random(f"shared-{index}")
    return [rng.randrange(1, 250) for _ in range(192 + rng.randrange(64))]


def _draw(rng: random.Random, config: ChaosConfig) -> tuple[list[int], int, int | None]:
    """Return a request's prompt, output length and the count of tokens after which its client leaves (None)."""
    if config.host_tier and rng.random() < 0.5:
        prompt = _shared_prompt(rng.randrange(SHARED_PROMPTS))
    else:
        prompt = [rng.randrange(1, 250) for _ in range(rng.randrange(8, 120))]
    max_tokens = rng.choice(config.max_tokens)
    return prompt, max_tokens, rng.randrange(1, 12) if rng.random() < config.cancel_fraction else None


def _one_request(endpoint: str, rng: random.Random, config: ChaosConfig, model: CostModel, tally: Tally) -> float:
    """Run one request and classify how it ended (see the module docstring); return how long its client waits
    before the next one (a refused client backs off, as a real one would: its retry delay, else 0.2 s)."""
    prompt, max_tokens, cancel_after = _draw(rng, config)
    tokens: list[int] = []
    request_id, index_errors, status, pause = "", 0, "", 0.0
    try:
        with sdk.Client(endpoint, api_key=rng.choice(KEYS), retry=sdk.RetryPolicy(max_attempts=1)) as client:
            stream = client.generate(prompt, max_tokens=max_tokens, ignore_eos=True, timeout=config.request_timeout_s)
            for chunk in stream:
                request_id = chunk.request_id
                if chunk.finished:
                    status = chunk.status
                    break
                index_errors += chunk.index != len(tokens)
                tokens.extend(chunk.token_ids)
                if cancel_after is not None and len(tokens) >= cancel_after:
                    break
    except sdk.SluiceError as exc:
        status = f"failed:{exc.code.name}"
        pause = exc.retry_delay_s if exc.retry_delay_s is not None else 0.2
        tally.note(exc.code.name, str(exc))
    expected = [model.token_for(request_id, len(prompt) + i) for i in range(len(tokens))] if request_id else []
    if index_errors or tokens != expected:
        tally.add("wrong", f"{request_id}: {index_errors} index errors, tokens differ from the model's")
    elif status == "failed:DEADLINE_EXCEEDED":
        tally.add("hung", f"{request_id}: no end within {config.request_timeout_s} s ({len(tokens)} tokens)")
    elif status.startswith("failed:"):
        tally.add(status)
    elif status in ("FINISHED_LENGTH", "FINISHED_STOP"):
        tally.add("exact" if len(tokens) == max_tokens else "wrong", f"{request_id}: {len(tokens)} of {max_tokens}")
    elif cancel_after is not None:
        tally.add("cancelled")
    else:
        tally.add("wrong", f"{request_id}: stream ended without a status after {len(tokens)} tokens")
    return pause


def _one_http_request(base_url: str, rng: random.Random, config: ChaosConfig, model: CostModel,
                      decode: Callable[[list[int]], str], admission_pid: Callable[[], int], tally: Tally) -> float:
    """`_one_request` over the OpenAI HTTP API: one streamed completion on HTTP/1.1, its text checked against the
    model's tokens (see the module docstring); return how long its client waits before the next one. A stream
    that ends without `[DONE]` while the same admission process ran from its start to its end is `wrong`: only
    admission going away may cut a stream off."""
    prompt, max_tokens, cancel_after = _draw(rng, config)
    pid = admission_pid()
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=config.request_timeout_s)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    request_id, text, finish, usage, status, pause = "", "", None, -1, "", 0.0
    try:
        conn.request("POST", f"{url.path}/completions", body=json.dumps(body),
                     headers={"Authorization": f"Bearer {rng.choice(KEYS)}", "Content-Type": "application/json"})
        response = conn.getresponse()
        request_id = response.getheader("x-request-id") or ""
        if response.status != 200:
            status = f"failed:HTTP_{response.status}"
            pause = float(response.getheader("retry-after") or 0.2)
            tally.note(status.removeprefix("failed:"), response.read().decode(errors="replace"))
        else:
            for line in response:
                data = line.decode().strip().removeprefix("data: ")
                if data == "[DONE]":
                    status = status or "DONE"
                    break
                if not data:
                    continue
                event = json.loads(data)
                if "error" in event:
                    status = f"failed:{event['error'].get('code') or event['error'].get('type')}"
                    tally.note(status.removeprefix("failed:"), json.dumps(event["error"]))
                    continue
                for choice in event["choices"]:
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
                if event.get("usage"):
                    usage = event["usage"]["completion_tokens"]
                if cancel_after is not None and len(text) >= cancel_after and finish is None:
                    status = "cancelled"
                    break
            status = status or "failed:CONNECTION_CLOSED"  # the stream ended without [DONE]: admission went away?
    except TimeoutError:
        status = "hung"
    except ConnectionRefusedError:  # admission down, before its restart
        status, pause = "failed:CONNECTION_REFUSED", 0.2
    except (ConnectionError, http.client.HTTPException) as exc:
        status = "failed:CONNECTION_CLOSED"
        tally.note("CONNECTION_CLOSED", f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()
    expected = decode([model.token_for(request_id, len(prompt) + i) for i in range(len(text))]) if request_id else ""
    why = ""
    if status == "failed:CONNECTION_CLOSED" and request_id and _still(admission_pid, pid, ADMISSION_EXIT_S):
        kind, why = "wrong", f"the stream ended without [DONE] after {len(text)} tokens while admission (pid {pid}) lived"
    elif text != expected:
        kind, why = "wrong", "text differs from the model's tokens"
    elif status == "hung":
        kind, why = "hung", f"nothing for {config.request_timeout_s} s ({len(text)} tokens)"
    elif status.startswith("failed:") or status == "cancelled":
        kind = status
    elif finish == "length" and usage == max_tokens == len(text):
        kind = "exact"
    else:
        kind, why = "wrong", f"[DONE] after {len(text)} of {max_tokens} tokens, finish {finish}, usage {usage}"
    tally.add(kind, f"{request_id} (HTTP): {why}", http=True)
    return pause


def _client_loop(endpoint: str, seed: int, config: ChaosConfig, stop: threading.Event, tally: Tally) -> None:
    rng, model = random.Random(seed), CostModel(MODEL)
    while not stop.is_set():
        stop.wait(min(_one_request(endpoint, rng, config, model, tally), 2.0))


def _http_client_loop(base_url: str, seed: int, config: ChaosConfig, decode: Callable[[list[int]], str],
                      admission_pid: Callable[[], int], stop: threading.Event, tally: Tally) -> None:
    rng, model = random.Random(seed), CostModel(MODEL)
    while not stop.is_set():
        stop.wait(min(_one_http_request(base_url, rng, config, model, decode, admission_pid, tally), 2.0))


def _still(now: Callable[[], int], pid: int, wait_s: float) -> bool:
    """Whether `now()` still gives `pid` after up to `wait_s` (it changes as soon as the process is gone)."""
    give_up = time.monotonic() + wait_s
    while now() == pid and time.monotonic() < give_up:
        time.sleep(0.02)
    return now() == pid


def _admission_pid(stack: Stack) -> int:
    """The admission process's pid now (0 while it is down): a restart changes it."""
    proc = stack.admission
    return proc.popen.pid if proc is not None and proc.popen is not None and proc.popen.poll() is None else 0


def _inject(stack: Stack, fault: str, rng: random.Random, stall_s: float) -> str:
    """Apply one fault; return what was done (for the report)."""
    action, role = fault.split(":", 1)
    if role == "redis":
        assert stack.redis is not None
        pid = stack.redis.pid if stack.redis.running else None
    else:
        proc = rng.choice(_targets(stack, role))
        pid = proc.popen.pid if proc.popen is not None and proc.alive() else None
        role = proc.name
    if pid is None:
        return f"{fault}: not running (being restarted), skipped"
    try:
        if action == "kill":
            os.kill(pid, signal.SIGKILL)
            return f"kill -9 {role} (pid {pid})"
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(stall_s)
        finally:
            os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # it died just before (an earlier fault): its supervisor restarts it
        return f"{fault}: {role} (pid {pid}) already gone, skipped"
    return f"SIGSTOP {role} (pid {pid}) for {stall_s} s"


def _targets(stack: Stack, role: str) -> list[Proc]:
    """Return the processes a fault on `role` may hit: `worker`, `scheduler` (every replica's), `prefill-worker`,
    `decode-scheduler`... (one side's), `router`, `admission`."""
    side, _, kind = role.rpartition("-")
    procs: dict[str, list[Proc | None]] = {"worker": list(stack.workers), "scheduler": list(stack.schedulers),
                                           "router": [stack.router], "admission": [stack.admission]}
    found = [p for p in procs[kind] if p is not None
             and (not side or stack.replicas[p.replica_id].role == side)]
    if not found:
        raise ValueError(f"fault on {role!r}: no such process in this stack")
    return found


def _rss_by_pid(stack: Stack) -> dict[str, tuple[int, int]]:
    """Return (pid, resident memory in kB) of every process of the stack, Redis included."""
    pids = {p.name: p.popen.pid for p in stack.procs if p.popen is not None and p.alive()}
    if stack.redis is not None and stack.redis.pid is not None:
        pids["redis"] = stack.redis.pid
    out: dict[str, tuple[int, int]] = {}
    for name, pid in pids.items():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        out[name] = (pid, next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0))
    return out


def _rss_kb(stack: Stack) -> dict[str, int]:
    """Return the resident memory (kB) of every process of the stack, Redis included."""
    return {name: kb for name, (_, kb) in _rss_by_pid(stack).items()}


def _rss_loop(stack: Stack, interval_s: float, stop: threading.Event, started: float,
              samples: list[dict[str, Any]]) -> None:
    """Append every process's (pid, RSS kB) to `samples` every `interval_s` until `stop`."""
    while not stop.wait(interval_s):
        samples.append({"t": round(time.monotonic() - started, 1), **_rss_by_pid(stack)})


def rss_growth_kb_per_min(samples: list[dict[str, Any]]) -> dict[str, float]:
    """Return, per process, the least-squares slope (kB per minute) of its RSS over the second half of `samples`,
    for the processes that were one process (one pid) all that time: a growth that warm-up does not explain."""
    half = samples[len(samples) // 2:]
    out: dict[str, float] = {}
    names = set().union(*(set(s) - {"t"} for s in half)) if half else set()
    for name in sorted(names):
        points = [(s["t"], s[name]) for s in half if name in s]
        if len(points) < 3 or len(points) < len(half) or len({pid for _, (pid, _) in points}) != 1:
            continue
        ts = [t for t, _ in points]
        kbs = [kb for _, (_, kb) in points]
        mean_t, mean_kb = sum(ts) / len(ts), sum(kbs) / len(kbs)
        spread = sum((t - mean_t) ** 2 for t in ts)
        if spread > 0:
            out[name] = round(60 * sum((t - mean_t) * (kb - mean_kb) for t, kb in zip(ts, kbs, strict=True)) / spread,
                              1)
    return out


def _admission_budgets(stack: Stack) -> dict[str, float]:
    assert stack.admission is not None
    url = stack.admission.metrics_url or stack.admission.printed_metrics_url()
    if not url:  # restarted by the last fault and not serving its metrics yet: read again while settling
        raise OSError("admission has not printed its metrics URL yet (restarting)")
    with urllib.request.urlopen(url, timeout=5) as reply:  # noqa: S310 (the stack's loopback URL)
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(("sluice_admission_budget_in_use{", "sluice_admission_active_requests ")):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _leaks(stack: Stack) -> dict[str, Any]:
    """Return what is still held once the stack has settled (all zero when nothing leaked)."""
    stats = stack.scheduler_stats()
    client = redis.Redis.from_url(stack.redis_url)
    try:
        key = f"sluice:{{{stack.config.namespace}:completions}}"
        pending = {_text(g["name"]): int(g["pending"]) for g in client.xinfo_groups(key)}
    except redis.ResponseError:  # no such key: nothing completed since Redis last restarted
        pending = {}
    finally:
        client.close()
    budgets = _admission_budgets(stack)
    return {"admission_reserved": {k: v for k, v in budgets.items() if v},
            "scheduler_requests": sum(s.running + s.waiting for s in stats),
            "kv_blocks_used": sum(s.kv_blocks_used for s in stats),
            "kv_blocks_held": sum(s.kv_blocks_held for s in stats),
            "host_blocks_beyond_tier": sum(s.host_blocks_used - s.host_blocks_cached for s in stats),
            "redis_pending": {g: n for g, n in pending.items() if n}}


def _nothing_held(leaks: dict[str, Any]) -> bool:
    return "unreadable" not in leaks and not leaks["admission_reserved"] and not leaks["scheduler_requests"] \
        and not leaks["kv_blocks_used"] and not leaks["kv_blocks_held"] and not leaks["host_blocks_beyond_tier"] \
        and not leaks["redis_pending"]


def _scheduler_scraper(stack: Stack) -> Scraper:
    """A reader of every scheduler's hand-off and host-hit counters (by label set), the restarted ones' new endpoints
    included."""
    return Scraper(lambda: [p.metrics_url for p in stack.schedulers], (*HANDOFF_COUNTERS, HOST_HITS), by_series=True)


def _handoffs(counts: Counter[str]) -> dict[str, dict[str, int]]:
    """Return the hand-off counts of the report: transfers by outcome, holds ended by reason."""
    out: dict[str, dict[str, int]] = {"transfers": {}, "holds_ended": {}}
    for series, value in sorted(counts.items()):
        name, _, labels = series.partition("{")
        section = "transfers" if name == "sluice_kv_transfers_total" else "holds_ended"
        label = labels.rstrip("}").partition("=")[2].strip('"')
        if value:
            out[section][label] = int(value)
    return out


def _settled_leaks(stack: Stack, settle_s: float) -> dict[str, Any]:
    """Return `_leaks` once nothing is held, or as it is after `settle_s` (a process restarted by the last fault
    may not answer yet: then it is read again)."""
    give_up = time.monotonic() + settle_s
    while True:
        try:
            leaks = _leaks(stack)
        except (grpc.RpcError, redis.RedisError, OSError) as exc:
            leaks = {"unreadable": str(exc)[:300]}
        if _nothing_held(leaks) or time.monotonic() > give_up:
            return leaks
        time.sleep(1.0)


def _scrape_loop(scraper: Scraper, interval_s: float, stop: threading.Event, counts: Counter[str]) -> None:
    """Add the counters' growth to `counts` every `interval_s` until `stop`, and once more after it."""
    while not stop.wait(interval_s):
        counts.update(scraper.delta())
    counts.update(scraper.delta())


def _run_dir(config: ChaosConfig, parent: Path = Path("out")) -> Path:
    """Return the run's directory, made: `config.run_dir`, else a fresh one under `parent` (two runs started in the
    same second shared `out/chaos-<seconds>`, and the second one's embedded Redis, in the same place, never
    answered). Absolute: the embedded Redis moves to a directory of its own before it reads its ACL file by this
    path (`make chaos`, with a relative one, ended at once: "redis-server exited with code 1")."""
    if config.run_dir:
        run_dir = Path(config.run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"chaos-{int(time.time())}-", dir=parent)).resolve()


def run(config: ChaosConfig) -> dict[str, Any]:
    """Run the chaos load and faults, check the invariants; return the report (see the module docstring)."""
    run_dir = _run_dir(config)
    tenants = run_dir / "tenants.toml"
    tenants.write_text(TENANTS)
    events: list[str] = []
    faults = config.faults or faults_for(config.disagg)
    scheduler_counts: Counter[str] = Counter()
    with Stack(stack_config(config, run_dir, tenants)) as stack:
        # Never given up on: chaos tests the data path under faults, not the supervisor's crash-loop limit (a
        # process faulted 5 times within 30 s of its restarts would be given up on and the stack would stop).
        stack.fleet.supervisor = Supervisor(stack, RestartPolicy(max_backoff_s=2.0, max_restarts=1_000_000),
                                            on_event=events.append)
        stack.fleet.start_supervising(0.1)
        rss_start, tally, stop, scraped = _rss_kb(stack), Tally(), threading.Event(), threading.Event()
        rss_samples: list[dict[str, Any]] = []
        sampler = threading.Thread(target=_rss_loop, args=(stack, config.rss_interval_s, scraped, time.monotonic(),
                                                           rss_samples), daemon=True)
        sampler.start()
        scraper = threading.Thread(target=_scrape_loop, args=(_scheduler_scraper(stack), config.scrape_interval_s,
                                                              scraped, scheduler_counts), daemon=True)
        scraper.start()
        clients = [threading.Thread(target=_client_loop, args=(stack.endpoint, config.seed * 1000 + i, config,
                                                               stop, tally), daemon=True)
                   for i in range(config.clients)]
        if config.http_clients:
            decode = load_model_spec(resolve_model("tiny"), "tiny").tokenizer.decode  # admission's (Stack)
            clients += [threading.Thread(target=_http_client_loop, args=(
                stack.http_base_url, config.seed * 1000 + 500 + i, config, decode, lambda: _admission_pid(stack),
                stop, tally), daemon=True) for i in range(config.http_clients)]
        for thread in clients:
            thread.start()
        rng, started = random.Random(config.seed), time.monotonic()
        while time.monotonic() - started < config.duration_s:
            time.sleep(config.fault_interval_s)
            fault = rng.choice(faults)
            tally.faults.append(_inject(stack, fault, rng, config.stall_s))
            tally.fault_kinds[fault] += 1
        stop.set()
        for thread in clients:
            thread.join(config.request_timeout_s + 30)
        hung_clients = sum(thread.is_alive() for thread in clients)
        leaks = _settled_leaks(stack, config.settle_s)
        scraped.set()
        scraper.join(30)
        sampler.join(30)
        rss_end = _rss_kb(stack)
        restarts = stack.fleet.supervisor.restart_counts()
    host_hit_tokens = int(scheduler_counts.pop(HOST_HITS, 0))
    outcomes = tally.outcomes
    offered = sum(outcomes.values())
    return {
        "duration_s": config.duration_s, "disagg": _split_text(config.disagg),
        "faults_injected": len(tally.faults), "fault_kinds": dict(tally.fault_kinds),
        "offered": offered, "exact": outcomes["exact"], "cancelled_by_client": outcomes["cancelled"],
        "failed_explicitly": {k.removeprefix("failed:"): v for k, v in outcomes.items() if k.startswith("failed:")},
        "hung": outcomes["hung"] + hung_clients, "wrong_tokens": outcomes["wrong"], "examples": tally.wrong,
        "failure_examples": tally.failure_examples, "handoffs": _handoffs(scheduler_counts),
        "http_outcomes": dict(tally.http_outcomes),
        "host_tier": config.host_tier, "host_hit_tokens": host_hit_tokens,
        "publish_interval_ms": config.publish_interval_ms, "stream_interval": config.stream_interval,
        "leaks": leaks, "restarts": restarts,
        "supervisor_problems": [e for e in events if "given up" in e or "could not be restarted" in e],
        "rss_kb_start": rss_start, "rss_kb_end": rss_end,
        "rss_kb_samples": [{k: (v[1] if k != "t" else v) for k, v in sample.items()} for sample in rss_samples],
        "rss_growth_kb_per_min": rss_growth_kb_per_min(rss_samples),
        "ok": outcomes["hung"] + hung_clients + outcomes["wrong"] == 0 and _nothing_held(leaks),
        "config": {k: v for k, v in asdict(config).items() if k != "run_dir"}, "run_dir": str(run_dir),
    }


def _split_text(disagg: tuple[int, int] | None) -> str | None:
    return None if disagg is None else f"{disagg[0]}:{disagg[1]}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run, print the JSON report (and write it with --json); exit 1 when an invariant failed."""
    parser = argparse.ArgumentParser(prog="python -m sluice_tools.chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=ChaosConfig.duration_s)
    parser.add_argument("--fault-interval-s", type=float, default=ChaosConfig.fault_interval_s)
    parser.add_argument("--clients", type=int, default=ChaosConfig.clients)
    parser.add_argument("--http-clients", type=int, default=ChaosConfig.http_clients,
                        help="more client threads over the OpenAI HTTP API (streamed, text checked exactly)")
    parser.add_argument("--seed", type=int, default=ChaosConfig.seed)
    parser.add_argument("--disagg", default=None, metavar="P:D",
                        help="a disaggregated stack of P prefill and D decode replicas (docs/disaggregation.md)")
    parser.add_argument("--faults", default=None, metavar="F,F,...",
                        help="draw only these faults (default: every one of the stack's kind: "
                             f"{','.join(FAULTS)}; with --disagg: {','.join(DISAGG_FAULTS)})")
    parser.add_argument("--host-tier", action="store_true",
                        help="every replica with a host prefix tier, and prompts that come back to it")
    parser.add_argument("--publish-interval-ms", type=float, default=0.0, metavar="MS",
                        help="the schedulers' --publish-interval-ms (their rounds' tokens wait up to MS and go out merged)")
    parser.add_argument("--stream-interval", type=int, default=1, metavar="N",
                        help="admission's --stream-interval (a stream's tokens held N at a time after its first)")
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--json", default=None, help="also write the report to this file")
    args = parser.parse_args(argv)
    if not 0 <= args.publish_interval_ms < math.inf:
        parser.error(f"--publish-interval-ms must be a finite number >= 0, got {args.publish_interval_ms}")
    if args.stream_interval < 1:
        parser.error(f"--stream-interval must be at least 1, got {args.stream_interval}")
    if args.clients < 0 or args.http_clients < 0 or args.clients + args.http_clients == 0:
        parser.error(f"--clients {args.clients} --http-clients {args.http_clients}: each must be >= 0, and one > 0")
    from sluice_tools.sim.disagg import parse_split  # the one P:D parser (`sluice up`, `sluice sim`)

    try:
        disagg = parse_split(args.disagg) if args.disagg is not None else None
    except ValueError as exc:
        parser.error(str(exc))
    faults = None
    if args.faults is not None:
        known = faults_for(disagg)
        faults = tuple(f.strip() for f in args.faults.split(",") if f.strip())
        unknown = [f for f in faults if f not in known]
        if unknown or not faults:
            parser.error(f"--faults {args.faults!r}: {', '.join(unknown) or 'none given'} not one of "
                         f"{', '.join(known)}")
    report = run(ChaosConfig(duration_s=args.duration_s, fault_interval_s=args.fault_interval_s,
                             clients=args.clients, http_clients=args.http_clients, seed=args.seed, disagg=disagg,
                             faults=faults,
                             host_tier=args.host_tier, publish_interval_ms=args.publish_interval_ms,
                             stream_interval=args.stream_interval, run_dir=args.run_dir))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
