"""A hand-driven plan builder for tests and benchmarks: sequential block ids, no policy.

It plays the scheduler's part just enough to build valid RoundPlans (prefill chunks, decodes,
prefix reuse, preemption by recompute, swap) without depending on the scheduler core, so the
engine can be checked on its own. It is not a scheduler: callers say what runs in each round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sluice.types import BlockCopy, RoundPlan, RoundResult, SamplingParams, ScheduledSeq
from worker_svc.backend import Backend
from worker_svc.engine.model import LlamaForCausalLM, reference_forward

RECENT_OUTPUT_TAIL = 16
"""Output ids sent along for stop-string checks."""


@dataclass
class ManualSeq:
    """One sequence as the planner tracks it."""

    request_id: str
    prompt: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    blocks: list[int] = field(default_factory=list)
    host_blocks: list[int] = field(default_factory=list)
    computed: int = 0
    """Tokens whose K/V is in the cache."""
    output: list[int] = field(default_factory=list)
    epoch: int = 0
    stop_string_hit: bool = False

    @property
    def tokens(self) -> tuple[int, ...]:
        """Return prompt + output."""
        return (*self.prompt, *self.output)


class ManualPlanner:
    """Allocates block ids sequentially from a free list and builds and runs rounds."""

    def __init__(self, backend: Backend, block_size: int, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.backend, self.block_size = backend, block_size
        self.free = list(range(num_blocks))
        self.free_host = list(range(num_host_blocks))
        self.round_id = 0

    def add(
        self, request_id: str, prompt: Sequence[int], sampling: SamplingParams | None = None
    ) -> ManualSeq:
        """Return a new sequence (nothing is allocated until it is scheduled)."""
        return ManualSeq(request_id, tuple(prompt), sampling or SamplingParams())

    def share_prefix(self, seq: ManualSeq, donor: ManualSeq, num_blocks: int) -> None:
        """Let seq reuse donor's first num_blocks full blocks (a prefix-cache hit): seq computes only the rest."""
        seq.blocks = donor.blocks[:num_blocks]
        seq.computed = num_blocks * self.block_size

    def scheduled(self, seq: ManualSeq, chunk: int | None = None) -> ScheduledSeq:
        """Return seq's next piece of work: up to chunk uncomputed tokens, sampling when it reaches the end."""
        tokens = seq.tokens
        end = len(tokens) if chunk is None else min(len(tokens), seq.computed + chunk)
        needed = -(-end // self.block_size)
        while len(seq.blocks) < needed:
            seq.blocks.append(self.free.pop(0))
        sample = end == len(tokens)
        return ScheduledSeq(
            request_id=seq.request_id,
            epoch=seq.epoch,
            token_ids=tokens[seq.computed : end],
            start_position=seq.computed,
            block_table=tuple(seq.blocks),
            sampling=seq.sampling,
            sample=sample,
            output_index=len(seq.output),
            recent_output_ids=tuple(seq.output[-RECENT_OUTPUT_TAIL:]) if seq.sampling.stop_strings else (),
        )

    def run(
        self,
        seqs: Sequence[ManualSeq],
        chunks: Sequence[int | None] | None = None,
        swaps: RoundPlan | None = None,
    ) -> RoundResult:
        """Run one round over seqs (with optional per-seq chunk caps and swaps) and record the outputs.

        Raises RuntimeError when the backend reports an error.
        """
        caps = chunks or [None] * len(seqs)
        work = [self.scheduled(seq, cap) for seq, cap in zip(seqs, caps, strict=True)]
        self.round_id += 1
        plan = RoundPlan(
            self.round_id,
            tuple(work),
            swap_out=swaps.swap_out if swaps else (),
            swap_in=swaps.swap_in if swaps else (),
        )
        result = self.backend.execute(plan)
        if result.error:
            raise RuntimeError(result.error)
        for seq, item, output in zip(seqs, work, result.outputs, strict=True):
            seq.computed += len(item.token_ids)
            seq.output.extend(output.token_ids)
            seq.stop_string_hit |= output.stop_string_hit
        return result

    def generate(self, seqs: Sequence[ManualSeq], num_tokens: int, chunk: int | None = None) -> None:
        """Run rounds over all seqs together until each has num_tokens output tokens."""
        while any(len(s.output) < num_tokens for s in seqs):
            active = [s for s in seqs if len(s.output) < num_tokens]
            self.run(active, [chunk] * len(active))

    def preempt_recompute(self, seq: ManualSeq) -> None:
        """Free seq's blocks and forget its cache: it will re-prefill prompt + output (new epoch)."""
        self.free.extend(seq.blocks)
        seq.blocks, seq.computed, seq.epoch = [], 0, seq.epoch + 1

    def swap_out(self, seq: ManualSeq) -> RoundPlan:
        """Return a plan whose swap_out moves seq's blocks to host blocks; seq then owns the host blocks."""
        seq.host_blocks = [self.free_host.pop(0) for _ in seq.blocks]
        copies = tuple(BlockCopy(d, h) for d, h in zip(seq.blocks, seq.host_blocks, strict=True))
        self.free.extend(seq.blocks)
        seq.blocks = []
        return RoundPlan(0, (), swap_out=copies)

    def swap_in(self, seq: ManualSeq) -> RoundPlan:
        """Return a plan whose swap_in brings seq's host blocks back into fresh device blocks."""
        seq.blocks = [self.free.pop() for _ in seq.host_blocks]
        copies = tuple(BlockCopy(h, d) for h, d in zip(seq.host_blocks, seq.blocks, strict=True))
        self.free_host.extend(seq.host_blocks)
        seq.host_blocks = []
        return RoundPlan(0, (), swap_in=copies)


def reference_greedy(
    model: LlamaForCausalLM, prompt: Sequence[int], num_tokens: int, vocab: int
) -> list[int]:
    """Return num_tokens greedy tokens after prompt, re-running the whole sequence each step."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        logits = reference_forward(model, torch.tensor(tokens))
        tokens.append(int(logits[-1, :vocab].argmax()))
    return tokens[len(prompt) :]
