"""A scenario's verified statements: `Check`, with the value that was measured (scenarios.py, fleet_scenarios.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Check", "check", "check_that"]


@dataclass(frozen=True)
class Check:
    """One verified statement with the value that was measured."""

    name: str
    measured: object
    expected: str
    ok: bool

    def line(self) -> str:
        """Return the check as one printable line."""
        measured = self.measured.value if isinstance(self.measured, enum.Enum) else self.measured
        return (
            f"  [{'PASS' if self.ok else 'FAIL'}] {self.name}: measured {measured} (expected {self.expected})"
        )


def check(name: str, measured: object, expected: object) -> Check:
    """Return a check that `measured` equals `expected`."""
    shown = expected.value if isinstance(expected, enum.Enum) else expected
    return Check(name, measured, str(shown), measured == expected)


def check_that(name: str, measured: object, holds: bool, expected: str) -> Check:
    """Return a check of an arbitrary condition, described in words."""
    return Check(name, measured, expected, bool(holds))
