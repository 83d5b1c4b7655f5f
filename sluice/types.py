"""The scheduler core's contract: what goes in (requests, round results) and what comes out
(round plans, events). Plain dataclasses; the wire forms are in protos/sluice/v1 and the
conversion lives in each service's `convert` module.

Everything here is shared by the scheduler service, the worker (torch and cost model) and the
simulator, so changes are contract changes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

ATTEMPT_SEPARATOR = "#"
"""A migrated request runs on its new replica as attempt `{request_id}#{n}` (admission_svc/migration.py)."""


DRAIN_HANDOFF = "drain timeout: handed to migration"
"""Detail of the CANCELLED completion a drained replica ends a request with that it hands to migration."""


KV_HELD = "kv held for a hand-off"
"""Detail of the FINISHED_LENGTH completion of a prefill request (`NewRequest.hold_kv`) whose prompt's KV blocks
stay pinned for the decode replica (docs/disaggregation.md): the request itself goes on there."""


def origin_request_id(downstream_id: str) -> str:
    """Return the id of the request an attempt continues (the id itself for a first attempt)."""
    return downstream_id.split(ATTEMPT_SEPARATOR, 1)[0]


class RequestStatus(enum.Enum):
    """Lifecycle states of a request (DESIGN.md); the transition table is in `state.py`."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    CANCELLING = "cancelling"
    FINISHED_STOP = "finished_stop"
    FINISHED_LENGTH = "finished_length"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    FAILED = "failed"
    REJECTED = "rejected"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset(
    {
        RequestStatus.FINISHED_STOP,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.CANCELLED,
        RequestStatus.TIMED_OUT,
        RequestStatus.FAILED,
        RequestStatus.REJECTED,
    }
)


MAX_LOGPROBS = 20
"""The most alternatives a request may ask log-probabilities of (vLLM's default --max-logprobs)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the worker picks tokens and when a request stops."""

    temperature: float = 0.0
    """0 means greedy."""
    top_k: int = 0
    """0 means no top-k cut."""
    top_p: float = 1.0
    """1.0 means no nucleus cut."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    max_tokens: int = 16
    """Number of output tokens after which the request finishes with FINISHED_LENGTH."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that finish the request (FINISHED_STOP); the stop token is part of the output."""
    stop_strings: tuple[str, ...] = ()
    """Strings that finish the request; the worker detects them and reports `stop_string_hit`."""
    ignore_eos: bool = False
    """Keep going past the model's end-of-sequence token."""
    presence_penalty: float = 0.0
    """[-2, 2]: subtracted once from the logit of every token already in the output (0: off)."""
    frequency_penalty: float = 0.0
    """[-2, 2]: subtracted from a token's logit once per time it is in the output (0: off)."""
    repetition_penalty: float = 1.0
    """> 0: a prompt or output token's positive logit is divided by it, a negative one multiplied (1: off)."""
    min_p: float = 0.0
    """[0, 1]: tokens less likely than min_p times the most likely one are dropped (0: off)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias in [-100, 100]) pairs, sorted by id, added to the logits before sampling."""
    logprobs: int | None = None
    """None: no log-probabilities; 0: the chosen token's; N: also the N most likely tokens."""
    json_schema: str = ""
    """Structured output: the output is JSON valid under this JSON schema (its text); "": free text."""
    json_prefix_ids: tuple[int, ...] = ()
    """Output tokens made under the schema before a migration (now the end of the prompt): the grammar replays
    them before this attempt's output."""

    @property
    def penalized(self) -> bool:
        """Return whether a penalty needs the request's token history (the whole output, and the prompt
        for the repetition penalty) in every round."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def reads_output(self) -> bool:
        """Return whether the worker needs the whole output in every round: a penalty counts it, a grammar
        replays it into the request's matcher when the worker has none for it (after preemption, migration
        or a restart), so the matcher's state is the request's run-state, not the worker's."""
        return self.penalized or bool(self.json_schema)


@dataclass(slots=True)
class NewRequest:
    """A request as submitted to a replica's scheduler."""

    request_id: str
    prompt_token_ids: Sequence[int]
    """A tuple, or an `array('q')` (the simulator's: the core copies it into its own array as bytes)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = "default"
    priority: int = 0
    """Larger runs first (with the priority policy); 0 is normal."""
    arrival_time: float = 0.0
    """Seconds on the caller's clock (the same clock as every `now`)."""
    deadline: float | None = None
    """Absolute time by which the request must finish, else TIMED_OUT."""
    queue_deadline: float | None = None
    """Absolute time by which the request must be first scheduled, else TIMED_OUT."""
    eos_token_id: int | None = None
    """The model's end-of-sequence token (finishes the request unless ignore_eos)."""
    tenant_weight: float | None = None
    """The tenant's fair-share weight as admission's configuration sets it (None: the scheduler's own)."""
    cache_salt: str = ""
    """The tenant's prefix-cache salt ("": cached prefixes are shared with every tenant of the model)."""
    hold_kv: bool = False
    """The prefill half of a disaggregated pair: when it ends FINISHED_LENGTH, its prompt's full blocks stay pinned
    for the decode replica's transfer (scheduler_svc/core/handoffs.py)."""


PENDING_TOKEN = -1
"""A token id in a plan placed ahead (overlap scheduling): the token the worker sampled for the same
request and epoch in the round before; the scheduler has not seen it yet."""


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's work in a round.

    Compute `token_ids` at positions `start_position ...`; their KV goes into the slots given by
    `block_table` (block i holds positions [i*block_size, (i+1)*block_size)). When `sample` is
    set, sample one token after the last of them, as output token number `output_index`.
    """

    request_id: str
    epoch: int
    token_ids: tuple[int, ...]
    start_position: int
    block_table: tuple[int, ...]
    sampling: SamplingParams
    sample: bool
    output_index: int
    recent_output_ids: tuple[int, ...] = ()
    """Tail of the output so far, filled only when stop strings are set (the worker is stateless); the whole
    output when a penalty is set (`SamplingParams.penalized`)."""
    prompt_token_ids: tuple[int, ...] = ()
    """The prompt, filled only when the repetition penalty is set (it counts prompt tokens too)."""

    @property
    def is_prefill(self) -> bool:
        return len(self.token_ids) > 1 or not self.sample


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy one KV block: device -> host for swap out, host -> device for swap in."""

    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class RoundBudget:
    """What a round was allowed and what it used (reported in every plan)."""

    max_query_tokens: int
    used_query_tokens: int
    max_seqs: int
    used_seqs: int
    max_kv_read_tokens: int | None
    used_kv_read_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    attention_tokens: int
    """Tokens of the query budget that deep prefill chunks paid for their attention (not in used_query_tokens;
    SchedulerConfig.attention_pairs_per_token)."""


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """Everything a worker needs to execute one round. Swaps run before the forward."""

    round_id: int
    seqs: tuple[ScheduledSeq, ...]
    swap_out: tuple[BlockCopy, ...] = ()
    swap_in: tuple[BlockCopy, ...] = ()
    budget: RoundBudget | None = None

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.swap_out and not self.swap_in


@dataclass(frozen=True, slots=True)
class SeqOutput:
    """A worker's answer for one ScheduledSeq."""

    request_id: str
    epoch: int
    token_ids: tuple[int, ...] = ()
    """The sampled token (one) when the seq asked for sampling; empty otherwise."""
    stop_string_hit: bool = False
    logprobs: TokenLogprobs | None = None
    """The sampled token's log-probability and the top alternatives, when the sampling asks for them."""


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One output token's log-probability under the model (log-softmax of the raw logits, as vLLM's default
    `raw_logprobs`), and the most likely tokens with theirs, most likely first."""

    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class RefusedSeq:
    """A sequence of a plan the worker refused (INVALID_ARGUMENT: it does not fit the worker) and did not run."""

    request_id: str
    field_name: str
    """The plan field at fault, e.g. "seqs[1].token_ids"."""
    message: str
    """What does not fit (the InvalidArgument's message)."""

    @property
    def detail(self) -> str:
        """The refusal as one line: "INVALID_ARGUMENT (field): message"."""
        return f"INVALID_ARGUMENT ({self.field_name}): {self.message}"


@dataclass(frozen=True, slots=True)
class RoundResult:
    """A worker's answer for one RoundPlan."""

    round_id: int
    outputs: tuple[SeqOutput, ...]
    elapsed_s: float = 0.0
    error: str = ""
    """Non-empty: the round failed as a whole (every request in it fails)."""
    refused: tuple[RefusedSeq, ...] = ()
    """Sequences the worker refused and did not run (the rest ran): exactly their requests fail."""


class RejectReason(enum.Enum):
    """Why the core refused a submission (the servicer maps each to a gRPC status)."""

    NEVER_FITS = "never_fits"
    """Prompt + max_tokens needs more KV blocks than the replica has (INVALID_ARGUMENT)."""
    QUEUE_FULL = "queue_full"
    """The bounded waiting queue is full (RESOURCE_EXHAUSTED)."""
    DUPLICATE = "duplicate"
    """A live request already has this id (ALREADY_EXISTS)."""
    INVALID = "invalid"
    """Empty prompt, max_tokens < 1 and the like (INVALID_ARGUMENT)."""


class KvEventKind(enum.Enum):
    """vLLM's KV event kinds: BlockStored, BlockRemoved, AllBlocksCleared."""

    STORED = "stored"
    REMOVED = "removed"
    ALL_CLEARED = "all_cleared"


class KvMedium(enum.Enum):
    """Where a block's KV is held (vLLM's `medium` strings)."""

    GPU = "GPU"
    """The replica's device KV: what the prefix cache can hit."""
    CPU = "CPU"
    """Host copies of a swapped-out request's blocks: private to it, never a prefix hit for another."""


@dataclass(frozen=True, slots=True)
class KvEvent:
    """A change of the replica's KV blocks; event ids are monotonic per replica (both media share them)."""

    event_id: int
    kind: KvEventKind
    block_hashes: tuple[int, ...] = ()
    parent_hash: int = 0
    """The parent of block_hashes[0] (STORED); 0: the first block of a sequence."""
    token_ids: tuple[int, ...] = ()
    """The stored blocks' tokens, block_size per block (STORED, only when the replica is asked to send them)."""
    medium: KvMedium = KvMedium.GPU


class Stage(enum.Enum):
    """Lifecycle stages the core reports (each becomes a span event; DESIGN.md Observability)."""

    ENQUEUED = "enqueued"
    FIRST_SCHEDULED = "first_scheduled"
    PREFILL_CHUNK = "prefill_chunk"
    FIRST_TOKEN = "first_token"
    PREEMPTED = "preempted"
    RESUMED = "resumed"
    CANCEL_REQUESTED = "cancel_requested"
    FINISHED = "finished"
    KV_RELEASED = "kv_released"


@dataclass(frozen=True, slots=True)
class LifecycleEvent:
    request_id: str
    stage: Stage
    time: float
    detail: tuple[tuple[str, int | str], ...] = ()
    """Stage attributes, e.g. (("tokens", 512),) for a prefill chunk or (("mode", "swap"),)."""


@dataclass(slots=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache when the request was first scheduled."""
    recomputed_tokens: int = 0
    """Tokens computed again because of preemption by recompute."""
    preemptions: int = 0


@dataclass(slots=True)
class Finished:
    """The terminal record of a request, emitted exactly once."""

    request_id: str
    tenant: str
    status: RequestStatus
    finish_reason: str
    """"stop", "length", "cancelled", "timeout", "error"."""
    usage: Usage
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float
    output_token_ids: tuple[int, ...] = ()
    detail: str = ""


@dataclass(slots=True)
class CoreEvents:
    """Everything the core has to say since the last `take_events()`; the driver publishes it."""

    tokens: list[tuple[str, int, int]] = field(default_factory=list)
    """(request_id, output index, token id) in order."""
    finished: list[Finished] = field(default_factory=list)
    lifecycle: list[LifecycleEvent] = field(default_factory=list)
    kv_events: list[KvEvent] = field(default_factory=list)
    dropped_results: int = 0
    """Results dropped since the last take: late (request gone) or stale (old epoch)."""
    logprobs: dict[tuple[str, int], TokenLogprobs] = field(default_factory=dict)
    """(request_id, output index) -> that token's log-probabilities, for requests that ask for them."""


@dataclass(slots=True)
class RequestTotals:
    """Running totals of the requests one scheduler took since it started, as its Stats RPC reports them
    (`SchedulerStats.input_tokens` ...): an observer takes an interval's means from two reads (the deployed planner,
    planner_svc/observe.py)."""

    input_tokens: int = 0
    """Prompt tokens of the requests submitted."""
    max_output_tokens: int = 0
    """The max_tokens those requests asked for."""
    ttft_s: float = 0.0
    ttft_count: int = 0
    """Submit to first token, summed over the requests that got one, and how many."""
    tpot_s: float = 0.0
    tpot_count: int = 0
    """First to last token per token after the first, summed over the finished requests with two or more."""

    def since(self, earlier: RequestTotals) -> RequestTotals | None:
        """The growth since `earlier`; None when a total went down (the scheduler restarted)."""
        pairs = [(getattr(self, f.name), getattr(earlier, f.name)) for f in fields(self)]
        if any(now < then for now, then in pairs):
            return None
        return RequestTotals(*(now - then for now, then in pairs))


@dataclass(frozen=True, slots=True)
class CoreStats:
    waiting: int
    running: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    host_blocks_total: int
    host_blocks_used: int
    preemptions: int
    recomputed_tokens: int
    dropped_results: int
    rounds: int
    queued_prefill_tokens: int
    finished: int
    cancelled: int
    timed_out: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    host_hit_tokens: int
    """Of prefix_hit_tokens, those found in the host (CPU) prefix tier."""
    host_blocks_cached: int
    """Host blocks holding prefix-tier copies (confirmed, pending or being read)."""


@dataclass(frozen=True)
class BackendInfo:
    """What a worker tells its scheduler (and WorkerService.Info) about itself."""

    model_id: str
    model_version: str
    block_size: int
    num_blocks: int
    num_host_blocks: int
    dtype: str
    device: str
    max_model_len: int
    vocab_size: int
    eos_token_id: int
    backend: str
    """"torch" or "costmodel"."""
    structured_output: bool = False
    """Honours `SamplingParams.json_schema` (a grammar masks the tokens); else the scheduler refuses it."""


# ---- a replica's presence at the router (sent by the scheduler, kept by the router, played by the simulator) ----


class ReplicaState(enum.Enum):
    """Where a replica stands with the router; the router's transition table is in router_svc/fleet.py."""

    WARMING = "warming"
    READY = "ready"
    DRAINING = "draining"
    GONE = "gone"
    UNHEALTHY = "unhealthy"
    """Registered, but its worker is down: no traffic until it reports READY again."""


class ReplicaRole(enum.Enum):
    """What a replica serves (prefill/decode disaggregation, docs/disaggregation.md)."""

    BOTH = "both"
    """Whole requests: prompt and decodes (the default; aggregated serving)."""
    PREFILL = "prefill"
    """Prompts only: the KV blocks then go to a decode replica."""
    DECODE = "decode"
    """Decodes only, of requests whose KV blocks a prefill replica sent."""

    @property
    def prefills(self) -> bool:
        """Return True when the replica may run prompts."""
        return self is not ReplicaRole.DECODE

    @property
    def decodes(self) -> bool:
        """Return True when the replica may run decodes."""
        return self is not ReplicaRole.PREFILL


class ReplicaInput(enum.Enum):
    """What moves a replica between states (the inputs of the router's replica table)."""

    WARMED = "warmed"
    """The replica reports its model loaded and a warm-up round done."""
    DRAIN = "drain"
    """Stop sending it traffic; in-flight work finishes."""
    REMOVE = "remove"
    """It left, or its heartbeat was lost."""
    FAULT = "fault"
    """It reports its worker down (it cannot run rounds until the worker is back)."""


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """A replica's load as a heartbeat reports it (built by `sluice.glue.replica_load`)."""

    waiting: int = 0
    running: int = 0
    queued_prefill_tokens: int = 0
    kv_blocks_free: int = 0
    prefill_tokens_per_s: float = 0.0
    """Measured by the replica from its rounds; 0 = not yet (the spec's registered rate is used)."""
    decode_round_s: float = 0.0
    """Measured by the replica from its rounds; 0 = not yet (the spec's registered value is used)."""


@dataclass(frozen=True, slots=True)
class HeartbeatReport:
    """One heartbeat: the state a replica reports and its load (built by `sluice.glue.heartbeat_report`)."""

    replica_id: str
    state: ReplicaState | None
    """None: the wire said nothing (UNSPECIFIED); the router then changes no state."""
    load: ReplicaLoad
