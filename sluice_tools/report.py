"""Reports of a run's summary (`sluice_tools.metrics.summarize`): JSON, tables and PNG plots.

- `write_json`: the whole summary, for machines.
- `format_table`: the headline figures of one run, fixed width, for people.
- `format_compare`: the same rows side by side, one column per configuration.
- `write_plots`: latency CDFs (TTFT, TPOT, E2E; one line per configuration) and a timeline of
  queue length, running requests, KV use and replica count (matplotlib, Agg backend).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sluice_tools.metrics import RequestRecord

Summary = Mapping[str, object]


def _get(summary: Summary, path: str) -> object:
    value: object = summary
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def _number(scale: float, digits: int) -> Callable[[object], str]:
    def render(value: object) -> str:
        if value is None or not isinstance(value, int | float) or math.isnan(float(value)):
            return "-"
        return f"{float(value) * scale:,.{digits}f}"

    return render


# (label, path in the summary, renderer)
ROWS: tuple[tuple[str, str, Callable[[object], str]], ...] = (
    ("requests", "requests", _number(1, 0)),
    ("ok", "counts.ok", _number(1, 0)),
    ("rejected", "counts.rejected", _number(1, 0)),
    ("timed out", "counts.timed_out", _number(1, 0)),
    ("cancelled", "counts.cancelled", _number(1, 0)),
    ("failed", "counts.failed", _number(1, 0)),
    ("retried", "retried", _number(1, 0)),
    ("goodput (req/s)", "goodput_rps", _number(1, 3)),
    ("SLO attainment (%)", "slo_attainment", _number(100, 1)),
    ("throughput (req/s)", "throughput_rps", _number(1, 3)),
    ("output tokens/s", "output_tokens_per_s", _number(1, 0)),
    ("TTFT p50 (ms)", "ttft_s.p50", _number(1000, 1)),
    ("TTFT p90 (ms)", "ttft_s.p90", _number(1000, 1)),
    ("TTFT p99 (ms)", "ttft_s.p99", _number(1000, 1)),
    ("TPOT p50 (ms)", "tpot_s.p50", _number(1000, 2)),
    ("TPOT p90 (ms)", "tpot_s.p90", _number(1000, 2)),
    ("TPOT p99 (ms)", "tpot_s.p99", _number(1000, 2)),
    ("ITL p50 (ms)", "itl_s.p50", _number(1000, 2)),
    ("ITL p99 (ms)", "itl_s.p99", _number(1000, 2)),
    ("E2E p50 (s)", "e2e_s.p50", _number(1, 2)),
    ("E2E p99 (s)", "e2e_s.p99", _number(1, 2)),
    ("TTFT actual/predicted p50", "ttft_prediction.ratio.p50", _number(1, 2)),
    ("TTFT actual/predicted p90", "ttft_prediction.ratio.p90", _number(1, 2)),
    ("TTFT actual/predicted p99", "ttft_prediction.ratio.p99", _number(1, 2)),
    ("max normal wait (s)", "max_normal_priority_wait_s", _number(1, 2)),
    ("Jain's index", "fairness.jain_index", _number(1, 3)),
    ("Jain's index, windowed", "fairness.windowed_jain_index", _number(1, 3)),
    ("preemptions", "preemptions", _number(1, 0)),
    ("recomputed tokens", "tokens.recomputed", _number(1, 0)),
    ("prefix hit rate (%)", "replica_stats.prefix_hit_rate", _number(100, 1)),
    ("KV use mean (%)", "series_summary.kv_used_frac.mean", _number(100, 1)),
    ("KV use max (%)", "series_summary.kv_used_frac.max", _number(100, 1)),
    ("queue max", "series_summary.waiting.max", _number(1, 0)),
    ("dropped results", "replica_stats.dropped_results", _number(1, 0)),
    ("simulated s", "sim.simulated_s", _number(1, 1)),
    ("wall s", "sim.wall_s", _number(1, 2)),
    ("sim s per wall s", "sim.sim_s_per_wall_s", _number(1, 1)),
)


def _class_rows(summaries: Sequence[Summary]) -> list[tuple[str, str, Callable[[object], str]]]:
    """Rows per priority and per tenant, for the classes any of the summaries has."""
    rows: list[tuple[str, str, Callable[[object], str]]] = []
    for key, noun in (("by_priority", "priority"), ("by_tenant", "tenant")):
        names = sorted({name for s in summaries for name in (_get(s, key) or {})})  # type: ignore[attr-defined]
        for name in names:
            rows.append((f"SLO attainment, {noun} {name} (%)", f"{key}.{name}.slo_attainment", _number(100, 1)))
            rows.append((f"TTFT p99, {noun} {name} (ms)", f"{key}.{name}.ttft_s.p99", _number(1000, 1)))
        if key == "by_tenant":
            rows += [(f"service share, tenant {n} (%)", f"fairness.tenants.{n}.share", _number(100, 1)) for n in names]
    return rows


def _rows_present(summaries: Sequence[Summary]) -> list[tuple[str, list[str]]]:
    rows = []
    for label, path, render in [*ROWS, *_class_rows(summaries)]:
        values = [_get(s, path) for s in summaries]
        if all(v is None for v in values):
            continue
        rows.append((label, [render(v) for v in values]))
    return rows


def format_table(summary: Summary, title: str = "") -> str:
    """Return the headline figures of one run as a fixed-width two-column table."""
    return format_compare({title or "value": summary})


def format_compare(summaries: Mapping[str, Summary]) -> str:
    """Return a fixed-width table with one row per figure and one column per configuration."""
    names = list(summaries)
    rows = _rows_present([summaries[n] for n in names])
    label_width = max([len("metric"), *(len(label) for label, _ in rows)])
    widths = [max([len(n), *(len(values[i]) for _, values in rows)]) for i, n in enumerate(names)]
    lines = [
        "  ".join(["metric".ljust(label_width), *(n.rjust(w) for n, w in zip(names, widths, strict=True))])
    ]
    lines.append("  ".join(["-" * label_width, *("-" * w for w in widths)]))
    for label, values in rows:
        cells = (v.rjust(w) for v, w in zip(values, widths, strict=True))
        lines.append("  ".join([label.ljust(label_width), *cells]))
    return "\n".join(lines)


def write_json(summary: object, path: str | Path) -> Path:
    """Write the summary (or a mapping of summaries) as indented JSON; returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return target


def _cdf_plot(plt: object, runs: Mapping[str, Sequence[RequestRecord]], metric: str, target: Path,
              title: str = "", slo_s: float | None = None) -> Path:
    figure = cdf_figure(plt, runs, metric, title, slo_s)
    figure.savefig(target, dpi=110)
    plt.close(figure)  # type: ignore[attr-defined]
    return target


def cdf_figure(plt: object, runs: Mapping[str, Sequence[RequestRecord]], metric: str, title: str = "",
               slo_s: float | None = None) -> Any:
    """Return a matplotlib figure: one CDF line per run, titled, with the SLO as a dashed line."""
    import numpy as np

    figure, axis = plt.subplots(figsize=(7, 4.5))  # type: ignore[attr-defined]
    for name, records in runs.items():
        values = np.sort([v for r in records if r.status == "ok" and (v := getattr(r, metric)) is not None])
        if values.size:
            axis.plot(values * 1000.0, np.arange(1, values.size + 1) / values.size, label=name)
    name = metric.removesuffix("_s").upper()
    if slo_s:
        axis.axvline(slo_s * 1000.0, color="red", linestyle="--", linewidth=1, label=f"SLO {slo_s * 1000:g} ms")
    axis.set_title(f"{name} CDF" + (f": {title}" if title else ""), fontsize=9)
    axis.set_xlabel(f"{name} (ms)")
    axis.set_ylabel("fraction of requests")
    axis.set_xscale("log")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    return figure


_TIMELINE = (
    ("waiting", "queue length"),
    ("running", "running requests"),
    ("kv_used_frac", "KV use (fraction)"),
    ("replicas_ready", "ready replicas"),
)


def _timeline_plot(
    plt: object, series: Mapping[str, Sequence[Sequence[float]]], title: str, target: Path
) -> Path:
    figure, axes = plt.subplots(len(_TIMELINE), 1, figsize=(8, 8), sharex=True)  # type: ignore[attr-defined]
    for axis, (key, label) in zip(axes, _TIMELINE, strict=True):
        points = series.get(key, ())
        axis.plot([p[0] for p in points], [p[1] for p in points], linewidth=0.8)
        axis.set_ylabel(label, fontsize=8)
        axis.grid(True, alpha=0.3)
    axes[0].set_title(title)
    axes[-1].set_xlabel("time (s)")
    figure.tight_layout()
    figure.savefig(target, dpi=110)
    plt.close(figure)  # type: ignore[attr-defined]
    return target


def write_plots(
    runs: Mapping[str, Sequence[RequestRecord]],
    series: Mapping[str, Mapping[str, Sequence[Sequence[float]]]],
    out_dir: str | Path,
    *,
    title: str = "",
    slo: Mapping[str, float] | None = None,
) -> list[Path]:
    """Write latency CDFs over all runs and one timeline per run into `out_dir`; returns the files.

    `runs` maps a configuration name to its records; `series` maps it to its time series
    (keys "waiting", "running", "kv_used_frac", "replicas_ready" as (time, value) pairs). `title`
    names the workload and setup on every CDF; `slo` maps "ttft_s"/"tpot_s" to a target drawn as a line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    files = [
        _cdf_plot(plt, runs, metric, target / f"cdf_{metric.removesuffix('_s')}.png", title,
                  (slo or {}).get(metric))
        for metric in ("ttft_s", "tpot_s", "e2e_s")
    ]
    for name, run_series in series.items():
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
        files.append(_timeline_plot(plt, run_series, name, target / f"timeline_{safe}.png"))
    return files


def records_to_json(records: Sequence[RequestRecord]) -> list[dict[str, object]]:
    """Return the per-request fields a later run's plots overlay (`sluice bench --compare`)."""
    keep = ("request_id", "tenant", "priority", "arrival_s", "first_token_s", "finish_s", "status",
            "input_tokens", "output_tokens")
    return [{key: getattr(record, key) for key in keep} for record in records]


def records_from_json(rows: Sequence[Mapping[str, object]]) -> list[RequestRecord]:
    """Return RequestRecords of `records_to_json` rows (TPOT is recomputed from the times and counts)."""
    names = ("request_id", "tenant", "priority", "arrival_s", "first_token_s", "finish_s", "status",
             "input_tokens", "output_tokens")
    return [RequestRecord(**{key: row[key] for key in names if key in row}) for row in rows]  # type: ignore[arg-type]


def format_capacity(results: Mapping[str, Any], ideal_prefix_hit_rate: float | None = None,
                    compute_bound_rps: float | None = None) -> str:
    """Return a table of capacity searches: the rate at the goal (requests and offered tokens within SLO),
    the request-only rate beside it, the ratio to the round-robin row, the shares at the capacity point,
    p99 TTFT there, prefix hits and, with `compute_bound_rps`, the capacity's share of that bound."""
    names = list(results)
    baseline = next((n for n in names if "round_robin" in n), names[0] if names else "")
    base_rps = results[baseline].capacity_rps if names else 0.0
    width = max([34, *(len(n) for n in names)])
    header = (f"{'configuration':<{width}} {'capacity req/s':>15} {'vs ' + baseline[:14]:>18} {'req-only req/s':>15} "
              f"{'req/tok in SLO':>15} {'p99 TTFT s':>11} {'prefix hits':>12} {'of bound':>9} {'probes':>7}")
    lines = [header, "-" * len(header)]
    for name in names:
        result = results[name]
        ratio = f"{result.capacity_rps / base_rps:.2f}x" if base_rps > 0 else "-"
        bound = "" if result.bracketed else " (unbracketed)"
        p99 = f"{result.p99_ttft_s:.2f}" if result.p99_ttft_s is not None else "-"
        hits = f"{result.prefix_hit_rate:.1%}" if result.prefix_hit_rate is not None else "-"
        alone = result.request_capacity_rps
        alone_text = f"{alone:.2f}" if alone is not None else "-"
        shares = "-"
        if result.attainment is not None:
            tokens = result.token_attainment
            shares = f"{result.attainment:.1%}/{tokens:.1%}" if tokens is not None else f"{result.attainment:.1%}/-"
        of_bound = f"{result.capacity_rps / compute_bound_rps:.1%}" if compute_bound_rps else "-"
        lines.append(f"{name:<{width}} {result.capacity_rps:>15.2f} {ratio:>18} {alone_text:>15} {shares:>15} "
                     f"{p99:>11} {hits:>12} {of_bound:>9} {len(result.probes):>7}{bound}")
    if ideal_prefix_hit_rate is not None and names:
        goal = next(iter(results.values())).goal
        lines.append(f"one infinite prefix cache would hit {ideal_prefix_hit_rate:.1%} of prompt tokens; goal: "
                     f"{goal:.0%} of requests and {goal:.0%} of offered tokens within SLO (refusals are misses)")
    return "\n".join(lines)


_OTHER_ROUTERS = frozenset({"round_robin", "random", "least_loaded", "prefix_only", "dynamo_kv", "llm_d"})
"""Router words of the baselines and the competitors: a `--compare` row naming one is not Sluice's."""
_SCORE_ONLY = ("prefill-weight=", "load-bound=", "on-time", "score")
"""Words that only the score router reads: a competitor given "the same levers" has none of them."""


def _words(name: str) -> frozenset[str]:
    return frozenset(word for word in name.split("+") if word)


def _same_levers(name: str) -> frozenset[str]:
    """Return the words of `dynamo_kv` given the levers of Sluice's row `name` (its router words dropped)."""
    return frozenset({"dynamo_kv", *(w for w in _words(name) if not w.startswith(_SCORE_ONLY))})


def _of_row(bound: float | Mapping[str, float] | None, name: str) -> float | None:
    """A bound given for every row, or per row name (absent: None)."""
    return bound.get(name) if isinstance(bound, Mapping) else bound


def capacity_goal_lines(results: Mapping[str, Any], compute_bound_rps: float | None, *, over_round_robin: float = 2.0,
                        over_same_levers: float = 1.3, bound_share: float = 0.95,
                        fleet_cache_bound_rps: float | Mapping[str, float] | None = None,
                        strict_fleet_bound_rps: float | Mapping[str, float] | None = None,
                        slo_bounds_rps: Mapping[str, float] | None = None) -> list[str]:
    """Return one line per Sluice row (a `--compare` item naming no baseline or competitor router) saying which
    capacity goal it meets: >= `over_round_robin` x the plain round_robin row and >= `over_same_levers` x the
    `dynamo_kv` row given the same levers (its words but the score router's, e.g. `dynamo_kv+budget=slo` for
    `score+prefill-weight=8+budget=slo`), or >= `bound_share` of the compute bound. A comparison whose row was not
    searched is named as missing, never taken as met. With `fleet_cache_bound_rps` (the compute bound when one LRU
    cache of the fleet's KV is all the prefix cache there is; one per row name where the rows' fleets differ, e.g. in
    a host prefix tier) the row's share of it is said too, as information: it is not a strict bound. With
    `strict_fleet_bound_rps` (the same fleet's KV under an eviction rule that knows the future,
    `sluice_tools.sim.bound.optimal_cache_savings`: a strict bound, given where it binds) the share of it is said and
    counts for the verdict like the compute bound's: the bound that binds is the lower of the two. With
    `slo_bounds_rps` (the bounds that serve prefills under the TTFT SLO by name, `pooled` and `partitioned`:
    `sluice_tools.sim.bound`) the row's share of each is said too, as information: they are optimistic but not strict
    (arrival order and least work first are not always the best), so they do not decide the verdict."""
    by_words = {_words(name): result for name, result in results.items()}
    round_robin = by_words.get(frozenset({"round_robin"}))
    lines = []
    for name, result in results.items():
        if _words(name) & _OTHER_ROUTERS:
            continue
        rate = result.capacity_rps
        parts, ratios_met = [], True
        for label, other, need in (("round_robin", round_robin, over_round_robin),
                                   ("+".join(["dynamo_kv", *sorted(_same_levers(name) - {"dynamo_kv"})]),
                                    by_words.get(_same_levers(name)),
                                    over_same_levers)):
            if other is None or other.capacity_rps <= 0:
                parts.append(f"no {label} row")
                ratios_met = False
                continue
            ratio = rate / other.capacity_rps
            ratios_met = ratios_met and ratio >= need
            parts.append(f"{ratio:.2f}x {label} (goal {need:g}x)")
        share = rate / compute_bound_rps if compute_bound_rps else None
        at_bound = share is not None and share >= bound_share
        parts.append(f"{share:.0%} of the compute bound (goal {bound_share:.0%})" if share is not None
                     else "no compute bound")
        fleet_bound = _of_row(fleet_cache_bound_rps, name)
        if fleet_bound:
            parts.append(f"{rate / fleet_bound:.0%} of it with the fleet's KV as one LRU cache")
        strict = _of_row(strict_fleet_bound_rps, name)
        if strict:
            parts.append(f"{rate / strict:.0%} of the strict bound with the fleet's KV (goal {bound_share:.0%})")
            at_bound = at_bound or rate / strict >= bound_share
        for label, bound in (slo_bounds_rps or {}).items():
            if bound > 0:
                parts.append(f"{rate / bound:.0%} of the {label} bound under the TTFT SLO")
        near = f"within {1 - bound_share:.0%} of the compute bound"
        verdict = (f"met (the ratios; {near})" if ratios_met and at_bound else "met (the ratios)" if ratios_met
                   else f"met ({near})" if at_bound else "not met")
        lines.append(f"goal of {name}: {'; '.join(parts)} -> {verdict}")
    return lines


def write_capacity_plot(results: Mapping[str, Any], out_dir: str | Path, title: str = "") -> Path:
    """Write attainment against offered rate, one line per configuration, with the goal; returns the file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(7, 4.5))
    goal = None
    for name, result in results.items():
        points = sorted((p.rate_rps, p.attainment) for p in result.probes)
        line, = axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        tokens = sorted((p.rate_rps, p.token_attainment) for p in result.probes if p.token_attainment is not None)
        if tokens:  # the offered-token share, dashed in the same colour
            axis.plot([p[0] for p in tokens], [p[1] for p in tokens], linestyle="--", marker=".",
                      color=line.get_color(), label=f"{name} (tokens)")
        goal = result.goal
    if goal is not None:
        axis.axhline(goal, color="red", linestyle="--", linewidth=1, label=f"goal {goal:.0%}")
    axis.set_title("SLO attainment vs offered rate" + (f": {title}" if title else ""), fontsize=9)
    axis.set_xlabel("offered rate (req/s)")
    axis.set_ylabel("fraction within SLO (requests; dashed: offered tokens)")
    axis.set_xscale("log")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    path = target / "capacity.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
