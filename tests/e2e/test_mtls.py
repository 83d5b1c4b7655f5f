"""Every internal hop is mutual TLS with per-RPC caller roles: the bypasses a network attacker tried are refused.

A stack with a fresh local CA serves a client over TLS; then, with the same addresses, a caller
without a certificate, with a certificate from another CA, or with a valid certificate of the wrong
role tries what was possible before (Submit at a scheduler as any tenant at any priority, Cancel
another tenant's request at its scheduler, RegisterReplica and Drain at the router, Execute at a
worker) and is refused, while the roles that need each call still get through.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sluice import client as sdk
from sluice.tls import TlsFiles, sync_channel, write_local_pki
from sluice.v1 import (
    router_pb2,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from sluice_tools.stack import Stack, StackConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run = tmp_path_factory.mktemp("mtls")
    with Stack(StackConfig(backend="costmodel", model="llama-3-8b", mtls=True, public_tls=True,
                           run_dir=run)) as running:
        yield running


def _code(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _as(stack: Stack, role: str, address: str) -> grpc.Channel:
    assert stack.tls_dir is not None
    return sync_channel(address, TlsFiles.of(stack.tls_dir, role))


def _submit(channel: grpc.Channel) -> grpc.StatusCode:
    stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
    request = scheduler_pb2.SubmitRequest(request_id="bypass-1", tenant="nobody", prompt_token_ids=[1, 2, 3],
                                          priority=2**31 - 1)
    request.sampling.max_tokens = 50
    return _code(lambda: stub.Submit(request, timeout=5))


def test_a_client_streams_over_tls_with_the_printed_ca(stack: Stack) -> None:
    """The public endpoint speaks TLS; a client that trusts the stack's CA generates as before."""
    with sdk.Client(stack.endpoint, api_key=stack.api_key, tls_ca=stack.tls_ca) as client:
        answer = client.generate_text("over tls", max_tokens=4)
    assert answer.status == "FINISHED_LENGTH" and len(answer.token_ids) == 4


def test_submit_at_a_scheduler_needs_the_admission_certificate(stack: Stack, tmp_path: Path) -> None:
    """No certificate, another CA's certificate, or a worker's certificate: Submit is refused; admission's passes."""
    scheduler = stack.schedulers[0].address
    with grpc.insecure_channel(scheduler) as plain:
        assert _submit(plain) == grpc.StatusCode.UNAVAILABLE, "no TLS at all: the handshake fails"
    foreign = write_local_pki(tmp_path / "other-ca", roles=("admission",))
    with sync_channel(scheduler, TlsFiles.of(foreign, "admission")) as forged:
        assert _submit(forged) == grpc.StatusCode.UNAVAILABLE, "a certificate from another CA is not accepted"
    with _as(stack, "worker", scheduler) as wrong_role:
        assert _submit(wrong_role) == grpc.StatusCode.PERMISSION_DENIED
    with _as(stack, "operator", scheduler) as tooling:
        assert _submit(tooling) == grpc.StatusCode.PERMISSION_DENIED
    with _as(stack, "admission", scheduler) as admission:
        assert _submit(admission) == grpc.StatusCode.OK, "the one role that submits still can"
        stub = scheduler_pb2_grpc.SchedulerServiceStub(admission)
        stub.Cancel(scheduler_pb2.CancelRequest(request_id="bypass-1"), timeout=5)


def test_cancel_at_the_scheduler_is_admissions_alone(stack: Stack) -> None:
    """A peer that learned a request id cannot cancel it at the scheduler unless it is admission."""
    scheduler = stack.schedulers[0].address
    for role in ("router", "planner", "operator", "worker"):
        with _as(stack, role, scheduler) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            code = _code(lambda stub=stub: stub.Cancel(scheduler_pb2.CancelRequest(request_id="someone"), timeout=5))
            assert code == grpc.StatusCode.PERMISSION_DENIED, role


def test_router_registry_calls_take_only_their_roles(stack: Stack) -> None:
    """RegisterReplica is the schedulers'; Drain the planner's and the operator's; others are refused."""
    assert stack.router is not None
    router = stack.router.address
    register = router_pb2.RegisterReplicaRequest(replica=router_pb2.Replica(replica_id="evil", model="x",
                                                                           scheduler_address="127.0.0.1:1"))
    drain = router_pb2.DrainRequest(replica_id="no-such-replica")
    with _as(stack, "admission", router) as admission:
        stub = router_pb2_grpc.RouterServiceStub(admission)
        assert _code(lambda: stub.RegisterReplica(register, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: stub.Drain(drain, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
    with _as(stack, "operator", router) as operator:
        stub = router_pb2_grpc.RouterServiceStub(operator)
        assert _code(lambda: stub.Drain(drain, timeout=5)) == grpc.StatusCode.NOT_FOUND, "allowed, then unknown"


def test_only_a_scheduler_drives_a_worker(stack: Stack) -> None:
    """Execute at a worker is refused to every role but scheduler (a bogus plan must not reach the engine)."""
    worker = stack.workers[0].address
    for role in ("admission", "router", "operator"):
        with _as(stack, role, worker) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            code = _code(lambda stub=stub: stub.Execute(worker_pb2.RoundPlan(round_id=1), timeout=5))
            assert code == grpc.StatusCode.PERMISSION_DENIED, role


def test_the_bench_checks_and_drives_a_tls_endpoint_with_its_ca(stack: Stack) -> None:
    """`sluice bench --tls-ca`: the health check and the replay trust the CA; a plaintext check cannot reach it."""
    import asyncio

    from sluice_tools.commands.bench import drive, unreachable
    from sluice_tools.workload import WorkloadRequest

    assert unreachable(stack.endpoint, tls_ca=stack.tls_ca) == ""
    assert "cannot reach admission" in unreachable(stack.endpoint, timeout_s=3)
    requests = [WorkloadRequest("tls-0", 0.0, 8, 3)]
    [outcome] = asyncio.run(drive(stack.endpoint, stack.api_key, requests, progress=False, tls_ca=stack.tls_ca))
    assert outcome.status == "ok" and outcome.output_tokens == 3, outcome.detail
