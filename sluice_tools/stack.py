"""A process supervisor for a whole Sluice deployment on one machine.

Used by `sluice up`, `sluice bench --spawn`, `make demo` and the end-to-end tests. Start order:
Redis (embedded unless a URL is given) -> router -> one worker per replica -> one scheduler per
replica -> admission. Each service is its own process (`python -m <service>`), logging to
`<run_dir>/<name>.log`. `start()` returns once every process reports gRPC health SERVING and the
router lists every replica READY; a process that dies during start-up fails it with the tail of its log.
Every child dies with the supervisor, even a SIGKILLed one (`sluice.lifeline`).

The embedded Redis gets a random password (so other local users cannot read or write the bus) and, by
default (`redis_acl`), one ACL user per role (sluice.redis_acl: a scheduler may only XADD, the router
only consume KV events and completions, admission only its own token stream and completions). Each
service's Redis URL, its own user and password included, reaches it (router, schedulers, admission) in
$SLUICE_REDIS_URL, never on a command line (readable by every local user in /proc); workers do not get
it. `describe()` prints it redacted.

Shutdown is graceful: every replica is drained at the router (no new routes; new requests get
UNAVAILABLE), in-flight requests get up to `drain_timeout_s` to finish while their clients keep
streaming, then admission stops, then schedulers (which cancel whatever is left), workers and the
router get SIGTERM (SIGKILL after a timeout), Redis last.

Supervision and replica changes belong to its collaborator `stack.fleet` (sluice_tools/stack_fleet.py:
`supervise()` one pass, or `start_supervising()` in a thread; sluice_tools/supervisor.py): a process
that dies is restarted on the same address with exponential backoff, the embedded Redis on the same
port with the same password. Replicas can be added and retired while the stack runs (`fleet.add_replica`,
`fleet.retire_replica`: what `sluice up --autoscale` does, sluice_tools/autoscale.py). What to start
(`StackConfig`), one process (`Proc`) and one replica (`Replica`) are in sluice_tools/stack_parts.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import grpc

from scheduler_svc.core.config import SchedulerConfig
from sluice.bus import redact_url
from sluice.config import DEFAULT_API_KEY
from sluice.lifeline import lifeline_command
from sluice.redis_acl import Role, acl_file_text, user_url
from sluice.redis_acl import rules as acl_rules
from sluice.redis_server import EmbeddedRedis, free_port
from sluice.tls import TlsFiles, sync_channel, write_local_pki
from sluice.v1 import router_pb2, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from sluice_tools.stack_fleet import StackFleet
from sluice_tools.stack_parts import (
    REPO_ROOT,
    Proc,
    Replica,
    StackConfig,
    StackError,
    health_serving,
    proc_serving,
    replica_role,
    terminate,
)
from worker_svc.models import resolve_model

__all__ = ["REPO_ROOT", "Proc", "Replica", "Stack", "StackConfig", "StackError", "health_serving"]


class Stack:
    """Starts, watches and stops the processes of one deployment. A context manager."""

    def __init__(self, config: StackConfig) -> None:
        if config.disagg is not None:
            prefill, decode = config.disagg
            if prefill < 1 or decode < 1:
                raise ValueError(f"disagg P:D needs at least one replica on each side, got {prefill}:{decode}")
            if config.engine != "sluice":
                raise ValueError("disagg needs Sluice workers (engine sluice): KV blocks move between them")
            config = dataclasses.replace(config, replicas=prefill + decode)
        self.config = config
        self.run_dir = Path(config.run_dir or tempfile.mkdtemp(prefix="sluice-run-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.redis: EmbeddedRedis | None = None
        self.redis_url = config.redis_url or ""
        """The operator's URL (the `default` user of the embedded Redis: every key and command)."""
        self.role_urls: dict[Role, str] = {}
        """Each role's own URL (embedded Redis with `redis_acl`); a role not here uses `redis_url`."""
        self.procs: list[Proc] = []
        self.router: Proc | None = None
        self.workers: list[Proc] = []
        self.schedulers: list[Proc] = []
        self.admission: Proc | None = None
        self.admissions: list[Proc] = []
        """Every admission process (`admission` is the first); more than one with `admission_procs`."""
        self.replicas: dict[str, Replica] = {}
        """Every replica started and not yet retired, by id (workers and schedulers are listed above too)."""
        self._next_replica = 0
        self.fleet = StackFleet(self)
        """Supervision (restarts) and replicas added or retired while the stack runs."""
        self.model_id = ""
        """The id the replicas registered under (what /v1/models lists)."""
        self.http_address = ""
        """host:port of the OpenAI-compatible HTTP API ("" when none is served)."""
        self.tls_dir: Path | None = write_local_pki(self.run_dir / "tls") if config.mtls or config.public_tls else None
        self.operator = TlsFiles.of(self.tls_dir, "operator") if self.tls_dir else None
        """The `operator` credentials the stack's own checks use (None without mTLS)."""

    @property
    def tls_ca(self) -> str | None:
        """The CA certificate (PEM path) clients trust for a TLS admission endpoint; None without TLS."""
        return str(self.tls_dir / "ca.pem") if self.tls_dir else None

    def channel(self, address: str) -> grpc.Channel:
        """Return a blocking channel to a service of this stack (mutual TLS as `operator` when on)."""
        return sync_channel(address, self.operator)

    @property
    def endpoint(self) -> str:
        """The admission address clients connect to."""
        return self.admission.address if self.admission else ""

    @property
    def http_base_url(self) -> str:
        """The OpenAI-compatible base URL (`http://host:port/v1`, https under public_tls), "" when none is served."""
        scheme = "https" if self.config.public_tls else "http"
        return f"{scheme}://{self.http_address}/v1" if self.http_address else ""

    @property
    def api_key(self) -> str:
        """A key that works with the default configuration."""
        return DEFAULT_API_KEY

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # ---- start ---------------------------------------------------------------------------------
    def start(self) -> Stack:
        """Start everything and wait until ready; raises StackError (after stopping what started)."""
        try:
            self._start_all()
        except BaseException:
            self.stop(graceful=False)
            raise
        return self

    def _start_all(self) -> None:
        c = self.config
        deadline = time.monotonic() + c.start_timeout_s
        if not self.redis_url:
            self._start_redis()
        common = ["--namespace", c.namespace, "--log-level", c.log_level]
        self.router = self._spawn("router", "router_svc", [*common, "--router-id", f"router-{c.namespace}",
                                                               *c.router_args],
                                  env=self.bus_env(Role.ROUTER))
        replicas = [self.spawn_worker() for _ in range(c.replicas)]
        self._wait_healthy([self.router, *self.workers], deadline)
        for replica in replicas:
            self.spawn_scheduler(replica)
        self._wait_healthy(self.schedulers, deadline)
        model_id = self.model_id = self._wait_replicas_ready(deadline)
        # Admission reads the tokenizer only and never generates a preset: resolve (generate) it here.
        tokenizer_model = str(resolve_model(c.model if c.backend == "torch" or c.engine == "vllm" else "tiny"))
        admission_args = [*common, "--router", self.router.address, "--model", tokenizer_model,
                          "--model-id", model_id]
        if c.config_file:
            admission_args += ["--config", c.config_file]
        if c.public_tls:
            admission_args.append("--public-tls")
        if c.http_port is not None:
            self.http_address = f"{c.host}:{c.http_port or free_port()}"
            admission_args += ["--http-port", self.http_address.rsplit(":", 1)[1]]
        admission_args += c.admission_args
        if c.admission_procs > 1:
            admission_args.append("--share-budgets")
        port = c.admission_port or free_port()
        for index in range(c.admission_procs):
            owner = self.admission_owner if index == 0 else f"{self.admission_owner}-{index}"
            name = "admission" if index == 0 else f"admission-{index}"
            self.admissions.append(self._spawn(name, "admission_svc", [*admission_args, "--owner", owner], port=port,
                                               env=self.bus_env(Role.ADMISSION)))
            self.admission = self.admission or self.admissions[0]
            # One at a time: each binds the shared ports and takes its first grants before the next one starts.
            self._wait_healthy([self.admissions[-1]], deadline)
            if index:  # the port's health answer may be another process's: wait for this one's own word
                self._wait_listening(self.admissions[-1], deadline)

    @property
    def admission_owner(self) -> str:
        """Admission's `--owner`: its token stream is `tokens:<owner>`, the only one its Redis user may read."""
        return f"admission-{self.config.namespace}"

    def _start_redis(self) -> None:
        """Start the embedded Redis: with `redis_acl`, users per role from an ACL file in run_dir (mode 0600,
        passwords hashed; a restart reads it again) and a URL per role; else one random password."""
        admin = secrets.token_urlsafe(24)
        acl_file, passwords = None, {}
        if self.config.redis_acl:
            passwords = {role: secrets.token_urlsafe(24) for role in Role}
            acl_file = self.run_dir / "redis-users.acl"
            fd = os.open(acl_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                shared = self.config.admission_procs > 1  # several owners: every tokens:* stream, the shares
                role_rules = acl_rules(self.config.namespace, admission_owner=None if shared else self.admission_owner,
                                       shared_budgets=shared)
                out.write(acl_file_text(role_rules, passwords, admin))
        self.redis = EmbeddedRedis(log_path=self.run_dir / "redis.log", password=admin, acl_file=acl_file)
        self.redis_url = self.redis.start()
        if acl_file is not None:
            self.role_urls = {role: user_url(self.redis_url, role.value, pw) for role, pw in passwords.items()}

    def bus_env(self, role: Role) -> dict[str, str]:
        """The environment that hands a service of `role` its Redis URL (its own user's, when there is one)."""
        return {"SLUICE_REDIS_URL": self.role_urls.get(role, self.redis_url)}

    def spawn_worker(self, role: str | None = None) -> Replica:
        """Start the worker of a new replica (a fresh id); its scheduler follows once it serves. `role`: its
        scheduler's --role (None: the split's, `replica_role`: prefill for the first P of a disaggregated stack)."""
        c = self.config
        index = self._next_replica
        self._next_replica += 1
        if c.engine == "vllm":
            return self._spawn_engine(index)
        role = role or replica_role(c, index)
        if role not in ("both", "prefill", "decode"):
            raise ValueError(f"replica role {role!r}: known roles are both, prefill and decode")
        worker_args = ["--backend", c.backend, "--model", c.model, "--log-level", c.log_level]
        if c.num_blocks is not None:
            worker_args += ["--num-blocks", str(c.num_blocks)]
        if c.emulate_time:
            worker_args.append("--emulate-time")
        worker_args += c.worker_args
        # Replicas share the cores: one torch thread pool each of the whole machine oversubscribes it.
        threads = str(max(1, (os.cpu_count() or 1) // c.replicas))
        worker = self._spawn(f"worker-{index}", "worker_svc", worker_args,
                             env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)})
        replica = Replica(f"replica-{index}", worker, role=role)
        worker.replica_id = replica.replica_id
        self.workers.append(worker)
        self.replicas[replica.replica_id] = replica
        return replica

    def _spawn_engine(self, index: int) -> Replica:
        """Start an unmodified vLLM server as replica `index`'s engine (its agent starts once it answers)."""
        from sluice_tools.vllm_engine import VllmEngineSpec, vllm_command, vllm_env

        c = self.config
        cores = os.cpu_count() or 1
        spec = VllmEngineSpec(model_dir=str(resolve_model(c.model)), port=free_port(),
                              kv_socket=str(self.run_dir / f"kv-{index}.sock"), replay_port=free_port(),
                              served_name=Path(c.model).name, cpu=index % cores,
                              scheduling_policy=c.vllm_scheduling_policy, scheduler_cls=c.vllm_scheduler_cls,
                              extra_args=c.engine_args)
        engine = Proc(f"engine-{index}", lifeline_command(vllm_command(spec)), self.run_dir / f"engine-{index}.log",
                      f"127.0.0.1:{spec.port}", http_health=f"{spec.url}/health")
        engine.env = vllm_env(spec, {**os.environ, **dict(c.env)})
        engine.launch()
        self.procs.append(engine)
        replica = Replica(f"replica-{index}", engine, engine=spec)
        engine.replica_id = replica.replica_id
        self.workers.append(engine)
        self.replicas[replica.replica_id] = replica
        return replica

    def _engine_flags(self, replica: Replica) -> list[str]:
        """The scheduler's flags that say what it fronts: a Sluice worker, or a vLLM engine (its agent's flags)."""
        spec = replica.engine
        if spec is None:
            return ["--worker", replica.worker.address]
        flags = ["--engine", "vllm", "--engine-url", spec.url, "--engine-kv-events", spec.kv_endpoint,
                 "--engine-kv-replay", spec.replay_endpoint, "--engine-model-id", spec.served_name]
        return [*flags, "--engine-priority"] if self.config.vllm_scheduling_policy == "priority" else flags

    def spawn_scheduler(self, replica: Replica) -> Proc:
        """Start the scheduler of a replica whose worker serves; it registers with the router itself."""
        c = self.config
        assert self.router is not None
        index = replica.replica_id.removeprefix("replica-")
        scheduler = self._spawn(f"scheduler-{index}", "scheduler_svc", [
            "--namespace", c.namespace, "--log-level", c.log_level, *self._engine_flags(replica),
            "--router", self.router.address, "--replica-id", replica.replica_id,
            *self._role_flags(replica.role), *c.scheduler_args],
            env=self.bus_env(Role.SCHEDULER))
        scheduler.replica_id = replica.replica_id
        replica.scheduler = scheduler
        self.schedulers.append(scheduler)
        return scheduler

    def _spawn(self, name: str, module: str, args: list[str], port: int = 0,
               env: dict[str, str] | None = None) -> Proc:
        port = port or free_port()
        address = f"{self.config.host}:{port}"
        command = [sys.executable, "-m", module, "--host", self.config.host, "--port", str(port), *args]
        if self.config.metrics:
            command += ["--metrics-port", "0"]  # the service prints the port it bound (sluice.serve)
        # Every child dies with the supervisor, even a SIGKILLed one (sluice.lifeline).
        proc = Proc(name, lifeline_command(command), self.run_dir / f"{name}.log", address)
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(dict(self.config.env))
        if self.tls_dir is not None:
            env["SLUICE_TLS_DIR"] = str(self.tls_dir)
        proc.env = env
        proc.launch()
        self.procs.append(proc)
        return proc

    def health_files(self, proc: Proc) -> TlsFiles | None:
        """The credentials to ask `proc`'s health with: admission's public port is plaintext unless public_tls."""
        if proc in self.admissions and not self.config.public_tls:
            return None
        return self.operator

    def _check_alive(self, procs: list[Proc]) -> None:
        for proc in procs:
            if not proc.alive():
                code = proc.popen.returncode if proc.popen else None
                raise StackError(f"{proc.name} exited with code {code} during start-up; log {proc.log_path}:\n"
                                 f"{proc.log_tail()}")

    def _wait_healthy(self, procs: list[Proc], deadline: float) -> None:
        pending = list(procs)
        while pending:
            self._check_alive(pending)
            pending = [p for p in pending if not proc_serving(p, files=self.health_files(p))]
            for proc in procs:
                if proc not in pending:
                    proc.mark_serving()
            for proc in procs:
                if proc not in pending and self.config.metrics and not proc.metrics_url:
                    proc.metrics_url = proc.printed_metrics_url()
            if pending and time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                raise StackError(f"not SERVING within {self.config.start_timeout_s}s: {names}; last log:\n"
                                 f"{pending[0].log_tail()}")
            if pending:
                time.sleep(0.1)

    def _wait_listening(self, proc: Proc, deadline: float) -> None:
        """Wait until `proc` printed that it listens (sluice.serve's line) and its metrics URL; raises StackError."""
        while "listening on" not in proc.log_tail(100_000)[-(proc.log_path.stat().st_size - proc.log_start):]:
            self._check_alive([proc])
            if time.monotonic() > deadline:
                raise StackError(f"{proc.name} did not start listening within {self.config.start_timeout_s}s; "
                                 f"last log:\n{proc.log_tail()}")
            time.sleep(0.1)
        if self.config.metrics:
            proc.metrics_url = proc.printed_metrics_url()

    def _wait_replicas_ready(self, deadline: float) -> str:
        """Wait until the router lists every replica READY; return their model id."""
        while True:
            self._check_alive(self.procs)
            ready = self.ready_replicas()
            if len(ready) >= self.config.replicas:
                return ready[0].model
            if time.monotonic() > deadline:
                raise StackError(f"{len(ready)} of {self.config.replicas} replicas READY after "
                                 f"{self.config.start_timeout_s}s")
            time.sleep(0.1)

    def ready_replicas(self) -> list[router_pb2.Replica]:
        """Return the replicas the router lists READY now (one that was UNHEALTHY, its worker down, is not)."""
        assert self.router is not None
        with self.channel(self.router.address) as channel:
            listed = router_pb2_grpc.RouterServiceStub(channel).ListReplicas(router_pb2.ListReplicasRequest(),
                                                                             timeout=5).replicas
        return [r for r in listed if r.state == router_pb2.READY]

    # ---- observe ---------------------------------------------------------------------------------
    def measured_warmup_s(self) -> float | None:
        """The longest time any replica's worker (or engine) took from launch to serving (None: none measured)."""
        times = [p.ready_after_s for p in self.workers if p.ready_after_s is not None]
        return max(times) if times else None

    def describe(self) -> str:
        """Return one line per process: name, address and pid (Redis first; admission marked as the endpoint)."""
        embedded = " (embedded, a Redis user per role)" if self.role_urls else " (embedded)"
        lines = [f"  {'redis':<12} {redact_url(self.redis_url)}" + (embedded if self.redis is not None else "")]
        for proc in self.procs:
            pid = proc.popen.pid if proc.popen is not None else "?"
            role = "  <- the endpoint clients call (gRPC)" if proc is self.admission else self._role_note(proc)
            metrics = f"  metrics {proc.metrics_url}" if proc.metrics_url else ""
            lines.append(f"  {proc.name:<12} {proc.address:<21} pid {pid}{metrics}{role}")
            if proc is self.admission and self.http_address:
                lines.append(f"  {'':<12} {self.http_address:<21} {'':<{len(f'pid {pid}')}}  <- OpenAI-compatible HTTP")
        return "\n".join(lines)

    def _role_flags(self, role: str) -> list[str]:
        """The scheduler's --role; a prefill replica's per-request chunk cap is also the whole round budget (the cap
        bounds the decodes' inter-token latency, and none run there: as the simulator's prefill replicas), unless
        scheduler_args set one (they come after, and the last flag wins). The default role, both, passes no flag, so
        the stack still starts a checkout older than the roles (bench_cost's --baseline)."""
        if role == "both":
            return []
        if role != "prefill":
            return ["--role", role]
        return ["--role", role, "--max-prefill-chunk", str(SchedulerConfig.max_num_batched_tokens)]

    def _role_note(self, proc: Proc) -> str:
        """`  (prefill)` / `  (decode)` after a disaggregated replica's scheduler; "" otherwise."""
        replica = self.replicas.get(proc.replica_id)
        if self.config.disagg is None or proc not in self.schedulers or replica is None:
            return ""
        return f"  ({replica.role})"

    def scheduler_stats(self) -> list[scheduler_pb2.SchedulerStats]:
        """Return every scheduler's Stats (KV blocks, queue, counters)."""
        out = []
        for proc in [p for p in self.schedulers if p.alive()]:
            with self.channel(proc.address) as channel:
                stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
                out.append(stub.Stats(scheduler_pb2.StatsRequest(), timeout=5))
        return out

    # ---- stop ------------------------------------------------------------------------------------
    def stop(self, graceful: bool = True) -> None:
        """Stop everything (see the module docstring); safe to call twice."""
        self.fleet.halt_supervision()
        if graceful:
            with contextlib.suppress(Exception):
                self._drain()
        order = [*self.admissions, *self.schedulers, *self.workers,
                 *([self.router] if self.router else [])]
        for proc in order:
            terminate(proc, timeout_s=10.0 if graceful else 3.0)
        self.procs = [p for p in self.procs if p.alive()]
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        self.fleet.release_supervision()

    def _drain(self) -> None:
        """Stop routing to every replica, let in-flight requests finish (clients keep their streams), then
        stop admission. New requests meanwhile get UNAVAILABLE (no READY replica) with a retry delay."""
        if self.router is not None and self.router.alive():
            with self.channel(self.router.address) as channel:
                stub = router_pb2_grpc.RouterServiceStub(channel)
                for replica_id in self.replicas:
                    with contextlib.suppress(grpc.RpcError):
                        stub.Drain(router_pb2.DrainRequest(replica_id=replica_id), timeout=5)
            deadline = time.monotonic() + self.config.drain_timeout_s
            while time.monotonic() < deadline:
                if not [s for s in self.scheduler_stats() if s.running or s.waiting]:
                    break
                time.sleep(0.1)
        for admission in self.admissions:
            terminate(admission, timeout_s=10.0)
