"""Structured output: the JSON schema a request's output must match, as the text the wire carries and as the
regular expression the worker's grammar (outlines-core) compiles.

Admission checks a schema here (a schema the grammar cannot express is a 400 naming the field, not a failure
in the worker); the worker compiles the same regular expression into its token index
(worker_svc/engine/grammar.py). Whitespace between JSON tokens is at most one space (`[ ]?`), so a model
cannot fill its output with blanks. outlines-core is imported on first use: the client SDK does not need it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

_PRIMITIVES = '{"type":"string"},{"type":"number"},{"type":"boolean"},{"type":"null"}'
JSON_OBJECT_SCHEMA = ('{"additionalProperties":{"anyOf":[' + _PRIMITIVES + ',{"items":{"anyOf":[' + _PRIMITIVES +
                      ']},"type":"array"},{"additionalProperties":{"anyOf":[' + _PRIMITIVES +
                      ']},"type":"object"}]},"type":"object"}')
"""OpenAI's response_format {"type": "json_object"}: a JSON object whose values are strings, numbers, booleans,
nulls, or arrays and objects of those (one level of nesting). Why not any object: outlines-core compiles a
regular expression, and `{"type": "object"}` at its default nesting depth took 43 s to index over the byte
vocabulary (this shape: 1.2 s, once per worker, at warm-up); docs/usage.md has the figures."""
MAX_REGEX_CHARS = 8192
"""The largest grammar (characters of regular expression) a schema may compile to. The worker builds a schema's
token index on its round thread, once per schema, and the build time grows with the grammar: measured on the
tiny model's vocabulary, json_object's 1,596 characters index in 0.14 s and ten bounded string properties (3,955)
in 0.07 s, while `{"type":"object","additionalProperties":{"type":"object"}}` (13,934) took 50 s, during which
every other request of that replica would wait. Such a schema is refused (400 naming it) instead."""
WHITESPACE = "[ ]?"
"""Whitespace allowed between JSON tokens."""


class SchemaError(ValueError):
    """The schema is not a JSON schema the grammar can express."""


def schema_text(schema: Mapping[str, Any]) -> str:
    """Return a schema's text without blanks, its keys in the client's order (a grammar writes an object's
    properties in the order the schema lists them, vLLM's as Sluice's)."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


@lru_cache(maxsize=256)
def schema_regex(text: str) -> str:
    """Return the regular expression of the JSON documents a schema (its text) allows.

    Raises SchemaError when the text is not a JSON object or the grammar cannot express the schema
    (an unknown type, an unresolvable $ref, ...)."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise SchemaError(f"the schema is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise SchemaError("the schema must be a JSON object")
    from outlines_core.json_schema import build_regex_from_schema

    try:
        regex = str(build_regex_from_schema(text, WHITESPACE))
    except (ValueError, TypeError, RuntimeError) as exc:
        raise SchemaError(str(exc)[:300]) from None
    if len(regex) > MAX_REGEX_CHARS:
        raise SchemaError(f"the schema's grammar is too large to compile without stalling a replica ({len(regex)} "
                          f"characters of regular expression, at most {MAX_REGEX_CHARS}): list the properties of "
                          "nested objects instead of leaving them open")
    return regex
