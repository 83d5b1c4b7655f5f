"""Bad input to the CLI ends in one line naming the problem and a non-zero exit: never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = "synthetic:poisson?rate=5&n=3&input=fixed:8&output=fixed:4"


def _sluice(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SLUICE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "sluice_tools.cli", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=90)


def _bad_config(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return name  # relative on purpose: the CLI must resolve it against its own working directory


CASES = {
    "priority out of int32": (["generate", "hi", "--priority", "-99999999999"], "outside the 32-bit range"),
    "synthetic rate not a number": (["sim", "synthetic:gamma?rate=abc"], "rate='abc' is not a number"),
    "disagg split with an empty side": (["sim", WORKLOAD, "--disagg", "0:8"], "at least one replica on each side"),
    "disagg split not P:D": (["sim", WORKLOAD, "--disagg", "3"], "--disagg wants P:D"),
    "disagg with reversed autoscale bounds": (["sim", WORKLOAD, "--disagg", "1:1", "--autoscale", "3:1"],
                                              "need MIN:MAX with 1 <= MIN <= MAX"),
    "disagg all with autoscale": (["sim", WORKLOAD, "--disagg", "all", "--autoscale", "1:2"],
                                  "--disagg all compares fixed splits"),
    "up disagg split with an empty side": (["up", "--disagg", "1:0", "--port", "0"], "at least one replica on each side"),
    "up disagg split not P:D": (["up", "--disagg", "2-2", "--port", "0"], "--disagg wants P:D"),
    "up disagg with bad autoscale bounds": (["up", "--disagg", "1:1", "--autoscale", "3:1", "--port", "0"],
                                            "--autoscale needs 1 <= MIN <= MAX"),
    "up disagg on vLLM engines": (["up", "--disagg", "1:1", "--engine", "vllm", "--port", "0"],
                                  "--disagg needs Sluice workers"),
    "up worker flag for vLLM engines": (["up", "--engine", "vllm", "--worker-arg=--host-blocks", "--port", "0"],
                                        "--worker-arg is for Sluice's own workers"),
    "up scheduler flag the scheduler refuses": (["up", "--backend", "costmodel", "--model", "llama-3-8b", "--port", "0",
                                                 "--http-port", "0", "--worker-arg=--host-blocks", "--worker-arg=0",
                                                 "--scheduler-arg=--host-prefix-cache"],
                                                "--host-prefix-cache needs host blocks"),
    "missing model directory": (["up", "--model", "no/such/dir", "--port", "0"], "neither a preset"),
    "unknown cost-model shape": (["up", "--backend", "costmodel", "--model", "gpt9", "--port", "0"],
                                 "unknown model 'gpt9'"),
    "unreachable Redis": (["up", "--redis-url", "redis://127.0.0.1:1", "--port", "0"], "cannot use Redis"),
    "unreachable Redis Cluster": (["up", "--redis-url", "redis+cluster://127.0.0.1:1", "--port", "0"],
                                  "cannot use Redis (RedisClusterException"),
    "bench target unreachable": (["bench", "--target", "127.0.0.1:1", WORKLOAD], "cannot reach admission"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line_and_non_zero(tmp_path: Path, case: str) -> None:
    """Each bad input exits non-zero with one error line that names the bad value, and no traceback."""
    args, expected = CASES[case]
    done = _sluice(tmp_path, *args)
    assert done.returncode != 0, done
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr and expected in lines[-1], done.stderr


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("bad.toml", "[budgets\nx = 1\n", "bad.toml"),
    ("bad.json", '{"budgets": 3}', "budgets"),
])
def test_bad_config_file_is_refused_before_anything_starts(tmp_path: Path, name: str, text: str,
                                                           expected: str) -> None:
    """A malformed config given by a relative path is refused in one line before any process starts."""
    done = _sluice(tmp_path, "up", "--config", _bad_config(tmp_path, name, text), "--port", "0")
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert expected in done.stderr.strip().splitlines()[-1] and "starting Redis" not in done.stderr, done.stderr
