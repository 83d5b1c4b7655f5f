"""Constructors for the frozen, slotted contract dataclasses the core builds every round.

The core builds one ScheduledSeq per sequence per round, and a plan, a budget and KV events per round,
with `retyping_constructor` (sluice/slots.py, which says how and why: about half the cost of writing the
slots through their descriptors); the cost model and the simulator use it too.
"""

from __future__ import annotations

from sluice.slots import retyping_constructor

__all__ = ["retyping_constructor"]
