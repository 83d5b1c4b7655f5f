"""Configuration of one replica's scheduler core (frozen; loaded once at start)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Policy(enum.Enum):
    """Order of the waiting queue."""

    FCFS = "fcfs"
    PRIORITY = "priority"
    FAIR = "fair"
    EDF = "edf"
    SRPF = "srpf"


class PreemptionMode(enum.Enum):
    """What happens to a preemption victim's KV."""

    RECOMPUTE = "recompute"
    SWAP = "swap"


class VictimPolicy(enum.Enum):
    """Whom to preempt when a running request needs a block and none is free (see victims.py)."""

    LOWEST_PRIORITY = "lowest_priority"
    """Lowest priority first, then the latest arrival."""
    LATEST_ARRIVAL = "latest_arrival"
    """The latest arrival first, whatever its priority."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets and policies of one replica's scheduler."""

    num_blocks: int
    """KV blocks on the device (from the worker's capacity)."""
    block_size: int = 16
    """Tokens per KV block."""
    max_num_batched_tokens: int = 2048
    """Query tokens per round (prefill chunk tokens + one per decode)."""
    max_num_seqs: int = 256
    """Sequences per round."""
    max_prefill_chunk: int = 512
    """Most prefill tokens one request may take in one round (chunked prefill)."""
    max_kv_read_tokens: int | None = None
    """Optional cap on context tokens read by one round (bounds inter-token latency)."""
    attention_pairs_per_token: int | None = None
    """Optional: a prefill chunk pays for its attention to context deeper than `attention_free_context` out of
    the round's token budget, one token per this many (query token, earlier token) pairs, so that a chunk of a
    long prompt shrinks to what fits the round's time (sluice.round_budget derives it); None: not charged."""
    attention_free_context: int = 0
    """Context before a chunk that the token budget already pays for (the depth it was sized at): only the
    attention beyond it is charged."""
    max_waiting: int = 4096
    """Bounded waiting queue: a submission is rejected with QUEUE_FULL when the queue plus the running and
    swapped-out requests (which a preemption sends back to it) reach this, so the queue never exceeds it."""
    policy: Policy = Policy.FCFS
    """Order of the waiting queue."""
    aging_rate: float = 1.0
    """Priority points a waiting request gains per second (priority policy)."""
    srpf_tokens_per_s: float = 4096.0
    """Least remaining prefill first (srpf): prefill tokens that weigh as much as one second of waiting."""
    fair_input_weight: float = 1.0
    """Weighted fair share: cost of one input (prefill) token."""
    fair_output_weight: float = 2.0
    """Weighted fair share: cost of one output token."""
    fair_return_credit: float = 2048.0
    """Weighted fair share: how much of the service it was owed (in weighted tokens, the counters' unit) a tenant
    keeps when it is back within `fair_return_window_s` of its last live request's end; 0 forfeits it all."""
    fair_return_window_s: float = 5.0
    """Weighted fair share: a gap up to this long keeps `fair_return_credit`; after a longer one the tenant
    starts at the active minimum (idleness banks nothing). See policies.FairQueue."""
    tenant_weights: tuple[tuple[str, float], ...] = ()
    """Share weight per tenant; unnamed tenants weigh 1."""
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    """What happens to a victim's KV when blocks run out."""
    victim_policy: VictimPolicy = VictimPolicy.LOWEST_PRIORITY
    """Whom to preempt when blocks run out."""
    num_host_blocks: int = 0
    """Host (CPU) blocks for swap mode and the host prefix tier; when none is left, swap falls back to recompute."""
    host_prefix_cache: bool = False
    """A second tier of the prefix cache in the host blocks: registered blocks the device evicts are copied there,
    and a prompt whose prefix continues there is copied back instead of computed (host_blocks.py). Needs
    num_host_blocks >= 1 and enable_prefix_caching."""
    host_load_blocks: int = 0
    """With the host prefix tier: blocks one round copies in at most. A prompt whose prefix continues into the tier
    gets its device blocks at admission and its hits copied in over as many rounds as that takes; it computes in
    the round after the last (its copies touch nothing a forward of theirs reads, so they run beside it). Size
    it for what the host link moves in one round's time. 0: no limit."""
    host_page_out_blocks: int = 256
    """With the host prefix tier: how many of the device's least recently used cached blocks (the next to be
    evicted) are kept copied in the tier; each round copies those among them the tier lacks. The copies touch
    nothing the round's forward uses, so they run beside it and cost no budget. Size it for the blocks a few
    rounds evict: an evicted block not yet copied is lost to the tier."""
    enable_prefix_caching: bool = True
    """Share full blocks by hash chain and keep freed ones in an LRU cache."""
    model_id: str = "tiny"
    """Salts the block hashes, with the adapter version."""
    adapter_version: str = ""
    """Adapter version of the served model (salts the block hashes)."""
    max_model_len: int = 4096
    """Prompt + max_tokens may not exceed this."""
    kv_event_token_ids: bool = False
    """Put each stored block's token ids in its KV event (vLLM's BlockStored.token_ids): what a KV indexer
    needs to rebuild hashes of its own, at block_size extra integers per stored block."""
    kv_hold_s: float = 30.0
    """How long a finished prefill request's KV blocks stay pinned for its decode replica's transfer when nobody
    releases them (a decode side that died or never asked; docs/disaggregation.md)."""
    max_lost_rounds: int = 3
    """A request lost with the worker in more than this many consecutive rounds fails (bounded retry)."""
