"""The common service life (sluice.serve), seen from outside a real service process: exit codes, signals, gc.freeze."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from sluice.redis_server import free_port
from sluice.serve import ServiceOptions, load_options, options_parser

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]


def _service(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("SLUICE_REDIS_URL", None)
    return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _read_until(proc: subprocess.Popen[str], text: str, timeout_s: float = 30.0) -> str:
    """Return the output up to the first line containing `text` (all of it if the process ends first)."""
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen.append(line)
        if text in line or not line:
            break
    return "".join(seen)


def _wait_catching_sigterm(pid: int, timeout_s: float = 30.0) -> bool:
    """Wait until the process catches SIGTERM (its handler is installed); return False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
        if caught & (1 << (signal.SIGTERM - 1)):
            return True
        time.sleep(0.05)
    return False


def test_options_and_parser_must_agree() -> None:
    """load_options builds the frozen options from the flags, and refuses a parser with a flag the options lack."""

    @dataclass(frozen=True, kw_only=True)
    class Options(ServiceOptions):
        name: str = "x"
        """A name."""

    parser = options_parser(Options)
    options = load_options(Options, parser, ["--name", "y", "--port", "0"])
    assert options == Options(name="y", port=0, host="127.0.0.1")
    with pytest.raises(Exception, match="frozen|cannot assign"):
        options.name = "z"  # type: ignore[misc]
    parser.add_argument("--extra", default=1)
    with pytest.raises(TypeError, match="extra"):
        load_options(Options, parser, [])


@pytest.mark.parametrize("flags, message", [
    ((), "no Redis: pass --redis-url"),
    (("--redis-url", "redis://127.0.0.1:1/0", "--policy", "bogus"), "unknown routing policy 'bogus'"),
])
def test_configuration_errors_exit_2_with_the_reason(flags: tuple[str, ...], message: str) -> None:
    """A service started with a bad configuration exits 2 and its log says what to change."""
    proc = _service("router_svc", "--port", "0", *flags)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and message in output, output


def test_a_config_file_typo_exits_2_naming_the_key(tmp_path: Path) -> None:
    """Admission started with a misspelt budget in its config file exits 2 with one line naming the key, no traceback."""
    config = tmp_path / "sluice.toml"
    config.write_text("[budgets]\nmax_activ_requests = 8\n")
    proc = _service("admission_svc", "--port", "0", "--config", str(config), "--redis-url", "redis://127.0.0.1:1/0")
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "unknown key 'budgets.max_activ_requests'" in output, output
    assert "Traceback" not in output, output


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status")
def test_sigterm_during_a_slow_start_exits_0_at_once() -> None:
    """A scheduler still waiting for its worker stops promptly on SIGTERM instead of finishing its start first."""
    proc = _service("scheduler_svc", "--port", "0", "--replica-id", "r0", "--worker", f"127.0.0.1:{free_port()}",
                    "--redis-url", "redis://127.0.0.1:1/0")
    assert _wait_catching_sigterm(proc.pid), "the service never installed its SIGTERM handler"
    time.sleep(0.5)  # into the wait for the worker, which never comes
    assert proc.poll() is None
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert time.monotonic() - began < 10 and "listening" not in output


def test_service_serves_frozen_then_drains_on_sigterm(redis_url: str) -> None:
    """A router prints its address, freezes its start-up heap out of the collector, and exits 0 after SIGTERM."""
    proc = _service("router_svc", "--port", "0", "--redis-url", redis_url, "--namespace", "serve-test")
    try:
        output = _read_until(proc, "frozen out of the garbage collector")
        assert "router listening on 127.0.0.1:" in output and "frozen out of the garbage collector" in output, output
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, rest
    assert "router stopping" in rest
