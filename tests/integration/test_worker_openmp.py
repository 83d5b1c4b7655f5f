"""The torch worker's CPU thread pool spins briefly at its barriers, then sleeps (worker_svc.__main__.short_openmp_spin).

A real `python -m worker_svc` process with the tiny torch model; libgomp itself reports what it read when torch loads
it (OMP_DISPLAY_ENV=VERBOSE prints GOMP_SPINCOUNT, the spins a waiting thread makes before it sleeps: 300,000 by
default, 0 under the passive policy). An operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import stop_process, wait_until
from worker_svc.__main__ import OPENMP_SPIN_COUNT, short_openmp_spin

pytestmark = pytest.mark.timeout(120)


def _spin_count(env: dict[str, str], tmp_path: Path) -> int:
    """Start a torch worker with `env`; return the GOMP_SPINCOUNT its libgomp reports once torch is loaded."""
    log = tmp_path / "worker.err"
    env = {**env, "OMP_DISPLAY_ENV": "VERBOSE"}
    with log.open("wb") as err:
        worker = subprocess.Popen([sys.executable, "-m", "worker_svc", "--backend", "torch", "--model", "tiny",
                                   "--port", "0", "--host", "127.0.0.1", "--metrics-port", "0"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        def reported() -> re.Match[str] | None:
            assert worker.poll() is None, log.read_text(errors="replace")[-2000:]
            return re.search(r"GOMP_SPINCOUNT = '(\d+)'", log.read_text(errors="replace"))

        assert wait_until(reported, 90, poll_s=0.1), "the worker's libgomp never reported its environment"
        found = reported()
        assert found is not None
        return int(found.group(1))
    finally:
        stop_process(worker)


def test_a_torch_workers_threads_spin_briefly_unless_the_operator_said_otherwise(
        subprocess_env: dict[str, str], tmp_path: Path) -> None:
    env = {k: v for k, v in subprocess_env.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    assert _spin_count(env, tmp_path) == int(OPENMP_SPIN_COUNT)
    assert _spin_count({**env, "OMP_WAIT_POLICY": "PASSIVE"}, tmp_path) == 0


def test_the_spin_count_is_set_only_where_no_policy_is() -> None:
    environ: dict[str, str] = {}
    assert short_openmp_spin(environ) == OPENMP_SPIN_COUNT and environ == {"GOMP_SPINCOUNT": OPENMP_SPIN_COUNT}
    for given in ({"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "0"}):
        kept = dict(given)
        assert short_openmp_spin(kept) is None and kept == given
