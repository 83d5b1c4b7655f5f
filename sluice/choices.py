"""One way to read a named choice (a policy, a mode) given as an Enum member or its value."""

from __future__ import annotations

import enum
from typing import TypeVar

E = TypeVar("E", bound=enum.Enum)


def enum_member(kind: type[E], value: E | str, what: str) -> E:
    """Return the member of `kind` that `value` is or names (case-insensitive for strings).

    Raises ValueError naming `what`, the bad value and every known value.
    """
    if isinstance(value, kind):
        return value
    try:
        return kind(value.lower() if isinstance(value, str) else value)
    except ValueError:
        known = ", ".join(str(member.value) for member in kind)
        raise ValueError(f"unknown {what} {value!r}; known: {known}") from None
