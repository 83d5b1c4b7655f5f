"""Fast positional constructors for the frozen, slotted contract dataclasses on hot paths.

Why: a frozen dataclass's generated __init__ goes through object.__setattr__ per field, which
costs about twice what writing the slots through their descriptors does. Plans, sequences,
budgets and results are built once per round or per sequence per round, so the scheduler core
and the cost model build them with `slot_constructor(cls)`: an identical object, still frozen
afterwards. The constructor is generated once per class, unrolled like dataclasses' own __init__.
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
