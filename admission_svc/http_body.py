"""The JSON body of an HTTP request, checked before any field is read: an object, bounded depth, UTF-8 text.

JSON allows what the rest of the path cannot take: nesting as deep as the body is long (the parser
recurses, and a few thousand `[` ended in a RecursionError and a 500), and `\\ud800`, a lone surrogate
that is no Unicode scalar value (the tokenizer and protobuf refuse it, again a 500 after the body was
accepted). Both are refused here with 400 naming the field. The walk is iterative and linear in the
body's size.
"""

from __future__ import annotations

import json
from typing import Any

from sluice import errors
from sluice.safe_text import lone_surrogate_at

MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays and objects a body may have (OpenAI's bodies need 5: a chat's content parts)."""


def _bad(message: str, field: str = "", reason: str = "malformed_message") -> errors.InvalidArgument:
    return errors.InvalidArgument(message, reason=reason, field_name=field)


def _path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def _check_text(text: str, field: str) -> None:
    at = lone_surrogate_at(text)
    if at is not None:
        raise _bad(f"{field or 'a key'} holds a lone surrogate at character {at} (text must be UTF-8: Unicode "
                   "scalar values only)", field, reason="invalid_request")


def check_tree(body: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Check a parsed body: no nesting deeper than `max_depth`, every string and key a run of scalar values.

    Raises InvalidArgument naming the field (e.g. `messages[0].content`)."""
    pending: list[tuple[Any, str, int]] = [(body, "", 1)]
    while pending:
        value, field, depth = pending.pop()
        if isinstance(value, str):
            _check_text(value, field)
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > max_depth:
            raise _bad(f"request body is nested deeper than {max_depth} levels", field)
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, _path(field, "<key>"))
                pending.append((item, _path(field, key), depth + 1))
        else:
            pending.extend((item, _path(field, index), depth + 1) for index, item in enumerate(value)
                           if isinstance(item, str | dict | list))


def parse_object(raw: bytes | bytearray, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """Return the JSON object of a body; raises InvalidArgument when it is not JSON, not an object, nested
    deeper than `max_depth` or holds text that is not UTF-8 scalar values."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _bad(f"request body is nested deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"request body is not JSON: {exc}"[:200]) from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    check_tree(body, max_depth)
    return body
