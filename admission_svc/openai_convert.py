"""OpenAI's HTTP API <-> the front door: request bodies to `GenerateCall`s, `Output`s to response bodies.

No I/O: the HTTP edge (admission_svc/http_edge.py) reads the JSON, calls these and writes what they
return. A body is checked field by field and a wrong one raises `errors.InvalidArgument` naming the
field (OpenAI's `param`). Sampling values the client omits come from the model's
generation_config.json, then from OpenAI's own defaults (`OPENAI_DEFAULTS`).

What Sluice cannot do is refused by name rather than ignored: `n` other than 1, `logprobs`,
`top_logprobs`, `echo`, `best_of` above 1, `suffix`, `logit_bias`, non-zero penalties, tools and
non-text response formats (400 with the field). Extension fields: `priority`, `top_k`, `ignore_eos`,
and `sluice_token_times` (each streamed chunk then carries `sluice.created_unix_s`, when its first
token was made, so a client can measure what the path adds per token).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from admission_svc.calls import GenerateCall, Output
from admission_svc.stops import StopTrimmer, stop_strings_problem
from sluice import errors
from sluice.chat_template import ChatTemplateError
from sluice.model_spec import GenerationDefaults, ModelSpec
from sluice.types import SamplingParams
from sluice.v1 import common_pb2

OPENAI_DEFAULTS = GenerationDefaults(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=16)
"""OpenAI's defaults (max_tokens: the legacy completions default), used when neither the client nor
the model's generation_config.json sets a value."""

# Field -> the values that mean "not asked for"; anything else is a feature Sluice does not have.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "echo": (None, False), "suffix": (None, ""), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "functions": (None, []), "function_call": (None, "none", "auto"), "audio": (None,), "prediction": (None,),
}


@dataclass(frozen=True)
class ParsedRequest:
    """A checked OpenAI request: the front door's call and how to answer it."""

    call: GenerateCall
    chat: bool
    """True for /v1/chat/completions (chat.completion objects), False for /v1/completions."""
    stream: bool
    include_usage: bool
    """stream_options.include_usage: a last chunk with `usage` and no choices."""
    stops: tuple[str, ...]
    """Stop strings, cut from the text as OpenAI does (the worker stops on them)."""
    token_times: bool = False
    """The `sluice_token_times` extension: chunks carry their first token's creation time."""


def _bad(name: str, message: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(message, reason="invalid_request", field_name=name)


def _number(body: Mapping[str, Any], name: str, kind: type[int] | type[float]) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
        raise _bad(name, f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}"[:200])
    return kind(value)


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, f"{name} must be a boolean, got {value!r}"[:200])
    return value


def _stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _bad("stop", "stop must be a string or a list of strings")
    if (problem := stop_strings_problem(items)) is not None:
        raise _bad("stop", problem)
    return tuple(s for s in items if s)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    for name, fine in _UNSUPPORTED.items():
        if name in body and body[name] not in fine:
            raise _bad(name, f"{name}={body[name]!r} is not supported by Sluice"[:200])
    if not isinstance(body.get("model"), str):
        raise _bad("model", "model must be a string (GET /v1/models lists the one served)")


def _sampling(body: Mapping[str, Any], model: ModelSpec, max_tokens_field: str) -> SamplingParams:
    """Return the sampling values: the client's, else the model's defaults, else OpenAI's."""
    wanted = GenerationDefaults(temperature=_number(body, "temperature", float), top_p=_number(body, "top_p", float),
                                top_k=_number(body, "top_k", int),
                                max_new_tokens=_number(body, max_tokens_field, int))
    values = wanted.with_defaults(model.generation).with_defaults(OPENAI_DEFAULTS)
    return SamplingParams(temperature=values.temperature or 0.0, top_k=values.top_k or 0,
                          top_p=1.0 if values.top_p is None else values.top_p, seed=_number(body, "seed", int),
                          max_tokens=values.max_new_tokens or 0, stop_strings=_stops(body),
                          ignore_eos=_flag(body, "ignore_eos"))


def _request(body: Mapping[str, Any], model: ModelSpec, chat: bool, max_tokens_field: str,
             prompt: str | tuple[int, ...], idempotency_key: str) -> ParsedRequest:
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", "user must be a string")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options", "stream_options must be an object")
    sampling = _sampling(body, model, max_tokens_field)
    call = GenerateCall(prompt=prompt if isinstance(prompt, str) else "",
                        prompt_token_ids=prompt if isinstance(prompt, tuple) else (), model=body["model"],
                        sampling=sampling, priority=_number(body, "priority", int) or 0,
                        idempotency_key=idempotency_key, add_special_tokens=not chat,
                        operation="chat" if chat else "text_completion")
    return ParsedRequest(call, chat, _flag(body, "stream"), bool(options.get("include_usage")),
                         sampling.stop_strings, _flag(body, "sluice_token_times"))


def completion_request(body: Mapping[str, Any], model: ModelSpec, idempotency_key: str = "") -> ParsedRequest:
    """Return the checked request of a /v1/completions body; raises InvalidArgument naming the field."""
    _refuse_unsupported(body)
    return _request(body, model, False, "max_tokens", _prompt(body.get("prompt")), idempotency_key)


def _prompt(prompt: Any) -> str | tuple[int, ...]:
    """Return one prompt: a string, [string], a list of token ids, or [list of token ids]."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(prompt)
    raise _bad("prompt", "prompt must be a string or a list of token ids (one prompt per request)")


def chat_request(body: Mapping[str, Any], model: ModelSpec, idempotency_key: str = "") -> ParsedRequest:
    """Return the checked request of a /v1/chat/completions body, its messages rendered with the model's
    chat template; raises InvalidArgument naming the field."""
    _refuse_unsupported(body)
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise _bad("response_format", "only response_format {\"type\": \"text\"} is supported")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty list")
    try:
        prompt = model.render_chat([_message(m, i) for i, m in enumerate(messages)])
    except ChatTemplateError as exc:
        raise _bad("messages", f"cannot render the chat: {exc}"[:300]) from None
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _request(body, model, True, field, prompt, idempotency_key)


def _message(message: Any, index: int) -> dict[str, Any]:
    """Return a message with its content as one string (text parts joined)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _bad(f"messages[{index}]", "each message must be an object with a string role")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise _bad(f"messages[{index}].content", "only text content parts are supported")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise _bad(f"messages[{index}].content", "content must be a string or a list of text parts")
    return {**message, "content": content or ""}


# ---- responses ----------------------------------------------------------------------------------

def usage(record_usage: common_pb2.Usage) -> dict[str, Any]:
    """Return `usage` as OpenAI reports it."""
    prompt, completion = record_usage.input_tokens, record_usage.output_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": record_usage.cached_tokens}}


def response_id(request: ParsedRequest, request_id: str) -> str:
    """Return the response id OpenAI-style (`chatcmpl-` or `cmpl-` and Sluice's request id)."""
    return f"{'chatcmpl' if request.chat else 'cmpl'}-{request_id}"


def _choice(request: ParsedRequest, text: str | None, finish_reason: str | None, first: bool) -> dict[str, Any]:
    if not request.chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    key = "delta" if request.stream else "message"
    content: dict[str, Any] = {"role": "assistant"} if first or not request.stream else {}
    if text is not None:
        content["content"] = text
    return {"index": 0, key: content, "logprobs": None, "finish_reason": finish_reason}


def response_body(request: ParsedRequest, model_id: str, outputs: Sequence[Output]) -> dict[str, Any]:
    """Return the whole (non-streamed) response of a finished request; the last output carries the completion."""
    trimmer = StopTrimmer(request.stops)
    text = "".join(trimmer.push(o.text) for o in outputs) + trimmer.flush()
    completion = outputs[-1].completion
    assert completion is not None
    return {"id": response_id(request, outputs[-1].request_id),
            "object": "chat.completion" if request.chat else "text_completion", "created": int(time.time()),
            "model": model_id, "choices": [_choice(request, text, finish_reason(completion.finish_reason), True)],
            "usage": usage(completion.usage)}


def finish_reason(reason: str) -> str:
    """Return OpenAI's finish reason for Sluice's ("stop" and "length" are the same)."""
    return reason if reason in ("stop", "length") else "stop"


def chunk_body(request: ParsedRequest, model_id: str, request_id: str, text: str | None,
               finish: str | None = None, first: bool = False, with_usage: dict[str, Any] | None = None,
               created_unix_s: float = 0.0) -> dict[str, Any]:
    """Return one streamed chunk: new text, or the finish reason, or (with_usage) the usage-only last chunk.

    `created_unix_s`: when the chunk's first token was made (sent with the sluice_token_times extension)."""
    body: dict[str, Any] = {"id": response_id(request, request_id),
                            "object": "chat.completion.chunk" if request.chat else "text_completion",
                            "created": int(time.time()), "model": model_id,
                            "choices": [] if with_usage is not None else [_choice(request, text, finish, first)]}
    if request.include_usage:
        body["usage"] = with_usage
    if request.token_times and created_unix_s:
        body["sluice"] = {"created_unix_s": created_unix_s}
    return body


def models_body(model: ModelSpec, created: int) -> dict[str, Any]:
    """Return GET /v1/models: the one model this deployment serves."""
    return {"object": "list", "data": [model_card(model, created)]}


def model_card(model: ModelSpec, created: int) -> dict[str, Any]:
    """Return the model object of GET /v1/models/{id}."""
    return {"id": model.model_id, "object": "model", "created": created, "owned_by": "sluice",
            "max_model_len": model.max_model_len}
