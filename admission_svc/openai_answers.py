"""OpenAI response bodies from the front door's `Output`s: whole responses, streamed chunks, usage, and each
choice's text (stop strings cut, the echoed prompt first) and log-probabilities in the endpoint's shape.

No I/O. Log-probabilities: chat answers `logprobs.content`, one `{token, logprob, bytes, top_logprobs}` per
output token; completions answer `logprobs` with `tokens`, `token_logprobs`, `top_logprobs` (the chosen token
and the alternatives, by token text) and `text_offset` (characters into the returned text, echo included).

Tool calls (a chat with tools, admission_svc/openai_tools.py): a choice's text is held back until it finishes,
then parsed; calls found become `tool_calls` (streamed: in the last chunk, with `finish_reason: "tool_calls"`)
and the text left is the content.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from admission_svc.calls import Output
from admission_svc.openai_convert import ParsedRequest
from admission_svc.openai_tools import openai_tool_calls, parse_tool_calls
from admission_svc.stops import StopTrimmer
from sluice.model_spec import ModelSpec
from sluice.v1 import common_pb2


def usage(record_usage: common_pb2.Usage) -> dict[str, Any]:
    """Return `usage` as OpenAI reports it."""
    prompt, completion = record_usage.input_tokens, record_usage.output_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": record_usage.cached_tokens}}


def total_usage(request: ParsedRequest, usages: Sequence[common_pb2.Usage]) -> dict[str, Any]:
    """Return the `usage` of every choice together (choice order): each prompt's tokens counted once (as vLLM
    does for n > 1), output tokens and prefix-cache hits summed over every choice."""
    if len(usages) == 1:
        return usage(usages[0])
    prompt = sum(u.input_tokens for i, u in enumerate(usages) if i % request.n == 0)
    completion = sum(u.output_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in usages)}}


def response_id(request: ParsedRequest, request_id: str) -> str:
    """Return the response id OpenAI-style (`chatcmpl-` or `cmpl-` and Sluice's request id)."""
    return f"{'chatcmpl' if request.chat else 'cmpl'}-{request_id}"


def finish_reason(reason: str) -> str:
    """Return OpenAI's finish reason for Sluice's ("stop" and "length" are the same)."""
    return reason if reason in ("stop", "length") else "stop"


class ChoiceText:
    """One choice's answer as its outputs arrive: text with stop strings cut (and the echoed prompt first), and
    log-probabilities in the endpoint's shape (`token_text` names a token: the tokenizer's text of it)."""

    def __init__(self, request: ParsedRequest, index: int, token_text: Callable[[int], str]) -> None:
        self.request = request
        self.index = index
        self.token_text = _token_id_text if request.tokens_as_ids else token_text
        self.trimmer = StopTrimmer(request.stops)
        self.echo = request.echo[request.prompt_index(index)] if request.echo else ""
        self.offset = len(self.echo)
        """Characters of text before the next token (completions' logprobs.text_offset)."""
        self.first = True
        self.held = ""
        """(tools) The text so far, parsed when the choice finishes."""
        self.tool_calls: list[dict[str, Any]] = []
        """(tools) The calls parsed from the finished text."""

    def piece(self, output: Output) -> tuple[str, dict[str, Any] | None]:
        """Return the text `output` lets show (the echo before the first) and its tokens' log-probabilities."""
        text = self.trimmer.push(output.text)
        if output.completion is not None:
            text += self.trimmer.flush()
        if self.echo:
            text, self.echo = self.echo + text, ""
        if self.request.tools is not None:
            text = self._tool_text(text, output.completion is not None)
        if self.request.logprobs is None or output.completion is not None:
            return text, None
        return text, self._logprobs(output.token_ids, output.logprobs)

    def _tool_text(self, text: str, finished: bool) -> str:
        """Hold the text back until the choice finishes; then return its content with the tool calls cut out."""
        self.held += text
        if not finished:
            return ""
        assert self.request.tools is not None
        content, self.tool_calls = parse_tool_calls(self.held, self.request.tools)
        return content or ""

    def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[common_pb2.TokenLogprobs]) -> dict[str, Any]:
        name = self.token_text
        if self.request.chat:
            return {"content": [{**_chat_logprob(name(token), got.logprob),
                                 "top_logprobs": [_chat_logprob(name(t), lp) for t, lp in zip(
                                     got.top_token_ids, got.top_logprobs, strict=False)]}
                                for token, got in zip(token_ids, logprobs, strict=False)]}
        body: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for token, got in zip(token_ids, logprobs, strict=False):
            text = name(token)
            body["text_offset"].append(self.offset)
            self.offset += len(text)
            body["tokens"].append(text)
            body["token_logprobs"].append(got.logprob)
            top = {name(t): lp for t, lp in zip(got.top_token_ids, got.top_logprobs, strict=False)}
            body["top_logprobs"].append({text: got.logprob, **top})
        return body

    def choice(self, text: str | None, finish: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        """Return this choice's object (a streamed delta or the whole message)."""
        wanted = self.request.logprobs is not None
        if not self.request.chat:
            return {"index": self.index, "text": text or "", "logprobs": logprobs if wanted else None,
                    "finish_reason": finish}
        key = "delta" if self.request.stream else "message"
        content: dict[str, Any] = {"role": "assistant"} if self.first or not self.request.stream else {}
        self.first = False
        if text is not None:
            content["content"] = text
        if self.tool_calls and (finish is not None or not self.request.stream):
            if not self.request.stream and not text:
                content["content"] = None
            content["tool_calls"] = openai_tool_calls(self.tool_calls, self.request.stream)
            finish = "tool_calls" if finish == "stop" else finish
        return {"index": self.index, key: content, "logprobs": logprobs if wanted else None, "finish_reason": finish}


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def _chat_logprob(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}


def _merge_logprobs(into: dict[str, Any] | None, more: dict[str, Any] | None) -> dict[str, Any] | None:
    if more is None:
        return into
    if into is None:
        return more
    for key, values in more.items():
        into[key].extend(values)
    return into


def response_body(request: ParsedRequest, model_id: str, choices: Sequence[Sequence[Output]],
                  token_text: Callable[[int], str] = str) -> dict[str, Any]:
    """Return the whole (non-streamed) response of finished requests, one list of outputs per choice in choice
    order; the last output of each carries its completion."""
    bodies, usages = [], []
    for index, outputs in enumerate(choices):
        answer, text, logprobs = ChoiceText(request, index, token_text), "", None
        for output in outputs:
            piece, more = answer.piece(output)
            text, logprobs = text + piece, _merge_logprobs(logprobs, more)
        completion = outputs[-1].completion
        assert completion is not None
        if request.logprobs is not None and logprobs is None:
            logprobs = {"content": []} if request.chat else {"text_offset": [], "token_logprobs": [], "tokens": [],
                                                              "top_logprobs": []}
        bodies.append(answer.choice(text, finish_reason(completion.finish_reason), logprobs))
        usages.append(completion.usage)
    return {"id": response_id(request, choices[0][-1].request_id),
            "object": "chat.completion" if request.chat else "text_completion", "created": int(time.time()),
            "model": model_id, "choices": bodies, "usage": total_usage(request, usages)}


def chunk_body(request: ParsedRequest, model_id: str, request_id: str, choice: dict[str, Any] | None,
               with_usage: dict[str, Any] | None = None, created_unix_s: float = 0.0) -> dict[str, Any]:
    """Return one streamed chunk: one choice's new text or finish reason, or (with_usage) the usage-only last chunk.

    `created_unix_s`: when the chunk's first token was made (sent with the sluice_token_times extension)."""
    body: dict[str, Any] = {"id": response_id(request, request_id),
                            "object": "chat.completion.chunk" if request.chat else "text_completion",
                            "created": int(time.time()), "model": model_id,
                            "choices": [] if choice is None else [choice]}
    if request.include_usage:
        body["usage"] = with_usage
    if request.token_times and created_unix_s:
        body["sluice"] = {"created_unix_s": created_unix_s}
    return body


def sse_event(body: dict[str, Any]) -> bytes:
    """Return `body` as one server-sent event (compact JSON, ASCII: non-ASCII text is escaped)."""
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()


class TextChunks:
    """The streamed chunk of one choice's new text as a server-sent event, from a template in which only the
    text, the choice index and the second change: byte for byte `sse_event(chunk_body(...))` of that choice
    with no finish reason and no log-probabilities. `applies` says when a request's chunks have that shape
    (no log-probabilities, no tools, no token times; a chat's first delta, which names the role, excepted)."""

    def __init__(self, request: ParsedRequest, model_id: str, request_id: str) -> None:
        dumps = json.dumps
        self.applies = request.logprobs is None and request.tools is None and not request.token_times
        self._head = (f'data: {{"id":{dumps(response_id(request, request_id))},"object":'
                      f'{dumps("chat.completion.chunk" if request.chat else "text_completion")},"created":')
        self._model = f',"model":{dumps(model_id)},"choices":[{{"index":'
        self._text = ',"delta":{"content":' if request.chat else ',"text":'
        self._tail = ('}' if request.chat else '') + ',"logprobs":null,"finish_reason":null}]' + (
            ',"usage":null' if request.include_usage else '') + '}\n\n'

    def event(self, index: int, text: str) -> bytes:
        """Return the event of choice `index`'s `text` (a chat's delta after its first)."""
        return (f"{self._head}{int(time.time())}{self._model}{index}{self._text}{json.dumps(text)}"
                f"{self._tail}").encode()


def models_body(model: ModelSpec, created: int) -> dict[str, Any]:
    """Return GET /v1/models: the one model this deployment serves."""
    return {"object": "list", "data": [model_card(model, created)]}


def model_card(model: ModelSpec, created: int) -> dict[str, Any]:
    """Return the model object of GET /v1/models/{id}."""
    return {"id": model.model_id, "object": "model", "created": created, "owned_by": "sluice",
            "max_model_len": model.max_model_len}
