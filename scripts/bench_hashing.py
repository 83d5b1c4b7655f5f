"""Print the cost of block hashing: CPython tuple hash() (before) vs keyed BLAKE2b (now).

    python scripts/bench_hashing.py [--tokens 8192] [--block-size 16]

Prints one JSON object: median microseconds for one prompt's whole chain (what admission pays per
request) and for one block extended from its parent (what the scheduler core pays each time a
request's block fills), for each, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from array import array
from collections.abc import Callable, Sequence

from sluice.hashing import block_hash, hash_chain, salt_of


def tuple_hash_chain(token_ids: Sequence[int], block_size: int, salt: int) -> list[int]:
    """The chain as it was before (64-bit CPython tuple hash), kept here only as the reference."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - len(token_ids) % block_size, block_size):
        parent = (hash((parent, salt, *token_ids[start : start + block_size])) & ((1 << 64) - 1)) or 1
        hashes.append(parent)
    return hashes


def median_us(fn: Callable[[], object], repeats: int = 200, inner: int = 1) -> float:
    """Median wall time of one call of `fn` in microseconds (`inner` calls per sample)."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) * 1e6 / inner)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(128_000) for _ in range(args.tokens)]
    salt = salt_of("llama-3-8b")
    before = median_us(lambda: tuple_hash_chain(tokens, args.block_size, salt & ((1 << 64) - 1)))
    after = median_us(lambda: hash_chain(tokens, args.block_size, salt))
    block = array("q", tokens[: args.block_size])  # the scheduler core keeps tokens in an int64 array
    mask = (1 << 64) - 1
    block_before = median_us(lambda: (hash((12345, salt & mask, *block)) & mask) or 1, inner=1000)
    block_after = median_us(lambda: block_hash(12345, salt, block), inner=1000)
    print(json.dumps({"tokens": args.tokens, "block_size": args.block_size,
                      "chain_tuple_hash_us": round(before, 1), "chain_blake2b_us": round(after, 1),
                      "chain_ratio": round(after / before, 2), "block_tuple_hash_us": round(block_before, 2),
                      "block_blake2b_us": round(block_after, 2), "block_ratio": round(block_after / block_before, 2)}))


if __name__ == "__main__":
    main()
