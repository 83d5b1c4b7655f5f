"""End to end through the command line: `sluice up`, `sluice generate`, then Ctrl-C."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sluice.redis_server import free_port
from tests.processes import children, read_until, wait_gone

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]


def _sluice(*args: str) -> list[str]:
    return [sys.executable, "-m", "sluice_tools.cli", *args]


def test_up_generate_and_ctrl_c(tmp_path: Path) -> None:
    """`sluice up` prints its endpoints and key, `sluice generate` and the printed curl line work through it, and SIGINT
    stops every process."""
    port, http_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    up = subprocess.Popen(_sluice("up", "--backend", "costmodel", "--model", "llama-3-8b", "--port", str(port),
                                  "--http-port", str(http_port), "--run-dir", str(tmp_path)),
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = read_until(up, "Ctrl-C to stop", 90)
        banner = "".join(lines)
        assert f"endpoint: 127.0.0.1:{port}" in banner and "sk-sluice-local" in banner, banner
        # Every service's Prometheus endpoint, on the free port it bound (--metrics on by default).
        assert banner.count("metrics http://127.0.0.1:") == 4, banner
        suggested = next(line for line in lines if line.startswith("Try: "))
        tried = subprocess.run(shlex.split(suggested.removeprefix("Try: ")), cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=60)
        assert tried.returncode == 0 and "finished" in tried.stderr, (suggested, tried.stderr)
        assert f"OpenAI:   http://127.0.0.1:{http_port}/v1" in banner, banner
        curl = next(line for line in lines if line.startswith("Or:  curl "))
        answered = subprocess.run(shlex.split(curl.removeprefix("Or:  ")), capture_output=True, text=True, timeout=60)
        completion = json.loads(answered.stdout)
        assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] == 16, completion
        done = subprocess.run(_sluice("generate", "hello", "--max-tokens", "5", "--target", f"127.0.0.1:{port}",
                                      "--ids"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert len(done.stdout.split()) == 5 and "5 output tokens" in done.stderr
        bad = subprocess.run(_sluice("generate", "hello", "--max-tokens", "0", "--target", f"127.0.0.1:{port}"),
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    finally:
        up.send_signal(signal.SIGINT)
        output, _ = up.communicate(timeout=60)
    assert up.returncode == 0, output
    assert "stopped." in output
    leftover = subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_up_refuses_a_taken_port_before_starting_anything(flag: str) -> None:
    """`sluice up --port P` (or `--http-port P`) with P already listening exits 2 at once, naming the port and
    suggesting `FLAG 0`."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--port": str(free_port()), "--http-port": str(free_port()), flag: str(port)}
        done = subprocess.run(_sluice("up", *[a for item in ports.items() for a in item]), cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"127.0.0.1:{port}" in done.stderr and f"{flag} 0" in done.stderr, done.stderr


def test_ctrl_c_while_starting_stops_what_started(tmp_path: Path) -> None:
    """SIGINT during `sluice up`'s start exits 130 at once, and every process started so far is gone."""
    up = subprocess.Popen(_sluice("up", "--port", "0", "--http-port", "0", "--run-dir", str(tmp_path)), cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not children(up.pid):
        time.sleep(0.05)
    started = children(up.pid)
    assert started, "sluice up started no process"
    up.send_signal(signal.SIGINT)
    output, _ = up.communicate(timeout=60)
    assert up.returncode == 130 and "interrupted while starting" in output, output
    assert wait_gone(started, 10.0) == []


def test_up_passes_scheduler_and_worker_flags_through(tmp_path: Path) -> None:
    """`--worker-arg` and `--scheduler-arg` reach every worker and scheduler: with host blocks on the worker and the
    host prefix tier on the scheduler, the scheduler logs the tier's size and requests are served; SIGINT stops it."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    up = subprocess.Popen(_sluice("up", "--backend", "costmodel", "--model", "llama-3-8b", "--port", str(port),
                                  "--http-port", "0", "--run-dir", str(tmp_path), "--worker-arg=--host-blocks",
                                  "--worker-arg=64", "--scheduler-arg=--host-prefix-cache"),
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        read_until(up, "Ctrl-C to stop", 90)
        assert "host prefix tier: 64 host blocks" in (tmp_path / "scheduler-0.log").read_text()
        done = subprocess.run(_sluice("generate", "hello", "--max-tokens", "5", "--target", f"127.0.0.1:{port}",
                                      "--ids"), cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and len(done.stdout.split()) == 5, done.stderr
    finally:
        up.send_signal(signal.SIGINT)
        output, _ = up.communicate(timeout=60)
    assert up.returncode == 0, output
