"""`sluice up`'s stack keeps the Redis password off command lines and out of its banner, and still works."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from redis.exceptions import NoPermissionError

from sluice import client as sdk
from sluice.bus import redis_client
from sluice.redis_acl import Role
from sluice_tools.stack import Stack, StackConfig
from tests.processes import command_line

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def test_stack_passes_the_redis_password_by_environment_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ACL users, the embedded Redis has a random password; services get it in $SLUICE_REDIS_URL,
    workers not at all."""
    monkeypatch.delenv("SLUICE_REDIS_URL", raising=False)
    with Stack(StackConfig(replicas=1, backend="costmodel", model="llama-3-8b", run_dir=tmp_path,
                           redis_acl=False)) as stack:
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


def test_stack_gives_each_service_its_own_redis_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ACL users (the default), a request and a cancel work end to end; each service holds only its own
    role's password (none the operator's), the ACL file is 0600 without passwords, and the role URLs are
    refused what other roles do."""
    monkeypatch.delenv("SLUICE_REDIS_URL", raising=False)
    config = StackConfig(replicas=1, backend="costmodel", model="llama-3-8b", run_dir=tmp_path, emulate_time=True)
    with Stack(config) as stack:
        assert stack.redis is not None and stack.redis.password and set(stack.role_urls) == set(Role)
        with sdk.Client(stack.endpoint, api_key=stack.api_key) as client:
            assert len(client.generate_text([1, 2, 3, 4], max_tokens=4).token_ids) == 4  # tokens came over Redis
            stream = client.generate([5, 6, 7, 8], max_tokens=2000, ignore_eos=True, timeout=60)
            first = next(stream)
            assert client.cancel(first.request_id) in {"CANCELLING", "CANCELLED"}
            with pytest.raises(sdk.Cancelled):
                for _ in stream:
                    pass
        pids = {proc.name: proc.popen.pid for proc in stack.procs if proc.popen is not None}
        role_of = {"router": Role.ROUTER, "scheduler-0": Role.SCHEDULER, "admission": Role.ADMISSION}
        for name, role in role_of.items():
            environ = _environ(pids[name])
            assert stack.role_urls[role].encode() in environ, name
            assert stack.redis.password.encode() not in environ, name
            assert all(url.encode() not in environ for other, url in stack.role_urls.items() if other != role)
            assert stack.role_urls[role] not in command_line(pids[name])
        acl = tmp_path / "redis-users.acl"
        assert acl.stat().st_mode & 0o777 == 0o600
        assert all(url.rsplit("@", 1)[0].rsplit(":", 1)[1] not in acl.read_text() for url in stack.role_urls.values())

        async def refusals() -> None:
            scheduler = redis_client(stack.role_urls[Role.SCHEDULER])
            router = redis_client(stack.role_urls[Role.ROUTER])
            for call in (scheduler.xrange(f"sluice:{{{config.namespace}:tokens:{stack.admission_owner}}}"),
                         router.xread({f"sluice:{{{config.namespace}:tokens:{stack.admission_owner}}}": "0"}),
                         scheduler.flushall()):
                with pytest.raises(NoPermissionError):
                    await call
            await scheduler.aclose()
            await router.aclose()
        asyncio.run(refusals())
