"""The front door's waiting line: bounded, first come first admitted per tenant, woken by releases, timed out."""

from __future__ import annotations

import asyncio

from admission_svc.front_queue import FrontQueue
from sluice.config import parse_config


def test_waiters_are_admitted_in_arrival_order_as_room_frees() -> None:
    """Three requests over a budget of one wait; each release admits the next in arrival order; none times out."""

    async def scenario() -> list[str]:
        queue, room, order = FrontQueue(), [0], []

        def fits() -> bool:
            return room[0] > 0

        async def request(name: str) -> None:
            await queue.wait("t", fits, 8, 5.0)
            room[0] -= 1
            order.append(name)

        tasks = [asyncio.ensure_future(request(n)) for n in "abc"]
        await asyncio.sleep(0.01)
        assert queue.waiting("t") == 3 and order == []
        for _ in "abc":
            room[0] += 1
            queue.released()
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        assert queue.timeouts == 0 and queue.waiting() == 0
        return order

    assert asyncio.run(scenario()) == ["a", "b", "c"]


def test_a_full_line_and_queueing_off_answer_at_once_and_a_wait_times_out() -> None:
    """With the line at its bound, or no bound set, a request does not wait; a waiter without room gives up after
    its timeout; another tenant's line is not held up by a full one."""

    async def scenario() -> None:
        queue = FrontQueue()
        never = asyncio.ensure_future(queue.wait("t", lambda: False, 1, 0.2))
        await asyncio.sleep(0.01)
        assert await asyncio.wait_for(queue.wait("t", lambda: False, 1, 10.0), 0.1) == 0.0  # the line is full
        assert await asyncio.wait_for(queue.wait("t", lambda: False, None, 10.0), 0.1) == 0.0  # queueing off
        assert await asyncio.wait_for(queue.wait("u", lambda: True, 1, 10.0), 0.1) == 0.0  # fits: no wait
        assert await never >= 0.2 and queue.timeouts == 1

    asyncio.run(scenario())


def test_queue_settings_come_from_the_config_budgets() -> None:
    """max_queued_requests and queue_timeout_s are budgets: global, and a tenant's own override them."""
    config = parse_config({"budgets": {"max_queued_requests": 512, "queue_timeout_s": 120},
                           "tenants": {"bench": {"api_keys": ["k"], "max_queued_requests": 4}}})
    assert (config.budgets.max_queued_requests, config.budgets.queue_timeout_s) == (512, 120)
    assert config.tenants[0].budgets is not None and config.tenants[0].budgets.max_queued_requests == 4
    assert config.tenants[0].budgets.queue_timeout_s == 120
