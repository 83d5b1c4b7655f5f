"""The sim summary's `ttft_prediction`: the router's predicted TTFT at routing against the actual one."""

from __future__ import annotations

import numpy as np
import pytest

from sluice_tools.metrics import RequestRecord, prediction_error
from sluice_tools.sim import SimConfig, Simulator, simulate
from sluice_tools.workload import load_workload

LOADED = "synthetic:poisson?rate=60&n=150&input=lognormal:1500:0.8:8000&output=lognormal:60:0.6:300"


def test_prediction_error_is_actual_over_predicted_from_the_routing_time() -> None:
    """Actual TTFT counts from the (last) routing; rejected requests and those without a first token are left out."""
    records = [
        RequestRecord("a", arrival_s=0.0, first_token_s=2.0),  # routed at 0.5, predicted 1.0 -> 1.5
        RequestRecord("b", arrival_s=0.0, first_token_s=1.0),  # routed at 0.0, predicted 2.0 -> 0.5
        RequestRecord("c", arrival_s=0.0, status="rejected"),
        RequestRecord("d", arrival_s=0.0),
    ]
    predicted = {"a": (0.5, 1.0), "b": (0.0, 2.0), "c": (0.0, 1.0), "d": (0.0, 1.0)}
    error = prediction_error(records, predicted)
    assert error["requests"] == 2
    assert error["ratio"]["p50"] == pytest.approx(1.0)  # type: ignore[index]
    assert error["ratio"]["max"] == pytest.approx(1.5)  # type: ignore[index]
    assert error["under"] == pytest.approx(0.5)


def test_sim_summary_block_is_computed_from_each_requests_predicted_and_actual_ttft() -> None:
    """The simulator records (routing time, the router's predicted TTFT) per admitted request; the summary's
    ratios are exactly the percentiles of (first token - routing time) / predicted over the ok requests."""
    requests = load_workload(LOADED, seed=3).requests
    config = SimConfig(replicas=2)
    simulator = Simulator(config, requests)
    records = simulator.run()
    ratios = [(r.first_token_s - simulator.predicted[r.request_id][0]) / simulator.predicted[r.request_id][1]
              for r in records if r.status == "ok" and r.first_token_s is not None]
    assert len(ratios) == len(requests)
    summary = simulate(config, requests, include_series=False).summary
    block = summary["ttft_prediction"]
    assert block["requests"] == len(ratios)  # type: ignore[index]
    for point in (50, 90, 99):
        assert block["ratio"][f"p{point}"] == pytest.approx(float(np.percentile(ratios, point)))  # type: ignore[index]
    assert 0.5 < block["ratio"]["p50"] < 2.0  # type: ignore[index]
