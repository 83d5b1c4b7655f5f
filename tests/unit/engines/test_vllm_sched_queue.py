"""Sluice's policies as vLLM's waiting queue (the --scheduler-cls queue), tested without vLLM."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from scheduler_svc.engines.vllm.sched_queue import PolicyRequestQueue, parse_weights, tenant_of


@dataclass
class EngineRequest:
    """The attributes of vLLM's Request the queue reads."""

    request_id: str
    num_prompt_tokens: int = 16
    arrival_time: float = 0.0
    priority: int = 0


def test_tenant_is_read_from_vllms_request_id() -> None:
    """`{tenant}:{id}` after vLLM's cmpl-/chatcmpl- prefix names the tenant; anything else is default."""
    assert tenant_of("cmpl-gold:abc-0") == "gold"
    assert tenant_of("chatcmpl-bronze:x") == "bronze"
    assert tenant_of("cmpl-abc") == "default" and tenant_of(":x") == "default"


def test_weighted_fair_order_inside_the_engine_queue() -> None:
    """With weights 2:1 and equal requests, pops alternate gold, gold, bronze as service is charged."""
    queue = PolicyRequestQueue("fair", parse_weights("gold=2,bronze=1"))
    for i in range(6):
        queue.add_request(EngineRequest(f"cmpl-gold:{i}", arrival_time=i))
        queue.add_request(EngineRequest(f"cmpl-bronze:{i}", arrival_time=i))
    order = []
    for _ in range(9):
        request = queue.pop_request()
        queue.on_output(request.request_id, 16)
        order.append(tenant_of(request.request_id))
    assert order.count("gold") == 6 and order.count("bronze") == 3
    assert len(queue) == 3 and bool(queue)


def test_a_preempted_request_prepended_keeps_its_place_and_removal_works() -> None:
    """prepend_request puts a request back where its key says (FCFS: the front); remove takes it out."""
    queue = PolicyRequestQueue("fcfs")
    first, second = EngineRequest("a", arrival_time=0), EngineRequest("b", arrival_time=1)
    queue.add_request(first)
    queue.add_request(second)
    assert queue.pop_request() is first
    queue.prepend_request(first)
    assert queue.peek_request() is first
    queue.remove_request(first)
    assert list(queue) == [second] and queue.pop_request() is second
    with pytest.raises(IndexError):
        queue.pop_request()


def test_bad_weights_are_refused_with_the_entry() -> None:
    """A weight that is not a positive number names the entry."""
    with pytest.raises(ValueError, match="gold=0"):
        parse_weights("gold=0")
