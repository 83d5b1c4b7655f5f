"""Records of a round: what an in-flight round needs (`InFlightRound`) and the builder that becomes it (`RoundBuilder`)."""

from __future__ import annotations

from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.request import Request
from scheduler_svc.core.retype import retyping_constructor
from sluice.types import BlockCopy, RoundBudget, RoundPlan, ScheduledSeq

DECODE = (1, True)
"""(tokens computed, sample) of a plain decode: most entries, so they are not stored per entry."""


class InFlightRound:
    """The bookkeeping of one planned round until its result arrives."""

    __slots__ = ("round_id", "entries", "chunks", "swapping", "host_release")

    def __init__(self, round_id: int) -> None:
        self.round_id = round_id
        self.entries: list[Request] = []
        """The request of each scheduled sequence, in plan order."""
        self.chunks: dict[Request, tuple[int, bool]] | None = None
        """(tokens computed, sample) of each entry that is not a plain decode (1 token, sampled);
        None until the round has one (most rounds are decodes only)."""
        # Tuples, grown by the rare swap paths: most rounds never touch them, and sharing the
        # empty tuple saves two allocations per round.
        self.swapping: tuple[Request, ...] = ()
        """Swap-out victims whose device blocks are pinned until the copy is done."""
        self.host_release: tuple[int, ...] = ()
        """Host blocks read by this round's swap-ins, free once it is done."""

    def entry(self, request: Request) -> tuple[int, bool]:
        """Return (tokens computed, sample) of `request`'s sequence in this round."""
        return self.chunks.get(request, DECODE) if self.chunks is not None else DECODE


# Built once per sequence per round (and once per round): see retype.py for why not the __init__.
new_scheduled_seq = retyping_constructor(ScheduledSeq)
new_round_budget = retyping_constructor(RoundBudget)
new_round_plan = retyping_constructor(RoundPlan)


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
        self.chunks = None
        self.swapping = ()
        self.host_release = ()
        self.seqs: list[ScheduledSeq] = []
        """The round's sequences while it is built; emptied once sealed (the plan holds them)."""
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
