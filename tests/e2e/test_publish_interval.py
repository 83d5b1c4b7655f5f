"""End to end: the scheduler's --publish-interval-ms, through admission to the HTTP client and the gRPC SDK.

A cost-model stack (one replica, emulated round times of a few ms, so without an interval a request's tokens arrive
one round at a time; a cost-model token is one printable character in admission's tokenizer, so text counts
tokens) whose scheduler publishes at most once per 50 ms while rounds come faster.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from sluice import client as sdk
from sluice_tools.stack import Stack, StackConfig
from tests.e2e.test_openai_http import _sse_data
from tests.processes import scraped_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

TOKENS = 60


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("publish-interval")
    config = run_dir / "sluice.toml"
    config.write_text('[tenants.acme]\napi_keys = ["k-acme"]\n')  # the key tests.e2e.test_openai_http's helper sends
    with Stack(StackConfig(backend="costmodel", model="llama-3-8b", emulate_time=True, http_port=0, replicas=1,
                           run_dir=run_dir, config_file=str(config),
                           scheduler_args=("--publish-interval-ms", "50"))) as running:
        yield running


def _text_chunks(events: list[dict[str, Any] | str]) -> list[str]:
    return [e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"]
            and e["choices"][0]["finish_reason"] is None]


def test_spaced_publications_reach_the_client_whole_in_fewer_bigger_chunks(stack: Stack) -> None:
    """Over HTTP/1.1 (chunks written by the token reader), HTTP/1.0 and the gRPC SDK: the first token comes alone (it
    is published at once), the rest in chunks of several rounds' tokens, every token once (the text is the whole
    answer and the usage counts it); the scheduler's metric counts the publications that waited."""
    assert stack.admission is not None and stack.schedulers[0].metrics_url
    body = {"model": "llama-3-8b", "prompt": "count", "max_tokens": TOKENS, "stream": True, "temperature": 0.0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    for http10 in (False, True):
        events = _sse_data(stack, "/completions", body, http10=http10)
        chunks = _text_chunks(events)
        usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
        assert sum(map(len, chunks)) == TOKENS and usage[-1]["completion_tokens"] == TOKENS, (chunks, usage)
        assert len(chunks[0]) == 1 and len(chunks) <= TOKENS // 3, chunks  # one round a token would be 60 chunks
    with sdk.Client(stack.endpoint, api_key="k-acme", retry=sdk.RetryPolicy(max_attempts=1)) as client:
        messages = [c for c in client.generate("count", max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
                    if c.token_ids]
    sizes = [len(m.token_ids) for m in messages]
    assert sum(sizes) == TOKENS and sizes[0] == 1 and len(sizes) <= TOKENS // 3, sizes
    assert len("".join(m.text for m in messages)) == TOKENS
    scheduler = scraped_metrics(stack.schedulers[0].metrics_url)
    assert scheduler["sluice_publications_spaced_total"] >= 3
    assert scheduler["sluice_publications_spaced_batches_total"] >= 3 * scheduler["sluice_publications_spaced_total"]
