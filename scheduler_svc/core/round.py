"""Records of a round: what an in-flight round needs (`InFlightRound`) and the builder that becomes it (`RoundBuilder`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.request import Request
from scheduler_svc.core.types import BlockCopy, RoundBudget, RoundPlan, ScheduledSeq


class InFlightRound:
    """The bookkeeping of one planned round until its result arrives."""

    __slots__ = ("round_id", "entries", "swapping", "host_release")

    def __init__(self, round_id: int) -> None:
        self.round_id = round_id
        self.entries: list[tuple[Request, int, bool, bool]] = []
        """(request, tokens computed, sample, is a decode) per scheduled sequence."""
        # Tuples, grown by the rare swap paths: most rounds never touch them, and sharing the
        # empty tuple saves two allocations per round.
        self.swapping: tuple[Request, ...] = ()
        """Swap-out victims whose device blocks are pinned until the copy is done."""
        self.host_release: tuple[int, ...] = ()
        """Host blocks read by this round's swap-ins, free once it is done."""


_SEQ_FIELDS = (
    "request_id",
    "epoch",
    "token_ids",
    "start_position",
    "block_table",
    "sampling",
    "sample",
    "output_index",
    "recent_output_ids",
)


def _make_seq_builder() -> Callable[..., ScheduledSeq]:
    """Return a positional ScheduledSeq constructor that writes the slots directly.

    Why: a frozen dataclass's __init__ goes through object.__setattr__ per field; writing the
    slots through their descriptors builds an identical object in about half the time, and this
    runs once per sequence per round. Falls back to the class itself if the contract's fields change.
    """
    if tuple(f.name for f in dataclasses.fields(ScheduledSeq)) != _SEQ_FIELDS:
        return ScheduledSeq
    setters = [getattr(ScheduledSeq, name).__set__ for name in _SEQ_FIELDS]
    s0, s1, s2, s3, s4, s5, s6, s7, s8 = setters
    new = object.__new__

    def build(rid, epoch, token_ids, start, table, sampling, sample, index, recent):  # type: ignore[no-untyped-def]
        seq = new(ScheduledSeq)
        s0(seq, rid)
        s1(seq, epoch)
        s2(seq, token_ids)
        s3(seq, start)
        s4(seq, table)
        s5(seq, sampling)
        s6(seq, sample)
        s7(seq, index)
        s8(seq, recent)
        return seq

    return build


new_scheduled_seq = _make_seq_builder()


def _slot_setters(cls: type, names: tuple[str, ...]) -> list[Callable[[object, object], None]] | None:
    """Return the slot setters of `cls` in field order, or None when its fields are not `names`."""
    if tuple(f.name for f in dataclasses.fields(cls)) != names:
        return None
    return [getattr(cls, name).__set__ for name in names]


def _make_budget_builder() -> Callable[..., RoundBudget]:
    """Return a positional RoundBudget constructor that writes the slots (once per round; see above)."""
    setters = _slot_setters(RoundBudget, _BUDGET_FIELDS)
    if setters is None:
        return RoundBudget
    s0, s1, s2, s3, s4, s5, s6, s7 = setters
    new = object.__new__

    def build(max_q, used_q, max_s, used_s, max_kv, used_kv, prefill, decode):  # type: ignore[no-untyped-def]
        budget = new(RoundBudget)
        s0(budget, max_q)
        s1(budget, used_q)
        s2(budget, max_s)
        s3(budget, used_s)
        s4(budget, max_kv)
        s5(budget, used_kv)
        s6(budget, prefill)
        s7(budget, decode)
        return budget

    return build


def _make_plan_builder() -> Callable[..., RoundPlan]:
    """Return a positional RoundPlan constructor that writes the slots (once per round; see above)."""
    setters = _slot_setters(RoundPlan, ("round_id", "seqs", "swap_out", "swap_in", "budget"))
    if setters is None:
        return RoundPlan
    s0, s1, s2, s3, s4 = setters
    new = object.__new__

    def build(round_id, seqs, swap_out, swap_in, budget):  # type: ignore[no-untyped-def]
        plan = new(RoundPlan)
        s0(plan, round_id)
        s1(plan, seqs)
        s2(plan, swap_out)
        s3(plan, swap_in)
        s4(plan, budget)
        return plan

    return build


_BUDGET_FIELDS = (
    "max_query_tokens",
    "used_query_tokens",
    "max_seqs",
    "used_seqs",
    "max_kv_read_tokens",
    "used_kv_read_tokens",
    "num_prefill_tokens",
    "num_decode_tokens",
)
new_round_budget = _make_budget_builder()
new_round_plan = _make_plan_builder()


class RoundBuilder(InFlightRound):
    """Budgets and products of the round being built; once sealed, the same object is its in-flight
    record (one object per round instead of two: small rounds are mostly fixed costs)."""

    __slots__ = (
        "seqs",
        "swap_out",
        "swap_in",
        "tokens_left",
        "seqs_left",
        "kv_left",
        "prefill_tokens",
        "decode_tokens",
        "preempted",
    )

    def __init__(self, round_id: int, config: SchedulerConfig) -> None:
        # InFlightRound's fields, set here rather than through super().__init__ (one call less
        # per round).
        self.round_id = round_id
        self.entries = []
        self.swapping = ()
        self.host_release = ()
        self.seqs: list[ScheduledSeq] = []
        self.swap_out: tuple[BlockCopy, ...] = ()
        self.swap_in: tuple[BlockCopy, ...] = ()
        self.tokens_left = config.max_num_batched_tokens
        self.seqs_left = config.max_num_seqs
        # Without a cap, a bound no round can reach keeps the arithmetic branch-free.
        kv_cap = config.max_kv_read_tokens
        self.kv_left = kv_cap if kv_cap is not None else 1 << 62
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.preempted = False
