"""A tenant's cache salt keeps its cached prefixes to itself; tenants without one share as before."""

from __future__ import annotations

import dataclasses

from core_factories import make_core, make_request, step

PROMPT_LEN = 64  # four 16-token blocks


def _cached_tokens(salts: tuple[str, str]) -> int:
    """Run one request per salt with the same prompt, the second after the first finished; its cached tokens."""
    core = make_core()
    first = dataclasses.replace(make_request("a", PROMPT_LEN, max_tokens=1), tenant="t1", cache_salt=salts[0])
    core.submit(first, 0.0)
    for now in range(3):
        step(core, float(now))
    second = dataclasses.replace(make_request("b", PROMPT_LEN, max_tokens=1), tenant="t2", cache_salt=salts[1],
                                 prompt_token_ids=first.prompt_token_ids)
    core.submit(second, 5.0)
    finished = []
    for now in range(6, 10):
        finished += step(core, float(now))[1].finished
    (record,) = [f for f in finished if f.request_id == "b"]
    return record.usage.cached_tokens


def test_tenants_without_a_salt_share_cached_prefixes() -> None:
    """Same prompt, no salts: the second tenant's request finds every full block but the last cached."""
    assert _cached_tokens(("", "")) == PROMPT_LEN - 16


def test_a_salted_tenant_shares_with_no_one() -> None:
    """A salt on either side, or two different salts, makes the same prompt miss the other's blocks."""
    assert _cached_tokens(("secret-1", "")) == 0
    assert _cached_tokens(("", "secret-2")) == 0
    assert _cached_tokens(("secret-1", "secret-2")) == 0


def test_the_same_salt_still_shares() -> None:
    """Requests carrying one tenant's salt reuse each other's blocks."""
    assert _cached_tokens(("secret-1", "secret-1")) == PROMPT_LEN - 16
