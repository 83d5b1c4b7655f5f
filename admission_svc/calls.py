"""What a transport hands the front door (`GenerateCall`, `Caller`), what it gets back (`Output`, and through an
`OutputSink` at once), the front door's settings, and its record of one admitted request (`Tracked`).

Plain dataclasses, no gRPC: the gRPC servicer and an HTTP edge build the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from opentelemetry import trace
from opentelemetry.context import Context

from admission_svc.fetched import FETCH_GRACE_S, MAX_FETCHES_AWAITED
from admission_svc.streams import RequestStream
from sluice.types import SamplingParams
from sluice.v1 import common_pb2, events_pb2


@dataclass(frozen=True)
class FrontDoorConfig:
    """Settings of the front door (the budgets are the core's, in AdmissionConfig)."""

    max_prompt_bytes: int = 1 << 20
    """A text prompt over this many UTF-8 bytes is INVALID_ARGUMENT before it is tokenized. 1 MiB is
    twice the text of the longest context served today (128k tokens at ~4 bytes per token) and
    about a second of one tokenizer thread."""
    inline_tokenize_bytes: int = 2048
    """Prompts up to this size are tokenized on the event loop (a few microseconds; a thread hop costs
    more); longer ones on the tokenizer threads, so they delay no other client."""
    tokenizer_threads: int = 2
    """Threads that tokenize long prompts (with the GIL released: TextTokenizer.encode_releasing_gil)."""
    downstream_timeout_s: float = 10.0
    """Timeout of each Route, Submit, Cancel and ListReplicas call."""
    resume_window_s: float = 60.0
    """Seconds a finished stream is kept for an idempotent retry to replay."""
    default_block_size: int = 16
    """Block size for prompt hashes when the router lists no replica of the model."""
    migration_limit: int = 3
    """Moves to another replica one request may make (as Dynamo's --migration-limit); one more ends it
    FAILED with reason `migration_limit`. 0 turns migration off: a lost replica's requests end FAILED."""
    watch_interval_s: float = 0.5
    """How often the watchdog looks for requests whose replica is gone, draining away or unhealthy."""
    stall_timeout_s: float = 2.0
    """A request with no new token for this long has its replica checked (router state, scheduler health)."""
    owner_lease_s: float = 5.0
    """Lease renewed at each scheduler holding this process's requests (every watch_interval_s): one that
    hears nothing for this long cancels them (the process died or lost the scheduler)."""
    migration_retry_s: float = 20.0
    """How long a migrating request keeps trying to be placed (the router may still list the dead
    replica until its heartbeat times out) before it ends FAILED."""
    max_finished_records: int = 2048
    """Finished requests remembered (for GetRequest, Cancel and idempotent retries) at most; the oldest beyond
    this are forgotten first (sluice_admission_records_evicted_total{reason="count"})."""
    finished_record_ttl_s: float = 300.0
    """A finished request is forgotten this many seconds after it ended, at the latest (reason="age")."""
    stream_interval: int = 1
    """Tokens a streamed request's chunks carry at least, after its first (vLLM's --stream-interval): a client's
    stream gets its first token at once, then a chunk (an SSE event, a gRPC message) once this many tokens wait,
    and the rest with the finish. 1: a chunk for whatever arrived, every round. Fewer chunks cost admission and
    the client less per token, at the price of a smoother stream."""
    completion_fetch_grace_s: float = FETCH_GRACE_S
    """A completion fetched from its scheduler (Lookup) whose bus copy has not come this many seconds later counts
    as lost on the bus, with a WARNING; one whose copy comes counts as late (admission_svc/fetched.py)."""
    max_fetches_awaited: int = MAX_FETCHES_AWAITED
    """Fetched completions waiting for their bus copy at most; the oldest beyond are forgotten unjudged."""


@dataclass(frozen=True)
class GenerateCall:
    """One generation as a client asked for it, whatever the transport."""

    prompt: str = ""
    """Text to tokenize (empty when `prompt_token_ids` is given)."""
    prompt_token_ids: tuple[int, ...] = ()
    """The prompt as token ids (then `prompt` must be empty)."""
    model: str = ""
    """Model name or alias ("" = the one this deployment serves)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling and stop settings, unset wire values already resolved."""
    priority: int = 0
    """Scheduling priority (higher first under the priority policy)."""
    adapter_version: str = ""
    """Adapter the replica must serve ("" = the base model)."""
    idempotency_key: str = ""
    """A retry with the same key attaches to the request the first call started ("" = none)."""
    operation: str = "text_completion"
    """GenAI operation name (`gen_ai.operation.name`): "text_completion", or "chat" for a chat endpoint."""
    max_tokens_unset: bool = False
    """The client gave no max_tokens: it is the rest of the model length after the prompt (vLLM's chat
    default), resolved once the prompt is tokenized."""
    add_special_tokens: bool = True
    """Tokenize `prompt` with the tokenizer's special tokens (BOS); False for a prompt rendered from a
    chat template, which writes its own."""
    stream_interval: int = 1
    """Tokens a streamed chunk carries after the first, as the caller asked (vLLM's per-request
    `stream_interval`; 1: every token); the larger of it and admission's --stream-interval applies."""


@dataclass(frozen=True)
class Placement:
    """What admission needs to place a request again (migration): the call, its prompt, its deadline."""

    call: GenerateCall
    prompt_ids: tuple[int, ...]
    deadline_unix_s: float | None = None


@dataclass(frozen=True)
class HandOff:
    """A placed prefill half of a disaggregated pair: where its KV is held and where its decode half goes."""

    prefill_attempt: str
    """The prefill attempt's id (its scheduler holds the KV blocks under it)."""
    prefill_replica_id: str
    prefill_address: str
    decode_replica_id: str
    decode_address: str
    decode_incarnation: str = ""


@dataclass(frozen=True)
class Caller:
    """What the transport knows about the call itself."""

    api_key: str | None = None
    """The bearer key (None = none sent)."""
    deadline_unix_s: float | None = None
    """When the client stops waiting (time.time() clock); None = no deadline."""
    trace_context: Context | None = None
    """The client's trace context from the call's headers (None = start a new trace)."""
    span_attributes: tuple[tuple[str, str], ...] = ()
    """Attributes the transport adds to the request's span (the HTTP edge: `http.route`)."""


@dataclass(frozen=True, slots=True)
class Output:
    """A piece of a generation: new tokens and their text, or (completion set) the successful end."""

    request_id: str
    index: int
    """Index of token_ids[0] in the output (for the last one: the number of tokens)."""
    token_ids: tuple[int, ...] = ()
    text: str = ""
    """Text the tokens complete (the last one: text held back until the end)."""
    created_unix_s: float = 0.0
    """When token_ids[0] was created; 0 = unknown."""
    completion: events_pb2.Completion | None = None
    """Set on the last Output: status, finish reason, usage."""
    logprobs: tuple[common_pb2.TokenLogprobs, ...] = ()
    """One per token_ids entry when the request asked for log-probabilities, else empty."""


class OutputSink(Protocol):
    """A transport's synchronous taker of a streamed request's token Outputs (`FrontDoor.stream`'s `sink`): the
    tokens go from the token reader straight to the client, without a wake-up of the stream's follower each."""

    def ready(self) -> bool:
        """Whether `push` can hand an Output on now (the client can take it at once, in order)."""

    def push(self, output: Output) -> None:
        """Hand on the text (and tokens) of `output` now; called only right after `ready` said True."""


@dataclass
class Tracked:
    """What admission remembers about one request it admitted."""

    request_id: str
    tenant: str
    input_tokens: int
    stream: RequestStream
    span: trace.Span
    received_s: float
    timestamps: common_pb2.LifecycleTimestamps = field(default_factory=common_pb2.LifecycleTimestamps)
    status: common_pb2.RequestStatus = common_pb2.WAITING
    replica_id: str = ""
    scheduler_address: str = ""
    incarnation: str = ""
    """Incarnation of the scheduler the current attempt was routed to ("" = not reported): another one
    listed under the same replica id means that scheduler restarted and lost the attempt."""
    completion: events_pb2.Completion | None = None
    ended: bool = False
    followers: int = 0
    """Generate calls streaming this request now (an idempotent retry is a second follower)."""
    retry_after_s: float | None = None
    """Retry delay of the refusal that kept it from being placed (a REJECTED request)."""
    lost: bool = False
    """Admission ended it FAILED because its replicas were lost more times than it moves a request (or none was
    left to take it): its stream ends UNAVAILABLE (`RequestLost`), not INTERNAL."""
    operation: str = "text_completion"
    """GenAI operation name of the call that started it (span name and metric label)."""
    placement: Placement | None = None
    """How it was placed (set once submitted): what a migration re-submits."""
    attempt_id: str = ""
    """Downstream id of the current attempt ("" until placed; the request id for the first)."""
    migrations: int = 0
    """Times it moved to another replica (its attempt number; planned hand-offs included)."""
    handoffs: int = 0
    """Planned prefill -> decode hand-offs among `migrations` (they do not count against the migration limit)."""
    handoff: HandOff | None = None
    """The current attempt is a prefill half: its decode half follows its FINISHED_LENGTH completion."""
    migrating: bool = False
    """A move is under way (the watchdog and a hand-off must not start a second)."""
    settling: bool = False
    """A successful completion is held while the tokens it counts arrive (Migrator.settle)."""
    bus_completions: set[str] = field(default_factory=set)
    """Its attempts whose completion came on the bus (a Lookup's copy of one of them fetched nothing missing:
    admission_svc/lookups.py)."""
    idempotency_key: str = ""
    """The key it was started with ("" none): forgotten with the record."""
    submitted: bool = False
    """A scheduler accepted its first Submit (its span has the `submitted` stage)."""
    submit_sent_s: float = 0.0
    """When its latest Submit was sent (time.time(); 0: not yet)."""
