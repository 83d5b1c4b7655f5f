"""The core's fast constructors build the same frozen contract objects as the classes themselves."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from scheduler_svc.core.retype import retyping_constructor
from sluice.types import (
    CoreEvents,
    CoreStats,
    KvEvent,
    KvEventKind,
    KvMedium,
    LifecycleEvent,
    RoundBudget,
    RoundPlan,
    SamplingParams,
    ScheduledSeq,
    Stage,
)

SEQ_ARGS = ("r1", 2, (7,), 130, (0, 5, 9), SamplingParams(max_tokens=9), True, 3, (1, 2), (5, 6))
BUDGET_ARGS = (8192, 3, 256, 3, None, 400, 0, 3, 0)
CASES = [
    (ScheduledSeq, SEQ_ARGS),
    (RoundBudget, BUDGET_ARGS),
    (RoundPlan, (4, (ScheduledSeq(*SEQ_ARGS),), (), (), RoundBudget(*BUDGET_ARGS))),
    (KvEvent, (12, KvEventKind.STORED, (99,), 98, (), KvMedium.GPU)),
    (LifecycleEvent, ("r1", Stage.FIRST_TOKEN, 1.5, (("tokens", 3),))),
    (CoreStats, tuple(range(20))),
    (CoreEvents, ([("r1", 0, 7)], [], [], [], 2, {})),
]


@pytest.mark.parametrize(("cls", "args"), CASES, ids=[c.__name__ for c, _ in CASES])
def test_builds_an_object_equal_to_the_classes_own(cls: Any, args: tuple) -> None:
    """The built object has the class's type, fields and equality, and a frozen class stays frozen."""
    build = retyping_constructor(cls)
    assert build is not cls and build.__qualname__ == f"retyping_constructor({cls.__name__})"
    built, expected = build(*args), cls(*args)
    assert type(built) is cls
    assert built == expected and dataclasses.astuple(built) == dataclasses.astuple(expected)
    if cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        assert hash(built) == hash(expected)
        with pytest.raises(dataclasses.FrozenInstanceError):
            built.__setattr__(dataclasses.fields(cls)[0].name, None)


def test_falls_back_where_a_shell_cannot_stand_in() -> None:
    """A class with __post_init__, with a __weakref__ slot or without slots gets a constructor that runs its rules."""

    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        value: int

        def __post_init__(self) -> None:
            if self.value < 0:
                raise ValueError("negative")

    @dataclasses.dataclass(frozen=True, slots=True, weakref_slot=True)
    class Weak:
        value: int

    @dataclasses.dataclass(frozen=True)
    class Plain:
        value: int

    with pytest.raises(ValueError, match="negative"):
        retyping_constructor(Checked)(-1)
    assert retyping_constructor(Weak)(3) == Weak(3)
    assert retyping_constructor(Plain) is Plain
