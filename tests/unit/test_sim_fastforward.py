"""The simulator's fast-forward (steady decode rounds in bulk) changes nothing a run reports."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import pytest

from scheduler_svc.core.config import Policy, PreemptionMode, SchedulerConfig
from sluice import glue
from sluice.types import CoreStats
from sluice_tools.sim import fastforward
from sluice_tools.sim.cluster import Simulator
from sluice_tools.sim.config import SimConfig
from sluice_tools.workload import load_workload, traces_dir

MIXED = ("synthetic:poisson?rate=60&n=300&input=lognormal:500:0.6:2000&output=lognormal:120:0.6:600"
         "&priority_frac=0.3&deadline_s=6&cancel_frac=0.1&cancel_after_s=1.5&conversations=40")

_FAST_FORWARD, _APPLY_HEARTBEAT = fastforward.fast_forward, glue.apply_heartbeat


def _run(config: SimConfig, spec: str, fast: bool, monkeypatch: pytest.MonkeyPatch, seed: int = 5,
         max_requests: int | None = None) -> dict[str, Any]:
    monkeypatch.setenv(fastforward.ENV_SWITCH, "1" if fast else "0")
    requests = load_workload(spec, seed=seed).requests
    if max_requests is not None:
        requests = requests[:max_requests]
    sim = Simulator(config, requests)
    # Each replica's KV events, in the order the router applied them: a run taken in bulk hands its STORED
    # events over in one call (the index reads them only when routing, which ends a run), so the calls
    # and their times differ, not what each replica's stream said.
    kv_seen: dict[str, list[Any]] = {}
    apply = sim.router.apply_kv_events

    def logged(replica_id: str, events: Any, now: float) -> bool:
        kv_seen.setdefault(replica_id, []).extend(events)
        return apply(replica_id, events, now)

    sim.router.apply_kv_events = logged  # type: ignore[method-assign]
    calls = 0
    forward = _FAST_FORWARD

    def counted(*args: Any) -> bool:
        nonlocal calls
        taken = forward(*args)
        calls += taken
        return taken

    monkeypatch.setattr(fastforward, "fast_forward", counted)
    heartbeats: list[tuple[Any, float]] = []
    send = _APPLY_HEARTBEAT

    def heartbeat(router: Any, report: Any, now: float) -> None:
        heartbeats.append((report, now))
        send(router, report, now)

    monkeypatch.setattr(glue, "apply_heartbeat", heartbeat)
    records = sim.run()
    rows = [{**{f.name: getattr(r, f.name) for f in fields(r)}, "token_times": list(r.token_times or ())} for r in records]
    index = sim.router.index.holders()
    return {"records": rows, "kv": kv_seen, "index": index, "stats": sim.replica_stats(), "series": sim.series,
            "rounds": sim.rounds, "end": sim.end_s, "rates": [r.rates for r in sim.replicas],
            "core": [r.core.stats() for r in sim.replicas], "heartbeats": heartbeats, "bulk_calls": calls}


def _same_both_ways(config: SimConfig, spec: str, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> None:
    slow = _run(config, spec, False, monkeypatch, **kw)
    fast = _run(config, spec, True, monkeypatch, **kw)
    assert slow.pop("bulk_calls") == 0
    assert fast.pop("bulk_calls") > 0, "the fast path was never taken: the test proves nothing"
    for key in slow:
        assert fast[key] == slow[key], key


def test_mixed_workload_pipelined_with_delays(monkeypatch: pytest.MonkeyPatch) -> None:
    """Priorities, deadlines, cancels, conversations, delays: every record, token time, KV event, heartbeat and stat is
    the same."""
    config = SimConfig(replicas=3, round_gap_s=0.0007, token_delay_s=0.002, submit_delay_s=0.001,
                       scheduler=SchedulerConfig(num_blocks=0, policy=Policy.PRIORITY))
    _same_both_ways(config, MIXED, monkeypatch)


def test_samples_and_heartbeats_inside_bulk_runs_read_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """With samples and heartbeats every few rounds, the ones that fall inside runs taken in bulk read the
    replicas' blocks and rates as of their time: every series point, heartbeat and record is the same."""
    config = SimConfig(replicas=3, heartbeat_interval_s=0.0131, sample_interval_s=0.0217,
                       scheduler=SchedulerConfig(num_blocks=0, policy=Policy.PRIORITY))
    inside = 0
    load_at = fastforward.load_at

    def counted(replica: Any, now: float) -> Any:
        nonlocal inside
        log = replica.rates_log
        inside += log is not None and now < log.times[-1]  # mid-run: the core is ahead of `now`
        return load_at(replica, now)

    monkeypatch.setattr(fastforward, "load_at", counted)
    _same_both_ways(config, MIXED, monkeypatch)
    assert inside > 100, "no sample or heartbeat fell inside a bulk run: the test proves nothing"


def test_small_pool_preempts_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a pool small enough to preempt (recompute and swap), both ways agree exactly."""
    for mode in (PreemptionMode.RECOMPUTE, PreemptionMode.SWAP):
        config = SimConfig(replicas=2, num_blocks=600, scheduler=SchedulerConfig(num_blocks=0, preemption_mode=mode))
        fast = _run(config, MIXED, True, monkeypatch)
        assert fast["stats"]["preemptions"] > 0
        _same_both_ways(config, MIXED, monkeypatch)


def test_serial_rounds_never_take_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without pipelining the fast path is off, and the run is what it always was."""
    config = SimConfig(replicas=2, pipeline=False)
    slow = _run(config, MIXED, False, monkeypatch)
    fast = _run(config, MIXED, True, monkeypatch)
    assert fast.pop("bulk_calls") == 0
    slow.pop("bulk_calls")
    assert fast == slow


@pytest.mark.skipif(not traces_dir().is_dir(), reason="shared traces directory is missing")
def test_azure_conv_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first 400 requests of the Azure conversation trace on 4 replicas: identical both ways."""
    _same_both_ways(SimConfig(replicas=4), "azure-conv", monkeypatch, max_requests=400)


def test_load_at_blocks_replace_as_dataclasses_does() -> None:
    """`load_at`'s positional copy of CoreStats is `dataclasses.replace` of the three block counts (fails when a
    field is added, moved or renamed)."""
    stats = CoreStats(*range(1, len(fields(CoreStats)) + 1))
    assert fastforward._with_blocks(stats, 100, 200) == replace(stats, kv_blocks_used=stats.kv_blocks_total - 300,
                                                               kv_blocks_free=100, kv_blocks_cached=200)
