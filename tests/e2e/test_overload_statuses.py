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

_STALL_HOOK = """
import signal, time

def _stall(signum, frame):
    time.sleep({stall_s})  # releases the GIL: gRPC core's threads keep accepting calls meanwhile

signal.signal(signal.SIGUSR1, _stall)
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One costmodel replica; every process can have its event loop stalled by SIGUSR1."""
    run_dir = tmp_path_factory.mktemp("overload")
    hook = run_dir / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent(_STALL_HOOK.format(stall_s=STALL_S)))
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
