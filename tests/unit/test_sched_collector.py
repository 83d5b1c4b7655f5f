"""The collector settings a scheduler process runs with (scheduler_svc.collector), and the bench that measures them."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from scheduler_svc import bench
from scheduler_svc.collector import TRANSIENT_OBJECTS_PER_SEQ, tune_collector


@pytest.fixture
def restore_collector() -> Iterator[None]:
    """Put the process's collector thresholds back after a test that changes them."""
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


def test_young_threshold_is_raised_above_one_rounds_transient_objects(restore_collector: None) -> None:
    """For 1024 sequences per round the young threshold becomes 16 objects per sequence; the others stay."""
    gc.set_threshold(700, 10, 10)
    assert tune_collector(1024) == (TRANSIENT_OBJECTS_PER_SEQ * 1024, 10, 10) == gc.get_threshold()


def test_tuning_never_lowers_a_threshold(restore_collector: None) -> None:
    """A smaller core in the same process keeps the larger threshold (and Python's 700 is a floor)."""
    gc.set_threshold(700, 10, 10)
    tune_collector(1024)
    assert tune_collector(8) == (TRANSIENT_OBJECTS_PER_SEQ * 1024, 10, 10)
    gc.set_threshold(700, 10, 10)
    assert tune_collector(8)[0] == 700


def test_bench_cores_decode_only_after_setup_with_the_waiting_queue_untouched() -> None:
    """The bench's setup (public API only) leaves every running request decoding and the waiting ones queued."""
    pairs, _ = bench.load_lengths()
    core = bench.build_core(8, 16, 5, pairs, seed=8)
    assert (core.num_running, core.num_waiting) == (8, 16)
    figures = bench.measure(core, 5)  # asserts that every measured round is decode-only
    assert figures["median_us"] > 0 and core.num_running == 8 and core.num_waiting == 16


def test_bench_pipelined_rounds_place_every_running_request_ahead() -> None:
    """Pipelined, each measured round carries every running request, placed ahead of the round in flight."""
    pairs, _ = bench.load_lengths()
    core = bench.build_core(8, 16, 40, pairs, seed=8)
    before = core.stats().rounds
    figures = bench.measure(core, 40, pipelined=True)  # asserts decode-only rounds of all 8 requests
    assert figures["median_us"] > 0 and core.num_running == 8 and core.num_waiting == 16
    assert core.stats().rounds == before + 41  # the one planned first, then one per measured round
    assert len(core.outcomes.in_flight) == 1  # the last one planned is still in flight
