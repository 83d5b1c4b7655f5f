"""The Grafana dashboard queries only metrics the services export, lays its panels out without overlap, and has a
fleet row covering every planner metric and every drain, migration and re-route metric."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from planner_svc.driver import PlannerMetrics
from sluice.prom import AdmissionMetrics, RouterMetrics, SchedulerMetrics, WorkerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "sluice-dashboard.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
            "summary": ("_sum", "_count", ""), "info": ("_info",), "unknown": ("",)}
FLEET_ROW = "Fleet: planner, drains, migration"


def families(registry: CollectorRegistry) -> dict[str, str]:
    """Return metric family name -> type of everything a registry declares (labelled families included)."""
    return {metric.name: metric.type for metric in registry.collect()}


def exported() -> dict[str, set[str]]:
    """Return, per service, the sample names its metrics classes export (a counter's `_total`, a histogram's
    `_bucket`...)."""
    registries = {"admission": AdmissionMetrics().registry, "router": RouterMetrics().registry,
                  "scheduler": SchedulerMetrics().registry, "worker": WorkerMetrics().registry,
                  "planner": PlannerMetrics().registry}
    return {service: {name + suffix for name, kind in families(registry).items() for suffix in SUFFIXES[kind]}
            for service, registry in registries.items()}


def panels() -> list[dict[str, Any]]:
    return list(json.loads(DASHBOARD.read_text())["panels"])


def queried(panel: dict[str, Any]) -> set[str]:
    """Return the sluice_*, vllm:* and gen_ai_* sample names a panel's queries read."""
    names = set()
    for target in panel.get("targets", []):
        # Label names (in selectors and by/without clauses) are not metric names: drop those parts first.
        expr = re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", re.sub(r"\{[^}]*\}", "", target["expr"]))
        names |= set(re.findall(r"\b(?:sluice_|gen_ai_)[a-z0-9_]+|\bvllm:[a-z0-9_]+", expr))
    return names


def test_every_query_reads_a_metric_some_service_exports() -> None:
    """A renamed or misspelled metric in a panel would draw an empty graph: every sluice_*, vllm:* and gen_ai_* name
    in every query is a sample some service's metrics class exports."""
    known = set().union(*exported().values())
    unknown = {(p["title"], name) for p in panels() for name in queried(p) if name not in known}
    assert unknown == set()


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    """Ids are unique, every panel fits the 24-column grid, no two panels share a cell, and each query has its
    own refId and the dashboard's datasource variable."""
    cells: dict[tuple[int, int], str] = {}
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids))
    for panel in panels():
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, (panel["title"], cells.get((x, y)))
                cells[(x, y)] = panel["title"]
        refs = [t["refId"] for t in panel.get("targets", [])]
        assert len(refs) == len(set(refs)), panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_the_fleet_row_shows_every_planner_drain_migration_and_reroute_metric() -> None:
    """Below the fleet row, the panels read every family of the planner and every drain, hand-off, migration,
    re-route and unreachable-report family (so a new one there needs a panel)."""
    all_panels = panels()
    row = next(p for p in all_panels if p["type"] == "row" and p["title"] == FLEET_ROW)
    below = set().union(*(queried(p) for p in all_panels if p["gridPos"]["y"] > row["gridPos"]["y"]))
    wanted = dict(families(PlannerMetrics().registry))
    for registry in (AdmissionMetrics().registry, SchedulerMetrics().registry, RouterMetrics().registry):
        wanted |= {name: kind for name, kind in families(registry).items()
                   if re.search(r"migration|reroute|drain|handed_off|unreachable", name)}
    assert {"sluice_admission_reroutes", "sluice_router_unreachable_reports", "sluice_planner_desired_replicas",
            "sluice_admission_migrations", "sluice_replica_drains"} <= set(wanted)
    missing = {name for name, kind in wanted.items() if not {name + suffix for suffix in SUFFIXES[kind]} & below}
    assert missing == set()


def test_vllm_and_gen_ai_panels_filter_by_the_model_and_replica_variables() -> None:
    """The dashboard has `model` and `replica` variables; every vllm:* query filters on both, every gen_ai_* query
    on the model, and there is at least one panel per family."""
    templating = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    assert {"datasource", "model", "replica"} <= set(templating)
    exprs = [t["expr"] for p in panels() for t in p.get("targets", [])]
    vllm = [e for e in exprs if "vllm:" in e]
    gen_ai = [e for e in exprs if "gen_ai_" in e]
    assert len(vllm) >= 8 and len(gen_ai) >= 4
    assert all('model_name=~"$model"' in e and 'instance=~"$replica"' in e for e in vllm), vllm
    assert all('gen_ai_request_model=~"$model"' in e for e in gen_ai), gen_ai
