"""How much an admitted request reserves: the reservation policies and the KV-block ledger of admission.

Both are part of ledger 1 of DESIGN.md (the admission reservation: predicted work, held from accept to
terminal state). Neither is the scheduler's KV occupancy (ledger 2, blocks really allocated on a
replica) nor a round budget (ledger 3): admission counts what it *expects* requests to need, before any
replica has allocated anything.

Reservation policies (`ReservationPolicy` names them; `make_reserver` builds one):

* conservative: reserve max_tokens. A request can never outrun it; most requests use far less.
* predicted: reserve the configured percentile of the last `window` output lengths observed for the
  same (tenant, model) (completions that finished, learnt at release), at most max_tokens; until
  `min_samples` completions were seen, max_tokens. A request whose streamed output outruns its
  reservation grows it to max(generated, reserved x growth_factor), at most max_tokens (geometric, so a
  long request grows O(log) times), and everything is reclaimed at its end.

When growth finds no budget, the rule is: **run over-committed, counted**. Admission neither generates
tokens nor holds KV, so it cannot queue a growth (the tokens are already produced) or preempt (the
scheduler owns preemption, on the real KV ledger); it grants the growth, counts it as an over-committed
growth, and the ledger, now over its cap, refuses new admissions until releases bring it back.

The KV-block ledger counts, for the requests it holds, every distinct full prompt block once (by its
block hash, reference-counted: the same system prompt in 100 requests is one block) plus each request's
own blocks: its partial last prompt block and its reserved output, rounded up to blocks.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from sluice.config import ReservationConfig, ReservationPolicy


class OutputLengths:
    """Sliding windows of observed output lengths per (tenant, model), with a cached percentile."""

    def __init__(self, window: int, percentile: float) -> None:
        self.window = window
        self.percentile = percentile
        self._samples: dict[tuple[str, str], deque[int]] = {}
        self._cached: dict[tuple[str, str], tuple[int, int]] = {}
        self._seen: dict[tuple[str, str], int] = {}

    def observe(self, tenant: str, model: str, output_tokens: int) -> None:
        """Remember one finished request's output length."""
        key = (tenant, model)
        self._samples.setdefault(key, deque(maxlen=self.window)).append(output_tokens)
        self._seen[key] = self._seen.get(key, 0) + 1

    def count(self, tenant: str, model: str) -> int:
        """Return how many samples the window of (tenant, model) holds."""
        samples = self._samples.get((tenant, model))
        return len(samples) if samples is not None else 0

    def quantile(self, tenant: str, model: str) -> int:
        """Return the percentile of the window (nearest rank); 0 for an empty window.

        Recomputed after every window/50 new samples, so a prediction costs O(1) amortised."""
        key = (tenant, model)
        samples = self._samples.get(key)
        if not samples:
            return 0
        seen = self._seen[key]
        cached = self._cached.get(key)
        if cached is not None and seen - cached[0] < max(1, self.window // 50):
            return cached[1]
        ordered = sorted(samples)
        rank = max(1, math.ceil(self.percentile * len(ordered)))
        value = ordered[rank - 1]
        self._cached[key] = (seen, value)
        return value


class Reserver(Protocol):
    """A reservation policy: how much output a request reserves at admission and when it outruns it."""

    def initial(self, tenant: str, model: str, max_tokens: int) -> int:
        """Return the output tokens to reserve at admission (1..max_tokens)."""

    def grown(self, reserved: int, generated: int, max_tokens: int) -> int:
        """Return the new reservation of a request that has generated more than it reserved."""

    def observe(self, tenant: str, model: str, output_tokens: int) -> None:
        """Learn one finished request's output length."""


class ConservativeReserver:
    """Reserve max_tokens: never outrun."""

    def initial(self, tenant: str, model: str, max_tokens: int) -> int:
        return max_tokens

    def grown(self, reserved: int, generated: int, max_tokens: int) -> int:
        return max(max_tokens, generated)

    def observe(self, tenant: str, model: str, output_tokens: int) -> None:
        """Nothing to learn."""


class PredictedReserver:
    """Reserve a percentile of the recent output lengths of the tenant and model; grow geometrically."""

    def __init__(self, config: ReservationConfig) -> None:
        self.config = config
        self.lengths = OutputLengths(config.window, config.percentile)

    def initial(self, tenant: str, model: str, max_tokens: int) -> int:
        if self.lengths.count(tenant, model) < self.config.min_samples:
            return max_tokens
        return min(max_tokens, max(1, self.lengths.quantile(tenant, model)))

    def grown(self, reserved: int, generated: int, max_tokens: int) -> int:
        step = math.ceil(reserved * self.config.growth_factor)
        return max(generated, min(max_tokens, step))

    def observe(self, tenant: str, model: str, output_tokens: int) -> None:
        self.lengths.observe(tenant, model, output_tokens)


def make_reserver(config: ReservationConfig) -> Reserver:
    """Return the reservation policy `config.policy` names; raises ValueError for an unknown one."""
    if config.policy is ReservationPolicy.CONSERVATIVE:
        return ConservativeReserver()
    if config.policy is ReservationPolicy.PREDICTED:
        return PredictedReserver(config)
    known = ", ".join(p.value for p in ReservationPolicy)
    raise ValueError(f"unknown reservation policy {config.policy!r}; known: {known}")


def request_blocks(input_tokens: int, reserved_output_tokens: int, block_size: int, full_prompt_blocks: int) -> int:
    """Return a request's own KV blocks: its context rounded up to blocks, less the full prompt blocks
    counted (shared) by their hashes."""
    total = -(-(input_tokens + reserved_output_tokens) // max(block_size, 1))
    return max(total - full_prompt_blocks, 0)


class BlockLedger:
    """KV blocks reserved by the requests it holds: distinct prompt blocks once (reference-counted) plus
    each request's own blocks."""

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}
        self.own_blocks = 0

    @property
    def blocks(self) -> int:
        """Return the blocks reserved: distinct shared prompt blocks + every request's own."""
        return len(self._refs) + self.own_blocks

    def new_blocks(self, hashes: Iterable[int]) -> int:
        """Return how many of `hashes` (distinct) no request in the ledger holds yet."""
        return sum(1 for h in set(hashes) if h not in self._refs)

    def add(self, hashes: Iterable[int], own_blocks: int) -> None:
        """Hold one request's prompt blocks and own blocks."""
        for h in hashes:
            self._refs[h] = self._refs.get(h, 0) + 1
        self.own_blocks += own_blocks

    def remove(self, hashes: Iterable[int], own_blocks: int) -> None:
        """Let go of what `add` held for one request (a hash's last holder forgets it)."""
        for h in hashes:
            left = self._refs[h] - 1
            if left:
                self._refs[h] = left
            else:
                del self._refs[h]
        self.own_blocks -= own_blocks


@dataclass
class Reservation:
    request_id: str
    tenant: str
    input_tokens: int
    reserved_output_tokens: int
    admitted_at: float
    started: bool = False
    max_tokens: int = 0
    """What the request asked for (the most its reservation can grow to)."""
    model: str = ""
    block_hashes: tuple[int, ...] = ()
    """Its full prompt blocks' hashes (shared blocks are counted once across requests)."""
    block_size: int = 16
    generated: int = 0
    """Output tokens streamed so far (the growth signal)."""

    @property
    def own_blocks(self) -> int:
        """KV blocks of its own: partial last prompt block and reserved output, rounded up."""
        return request_blocks(self.input_tokens, self.reserved_output_tokens, self.block_size,
                              len(self.block_hashes))


@dataclass
class Usage:
    """The five budgets' usage (in the core's budget order), for one tenant or globally."""

    active: int = 0
    queued: int = 0
    pending_input_tokens: int = 0
    reserved_output_tokens: int = 0
    kv: BlockLedger = field(default_factory=BlockLedger)

    def add(self, reservation: Reservation, sign: int) -> None:
        self.active += sign
        if not reservation.started:
            self.queued += sign
            self.pending_input_tokens += sign * reservation.input_tokens
        self.reserved_output_tokens += sign * reservation.reserved_output_tokens
        if sign > 0:
            self.kv.add(reservation.block_hashes, reservation.own_blocks)
        else:
            self.kv.remove(reservation.block_hashes, reservation.own_blocks)

    def used(self) -> tuple[int, ...]:
        """Return (active, queued, pending input tokens, reserved output tokens, reserved KV blocks)."""
        return (self.active, self.queued, self.pending_input_tokens, self.reserved_output_tokens, self.kv.blocks)


@dataclass(frozen=True)
class Growth:
    """A reservation grown because its request outran it."""

    request_id: str
    reserved_output_tokens: int
    """The reservation after growing."""
    overcommitted: bool
    """The ledger had no room for it: granted anyway, over the cap named in `budget`."""
    budget: str = ""
