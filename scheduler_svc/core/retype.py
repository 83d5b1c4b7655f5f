"""Constructors for the frozen, slotted contract dataclasses the core builds every round.

Why: `sluice.slots.slot_constructor` writes each slot through its descriptor's `__set__` (a C call
per field), because a frozen class's own `__setattr__` refuses writes. A shell class with the same
`__slots__` has the default `__setattr__`, so its fields are written by the interpreter's fast slot
stores; assigning `__class__` afterwards (CPython allows it between classes of identical layout)
turns the shell into the frozen class. The result is the same object a `cls(...)` call builds
(same type, fields, equality and hash, still frozen) at about half of `slot_constructor`'s cost:
the core builds one ScheduledSeq per sequence per round, and a plan, a budget and KV events per
round. Falls back to `slot_constructor` for a class whose layout a shell cannot match, and to the
class itself when it has a `__post_init__`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from sluice.slots import slot_constructor


def retyping_constructor(cls: type) -> Callable[..., Any]:
    """Return a function taking every field of `cls` positionally, in field order, that builds an
    instance (identical to `cls(...)`) through a shell class of the same layout."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    slots = cls.__dict__.get("__slots__")
    if hasattr(cls, "__post_init__"):
        return cls  # its checks must run
    if not names or slots is None or set(slots) != set(names) or cls.__bases__ != (object,):
        return slot_constructor(cls)
    shell = type(f"_{cls.__name__}Shell", (), {"__slots__": tuple(slots)})
    namespace: dict[str, Any] = {"_new": object.__new__, "_shell": shell, "_cls": cls}
    lines = [f"def build({', '.join(names)}):", "    _obj = _new(_shell)"]
    lines += [f"    _obj.{name} = {name}" for name in names]
    lines += ["    _obj.__class__ = _cls", "    return _obj"]
    exec("\n".join(lines), namespace)  # the same technique dataclasses uses for __init__
    build: Callable[..., Any] = namespace["build"]
    build.__qualname__ = f"retyping_constructor({cls.__name__})"
    try:
        build(*([None] * len(names)))
    except TypeError:  # a layout the shell cannot match (a __weakref__ slot, a C base, ...)
        return slot_constructor(cls)
    return build
