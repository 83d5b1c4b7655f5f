"""Figures, table and plots of `make bench-peers` (pure but for `write_outputs`).

Per run: `sluice_tools.metrics.summarize` of the client's records, plus what only the engines and the front
end's processes know: the prefix-cache hit rate (growth of `vllm:prefix_cache_hits_total` over growth of
`vllm:prefix_cache_queries_total`, both in tokens, summed over engines), the tokens each engine processed
(prompt + generated; its share is the load balance) and the front end's CPU seconds per request and per
streamed token (utime+stime of its processes and their children, from /proc/PID/stat).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from sluice_tools.metrics import RequestRecord
from sluice_tools.report import cdf_figure, records_from_json, records_to_json, write_json


def _ms(value: object) -> float | None:
    return None if value is None else round(float(value) * 1000.0, 1)  # type: ignore[arg-type]


def engine_figures(deltas: Sequence[Mapping[str, float]]) -> dict[str, object]:
    """Return the prefix-cache hit rate over all engines and the tokens (and share) per engine."""
    queries = sum(d.get("vllm:prefix_cache_queries_total", 0.0) for d in deltas)
    hits = sum(d.get("vllm:prefix_cache_hits_total", 0.0) for d in deltas)
    tokens = [d.get("vllm:prompt_tokens_total", 0.0) + d.get("vllm:generation_tokens_total", 0.0) for d in deltas]
    total = sum(tokens)
    return {
        "prefix_cache_hit_rate": hits / queries if queries else None,
        "prefix_cache_hits_tokens": hits,
        "prefix_cache_queries_tokens": queries,
        "tokens_per_engine": tokens,
        "token_share_per_engine": [t / total if total else None for t in tokens],
        "preemptions": sum(d.get("vllm:num_preemptions_total", 0.0) for d in deltas),
        "engine_deltas": [dict(d) for d in deltas],
    }


def failures(records: Sequence[RequestRecord]) -> dict[str, object]:
    """Return refused (explicit HTTP status) and failed/timed-out (no explicit status) counts with examples."""
    out: dict[str, object] = {}
    for status, explicit in (("rejected", True), ("failed", False), ("timed_out", False)):
        bad = [r for r in records if r.status == status]
        out[status] = {"count": len(bad), "explicit": explicit, "examples": sorted({r.detail for r in bad})[:3]}
    return out


def tenant_figures(records: Sequence[RequestRecord], window_end_s: float) -> dict[str, object]:
    """Return, per tenant, the tokens streamed by `window_end_s` (the last arrival: both tenants still
    backlogged), TTFT p50/p99 over every request that streamed a first token, and how many never did; plus the
    first tenant's served tokens over the second's (`served_ratio`, tenants in order of appearance)."""
    tenants: dict[str, list[RequestRecord]] = {}
    for record in records:
        tenants.setdefault(record.tenant, []).append(record)
    out: dict[str, object] = {"window_end_s": window_end_s}
    served = []
    for tenant, group in tenants.items():
        ttfts = sorted(r.first_token_s - r.arrival_s for r in group if r.first_token_s is not None)
        tokens = sum(sum(1 for t in (r.token_times or ()) if t <= window_end_s) for r in group)
        served.append(tokens)
        out[tenant] = {"requests": len(group), "served_tokens_in_window": tokens,
                       "ttft_p50_ms": _ms(_quantile(ttfts, 0.50)), "ttft_p99_ms": _ms(_quantile(ttfts, 0.99)),
                       "no_first_token": sum(1 for r in group if r.first_token_s is None),
                       "ok": sum(1 for r in group if r.status == "ok")}
    out["tenants"] = list(tenants)
    out["served_ratio"] = served[0] / served[1] if len(served) == 2 and served[1] else None
    return out


def _quantile(ordered: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile of an ascending list (None when empty)."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))]


def best_sluice(runs: Sequence[Mapping[str, object]], configs: Sequence[str]) -> dict[str, str]:
    """Return, per workload, the Sluice configuration of `configs` with the highest goodput summed over its near
    and over runs (the loads the goal is about)."""
    totals: dict[str, dict[str, float]] = {}
    for run in runs:
        if run["front"] in configs and run["load"] in ("near", "over"):
            per = totals.setdefault(str(run["workload"]), {})
            per[str(run["front"])] = per.get(str(run["front"]), 0.0) + float(run["headline"]["goodput_rps"] or 0.0)  # type: ignore[index]
    return {workload: max(per, key=lambda name: per[name]) for workload, per in totals.items()}


def sluice_best_rows(runs: Sequence[Mapping[str, object]], best: Mapping[str, str]) -> list[dict[str, object]]:
    """Return a `sluice_best` copy of each run of the configuration `best` names for its workload."""
    return [{**run, "front": "sluice_best", "config": run["front"]} for run in runs
            if best.get(str(run["workload"])) == run["front"]]


def format_tenants(runs: Sequence[Mapping[str, object]]) -> str:
    """Return the fairness cell's rows as a Markdown table ("" without one)."""
    rows = [r for r in runs if r.get("tenants")]
    if not rows:
        return ""
    keys = ("front end", "gold:bronze served tokens", "gold TTFT p99 ms", "bronze TTFT p99 ms", "gold TTFT p50 ms",
            "bronze TTFT p50 ms", "no first token gold/bronze", "ok gold/bronze")
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for run in rows:
        t = run["tenants"]
        gold, bronze = t.get("gold", {}), t.get("bronze", {})  # type: ignore[attr-defined]
        cells = (run["front"], t.get("served_ratio"), gold.get("ttft_p99_ms"), bronze.get("ttft_p99_ms"),  # type: ignore[attr-defined]
                 gold.get("ttft_p50_ms"), bronze.get("ttft_p50_ms"),
                 f"{gold.get('no_first_token')}/{bronze.get('no_first_token')}", f"{gold.get('ok')}/{bronze.get('ok')}")
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def run_summary(summary: dict[str, object], records: Sequence[RequestRecord], deltas: Sequence[Mapping[str, float]],
                cpu_s: float, has_process: bool) -> dict[str, object]:
    """Return the run's summary with engine figures, failures, front-end CPU and a flat `headline`."""
    streamed = sum(r.output_tokens for r in records if r.status == "ok")
    engines = engine_figures(deltas)
    cpu = {
        "seconds": cpu_s if has_process else None,
        "ms_per_request": cpu_s * 1000.0 / len(records) if has_process and records else None,
        "us_per_streamed_token": cpu_s * 1e6 / streamed if has_process and streamed else None,
    }
    ttft, itl, e2e, tpot = summary["ttft_s"], summary["itl_s"], summary["e2e_s"], summary["tpot_s"]
    counts = summary["counts"]
    headline = {
        "ok": counts["ok"],  # type: ignore[index]
        "refused": counts["rejected"],  # type: ignore[index]
        "failed": counts["failed"] + counts["timed_out"],  # type: ignore[index]
        "ttft_p50_ms": _ms(ttft["p50"]), "ttft_p99_ms": _ms(ttft["p99"]),  # type: ignore[index]
        "itl_p50_ms": _ms(itl["p50"]), "itl_p99_ms": _ms(itl["p99"]),  # type: ignore[index]
        "tpot_p50_ms": _ms(tpot["p50"]), "tpot_p99_ms": _ms(tpot["p99"]),  # type: ignore[index]
        "e2e_p99_ms": _ms(e2e["p99"]),  # type: ignore[index]
        "goodput_rps": round(float(summary["goodput_rps"]), 3),  # type: ignore[arg-type]
        "slo_attainment": round(float(summary["slo_attainment"]), 3),  # type: ignore[arg-type]
        "prefix_hit_rate": engines["prefix_cache_hit_rate"],
        "token_share": engines["token_share_per_engine"],
        "cpu_ms_per_request": cpu["ms_per_request"],
        "cpu_us_per_token": cpu["us_per_streamed_token"],
        "host_load_1min": (summary.get("machine_load_1min") or {}).get("after"),  # type: ignore[attr-defined]
    }
    return {**summary, "engines": engines, "failures": failures(records), "front_cpu": cpu, "headline": headline}


COLUMNS = (
    ("workload", "workload"), ("load", "load"), ("rate_rps", "req/s"), ("front", "front end"), ("ok", "ok"),
    ("refused", "refused"), ("failed", "failed"), ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"),
    ("itl_p50_ms", "ITL p50 ms"), ("itl_p99_ms", "ITL p99 ms"), ("tpot_p99_ms", "TPOT p99 ms"), ("e2e_p99_ms", "E2E p99 ms"),
    ("goodput_rps", "goodput req/s"), ("prefix_hit_rate", "prefix hit"), ("token_share", "token share"),
    ("cpu_ms_per_request", "CPU ms/req"), ("cpu_us_per_token", "CPU µs/token"), ("host_load_1min", "host load"),
)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return "/".join(_cell(v) for v in value)
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def format_table(runs: Sequence[Mapping[str, object]]) -> str:
    """Return one Markdown table, a row per (workload, load, front end)."""
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for run in runs:
        flat = {**run, **run["headline"]}  # type: ignore[dict-item]
        lines.append("| " + " | ".join(_cell(flat.get(key)) for key, _ in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def versus_best_peer(runs: Sequence[Mapping[str, object]], ours: Sequence[str]) -> list[dict[str, object]]:
    """Return, per (workload, load) and front end of `ours`, its goodput over the best peer's goodput and its
    TTFT p99 over the best (lowest) peer TTFT p99, naming those peers (the peers: every other front end)."""
    cells: dict[tuple[str, str], list[Mapping[str, object]]] = {}
    for run in runs:
        cells.setdefault((str(run["workload"]), str(run["load"])), []).append(run)
    out = []
    for (workload, load), group in cells.items():
        peers = [r for r in group if r["front"] not in ours]
        good = [r for r in peers if r["headline"]["goodput_rps"] is not None]  # type: ignore[index]
        fast = [r for r in peers if r["headline"]["ttft_p99_ms"] is not None]  # type: ignore[index]
        if not good or not fast:
            continue
        best_good = max(good, key=lambda r: r["headline"]["goodput_rps"])  # type: ignore[index]
        best_fast = min(fast, key=lambda r: r["headline"]["ttft_p99_ms"])  # type: ignore[index]
        for run in (r for r in group if r["front"] in ours):
            head, bg, bf = run["headline"], best_good["headline"], best_fast["headline"]
            out.append({
                "workload": workload, "load": load, "front": run["front"],
                "best_goodput_peer": best_good["front"], "goodput_ratio":
                    head["goodput_rps"] / bg["goodput_rps"] if bg["goodput_rps"] else None,  # type: ignore[index,operator]
                "best_ttft_p99_peer": best_fast["front"], "ttft_p99_ratio":
                    head["ttft_p99_ms"] / bf["ttft_p99_ms"] if head["ttft_p99_ms"] and bf["ttft_p99_ms"] else None,  # type: ignore[index,operator]
            })
    return out


def format_versus(rows: Sequence[Mapping[str, object]]) -> str:
    """Return the ratios of `versus_best_peer` as a Markdown table ("" without rows)."""
    if not rows:
        return ""
    keys = ("workload", "load", "front", "goodput_ratio", "best_goodput_peer", "ttft_p99_ratio", "best_ttft_p99_peer")
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(row[k]) for k in keys) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_outputs(results: Mapping[str, object], records: Mapping[tuple[str, str], Mapping[str, Sequence[RequestRecord]]],
                  out: Path, slo_ttft_s: float, plots: bool = True) -> None:
    """Write OUT/results.json, OUT/records.json, OUT/table.md and (with `plots`, when matplotlib is there) one
    TTFT CDF per (workload, load)."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(results, out / "results.json")
    write_json({f"{w}|{load}": {front: records_to_json(recs) for front, recs in runs.items()}
                for (w, load), runs in records.items()}, out / "records.json")
    versus = results.get("sluice_vs_best_peer") or []
    runs = results["runs"]
    (out / "table.md").write_text(format_table(runs) + "\n" + format_versus(versus) + "\n"  # type: ignore[arg-type]
                                  + format_tenants(runs))  # type: ignore[arg-type]
    if not plots:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    for (workload, load), runs in records.items():
        figure = cdf_figure(plt, runs, "ttft_s", f"{workload}, {load} load", slo_ttft_s)
        figure.savefig(out / f"ttft_cdf_{workload}_{load}.png", dpi=110)
        plt.close(figure)


def read_outputs(out: Path) -> tuple[dict[str, object], dict[tuple[str, str], dict[str, list[RequestRecord]]]]:
    """Return the results and per-request records an earlier run wrote to OUT (for `--include`)."""
    results = json.loads((out / "results.json").read_text())
    raw = json.loads((out / "records.json").read_text())
    records = {}
    for key, runs in raw.items():
        workload, load = key.split("|", 1)
        records[(workload, load)] = {front: records_from_json(rows) for front, rows in runs.items()}
    return results, records
