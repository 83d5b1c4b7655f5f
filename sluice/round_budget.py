"""A round budget sized from the TPOT target, as Sarathi-Serve sizes its chunks from its inter-token target.

Why: near saturation every running request decodes once per round, so a round's time *is* the
time per output token of every request in it. A fixed budget (2,048 query tokens) either wastes
the target (short rounds) or misses it (on 4 x H200 with Llama-3-8B a full 2,048-token round takes
~49 ms against a 50 ms target). So the budget is the largest one whose worst round still fits:

    max_num_batched_tokens = largest B (a multiple of `granule`) with
        round_time(query=B, attended_pairs=B * context + B * (B + 1) / 2, kv_read=0, sampled=seqs)
            <= headroom * tpot_slo
    max_num_seqs           = largest S (a multiple of `seat_granule`, at most `max_seats`) with
        round_time(query=S, attended_pairs=S * context, kv_read=S * context, sampled=S) <= headroom * tpot_slo
    max_kv_read_tokens     = largest R (a multiple of `granule`) with
        round_time(query=S, attended_pairs=R, kv_read=R, sampled=S) <= headroom * tpot_slo
    attention_pairs_per_token = largest K with, for the deepest chunk (start D = max_context) that the
        charge lets into a round, n = B * K / (K + D - context):
        round_time(query=n, attended_pairs=n * D + n * (n + 1) / 2, kv_read=D + n, sampled=1)
            <= headroom * tpot_slo

The seat cap S follows from the same rule: every running request decodes in every round, so S is how many
decodes at `context` tokens each fit one round within the target. A fixed cap below that binds before the
KV cache or the GPU do: on Llama-3-8B / H200 at TPOT 50 ms the derived S is 608 against a fixed 256, and at
the chat mixes' capacity the fixed 256 kept every replica full of decodes for 9-17 s of a minute while its
KV cache was under 60 % used, so new requests waited for a seat and missed TTFT (docs/simulator.md,
"The seat cap"). vLLM's own default on H100/H200-class GPUs is 1,024 seats, the default `max_seats`; the
KV-read budget R, not the seat count, is what keeps a round of long contexts within the target.

The token budget B is sized for a chunk attending to `context` earlier tokens; a chunk of a long prompt
attends to tens of thousands (Mooncake), and a round of B such tokens takes 2-4x the target. So the core
charges a chunk starting at s > context ceil(n * (s - context) / K) tokens of the round's budget on top of
its n tokens (`SchedulerConfig.attention_pairs_per_token`): K is how many (query, earlier token) pairs cost
as much as one query token. With a compute time linear in tokens and pairs (the roofline's compute side),
a round that fits at depth `context` (B) and at the deepest depth D fits at every depth between, since
n * (1 + (s - context) / K) = B holds the compute of the chunk's tokens plus its extra pairs constant.

`round_time(query_tokens, attended_pairs, kv_read_tokens, sampled_seqs)` is whatever knows the
replica's rounds: the cost model of its model and GPU (`worker_svc.costmodel.CostModel._time`, in
the simulator) or a line through the measured rates (`linear_round_time`: a decode round plus
prefill tokens at the measured rate, in the scheduler service, which sees no model or GPU). The
cost model is a roofline (compute and memory traffic overlap, the larger wins), so the token and
the KV-read limits are found separately and a round at both limits still fits; `headroom` covers
what the model leaves out. A linear model sets seats and a KV-read budget only when it is given a time
per KV token read (`kv_read_s`), and an attention charge only when it is given a time per pair (`pair_s`).

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RoundBudget", "RoundTime", "derive_round_budget", "linear_round_time"]

RoundTime = Callable[[int, int, int, int], float]
"""(query tokens, attended pairs, KV tokens read, sampled sequences) -> seconds of one round."""


@dataclass(frozen=True)
class RoundBudget:
    """Per-round budgets derived from a TPOT target."""

    max_num_batched_tokens: int
    """Query tokens per round (prefill chunk tokens + one per decode)."""
    max_kv_read_tokens: int | None
    """Context tokens one round may read; None: the time model has no KV-read term (no cap)."""
    target_s: float
    """The round time the budgets were sized for (headroom x TPOT target)."""
    attention_pairs_per_token: int | None = None
    """Attention pairs charged as one query token beyond `attention_free_context`; None: pairs cost nothing in
    the time model (no charge)."""
    attention_free_context: int = 0
    """Context depth the token budget was sized at (`context_tokens`): attention within it is not charged."""
    max_num_seqs: int | None = None
    """Running requests (seats): the decodes at `attention_free_context` tokens that fit one round; None: the
    time model has no KV-read term (it cannot say; the configured cap stays)."""


def linear_round_time(prefill_tokens_per_s: float, decode_round_s: float, pair_s: float = 0.0,
                      kv_read_s: float = 0.0) -> RoundTime:
    """Return a round-time model from measured rates: one decode round plus the query tokens at the prefill rate,
    plus `pair_s` seconds per attended (query token, earlier token) pair (0: attention is free), plus `kv_read_s`
    seconds per KV token the round reads (0: reading is free, and the model has no KV term: it sizes neither
    seats nor a KV-read budget)."""
    if not (prefill_tokens_per_s > 0 and 0 <= pair_s < math.inf and 0 <= kv_read_s < math.inf):  # NaN fails too
        raise ValueError(f"need prefill_tokens_per_s > 0 and pair_s, kv_read_s finite and >= 0, got "
                         f"{prefill_tokens_per_s}, {pair_s}, {kv_read_s}")

    def round_time(query: int, pairs: int, read: int, sampled: int) -> float:
        return decode_round_s + query / prefill_tokens_per_s + pairs * pair_s + read * kv_read_s

    round_time.has_kv_term = kv_read_s > 0  # type: ignore[attr-defined]
    return round_time


def _largest(fits: Callable[[int], bool], granule: int, limit: int) -> int:
    """Return the largest multiple of `granule` in [granule, limit] for which `fits` holds (granule if none)."""
    lo, hi = 1, max(limit // granule, 1)
    if not fits(granule):
        return granule
    while lo < hi:  # fits is monotone: larger budgets take longer
        mid = (lo + hi + 1) // 2
        if fits(mid * granule):
            lo = mid
        else:
            hi = mid - 1
    return lo * granule


def derive_round_budget(tpot_slo_s: float, round_time: RoundTime, *, max_num_seqs: int = 256,
                        context_tokens: int = 2048, granule: int = 64, headroom: float = 0.9,
                        max_tokens: int = 16384, max_kv_read: int = 1 << 24, min_kv_read: int = 0,
                        max_context: int = 1 << 17, max_seats: int = 1024, seat_granule: int = 16,
                        seat_context: int | None = None) -> RoundBudget:
    """Return the largest per-round budgets whose rounds take at most `headroom * tpot_slo_s` (module docstring).

    `context_tokens`: context a prefill chunk attends to besides itself, what the token budget is sized
    for (a chunk of a long prompt reads more: the attention charge pays for the rest); `max_num_seqs`:
    decodes sampled in a KV-bound round when the model has no KV-read term (with one, the derived seat cap
    is, up to `max_seats`, in multiples of `seat_granule`, sized for decodes at `seat_context` tokens each,
    default `context_tokens`); `min_kv_read`: the KV-read budget is never below it (pass
    max_model_len: the core refuses a request whose whole context exceeds the cap, and one long request
    alone decodes well within the target); `max_context`: the deepest position a chunk starts at (pass
    max_model_len), where the attention charge is sized. Raises
    ValueError when the target is not positive or even the smallest round misses it (say so, do
    not run rounds that cannot meet it).
    """
    if tpot_slo_s <= 0 or not 0 < headroom <= 1:
        raise ValueError(f"need tpot_slo_s > 0 and headroom in (0, 1], got {tpot_slo_s}, {headroom}")
    target = headroom * tpot_slo_s
    has_kv_term = getattr(round_time, "has_kv_term", True)
    seats: int | None = None
    if has_kv_term:
        decode_context = context_tokens if seat_context is None else seat_context

        def seats_fit(s: int) -> bool:
            return round_time(s, s * decode_context, s * decode_context, s) <= target

        seats = _largest(seats_fit, seat_granule, max(max_seats, seat_granule))
    seqs = seats if seats is not None else max(max_num_seqs, 1)

    def tokens_fit(b: int) -> bool:
        return round_time(b, b * context_tokens + b * (b + 1) // 2, 0, min(b, seqs)) <= target

    def kv_fits(r: int) -> bool:
        return round_time(seqs, r, r, seqs) <= target

    if not tokens_fit(granule) or (has_kv_term and not kv_fits(granule)):
        raise ValueError(f"a round of {granule} tokens or {seqs} decodes already takes over the "
                         f"{target * 1e3:.1f} ms target: the TPOT target cannot be met on this replica")
    tokens = _largest(tokens_fit, granule, max_tokens)
    kv_read = max(_largest(kv_fits, granule, max_kv_read), min_kv_read) if has_kv_term else None
    pairs_per_token = _attention_pairs_per_token(round_time, target, tokens, context_tokens, max_context)
    return RoundBudget(tokens, kv_read, target, pairs_per_token, context_tokens, seats)


def _attention_pairs_per_token(round_time: RoundTime, target: float, tokens: int, context: int,
                               depth: int) -> int | None:
    """Return the largest charge rate K (pairs per token) at which the deepest chunk the charge lets in fits
    `target` (module docstring); None when attention costs nothing (any K fits) or no chunk is deeper."""
    if depth <= context:
        return None

    def deepest_fits(per_token: int) -> bool:
        n = max(tokens * per_token // (per_token + depth - context), 1)
        return round_time(n, n * depth + n * (n + 1) // 2, depth + n, 1) <= target

    unbounded = 1 << 40
    if deepest_fits(unbounded):
        return None
    return _largest(deepest_fits, 1, unbounded)
