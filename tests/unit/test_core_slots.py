"""slot_constructor builds the same frozen objects as the dataclasses' own __init__."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from sluice.slots import slot_constructor
from sluice.types import RoundBudget, RoundResult, SamplingParams, ScheduledSeq, SeqOutput


def test_built_objects_equal_the_init_built_ones_and_stay_frozen() -> None:
    """Every hot-path contract class comes out equal to its __init__ twin and still refuses assignment."""
    samples = {
        ScheduledSeq: ("r", 2, (1, 2), 5, (0, 1), SamplingParams(seed=3), True, 4, (9,), (1, 2)),
        RoundBudget: (8, 8, 4, 2, None, 40, 6, 2, 0),
        SeqOutput: ("r", 2, (7,), True, None),
        RoundResult: (3, (), 0.25, "", ()),
    }
    for cls, args in samples.items():
        built = slot_constructor(cls)(*args)
        assert type(built) is cls and built == cls(*args)
        with pytest.raises(dataclasses.FrozenInstanceError):
            built.__setattr__(dataclasses.fields(cls)[0].name, "changed")


def test_a_dataclass_without_slots_gets_its_own_class_back() -> None:
    """Without slot descriptors there is nothing to write directly, so the class itself is returned."""

    @dataclass(frozen=True)
    class Plain:
        value: int

    assert slot_constructor(Plain) is Plain


def test_every_field_is_required_and_positional() -> None:
    """Defaults are not applied: a missing field is a TypeError, not a silently unset slot."""
    with pytest.raises(TypeError):
        slot_constructor(SeqOutput)("r", 2)
