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

    __slots__ = ("round_id", "entries", "chunks", "swapping", "host_release", "host_written", "host_read",
                 "loading")

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
        self.host_written: tuple[int, ...] = ()
        """Host prefix-tier blocks this round's swap-outs copy evicted blocks into (pending until it answers)."""
        self.host_read: tuple[int, ...] = ()
        """Host prefix-tier blocks this round's swap-ins read (held until it answers)."""
        self.loading: tuple[Request, ...] = ()
        """Requests whose host-tier hits this round copies in (not entries: they compute in a later round)."""

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
        "attention_tokens",
        "charges",
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
        self.host_written = ()
        self.host_read = ()
        self.loading = ()
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
        self.attention_tokens = 0
        self.charges: dict[Request, int] | None = None
        """The attention charge of each chunk that paid one (`attention_charge`); None until one does."""
        self.preempted = False


def chunk_tokens(config: SchedulerConfig, rnd: RoundBuilder, start: int, known: int, reserve: int = 0) -> int:
    """Return the tokens of a prefill chunk from position `start` (`known` tokens known past it) in this round.

    Capped by `max_prefill_chunk`, the round's KV-read budget and its token budget less `reserve` (one token
    for each running request placed after this one: decodes come first), and, with
    `attention_pairs_per_token`, shrunk so that the chunk plus its attention charge (`attention_charge`) fits
    the token budget. Neither the reserve nor the charge shrinks it below one block (or the rest of the
    prompt, or the tokens left), so every prompt makes progress. 0 or less: nothing fits.
    """
    tokens_left = rnd.tokens_left
    least = min(known, config.block_size, tokens_left)
    room = max(tokens_left - reserve, least)
    num = min(known, config.max_prefill_chunk, room, rnd.kv_left - start)
    per_token = config.attention_pairs_per_token
    depth = start - config.attention_free_context
    if per_token is not None and depth > 0 and num > least:
        # n + n * depth / per_token <= room, in integers (the charge is rounded up: ceil(x) <= room iff x <= room)
        num = min(num, max(room * per_token // (per_token + depth), least))
    return num


def attention_charge(config: SchedulerConfig, start: int, num: int) -> int:
    """Return the query tokens a prefill chunk of `num` tokens from `start` pays for its attention to the context
    deeper than `attention_free_context` (0 without `attention_pairs_per_token`)."""
    per_token = config.attention_pairs_per_token
    depth = start - config.attention_free_context
    if per_token is None or depth <= 0:
        return 0
    return -(-num * depth // per_token)
