"""End to end: a graceful stop lets in-flight requests finish while new ones are turned away."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from scheduler_svc.publisher import GRACE_AFTER_GIVING_UP_S, PUBLISH_GRACE_S
from sluice import client as sdk
from sluice_tools.stack import Stack, StackConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_graceful_stop_finishes_in_flight_streams(tmp_path: Path) -> None:
    """During Stack.stop() a running stream still receives every token, and all processes exit afterwards."""
    stack = Stack(StackConfig(replicas=1, backend="costmodel", model="llama-3-8b", emulate_time=True,
                              run_dir=tmp_path)).start()
    outcome: dict[str, object] = {}
    started = threading.Event()

    def stream() -> None:
        with sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
            tokens = 0
            try:
                for chunk in client.generate([1, 2, 3, 4] * 8, max_tokens=400, ignore_eos=True, timeout=60):
                    tokens += len(chunk.token_ids)
                    started.set()
                    outcome["status"] = chunk.status
            except sdk.SluiceError as exc:
                outcome["error"] = exc
            outcome["tokens"] = tokens

    worker = threading.Thread(target=stream)
    worker.start()
    assert started.wait(30)
    began = time.monotonic()
    stack.stop()
    worker.join(30)
    assert "error" not in outcome, outcome
    assert outcome["tokens"] == 400 and outcome["status"] == "FINISHED_LENGTH"
    assert time.monotonic() - began < stack.config.drain_timeout_s + 30
    assert not any(proc.alive() for proc in [*stack.workers, *stack.schedulers])


def test_a_scheduler_stopped_while_redis_is_gone_exits(tmp_path: Path) -> None:
    """SIGTERM to a scheduler whose Redis was killed -9 mid-stream: it drains, gives up on the publications Redis
    will never take after the publisher's grace, and exits (its drain's flush waited for them for ever: such a
    scheduler was found still retrying 35 minutes after its stop), without waiting a second grace when it stops."""
    stack = Stack(StackConfig(replicas=1, backend="costmodel", model="llama-3-8b", emulate_time=True,
                              run_dir=tmp_path, drain_timeout_s=2.0)).start()
    started = threading.Event()

    def stream() -> None:
        with contextlib.suppress(sdk.SluiceError), sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
            for _ in client.generate([1, 2, 3, 4] * 8, max_tokens=2000, ignore_eos=True, timeout=60):
                started.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    try:
        assert started.wait(30)
        assert stack.redis is not None and stack.redis.pid is not None
        os.kill(stack.redis.pid, signal.SIGKILL)
        time.sleep(1.0)  # rounds go on; their tokens queue in the publisher, which retries
        scheduler = stack.schedulers[0].popen
        assert scheduler is not None
        scheduler.send_signal(signal.SIGTERM)
        # drain (2 s) + the handed-off requests' wait (at most 10 s: their ends cannot be published) + the drain's
        # flush (PUBLISH_GRACE_S) + the stop's short grace after it gave up (test_publisher_stop.py) + margin
        scheduler.wait(timeout=2.0 + 10 + PUBLISH_GRACE_S + GRACE_AFTER_GIVING_UP_S + 15)
    finally:
        stack.stop()
