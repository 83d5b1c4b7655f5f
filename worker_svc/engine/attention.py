"""Paged attention for one layer of a round: write this round's K/V by slot, then attend.

Decodes (one query each) run as one padded batch over their gathered contexts with a length
mask; each prefill chunk attends over its own gathered context with a causal mask offset by its
start position. Both use `scaled_dot_product_attention` with grouped-query attention. The
per-sequence decode variant (`batched_decode=False`) exists to be measured against the padded
one (worker_svc/bench.py); the padded batch wins on the CPU (docs/worker.md). Contexts are gathered
(copied) out of the cache, so the padded batch is split into row groups whose gathered K and V stay
under `max_gather_bytes`: a large batch of long contexts does not allocate gigabytes per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_svc.engine.batch import DecodeGroup, RoundInputs

DEFAULT_MAX_GATHER_BYTES = 256 * 2**20
"""Most bytes of K and V one padded decode batch gathers out of the cache at once."""


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    inputs: RoundInputs,
    batched_decode: bool = True,
    max_gather_bytes: int = DEFAULT_MAX_GATHER_BYTES,
) -> torch.Tensor:
    """Return attention output [T, H, D] for the round's queries q [T, H, D].

    k and v [T, KVH, D] are first written into the flattened caches
    ([slots, KVH, D]) at `inputs.slot_mapping`, so each query sees its own token's K/V.
    """
    key_cache.index_copy_(0, inputs.slot_mapping, k)
    value_cache.index_copy_(0, inputs.slot_mapping, v)
    out = torch.empty_like(q)
    group = inputs.decode
    if group is not None and batched_decode:
        row_bytes = 2 * group.slots.shape[1] * key_cache[0].numel() * key_cache.element_size()
        rows_per_gather = max(1, max_gather_bytes // row_bytes)
        for first in range(0, group.num_tokens, rows_per_gather):
            rows = slice(first, min(first + rows_per_gather, group.num_tokens))
            _decodes_padded(q, key_cache, value_cache, group, rows, out)
    elif group is not None:
        _decodes_one_by_one(q, key_cache, value_cache, group, out)
    for span in inputs.prefills:
        queries = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        keys = key_cache[span.context_slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        values = value_cache[span.context_slots].transpose(0, 1).unsqueeze(0)
        result = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=span.mask, is_causal=span.mask is None, enable_gqa=True
        )
        out[span.start : span.end] = result[0].transpose(0, 1)
    return out


def _decodes_padded(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: DecodeGroup,
    rows: slice,
    out: torch.Tensor,
) -> None:
    # decode rows are the round's first rows, so group row i is query row i
    keys = key_cache[group.slots[rows]].transpose(1, 2)  # [b, KVH, Lmax, D]
    values = value_cache[group.slots[rows]].transpose(1, 2)
    queries = q[rows].unsqueeze(2)  # [b, H, 1, D]
    result = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=group.mask[rows], enable_gqa=True
    )
    out[rows] = result.squeeze(2)


def _decodes_one_by_one(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, group: DecodeGroup, out: torch.Tensor
) -> None:
    for row, length in enumerate(group.lengths):
        slots = group.slots[row, :length]
        keys = key_cache[slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        values = value_cache[slots].transpose(0, 1).unsqueeze(0)
        result = F.scaled_dot_product_attention(
            q[row, :, None, :].unsqueeze(0), keys, values, enable_gqa=True
        )
        out[row] = result[0, :, 0]
