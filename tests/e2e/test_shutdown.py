"""End to end: a graceful stop lets in-flight requests finish while new ones are turned away."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

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
