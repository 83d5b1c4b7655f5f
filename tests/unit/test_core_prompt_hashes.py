"""A prompt's hash chain handed to `submit` (the simulator hashes it for routing) spares the core hashing it
again, and changes nothing: the same chain, the same cache hits and KV events; a chain of another salt is ignored."""

from __future__ import annotations

import dataclasses
from array import array

from core_factories import make_core, make_request, step

from scheduler_svc.core import SchedulerCore
from sluice.hashing import hash_chain, salt_of
from sluice.types import CoreEvents

BLOCK = 16


def _run(prompt_len: int, chain_salt: int | None, cache_salt: str = "",
         as_array: bool = False) -> tuple[list[int], list[CoreEvents], int]:
    """Two requests with one prompt, the second after the first finished; return (the second's hash chain,
    every round's events, the second's cached tokens). `chain_salt`: hand each its chain with that salt;
    `as_array`: the prompt as an `array('q')`, as the simulator gives it."""
    core: SchedulerCore = make_core()
    events: list[CoreEvents] = []
    first = dataclasses.replace(make_request("a", prompt_len, max_tokens=2), cache_salt=cache_salt)
    if as_array:
        first = dataclasses.replace(first, prompt_token_ids=array("q", first.prompt_token_ids))
    second = dataclasses.replace(make_request("b", max_tokens=2), cache_salt=cache_salt,
                                 prompt_token_ids=first.prompt_token_ids)
    cached = 0
    for now, request in ((0.0, first), (10.0, second)):
        if chain_salt is None:
            core.submit(request, now)
        else:
            core.submit(request, now, tuple(hash_chain(request.prompt_token_ids, BLOCK, chain_salt)), chain_salt)
        chain = list(core.requests.live[request.request_id].block_hashes)
        for tick in range(4):
            finished = step(core, now + tick)[1]
            events.append(finished)
            cached = next((f.usage.cached_tokens for f in finished.finished if f.request_id == "b"), cached)
    return chain, events, cached


def test_a_handed_chain_is_the_chain_the_core_would_hash() -> None:
    """With the core's salt, the seeded chain, the rounds' events and the cache hits are those of hashing."""
    salt = salt_of("tiny")  # the config's default model_id, no adapter
    for prompt_len in (BLOCK - 1, BLOCK, 3 * BLOCK, 3 * BLOCK + 5):  # the last full block is never looked up
        assert _run(prompt_len, salt) == _run(prompt_len, None)
    assert _run(3 * BLOCK, salt)[2] == 2 * BLOCK  # the second request hit the first's blocks


def test_a_chain_of_another_salt_is_ignored() -> None:
    """A chain hashed with another salt (a tenant's cache salt, another model) is not used: the core hashes."""
    assert _run(3 * BLOCK, salt_of("other-model")) == _run(3 * BLOCK, None)
    assert _run(3 * BLOCK, salt_of("tiny"), cache_salt="t1") == _run(3 * BLOCK, None, cache_salt="t1")


def test_a_prompt_given_as_an_array_is_the_same_request() -> None:
    """A prompt as an `array('q')` (the simulator's, copied as bytes) schedules, hashes, hits and emits exactly as
    the same ids in a tuple, with the chain handed over or hashed by the core."""
    salt = salt_of("tiny")
    for prompt_len in (BLOCK - 1, 3 * BLOCK + 5):
        assert _run(prompt_len, salt, as_array=True) == _run(prompt_len, salt)
        assert _run(prompt_len, None, as_array=True) == _run(prompt_len, None)
