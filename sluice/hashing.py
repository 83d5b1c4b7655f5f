"""Block-hash chains: the identity of a full KV block is its tokens plus everything before it.

hash(block i) = BLAKE2b-64(key = salt, parent hash ‖ tokens of block i). Equal prefixes (same
model, adapter and cache salt, same tokens) give equal chains, so admission, router and
scheduler agree on which blocks a prompt shares with cached ones without exchanging token ids.

Encoding (fixed, so every interpreter, platform and process computes the same values): the
parent as 8 bytes little-endian, each token id as 4 bytes little-endian signed (the wire type is int32,
so every id a request can carry encodes, and none aliases another); the salt is the
BLAKE2b key (32 bytes). Values are unsigned 64-bit, never 0 (0 means "no parent"), because
the wire type is `uint64` (protos/sluice/v1/events.proto, router.proto, scheduler.proto).

Collision argument. A scheduler shares a cached block with any request whose chain reaches the
same 64-bit value, so a collision would hand one prompt another prompt's KV. Previously the
value was CPython's tuple hash(), which is not collision resistant: colliding prompts can be
computed in microseconds (the reason vLLM moved to SHA-256, advisory GHSA-rm76-4mrf-v9r8).
BLAKE2b is a cryptographic hash; with a 64-bit output:
- accidental: among n distinct live blocks, P(any collision) <= n^2 / 2^65 (1e6 blocks: 3e-8);
- a second preimage of a block somebody else will send costs ~2^64 hash evaluations, and the
  attacker must know that block's content and salt;
- a birthday pair (2^32 work) only helps an attacker who writes both the victim's prefix and
  his own; a secret per-tenant cache salt (`salt_of(..., cache_salt=...)`) makes the hash a
  keyed PRF the attacker cannot evaluate offline, which rules this out too.
Every input of a block's hash (the parent included) is length-fixed, so a chain never aliases
a different split of the same tokens.

Cache salt. `cache_salt=""` (the default) gives every tenant of a model the same chain: equal
prefixes are shared across tenants (system prompts, few-shot examples), which is most of the
prefix-cache benefit, and content confusion is ruled out by the argument above. What remains
is a timing side channel: a tenant can learn whether a guessed prefix of at least one block
was recently sent by someone. A deployment whose tenants must not learn that gives each tenant
its own secret cache salt, so no block is ever shared across tenants. See docs/security.md.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from typing import Any

NO_PARENT = 0
_SALT_BYTES = 32
_PERSON = b"sluice-salt-v1"
_ZERO, _ONE = bytes(8), (1).to_bytes(8, "little")


def salt_of(model_id: str, adapter_version: str = "", cache_salt: str = "") -> int:
    """Return the salt (a 256-bit int) of a model, adapter and cache salt.

    Blocks of different models, adapters or cache salts never match. Each field is length-
    prefixed, so no two different triples encode to the same bytes.
    """
    fields = (model_id.encode(), adapter_version.encode(), cache_salt.encode())
    encoded = b"".join(len(f).to_bytes(4, "little") + f for f in fields)
    digest = hashlib.blake2b(encoded, digest_size=_SALT_BYTES, person=_PERSON).digest()
    return int.from_bytes(digest, "little")


@functools.lru_cache(maxsize=4096)
def _keyed(salt: int) -> Any:
    """The BLAKE2b state keyed by `salt`, to be copied per block (keying once saves a compression)."""
    key = (salt & ((1 << (8 * _SALT_BYTES)) - 1)).to_bytes(_SALT_BYTES, "little")
    return hashlib.blake2b(digest_size=8, key=key)


@functools.lru_cache(maxsize=64)
def _packer(count: int) -> Any:
    """struct.pack for `count` int32 token ids, little-endian (one Struct per block size, built once)."""
    return struct.Struct(f"<{count}i").pack


_last_block_key: tuple[Any, ...] = (None, None, 0, None)
"""(salt, its keyed state, block length, its packer) of the last `block_hash` call. One tuple, replaced
whole (threads see one consistent entry); one salt and block size is nearly every call of a replica,
so two tests replace two cache lookups that hash a 256-bit salt."""


def _block_key(salt: int, count: int) -> tuple[Any, ...]:
    global _last_block_key
    _last_block_key = (salt, _keyed(salt), count, _packer(count))
    return _last_block_key


def block_hash(parent: int, salt: int, tokens: Sequence[int]) -> int:
    """Return the hash of one full block given its parent's hash (NO_PARENT for the first)."""
    # Inlined (one keyed copy, one update): the scheduler core calls this each time one of its requests fills a block.
    key = _last_block_key
    count = len(tokens)
    if salt is not key[0] or count != key[2]:
        key = _block_key(salt, count)
    state = key[1].copy()
    state.update(parent.to_bytes(8, "little") + key[3](*tokens))
    return int.from_bytes(state.digest(), "little") or 1


def hash_chain(token_ids: Sequence[int], block_size: int, salt: int, parent: int = NO_PARENT) -> list[int]:
    """Return the hashes of every full block of `token_ids` (a partial last block has none)."""
    full = len(token_ids) - len(token_ids) % block_size
    if full == 0:
        return []
    return hash_packed(_packer(full)(*token_ids[:full]), block_size, salt, parent)


def hash_packed(packed: bytes, block_size: int, salt: int, parent: int = NO_PARENT) -> list[int]:
    """Return `hash_chain` of the tokens whose full blocks `packed` holds as little-endian int32 (4 bytes a
    token; a partial last block is ignored). For a caller that has the ids as an array: no int per token."""
    keyed = _keyed(salt)
    view = memoryview(packed)
    step = 4 * block_size
    end = len(view) - len(view) % step
    digests: list[bytes] = []
    previous = parent.to_bytes(8, "little")
    zero, one, append = _ZERO, _ONE, digests.append
    for start in range(0, end, step):  # a loop of plain calls: a prompt of ~70 blocks at every arrival
        state = keyed.copy()
        state.update(previous + view[start : start + step])
        previous = state.digest()
        if previous == zero:
            previous = one
        append(previous)
    from_bytes = int.from_bytes
    return [from_bytes(d, "little") for d in digests]
