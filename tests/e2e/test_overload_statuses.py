"""End to end: under overload every request admission does not serve ends with an explicit status.

Found at 3x overload (60 s, costmodel): 0 to ~5,500 requests a run ended bare CANCELLED, no tokens, no RetryInfo,
and none of them ever reached admission's handlers. Their cause is gRPC's own accept queue: a call the server's
event loop has not yet picked up waits in gRPC core, and core cancels one that waited longer than
`grpc.server_max_unrequested_time_in_server` (30 s by default) without a word to the application. Admission's
event loop falls that far behind when it is saturated. The test stalls admission's event loop (a real admission
process; a signal handler installed through sitecustomize sleeps in the loop's thread, as a saturated loop
would, while gRPC core keeps accepting) for longer than that, with calls arriving meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

from sluice import client as sdk
from sluice_tools.stack import Stack, StackConfig
from sluice_tools.stack_parts import REPO_ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

KEY = "k-acme"
STALL_S = 33.0
"""Longer than gRPC core's default 30 s limit on a call nobody picked up."""
SHORT_STALL_S = 8.0
"""Long enough for a backlog of thousands of calls to build up in gRPC core while admission's loop is stalled."""
BACKLOG_CALLS = 4000
"""More than gRPC core's default limit on calls waiting to be picked up (`grpc.server.max_pending_requests_hard_limit`,
3,000; above `grpc.server.max_pending_requests`, 1,000, core drops a growing share of them at random)."""

_STALL_HOOK = """
import signal, time

def _stall(signum, frame):
    time.sleep({stall_s})  # releases the GIL: gRPC core's threads keep accepting calls meanwhile

def _short_stall(signum, frame):
    time.sleep({short_stall_s})

signal.signal(signal.SIGUSR1, _stall)
signal.signal(signal.SIGUSR2, _short_stall)
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One costmodel replica; every process can have its event loop stalled by SIGUSR1."""
    run_dir = tmp_path_factory.mktemp("overload")
    hook = run_dir / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent(_STALL_HOOK.format(stall_s=STALL_S, short_stall_s=SHORT_STALL_S)))
    config = run_dir / "sluice.toml"
    config.write_text(f'[tenants.acme]\napi_keys = ["{KEY}"]\n')
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), str(hook), os.environ.get("PYTHONPATH")) if p)
    with Stack(StackConfig(replicas=1, backend="costmodel", config_file=str(config), run_dir=run_dir,
                           env=(("PYTHONPATH", pythonpath),))) as running:
        yield running


def _generate(stack: Stack, results: list[object]) -> None:
    with sdk.Client(stack.endpoint, api_key=KEY, retry=sdk.RetryPolicy(max_attempts=1)) as client:
        try:
            results.append(client.generate_text("hello there", max_tokens=8, timeout=120))
        except sdk.SluiceError as exc:
            results.append(exc)


def test_calls_waiting_for_a_stalled_event_loop_are_served_or_refused_explicitly(stack: Stack) -> None:
    """Calls that arrive while admission's event loop is stalled longer than gRPC's accept limit are served once
    it runs again (or refused RESOURCE_EXHAUSTED with RetryInfo), never cancelled bare by gRPC core."""
    warm: list[object] = []
    _generate(stack, warm)
    assert isinstance(warm[0], sdk.Generation), warm
    assert stack.admission is not None and stack.admission.popen is not None
    os.kill(stack.admission.popen.pid, signal.SIGUSR1)
    time.sleep(0.5)  # the loop is in the stall before the calls arrive
    results: list[object] = []
    threads = [threading.Thread(target=_generate, args=(stack, results)) for _ in range(6)]
    for thread in threads:
        thread.start()
        time.sleep(0.2)
    for thread in threads:
        thread.join(timeout=150)
    assert len(results) == 6
    unexplained = [repr(r) for r in results if not _explicit(r)]
    assert not unexplained, f"{len(unexplained)} of 6 ended without an explicit answer: {unexplained}"


def _explicit(result: object) -> bool:
    """Return whether `result` is a whole answer or a refusal that says when to retry."""
    if isinstance(result, sdk.Generation):
        return len(result.token_ids) == 8
    return isinstance(result, sdk.ResourceExhausted) and result.retry_delay_s is not None


async def _backlog_outcomes(endpoint: str) -> list[str]:
    """Open BACKLOG_CALLS Generate calls at once on one plain gRPC channel (no SDK: what any gRPC client sees);
    return, per call, "ok" or its status code name, "+details" when it carries admission's status details."""
    import grpc

    from sluice.v1 import admission_pb2_grpc

    request = sdk.build_request("hello there", max_tokens=1)
    metadata = (("authorization", f"Bearer {KEY}"),)
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)

        async def one() -> str:
            call = stub.Generate(request, timeout=90, metadata=metadata)
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                details = any(key == "grpc-status-details-bin" for key, _ in exc.trailing_metadata() or ())
                return exc.code().name + ("+details" if details else "")
            return "ok"

        return await asyncio.gather(*(one() for _ in range(BACKLOG_CALLS)))


def test_a_backlog_of_thousands_of_calls_gets_explicit_answers(stack: Stack) -> None:
    """Thousands of calls that pile up in gRPC core while admission's event loop is stalled (as under 3x overload)
    are all answered by admission: served, or refused with status details. Before, core dropped those beyond its
    pending-call limits (1,000 soft, 3,000 hard) with a bare CANCELLED that admission never saw."""
    warm: list[object] = []
    _generate(stack, warm)
    assert isinstance(warm[0], sdk.Generation), warm
    assert stack.admission is not None and stack.admission.popen is not None
    os.kill(stack.admission.popen.pid, signal.SIGUSR2)
    time.sleep(0.3)  # the loop is in the stall before the calls arrive
    started = time.monotonic()
    outcomes = asyncio.run(_backlog_outcomes(stack.endpoint))
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
    assert time.monotonic() - started > SHORT_STALL_S - 1, f"the calls did not wait for the stall: {counts}"
    assert set(counts) <= {"ok", "RESOURCE_EXHAUSTED+details"}, counts
