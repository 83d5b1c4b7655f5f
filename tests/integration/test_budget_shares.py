"""Budget shares on a real Redis (admission_svc/shares.py): grants of several processes never sum past a cap, a
process that joins gets its fair part, and a process whose lease lapses loses its grants to the others."""

from __future__ import annotations

import asyncio
import random

import pytest
import redis.asyncio as aioredis

from admission_svc.core import AdmissionConfig, AdmissionCore
from admission_svc.shares import BudgetShares, fair_part
from sluice.config import Budgets, TenantConfig
from sluice.core_errors import OverBudget

pytestmark = pytest.mark.redis

CAP = 5


def make_core() -> AdmissionCore:
    """A core whose global active-request cap is CAP and tenant `t` has a cap of its own (3 active)."""
    return AdmissionCore(AdmissionConfig(budgets=Budgets(max_active_requests=CAP),
                                         tenants=(TenantConfig("t", api_keys=("k",),
                                                               budgets=Budgets(max_active_requests=3)),)))


def _admit(core: AdmissionCore, request_id: str, now: float = 0.0) -> bool:
    try:
        core.admit(request_id, "t", 4, 4, now)
    except OverBudget:
        return False
    return True


def test_fair_parts_add_up_to_the_cap() -> None:
    """The fair parts of every rank sum to the cap for any number of processes."""
    for cap in (0, 1, 5, 256):
        for processes in (1, 2, 3, 7):
            assert sum(fair_part(cap, processes, rank) for rank in range(processes)) == cap


def test_a_share_limits_admission_but_not_what_could_ever_fit() -> None:
    """Under a share of 1 active request the second request is OverBudget (retry later), never InvalidRequest."""
    core = make_core()
    core.set_share(None, (1, None, None, None, None))
    assert _admit(core, "a")
    with pytest.raises(OverBudget):
        core.admit("b", "t", 4, 4, 0.0)
    core.set_share(None, None)
    assert _admit(core, "b")


async def _shares(redis_url: str, namespace: str, n: int, lease_s: float) -> tuple[list[AdmissionCore],
                                                                                   list[BudgetShares]]:
    client = aioredis.Redis.from_url(redis_url)
    key = f"sluice:{{{namespace}:budgets}}"
    cores = [make_core() for _ in range(n)]
    return cores, [BudgetShares(client, key, f"p{i}", core, lease_s) for i, core in enumerate(cores)]


def test_random_admissions_and_rebalances_never_exceed_the_caps(redis_url: str, namespace: str) -> None:
    """Three processes admitting, releasing and rebalancing in a random order: at every step what they hold together
    is within the global cap and the tenant's, and the grants in Redis never sum past them."""
    async def scenario() -> None:
        cores, shares = await _shares(redis_url, namespace, 3, lease_s=30.0)
        rng = random.Random(7)
        held: list[list[str]] = [[], [], []]
        admitted = 0
        for step in range(400):
            i = rng.randrange(3)
            action = rng.random()
            if action < 0.3:
                await shares[i].rebalance()
            elif action < 0.7:
                if _admit(cores[i], f"r{step}"):
                    held[i].append(f"r{step}")
                    admitted += 1
            elif held[i]:
                cores[i].release(held[i].pop(rng.randrange(len(held[i]))), 0.0)
            total = sum(len(h) for h in held)
            assert total <= 3  # the tenant's cap (tighter than the global one)
            grants = [s.grants[None][0] or 0 for s in shares]
            assert sum(grants) <= CAP and sum(s.grants["t"][0] or 0 for s in shares) <= 3
            assert all(len(h) <= (s.grants["t"][0] or 0) for h, s in zip(held, shares, strict=True))
        assert admitted > 50  # the shares did move: the processes admitted all along

    asyncio.run(scenario())


def test_a_joining_process_gets_its_fair_part_within_three_rounds(redis_url: str, namespace: str) -> None:
    """Alone, a process is granted the whole cap; once a second one joins, the first learns it at its next round,
    shrinks at the one after, and the newcomer grows: the cap is split 3 + 2, never more in all."""
    async def scenario() -> None:
        _, (first, second) = await _shares(redis_url, namespace, 2, lease_s=30.0)
        await first.rebalance()
        assert first.grants[None][0] == CAP
        await second.rebalance()
        assert second.grants[None][0] == 0  # nothing free yet: the first holds the cap
        await first.rebalance()  # learns there are two
        assert first.grants[None][0] == CAP
        await first.rebalance()  # shrinks to its fair part
        await second.rebalance()
        assert (first.grants[None][0], second.grants[None][0]) == (3, 2)

    asyncio.run(scenario())


def test_a_lapsed_lease_gives_its_grants_to_the_others(redis_url: str, namespace: str) -> None:
    """A process that stops renewing (killed) loses its grants once its lease expires: the survivor then gets the
    whole cap; while the lease runs, it does not."""
    async def scenario() -> None:
        _, (survivor, killed) = await _shares(redis_url, namespace, 2, lease_s=0.5)
        for _ in range(3):
            await survivor.rebalance()
            await killed.rebalance()
        assert killed.grants[None][0] == 2
        await survivor.rebalance()
        assert survivor.grants[None][0] == 3
        await asyncio.sleep(0.7)
        await survivor.rebalance()  # the dead lease is deleted, and its grant given at once
        assert survivor.grants[None][0] == CAP and survivor.processes == 1

    asyncio.run(scenario())


def test_a_process_that_cannot_renew_stops_admitting(redis_url: str, namespace: str) -> None:
    """When renewals fail for most of a lease, the grants drop to what is held: nothing new is admitted."""
    async def scenario() -> None:
        cores, (shares,) = await _shares(redis_url, namespace, 1, lease_s=0.4)
        await shares.rebalance()
        assert _admit(cores[0], "a")
        assert not shares.expire(shares.renewed_at + 0.1)
        assert shares.expire(shares.renewed_at + 0.35)
        assert not _admit(cores[0], "b")
        cores[0].release("a", 0.0)
        await shares.rebalance()
        assert _admit(cores[0], "b")

    asyncio.run(scenario())


def test_leave_returns_every_grant_at_once(redis_url: str, namespace: str) -> None:
    """A graceful stop (`leave`) frees its grants: the other process gets the whole cap on its next rounds."""
    async def scenario() -> None:
        _, (staying, leaving) = await _shares(redis_url, namespace, 2, lease_s=30.0)
        for _ in range(3):
            await staying.rebalance()
            await leaving.rebalance()
        await leaving.leave()
        await staying.rebalance()
        await staying.rebalance()
        assert staying.grants[None][0] == CAP

    asyncio.run(scenario())


def test_only_shared_budgets_open_the_shares_key_and_script_to_admission() -> None:
    """One admission process (no --share-budgets) keeps its ACL without scripts; shared budgets add the `budgets`
    key and the script's commands, and to no other role."""
    from sluice.redis_acl import Role, rules

    plain, shared = rules("ns", admission_owner="a"), rules("ns", shared_budgets=True)
    assert "evalsha" not in plain[Role.ADMISSION].commands
    assert not any("budgets" in key for rule in plain.values() for key in rule.keys)
    assert "evalsha" in shared[Role.ADMISSION].commands
    assert [key for key in shared[Role.ADMISSION].keys if "budgets" in key] == ["sluice:{ns:budgets}"]
    assert all("evalsha" not in shared[role].commands for role in (Role.ROUTER, Role.SCHEDULER))


def test_join_waits_until_the_others_have_made_room(redis_url: str, namespace: str) -> None:
    """A process joining one that holds the whole cap is settled (its fair part granted) once `join` returns, while
    the first keeps renewing as it does in service."""
    async def scenario() -> None:
        _, (first, second) = await _shares(redis_url, namespace, 2, lease_s=0.4)
        await first.rebalance()
        stop = asyncio.Event()
        renewing = asyncio.create_task(first.run(stop))
        try:
            assert await second.join(timeout_s=5.0)
            assert second.grants[None][0] == 2 and second.settled()
        finally:
            stop.set()
            await renewing
        assert (first.grants[None][0] or 0) + (second.grants[None][0] or 0) <= CAP

    asyncio.run(scenario())
