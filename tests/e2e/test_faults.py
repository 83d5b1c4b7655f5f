"""End to end: faults that used to hang, leak or corrupt a stream, on a real 2-replica stack.

Real processes (cost-model workers, emulated round times), `kill -9` as an operator's accident would be, a
real redis-server killed and restarted, and garbage written to Redis with a real XADD. The cost model's token
at a position depends only on the request and the position, so every stream is checked token for token
against what an untouched run gives (tests/e2e/test_migration_stack.py checks that reference itself).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sluice import client as sdk
from sluice_tools.stack import Stack, health_serving
from sluice_tools.stack_parts import terminate
from tests.e2e.test_migration_stack import (
    _assert_budgets_return_to_zero,
    _assert_exact,
    _finish,
    _launch,
    _migrations,
    _start,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _relaunch_admission(stack: Stack, *extra: str) -> None:
    """Restart admission with extra flags (same address and owner) and wait until it serves."""
    admission = stack.admission
    assert admission is not None
    terminate(admission, timeout_s=10)
    admission.args = [*admission.args, *extra]
    admission.launch()
    give_up = time.monotonic() + 30
    while not health_serving(admission.address):
        assert admission.alive() and time.monotonic() < give_up, admission.log_tail()
        time.sleep(0.1)
    while not admission.metrics_url:
        admission.metrics_url = admission.printed_metrics_url()
        time.sleep(0.05)


def _restart_on_the_same_address(stack: Stack, index: int) -> float:
    """kill -9 scheduler `index` and start it again at once on its address; return the seconds until it serves."""
    proc = stack.schedulers[index]
    assert proc.popen is not None
    proc.popen.kill()
    proc.popen.wait(5)
    killed = time.monotonic()
    proc.launch()
    while not health_serving(proc.address):
        assert proc.alive() and time.monotonic() - killed < 30, proc.log_tail()
        time.sleep(0.02)
    return time.monotonic() - killed


def _replica_of(stack: Stack, request_id: str) -> str:
    with sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
        return client.get_request(request_id).replica_id


def test_a_scheduler_restarted_at_once_on_its_address_strands_no_request(tmp_path: Path) -> None:
    """kill -9 of replica-0's scheduler and an immediate restart on the same address (it serves and registers
    again long before admission's stall timeout): the requests the dead incarnation held move
    (`replica_restarted`) and finish with exactly the untouched run's tokens; one of them, cancelled by its
    client while stranded, ends CANCELLED at once although the new scheduler answers its Cancel NOT_FOUND;
    admission's budgets are zero after."""
    with _start(tmp_path) as stack:
        # A stall timeout well past the restart time: the restarted scheduler answers health and is listed READY
        # when the watchdog looks, so only the incarnation can tell that its requests are gone.
        _relaunch_admission(stack, "--stall-timeout-s", "5")
        outs, threads = _launch(stack)
        placed = {out.request_id: _replica_of(stack, out.request_id) for out in outs}
        stranded = [o for o in outs if placed[o.request_id] == "replica-0"]
        assert stranded, placed
        restart_s = _restart_on_the_same_address(stack, 0)
        assert restart_s < 5, restart_s
        victim = stranded[0]
        with sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
            client.cancel(victim.request_id)
            give_up = time.monotonic() + 10
            while not client.get_request(victim.request_id).finished:
                assert time.monotonic() < give_up, "a cancel of a request its restarted scheduler forgot never ended"
                time.sleep(0.05)
            assert client.get_request(victim.request_id).status == "CANCELLED"
        _finish(outs, threads)
        assert isinstance(victim.error, sdk.SluiceError) and "CANCELLED" in str(victim.error), victim.error
        others = [o for o in outs if o is not victim]
        _assert_exact(others)
        values = _assert_budgets_return_to_zero(stack)
        moved = _migrations(values, "replica_restarted")
        assert moved >= len(stranded) - 1, (moved, len(stranded))
        print(f"\nscheduler restarted in {restart_s:.2f} s: {int(moved)} of {len(stranded) - 1} stranded requests "
              f"moved (replica_restarted), 1 cancelled while stranded, all {len(others)} others exact")
