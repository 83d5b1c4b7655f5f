"""Block-hash chains: keyed BLAKE2b with a fixed encoding, per-tenant cache salts, and agreement of every entry point."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from sluice.hashing import NO_PARENT, block_hash, hash_chain, salt_of

# Pinned values: if the encoding, the key derivation or the hash changes, every deployment's
# admission, router and schedulers must change together, so this test must be updated on purpose.
KNOWN_TINY_0_TO_31 = [17925649318200310025, 14178422303080598613]


def _reference(parent: int, salt: int, tokens: list[int]) -> int:
    """The documented definition, written out independently of sluice.hashing."""
    key = salt.to_bytes(32, "little")
    data = parent.to_bytes(8, "little") + struct.pack(f"<{len(tokens)}i", *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=key).digest(), "little") or 1


def test_chain_matches_the_documented_keyed_blake2b_definition() -> None:
    """Each block is BLAKE2b-64 keyed by the salt over parent (8 bytes LE) and token ids (int32 LE)."""
    salt = salt_of("tiny")
    tokens = list(range(48)) + [7]
    expected, parent = [], NO_PARENT
    for start in range(0, 48, 16):
        parent = _reference(parent, salt, tokens[start : start + 16])
        expected.append(parent)
    assert hash_chain(tokens, 16, salt) == expected
    assert hash_chain(list(range(32)), 16, salt) == KNOWN_TINY_0_TO_31


def test_values_do_not_depend_on_the_interpreter_hash_seed() -> None:
    """Another interpreter with a different PYTHONHASHSEED computes the same chain."""
    code = "from sluice.hashing import hash_chain, salt_of; print(hash_chain(list(range(32)), 16, salt_of('tiny')))"
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, timeout=60)
        assert out.stdout.strip() == str(KNOWN_TINY_0_TO_31)


def test_block_hash_extends_a_chain_exactly_like_hash_chain() -> None:
    """The scheduler's one-block-at-a-time extension and admission's whole chain agree."""
    salt = salt_of("m", "v2")
    tokens = [(i * 7919) % 128_000 for i in range(16 * 5)]
    chain = hash_chain(tokens, 16, salt)
    extended: list[int] = []
    for start in range(0, len(tokens), 16):
        extended.append(block_hash(extended[-1] if extended else NO_PARENT, salt, tokens[start : start + 16]))
    assert extended == chain
    assert hash_chain(tokens[32:], 16, salt, parent=chain[1]) == chain[2:]


def test_cache_salt_separates_tenants_and_the_default_shares() -> None:
    """Equal prompts share blocks under one cache salt; different cache salts share none."""
    tokens = list(range(64))
    shared = hash_chain(tokens, 16, salt_of("m"))
    assert hash_chain(tokens, 16, salt_of("m", "", "")) == shared
    tenant_a = hash_chain(tokens, 16, salt_of("m", "", "tenant-a-secret"))
    tenant_b = hash_chain(tokens, 16, salt_of("m", "", "tenant-b-secret"))
    assert tenant_a == hash_chain(tokens, 16, salt_of("m", "", "tenant-a-secret"))
    assert not set(tenant_a) & set(tenant_b) and not set(tenant_a) & set(shared)


def test_salt_fields_are_length_prefixed() -> None:
    """Moving characters between model, adapter and cache salt gives a different salt."""
    salts = {salt_of("ab", "c"), salt_of("a", "bc"), salt_of("a", "b", "c"), salt_of("a\x00b", "c"),
             salt_of("ab", "", "c"), salt_of("abc")}
    assert len(salts) == 6


def test_one_token_or_one_position_changes_the_block_and_everything_after() -> None:
    """A changed token changes its block's hash and, through the parent, every later block's."""
    salt = salt_of("m")
    tokens = list(range(64))
    changed = tokens.copy()
    changed[20] = 999
    a, b = hash_chain(tokens, 16, salt), hash_chain(changed, 16, salt)
    assert a[0] == b[0] and all(x != y for x, y in zip(a[1:], b[1:], strict=True))
    assert hash_chain(tokens, 16, salt) != hash_chain(tokens, 32, salt)[:4]


def test_every_int32_token_id_hashes_and_wider_ids_are_refused_not_wrapped() -> None:
    """Any id the int32 wire type carries (negative ones too) hashes, distinctly; a wider id raises, never aliases."""
    salt = salt_of("m")
    assert hash_chain([-1] * 16, 16, salt) != hash_chain([(1 << 31) - 1] * 16, 16, salt)
    with pytest.raises(struct.error):
        hash_chain([1 << 31] * 16, 16, salt)
    with pytest.raises(struct.error):
        block_hash(NO_PARENT, salt, [(1 << 32) - 1] * 16)


def test_a_requests_chain_is_the_same_extended_in_one_step_or_block_by_block() -> None:
    """`block_hashes_upto` hashes several blocks in one `hash_chain` call (a prompt at submit): the same hashes
    as one `block_hash` per block, from an empty chain or from part of one, with a partial block left alone."""
    from scheduler_svc.core.request import Request, block_hashes_upto
    from sluice.types import NewRequest, SamplingParams

    prompt = tuple((i * 7919) % 50_000 for i in range(16 * 9 + 5))
    salt = salt_of("m")
    expected, parent = [], NO_PARENT
    for i in range(9):
        parent = block_hash(parent, salt, prompt[16 * i : 16 * (i + 1)])
        expected.append(parent)
    for steps in ([9], [1, 9], [3, 4, 9], [2, 3, 4, 5, 6, 7, 8, 9]):
        request = Request(NewRequest("r", prompt, SamplingParams(max_tokens=4)), 0)
        for count in steps:
            assert list(block_hashes_upto(request, count, 16, salt)) == expected[:count]
