"""vLLM's prefix-cache block hashes, computed outside vLLM (standard library + cbor2).

vLLM (v1, `--prefix-caching-hash-algo`, default sha256) identifies a full block by
hash(parent digest, the block's token ids as a tuple, extra keys), where the hash is SHA-256 of the
pickled tuple (`sha256`) or of its canonical CBOR encoding (`sha256_cbor`, language-neutral). The first
block's parent is the digest of the seed string: `$PYTHONHASHSEED` of the engine process if set, else
"vllm-none-hash". The chain carries the full 32-byte digest; what the KV events publish is its low 64 bits
read big-endian. Only full blocks are hashed. Extra keys are None for plain text; a LoRA adapter,
multimodal inputs or a `cache_salt` change the first block's (and so the whole chain's) hashes, which this
module does not reproduce: `chain` refuses them rather than guess (ValueError).

Used to check that what the router predicts is what vLLM reports (tests/engines), never on the request path:
the router's index speaks Sluice's own hashes, which the agent derives from the events' token ids (kv.py).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

__all__ = ["ALGORITHMS", "DEFAULT_SEED", "chain", "event_id", "root_digest"]

DEFAULT_SEED = "vllm-none-hash"
"""The seed vLLM hashes into the root parent when PYTHONHASHSEED is not set (cryptographic algorithms)."""
_MASK64 = (1 << 64) - 1


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    import cbor2  # only where the cbor algorithm is asked for (the agent's venv has it)

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


ALGORITHMS = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}
"""`--prefix-caching-hash-algo` values reproduced here (xxhash ones use a random seed per process)."""


def _algorithm(name: str) -> Any:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown vLLM hash algorithm {name!r}; known: {', '.join(sorted(ALGORITHMS))}") from None


def root_digest(algorithm: str = "sha256", seed: str = DEFAULT_SEED) -> bytes:
    """Return the 32-byte parent of a chain's first block (vLLM's NONE_HASH for `seed`)."""
    return bytes(_algorithm(algorithm)(seed))


def event_id(digest: bytes) -> int:
    """Return the 64-bit id vLLM's KV events carry for a block digest (its low 64 bits, big-endian)."""
    return int.from_bytes(digest, "big") & _MASK64


def chain(token_ids: Sequence[int], block_size: int, algorithm: str = "sha256", seed: str = DEFAULT_SEED,
          extra_keys: Any = None) -> list[bytes]:
    """Return the 32-byte digests of every full block of `token_ids`, as vLLM computes them.

    Raises ValueError for an unknown algorithm, a block size below 1, or extra keys (see the module docstring).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if extra_keys is not None:
        raise ValueError("extra keys (LoRA, multimodal, cache_salt) are not reproduced")
    hash_fn = _algorithm(algorithm)
    parent = root_digest(algorithm, seed)
    digests: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = bytes(hash_fn((parent, tuple(token_ids[start:start + block_size]), None)))
        digests.append(parent)
    return digests
