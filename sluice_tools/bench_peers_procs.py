"""Processes of `make bench-peers`: starting and stopping them, their CPU time and the engines' counters.

vLLM engines are started by `sluice_tools.vllm_engine` (the one way the repo starts vLLM), with
`--enable-scale-out` added: vllm-router's cache_aware tokenizes through /v1/completions/render.

Everything binds to 127.0.0.1. Each process is started in a session of its own (`start_new_session`) so that
`stop()` ends it and every child (vLLM's engine core and worker) by process group, and nothing else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sluice_tools.scrape import read_samples

TICK = os.sysconf("SC_CLK_TCK")
ENGINE_COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
)


@dataclass
class Proc:
    """A started process (and its session) with its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    url: str = ""

    def stop(self, grace_s: float = 10.0) -> None:
        """End the process's group: SIGTERM, then SIGKILL after `grace_s`."""
        if self.popen.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)
        except ProcessLookupError:
            pass


def spawn(name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None, url: str = "") -> Proc:
    """Start `argv` in a new session, stdout+stderr to LOG_DIR/NAME.log; return the Proc."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                 start_new_session=True)
    return Proc(name, popen, log, url)


def wait_http(proc: Proc, path: str, timeout_s: float) -> None:
    """Wait until GET proc.url+path answers 200; raises RuntimeError (with the log's tail) if the process
    exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}); log tail:\n{_tail(proc.log)}")
        try:
            with urllib.request.urlopen(proc.url + path, timeout=2) as reply:  # noqa: S310 (loopback)
                if reply.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{proc.name} not ready at {proc.url}{path} after {timeout_s:g} s; log tail:\n{_tail(proc.log)}")


def _tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def post(url: str, timeout_s: float = 10.0) -> int:
    """POST an empty body to `url`; return the HTTP status (0 when unreachable)."""
    request = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:  # noqa: S310 (loopback)
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def get_ok(url: str, timeout_s: float = 5.0) -> bool:
    """Return True when GET `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 (loopback)
            return int(reply.status) == 200
    except OSError:
        return False


def reset_prefix_caches(engine_urls: Sequence[str]) -> None:
    """Empty every engine's prefix cache; raises RuntimeError naming an engine that refuses."""
    for url in engine_urls:
        status = post(f"{url}/reset_prefix_cache")
        if status != 200:
            raise RuntimeError(f"POST {url}/reset_prefix_cache answered {status} (VLLM_SERVER_DEV_MODE=1 set?)")


def wait_idle(engine_urls: Sequence[str], timeout_s: float = 60.0) -> None:
    """Wait until no engine runs or queues a request (a run's stragglers must not leak into the next)."""
    deadline = time.monotonic() + timeout_s
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    while time.monotonic() < deadline:
        if all(sum(read_samples(f"{u}/metrics", names).values()) == 0 for u in engine_urls):
            return
        time.sleep(0.5)


def engine_counters(engine_urls: Sequence[str]) -> list[dict[str, float]]:
    """Return each engine's ENGINE_COUNTERS (summed over label sets)."""
    return [read_samples(f"{u}/metrics", ENGINE_COUNTERS, timeout_s=5.0) for u in engine_urls]


def counter_deltas(before: list[dict[str, float]], after: list[dict[str, float]]) -> list[dict[str, float]]:
    """Return after - before per engine and counter."""
    return [{k: a.get(k, 0.0) - b.get(k, 0.0) for k in ENGINE_COUNTERS} for b, a in zip(before, after, strict=True)]


def _children() -> dict[int, list[int]]:
    """Return ppid -> pids of every process visible in /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat_fields(int(entry))
            if stat:
                tree.setdefault(int(stat[1]), []).append(int(entry))
    return tree


def descendants(root: int) -> list[int]:
    """Return the pids of every process below `root` (its children, theirs, and so on), read from /proc."""
    tree, out = _children(), []
    todo = list(tree.get(root, []))
    while todo:
        out.append(todo.pop())
        todo.extend(tree.get(out[-1], []))
    return out


def _stat_fields(pid: int) -> list[str]:
    """Fields of /proc/PID/stat after the command name (state is [0], ppid [1]); [] when gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return []


@dataclass
class CpuMeter:
    """utime+stime of some processes and all their descendants, between `start()` and `stop()`."""

    roots: Sequence[int]
    seen: dict[int, float] = field(default_factory=dict)

    def _read(self) -> dict[int, float]:
        tree, out, todo = _children(), {}, list(self.roots)
        while todo:
            pid = todo.pop()
            fields = _stat_fields(pid)
            if fields:
                out[pid] = (int(fields[11]) + int(fields[12])) / TICK
                todo.extend(tree.get(pid, []))
        return out

    def start(self) -> None:
        """Take the first reading."""
        self.seen = self._read()

    def stop(self) -> float:
        """Return CPU seconds used since start() (a process born in between counts from zero)."""
        now = self._read()
        return sum(cpu - self.seen.get(pid, 0.0) for pid, cpu in now.items())
