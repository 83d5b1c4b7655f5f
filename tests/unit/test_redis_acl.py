"""Redis ACL users per role (sluice/redis_acl.py) on a real embedded Redis: each role's own Bus calls work,
other roles' writes and reads are refused with NOPERM; the Kubernetes ACL Secret matches the rules."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from redis.exceptions import NoPermissionError

from sluice.bus import Bus, redis_client
from sluice.redis_acl import Role, acl_file_text, key_of, rules, user_url
from sluice.redis_server import EmbeddedRedis
from sluice.v1 import events_pb2

NS = "aclns"
OWNER = "adm-1"
PASSWORDS = {role: f"pw-{role.value}-0123456789" for role in Role}
K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    acl = tmp_path_factory.mktemp("acl") / "users.acl"
    acl.write_text(acl_file_text(rules(NS, admission_owner=OWNER), PASSWORDS, "admin-pw"))
    with EmbeddedRedis(password="admin-pw", acl_file=acl) as server:
        yield server


def run_as(server: EmbeddedRedis, role: Role, body) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        client = redis_client(user_url(server.url, role.value, PASSWORDS[role]))
        try:
            await body(Bus(client, NS))
        finally:
            await client.aclose()
    asyncio.run(main())


async def refused(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(NoPermissionError):
        await call


def test_key_naming_is_the_bus_naming() -> None:
    """The ACL module's key naming is exactly Bus.key, so the patterns cover the real streams."""
    bus = Bus(redis_client("redis://127.0.0.1:1/0"), NS)
    assert key_of(NS, "tokens:x") == bus.key("tokens:x") and key_of(NS, "kv:1", "dead") == bus.key("kv:1", "dead")


def test_scheduler_publishes_but_reads_nothing(acl_redis: EmbeddedRedis) -> None:
    """A scheduler's user publishes tokens, completions and KV events, and can read no stream nor consume."""
    async def body(bus: Bus) -> None:
        assert await bus.ping()
        await bus.publish_token_batch(OWNER, events_pb2.TokenDeltaBatch())
        await bus.publish_token_batch("another-owner", events_pb2.TokenDeltaBatch())
        await bus.publish_completion(events_pb2.Completion(request_id="r1"))
        await bus.publish_kv(events_pb2.KvEventBatch(replica_id="replica-0"))
        await refused(bus.read_tokens(bus.tokens_stream(OWNER), "0", block_ms=10))
        await refused(bus.ensure_group("completions", "g"))
        await refused(bus.client.xrange(bus.key("completions")))
        await refused(bus.client.delete(bus.key("completions")))
        await refused(bus.client.publish("chan", b"x"))
    run_as(acl_redis, Role.SCHEDULER, body)


def test_router_consumes_kv_and_completions_only(acl_redis: EmbeddedRedis) -> None:
    """The router's user consumes KV shards and completions (group, read, ack) and cannot read token streams."""
    async def body(bus: Bus) -> None:
        seen: list[bytes] = []
        stop = asyncio.Event()

        async def handler(entry_id: str, payload: bytes, context: object) -> None:
            seen.append(payload)
            stop.set()
        await bus.consume(bus.kv_stream("replica-0"), "router-g", "router-1", handler, stop=stop, block_ms=50)
        assert seen  # the scheduler test's KV batch (or a fresh one) reached the router
        await bus.ensure_group("completions", "router-g")
        await refused(bus.read_tokens(bus.tokens_stream(OWNER), "0", block_ms=10))
        await refused(bus.client.xadd(bus.key(bus.tokens_stream(OWNER)), {"d": b""}))
        await refused(bus.client.keys("*"))
    run_as(acl_redis, Role.SCHEDULER, lambda bus: bus.publish_kv(events_pb2.KvEventBatch(replica_id="replica-0")))
    run_as(acl_redis, Role.ROUTER, body)


def test_admission_reads_its_own_tokens_and_cannot_forge_kv(acl_redis: EmbeddedRedis) -> None:
    """Admission's user reads its own token stream and consumes/publishes completions; it cannot publish KV
    events nor read another admission process's token stream."""
    async def body(bus: Bus) -> None:
        entries = await bus.read_tokens(bus.tokens_stream(OWNER), "0", block_ms=10)
        assert entries  # what the scheduler published for this owner
        await bus.publish_completion(events_pb2.Completion(request_id="attempt-2"))
        await bus.ensure_group("completions", "admission-g")
        await refused(bus.read_tokens(bus.tokens_stream("another-owner"), "0", block_ms=10))
        await refused(bus.publish_kv(events_pb2.KvEventBatch(replica_id="replica-0")))
        await refused(bus.ensure_group(bus.kv_stream("replica-0"), "evil"))
    run_as(acl_redis, Role.SCHEDULER, lambda bus: bus.publish_token_batch(OWNER, events_pb2.TokenDeltaBatch()))
    run_as(acl_redis, Role.ADMISSION, body)


def test_users_survive_a_restart(acl_redis: EmbeddedRedis) -> None:
    """A restarted embedded Redis reads the ACL file again: the same users and passwords work, the rules hold."""
    assert acl_redis.pid is not None
    os.kill(acl_redis.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while acl_redis.running and time.monotonic() < deadline:
        time.sleep(0.01)
    acl_redis.restart()

    async def body(bus: Bus) -> None:
        await bus.publish_kv(events_pb2.KvEventBatch(replica_id="replica-0"))
        await refused(bus.read_tokens(bus.tokens_stream(OWNER), "0", block_ms=10))
    run_as(acl_redis, Role.SCHEDULER, body)


def test_kubernetes_acl_secret_matches_the_rules_and_role_secrets(tmp_path: Path) -> None:
    """deploy/k8s's ACL file is rules("default") with the role Secrets' passwords (hashed), and a real Redis
    loaded with it lets each role in with its Secret's password."""
    docs = [d for d in yaml.safe_load_all((K8S / "05-secrets.yaml").read_text()) if d]
    secrets = {d["metadata"]["name"]: d["stringData"] for d in docs}
    passwords = {role: secrets[f"sluice-redis-{role.value}"]["password"] for role in Role}
    text = secrets["sluice-redis-acl"]["users.acl"]
    assert text == acl_file_text(rules("default"), passwords, secrets["sluice-redis"]["password"])
    assert hashlib.sha256(passwords[Role.ROUTER].encode()).hexdigest() in text
    assert passwords[Role.ROUTER] not in text
    acl = tmp_path / "users.acl"
    acl.write_text(text)
    with EmbeddedRedis(password=secrets["sluice-redis"]["password"], acl_file=acl) as server:
        async def body() -> None:
            for role in Role:
                client = redis_client(user_url(server.url, role.value, passwords[role]))
                assert await client.ping()
                await client.aclose()
        asyncio.run(body())


def test_user_url_keeps_host_port_db_and_query() -> None:
    """user_url replaces only the credentials, quoting them."""
    url = user_url("rediss://:old@127.0.0.1:6380/2?ssl_ca_certs=/ca.pem", "router", "p/w@")
    assert url == "rediss://router:p%2Fw%40@127.0.0.1:6380/2?ssl_ca_certs=/ca.pem"


def test_rules_refuse_a_malformed_namespace_and_escape_globs() -> None:
    """A namespace with ':' is refused; glob characters in an owner cannot widen admission's pattern."""
    with pytest.raises(ValueError):
        rules("a:b")
    rule = rules("ns", admission_owner="o*")[Role.ADMISSION]
    assert r"sluice:{ns:tokens:o\*}" in rule.keys


def test_redis_acl_command_creates_users_an_operators_redis_accepts(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`sluice redis-acl` writes 0600 password files (kept on a rerun) and prints ACL SETUSER commands that a
    real Redis accepts, after which each role logs in with its file's password and keeps its limits."""
    import shlex

    import redis

    from sluice_tools.cli import main

    args = ["redis-acl", "--namespace", NS, "--owner", OWNER, "--password-dir", str(tmp_path / "pw")]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0 and capsys.readouterr().out == first
    files = {role: tmp_path / "pw" / f"{role.value}.password" for role in Role}
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files.values())
    with EmbeddedRedis(password="admin-pw") as server:
        admin = redis.Redis.from_url(server.url)
        for line in first.splitlines():
            admin.execute_command(*shlex.split(line))
        router = redis.Redis.from_url(user_url(server.url, "router", files[Role.ROUTER].read_text().strip()))
        assert router.ping()
        with pytest.raises(NoPermissionError):
            router.xread({key_of(NS, f"tokens:{OWNER}"): "0"})
        admin.close()
        router.close()


def test_cluster_rules_let_a_cluster_client_work_within_its_role() -> None:
    """With `cluster=True`, each role's user on a real 2-node Redis Cluster connects through a cluster client
    and publishes a completion; the scheduler still cannot read."""
    import redis

    from sluice.redis_acl import acl_setuser_commands
    from sluice.redis_server import EmbeddedRedisCluster

    with EmbeddedRedisCluster(2, password="admin-pw") as cluster:
        for node in cluster.nodes:
            admin = redis.Redis.from_url(node.url)
            for command in acl_setuser_commands(rules(NS, cluster=True), PASSWORDS):
                admin.execute_command(*command)
            admin.close()

        async def body() -> None:
            for role in Role:
                client = redis_client(user_url(cluster.url, role.value, PASSWORDS[role]))
                bus = Bus(client, NS)
                assert await bus.publish_completion(events_pb2.Completion(request_id=role.value))
                if role is Role.SCHEDULER:
                    await refused(client.xrange(bus.key("completions")))
                await client.aclose()
        asyncio.run(body())
