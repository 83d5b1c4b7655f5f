"""End to end with the official `openai` client: structured output (response_format json_schema / json_object)
and tool calls (tools with tool_choice required / a named function / none) against real processes (tiny torch
model, whose template has no tool markup: the hermes format).

Each test fails when its parameter is ignored: the same greedy request without it is not JSON (or not a call),
with it the answer parses and validates against the schema (jsonschema), streamed and not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from sluice_tools.stack import Stack, StackConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "city": {"enum": ["Paris", "Lima", "Oslo"]},
                                           "tag": {"type": "string", "maxLength": 6}},
          "required": ["ok", "city", "tag"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": [1, 2, 3]}}, "required": ["a", "b"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
CHAT = [{"role": "user", "content": "Answer in JSON please"}]
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 100}
CONFIG = """
[tenants.acme]
api_keys = ["k-acme"]
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack (1 replica of the tiny torch model) with the HTTP edge on a free port."""
    run_dir = tmp_path_factory.mktemp("structured")
    config = run_dir / "sluice.toml"
    config.write_text(CONFIG)
    with Stack(StackConfig(replicas=1, config_file=str(config), run_dir=run_dir, http_port=0,
                           num_blocks=256)) as running:
        yield running


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_base_url, api_key="k-acme", max_retries=0, timeout=120)


def _chat(stack: Stack, stream: bool, **params: Any) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """Return (content, tool calls as {name, arguments}, finish_reason) of one chat, streamed or not."""
    client = _client(stack)
    merged = {**GREEDY, **params}
    if not stream:
        answer = client.chat.completions.create(model=stack.model_id, messages=CHAT, **merged)  # type: ignore[arg-type]
        message = answer.choices[0].message
        calls = [{"name": c.function.name, "arguments": c.function.arguments}  # type: ignore[union-attr]
                 for c in message.tool_calls or []]
        return message.content, calls, answer.choices[0].finish_reason
    content, finish, calls = None, None, {}
    for chunk in client.chat.completions.create(model=stack.model_id, messages=CHAT, stream=True,  # type: ignore[arg-type]
                                                **merged):
        for choice in chunk.choices:
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""  # type: ignore[union-attr]
                entry["arguments"] += call.function.arguments or ""  # type: ignore[union-attr]
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(stack: Stack, stream: bool) -> None:
    """response_format json_schema: the greedy answer is valid under the schema; without it, it is not JSON."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    content, _, finish = _chat(stack, stream, response_format=fmt)
    assert finish == "stop" and content is not None
    jsonschema.validate(json.loads(content), SCHEMA)
    free, _, _ = _chat(stack, stream)
    with pytest.raises(ValueError):
        json.loads(free or "")


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_output_is_an_object(stack: Stack, stream: bool) -> None:
    """response_format json_object: with "}" pushed by logit_bias the answer is still a JSON object ("{}"), where
    without the format the same bias makes text that does not parse; the completions endpoint takes it too."""
    bias = {"logit_bias": {str(ord("}")): 100}}
    content, _, _ = _chat(stack, stream, response_format={"type": "json_object"}, **bias)
    assert json.loads(content or "") == {}
    free, _, _ = _chat(stack, stream, **bias)
    assert free is not None and free.startswith("}")
    text = _client(stack).completions.create(model=stack.model_id, prompt="JSON:", max_tokens=20, temperature=0,
                                             logit_bias={str(ord("}")): 100},
                                             extra_body={"response_format": {"type": "json_object"}})
    assert json.loads(text.choices[0].text) == {}


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_calls_parse_and_validate(stack: Stack, stream: bool) -> None:
    """tool_choice "required" and a named function give one call to an offered tool whose arguments validate
    against its parameters schema, finish_reason "tool_calls"; without tools the answer has no call."""
    schemas = {"get_weather": WEATHER, "add": ADD}
    content, calls, finish = _chat(stack, stream, tools=TOOLS, tool_choice="required")
    assert finish == "tool_calls" and len(calls) == 1 and not content
    jsonschema.validate(json.loads(calls[0]["arguments"]), schemas[calls[0]["name"]])
    for name in ("add", "get_weather"):
        _, calls, finish = _chat(stack, stream, tools=TOOLS,
                                 tool_choice={"type": "function", "function": {"name": name}})
        assert finish == "tool_calls" and [c["name"] for c in calls] == [name]
        jsonschema.validate(json.loads(calls[0]["arguments"]), schemas[name])
    content, calls, finish = _chat(stack, stream, tools=TOOLS, tool_choice="none")
    assert calls == [] and finish in ("stop", "length") and content


def test_what_structured_output_and_tools_refuse_is_400_naming_it(stack: Stack) -> None:
    """A schema the grammar cannot express, an unknown format type, a tool_choice naming no offered tool, the
    legacy functions field and response_format with a forced call are 400 with `param` naming the field."""
    client = _client(stack)
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
              "response_format.json_schema.schema"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "open", "schema": {
                 "type": "object", "additionalProperties": {"type": "object"}}}}},  # would stall a replica ~50 s
              "response_format.json_schema.schema"),
             ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
             ({"functions": [{"name": "f"}]}, "functions"),
             ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
              "response_format")]
    for body, field in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=stack.model_id, messages=CHAT, max_tokens=2,  # type: ignore[arg-type]
                                           extra_body=body)
        assert info.value.status_code == 400 and info.value.param == field, body
