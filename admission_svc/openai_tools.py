"""Tool calls of chat completions: `tools` and `tool_choice` checked, the call forced by a grammar when the
client requires one, and the model's text parsed back into OpenAI's `tool_calls`.

No I/O. The tool definitions reach the model through its chat template (`tools`, as transformers passes them);
what a call looks like in the model's text is the template's tool-call format (`tool_call_format`):

- "hermes" (Qwen 2.5, Hermes, templates that print `<tool_call>`): `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>`, one block per call, text before the first block is the message's content;
- "llama3_json" (Llama 3.1+, templates that set up `ipython`/`<|python_tag|>`): the whole answer is
  `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`; several calls joined by ";").

A template with neither marker gets "hermes". tool_choice "none" sends the tools to the template but parses
nothing; "auto" parses what the model wrote (a block that is not JSON of a known tool stays text); "required"
and a named function force one call: the prompt ends with the format's opening (hermes: `<tool_call>\\n`) and
the output is constrained by the JSON schema of a call to one of the allowed tools (structured output,
sluice/structured.py), so it always parses. Streamed, a request with tools sends its content and calls in the
last chunk, when the whole text can be parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sluice import errors
from sluice.structured import SchemaError, schema_regex, schema_text

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
FORMATS = (HERMES, LLAMA3_JSON)
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools."""

    format: str
    """HERMES or LLAMA3_JSON."""
    tools: tuple[dict[str, Any], ...]
    """The tools as the template gets them ({"type": "function", "function": {...}})."""
    names: frozenset[str]
    """Names of the functions the model may call (all, or the one tool_choice names)."""
    forced: bool
    """tool_choice "required" or a named function: the output is one call, constrained by `call_schema`."""
    call_schema: str = ""
    """The JSON schema text of one call to an allowed function (forced only)."""
    parse: bool = True
    """Parse calls out of the output (False for tool_choice "none")."""

    @property
    def prompt_suffix(self) -> str:
        """Return the text put after the generation prompt of a forced call (the format's opening)."""
        return "<tool_call>\n" if self.forced and self.format == HERMES else ""

    @property
    def arguments_key(self) -> str:
        return "arguments" if self.format == HERMES else "parameters"


def tool_call_format(template_source: str | None) -> str:
    """Return the tool-call format a chat template writes (HERMES when it shows no known marker)."""
    source = template_source or ""
    if "<tool_call>" in source:
        return HERMES
    if "<|python_tag|>" in source or "ipython" in source:
        return LLAMA3_JSON
    return HERMES


def _bad(name: str, message: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(message[:300], reason="invalid_request", field_name=name)


def _tool(tool: Any, index: int) -> dict[str, Any]:
    name = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(
            tool.get("function"), dict):
        raise _bad(name, f"{name} must be {{\"type\": \"function\", \"function\": {{...}}}}")
    function = tool["function"]
    if not isinstance(function.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", function["name"]):
        raise _bad(f"{name}.function.name", f"{name}.function.name must be 1-64 letters, digits, _ . or -")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise _bad(f"{name}.function.parameters", f"{name}.function.parameters must be a JSON schema object")
    return {"type": "function", "function": {**function, "parameters": parameters}}


def tool_plan(body: Mapping[str, Any], template_source: str | None) -> ToolPlan | None:
    """Return how a chat body uses tools (None: no tools); raises InvalidArgument naming the field."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw in (None, []):
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(raw, list):
        raise _bad("tools", "tools must be a list of function tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if len(by_name) != len(tools):
        raise _bad("tools", "tools holds two functions of the same name")
    fmt = tool_call_format(template_source)
    if choice in (None, "auto", "none"):
        return ToolPlan(fmt, tools, frozenset(by_name), False, parse=choice != "none")
    if choice == "required":
        names = sorted(by_name)
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        wanted = choice["function"].get("name")
        if wanted not in by_name:
            raise _bad("tool_choice", f"tool_choice names {str(wanted)[:64]!r}, which is not in tools")
        names = [wanted]
    else:
        raise _bad("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                  "\"function\": {\"name\": ...}}")
    plan = ToolPlan(fmt, tools, frozenset(names), True)
    calls = [{"type": "object", "properties": {"name": {"const": n}, plan.arguments_key: by_name[n]["parameters"]},
              "required": ["name", plan.arguments_key], "additionalProperties": False} for n in names]
    schema = schema_text(calls[0] if len(calls) == 1 else {"anyOf": calls})
    try:
        schema_regex(schema)
    except SchemaError as exc:
        raise _bad("tools", f"a tool's parameters are not a JSON schema structured output can force: {exc}") from None
    return ToolPlan(fmt, tools, frozenset(names), True, schema)


def _call(text: str, plan: ToolPlan) -> dict[str, Any] | None:
    """Return {"name", "arguments"} of one call's JSON text, or None when it is not a call to an allowed tool."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in plan.names:
        return None
    arguments = value.get(plan.arguments_key, value.get("arguments", value.get("parameters", {})))
    if not isinstance(arguments, dict):
        return None
    return {"name": value["name"], "arguments": arguments}


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """Return (content, calls) of a finished answer: the message text left and the calls found, each
    {"name", "arguments"} (arguments as an object). A forced call's text is the call's JSON alone."""
    if not plan.parse:
        return text, []
    if plan.forced:
        call = _call(text.strip(), plan)
        return (None, [call]) if call else (text, [])
    if plan.format == HERMES:
        calls = [c for block in _HERMES_BLOCK.findall(text) if (c := _call(block, plan))]
        if not calls:
            return text, []
        content = text[: text.find("<tool_call>")].strip()
        return content or None, calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls = [c for part in body.split(";") if (c := _call(part.strip(), plan))] if body.startswith("{") else []
    return (None, calls) if calls and len(calls) == len(body.split(";")) else (text, [])


def openai_tool_calls(calls: Sequence[Mapping[str, Any]], stream: bool) -> list[dict[str, Any]]:
    """Return calls as OpenAI's message.tool_calls, each with a fresh id (a streamed delta's carry an index too)."""
    out = []
    for i, call in enumerate(calls):
        entry: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                 "function": {"name": call["name"],
                                              "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
        out.append({"index": i, **entry} if stream else entry)
    return out
