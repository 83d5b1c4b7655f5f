"""Leaving out the heartbeats that the next tick replaces before any route changes nothing a run reports."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import pytest

from sluice import glue
from sluice_tools.sim.cluster import Simulator
from sluice_tools.sim.config import SimConfig, with_admission
from sluice_tools.workload import load_workload

MIXED = ("synthetic:poisson?rate=40&n=250&input=lognormal:500:0.6:2000&output=lognormal:120:0.6:600"
         "&priority_frac=0.3&deadline_s=6&cancel_frac=0.1&cancel_after_s=1.5&conversations=40")


def _run(config: SimConfig, superseded: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    sim = Simulator(config, load_workload(MIXED, seed=3).requests)
    sim.superseded_heartbeats = superseded
    sent = 0
    send = glue.apply_heartbeat

    def counted(router: Any, report: Any, now: float) -> Any:
        nonlocal sent
        sent += 1
        return send(router, report, now)

    monkeypatch.setattr(glue, "apply_heartbeat", counted)
    records = sim.run()
    rows = [{f.name: getattr(r, f.name) for f in fields(r)} | {"token_times": list(r.token_times or ())}
            for r in records]
    fleet = [(v.spec.replica_id, v.state, v.load, v.inflight, v.indexed_blocks) for v in sim.router.replicas()]
    return {"records": rows, "predicted": sim.predicted, "series": sim.series, "stats": sim.replica_stats(),
            "fleet": fleet, "stale": sim.router.stale_routes, "rounds": sim.rounds, "sent": sent}


@pytest.mark.parametrize("ttft_slo_s", [None, 0.03])
def test_superseded_heartbeats_change_nothing(ttft_slo_s: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Heartbeats every 4 ms against arrivals every ~25 ms, with submit delays (and early refusals that retry):
    every record, prediction, series point and the router's final loads are the same with the superseded
    heartbeats left out as with every heartbeat sent."""
    config = SimConfig(replicas=3, heartbeat_interval_s=0.004, submit_delay_s=0.001, token_delay_s=0.002)
    if ttft_slo_s is not None:
        config = replace(with_admission(config, ttft_slo_s=ttft_slo_s), max_retries=2)
    every = _run(config, False, monkeypatch)
    fewer = _run(config, True, monkeypatch)
    assert fewer["sent"] < every["sent"] * 0.7, "few heartbeats were left out: the test proves nothing"
    if ttft_slo_s is not None:
        assert sum(r["retries"] for r in every["records"]) > 0, "no refusal retried: the test proves nothing"
    for key in every:
        if key != "sent":
            assert fewer[key] == every[key], key
