"""End to end: under supervision a killed worker, scheduler or Redis is restarted and the stack serves again.

Real processes (cost-model backend), `kill -9` as an operator's accident would be. Recovery times (kill to
the first request that completes again) are printed as JSON lines, not asserted: figures, not tests.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import grpc
import pytest

from sluice import client as sdk
from sluice import services
from sluice_tools.stack import Stack, StackConfig, health_serving
from sluice_tools.supervisor import Supervisor
from tests.processes import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PROMPT = [5, 6, 7, 8] * 8


def _config(run_dir: Path, replicas: int) -> StackConfig:
    return StackConfig(replicas=replicas, backend="costmodel", model="llama-3-8b", run_dir=run_dir, emulate_time=True,
                       start_timeout_s=60)


class Target(NamedTuple):
    """Where requests go: a Stack, or a `sluice up` started as a process."""

    endpoint: str
    api_key: str


def _complete(stack: Stack | Target, max_tokens: int = 8, timeout_s: float = 5.0, **options: object) -> str:
    """One request start to end; return its final status (raises sdk.SluiceError)."""
    with sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
        status = ""
        for chunk in client.generate(PROMPT, max_tokens=max_tokens, ignore_eos=True, timeout=timeout_s,
                                     **options):  # type: ignore[arg-type]
            status = chunk.status or status
        return status


def _until_served(stack: Stack | Target, since: float, limit_s: float = 60.0) -> float:
    """Send requests until one finishes; return the seconds from `since` (fails after `limit_s`)."""
    last: Exception | None = None
    while time.monotonic() - since < limit_s:
        try:
            if _complete(stack) == "FINISHED_LENGTH":
                return time.monotonic() - since
        except sdk.SluiceError as exc:
            last = exc
        time.sleep(0.05)
    raise AssertionError(f"not serving {limit_s} s after the kill; last error: {last}")


def _kill9(pid: int) -> float:
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


@pytest.fixture(scope="module")
def supervised(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two cost-model replicas under a supervisor thread, for the whole module."""
    lines: list[str] = []
    with Stack(_config(tmp_path_factory.mktemp("supervised"), replicas=2)) as stack:
        stack.fleet.supervisor = Supervisor(stack, on_event=lines.append)
        stack.fleet.start_supervising(0.1)
        stack.events = lines  # type: ignore[attr-defined]
        yield stack


def test_killed_worker_is_restarted_while_the_other_replica_keeps_streaming(supervised: Stack) -> None:
    """kill -9 of one replica's worker: it is restarted on its address, the stack serves new requests again, and a
    stream on the other replica finishes untouched."""
    stack = supervised
    outcome: dict[str, object] = {}
    first = threading.Event()

    def stream() -> None:
        with sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
            tokens = 0
            for chunk in client.generate(PROMPT, max_tokens=1500, ignore_eos=True, timeout=60):
                outcome.setdefault("request_id", chunk.request_id)
                tokens += len(chunk.token_ids)
                outcome["status"] = chunk.status
                first.set()
            outcome["tokens"] = tokens

    thread = threading.Thread(target=stream)
    thread.start()
    assert first.wait(20)
    with sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
        serving = client.get_request(str(outcome["request_id"])).replica_id
    victim = next(w for w in stack.workers if w.replica_id != serving)
    old_pid = victim.popen.pid  # type: ignore[union-attr]
    killed = _kill9(old_pid)
    recovery = _until_served(stack, killed)
    assert wait_until(lambda: victim.alive() and victim.popen.pid != old_pid, 30)  # type: ignore[union-attr]
    thread.join(60)
    assert outcome.get("status") == "FINISHED_LENGTH" and outcome.get("tokens") == 1500, outcome
    assert wait_until(lambda: stack.fleet.supervisor.restart_counts().get(victim.name) == 1, 10)  # type: ignore[union-attr]
    assert any(f"{victim.name} died (killed by SIGKILL)" in line for line in stack.events)  # type: ignore[attr-defined]
    print(json.dumps({"kill": "worker", "recovery_s": round(recovery, 3)}))


def test_killed_scheduler_is_restarted_registers_again_and_serves(supervised: Stack) -> None:
    """kill -9 of a scheduler: it is restarted, registers with the router again (READY after its worker serves),
    and requests complete on both replicas again."""
    stack = supervised
    victim = stack.schedulers[0]
    old_pid = victim.popen.pid  # type: ignore[union-attr]
    killed = _kill9(old_pid)
    recovery = _until_served(stack, killed)
    assert wait_until(lambda: victim.alive() and victim.popen.pid != old_pid, 30)  # type: ignore[union-attr]

    def both_ready() -> bool:
        from sluice.v1 import router_pb2

        return sum(r.state == router_pb2.READY for r in stack.fleet.list_replicas()) == 2

    assert wait_until(both_ready, 30)
    back = time.monotonic() - killed
    served: set[str] = set()

    def one(i: int) -> None:
        # Distinct prompts (a shared prefix would draw every request to one replica), 8 at a time: one at a time,
        # both replicas idle, the replica whose measured rates predict the lower TTFT would take every request.
        with sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
            request_id = ""
            for chunk in client.generate([100 + i] * 32, max_tokens=32, ignore_eos=True, timeout=30):
                request_id = chunk.request_id
            served.add(client.get_request(request_id).replica_id)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(24)))
    assert served == {victim.replica_id, stack.schedulers[1].replica_id}
    print(json.dumps({"kill": "scheduler", "recovery_s": round(recovery, 3), "replica_ready_s": round(back, 3)}))


def test_killed_redis_is_restarted_on_its_port_and_password(supervised: Stack) -> None:
    """kill -9 of the embedded Redis: it is restarted on the same port with the same password, the services
    reconnect (their consumer groups recreated) and new requests complete."""
    stack = supervised
    assert stack.redis is not None
    url, old_pid = stack.redis_url, stack.redis.pid
    killed = _kill9(old_pid)  # type: ignore[arg-type]
    recovery = _until_served(stack, killed)
    assert stack.redis.pid != old_pid and stack.redis.url == url
    for _ in range(5):
        assert _complete(stack) == "FINISHED_LENGTH"
    print(json.dumps({"kill": "redis", "recovery_s": round(recovery, 3)}))


def test_a_stream_running_while_redis_restarts_completes_with_every_token(supervised: Stack) -> None:
    """Redis killed mid-stream and restarted by the supervisor: the scheduler holds the tokens until Redis is
    back, admission's reader and completion consumer resume, and the client gets exactly the cost model's tokens."""
    stack = supervised
    assert stack.redis is not None
    received: list[int] = []
    outcome: dict[str, object] = {}
    first = threading.Event()

    def stream() -> None:
        with sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
            try:
                for chunk in client.generate([9, 8, 7] * 10, max_tokens=1200, ignore_eos=True, timeout=90):
                    assert chunk.index == len(received)
                    outcome["request_id"] = chunk.request_id
                    received.extend(chunk.token_ids)
                    outcome["status"] = chunk.status
                    first.set()
            except sdk.SluiceError as exc:
                outcome["error"] = exc

    thread = threading.Thread(target=stream)
    thread.start()
    assert first.wait(20)
    assert stack.fleet.supervisor is not None
    restarts = stack.fleet.supervisor.restart_counts().get("redis", 0)
    _kill9(stack.redis.pid)  # type: ignore[arg-type]
    at_kill = len(received)
    thread.join(90)
    assert at_kill < 1200 and stack.fleet.supervisor.restart_counts().get("redis", 0) == restarts + 1
    assert "error" not in outcome, outcome
    assert outcome.get("status") == "FINISHED_LENGTH" and len(received) == 1200, (outcome, len(received))
    from worker_svc.costmodel import CostModel

    model = CostModel("llama-3-8b", "h200")  # its tokens are a function of the request id and the position
    prompt_len = 30  # the [9, 8, 7] * 10 prompt, sent as token ids
    assert received == [model.token_for(str(outcome["request_id"]), prompt_len + i, i) for i in range(1200)]


@pytest.mark.parametrize("name", ["router", "admission"])
def test_killed_router_or_admission_is_restarted_and_serves(supervised: Stack, name: str) -> None:
    """kill -9 of the router (the replicas register again with it) or of admission (clients reconnect to the
    same address): restarted, and new requests complete."""
    stack = supervised
    victim = stack.router if name == "router" else stack.admission
    assert victim is not None and victim.popen is not None
    old_pid = victim.popen.pid
    killed = _kill9(old_pid)
    recovery = _until_served(stack, killed)
    assert victim.alive() and victim.popen.pid != old_pid
    if name == "router":
        from sluice.v1 import router_pb2

        assert wait_until(lambda: sum(r.state == router_pb2.READY for r in stack.fleet.list_replicas()) == 2, 20)
    print(json.dumps({"kill": name, "recovery_s": round(recovery, 3)}))


def test_a_restarted_process_reports_the_metrics_url_it_bound_again(supervised: Stack) -> None:
    """kill -9 of admission (metrics on port 0): after the restart its `metrics_url` is the URL the new
    incarnation printed, which answers with Sluice metrics, and the supervisor says so; the old one is gone."""
    import urllib.request

    from sluice.serve import METRICS_LINE

    stack = supervised
    victim = stack.admission
    assert victim is not None and victim.popen is not None
    # The test before this one may have restarted admission: the supervisor learns the new incarnation's URL on a
    # pass after it printed it, asynchronously (CI once read it still empty here).
    assert wait_until(lambda: bool(victim.metrics_url), 20)
    old_url, old_pid = victim.metrics_url, victim.popen.pid
    killed = _kill9(old_pid)
    _until_served(stack, killed)
    assert wait_until(lambda: bool(victim.metrics_url) and victim.popen.pid != old_pid, 20)  # type: ignore[union-attr]
    printed = [line[len(METRICS_LINE):].strip() for line in victim.log_path.read_text().splitlines()
               if line.startswith(METRICS_LINE)]
    assert printed[-1] == victim.metrics_url and old_url in printed[:-1]
    with urllib.request.urlopen(victim.metrics_url, timeout=5) as reply:  # noqa: S310 (loopback URL from the stack)
        assert "sluice_admission_requests_total" in reply.read().decode()
    assert any(line == f"admission metrics now on {victim.metrics_url}" for line in stack.events)  # type: ignore[attr-defined]
    print(json.dumps({"kill": "admission", "metrics_url_before": old_url, "after": victim.metrics_url}))


def test_while_redis_is_down_services_are_not_serving_and_requests_fail_fast(tmp_path: Path) -> None:
    """With Redis killed and not yet restarted: router, schedulers and admission report NOT_SERVING, a request
    ends UNAVAILABLE in well under its deadline; once the supervisor restarts Redis all serve again."""
    with Stack(_config(tmp_path, replicas=1)) as stack:
        stack.fleet.supervisor = Supervisor(stack, on_event=lambda line: None)
        assert stack.redis is not None
        killed = _kill9(stack.redis.pid)  # type: ignore[arg-type]
        checks = [(stack.router.address, services.ROUTER), (stack.schedulers[0].address, services.SCHEDULER),  # type: ignore[union-attr]
                  (stack.admission.address, services.ADMISSION)]  # type: ignore[union-attr]
        assert wait_until(lambda: not any(health_serving(a, s) for a, s in checks), 10)
        began = time.monotonic()
        with pytest.raises(sdk.SluiceError) as refused:
            _complete(stack, timeout_s=30, idempotency_key="")  # no key: the SDK does not retry, one answer
        refused_after = time.monotonic() - began
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert "Redis" in refused.value.message
        assert refused_after < 2
        began = time.monotonic()
        with pytest.raises(sdk.SluiceError) as retried:
            _complete(stack, timeout_s=30)  # the SDK's default: retried after the server's delay, then given up
        retried_after = time.monotonic() - began
        assert retried.value.code == grpc.StatusCode.UNAVAILABLE and retried_after < 10
        def restarted() -> bool:
            stack.fleet.supervise()  # the first pass notes the death, a later one restarts it once the backoff is due
            return stack.redis is not None and stack.redis.running

        assert wait_until(restarted, 10)
        assert wait_until(lambda: all(health_serving(a, s) for a, s in checks), 10)
        recovery = _until_served(stack, killed)
        print(json.dumps({"kill": "redis (restart held back)", "unavailable_after_s": round(refused_after, 3),
                          "unavailable_after_sdk_retries_s": round(retried_after, 3),
                          "recovery_s": round(recovery, 3)}))


def test_sluice_up_restarts_a_killed_worker_and_counts_it_on_stop(tmp_path: Path) -> None:
    """`sluice up` (the CLI) survives kill -9 of its worker: it prints the death with its cause and the restart,
    serves again, and on Ctrl-C exits 0 printing the restart count."""
    import subprocess
    import sys

    from sluice.redis_server import free_port
    from tests.processes import children, command_line

    port = free_port()
    up = subprocess.Popen([sys.executable, "-m", "sluice_tools.cli", "up", "--backend", "costmodel", "--model",
                           "llama-3-8b", "--port", str(port), "--run-dir", str(tmp_path)],
                          cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
                          stderr=(tmp_path / "up.err").open("w"), text=True)
    try:
        assert up.stdout is not None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and "Ctrl-C to stop" not in (line := up.stdout.readline()) and line:
            pass
        worker = next(pid for pid in children(up.pid) if "worker_svc" in command_line(pid))
        killed = _kill9(worker)
        recovery = _until_served(Target(f"127.0.0.1:{port}", "sk-sluice-local"), killed)
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.kill()
    err = (tmp_path / "up.err").read_text()
    assert "worker-0 died (killed by SIGKILL); restarting in 0.5 s" in err and "restarted worker-0" in err, err
    assert "restarts: worker-0 1" in err, err
    print(json.dumps({"kill": "worker under sluice up", "recovery_s": round(recovery, 3)}))
