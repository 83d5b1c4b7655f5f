"""`bench_cost`'s ratios (the first Sluice target's path over every other target's, paired by repeat) and its
rate-matched pairs' stacks, flags and table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sluice_tools.bench_cost import (
    _stack_config,
    build_parser,
    no_matched_pairs,
    pair_table,
    ratio_table,
    ratios,
)
from worker_svc import __main__ as worker_main


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


def test_the_rate_matched_stack_gives_its_worker_the_scale_and_the_worker_takes_it(tmp_path: Path) -> None:
    """`--match-rate`'s stacks: the time scale reaches the worker's command line as --emulate-time-scale, which
    the worker's own parser reads back; at scale 1 (every other stack of the bench) nothing is added."""
    scaled = _stack_config(tmp_path / "scaled", time_scale=2.5)
    assert scaled.emulate_time and scaled.worker_args == ("--emulate-time-scale", "2.5")
    options = worker_main.parse_args(["--backend", "costmodel", "--emulate-time", *scaled.worker_args])
    assert options.emulate_time_scale == 2.5
    assert _stack_config(tmp_path / "plain").worker_args == ()


@pytest.mark.parametrize(("argv", "reason"), [
    (["--match-rate", "--no-vllm"], "--no-vllm"),
    (["--match-rate", "--scale-out", "1", "2"], "--scale-out"),
    (["--match-rate", "--vllm-python", "/nonexistent/python"], "no vLLM at /nonexistent/python (make setup-vllm)"),
    (["--no-vllm"], None),
])
def test_a_run_that_cannot_pair_with_vllm_says_why_it_measures_no_matched_pairs(argv: list[str],
                                                                                reason: str | None) -> None:
    """`make bench-cost` asks for --match-rate; with --no-vllm, --scale-out or no vLLM installed the run goes on
    without the pairs and prints why (`no_matched_pairs`); without --match-rate there is nothing to say."""
    assert no_matched_pairs(build_parser().parse_args(argv)) == reason


def test_pair_table_lists_each_pair_in_run_order_with_both_rates() -> None:
    pairs = [{"concurrency": 16, "time_scale": 0.52, "tokens_per_s": {"sluice_http": 6200, "vllm": 6400},
              "path_us_per_token": {"sluice_http": 61.0, "vllm": 55.0}},
             {"concurrency": 256, "time_scale": 2.2, "tokens_per_s": {"sluice_http": 12000, "vllm": 11900},
              "path_us_per_token": {"sluice_http": 31.5, "vllm": 39.4}}]
    lines = pair_table(pairs).splitlines()
    assert lines[2] == "| 16 | 0.52 | 6200 / 6400 | 61.0 / 55.0 |"
    assert lines[3] == "| 256 | 2.2 | 12000 / 11900 | 31.5 / 39.4 |"
