"""`bench_cost`'s ratios: the first Sluice target's path over every other target's, paired by repeat."""

from __future__ import annotations

from typing import Any

from sluice_tools.bench_cost import ratio_table, ratios


def _figures(paths: list[float]) -> dict[str, Any]:
    return {"path_us_per_token_each_run": paths}


def test_each_repeat_is_paired_with_the_same_repeat_of_the_other_target_and_the_median_taken() -> None:
    """Repeat i of the reference over repeat i of the other (not medians over medians): 100/50, 90/60, 120/40."""
    results = {"sluice_http": {"16": _figures([100.0, 90.0, 120.0]), "256": _figures([40.0])},
               "vllm": {"16": _figures([50.0, 60.0, 40.0]), "256": _figures([80.0])},
               "sluice_http_baseline": {"16": _figures([100.0, 100.0, 100.0])}}
    by_pair = ratios(results)
    assert by_pair["sluice_http / vllm"] == {"16": {"each_run": [2.0, 1.5, 3.0], "median": 2.0},
                                             "256": {"each_run": [0.5], "median": 0.5}}
    assert by_pair["sluice_http / sluice_http_baseline"] == {"16": {"each_run": [1.0, 0.9, 1.2], "median": 1.0}}
    assert "sluice_http / sluice_http" not in by_pair
    table = ratio_table(by_pair)
    assert "| sluice_http / vllm | 16 | 2.00, 1.50, 3.00 | **2.00** |" in table
    assert "| sluice_http / sluice_http_baseline | 16 | 1.00, 0.90, 1.20 | **1.00** |" in table


def test_levels_only_one_side_has_and_zero_paths_give_no_ratio() -> None:
    """A concurrency the reference did not run, or a run with no path CPU, is left out rather than divided."""
    results = {"sluice_http": {"16": _figures([100.0, 80.0])},
               "vllm": {"16": _figures([0.0, 40.0]), "1": _figures([500.0])}}
    assert ratios(results) == {"sluice_http / vllm": {"16": {"each_run": [2.0], "median": 2.0}}}


def test_without_the_reference_there_is_nothing_to_compare() -> None:
    """Scale-out results (admission_procs=N) have no `sluice_http` target: no ratios, no table rows."""
    assert ratios({"admission_procs=1": {"256": _figures([50.0])}}) == {}
    assert ratio_table({}).count("\n") == 1
