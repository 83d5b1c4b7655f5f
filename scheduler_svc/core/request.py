"""The core's mutable record of one live request (internal; the contract types are in types.py)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from sluice.hashing import block_hash, hash_chain
from sluice.types import BlockCopy, NewRequest, RequestStatus, SamplingParams, Usage

_NO_STOP_TOKENS: frozenset[int] = frozenset()


class Request:
    """One request's progress: tokens, computed prefix, blocks, epoch and where it is."""

    # Slots are laid out in this order: the fields every round reads or writes for a decode
    # come first, so that they share the object's first cache lines (a round at 1024 running
    # touches 1024 of these).
    __slots__ = (
        "in_flight_round",
        "in_flight_prev",
        "status",
        "num_computed",
        "tokens",
        "last_token_ids",
        "num_prompt",
        "block_ids",
        "block_table",
        "stop_tail",
        "pending_prefill",
        "request_id",
        "epoch",
        "sampling",
        "lost_rounds",
        "num_registered",
        "max_tokens",
        "eos_token_id",
        "stop_token_ids",
        "tenant",
        "priority",
        "arrival_time",
        "deadline",
        "queue_deadline",
        "block_hashes",
        "salt",
        "host_blocks",
        "loads",
        "loading",
        "swap_pinned",
        "held_blocks",
        "recompute_debt",
        "release_input",
        "arrival_seq",
        "queue_seq",
        "first_scheduled_time",
        "first_token_time",
        "usage",
    )

    def __init__(self, new: NewRequest, arrival_seq: int) -> None:
        sampling: SamplingParams = new.sampling
        self.request_id = new.request_id
        self.tenant = new.tenant
        self.priority = new.priority
        self.arrival_time = new.arrival_time
        self.deadline = new.deadline
        self.queue_deadline = new.queue_deadline
        self.eos_token_id = None if sampling.ignore_eos else new.eos_token_id
        self.sampling = sampling
        self.max_tokens = sampling.max_tokens
        self.stop_token_ids = frozenset(sampling.stop_token_ids) if sampling.stop_token_ids else _NO_STOP_TOKENS
        # The worker is stateless: it needs enough output tail to match the longest stop string.
        self.stop_tail = (
            max(len(s.encode()) for s in sampling.stop_strings) + 1 if sampling.stop_strings else 0
        )
        if sampling.reads_output:  # a penalty or a grammar reads the whole output every round
            self.stop_tail = sampling.max_tokens + 1
        # An array, not a list: the garbage collector does not walk it (see block_pool.py).
        # Raises OverflowError/TypeError for ids that are not 64-bit integers.
        self.tokens = array("q", new.prompt_token_ids)
        self.num_prompt = len(self.tokens)
        self.last_token_ids: tuple[int, ...] = ()
        """The last output token as a 1-tuple, `(tokens[-1],)` once there is one: the worker's own tuple,
        reused as the next decode's token_ids (one tuple and one int fewer per decode per round)."""
        self.num_computed = 0
        self.pending_prefill = 0
        """Prefill tokens not yet scheduled that this request adds to the core's pending-prefill count."""
        self.block_ids = array("q")
        self.block_table: tuple[int, ...] = ()
        # Arrays, and shared empty tuples until a swap: fewer objects and items for a full
        # collection to walk per live request (the p99 of a round at 1024 running is one).
        self.block_hashes = array("Q")
        self.salt = 0
        """The block-hash salt: the replica's, or the tenant's own (set by the core at submission)."""
        self.num_registered = 0
        self.status = RequestStatus.WAITING
        self.epoch = 0
        self.in_flight_round: int | None = None
        """The latest in-flight round that reads this request (None when none does)."""
        self.in_flight_prev: int | None = None
        """An earlier in-flight round that reads it too: set while it is placed ahead (overlap scheduling)
        in the round after the one whose token it waits for; cleared when that round answers."""
        self.host_blocks: Sequence[int] = ()
        """Host blocks holding this request's swapped-out KV (empty unless swapped out)."""
        self.loads: tuple[BlockCopy, ...] = ()
        """Host prefix-tier hits (host block -> its device block) not yet copied in: a round copies at most
        host_load_blocks of them, and the request computes only once none is left and none is in flight."""
        self.loading = False
        """A round copying some of its host-tier hits in is in flight (the request computes after it)."""
        self.swap_pinned: Sequence[int] = ()
        """Device blocks pinned until this request's swap-out copy is done."""
        self.held_blocks: Sequence[int] = ()
        """Device blocks of an ended request pinned until the in-flight round that still reads it answers."""
        self.recompute_debt = 0
        """Tokens computed before the last recompute preemption (not yet counted as recomputed)."""
        self.lost_rounds = 0
        """Consecutive rounds of this request lost with the worker (reset by a round that answers)."""
        self.release_input: object = None
        """The state-machine input that ends a CANCELLING request once its round's result arrives."""
        self.arrival_seq = arrival_seq
        self.queue_seq = -1
        """Sequence number of the live waiting-queue entry; -1 when not queued (lazy deletion)."""
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.usage = Usage(input_tokens=self.num_prompt)

    @property
    def num_outputs(self) -> int:
        """Return the number of output tokens so far."""
        return len(self.tokens) - self.num_prompt

    @property
    def output_ids(self) -> tuple[int, ...]:
        """Return the output tokens so far."""
        return tuple(self.tokens[self.num_prompt :])

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed}/"
            f"{len(self.tokens)}, blocks={len(self.block_ids)}, epoch={self.epoch})"
        )


def block_hashes_upto(request: Request, count: int, block_size: int, salt: int) -> array[int]:
    """Return `request`'s block-hash chain, extended to at least `count` full blocks.

    The chain is kept on the request, so admission, the prefix-cache lookup and registration
    compute each hash once.
    """
    hashes = request.block_hashes
    tokens = request.tokens
    have = len(hashes)
    if count - have > 1 and count * block_size <= len(tokens):  # several full blocks (a prompt): one packing
        hashes.extend(hash_chain(tokens[have * block_size : count * block_size], block_size, salt,
                                 hashes[-1] if have else 0))
    while len(hashes) < count:
        start = len(hashes) * block_size
        hashes.append(block_hash(hashes[-1] if hashes else 0, salt, tokens[start : start + block_size]))
    return hashes
