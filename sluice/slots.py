"""Fast positional constructors for the frozen, slotted contract dataclasses on hot paths.

Why: a frozen dataclass's generated __init__ goes through object.__setattr__ per field, which
costs about twice what writing the slots through their descriptors does. Plans, sequences,
budgets and results are built once per round or per sequence per round, so the scheduler core
and the cost model build them with `slot_constructor(cls)` or, about twice as fast again,
`retyping_constructor(cls)`: an identical object, still frozen afterwards. The constructor is
generated once per class, unrolled like dataclasses' own __init__.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def slot_constructor(cls: type) -> Callable[..., Any]:
    """Return a function taking every field of `cls` positionally, in field order, that builds an
    instance by writing its slots. Returns `cls` itself when it is not a slotted dataclass."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    if not names or not all(hasattr(cls.__dict__.get(name), "__set__") for name in names):
        return cls
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    lines = [f"def build({', '.join(names)}):", "    _obj = _new(_cls)"]
    for index, name in enumerate(names):
        namespace[f"_set{index}"] = getattr(cls, name).__set__
        lines.append(f"    _set{index}(_obj, {name})")
    lines.append("    return _obj")
    exec("\n".join(lines), namespace)  # the same technique dataclasses uses for __init__
    build: Callable[..., Any] = namespace["build"]
    build.__qualname__ = f"slot_constructor({cls.__name__})"
    return build


def retyping_constructor(cls: type) -> Callable[..., Any]:
    """Return a function taking every field of `cls` positionally, in field order, that builds an
    instance (identical to `cls(...)`) through a shell class of the same layout.

    Why: `slot_constructor` writes each slot through its descriptor's `__set__` (a C call per field),
    because a frozen class's own `__setattr__` refuses writes. A shell class with the same `__slots__`
    has the default `__setattr__`, so its fields are written by the interpreter's fast slot stores;
    assigning `__class__` afterwards (CPython allows it between classes of identical layout) turns the
    shell into the frozen class. The result is the same object a `cls(...)` call builds (same type,
    fields, equality and hash, still frozen) at about half of `slot_constructor`'s cost. Falls back to
    `slot_constructor` for a class whose layout a shell cannot match, and to the class itself when it
    has a `__post_init__`."""
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
