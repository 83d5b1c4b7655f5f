"""End to end: admission's --stream-interval (vLLM's --stream-interval) over HTTP and over the gRPC SDK.

A cost-model stack (one replica, emulated round times, so a request's tokens arrive one round at a time; a
cost-model token is one printable character in admission's tokenizer, so text counts tokens) whose admission holds
a stream's tokens, after the first, until 4 wait.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sluice import client as sdk
from sluice_tools.stack import Stack, StackConfig
from tests.e2e.test_openai_http import _sse_data
from tests.processes import scraped_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

INTERVAL = 4
TOKENS = 30


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("interval")
    config = run_dir / "sluice.toml"
    config.write_text('[tenants.acme]\napi_keys = ["k-acme"]\n')  # the key tests.e2e.test_openai_http's helper sends
    with Stack(StackConfig(backend="costmodel", model="llama-3-8b", emulate_time=True, http_port=0, replicas=1,
                           run_dir=run_dir, config_file=str(config),
                           admission_args=("--stream-interval", str(INTERVAL)))) as running:
        yield running


def _text_chunks(events: list[dict[str, Any] | str]) -> list[str]:
    return [e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"]
            and e["choices"][0]["finish_reason"] is None]


def test_a_stream_sends_its_first_token_at_once_then_chunks_of_the_interval_and_the_rest_with_the_finish(
        stack: Stack) -> None:
    """Over HTTP/1.1 (chunks written by the token reader) and HTTP/1.0 (the request task's way) alike: the first
    text chunk is one token, every later one but the last carries at least 4, and together they are the whole
    answer; the gRPC SDK's messages follow the same rule. (A cost-model token depends on the request's id, so the
    three requests' texts differ; one character a token.)"""
    assert stack.admission is not None
    body = {"model": "llama-3-8b", "prompt": "count", "max_tokens": TOKENS, "stream": True, "temperature": 0.0,
            "ignore_eos": True}
    at_once = 'sluice_admission_http_stream_events_total{way="at_once"}'
    before = scraped_metrics(stack.admission.metrics_url)[at_once]
    for http10 in (False, True):
        chunks = _text_chunks(_sse_data(stack, "/completions", body, http10=http10))
        assert sum(map(len, chunks)) == TOKENS, chunks
        assert len(chunks[0]) == 1 and all(len(c) >= INTERVAL for c in chunks[1:-1]), chunks
        assert len(chunks) <= 2 + (TOKENS - 1) // INTERVAL, chunks
        if not http10:
            assert scraped_metrics(stack.admission.metrics_url)[at_once] > before  # held, then written at once
    with sdk.Client(stack.endpoint, api_key="k-acme", retry=sdk.RetryPolicy(max_attempts=1)) as client:
        messages = [c for c in client.generate("count", max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
                    if c.token_ids]
    sizes = [len(m.token_ids) for m in messages]
    assert sum(sizes) == TOKENS and sizes[0] == 1 and all(s >= INTERVAL for s in sizes[1:-1]), sizes
    assert len(sizes) <= 2 + (TOKENS - 1) // INTERVAL and len("".join(m.text for m in messages)) == TOKENS


def test_admission_refuses_a_stream_interval_below_one(tmp_path: Path) -> None:
    """--stream-interval 0 is a startup error naming the flag, not a stream that never sends."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "admission_svc", "--port", "0", "--stream-interval", "0"],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode != 0 and "--stream-interval must be at least 1" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("asked, held", [(8, 8), (2, INTERVAL)])
def test_a_requests_stream_interval_holds_more_tokens_but_never_fewer_than_admissions(stack: Stack, asked: int,
                                                                                      held: int) -> None:
    """vLLM's per-request `stream_interval`: the larger of it and admission's --stream-interval (4) applies, so 8
    sends chunks of at least 8 after the first and 2 still chunks of at least 4."""
    body = {"model": "llama-3-8b", "prompt": "count", "max_tokens": TOKENS, "stream": True, "temperature": 0.0,
            "ignore_eos": True, "stream_interval": asked}
    chunks = _text_chunks(_sse_data(stack, "/completions", body, http10=False))
    assert sum(map(len, chunks)) == TOKENS and len(chunks[0]) == 1, chunks
    assert all(len(c) >= held for c in chunks[1:-1]) and len(chunks) <= 2 + (TOKENS - 1) // held, chunks
