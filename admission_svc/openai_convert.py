"""OpenAI's HTTP API <-> the front door: request bodies to `GenerateCall`s, `Output`s to response bodies.

No I/O: the HTTP edge (admission_svc/http_edge.py) reads the JSON, calls these and writes what they
return. A body is checked field by field and a wrong one raises `errors.InvalidArgument` naming the
field (OpenAI's `param`). Sampling values the client omits come from the model's
generation_config.json, then from OpenAI's own defaults (`OPENAI_DEFAULTS`); a chat without max_tokens
gets the rest of the model length after its prompt (vLLM's default).

One body can ask for several choices: `n` samples of each prompt, and (completions) a list of prompts.
Each choice is its own request inside (`ParsedRequest.calls`, choice i*n + j is sample j of prompt i, as
vLLM orders them); sample j of a seeded request uses seed + j, so the n samples differ.

Structured output: `response_format` json_object or json_schema (chat and completions) becomes the request's
JSON schema (`SamplingParams.json_schema`, sluice/structured.py), checked here so a schema the grammar cannot
express is a 400 naming `response_format`. Chat `tools` / `tool_choice`: admission_svc/openai_tools.py.

What Sluice cannot do is refused by name rather than ignored: `best_of` other than n, `suffix`, the legacy
`functions` / `function_call`, audio, predictions, vLLM's guided_* and structured_outputs fields (400 with the
field), and `echo` with `logprobs` (prompt log-probabilities). Extension fields (vLLM's): `priority`, `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `return_tokens_as_token_ids`; and `sluice_token_times` (each streamed chunk then carries
`sluice.created_unix_s`, when its first token was made, so a client can measure what the path adds per token).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from admission_svc.calls import GenerateCall
from admission_svc.openai_tools import ToolPlan, tool_plan
from admission_svc.ranges import INT64
from admission_svc.stops import stop_strings_problem
from sluice import errors
from sluice.chat_template import ChatTemplateError
from sluice.model_spec import GenerationDefaults, ModelSpec
from sluice.structured import JSON_OBJECT_SCHEMA, SchemaError, schema_regex, schema_text
from sluice.types import MAX_LOGPROBS, SamplingParams

OPENAI_DEFAULTS = GenerationDefaults(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=16)
"""OpenAI's defaults (max_tokens: the legacy completions default), used when neither the client nor
the model's generation_config.json sets a value."""

MAX_CHOICES = 128
"""The most choices (prompts x n) one body may ask for: each is a request of its own."""

MAX_STREAM_INTERVAL = 1 << 20
"""The largest `stream_interval` taken (vLLM sets no ceiling; any larger one streams the same: first token, rest)."""

# Field -> the values that mean "not asked for"; anything else is a feature Sluice does not have.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""), "functions": (None, []), "function_call": (None, "none", "auto"), "audio": (None,), "prediction": (None,),
    "prompt_logprobs": (None, 0), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "structured_outputs": (None,),
    # vLLM extensions Sluice does not have, refused unless left at vLLM's default
    "min_tokens": (None, 0), "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "truncate_prompt_tokens": (None,), "length_penalty": (None, 1, 1.0),
    "bad_words": (None, []), "allowed_token_ids": (None,), "use_beam_search": (None, False),
    "logprob_token_ids": (None, []), "continuous_usage_stats": (None, False), "cache_salt": (None, ""),
}

ACCEPTED_FIELDS = (
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "seed", "stop", "stop_token_ids",
    "ignore_eos", "n", "best_of", "logprobs", "top_logprobs", "return_tokens_as_token_ids", "echo", "stream",
    "stream_options", "user", "priority", "sluice_token_times", "response_format", "tools", "tool_choice",
    "stream_interval",
)
"""The completions and chat fields the edge reads (docs/usage.md's table lists each, with `_UNSUPPORTED`'s)."""
KNOWN_FIELDS = frozenset(ACCEPTED_FIELDS) | frozenset(_UNSUPPORTED)
"""Every completions and chat field the edge knows: read, or refused unless left at its default."""


@dataclass(frozen=True)
class ParsedRequest:
    """A checked OpenAI request: the front door's calls (one per choice) and how to answer them."""

    calls: tuple[GenerateCall, ...]
    """One per choice, in choice order (choice i*n + j: sample j of prompt i)."""
    chat: bool
    """True for /v1/chat/completions (chat.completion objects), False for /v1/completions."""
    stream: bool
    include_usage: bool
    """stream_options.include_usage: a last chunk with `usage` and no choices."""
    stops: tuple[str, ...]
    """Stop strings, cut from the text as OpenAI does (the worker stops on them)."""
    token_times: bool = False
    """The `sluice_token_times` extension: chunks carry their first token's creation time."""
    n: int = 1
    """Samples per prompt."""
    echo: tuple[str, ...] = ()
    """(completions `echo`) each prompt's text, put before its choices' text; empty: no echo."""
    logprobs: int | None = None
    """Log-probabilities per output token with this many alternatives; None: none asked for."""
    tokens_as_ids: bool = False
    """vLLM's `return_tokens_as_token_ids`: log-probabilities name tokens `token_id:<id>`, not by their text."""
    tools: ToolPlan | None = None
    """(chat) how the request uses tools: the answer's text is parsed into tool_calls; None: no tools."""

    @property
    def call(self) -> GenerateCall:
        """Return the first choice's call (the only one of a plain request)."""
        return self.calls[0]

    @property
    def stream_interval(self) -> int:
        """vLLM's `stream_interval` as asked (every call carries it): after the first token, tokens go out this many
        at a time (at least admission's --stream-interval, as vLLM clamps it to its server's)."""
        return self.call.stream_interval

    def prompt_index(self, choice: int) -> int:
        """Return the index of the prompt a choice samples."""
        return choice // self.n


def _bad(name: str, message: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(message, reason="invalid_request", field_name=name)


def _number(body: Mapping[str, Any], name: str, kind: type[int] | type[float]) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
        raise _bad(name, f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}"[:200])
    if kind is float and not math.isfinite(value):
        raise _bad(name, f"{name} must be a finite number, got {value!r}")
    return kind(value)


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, f"{name} must be a boolean, got {value!r}"[:200])
    return value


def _in_range(body: Mapping[str, Any], name: str, low: float, high: float, default: float) -> float:
    """Return a number field within [low, high] (vLLM's range), or `default` when absent."""
    value = _number(body, name, float)
    if value is None:
        return default
    if not low <= value <= high:
        raise _bad(name, f"{name} must be in [{low:g}, {high:g}], got {value:g}")
    return float(value)


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


def _stop_token_ids(body: Mapping[str, Any], vocab_size: int) -> tuple[int, ...]:
    """Return vLLM's `stop_token_ids` (ids in the vocabulary; the stop token is part of the output)."""
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not _is_ids(ids) and ids != []:
        raise _bad("stop_token_ids", "stop_token_ids must be a list of token ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise _bad("stop_token_ids", f"stop_token_ids holds ids outside [0, {vocab_size}), e.g. {bad[0]}")
    return tuple(ids)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    for name, fine in _UNSUPPORTED.items():
        if name in body and body[name] not in fine:
            raise _bad(name, f"{name}={body[name]!r} is not supported by Sluice"[:200])
    if not isinstance(body.get("model"), str):
        raise _bad("model", "model must be a string (GET /v1/models lists the one served)")


def _logit_bias(body: Mapping[str, Any], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """Return logit_bias ({"token id": bias}) as sorted (id, bias) pairs; ids in the vocabulary, biases in
    [-100, 100] (vLLM clamps a bias into that range; OpenAI refuses one outside it, as Sluice does)."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise _bad("logit_bias", "logit_bias must be an object of token id -> bias")
    pairs: list[tuple[int, float]] = []
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise _bad("logit_bias", f"logit_bias key {key!r} is not a token id"[:200]) from None
        if not 0 <= token < vocab_size:
            raise _bad("logit_bias", f"logit_bias token id {token} is outside [0, {vocab_size})")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise _bad("logit_bias", f"logit_bias[{key!r}] must be a number in [-100, 100], got {value!r}"[:200])
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    """Return how many alternatives to return per token (None: no logprobs). Chat: `logprobs` true and
    `top_logprobs` 0..20; completions: `logprobs` 0..20 (OpenAI caps it at 5, vLLM at --max-logprobs)."""
    if not chat:
        value = _number(body, "logprobs", int)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise _bad("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {value}")
        return value
    wanted, top = _flag(body, "logprobs"), _number(body, "top_logprobs", int)
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise _bad("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}")
    if top and not wanted:
        raise _bad("top_logprobs", "top_logprobs needs logprobs: true")
    return (top or 0) if wanted else None


def _sampling(body: Mapping[str, Any], model: ModelSpec, max_tokens_field: str, chat: bool) -> SamplingParams:
    """Return the sampling values: the client's, else the model's defaults, else OpenAI's (a chat's max_tokens:
    0 here, the rest of the model length once the prompt is tokenized)."""
    top_p = _number(body, "top_p", float)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise _bad("top_p", f"top_p must be in (0, 1], got {top_p:g}")
    wanted = GenerationDefaults(temperature=_number(body, "temperature", float), top_p=top_p,
                                top_k=_number(body, "top_k", int),
                                max_new_tokens=_number(body, max_tokens_field, int))
    values = wanted.with_defaults(model.generation)
    if chat and values.max_new_tokens is None:
        values = dataclasses.replace(values, max_new_tokens=0)  # the front door sets the rest of the model length
    values = values.with_defaults(OPENAI_DEFAULTS)
    repetition = _number(body, "repetition_penalty", float)
    if repetition is not None and not repetition > 0:
        raise _bad("repetition_penalty", f"repetition_penalty must be > 0, got {repetition:g}")
    return SamplingParams(temperature=values.temperature or 0.0, top_k=values.top_k or 0,
                          top_p=1.0 if values.top_p is None else values.top_p, seed=_number(body, "seed", int),
                          max_tokens=values.max_new_tokens or 0, stop_strings=_stops(body),
                          stop_token_ids=_stop_token_ids(body, model.vocab_size),
                          ignore_eos=_flag(body, "ignore_eos"),
                          presence_penalty=_in_range(body, "presence_penalty", -2.0, 2.0, 0.0),
                          frequency_penalty=_in_range(body, "frequency_penalty", -2.0, 2.0, 0.0),
                          repetition_penalty=1.0 if repetition is None else repetition,
                          min_p=_in_range(body, "min_p", 0.0, 1.0, 0.0),
                          logit_bias=_logit_bias(body, model.vocab_size), logprobs=_logprobs(body, chat))


def _response_format(body: Mapping[str, Any]) -> str:
    """Return the JSON schema text `response_format` asks for ("": free text); raises InvalidArgument naming it."""
    fmt = body.get("response_format")
    if fmt is None:
        return ""
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise _bad("response_format", "response_format must be an object with a string type")
    kind = fmt["type"]
    if kind == "text":
        return ""
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind != "json_schema":
        raise _bad("response_format.type", f"response_format.type must be text, json_object or json_schema, "
                                           f"got {kind!r}"[:200])
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise _bad("response_format.json_schema.schema", "response_format json_schema needs json_schema.schema, "
                                                         "a JSON schema object")
    text = schema_text(spec["schema"])
    try:
        schema_regex(text)
    except SchemaError as exc:
        raise _bad("response_format.json_schema.schema", f"the schema cannot be used for structured output: "
                                                         f"{exc}"[:300]) from None
    return text


def _choices_per_prompt(body: Mapping[str, Any]) -> int:
    n = _number(body, "n", int)
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        raise _bad("n", f"n must be in [1, {MAX_CHOICES}], got {n}")
    best_of = _number(body, "best_of", int)
    if best_of is not None and best_of != n:
        raise _bad("best_of", f"best_of={best_of} other than n is not supported by Sluice (it would rank "
                              f"{best_of} samples by log-probability and return {n})")
    return n


def _request(body: Mapping[str, Any], model: ModelSpec, chat: bool, max_tokens_field: str,
             prompts: Sequence[str | tuple[int, ...]], idempotency_key: str, json_schema: str = "") -> ParsedRequest:
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", "user must be a string")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "stream_options must be an object")
    if options is not None and not stream:
        raise _bad("stream_options", "stream_options is only allowed when stream is true")
    n = _choices_per_prompt(body)
    if n * len(prompts) > MAX_CHOICES:
        raise _bad("n", f"{len(prompts)} prompts x n={n} is more than {MAX_CHOICES} choices")
    sampling = _sampling(body, model, max_tokens_field, chat)
    if sampling.seed is not None and not INT64[0] <= sampling.seed <= INT64[1] - (n - 1):
        raise _bad("seed", f"seed must be in [{INT64[0]}, {INT64[1] - (n - 1)}] (sample j of n uses seed + j), "
                           f"got {sampling.seed}"[:200])
    if json_schema:
        if sampling.ignore_eos:
            raise _bad("ignore_eos", "ignore_eos cannot go with structured output (the document ends at EOS)")
        sampling = dataclasses.replace(sampling, json_schema=json_schema)
    rest_of_context = chat and body.get(max_tokens_field) is None and sampling.max_tokens == 0
    priority = _number(body, "priority", int) or 0
    interval = _number(body, "stream_interval", int)
    if interval is not None and not 1 <= interval <= MAX_STREAM_INTERVAL:
        raise _bad("stream_interval", f"stream_interval must be in [1, {MAX_STREAM_INTERVAL}], got {interval}")
    calls: list[GenerateCall] = []
    for prompt in prompts:
        for sample in range(n):
            seeded = sampling if sampling.seed is None or not sample else dataclasses.replace(
                sampling, seed=sampling.seed + sample)
            key = f"{idempotency_key}/{len(calls)}" if idempotency_key and len(prompts) * n > 1 else idempotency_key
            calls.append(GenerateCall(
                prompt=prompt if isinstance(prompt, str) else "",
                prompt_token_ids=prompt if isinstance(prompt, tuple) else (), model=body["model"],
                sampling=seeded, priority=priority, idempotency_key=key, add_special_tokens=not chat,
                operation="chat" if chat else "text_completion", max_tokens_unset=rest_of_context,
                stream_interval=interval or 1))
    return ParsedRequest(tuple(calls), chat, stream, bool((options or {}).get("include_usage")),
                         sampling.stop_strings, _flag(body, "sluice_token_times"),
                         n=n, logprobs=sampling.logprobs, tokens_as_ids=_flag(body, "return_tokens_as_token_ids"))


def completion_request(body: Mapping[str, Any], model: ModelSpec, idempotency_key: str = "") -> ParsedRequest:
    """Return the checked request of a /v1/completions body; raises InvalidArgument naming the field."""
    _refuse_unsupported(body)
    prompts = _prompts(body.get("prompt"))
    parsed = _request(body, model, False, "max_tokens", prompts, idempotency_key, _response_format(body))
    if not _flag(body, "echo"):
        return parsed
    if parsed.logprobs is not None:
        raise _bad("echo", "echo with logprobs (the prompt's log-probabilities) is not supported by Sluice")
    texts = tuple(p if isinstance(p, str) else model.tokenizer.decode(p) for p in prompts)
    return dataclasses.replace(parsed, echo=texts)


def _prompts(prompt: Any) -> list[str | tuple[int, ...]]:
    """Return the prompts: a string, a list of token ids, or a non-empty list of strings or of id lists."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [_one_prompt(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        return [_one_prompt(p) for p in prompt]
    raise _bad("prompt", "prompt must be a string, a list of token ids, or a non-empty list of either")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _one_prompt(prompt: str | list[int]) -> str | tuple[int, ...]:
    return prompt if isinstance(prompt, str) else tuple(prompt)


def chat_request(body: Mapping[str, Any], model: ModelSpec, idempotency_key: str = "") -> ParsedRequest:
    """Return the checked request of a /v1/chat/completions body, its messages rendered with the model's
    chat template; raises InvalidArgument naming the field."""
    _refuse_unsupported(body)
    json_schema = _response_format(body)
    source = model.chat_template.source if model.chat_template is not None else None
    tools = tool_plan(body, source)
    if tools is not None and tools.forced:
        if json_schema:
            raise _bad("response_format", "response_format cannot go with a forced tool call (tool_choice "
                                          "\"required\" or a named function)")
        json_schema = tools.call_schema
    if _flag(body, "echo"):
        raise _bad("echo", "echo is a completions field; chat completions do not echo")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "messages must be a non-empty list")
    try:
        prompt = model.render_chat([_message(m, i) for i, m in enumerate(messages)],
                                   tools=tools.tools if tools is not None else None)
    except ChatTemplateError as exc:
        raise _bad("messages", f"cannot render the chat: {exc}"[:300]) from None
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    prompt += tools.prompt_suffix if tools is not None else ""
    parsed = _request(body, model, True, field, [prompt], idempotency_key, json_schema)
    return dataclasses.replace(parsed, tools=tools) if tools is not None else parsed


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


def tokenize_request(body: Mapping[str, Any], model: ModelSpec) -> list[int]:
    """Return the token ids of a /tokenize body (vLLM's: `prompt` with `add_special_tokens`, default true; or
    `messages` with `add_generation_prompt`, default true); raises InvalidArgument naming the field."""
    if body.get("model") not in (None, "") and not model.accepts(body["model"]):
        raise errors.NotFound(f"unknown model {str(body['model'])[:100]!r}; this deployment serves "
                              f"{model.model_id!r}", reason="unknown_model", field_name="model")
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "messages must be a non-empty list")
        try:
            text = model.render_chat([_message(m, i) for i, m in enumerate(messages)],
                                     add_generation_prompt=body.get("add_generation_prompt", True) is not False)
        except ChatTemplateError as exc:
            raise _bad("messages", f"cannot render the chat: {exc}"[:300]) from None
        return model.tokenizer.encode(text, add_special_tokens=_flag(body, "add_special_tokens"))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise _bad("prompt", "prompt must be a string (or send messages)")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise _bad("add_special_tokens", "add_special_tokens must be a boolean")
    return model.tokenizer.encode(prompt, add_special_tokens=special)


def detokenize_request(body: Mapping[str, Any], model: ModelSpec) -> list[int]:
    """Return the token ids of a /detokenize body (`tokens`, each in the vocabulary)."""
    if body.get("model") not in (None, "") and not model.accepts(body["model"]):
        raise errors.NotFound(f"unknown model {str(body['model'])[:100]!r}", reason="unknown_model",
                              field_name="model")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise _bad("tokens", "tokens must be a list of token ids")
    bad = [t for t in tokens if not 0 <= t < model.vocab_size]
    if bad:
        raise _bad("tokens", f"tokens holds ids outside [0, {model.vocab_size}), e.g. {bad[0]}")
    return tokens

