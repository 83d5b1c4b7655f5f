"""No orphans: when a supervisor is SIGKILLed, every process it started (Redis, the services) exits too."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sluice.redis_server import free_port
from tests.processes import children, command_line, wait_gone

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")]
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_embedded_redis_dies_with_a_sigkilled_parent() -> None:
    """The redis-server an EmbeddedRedis starts exits when the process that started it is SIGKILLed."""
    script = textwrap.dedent("""
        import time
        from sluice.redis_server import EmbeddedRedis
        server = EmbeddedRedis()
        print(server.start(), flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    assert parent.stdout.readline().startswith("redis://")
    redis = [pid for pid in children(parent.pid) if "redis-server" in command_line(pid)]
    assert len(redis) == 1
    parent.kill()
    parent.wait(10)
    left = wait_gone(redis, 10.0)
    _kill_leftovers(left)
    assert left == [], f"redis-server outlived its parent: {[command_line(p) for p in left]}"


def test_every_child_of_a_sigkilled_sluice_up_exits(tmp_path: Path) -> None:
    """After `sluice up` is SIGKILLed, its Redis, router, worker, scheduler and admission processes all exit."""
    up = subprocess.Popen([sys.executable, "-m", "sluice_tools.cli", "up", "--backend", "costmodel", "--model", "llama-3-8b",
                           "--port", str(free_port()), "--http-port", "0", "--run-dir", str(tmp_path)],
                          cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert up.stdout is not None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and "Ctrl-C to stop" not in (line := up.stdout.readline()) and line:
        pass
    started = children(up.pid)
    names = " ".join(command_line(pid) for pid in started)
    assert len(started) == 5, names  # redis, router, worker, scheduler, admission
    assert all(part in names for part in ("redis-server", "router_svc", "worker_svc", "scheduler_svc",
                                          "admission_svc")), names
    up.kill()
    up.wait(10)
    left = wait_gone(started, 30.0)
    _kill_leftovers(left)
    assert left == [], f"outlived `sluice up`: {[command_line(p) for p in left]}"


def test_a_sigtermed_sluice_bench_stops_its_spawned_stack_before_it_exits(tmp_path: Path) -> None:
    """SIGTERM to `sluice bench --spawn` mid-run stops the stack it spawned, as Ctrl-C does, before the command exits
    (exit 130): nothing of it is left running. Before, SIGTERM ended the command at once and its services, told by
    their lifelines, were still draining after it had gone."""
    bench = subprocess.Popen([sys.executable, "-m", "sluice_tools.cli", "bench",
                              "synthetic:poisson?rate=20&n=4000&input=fixed:32&output=fixed:200", "--spawn",
                              "--backend", "costmodel", "--model", "llama-3-8b", "--emulate-time"],
                             cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert bench.stderr is not None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and "[bench]" not in (line := bench.stderr.readline()) and line:
        pass
    time.sleep(2.0)  # requests in flight, their tokens on the way
    started = children(bench.pid)
    assert len(started) == 5, " ".join(command_line(pid) for pid in started)
    bench.send_signal(signal.SIGTERM)
    try:
        code = bench.wait(60)
    finally:
        bench.kill()
    left = [pid for pid in started if Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)]
    _kill_leftovers(left)
    assert (code, left) == (130, []), f"exit {code}; still running: {[command_line(p) for p in left]}"


def _state(pid: int) -> str:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.lower()
    return "gone"
