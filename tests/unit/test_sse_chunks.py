"""The streamed text chunk from its template is the chunk the general path builds, byte for byte."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from admission_svc import openai_answers, openai_convert
from sluice.model_spec import ModelSpec, load_model_spec

TEXTS = ("hello", " ", 'a "quoted" \\ back\nslash', "naïve — ünïcode 世界 🙂", "\x00\x1f", "</script>")


@pytest.fixture(scope="module")
def spec(tiny_preset: Path) -> ModelSpec:
    """The tiny preset's spec (it has a chat template)."""
    return load_model_spec(tiny_preset, "tiny")


def _parse(spec: ModelSpec, chat: bool, **body: Any) -> openai_convert.ParsedRequest:
    if chat:
        return openai_convert.chat_request({"model": "", "messages": [{"role": "user", "content": "x"}],
                                            "stream": True, **body}, spec)
    return openai_convert.completion_request({"model": "", "prompt": "x", "stream": True, **body}, spec)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("usage", [False, True])
def test_template_chunk_equals_the_general_chunk(spec: ModelSpec, chat: bool, usage: bool) -> None:
    """For completions and a chat's later deltas, with and without include_usage, any text (quotes, control
    characters, non-ASCII) gives the same event bytes from the template as from chunk_body (the second aside)."""
    parsed = _parse(spec, chat, n=2, **({"stream_options": {"include_usage": True}} if usage else {}))
    texts = openai_answers.TextChunks(parsed, 'm"odel', "req-1")
    assert texts.applies
    for index in (0, 1):
        answer = openai_answers.ChoiceText(parsed, index, str)
        if chat:
            answer.choice("first", None, None)  # the first delta names the role: the general path's
        for text in TEXTS:
            general = openai_answers.sse_event(openai_answers.chunk_body(
                parsed, 'm"odel', "req-1", answer.choice(text, None, None)))
            fast = texts.event(index, text)
            assert _without_created(fast) == _without_created(general)


def _without_created(event: bytes) -> bytes:
    head, _, rest = event.partition(b'"created":')
    return head + rest[rest.index(b","):]


def test_template_does_not_apply_to_chunks_of_another_shape(spec: ModelSpec) -> None:
    """Log-probabilities, tools and token times change a chunk's shape: the template refuses those requests."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert not openai_answers.TextChunks(_parse(spec, False, logprobs=1), "m", "r").applies
    assert not openai_answers.TextChunks(_parse(spec, True, tools=tools), "m", "r").applies
    assert not openai_answers.TextChunks(_parse(spec, False, sluice_token_times=True), "m", "r").applies
