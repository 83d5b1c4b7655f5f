"""A round budget sized from the TPOT target, as Sarathi-Serve sizes its chunks from its inter-token target.

Why: near saturation every running request decodes once per round, so a round's time *is* the
time per output token of every request in it. A fixed budget (2,048 query tokens) either wastes
the target (short rounds) or misses it (on 4 x H200 with Llama-3-8B a full 2,048-token round takes
~49 ms against a 50 ms target). So the budget is the largest one whose worst round still fits:

    max_num_batched_tokens = largest B (a multiple of `granule`) with
        round_time(query=B, attended_pairs=B * context + B * (B + 1) / 2, kv_read=0, sampled=seqs)
            <= headroom * tpot_slo
    max_kv_read_tokens     = largest R (a multiple of `granule`) with
        round_time(query=seqs, attended_pairs=R, kv_read=R, sampled=seqs) <= headroom * tpot_slo

`round_time(query_tokens, attended_pairs, kv_read_tokens, sampled_seqs)` is whatever knows the
replica's rounds: the cost model of its model and GPU (`worker_svc.costmodel.CostModel._time`, in
the simulator) or a line through the measured rates (`linear_round_time`: a decode round plus
prefill tokens at the measured rate, in the scheduler service, which sees no model or GPU). The
cost model is a roofline (compute and memory traffic overlap, the larger wins), so the token and
the KV-read limits are found separately and a round at both limits still fits; `headroom` covers
what the model leaves out. A linear model has no KV-read term, so it sets no KV-read budget.

Pure: no clock, no I/O.
"""

from __future__ import annotations

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


def linear_round_time(prefill_tokens_per_s: float, decode_round_s: float) -> RoundTime:
    """Return a round-time model from measured rates: one decode round plus the query tokens at the prefill rate."""
    if prefill_tokens_per_s <= 0:
        raise ValueError(f"prefill_tokens_per_s must be > 0, got {prefill_tokens_per_s}")

    def round_time(query: int, pairs: int, read: int, sampled: int) -> float:
        return decode_round_s + query / prefill_tokens_per_s

    round_time.has_kv_term = False  # type: ignore[attr-defined]
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
                        max_tokens: int = 16384, max_kv_read: int = 1 << 24, min_kv_read: int = 0) -> RoundBudget:
    """Return the largest per-round budgets whose rounds take at most `headroom * tpot_slo_s` (module docstring).

    `context_tokens`: context a prefill chunk attends to besides itself (the chunk of a long prompt
    reads the part before it); `max_num_seqs`: decodes sampled in a KV-bound round; `min_kv_read`:
    the KV-read budget is never below it (pass max_model_len: the core refuses a request whose whole
    context exceeds the cap, and one long request alone decodes well within the target). Raises
    ValueError when the target is not positive or even the smallest round misses it (say so, do
    not run rounds that cannot meet it).
    """
    if tpot_slo_s <= 0 or not 0 < headroom <= 1:
        raise ValueError(f"need tpot_slo_s > 0 and headroom in (0, 1], got {tpot_slo_s}, {headroom}")
    target = headroom * tpot_slo_s
    seqs = max(max_num_seqs, 1)

    def tokens_fit(b: int) -> bool:
        return round_time(b, b * context_tokens + b * (b + 1) // 2, 0, min(b, seqs)) <= target

    def kv_fits(r: int) -> bool:
        return round_time(seqs, r, r, seqs) <= target

    has_kv_term = getattr(round_time, "has_kv_term", True)
    if not tokens_fit(granule) or (has_kv_term and not kv_fits(granule)):
        raise ValueError(f"a round of {granule} tokens or {seqs} decodes already takes over the "
                         f"{target * 1e3:.1f} ms target: the TPOT target cannot be met on this replica")
    tokens = _largest(tokens_fit, granule, max_tokens)
    kv_read = max(_largest(kv_fits, granule, max_kv_read), min_kv_read) if has_kv_term else None
    return RoundBudget(tokens, kv_read, target)
