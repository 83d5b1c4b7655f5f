"""A long command is never silent when its output goes into a pipe (a CI log, `| tee`): `sluice sim` reports its
progress on stderr by default, throttled, and stdout keeps only the report."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = "synthetic:poisson?rate=20&n=200&input=fixed:64&output=fixed:16"


def _sim_through_a_pipe(*flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "sluice_tools.cli", "sim", WORKLOAD, "--replicas", "2", *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)  # pipes


def test_sim_piped_reports_progress_on_stderr_by_default() -> None:
    """With stderr a pipe and no flag, the run prints a progress line when it starts and one when it is done."""
    done = _sim_through_a_pipe()
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert any(line.startswith("  fcfs+score: simulated 0 s of the arrivals'") for line in lines), lines
    assert any(line.startswith("  fcfs+score: done, simulated ") for line in lines), lines
    assert "\r" not in done.stderr  # a pipe gets whole lines, not a terminal's rewritten one
    assert "arrivals'" not in done.stdout  # the report on stdout stays clean for `> report.txt`


def test_no_progress_silences_it() -> None:
    """`--no-progress` prints no progress line, even into a pipe."""
    done = _sim_through_a_pipe("--no-progress")
    assert done.returncode == 0, done.stderr
    assert "fcfs+score: simulated" not in done.stderr and "done, simulated" not in done.stderr
