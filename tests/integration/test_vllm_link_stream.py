"""The agent's reading of vLLM's completions stream, against a real HTTP server on loopback that sends the bytes
the test gives it (split where the test says): SSE lines cut anywhere, CRLF endings, a large event, an event that
does not parse, a stream cut before its finish. tests/engines reads real vLLM servers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest
from aiohttp import web

from scheduler_svc.core.request import Request
from scheduler_svc.engines.vllm.link import Chunk, EngineGone, EngineLink, EngineRefused
from sluice.types import NewRequest, SamplingParams
from tests.processes import serve_on_loopback


def _event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None, newline: bytes = b"\n") -> bytes:
    body = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny", "choices": choices,
            "usage": usage}
    return b"data: " + json.dumps(body).encode() + newline + newline


def _choice(ids: list[int], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
    return {"index": 0, "text": "x", "logprobs": logprobs, "finish_reason": finish, "stop_reason": None,
            "token_ids": ids, "prompt_token_ids": None}


def _stream(payload: bytes, cut: int) -> list[Chunk]:
    """What EngineLink.stream yields for a server that sends `payload` in pieces of `cut` bytes."""
    parts = [payload[i:i + cut] for i in range(0, len(payload), cut)]
    return asyncio.run(_read(parts))


async def _read(parts: Sequence[bytes]) -> list[Chunk]:
    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for part in parts:
            await response.write(part)
            await asyncio.sleep(0)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner, url = await serve_on_loopback(app)
    link = EngineLink(url, served_model="tiny")
    request = Request(NewRequest("r1", (5, 6, 7), SamplingParams(max_tokens=8)), 1)
    try:
        return [chunk async for chunk in link.stream(request)]
    finally:
        await link.close()
        await runner.cleanup()


def _whole(newline: bytes = b"\n") -> bytes:
    return (b": a comment line" + newline + _event([_choice([11])], newline=newline)
            + _event([_choice([12, 13])], newline=newline)
            + _event([_choice([14], finish="length")], newline=newline)
            + _event([], {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                          "prompt_tokens_details": {"cached_tokens": 2}}, newline=newline)
            + b"data: [DONE]" + newline + newline)


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
@pytest.mark.parametrize("cut", [1, 7, 1 << 20])
def test_chunks_are_the_same_however_the_bytes_arrive(newline: bytes, cut: int) -> None:
    """Byte by byte, in 7-byte pieces or at once, with LF or CRLF: the same chunks, the finish held for the usage
    event (its cached prompt tokens), comments skipped."""
    chunks = _stream(_whole(newline), cut)
    assert [(c.token_ids, c.finish_reason, c.cached_tokens) for c in chunks] == [
        ([11], None, 0), ([12, 13], None, 0), ([14], "length", 2)]


def test_a_large_merged_event_is_read_whole() -> None:
    """A chunk of 1,000 tokens with alternatives (a lagging API server merges its outputs), over 64 KiB and read in
    4 KiB pieces: one chunk, every token with its log-probabilities."""
    ids = list(range(1, 1001))
    logprobs = {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": [-0.5] * len(ids),
                "top_logprobs": [{f"token_id:{t}": -0.5, "token_id:9999": -1.5} for t in ids],
                "text_offset": [0] * len(ids)}
    big = _event([_choice(ids, logprobs=logprobs)])
    assert len(big) > 1 << 16
    chunks = _stream(big + _event([_choice([7], finish="stop")]) + b"data: [DONE]\n\n", 4096)
    assert chunks[0].token_ids == ids and chunks[0].logprobs is not None and len(chunks[0].logprobs) == len(ids)
    assert chunks[0].logprobs[0].top_token_ids == (1, 9999)
    assert (chunks[1].token_ids, chunks[1].finish_reason) == ([7], "stop")


@pytest.mark.parametrize("bad", [
    b"data: {not json\n\n", b'data: {"choices": [{"token_ids": ["x"]}]}\n\n',
    b'data: {"choices": [{"token_ids": [5], "logprobs": {"token_logprobs": ["high"], "top_logprobs": [{}]}}]}\n\n',
    b'data: {"choices": [{"token_ids": [5], "logprobs": {"token_logprobs": [-1.0], "top_logprobs": [{"x": -1}]}}]}\n\n'])
def test_an_event_that_does_not_parse_fails_the_request_naming_it(bad: bytes) -> None:
    """Broken JSON, token ids that are not integers, a log-probability that is not a number or an alternative not
    named by token id: EngineRefused (the request fails alone, with the reason), not an exception that kills the
    stream's task and leaves the request running."""
    with pytest.raises(EngineRefused, match="does not parse"):
        _stream(_event([_choice([11])]) + bad, 1 << 20)


def test_a_stream_cut_before_its_finish_is_the_engine_gone() -> None:
    with pytest.raises(EngineGone, match="without a finish"):
        _stream(_event([_choice([11])]) + _event([_choice([12])]), 5)
