"""End to end: a stall elsewhere must not cost a live admission process its requests.

Admission renews an owner lease at every scheduler holding its requests, and a scheduler cancels the requests of
an owner whose lease lapsed (`owner_gone`), which is right when admission died (tests/e2e/test_faults.py) and
wrong when it lives. Two stalls, each made real with SIGSTOP on a real stack (cost-model worker, emulated time):
- the router stops while a request waits its turn: admission's watchdog asks the router about the quiet request
  and waits up to its downstream timeout (10 s), which must not stop the renewals (they used to ride its tick);
- a scheduler stops for longer than a lease: on waking, its sweep must not cancel the owners whose renewals it
  could not read while it was stopped.
In both every stream must end with all its tokens, exactly the untouched run's.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from sluice_tools.stack import Proc, Stack, StackConfig
from tests.e2e.test_migration_stack import MODEL, Streamed, _assert_exact, _run_all
from tests.processes import scraped_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

MAX_TOKENS = 1500
"""Enough that the first request still runs (and the second still waits) after a 5 s lease at ~4 ms a round."""


def _stack(tmp_path: Path) -> Stack:
    """One replica that runs one sequence at a time: the second request waits, quiet, behind the first."""
    return Stack(StackConfig(replicas=1, backend="costmodel", model=MODEL, emulate_time=True, run_dir=tmp_path,
                             scheduler_args=("--max-num-seqs", "1")))


def _run_with_a_stop(stack: Stack, proc: Proc, stop_s: float) -> list[Streamed]:
    outs = [Streamed([1 + (i * 7 + j) % 200 for j in range(24 + i)]) for i in range(2)]
    threads = _run_all(stack, outs, MAX_TOKENS)
    give_up = time.monotonic() + 60
    while not outs[0].tokens:  # the first runs; the second waits behind it
        assert time.monotonic() < give_up and not any(o.error for o in outs)
        time.sleep(0.02)
    assert proc.popen is not None
    proc.popen.send_signal(signal.SIGSTOP)
    try:
        time.sleep(stop_s)
    finally:
        proc.popen.send_signal(signal.SIGCONT)
    for thread in threads:
        thread.join(120)
    return outs


def test_a_stopped_router_does_not_stop_admissions_lease_renewals(tmp_path: Path) -> None:
    """The router stopped for 8 s while the second request is quiet (> the 2 s stall time): admission's watchdog
    waits on ListReplicas, the renewals go on, and both requests end whole (they were cancelled `owner_gone`)."""
    with _stack(tmp_path) as stack:
        assert stack.router is not None
        outs = _run_with_a_stop(stack, stack.router, 8.0)
        _assert_exact(outs, MAX_TOKENS)
        assert sum(s.cancelled for s in stack.scheduler_stats()) == 0


def test_a_scheduler_stopped_longer_than_a_lease_keeps_its_owners_requests(tmp_path: Path) -> None:
    """The scheduler stopped for 7 s (a lease is 5 s; the router's heartbeat timeout 10 s, so nothing moves): on
    waking its sweep extends the leases by the time it did not run instead of cancelling every request of an
    admission whose renewals sat unread in its socket."""
    with _stack(tmp_path) as stack:
        outs = _run_with_a_stop(stack, stack.schedulers[0], 7.0)
        _assert_exact(outs, MAX_TOKENS)
        assert sum(s.cancelled for s in stack.scheduler_stats()) == 0
        late = scraped_metrics(stack.schedulers[0].metrics_url)["sluice_owner_lease_sweep_late_seconds_total"]
        assert 6.0 <= late < 60.0  # the stop, counted once (and any later stall of a loaded machine)
