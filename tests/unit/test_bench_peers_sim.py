"""The simulator side of `make bench-peers`: the fit to probe samples and the workload handed to `sluice sim`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice_tools.bench_peers_sim import (
    SIM_CONFIGS,
    compare,
    decode_shape,
    fit,
    prefill_shape,
    sim_config,
    to_workload,
)
from sluice_tools.bench_peers_workload import ChatShape, Req, chat_requests
from sluice_tools.sim.run import simulate
from worker_svc.costmodel import CostCoefficients, CostModel, coefficients_to_dict


def test_fit_recovers_the_coefficients_that_made_the_samples() -> None:
    """Samples timed by a known cost model (a CPU-like 3 ms per round), each TTFT with 15 ms that is no round, fit
    back to it within 5% and to the 15 ms as the request delay (within 0.5 ms)."""
    truth = CostModel("tiny", "h200", block_size=32,
                      coefficients=CostCoefficients(compute_efficiency=2e-4, memory_efficiency=1e-3, overhead_s=0.003))
    samples = [{"kind": "prefill", "prompt": p, "seconds": 0.015 + truth.shape_time(prefill_shape(p))}
               for p in (32, 256, 1280)]
    samples += [{"kind": "decode", "batch": b, "context": 288, "seconds": truth.shape_time(decode_shape(b, 288))}
                for b in (1, 8, 32)]
    fitted, rows, delay = fit(samples)
    assert delay == pytest.approx(0.015, abs=0.0005)
    assert fitted.coefficients.overhead_s == pytest.approx(0.003, rel=0.1)
    assert all(abs(row["error"]) < 0.05 for row in rows)


def test_prompts_become_block_ids_shared_exactly_where_the_text_is() -> None:
    """Two prompts with the same first 64 characters share two block ids and differ after; a partial block has
    no id; lengths, outputs and arrivals carry over."""
    a, b = "x" * 64 + "a" * 40, "x" * 64 + "b" * 32
    reqs = to_workload([Req(0.0, a, 5, "g"), Req(1.5, b, 7, "g", "gold", 1)])
    assert reqs[0].hash_ids[:2] == reqs[1].hash_ids[:2] and reqs[0].hash_ids[2] != reqs[1].hash_ids[2]
    assert len(reqs[0].hash_ids) == 3 and reqs[0].hash_block_tokens == 32
    assert (reqs[1].input_length, reqs[1].output_length, reqs[1].arrival_s) == (96, 7, 1.5)
    assert (reqs[1].tenant, reqs[1].priority) == ("gold", 1)


def test_the_chat_mix_runs_through_every_simulated_front_end(tmp_path: Path) -> None:
    """Each simulated front end serves every turn of a small chat mix on 2 CPU-fitted replicas, and the
    prefix-aware ones hit the shared system prompt."""
    coefficients = tmp_path / "probe.json"
    coefficients.write_text(json.dumps({"coefficients": coefficients_to_dict(
        CostCoefficients(compute_efficiency=2e-4, memory_efficiency=1e-3, overhead_s=0.003))}))
    requests = to_workload(chat_requests(24, 4.0, ChatShape(system_tokens=256, turns=3, assistant_tokens=16)))
    rows = []
    for front in SIM_CONFIGS:
        summary = simulate(sim_config(front, coefficients, 1.0, 0.1), requests, include_series=False).summary  # type: ignore[arg-type]
        assert summary["counts"]["ok"] == 24, front  # type: ignore[index]
        rows.append({"workload": "chat", "load": "near", "front": front, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0,
                     "goodput_rps": float(summary["goodput_rps"])})  # type: ignore[arg-type]
    live = {"runs": [{"workload": "chat", "load": "near", "front": "sluice",
                      "headline": {"ttft_p50_ms": 3.0, "ttft_p99_ms": 4.0, "goodput_rps": 1.0}}]}
    table = compare(rows, live)
    assert "| chat | near | sluice | 1.0 | 3.0 | 2.0 | 4.0 |" in table and "sim ranking" in table
