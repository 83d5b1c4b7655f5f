"""`sluice up`'s stack keeps the Redis password off command lines and out of its banner, and still works."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice import client as sdk
from sluice_tools.stack import Stack, StackConfig
from tests.processes import command_line

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def test_stack_passes_the_redis_password_by_environment_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded Redis has a random password; services get it in $SLUICE_REDIS_URL, workers not at all."""
    monkeypatch.delenv("SLUICE_REDIS_URL", raising=False)
    with Stack(StackConfig(replicas=1, backend="costmodel", model="llama-3-8b", run_dir=tmp_path)) as stack:
        assert stack.redis is not None and stack.redis.password and stack.redis._proc is not None
        password = stack.redis.password
        with sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
            assert len(client.generate_text([1, 2, 3, 4], max_tokens=4).token_ids) == 4  # tokens came over Redis
        pids = {proc.name: proc.popen.pid for proc in stack.procs if proc.popen is not None}
        for name, pid in {**pids, "redis": stack.redis._proc.pid}.items():
            line = command_line(pid)
            assert password not in line and "--redis-url" not in line, f"{name}: {line}"
        for name in ("router", "scheduler-0", "admission"):
            assert password.encode() in _environ(pids[name]), name
        assert password.encode() not in _environ(pids["worker-0"])
        banner = stack.describe()
        assert password not in banner and ":***@127.0.0.1" in banner
