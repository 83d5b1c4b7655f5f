"""The changing part of a local stack: supervision and replicas added or retired while it runs.

`StackFleet` is a collaborator of `sluice_tools.stack.Stack`, which holds one as `stack.fleet` (kept apart
so that the stack's start and stop stay readable): `supervise()` is one supervision pass
(sluice_tools/supervisor.py), `start_supervising()` runs it in a thread; `add_replica` / `retire_replica`
/ `advance_replicas` are what the planner's launcher (sluice_tools/autoscale.py) calls. It owns the
supervision state (the `Supervisor`, its thread and the events that stop it); the processes and
replicas stay the stack's.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

import grpc

from sluice.v1 import router_pb2, router_pb2_grpc

if TYPE_CHECKING:
    from sluice_tools.stack import Proc, Replica, Stack
    from sluice_tools.supervisor import Supervisor


class StackFleet:
    """Supervision and replica changes of a running Stack (see the module docstring)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.supervisor: Supervisor | None = None
        """Set by `supervise`/`start_supervising` (or by the caller, to choose its events and hooks): restarts
        dead processes (None: nothing is restarted)."""
        self._supervising: threading.Thread | None = None
        self._halt = threading.Event()
        self._released = threading.Event()
        self._pass_lock = threading.Lock()

    def supervise(self, now: float | None = None) -> None:
        """One supervision pass: restart what died (when its backoff is due), move replicas along."""
        from sluice_tools.supervisor import Supervisor

        with self._pass_lock:  # `stop` waits for a pass under way, then no pass runs any more
            if self.supervisor is None:
                self.supervisor = Supervisor(self.stack)
            self.supervisor.step(time.monotonic() if now is None else now)

    def start_supervising(self, interval_s: float = 0.25) -> threading.Thread:
        """Run `supervise` every `interval_s` in a thread until `stop` (which the thread outlives: processes it
        restarts get their lifeline signal when the thread that started them ends, sluice.lifeline)."""
        def loop() -> None:
            while not self._halt.wait(interval_s):
                try:
                    self.supervise()
                except Exception as exc:  # a bug here must not end the thread: its children would go with it
                    print(f"supervisor: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            self._released.wait()

        self._supervising = threading.Thread(target=loop, name="sluice-supervisor", daemon=True)
        self._supervising.start()
        return self._supervising

    def halt_supervision(self) -> None:
        """Stop supervising: a pass under way finishes, then no pass runs any more (the stack is stopping)."""
        self._halt.set()
        with self._pass_lock:
            if self.supervisor is not None:
                self.supervisor.halted = True

    def release_supervision(self) -> None:
        """Let the supervision thread end (once the stack has stopped what it started) and wait for it."""
        self._released.set()
        if self._supervising is not None and self._supervising is not threading.current_thread():
            self._supervising.join(timeout=10)

    def relaunch(self, proc: Proc) -> None:
        """Start a dead process again with the same command, address and environment."""
        if proc.alive():
            raise RuntimeError(f"{proc.name} is still running")
        proc.launch()

    def add_replica(self, role: str | None = None) -> str:
        """Start a new replica (worker now, its scheduler once the worker serves, see `advance_replicas`);
        return its id. It registers with the router (with `role`: prefill or decode joins that pool of a
        disaggregated stack; None: the stack's default) and is routed to once READY."""
        return self.stack.spawn_worker(role).replica_id

    def retire_replica(self, replica_id: str) -> None:
        """Drain and stop a replica: the router stops routing to it, its scheduler gets SIGTERM (it finishes its
        requests up to its drain timeout, then cancels the rest); its worker stops once the scheduler is gone.
        Raises KeyError for an unknown replica."""
        replica = self.stack.replicas[replica_id]
        replica.retiring = True
        self.router_drain(replica_id)
        if replica.scheduler is not None and replica.scheduler.alive() and replica.scheduler.popen is not None:
            replica.scheduler.popen.send_signal(signal.SIGTERM)

    def advance_replicas(self) -> list[str]:
        """Move replicas along: start the scheduler of a new replica whose worker serves; forget a retired one
        whose scheduler has exited (its worker stopped). Returns what happened, one line each."""
        from sluice_tools.stack_parts import proc_serving, terminate

        events = []
        for replica in list(self.stack.replicas.values()):
            if replica.retiring:
                if replica.scheduler is None or not replica.scheduler.alive():
                    terminate(replica.worker, timeout_s=10.0)
                    self._forget(replica)
                    events.append(f"{replica.replica_id} retired (scheduler and worker stopped)")
            elif replica.scheduler is None and replica.worker.alive() and proc_serving(replica.worker, timeout_s=0.2,
                                                                                         files=self.stack.operator):
                replica.worker.mark_serving()
                self.stack.spawn_scheduler(replica)
                events.append(f"{replica.replica_id}: worker serving after {replica.worker.ready_after_s:.1f} s, "
                              "scheduler started")
        return events

    def _forget(self, replica: Replica) -> None:
        stack = self.stack
        del stack.replicas[replica.replica_id]
        gone = {id(replica.worker), id(replica.scheduler)}
        stack.workers = [p for p in stack.workers if id(p) not in gone]
        stack.schedulers = [p for p in stack.schedulers if id(p) not in gone]
        stack.procs = [p for p in stack.procs if id(p) not in gone]

    def router_drain(self, replica_id: str) -> None:
        """Ask the router to stop routing to a replica (best effort: the router may be down)."""
        router = self.stack.router
        if router is None:
            return
        with self.stack.channel(router.address) as channel, contextlib.suppress(grpc.RpcError):
            router_pb2_grpc.RouterServiceStub(channel).Drain(router_pb2.DrainRequest(replica_id=replica_id),
                                                             timeout=2)

    def list_replicas(self) -> list[router_pb2.Replica]:
        """The router's registry (raises grpc.RpcError when the router does not answer)."""
        router = self.stack.router
        assert router is not None
        with self.stack.channel(router.address) as channel:
            return list(router_pb2_grpc.RouterServiceStub(channel).ListReplicas(
                router_pb2.ListReplicasRequest(), timeout=2).replicas)
