"""Metrics on hand-made records, checked against hand-computed numbers."""

from __future__ import annotations

import json

import pytest

from sluice_tools.metrics import FairnessWeights, RequestRecord, jain_index, meets_slo, percentiles, summarize


def make_record(
    request_id: str, arrival: float, first: float, finish: float, out: int, **kw: object
) -> RequestRecord:
    """Return an ok record with the given times and output length."""
    return RequestRecord(
        request_id, arrival_s=arrival, first_token_s=first, finish_s=finish, output_tokens=out, **kw
    )  # type: ignore[arg-type]


def test_percentiles_interpolate_linearly() -> None:
    """p50/p90/p99 of 1..4 are 2.5/3.7/3.97 (linear interpolation between closest ranks)."""
    stats = percentiles([4.0, 1.0, 3.0, 2.0])
    assert stats["p50"] == pytest.approx(2.5)
    assert stats["p90"] == pytest.approx(3.7)
    assert stats["p99"] == pytest.approx(3.97)
    assert stats["max"] == 4.0 and stats["count"] == 4


def test_percentiles_of_nothing_are_none() -> None:
    """An empty sample gives None percentiles rather than an exception or a zero."""
    assert percentiles([])["p99"] is None


def test_jain_index_hand_values() -> None:
    """Jain's index is 1 for equal shares, 0.5 for one of two starved, 36/42 for 1,2,3."""
    assert jain_index([5, 5]) == pytest.approx(1.0)
    assert jain_index([1, 0]) == pytest.approx(0.5)
    assert jain_index([1, 2, 3]) == pytest.approx(36 / 42)
    assert jain_index([]) is None


def test_record_derived_latencies() -> None:
    """TTFT, TPOT and E2E follow the documented definitions."""
    record = make_record("a", arrival=1.0, first=1.5, finish=2.5, out=11)
    assert record.ttft_s == pytest.approx(0.5)
    assert record.tpot_s == pytest.approx(0.1)
    assert record.e2e_s == pytest.approx(1.5)
    assert make_record("b", 0.0, 0.2, 0.2, out=1).tpot_s is None


def test_unknown_status_is_refused() -> None:
    """A misspelt status is an error, not a silently uncounted request."""
    with pytest.raises(ValueError, match="status"):
        RequestRecord("x", status="done")


def test_summary_goodput_attainment_and_counts() -> None:
    """Goodput counts only ok requests inside both SLOs; rejections count as misses in attainment."""
    records = [
        make_record("fast", 0.0, 0.1, 1.0, out=10),  # ttft .1, tpot .1
        make_record("slow-ttft", 0.0, 2.0, 3.0, out=11),  # ttft 2 > 1
        make_record("slow-tpot", 1.0, 1.2, 4.2, out=11),  # tpot .3 > .2
        RequestRecord("rej", arrival_s=2.0, finish_s=2.0, status="rejected", input_tokens=99),
    ]
    summary = summarize(records, slo_ttft_s=1.0, slo_tpot_s=0.2)
    assert summary["duration_s"] == pytest.approx(4.2)
    assert summary["goodput_rps"] == pytest.approx(1 / 4.2)
    assert summary["slo_attainment"] == pytest.approx(0.25)
    assert summary["counts"] == {"ok": 3, "rejected": 1, "timed_out": 0, "cancelled": 0, "failed": 0}
    ttft = summary["ttft_s"]
    assert isinstance(ttft, dict) and ttft["p50"] == pytest.approx(0.2)
    json.dumps(summary)


def test_itl_from_token_times() -> None:
    """ITL percentiles come from the gaps between consecutive token times of every ok request."""
    records = [
        make_record("a", 0.0, 1.0, 1.3, out=3, token_times=[1.0, 1.1, 1.3]),
        make_record("b", 0.0, 1.0, 1.4, out=2, token_times=[1.0, 1.4]),
    ]
    itl = summarize(records, 1.0, 1.0)["itl_s"]
    assert isinstance(itl, dict)
    assert itl["count"] == 3
    assert itl["p50"] == pytest.approx(0.2)
    assert itl["max"] == pytest.approx(0.4)


def test_tenant_shares_and_weighted_jain() -> None:
    """A tenant of weight 2 that gets twice the service of a weight-1 tenant is perfectly fair."""
    records = [
        make_record("a", 0, 1, 2, out=10, tenant="gold", input_tokens=20),  # 20 + 2*10 = 40
        make_record("b", 0, 1, 2, out=5, tenant="free", input_tokens=10),  # 10 + 2*5 = 20
    ]
    fairness = summarize(records, 1, 1, fairness=FairnessWeights(tenant_weights={"gold": 2.0}))["fairness"]
    assert isinstance(fairness, dict)
    assert fairness["jain_index"] == pytest.approx(1.0)
    assert fairness["tenants"]["gold"]["share"] == pytest.approx(2 / 3)


def test_longest_normal_priority_wait() -> None:
    """The longest wait covers only priority-0 requests, including one that never ran."""
    records = [
        make_record("hi", 0.0, 9.0, 10.0, out=2, priority=5),
        make_record("n1", 0.0, 3.0, 4.0, out=2, first_scheduled_s=2.5),
        RequestRecord("n2", arrival_s=1.0, finish_s=5.0, status="timed_out"),
    ]
    assert summarize(records, 1, 1)["max_normal_priority_wait_s"] == pytest.approx(4.0)


def test_series_are_summarised_and_passed_through() -> None:
    """Replica-level series get mean/max/last and are kept for plots."""
    series = {"queue_len": [(0.0, 1.0), (1.0, 3.0), (2.0, 2.0)]}
    summary = summarize(
        [make_record("a", 0, 1, 2, out=2)], 1, 1, series=series, replica_stats={"preemptions": 4}
    )
    assert summary["series_summary"] == {"queue_len": {"mean": 2.0, "max": 3.0, "last": 2.0}}
    assert summary["replica_stats"] == {"preemptions": 4}
    assert "queue_len" in summary["series"]  # type: ignore[operator]


def test_meets_slo_single_token() -> None:
    """A single-token answer has no TPOT and meets the SLO on TTFT alone."""
    assert meets_slo(make_record("a", 0, 0.5, 0.5, out=1), 1.0, 0.01)


def test_windowed_jain_counts_only_windows_where_tenants_compete() -> None:
    """Windowed Jain's index uses weighted service inside windows with two or more live tenants."""
    records = [
        make_record("a1", 0.0, 1.0, 15.0, out=3, tenant="a", input_tokens=10, token_times=[1.0, 5.0, 12.0]),
        make_record("b1", 0.0, 2.0, 8.0, out=2, tenant="b", input_tokens=20, token_times=[2.0, 3.0]),
    ]
    weights = FairnessWeights(tenant_weights={"a": 2.0}, window_s=10.0)
    fairness = summarize(records, 1, 1, fairness=weights)["fairness"]
    assert isinstance(fairness, dict)
    # window 0 only: a = (10 + 2*2) / 2 = 7, b = 20 + 2*2 = 24 -> 31^2 / (2 * (49 + 576))
    assert fairness["windowed_jain_index"] == pytest.approx(961 / 1250)
    assert summarize(records[:1], 1, 1)["fairness"]["windowed_jain_index"] is None  # type: ignore[index]


def test_per_priority_and_per_tenant_classes() -> None:
    """With two priorities and two tenants the summary splits attainment and TTFT by class; one class adds nothing."""
    records = [
        make_record("hi", 0.0, 0.1, 1.0, out=10, priority=1, tenant="a"),
        make_record("lo", 0.0, 2.0, 3.0, out=10, tenant="b"),
        make_record("lo2", 0.0, 0.5, 1.4, out=10, tenant="b"),
    ]
    summary = summarize(records, slo_ttft_s=1.0, slo_tpot_s=0.2)
    by_priority, by_tenant = summary["by_priority"], summary["by_tenant"]
    assert by_priority["1"]["slo_attainment"] == 1.0 and by_priority["0"]["slo_attainment"] == 0.5  # type: ignore[index]
    assert by_tenant["b"]["requests"] == 2 and by_tenant["b"]["ttft_s"]["p50"] == pytest.approx(1.25)  # type: ignore[index]
    single = summarize(records[1:2], slo_ttft_s=1.0, slo_tpot_s=0.2)
    assert "by_priority" not in single and "by_tenant" not in single
