"""A round plan's sequences turned into the flat tensors one forward needs.

All query tokens of the round are laid out in one [T] vector so each linear layer runs once per
round. Single-token sequences (decodes) come first, so their attention can run as one padded
batch; multi-token chunks (prefills) follow, each attended on its own. Everything is validated
here, before the cache is touched, so a bad plan changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sluice.types import ScheduledSeq
from worker_svc.engine.errors import PlanError

ToDevice = Callable[[np.ndarray], torch.Tensor]


@dataclass(frozen=True)
class DecodeGroup:
    """Attention inputs of the first `num_tokens` query tokens (one per single-token sequence)."""

    num_tokens: int
    slots: torch.Tensor
    """[B, Lmax] cache slots of each sequence's context (padding points at slot 0)."""
    mask: torch.Tensor
    """[B, 1, 1, Lmax] True where the key is part of the context."""
    lengths: tuple[int, ...]
    """Context length of each sequence (for the unpadded per-sequence variant)."""


@dataclass(frozen=True)
class PrefillSpan:
    """Attention inputs of one multi-token chunk: query rows [start, end) of the round."""

    start: int
    end: int
    context_slots: torch.Tensor
    """[L] cache slots of positions 0 .. L-1 (L = start_position + chunk length)."""
    mask: torch.Tensor | None
    """[n, L] causal mask offset by start_position; None when the chunk starts at 0 (plain causal)."""


@dataclass(frozen=True)
class RoundInputs:
    """The flattened round: token ids, positions, slots, attention groups and rows to sample."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    decode: DecodeGroup | None
    prefills: tuple[PrefillSpan, ...]
    sample_rows: torch.Tensor
    """Round rows of the last token of each sequence that samples."""
    sample_seq_indices: tuple[int, ...]
    """Index in plan.seqs of each sampling sequence, in the order of sample_rows."""


@dataclass(frozen=True)
class EngineLimits:
    """What a plan must stay within."""

    block_size: int
    num_blocks: int
    vocab_size: int
    max_positions: int


def validate_seq(seq: ScheduledSeq, limits: EngineLimits) -> None:
    """Raise PlanError when seq cannot run: empty, out of range tokens/positions/blocks."""
    name = f"seq {seq.request_id!r} (epoch {seq.epoch})"
    if not seq.token_ids:
        raise PlanError(f"{name}: no token_ids to compute")
    end = seq.start_position + len(seq.token_ids)
    if seq.start_position < 0 or end > limits.max_positions:
        raise PlanError(f"{name}: positions [{seq.start_position}, {end}) exceed [0, {limits.max_positions})")
    bad_tokens = [t for t in seq.token_ids if not 0 <= t < limits.vocab_size]
    if bad_tokens:
        raise PlanError(f"{name}: token ids {bad_tokens[:8]} outside the vocabulary [0, {limits.vocab_size})")
    needed = -(-end // limits.block_size)
    if len(seq.block_table) < needed:
        raise PlanError(
            f"{name}: block_table has {len(seq.block_table)} blocks, positions up to {end} need {needed}"
        )
    bad_blocks = [b for b in seq.block_table[:needed] if not 0 <= b < limits.num_blocks]
    if bad_blocks:
        raise PlanError(f"{name}: block ids {bad_blocks[:8]} outside the pool [0, {limits.num_blocks})")


def _slots(block_table: Sequence[int], block_size: int, start: int, end: int) -> np.ndarray:
    needed = -(-end // block_size)
    table = np.asarray(block_table[:needed], dtype=np.int64)
    all_slots = (table[:, None] * block_size + np.arange(block_size, dtype=np.int64)).reshape(-1)
    return all_slots[start:end]


def build_round_inputs(
    seqs: Sequence[ScheduledSeq], limits: EngineLimits, device: torch.device
) -> RoundInputs:
    """Return the round's flat tensors on device; raises PlanError for an invalid sequence."""
    for seq in seqs:
        validate_seq(seq, limits)
    decodes = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
    prefills = [i for i, s in enumerate(seqs) if len(s.token_ids) > 1]
    order = decodes + prefills
    token_ids: list[int] = []
    positions: list[np.ndarray] = []
    slot_parts: list[np.ndarray] = []
    last_rows: dict[int, int] = {}
    row = 0
    for index in order:
        seq = seqs[index]
        end = seq.start_position + len(seq.token_ids)
        token_ids.extend(seq.token_ids)
        positions.append(np.arange(seq.start_position, end, dtype=np.int64))
        slot_parts.append(_slots(seq.block_table, limits.block_size, seq.start_position, end))
        row += len(seq.token_ids)
        last_rows[index] = row - 1
    sampling = [i for i in order if seqs[i].sample]

    def put(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device, non_blocking=True)

    return RoundInputs(
        token_ids=put(np.asarray(token_ids, dtype=np.int64)),
        positions=put(np.concatenate(positions)),
        slot_mapping=put(np.concatenate(slot_parts)),
        decode=_decode_group([seqs[i] for i in decodes], limits.block_size, put),
        prefills=_prefill_spans([seqs[i] for i in prefills], len(decodes), limits.block_size, put),
        sample_rows=put(np.asarray([last_rows[i] for i in sampling], dtype=np.int64)),
        sample_seq_indices=tuple(sampling),
    )


def _decode_group(seqs: list[ScheduledSeq], block_size: int, put: ToDevice) -> DecodeGroup | None:
    if not seqs:
        return None
    lengths = [s.start_position + 1 for s in seqs]
    longest = max(lengths)
    slots = np.zeros((len(seqs), longest), dtype=np.int64)
    mask = np.zeros((len(seqs), longest), dtype=bool)
    for row, (seq, length) in enumerate(zip(seqs, lengths, strict=True)):
        slots[row, :length] = _slots(seq.block_table, block_size, 0, length)
        mask[row, :length] = True
    return DecodeGroup(
        num_tokens=len(seqs), slots=put(slots), mask=put(mask)[:, None, None, :], lengths=tuple(lengths)
    )


def _prefill_spans(
    seqs: list[ScheduledSeq], first_row: int, block_size: int, put: ToDevice
) -> tuple[PrefillSpan, ...]:
    spans, row = [], first_row
    for seq in seqs:
        n, start = len(seq.token_ids), seq.start_position
        context = start + n
        mask = None
        if start > 0:
            # query i sits at position start + i and may see keys 0 .. start + i
            mask = put(np.arange(context)[None, :] <= (start + np.arange(n))[:, None])
        spans.append(PrefillSpan(row, row + n, put(_slots(seq.block_table, block_size, 0, context)), mask))
        row += n
    return tuple(spans)
