"""Tool calls at the edge (no I/O): the format from the chat template, tools and tool_choice checked by name, the
forced call's schema, the tools rendered by the template, and the model's text parsed into calls."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from admission_svc import openai_answers, openai_convert
from admission_svc.calls import Output
from admission_svc.openai_tools import HERMES, LLAMA3_JSON, parse_tool_calls, tool_call_format, tool_plan
from sluice import errors
from sluice.chat_template import ChatTemplate
from sluice.model_spec import ModelSpec, load_model_spec
from sluice.v1 import common_pb2, events_pb2

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CHAT = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def spec(tiny_preset: Path) -> ModelSpec:
    return load_model_spec(tiny_preset, "tiny")


def _with_template(spec: ModelSpec, name: str) -> ModelSpec:
    tokens = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    return dataclasses.replace(spec, chat_template=ChatTemplate((TEMPLATES / name).read_text(), tokens))


def test_the_format_comes_from_the_template() -> None:
    """Qwen 2's template (<tool_call>) is hermes, Llama 3's (ipython) llama3_json, one without markers hermes."""
    assert tool_call_format((TEMPLATES / "qwen2.jinja").read_text()) == HERMES
    assert tool_call_format((TEMPLATES / "llama3.jinja").read_text()) == LLAMA3_JSON
    assert tool_call_format((TEMPLATES / "zephyr.jinja").read_text()) == HERMES


def test_tools_reach_the_prompt_and_a_forced_call_gets_its_schema(spec: ModelSpec) -> None:
    """The template renders the tool definitions; a named function forces the schema of a call to it (hermes:
    "arguments" after a "<tool_call>" opening; llama3_json: "parameters", no opening); auto forces nothing."""
    for name, key, suffix in (("qwen2.jinja", "arguments", "<tool_call>\n"), ("llama3.jinja", "parameters", "")):
        model = _with_template(spec, name)
        body = {"model": "tiny", "messages": CHAT, "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        parsed = openai_convert.chat_request(body, model)
        assert parsed.call.prompt.endswith(suffix) and "get_weather" in parsed.call.prompt
        schema = json.loads(parsed.call.sampling.json_schema)
        assert schema["properties"] == {"name": {"const": "get_weather"}, key: WEATHER}
        auto = openai_convert.chat_request({**body, "tool_choice": "auto"}, model)
        assert auto.call.sampling.json_schema == "" and auto.tools is not None and not auto.tools.forced


def test_bad_tools_and_choices_are_refused_by_name() -> None:
    """A tool that is not a function, a duplicate name, a choice naming no tool or of unknown form, a choice
    without tools: InvalidArgument naming the field."""
    cases = [({"tools": [{"type": "retrieval"}]}, "tools[0]"), ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
             ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"), ({"tool_choice": "required"}, "tool_choice"),
             ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name")]
    for body, field in cases:
        with pytest.raises(errors.InvalidArgument) as info:
            tool_plan(body, None)
        assert info.value.field_name == field, body


def test_calls_are_parsed_out_of_the_text() -> None:
    """hermes blocks (content before them kept), llama3_json answers (with <|python_tag|>, several by ";"); a
    block naming no offered tool or not JSON stays text; tool_choice none parses nothing."""
    hermes = tool_plan({"tools": TOOLS}, "<tool_call>")
    assert hermes is not None
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert parse_tool_calls(text, hermes) == ("Let me look.", [{"name": "get_weather", "arguments": {"city": "Paris"}}])
    assert parse_tool_calls('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', hermes)[1] == []
    assert parse_tool_calls("<tool_call>not json</tool_call>", hermes)[1] == []
    llama = tool_plan({"tools": TOOLS}, "ipython")
    assert llama is not None
    two = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {}}'
    assert [c["name"] for c in parse_tool_calls(two, llama)[1]] == ["add", "get_weather"]
    assert parse_tool_calls("The weather is fine.", llama) == ("The weather is fine.", [])
    none = tool_plan({"tools": TOOLS, "tool_choice": "none"}, "<tool_call>")
    assert none is not None and parse_tool_calls(text, none) == (text, [])


def test_the_answer_carries_tool_calls_and_their_finish_reason(spec: ModelSpec) -> None:
    """A forced call's output becomes message.tool_calls with content null and finish_reason tool_calls."""
    body = {"model": "tiny", "messages": CHAT, "tools": TOOLS, "tool_choice": "required"}
    parsed = openai_convert.chat_request(body, spec)
    done = events_pb2.Completion(finish_reason="stop", usage=common_pb2.Usage(input_tokens=3, output_tokens=5))
    outputs = [Output("r", 0, (1,), '{"name": "add", "arguments": {"x": 1}}'), Output("r", 1, completion=done)]
    answer = openai_answers.response_body(parsed, "tiny", [outputs])
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"x": 1}
