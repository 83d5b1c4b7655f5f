"""The capacity measure that shedding cannot game: requests and offered tokens within SLO must both reach the
goal, refusals count as misses, and batch arrivals can be jittered apart."""

from __future__ import annotations

import json

import pytest

from sluice_tools.capacity import CapacitySearch, Probe, find_capacity, paired, token_attainment
from sluice_tools.metrics import RequestRecord
from sluice_tools.workload import WorkloadError, WorkloadRequest, transform


def _served(request_id: str, ttft_s: float = 0.1, status: str = "ok") -> RequestRecord:
    return RequestRecord(request_id, arrival_s=0.0, first_token_s=ttft_s if status == "ok" else None,
                         finish_s=ttft_s + 0.09, status=status, output_tokens=10)


def test_a_refused_long_request_weighs_by_its_offered_tokens() -> None:
    """Nine short requests served within SLO and one long one refused: 90% of requests but only 9,090 of
    19,090 offered tokens (47.6%) within SLO; a late request and one without a record are misses too."""
    requests = [WorkloadRequest(f"s{i}", 0.0, 1000, 10) for i in range(9)] + [WorkloadRequest("long", 0.0, 9990, 10)]
    records = [_served(f"s{i}") for i in range(9)] + [_served("long", status="rejected")]
    assert token_attainment(paired(requests, records), slo_ttft_s=1.0, slo_tpot_s=0.05) == pytest.approx(
        9090 / 19090)
    late = [_served(f"s{i}", ttft_s=2.0 if i == 0 else 0.1) for i in range(8)]  # s0 late, s8 has no record
    assert token_attainment(paired(requests[:9], late), 1.0, 0.05) == pytest.approx(7 / 9)


def test_shedding_the_expensive_requests_does_not_raise_the_capacity() -> None:
    """A system that keeps 95% of requests within SLO at any rate by refusing ever more of the long ones (its
    token share falls past x2) has capacity x2 by the new measure; the request-only figure, which shedding
    inflates up to the search's limit, is reported beside it."""
    def probe(scale: float) -> Probe:
        tokens = 0.97 if scale <= 2.0 else max(0.0, 0.97 - 0.2 * (scale - 2.0))
        return Probe(scale, 10.0 * scale, 0.95, None, token_attainment=tokens)

    result = find_capacity(probe, CapacitySearch(goal=0.9, tolerance=0.05))
    assert result.bracketed
    true_scale = 2.35  # 0.97 - 0.2 (s - 2) >= 0.9
    assert true_scale / 1.05 <= result.scale <= true_scale
    assert result.token_attainment is not None and result.token_attainment >= 0.9
    assert result.request_capacity_rps == pytest.approx(10.0 * 64)  # never fails on requests alone
    assert result.capacity_rps < result.request_capacity_rps / 20


def test_a_probe_passes_only_when_both_shares_reach_the_goal() -> None:
    """`passes` needs both shares; without a token share (unknown offered tokens) requests alone decide."""
    assert Probe(1.0, 1.0, 0.95, None, token_attainment=0.92).passes(0.9)
    assert not Probe(1.0, 1.0, 0.95, None, token_attainment=0.6).passes(0.9)
    assert not Probe(1.0, 1.0, 0.85, None, token_attainment=0.99).passes(0.9)
    assert Probe(1.0, 1.0, 0.95, None).passes(0.9)


def test_jitter_spreads_a_batch_of_one_timestamp_repeatably() -> None:
    """Eight requests at one instant, jittered by 0.5 s: eight distinct arrivals within [t, t + 0.5), in order,
    the same for the same seed and different for another; a negative jitter is refused."""
    batch = [WorkloadRequest(f"r{i}", 3.0, 100, 10) for i in range(8)]
    spread = transform(batch, jitter_s=0.5, seed=1)
    arrivals = [r.arrival_s for r in spread]
    assert len(set(arrivals)) == 8 and arrivals == sorted(arrivals)
    assert all(3.0 <= t < 3.5 for t in arrivals)
    assert arrivals == [r.arrival_s for r in transform(batch, jitter_s=0.5, seed=1)]
    assert arrivals != [r.arrival_s for r in transform(batch, jitter_s=0.5, seed=2)]
    with pytest.raises(WorkloadError, match="jitter"):
        transform(batch, jitter_s=-1.0)


def test_the_table_and_plot_show_both_shares_and_the_share_of_the_compute_bound(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The capacity table prints the request-only rate, both shares at the capacity point and the capacity
    over the compute bound; the plot is written with the token share beside the request share."""
    from sluice_tools.report import format_capacity, write_capacity_plot

    def probe(scale: float) -> Probe:
        return Probe(scale, 10.0 * scale, 0.95, None, token_attainment=0.97 if scale <= 2.0 else 0.5)

    result = find_capacity(probe, CapacitySearch(goal=0.9, tolerance=0.05))
    table = format_capacity({"round_robin": result}, compute_bound_rps=40.0)
    row = table.splitlines()[2]
    assert f"{result.capacity_rps:.2f}" in row and f"{result.request_capacity_rps:.2f}" in row
    assert "95.0%/97.0%" in row and f"{result.capacity_rps / 40.0:.1%}" in row
    assert write_capacity_plot({"round_robin": result}, tmp_path).stat().st_size > 0


def test_the_goal_lines_say_which_goal_each_sluice_row_meets() -> None:
    """Each Sluice row gets one line: its ratio to the plain round_robin row and to `dynamo_kv` given the same
    levers (the row with its words but the score router's), its share of the compute bound, and which goal it
    meets (both ratios, or within 5 % of the bound); baselines and competitors get none; a comparison whose row
    is missing is named, not taken as met."""
    from sluice_tools.report import capacity_goal_lines

    def searched(rate: float):  # type: ignore[no-untyped-def]
        return find_capacity(lambda scale: Probe(scale, rate * scale, 0.95 if scale <= 1.0 else 0.5, None,
                                                 token_attainment=0.95 if scale <= 1.0 else 0.5),
                             CapacitySearch(goal=0.9, tolerance=0.01))

    best = "score+prefill-weight=8+budget=slo+early-refusal"
    results = {"round_robin": searched(10.0), "dynamo_kv+early-refusal+budget=slo": searched(15.0),
               best: searched(21.0), "score": searched(19.0)}
    rates = {name: result.capacity_rps for name, result in results.items()}
    lines = capacity_goal_lines(results, compute_bound_rps=19.5)
    assert [line.split(":")[0] for line in lines] == [f"goal of {best}", "goal of score"]
    assert f"{rates[best] / rates['round_robin']:.2f}x round_robin (goal 2x)" in lines[0]
    assert f"{rates[best] / rates['dynamo_kv+early-refusal+budget=slo']:.2f}x dynamo_kv+budget=slo+early-refusal" in lines[0]
    assert lines[0].endswith("-> met (the ratios; within 5% of the compute bound)")
    assert "no dynamo_kv row" in lines[1] and lines[1].endswith("-> met (within 5% of the compute bound)")
    far = capacity_goal_lines(results, compute_bound_rps=100.0)
    assert far[0].endswith("-> met (the ratios)") and far[1].endswith("-> not met")
    alone = capacity_goal_lines({"score": results["score"]}, compute_bound_rps=None)
    assert alone == ["goal of score: no round_robin row; no dynamo_kv row; no compute bound -> not met"]
    # The share of the bound with the fleet's KV as one LRU cache is said beside it; the verdict stays the ideal one's.
    cached = capacity_goal_lines(results, compute_bound_rps=100.0, fleet_cache_bound_rps=rates["score"])
    assert "100% of it with the fleet's KV as one LRU cache" in cached[1] and cached[1].endswith("-> not met")
    # One bound per row where the rows' fleets hold different KV (a host prefix tier); a row without one says none.
    per_row = capacity_goal_lines(results, compute_bound_rps=100.0, fleet_cache_bound_rps={"score": rates["score"] / 2})
    assert "200% of it with the fleet's KV" in per_row[1] and "fleet's KV" not in per_row[0]
    # The strict bound with the fleet's KV (an eviction rule that knows the future) is a bound that binds: within
    # 5 % of it meets the goal like the compute bound, and a row far below it does not.
    strict = capacity_goal_lines(results, compute_bound_rps=100.0, strict_fleet_bound_rps={"score": rates["score"] * 1.04})
    assert "96% of the strict bound with the fleet's KV (goal 95%)" in strict[1]
    assert strict[1].endswith("-> met (within 5% of the compute bound)") and "strict" not in strict[0]
    below = capacity_goal_lines(results, compute_bound_rps=100.0, strict_fleet_bound_rps=rates["score"] * 1.7)
    assert "59% of the strict bound" in below[1] and below[1].endswith("-> not met")
    # The bounds under the TTFT SLO (pooled, partitioned) are said as information; they decide nothing.
    slo = capacity_goal_lines(results, compute_bound_rps=100.0,
                              slo_bounds_rps={"pooled": rates["score"] * 1.02, "partitioned": rates["score"] * 1.25})
    assert "98% of the pooled bound under the TTFT SLO; 80% of the partitioned bound under the TTFT SLO" in slo[1]
    assert slo[1].endswith("-> not met")


def test_sim_capacity_tolerance_sets_how_close_the_search_brackets_the_capacity(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`sluice sim --capacity --capacity-tolerance 0.01` bisects until the capacity and the lowest failing rate
    above it are within 1 %; the default 5 % stops with a wider bracket on the same workload."""
    from sluice_tools.cli import main

    def bracket(tolerance: str) -> float:
        out = tmp_path / f"cap-{tolerance}.json"
        argv = ["sim", "synthetic:poisson?rate=20&n=100&input=lognormal:3000:0.5:8000&output=lognormal:100:0.5:400",
                "--replicas", "1", "--capacity", "--compare", "round_robin", "--no-progress", "--json", str(out)]
        assert main([*argv, "--capacity-tolerance", tolerance] if tolerance else argv) == 0
        result = json.loads(out.read_text())["capacity"]["round_robin"]
        failing = min(p["rate_rps"] for p in result["probes"] if p["rate_rps"] > result["capacity_rps"])
        return failing / result["capacity_rps"]

    fine, default = bracket("0.01"), bracket("")
    assert fine <= 1.01 + 1e-9 < default <= 1.05 + 1e-9
    # The bounds beside it: with no block hashes, no cache of any size changes the compute bound.
    bounds = json.loads((tmp_path / "cap-.json").read_text())["compute_bound_rps"]
    assert bounds["fleet_cache"] == bounds["ideal_cache"] == bounds["no_cache"] > 0
    from worker_svc.costmodel import CostModel
    assert bounds["fleet_cache_tokens"] == CostModel("llama-3-8b", "h200").num_blocks * 16


def test_sim_capacity_gives_the_strict_bound_with_the_fleets_kv_where_that_kv_binds(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A chat mix with shared prefixes on one replica of 600 blocks: the fleet's KV cannot hold the reuse, so
    `sluice sim --capacity` prints and writes the strict bound with it (an eviction rule that knows the future),
    which lies above one LRU cache's and below an infinite cache's."""
    from sluice_tools.cli import main

    out = tmp_path / "cap.json"
    assert main(["sim", "synthetic:?mix=chat-high-reuse&rate=20&n=80", "--replicas", "1", "--capacity",
                 "--compare", "score+num-blocks=600", "--no-progress", "--json", str(out)]) == 0
    bounds = json.loads(out.read_text())["compute_bound_rps"]
    lru = bounds["fleet_cache_by_config"]["score+num-blocks=600"]
    strict = bounds["fleet_cache_optimal_by_config"]["score+num-blocks=600"]
    assert bounds["no_cache"] < lru < strict < bounds["ideal_cache"]
    printed = capsys.readouterr().out
    assert f"strict bound with the fleet's KV of score+num-blocks=600: {strict:.2f} req/s" in printed
    assert "of the strict bound with the fleet's KV (goal 95%)" in printed
