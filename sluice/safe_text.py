"""Client-supplied text, made safe to echo in an error or write to a log.

A request id, model name or replica id comes from whoever called. Echoed whole into an error it can
overflow the caller's metadata limit (a 16 KiB id turned NOT_FOUND into RESOURCE_EXHAUSTED, which SDKs
retry); written raw to a log, a newline forges a log line and an escape sequence rewrites a terminal.
`shown()` is for messages, `EscapingFormatter` for every log line a service writes.
"""

from __future__ import annotations

import logging

SHOWN_CHARS = 64
"""How much of a client's value an error message quotes."""


def escape_controls(text: str) -> str:
    """Return `text` with control characters (C0, DEL, C1, line and paragraph separators) escaped."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


def shown(value: str, limit: int = SHOWN_CHARS) -> str:
    """Return a quoted, control-escaped prefix of `value` of at most `limit` characters, saying how long
    the whole was when it is cut: `'abc...' (20000 chars)`."""
    quoted = f"'{escape_controls(value[:limit])}'"
    return quoted if len(value) <= limit else f"{quoted}... ({len(value)} chars)"


class EscapingFormatter(logging.Formatter):
    """A formatter whose message part never spans lines: control characters in it are escaped.

    Tracebacks (exc_info) still print on their own lines; they come from the code, not from a caller.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


def lone_surrogate_at(text: str) -> int | None:
    """Return the index of the first lone surrogate in `text` (not a Unicode scalar value: it has no UTF-8
    form, so a tokenizer or protobuf refuses it), or None when the text is all scalar values."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None
