"""The paged KV cache: per layer, K and V tensors of [num_blocks, block_size, kv_heads, head_dim].

Block i of a sequence's block table holds its positions [i*block_size, (i+1)*block_size); the
slot of position p is `block_table[p // block_size] * block_size + p % block_size` in the
flattened [num_blocks * block_size, kv_heads, head_dim] view. Which block belongs to whom is the
scheduler's business; the cache only stores, copies and clears blocks. A host (CPU) pool of the
same layout holds swapped-out blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker_svc.engine.config import LlamaConfig
from worker_svc.engine.errors import PlanError


def bytes_per_block(config: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
    """Return the bytes one block takes across all layers (K and V)."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.head_dim * element


def blocks_for_budget(config: LlamaConfig, block_size: int, dtype: torch.dtype, memory_bytes: int) -> int:
    """Return how many blocks fit in memory_bytes; raises ValueError when not even one does."""
    per_block = bytes_per_block(config, block_size, dtype)
    count = memory_bytes // per_block
    if count < 1:
        raise ValueError(
            f"a KV budget of {memory_bytes} bytes holds no block (one block takes {per_block} bytes)"
        )
    return int(count)


class PagedKVCache:
    """Device K/V blocks for every layer, plus an optional host pool for swapping."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_host_blocks: int = 0,
    ) -> None:
        if num_blocks < 1 or block_size < 1 or num_host_blocks < 0:
            raise ValueError(
                f"need num_blocks >= 1, block_size >= 1, num_host_blocks >= 0; got "
                f"{num_blocks}, {block_size}, {num_host_blocks}"
            )
        self.num_blocks, self.block_size, self.num_host_blocks = num_blocks, block_size, num_host_blocks
        self.device, self.dtype = device, dtype
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        layers = range(config.num_hidden_layers)
        self.key = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        self.value = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        host_shape = (num_host_blocks, *shape[1:])
        pin = device.type == "cuda"
        self.host_key = [torch.zeros(host_shape, dtype=dtype, pin_memory=pin) for _ in layers]
        self.host_value = [torch.zeros(host_shape, dtype=dtype, pin_memory=pin) for _ in layers]

    def flat_key(self, layer: int) -> torch.Tensor:
        """Return layer's K cache as [num_blocks * block_size, kv_heads, head_dim] (a view)."""
        return self.key[layer].view(-1, *self.key[layer].shape[2:])

    def flat_value(self, layer: int) -> torch.Tensor:
        """Return layer's V cache as [num_blocks * block_size, kv_heads, head_dim] (a view)."""
        return self.value[layer].view(-1, *self.value[layer].shape[2:])

    def validate_swaps(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]) -> None:
        """Raise PlanError when a (src, dst) pair names a block outside its pool."""
        for label, pairs, src_limit, dst_limit in (
            ("swap_out", swap_out, self.num_blocks, self.num_host_blocks),
            ("swap_in", swap_in, self.num_host_blocks, self.num_blocks),
        ):
            for src, dst in pairs:
                if not (0 <= src < src_limit and 0 <= dst < dst_limit):
                    raise PlanError(
                        f"{label} copy {src} -> {dst} is out of range (source pool has {src_limit} "
                        f"blocks, destination pool {dst_limit})"
                    )

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks, (device src, host dst) per pair."""
        if pairs:
            src, dst = self._indices(pairs, self.device)
            for layer in range(len(self.key)):
                self.host_key[layer][dst.cpu()] = self.key[layer][src].cpu()
                self.host_value[layer][dst.cpu()] = self.value[layer][src].cpu()

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks, (host src, device dst) per pair."""
        if pairs:
            src, dst = self._indices(pairs, self.device)
            for layer in range(len(self.key)):
                self.key[layer][dst] = self.host_key[layer][src.cpu()].to(self.device, non_blocking=True)
                self.value[layer][dst] = self.host_value[layer][src.cpu()].to(self.device, non_blocking=True)

    @property
    def block_bytes(self) -> int:
        """Return the bytes one block takes across all layers (K and V): one transferred block's size."""
        return 2 * len(self.key) * self.key[0][0].numel() * self.key[0].element_size()

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """Return each block's raw K/V bytes: every layer's K then V, in the cache's dtype (a KV transfer)."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        # [blocks, layers, 2, block_size, kv_heads, head_dim]
        stacked = torch.stack([torch.stack((k.index_select(0, index), v.index_select(0, index)), dim=1)
                               for k, v in zip(self.key, self.value, strict=True)], dim=1)
        raw = stacked.contiguous().view(torch.uint8).reshape(len(block_ids), -1).cpu().numpy()
        return [raw[i].tobytes() for i in range(len(block_ids))]

    def write_blocks(self, block_ids: Sequence[int], data: Sequence[bytes | memoryview]) -> None:
        """Store raw K/V bytes (`read_blocks`' layout) into the given blocks. Raises PlanError for a size that is
        not one block's or a block id out of range."""
        size = self.block_bytes
        for block, chunk in zip(block_ids, data, strict=True):
            if not 0 <= block < self.num_blocks:
                raise PlanError(f"KV block {block} is out of range (the cache has {self.num_blocks} blocks)")
            if len(chunk) != size:
                raise PlanError(f"KV block data of {len(chunk)} bytes; one block is {size} bytes")
        if not block_ids:
            return
        layers, shape = len(self.key), self.key[0].shape[1:]
        raw = torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8)
        blocks = raw.view(self.dtype).reshape(len(block_ids), layers, 2, *shape).to(self.device)
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        for layer in range(layers):
            self.key[layer].index_copy_(0, index, blocks[:, layer, 0])
            self.value[layer].index_copy_(0, index, blocks[:, layer, 1])

    def clear_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero the given device blocks (used after the warm-up round's scratch use)."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        for layer in range(len(self.key)):
            self.key[layer].index_fill_(0, index, 0)
            self.value[layer].index_fill_(0, index, 0)

    @staticmethod
    def _indices(pairs: Sequence[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
        return src, dst
