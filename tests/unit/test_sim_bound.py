"""The compute bound of a capacity counts each request's FLOPs once and what an ideal cache would not compute; the
pooled bound serves prefills in arrival order at the fleet's FLOP rate and refuses what it would serve late."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice_tools.sim import SimConfig
from sluice_tools.sim.bound import (
    compute_bound_rps,
    fleet_cache_tokens,
    lru_cached_tokens,
    optimal_cache_savings,
    partitioned_attainment,
    pooled_attainment,
    request_shape,
)
from sluice_tools.workload import WorkloadRequest
from worker_svc.costmodel import CostModel, RoundShape


def test_request_shape_sums_the_prefill_and_every_decode_round() -> None:
    """A 4-token prompt with 32 cached tokens capped at 3, and 3 outputs: 1 fresh prompt token then 2 decodes."""
    shape = request_shape(WorkloadRequest("r", 0.0, 4, 3), cached_tokens=32)
    # fresh token 4 attends to 4 positions; decode 1 to 5, decode 2 to 6
    assert (shape.query_tokens, shape.attended_pairs, shape.sampled_seqs) == (3, 4 + 5 + 6, 3)


def test_compute_bound_is_the_fleets_flop_rate_over_the_requests_flops_and_an_ideal_cache_raises_it() -> None:
    """Two replicas, two requests of 1,000 prompt tokens sharing their first 512 (Mooncake blocks): the bound is
    2 x 2 requests x FLOP rate / FLOPs, and with the shared blocks held once it is higher."""
    requests = [WorkloadRequest(f"r{i}", float(i), 1000, 10, hash_ids=(7, 100 + i)) for i in range(2)]
    config = SimConfig(replicas=2)
    cost = CostModel("llama-3-8b", "h200")
    rate = cost.gpu.peak_flops * cost.tensor_parallel * cost.coefficients.compute_efficiency
    flops = 2 * cost.flops_and_bytes(request_shape(requests[0], 0))[0]
    assert compute_bound_rps(config, requests, ideal_cache=False) == pytest.approx(2 * 2 * rate / flops)
    cached_flops = flops / 2 + cost.flops_and_bytes(request_shape(requests[1], 512))[0]
    assert compute_bound_rps(config, requests) == pytest.approx(2 * 2 * rate / cached_flops)
    assert compute_bound_rps(config, requests) > compute_bound_rps(config, requests, ideal_cache=False)


def test_an_lru_cache_holds_a_prefix_only_while_it_is_among_the_most_recently_used_blocks() -> None:
    """Two conversations of 2 blocks each, then a third turn of each adding a block. With 5 blocks of cache both
    second turns hit their 2 leading blocks. With 4, a2's new block pushes out the least recently used block, b's
    first, so b2 misses from its first block on (a prefix is only as good as its head); with 3, a's head is gone
    before a2 too. A request without block hashes hits nothing and evicts nothing."""
    a1, b1, a2, b2 = (WorkloadRequest(name, float(i), 1600, 10, hash_ids=ids, hash_block_tokens=512)
                      for i, (name, ids) in enumerate([("a1", (1, 2)), ("b1", (3, 4)), ("a2", (1, 2, 5)),
                                                        ("b2", (3, 4, 6))]))
    plain = WorkloadRequest("p", 1.5, 100, 10)
    assert lru_cached_tokens([a1, b1, a2, b2], 5 * 512) == [0, 0, 1024, 1024]
    assert lru_cached_tokens([a1, b1, plain, a2, b2], 4 * 512 + 511) == [0, 0, 0, 1024, 0]
    assert lru_cached_tokens([a1, b1, a2, b2], 3 * 512) == [0, 0, 0, 0]


def test_the_fleet_cache_bound_lies_between_no_cache_and_an_ideal_one() -> None:
    """The compute bound with one LRU cache of the fleet's KV: the ideal cache's when it holds everything, no
    cache's when it holds nothing, and in between for a cache that holds part of the reuse (one conversation
    every other request stays; three others, each back only every sixth request, do not)."""
    conversations = [0 if i % 2 == 0 else 1 + (i // 2) % 3 for i in range(24)]
    requests = [WorkloadRequest(f"r{i}", float(i), 1600, 10, hash_ids=(c, 10 + c, 100 + i), hash_block_tokens=512)
                for i, c in enumerate(conversations)]
    assert [hit > 0 for hit in lru_cached_tokens(requests, 7 * 512)] == [i % 2 == 0 and i > 0 for i in range(24)]
    config = SimConfig(replicas=2)
    ideal = compute_bound_rps(config, requests)
    none = compute_bound_rps(config, requests, ideal_cache=False)
    assert compute_bound_rps(config, requests, cache_tokens=10**9) == pytest.approx(ideal)
    assert compute_bound_rps(config, requests, cache_tokens=0) == pytest.approx(none)
    assert none < compute_bound_rps(config, requests, cache_tokens=7 * 512) < ideal
    assert fleet_cache_tokens(config) == 2 * CostModel("llama-3-8b", "h200").num_blocks * config.scheduler.block_size
    assert fleet_cache_tokens(replace(config, num_blocks=1000)) == 2 * 1000 * config.scheduler.block_size


def _prefill_s(config: SimConfig, tokens: int) -> float:
    """Seconds one replica's FLOP rate takes to prefill `tokens` uncached prompt tokens."""
    cost = CostModel("llama-3-8b", "h200")
    rate = cost.gpu.peak_flops * cost.tensor_parallel * cost.coefficients.compute_efficiency
    return pooled_flops(tokens) / rate


def pooled_flops(tokens: int) -> float:
    """FLOPs of a fresh prefill of `tokens` tokens (the shape pooled_attainment charges)."""
    cost = CostModel("llama-3-8b", "h200")
    return cost.flops_and_bytes(RoundShape(tokens, tokens * (tokens + 1) // 2, 0, tokens, 1))[0]


def test_pooled_bound_serves_a_burst_only_as_far_as_the_fleets_flops_reach_within_the_slo() -> None:
    """Ten 4,000-token prompts at one instant on 2 replicas: the pooled server finishes them one after another at
    twice one replica's rate, so exactly floor(SLO / (own / 2)) of them are on time and the rest are refused."""
    config = SimConfig(replicas=2)
    own = _prefill_s(config, 4000)
    config = replace(config, slo_ttft_s=3.5 * own)  # 7 fit at half an own prefill each
    burst = [WorkloadRequest(f"r{i}", 0.0, 4000, 100) for i in range(10)]
    by_requests, by_tokens = pooled_attainment(config, burst)
    assert by_requests == pytest.approx(math.floor(3.5 * 2) / 10)
    assert by_tokens == pytest.approx(by_requests)
    spread = [WorkloadRequest(f"r{i}", 10.0 * i * own, 4000, 100) for i in range(10)]
    assert pooled_attainment(config, spread) == (1.0, 1.0)


def test_partitioned_bound_runs_each_prompt_on_one_replica_after_its_own_backlog() -> None:
    """The same burst on 2 partitioned servers: each takes every other prompt at one replica's rate, so 3 of the
    5 it gets finish within 3.5 own prefills (6 in all, against the pooled server's 7). Arrivals spread one own
    prefill apart are all on time. Two prompts at one instant with room for one prefill each: each goes to the
    server that is free, so both are on time."""
    config = SimConfig(replicas=2)
    own = _prefill_s(config, 4000)
    config = replace(config, slo_ttft_s=3.5 * own)
    burst = [WorkloadRequest(f"r{i}", 0.0, 4000, 100) for i in range(10)]
    assert partitioned_attainment(config, burst) == pytest.approx((0.6, 0.6))
    assert pooled_attainment(config, burst)[0] == pytest.approx(0.7)
    spread = [WorkloadRequest(f"r{i}", i * own, 4000, 100) for i in range(10)]
    assert partitioned_attainment(config, spread) == (1.0, 1.0)
    tight = replace(config, slo_ttft_s=1.5 * own)  # one own prefill fits, two back to back do not
    assert partitioned_attainment(tight, [WorkloadRequest("a", 0.0, 4000, 10), WorkloadRequest("b", 0.0, 4000, 10)]) \
        == (1.0, 1.0)


def test_pooled_bound_refuses_a_prompt_one_replica_cannot_prefill_within_the_slo() -> None:
    """A prompt runs on one replica: one whose own prefill there takes longer than the SLO is refused however many
    replicas the pool has, and it weighs in the token share by its size."""
    config = SimConfig(replicas=64)
    config = replace(config, slo_ttft_s=0.9 * _prefill_s(config, 6000))
    requests = [WorkloadRequest("long", 0.0, 6000, 0), WorkloadRequest("short", 1.0, 2000, 0)]
    assert pooled_attainment(config, requests) == (0.5, pytest.approx(2000 / 8000))


def _flops_of(request: WorkloadRequest, cached: int) -> float:
    return CostModel("llama-3-8b", "h200").flops_and_bytes(request_shape(request, cached))[0]


def _lru_savings(requests: list[WorkloadRequest], capacity_tokens: int) -> float:
    return sum(_flops_of(r, 0) - _flops_of(r, hit) for r, hit in zip(requests, lru_cached_tokens(requests, capacity_tokens),
                                                                    strict=True))


def test_an_eviction_rule_that_knows_the_future_keeps_the_prefix_that_comes_back_where_lru_keeps_none() -> None:
    """Three conversations of one 2-block prefix each, visited in turn (a, b, c, a, b, c, a): with room for two
    prefixes LRU always evicts the one that comes back next and hits nothing; the optimal rule keeps one prefix for
    good and the other slot for whichever comes back first, so it hits on a2 (a kept), on b2 (b in the other slot)
    and on a3: 3 of the 4 returns, each worth a whole 2-block prefix here (the prompts are 2 blocks and a token)."""
    order = ["a", "b", "c", "a", "b", "c", "a"]
    prefix = {"a": (1, 2), "b": (3, 4), "c": (5, 6)}
    requests = [WorkloadRequest(f"{c}{i}", float(i), 1025, 4, hash_ids=prefix[c], hash_block_tokens=512)
                for i, c in enumerate(order)]
    assert lru_cached_tokens(requests, 4 * 512) == [0] * 7
    one_return = _flops_of(requests[0], 0) - _flops_of(requests[0], 1024)
    saved = optimal_cache_savings(requests, 4 * 512, _flops_of)
    assert saved == pytest.approx(3 * one_return, rel=1e-6)
    assert saved >= 3 * one_return  # rounded up: it errs high, never low
    # room for everything: every return hits (4 of them); no room: nothing
    assert optimal_cache_savings(requests, 6 * 512, _flops_of) == pytest.approx(4 * one_return, rel=1e-6)
    assert optimal_cache_savings(requests, 511, _flops_of) == 0.0
    config = SimConfig(replicas=2)
    strict = compute_bound_rps(config, requests, cache_tokens=4 * 512, eviction="optimal")
    assert compute_bound_rps(config, requests, cache_tokens=4 * 512) < strict < compute_bound_rps(config, requests)
    with pytest.raises(ValueError, match="eviction"):
        compute_bound_rps(config, requests, cache_tokens=4 * 512, eviction="fifo")


def test_a_hit_is_worth_the_most_a_run_of_leading_blocks_saves_per_block_so_a_short_last_block_cannot_lower_it() -> None:
    """A prompt of 2 blocks and 1 token (its third block saves nothing: the last token is always computed) comes back
    with room for its first two blocks only: the bound must count what those two save, not two thirds of it (the
    mean over all three would)."""
    first = WorkloadRequest("x1", 0.0, 1025, 4, hash_ids=(1, 2, 3), hash_block_tokens=512)
    again = WorkloadRequest("x2", 1.0, 1025, 4, hash_ids=(1, 2, 3), hash_block_tokens=512)
    two_blocks = _flops_of(again, 0) - _flops_of(again, 1024)
    assert optimal_cache_savings([first, again], 2 * 512, _flops_of) >= two_blocks


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=2, max_size=30), st.integers(1, 12), st.integers(1, 3))
def test_no_eviction_rule_saves_more_than_the_strict_bound_lru_included(
        conversations: list[int], capacity_blocks: int, depth: int) -> None:
    """Random conversations (each a chain of `depth` shared blocks and a block of its own): LRU's savings, one
    eviction rule among all, never exceed the strict bound, and an infinite cache's savings bound both."""
    requests = [WorkloadRequest(f"r{i}", float(i), 512 * (depth + 1), 8,
                                hash_ids=tuple(100 * c + d for d in range(depth)) + (10_000 + i,),
                                hash_block_tokens=512) for i, c in enumerate(conversations)]
    strict = optimal_cache_savings(requests, capacity_blocks * 512, _flops_of)
    assert _lru_savings(requests, capacity_blocks * 512) <= strict * (1 + 1e-9)
    assert strict <= _lru_savings(requests, 10**9) * (1 + 1e-6) + len(requests) * 1e6
