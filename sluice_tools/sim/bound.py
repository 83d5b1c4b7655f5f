"""The compute bound of a capacity: the arrival rate at which every replica would be busy on FLOPs alone.

No router, order or round budget can serve a workload faster than its FLOPs allow: each request costs its
prefill (the part one infinite prefix cache would not hold: `ideal_prefix_hit_rate`'s leading blocks) and one
query token per further output token, each attending to its whole context, at the cost model's FLOP rate
(peak x compute efficiency x tensor parallel). Memory-bound rounds, round overheads and idle replicas only
slow it further, so `compute_bound_rps` is an upper bound on steady-state capacity; a capacity search on a
short window can still exceed it, since the window ends while the backlog is being drained within the SLO.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

from sluice_tools.sim.config import SimConfig
from sluice_tools.workload import WorkloadRequest
from worker_svc.costmodel import CostModel, RoundShape


def request_shape(request: WorkloadRequest, cached_tokens: int) -> RoundShape:
    """Return the summed shape of every round a request takes part in: its prefill past `cached_tokens`,
    then one query token per output after the first (each reading its whole context)."""
    n, out = request.input_length, request.output_length
    cached = min(cached_tokens, n - 1)
    fresh = n - cached
    pairs = fresh * cached + fresh * (fresh + 1) // 2
    decodes = out - 1
    pairs += decodes * (n + 1) + decodes * (decodes - 1) // 2  # output k attends to n + k positions
    query = fresh + decodes
    return RoundShape(query, pairs, cached + n * decodes, query, out)


def _cost_model(config: SimConfig) -> CostModel:
    """The cost model of the configuration's replicas (model, GPU, block size, coefficients, model length)."""
    return CostModel(config.model, config.gpu, block_size=config.scheduler.block_size,
                     coefficients=config.cost_coefficients, max_model_len=config.max_model_len,
                     host_kv_bytes=config.host_kv_bytes)


def compute_bound_rps(config: SimConfig, requests: Sequence[WorkloadRequest], *, ideal_cache: bool = True,
                      cache_tokens: int | None = None, eviction: str = "lru") -> float:
    """Return the rate (req/s) at which `config.replicas` replicas would be busy on the requests' FLOPs alone.

    With `ideal_cache`, what one infinite prefix cache would hold is not computed (the most any router
    saves); without it every prompt token is. With `cache_tokens`, that cache holds only so many tokens and
    evicts the least recently used block (`eviction="lru"`: `lru_cached_tokens`, not a strict bound) or the block
    an eviction rule that knows the future would (`eviction="optimal"`: `optimal_cache_savings`, a strict one);
    `fleet_cache_tokens` is the fleet's KV."""
    if eviction not in ("lru", "optimal"):
        raise ValueError(f"eviction must be 'lru' or 'optimal', not {eviction!r}")
    cost = _cost_model(config)
    flops_per_s = cost.gpu.peak_flops * cost.tensor_parallel * cost.coefficients.compute_efficiency
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    capacity = cache_tokens if ideal_cache else 0
    if capacity is not None and eviction == "optimal":
        def flops_of(request: WorkloadRequest, cached: int) -> float:
            return cost.flops_and_bytes(request_shape(request, cached))[0]

        flops = sum(flops_of(request, 0) for request in ordered) - optimal_cache_savings(ordered, capacity, flops_of)
    else:
        cached = _ideal_cached_tokens(ordered) if capacity is None else lru_cached_tokens(ordered, capacity)
        flops = sum(cost.flops_and_bytes(request_shape(request, hit))[0]
                    for request, hit in zip(ordered, cached, strict=True))
    return config.replicas * len(requests) * flops_per_s / flops if flops > 0 else float("inf")


def fleet_cache_tokens(config: SimConfig) -> int:
    """Return the tokens of KV every replica holds together: its device blocks (the simulator's), and its host
    prefix tier's when it has one (`host_cache_gb`)."""
    cost = _cost_model(config)
    host = cost.num_host_blocks if config.host_cache_gb is not None else 0
    return config.replicas * ((config.num_blocks or cost.num_blocks) + host) * config.scheduler.block_size


def _ideal_cached_tokens(ordered: Sequence[WorkloadRequest]) -> list[int]:
    """Each request's leading tokens one infinite prefix cache holds when it arrives (requests in arrival order)."""
    seen: set[int] = set()
    cached = []
    for request in ordered:
        hit = 0
        for block in request.hash_ids:
            if block not in seen:
                break
            hit += request.hash_block_tokens
        seen.update(request.hash_ids)
        cached.append(hit)
    return cached


def lru_cached_tokens(ordered: Sequence[WorkloadRequest], capacity_tokens: int) -> list[int]:
    """Each request's leading tokens a prefix cache of `capacity_tokens` holds when it arrives (requests in arrival
    order): one cache for the whole fleet, every prompt's blocks stored once it arrives, the least recently used
    block evicted when it is full (vLLM's rule and the block pool's). It is about the most routing gets from that
    much KV under that eviction, not a strict bound: replicas holding the same prefix twice only shrink it, and
    running requests' KV, which shrinks it further, is left out, but separate LRU caches can beat one on some
    access patterns, and an eviction rule that knew the future (Belady's) holds more."""
    cache: OrderedDict[int, None] = OrderedDict()
    cached = []
    for request in ordered:
        if not request.hash_ids:
            cached.append(0)
            continue
        blocks = max(capacity_tokens // request.hash_block_tokens, 0)
        hit = 0
        for block in request.hash_ids:
            if block not in cache:
                break
            cache.move_to_end(block)
            hit += 1
        for block in request.hash_ids[hit:]:
            cache[block] = None
            cache.move_to_end(block)
        while len(cache) > blocks:
            cache.popitem(last=False)
        cached.append(hit * request.hash_block_tokens)
    return cached


SAVINGS_UNIT_FLOPS = 1e6
"""`optimal_cache_savings` solves in whole units of this many FLOPs, each hit's worth rounded up (so it errs high)."""


def optimal_cache_savings(ordered: Sequence[WorkloadRequest], capacity_tokens: int,
                          flops_of: Callable[[WorkloadRequest, int], float]) -> float:
    """Return an upper bound on the FLOPs a prefix cache of `capacity_tokens` can save the requests (in arrival
    order), whatever its eviction rule: `flops_of(request, cached_tokens)` is a request's FLOPs with that many
    leading prompt tokens cached.

    A hit on a block at request j means the block stayed cached since its previous use, at request i: the
    interval (i, j) held one block of the cache. Any cache, the fleet's KV on several replicas included (a block
    held twice only takes more room), keeps at most `capacity_tokens // block` blocks at each moment between two
    requests, so the hits any eviction rule gets are intervals no more than that many of which overlap anywhere.
    The best such set, an eviction rule that knows the future (Belady's, with each hit weighed by the FLOPs it
    saves), is a maximum-weight choice of intervals with that many overlapping at most: a min-cost flow on the
    request sequence (networkx's network simplex), exact in whole units of `SAVINGS_UNIT_FLOPS`.

    Two relaxations keep it a bound and make it a flow: a block may hit without the blocks before it (a real
    prefix cache hits only a run of leading blocks), and every hit of request j is worth the same: the most that
    a run of j's leading blocks saves per block, over the runs an infinite cache would hold (deeper blocks save
    more, attending to more, so that is the longest run's mean but where a last, partial block saves less; a real
    run of h leading hits saves at most h times it). Running requests' KV, which leaves less room,
    is left out. A few hundred requests take well under a second; 3,993 Mooncake requests with 77,953 reuses ~1.5 min."""
    import networkx as nx  # noqa: PLC0415 (only where a bound is asked for: the sim's capacity search)

    if capacity_tokens <= 0 or len(ordered) < 2:
        return 0.0
    graph = nx.MultiDiGraph()
    graph.add_nodes_from(range(len(ordered)))
    last_use: dict[int, int] = {}
    slots = 0
    for j, request in enumerate(ordered):
        if not request.hash_ids:
            continue
        block_tokens = request.hash_block_tokens
        slots = max(slots, capacity_tokens // block_tokens)
        held = 0
        for block in request.hash_ids:
            if block not in last_use:
                break
            held += 1
        if held:
            full = flops_of(request, 0)
            best = max((full - flops_of(request, h * block_tokens)) / h for h in range(1, held + 1))
            worth = math.ceil(best / SAVINGS_UNIT_FLOPS)
            for block in request.hash_ids[:held]:
                graph.add_edge(last_use[block], j, capacity=1, weight=-worth)
        for block in request.hash_ids:
            last_use[block] = j
    if slots == 0 or graph.number_of_edges() == 0:
        return 0.0
    for j in range(len(ordered) - 1):
        graph.add_edge(j, j + 1, capacity=slots, weight=0)
    graph.nodes[0]["demand"] = -slots
    graph.nodes[len(ordered) - 1]["demand"] = slots
    cost, _ = nx.network_simplex(graph)
    return -cost * SAVINGS_UNIT_FLOPS


def pooled_attainment(config: SimConfig, requests: Sequence[WorkloadRequest]) -> tuple[float, float]:
    """Return (request share, offered-token share) within the TTFT SLO on one pooled ideal server.

    The pooled server has every replica's FLOP rate and computes prefills (past what one infinite
    prefix cache holds) in arrival order; a request's first token comes when the work ahead of it and
    its own prefill are done at the pooled rate, and never sooner than its own prefill alone takes at one
    replica's rate (a prompt runs on one replica). A request that would be late is refused, so it adds
    no work (admission's early refusal, with a perfect prediction). Decodes, round overheads and
    memory-bound rounds are left out, so every one of these is optimistic."""
    return _ideal_attainment(config, requests, partitioned=False)


def partitioned_attainment(config: SimConfig, requests: Sequence[WorkloadRequest]) -> tuple[float, float]:
    """Return (request share, offered-token share) within the TTFT SLO on `config.replicas` ideal servers.

    As `pooled_attainment`, but each prompt runs whole on one server at one replica's FLOP rate, the one whose
    backlog ends first (the least work left), after the prefills sent there before it: a long prompt waits for a
    quarter of a 4-replica fleet's backlog and then takes its whole prefill at one replica's rate, where the
    pooled server would have taken it at four. Still optimistic (a perfect prediction, one infinite prefix cache
    every server reads, no decodes), but not a strict bound: least work first and arrival order are not always
    the best a router and a scheduler can do."""
    return _ideal_attainment(config, requests, partitioned=True)


def _ideal_attainment(config: SimConfig, requests: Sequence[WorkloadRequest], *,
                      partitioned: bool) -> tuple[float, float]:
    cost = _cost_model(config)
    one = cost.gpu.peak_flops * cost.tensor_parallel * cost.coefficients.compute_efficiency
    pooled, slo = one * config.replicas, config.slo_ttft_s
    seen: set[int] = set()
    backlog_flops, clock = 0.0, None
    free_at = [0.0] * max(config.replicas, 1)  # partitioned: when each server's backlog ends (seconds)
    served = served_tokens = offered_tokens = 0
    for request in sorted(requests, key=lambda r: r.arrival_s):
        cached = 0
        for block in request.hash_ids:
            if block not in seen:
                break
            cached += request.hash_block_tokens
        n = request.input_length
        fresh = n - min(cached, n - 1)
        shape = RoundShape(fresh, fresh * (n - fresh) + fresh * (fresh + 1) // 2, n - fresh, fresh, 1)
        own = cost.flops_and_bytes(shape)[0]
        offered_tokens += n + request.output_length
        if partitioned:
            server = min(range(len(free_at)), key=free_at.__getitem__)
            done = max(free_at[server], request.arrival_s) + own / one
            on_time = done - request.arrival_s <= slo
            if on_time:
                free_at[server] = done
        else:
            if clock is not None:
                backlog_flops = max(backlog_flops - (request.arrival_s - clock) * pooled, 0.0)
            clock = request.arrival_s
            on_time = max((backlog_flops + own) / pooled, own / one) <= slo
            if on_time:
                backlog_flops += own
        if on_time:
            seen.update(request.hash_ids)
            served += 1
            served_tokens += n + request.output_length
    if not requests:
        return 1.0, 1.0
    return served / len(requests), served_tokens / offered_tokens if offered_tokens else 1.0
