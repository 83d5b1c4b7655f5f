"""Reports: tables, the side-by-side comparison, JSON and PNG plots from real summaries."""

from __future__ import annotations

import json
from pathlib import Path

from sluice_tools.metrics import RequestRecord, summarize
from sluice_tools.report import format_compare, format_table, write_json, write_plots


def make_records(scale: float) -> list[RequestRecord]:
    """Return three ok requests whose latencies grow with `scale`, and one rejection."""
    records = [
        RequestRecord(
            f"r{i}", arrival_s=i, first_token_s=i + 0.1 * scale, finish_s=i + 1.0 * scale, output_tokens=10
        )
        for i in range(3)
    ]
    return [*records, RequestRecord("x", arrival_s=0.5, finish_s=0.5, status="rejected")]


def test_table_shows_headline_figures() -> None:
    """The one-run table shows TTFT p99 in ms and the rejection count, and leaves out absent rows."""
    table = format_table(summarize(make_records(1.0), 1.0, 0.05))
    assert "TTFT p99 (ms)" in table and "100.0" in table
    assert "rejected" in table
    assert "sim s per wall s" not in table


def test_compare_has_one_column_per_configuration() -> None:
    """The comparison puts each configuration in its own column, aligned."""
    table = format_compare(
        {"fcfs+rr": summarize(make_records(1.0), 1, 1), "fcfs+score": summarize(make_records(2.0), 1, 1)}
    )
    header, rule, *rows = table.splitlines()
    assert header.split()[-2:] == ["fcfs+rr", "fcfs+score"]
    ttft = next(row for row in rows if row.startswith("TTFT p50"))
    assert ttft.split()[-2:] == ["100.0", "200.0"]
    assert len({len(line) for line in [header, rule, *rows]}) == 1


def test_json_and_plots_are_written(tmp_path: Path) -> None:
    """JSON round-trips and the CDF and timeline PNGs are written and non-empty."""
    summary = summarize(make_records(1.0), 1, 1, series={"waiting": [(0.0, 1.0), (1.0, 0.0)]})
    path = write_json(summary, tmp_path / "out.json")
    assert json.loads(path.read_text())["counts"]["rejected"] == 1
    files = write_plots(
        {"a": make_records(1.0), "b": make_records(2.0)}, {"a": {"waiting": [(0, 1), (1, 2)]}}, tmp_path
    )
    assert {f.name for f in files} == {"cdf_ttft.png", "cdf_tpot.png", "cdf_e2e.png", "timeline_a.png"}
    assert all(f.stat().st_size > 1000 for f in files)


def test_compare_adds_rows_per_priority_and_tenant() -> None:
    """A run with two priorities gets attainment and TTFT p99 rows per priority, '-' where a column lacks the class."""
    mixed = [
        RequestRecord("h", arrival_s=0, first_token_s=0.1, finish_s=1.0, output_tokens=10, priority=2),
        RequestRecord("n", arrival_s=0, first_token_s=0.3, finish_s=1.0, output_tokens=10),
    ]
    table = format_compare({"mixed": summarize(mixed, 1, 1), "plain": summarize(make_records(1.0), 1, 1)})
    row = next(line for line in table.splitlines() if line.startswith("TTFT p99, priority 2 (ms)"))
    assert row.split()[-2:] == ["100.0", "-"]


def test_cdf_is_titled_with_the_setup_and_draws_the_slo() -> None:
    """A CDF plot names the workload in its title, has one line per run, and marks the SLO target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sluice_tools.metrics import RequestRecord
    from sluice_tools.report import cdf_figure

    runs = {name: [RequestRecord(f"{name}{i}", arrival_s=0.0, first_token_s=0.01 * (i + 1), finish_s=1.0,
                                 output_tokens=10) for i in range(5)] for name in ("before", "after")}
    figure = cdf_figure(plt, runs, "ttft_s", "azure-conv (5 requests)", slo_s=0.2)
    axis = figure.axes[0]
    labels = [line.get_label() for line in axis.get_lines()]
    assert "azure-conv (5 requests)" in axis.get_title()
    assert labels == ["before", "after", "SLO 200 ms"]
    plt.close(figure)


def test_bench_records_survive_the_json_round_trip() -> None:
    """Records written by `sluice bench --json` read back with the same latencies, for --compare overlays."""
    from sluice_tools.metrics import RequestRecord
    from sluice_tools.report import records_from_json, records_to_json

    records = [RequestRecord("r1", tenant="a", arrival_s=1.0, first_token_s=1.2, finish_s=2.0, output_tokens=5,
                             input_tokens=7), RequestRecord("r2", status="rejected", arrival_s=1.5, finish_s=1.5)]
    back = records_from_json(json.loads(json.dumps(records_to_json(records))))
    assert [(r.request_id, r.status, r.ttft_s, r.tpot_s, r.e2e_s) for r in back] == \
        [(r.request_id, r.status, r.ttft_s, r.tpot_s, r.e2e_s) for r in records]
