"""The parts of a one-machine deployment (sluice_tools.stack): what to start, one service process, one replica.

`StackConfig` says what `Stack` starts; `Proc` is one service process (its log, address, metrics URL and
environment); `Replica` a worker + scheduler pair; `health_serving` and `terminate` are the probes and the
stop every supervisor of these processes uses.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.serve import METRICS_LINE
from sluice.tls import TlsFiles, sync_channel

REPO_ROOT = Path(__file__).resolve().parent.parent

__all__ = ["REPO_ROOT", "Proc", "Replica", "StackConfig", "StackError", "health_serving", "proc_serving",
           "replica_role", "terminate"]


class StackError(RuntimeError):
    """A process of the stack failed to start or to become ready; the message has its log tail."""


@dataclass(frozen=True)
class StackConfig:
    """What to start."""

    replicas: int = 1
    """Worker + scheduler pairs (with `disagg`, its P + D)."""
    disagg: tuple[int, int] | None = None
    """Prefill/decode disaggregation (docs/disaggregation.md): P replicas register role prefill (the first P) and D
    role decode; None: every replica is aggregated (role both)."""
    backend: str = "torch"
    """Worker backend: "torch" or "costmodel"."""
    model: str = "tiny"
    """Preset name or model directory (torch); model shape (costmodel)."""
    redis_url: str | None = None
    """An existing Redis; None starts the embedded one."""
    config_file: str | None = None
    """Admission config (API keys, budgets); None = the default tenant and key."""
    admission_port: int = 0
    """Port of the public endpoint; 0 picks a free one."""
    admission_procs: int = 1
    """Admission processes serving that port (and the HTTP port) together, SO_REUSEPORT, sharing the caps in Redis
    (`--share-budgets`: admission_svc/shares.py)."""
    http_port: int | None = None
    """Port of admission's OpenAI-compatible HTTP API; 0 picks a free one; None serves none."""
    host: str = "127.0.0.1"
    run_dir: Path | None = None
    """Where logs go; None makes a fresh temporary directory."""
    namespace: str = field(default_factory=lambda: "s" + uuid.uuid4().hex[:10])
    """Bus namespace (unique per stack so stacks sharing one Redis never mix)."""
    num_blocks: int | None = None
    """KV blocks per worker (None: the backend's default)."""
    scheduler_args: tuple[str, ...] = ()
    """Extra flags for every scheduler (policy, budgets...)."""
    worker_args: tuple[str, ...] = ()
    """Extra flags for every Sluice worker (e.g. `--host-blocks 256`)."""
    router_args: tuple[str, ...] = ()
    """Extra flags for the router (e.g. `--policy round_robin`)."""
    admission_args: tuple[str, ...] = ()
    """Extra flags for admission (e.g. `--http-header-timeout-s 1`)."""
    emulate_time: bool = False
    """Cost model: make rounds take their modelled time."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment for every service (e.g. SLUICE_TRACE_FILE)."""
    start_timeout_s: float = 120.0
    drain_timeout_s: float = 10.0
    log_level: str = "INFO"
    metrics: bool = True
    """Every service serves Prometheus metrics on a free port (`Proc.metrics_url` says which)."""
    mtls: bool = False
    """Internal calls over mutual TLS, each RPC admitting only its callers' roles (a fresh local CA in
    run_dir/tls; the stack's own checks use the `operator` certificate)."""
    public_tls: bool = False
    """Admission's public endpoint over TLS too (needs mtls; clients trust `Stack.tls_ca`)."""
    redis_acl: bool = True
    """Embedded Redis: one ACL user per role (sluice.redis_acl), each service its own URL; off: one shared password."""
    engine: str = "sluice"
    """What a replica runs: "sluice" (a worker of `backend`) or "vllm" (an unmodified vLLM server, started from
    vLLM's venv, with a Sluice agent as its scheduler: scheduler_svc/engines/vllm)."""
    engine_args: tuple[str, ...] = ()
    """Extra flags for every vLLM server (engine "vllm")."""
    vllm_scheduling_policy: str = "fcfs"
    """vLLM's own --scheduling-policy (engine "vllm"): fcfs or priority (then priorities pass through)."""
    vllm_scheduler_cls: str = ""
    """vLLM's --scheduler-cls (engine "vllm"), e.g. scheduler_svc.engines.vllm.sched_cls.SluiceScheduler."""


def replica_role(config: StackConfig, index: int) -> str:
    """Return the scheduler's --role of replica number `index`: both, or prefill for the first P of a P:D split and
    decode for the rest."""
    if config.disagg is None:
        return "both"
    return "prefill" if index < config.disagg[0] else "decode"


@dataclass
class Proc:
    """One service process."""

    name: str
    args: list[str]
    log_path: Path
    address: str = ""
    popen: subprocess.Popen[bytes] | None = None
    metrics_url: str = ""
    """Its Prometheus endpoint, read from its log once it serves ("" without metrics, and from each launch
    until the new incarnation prints its own: under --metrics-port 0 a restart binds another port)."""
    env: dict[str, str] = field(default_factory=dict)
    """Its whole environment (secrets included: never printed)."""
    replica_id: str = ""
    """The replica it belongs to (workers and schedulers); "" for the others."""
    log_start: int = 0
    """Size of its log when the running incarnation was launched (what that one printed starts there)."""
    http_health: str = ""
    """A URL whose 200 says it serves (a vLLM engine's /health); "": it answers gRPC health at `address`."""
    launched_at: float = 0.0
    """time.monotonic() of the running incarnation's launch."""
    ready_after_s: float | None = None
    """Seconds from that launch until it first served (None: not yet): a measured warm-up, for the planner."""

    def mark_serving(self) -> None:
        """Record the running incarnation's time to serve, once."""
        if self.ready_after_s is None:
            self.ready_after_s = time.monotonic() - self.launched_at

    def launch(self) -> None:
        """Start (or start again) the process, appending to its log, in a new session.

        Before a restart, what is left of the previous incarnation's session is killed: a vLLM server's engine
        core outlives a kill -9 of its API server and would keep its ports."""
        self.reap_session()
        self.log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.launched_at, self.ready_after_s = time.monotonic(), None
        self.metrics_url = ""  # the previous incarnation's endpoint is gone with it
        with self.log_path.open("ab") as log:
            # A new session: a Ctrl-C in the terminal reaches only `sluice up`, which stops children in order.
            self.popen = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=self.env, cwd=str(REPO_ROOT), start_new_session=True)

    def reap_session(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every process left in the previous incarnation's session (its own process group) and wait
        until they are gone; nothing when there was none."""
        if self.popen is None:
            return
        group = self.popen.pid  # start_new_session: the group id is the leader's pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(group, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)

    def log_tail(self, limit: int = 3000) -> str:
        """Return the end of the process's log."""
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-limit:]
        return "(no log)"

    def alive(self) -> bool:
        """True while the process runs."""
        return self.popen is not None and self.popen.poll() is None

    def printed_metrics_url(self) -> str:
        """Return the metrics URL the running incarnation printed (sluice.serve METRICS_LINE); "" until it has."""
        with contextlib.suppress(OSError), self.log_path.open("rb") as log:
            log.seek(self.log_start)
            for line in reversed(log.read().decode(errors="replace").splitlines()):
                if line.startswith(METRICS_LINE):
                    return line[len(METRICS_LINE):].strip()
        return ""


@dataclass
class Replica:
    """One worker + scheduler pair (or vLLM engine + agent); the scheduler is started once its worker serves."""

    replica_id: str
    worker: Proc
    scheduler: Proc | None = None
    engine: Any = None
    """The VllmEngineSpec of a vLLM replica (sluice_tools.vllm_engine); None for a Sluice worker."""
    retiring: bool = False
    """Being drained and stopped (a scale-down): not restarted, not counted."""
    role: str = "both"
    """Its scheduler's --role: both, or prefill / decode in a disaggregated stack (its pool)."""



def health_serving(address: str, service: str = "", timeout_s: float = 1.0, files: TlsFiles | None = None) -> bool:
    """Return True when the gRPC health service at `address` reports SERVING (over TLS with `files`)."""
    with sync_channel(address, files) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def proc_serving(proc: Proc, timeout_s: float = 1.0, files: TlsFiles | None = None) -> bool:
    """Return True when `proc` serves: its HTTP health URL answers 200, or its gRPC health reports SERVING."""
    if proc.http_health:
        try:
            with urllib.request.urlopen(proc.http_health, timeout=timeout_s) as reply:  # noqa: S310 (loopback URL)
                return bool(reply.status == 200)
        except (OSError, ValueError):
            return False
    return health_serving(proc.address, timeout_s=timeout_s, files=files)


def terminate(proc: Proc, timeout_s: float) -> None:
    """SIGTERM `proc` and wait `timeout_s` for it; SIGKILL it after that, and whatever it left in its session."""
    if proc.popen is None:
        return
    if proc.alive():
        proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait(timeout=5)
    if proc.http_health:  # an engine: its children (vLLM's engine core) must not outlive it
        proc.reap_session(timeout_s=5.0)
