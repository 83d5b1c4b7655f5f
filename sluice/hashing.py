"""Block-hash chains: the identity of a full KV block is its tokens plus everything before it.

hash(block i) = H(hash(block i-1), salt, tokens of block i). Equal prefixes (same model and
adapter, same tokens) give equal chains, so admission, router and scheduler agree on which
blocks a prompt shares with cached ones without exchanging token ids.

The hash is CPython's tuple hash over ints, which does not depend on PYTHONHASHSEED (only str
and bytes hashing is randomised), so every process of one deployment computes the same values;
the salt string goes through blake2b once. Values are unsigned 64-bit, never 0 (0 means "no parent").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

_MASK = (1 << 64) - 1
NO_PARENT = 0


def salt_of(model_id: str, adapter_version: str = "") -> int:
    """Return the 64-bit salt for a model and adapter: blocks of different models never match."""
    digest = hashlib.blake2b(f"{model_id}\x00{adapter_version}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def block_hash(parent: int, salt: int, tokens: Sequence[int]) -> int:
    """Return the hash of one full block given its parent's hash (NO_PARENT for the first)."""
    value = hash((parent, salt, *tokens)) & _MASK
    return value or 1


def hash_chain(token_ids: Sequence[int], block_size: int, salt: int, parent: int = NO_PARENT) -> list[int]:
    """Return the hashes of every full block of `token_ids` (a partial last block has none)."""
    hashes: list[int] = []
    full = len(token_ids) - len(token_ids) % block_size
    for start in range(0, full, block_size):
        parent = block_hash(parent, salt, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
