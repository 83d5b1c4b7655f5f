"""The compute bound of a capacity counts each request's FLOPs once and what an ideal cache would not compute."""

from __future__ import annotations

import pytest

from sluice_tools.sim import SimConfig
from sluice_tools.sim.bound import compute_bound_rps, request_shape
from sluice_tools.workload import WorkloadRequest
from worker_svc.costmodel import CostModel


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
