"""Paged attention for one layer of a round: write this round's K/V by slot, then attend.

Decodes (one query each) run as one padded batch over their gathered contexts with a length
mask; each prefill chunk attends over its own gathered context with a causal mask offset by its
start position. Both use `scaled_dot_product_attention` with grouped-query attention. The
per-sequence decode variant (`batched_decode=False`) exists to be measured against the padded
one (worker_svc/bench.py); the padded batch wins on the CPU (docs/worker.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_svc.engine.batch import DecodeGroup, RoundInputs


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    inputs: RoundInputs,
    batched_decode: bool = True,
) -> torch.Tensor:
    """Return attention output [T, H, D] for the round's queries q [T, H, D].

    k and v [T, KVH, D] are first written into the flattened caches
    ([slots, KVH, D]) at `inputs.slot_mapping`, so each query sees its own token's K/V.
    """
    key_cache.index_copy_(0, inputs.slot_mapping, k)
    value_cache.index_copy_(0, inputs.slot_mapping, v)
    out = torch.empty_like(q)
    if inputs.decode is not None:
        attend_decodes = _decodes_padded if batched_decode else _decodes_one_by_one
        attend_decodes(q, key_cache, value_cache, inputs.decode, out)
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
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, group: DecodeGroup, out: torch.Tensor
) -> None:
    count = group.num_tokens
    keys = key_cache[group.slots].transpose(1, 2)  # [B, KVH, Lmax, D]
    values = value_cache[group.slots].transpose(1, 2)
    queries = q[:count].unsqueeze(2)  # [B, H, 1, D]
    result = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask, enable_gqa=True)
    out[:count] = result.squeeze(2)


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
