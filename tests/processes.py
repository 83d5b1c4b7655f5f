"""Helpers for tests that look at real processes: /proc (Linux) and their metrics endpoints."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _stat_fields(pid: int) -> list[str] | None:
    """Return the fields of /proc/<pid>/stat after the command name, or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # the name may contain spaces and parentheses


def children(pid: int) -> list[int]:
    """Return the pids whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (an exited child its new parent has not reaped yet)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until none of `pids` runs; return those still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if running(p)]
    return left


def command_line(pid: int) -> str:
    """Return the command line of `pid` with spaces between arguments ("" when it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def wait_until(condition: Callable[[], object], timeout_s: float, poll_s: float = 0.05) -> bool:
    """Return True as soon as `condition()` is true, polling every `poll_s`; after `timeout_s`, whether it is then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return bool(condition())


def stop_process(process: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM `process` if it still runs, then SIGKILL after `grace_s`; reaped either way."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def scraped_metrics(url: str) -> dict[str, float]:
    """Every sample of a Prometheus text exposition at `url`, by its series (name and labels as printed)."""
    with urllib.request.urlopen(url, timeout=5) as reply:  # noqa: S310 (loopback URL from the stack)
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def read_until(process: subprocess.Popen[str], marker: str, timeout_s: float) -> list[str]:
    """Read `process`'s stdout a line at a time until a line holds `marker`, the output ends, or `timeout_s` passes
    (checked between lines); return the lines read, the marker's line included."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.stdout is not None:
        line = process.stdout.readline()
        lines.append(line)
        if marker in line or not line:
            break
    return lines


async def serve_on_loopback(app: Any) -> tuple[Any, str]:
    """Serve the aiohttp `app` on a free loopback port; return its runner (`await runner.cleanup()` stops it) and
    its base URL."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # noqa: SLF001 (aiohttp's bound port)
    return runner, f"http://127.0.0.1:{port}"

