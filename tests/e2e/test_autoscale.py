"""End to end: the planner under a running stack (`sluice up --autoscale`) adds replicas as load rises and
retires them as it falls, and every request ends with a status.

Real processes, cost-model replicas with modelled time, a planner configured for replicas that start in
seconds (`quick_planner_config`; the defaults are for GPU replicas that take over a minute).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from sluice import client as sdk
from sluice_tools.autoscale import Autoscaler, parse_bounds, quick_planner_config
from sluice_tools.stack import REPO_ROOT, Stack, StackConfig
from sluice_tools.supervisor import Supervisor
from tests.processes import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


class Load:
    """Closed-loop clients: `level` of them send requests back to back; every outcome is recorded."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.level = 0
        self.outcomes: list[str] = []
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(12)]

    def _client(self, i: int) -> None:
        with sdk.Client(self.stack.endpoint, api_key=self.stack.api_key) as client:
            n = 0
            while not self.stopped.is_set():
                if i >= self.level:
                    time.sleep(0.05)
                    continue
                n += 1
                status = "NO_STATUS"
                try:
                    for chunk in client.generate([i + 1, n % 97 + 1] * 16, max_tokens=60, ignore_eos=True,
                                                 timeout=30):
                        status = chunk.status or status
                except sdk.SluiceError as exc:
                    status = exc.code.name
                self.outcomes.append(status)

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(60)


def test_rising_then_falling_load_adds_and_retires_replicas(tmp_path: Path) -> None:
    """From 1 replica (bounds 1:3), a rising load makes the planner add replicas that become READY and serve;
    when the load stops, it drains and retires them back to 1; every request ended with a status."""
    lines: list[str] = []
    config = StackConfig(replicas=1, backend="costmodel", model="llama-3-8b", emulate_time=True, run_dir=tmp_path,
                         scheduler_args=("--max-num-seqs", "2"), start_timeout_s=60)
    with Stack(config) as stack:
        stack.fleet.supervisor = Supervisor(stack, on_event=lines.append)
        autoscaler = Autoscaler(stack, quick_planner_config(1, 3), period_s=0.5, on_event=lines.append)
        stack.fleet.supervisor.hooks.append(autoscaler.tick)
        metrics_url = autoscaler.serve_metrics()
        stack.fleet.start_supervising(0.1)
        with Load(stack) as load:
            for level in (2, 6, 12):  # rising
                load.level = level
                time.sleep(4)
            up = [e for e in autoscaler.events if e[1] == "scale_up"]
            assert up, lines
            seen = autoscaler.source.last
            assert seen is not None and seen.ttft_observed_s is not None and seen.tpot_observed_s is not None, seen
            assert seen.mean_input_tokens == pytest.approx(32, abs=1), seen  # [i + 1, n % 97 + 1] * 16
            assert seen.mean_output_tokens > 0, seen
            assert wait_until(lambda: any("READY replicas: replica-0, replica-1" in line for line in lines), 20), lines
            load.level = 0  # falling
            assert wait_until(lambda: any(e[1] == "scale_down" for e in autoscaler.events)
                         and len(stack.replicas) == 1, 40), lines
        assert any("retired" in line for line in lines), lines
        scraped = _scrape(metrics_url)
        assert scraped.get('sluice_planner_decisions_total{kind="scale_up"', 0) >= len(up), scraped
        assert scraped.get('sluice_planner_decisions_total{kind="scale_down"', 0) >= 1, scraped
        assert scraped.get("sluice_planner_current_replicas") is not None, scraped
        assert load.outcomes and all(status != "NO_STATUS" for status in load.outcomes)
        finished = sum(status == "FINISHED_LENGTH" for status in load.outcomes)
        assert finished / len(load.outcomes) > 0.95, sorted(set(load.outcomes))
        print("\n".join(lines))
        print(f"requests: {len(load.outcomes)}, finished {finished}, others {sorted(set(load.outcomes))}")


def _scrape(url: str) -> dict[str, float]:
    """Return the planner's samples, keyed by name (labels cut after the first one), summed over the rest."""
    samples: dict[str, float] = {}
    with urllib.request.urlopen(url, timeout=5) as reply:  # noqa: S310 (our own loopback endpoint)
        for line in reply.read().decode().splitlines():
            if line.startswith("sluice_planner"):
                name, _, value = line.rpartition(" ")
                key = name.split(",")[0]
                samples[key] = samples.get(key, 0.0) + float(value)
    return samples


def test_autoscale_bounds_are_checked_before_anything_starts() -> None:
    """`--autoscale` takes MIN:MAX with 1 <= MIN <= MAX; anything else is a usage error (exit 2), nothing started."""
    assert parse_bounds("1:3") == (1, 3)
    for bad in ("3:1", "0:2", "2", "a:b"):
        with pytest.raises(ValueError):
            parse_bounds(bad)
    done = subprocess.run([sys.executable, "-m", "sluice_tools.cli", "up", "--backend", "costmodel", "--model",
                           "llama-3-8b", "--port", "0", "--autoscale", "3:1"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--autoscale needs 1 <= MIN <= MAX" in done.stderr
