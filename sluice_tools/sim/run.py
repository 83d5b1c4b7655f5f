"""One simulation run from configuration to summary (what `sluice sim` and the tests call)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sluice_tools.metrics import FairnessWeights, RequestRecord, prediction_error, summarize
from sluice_tools.sim.cluster import Simulator
from sluice_tools.sim.config import SimConfig
from sluice_tools.sim.fleet import FleetConfig, FleetSimulator
from sluice_tools.workload import WorkloadRequest


@dataclass
class SimResult:
    """The records, time series and summary of one run."""

    config: SimConfig
    records: list[RequestRecord]
    series: dict[str, list[tuple[float, float]]]
    summary: dict[str, object]


def simulate(
    config: SimConfig, requests: Sequence[WorkloadRequest], *, include_series: bool = True,
    fleet: FleetConfig | None = None, progress: Callable[[float], None] | None = None,
) -> SimResult:
    """Run `requests` through a simulated deployment and return its result.

    The summary carries a "ttft_prediction" section (the router's predicted TTFT against the actual
    one, `sluice_tools.metrics.prediction_error`) and a "sim" section: simulated seconds, wall seconds, their ratio, rounds.
    With `fleet`, the planner sizes the fleet (sluice_tools/sim/fleet.py) and the summary has a "fleet"
    section (GPU-seconds, scale events, time to ready, drain durations, migrations); with `fleet` and
    `config.disagg`, the pool planner sizes the prefill and decode pools apart (sluice_tools/sim/disagg_fleet.py)
    and the "fleet" section adds "pools" (per pool: GPU-seconds, scale events, each replica's timeline).
    `progress`, if given, is called with the simulated time once per simulated sample interval.
    Raises ValueError for an unknown model, GPU or a configuration the cores refuse.
    """
    if config.disagg is not None and fleet is not None:
        from sluice_tools.sim.disagg_fleet import DisaggFleetSimulator  # pools sized apart (its own module)
        simulator: Simulator = DisaggFleetSimulator(config, requests, fleet)
    elif config.disagg is not None:
        from sluice_tools.sim.disagg import DisaggSimulator  # the disaggregated deployment (its own module)
        simulator = DisaggSimulator(config, requests)
    else:
        simulator = Simulator(config, requests) if fleet is None else FleetSimulator(config, requests, fleet)
    simulator.on_progress = progress
    records = simulator.run()
    simulated_s = simulator.end_s
    fairness = FairnessWeights(tenant_weights=dict(config.tenant_weights))
    summary = summarize(
        records,
        config.slo_ttft_s,
        config.slo_tpot_s,
        fairness=fairness,
        series=simulator.series,
        replica_stats=simulator.replica_stats(),
        include_series=include_series,
    )
    summary["sim"] = {
        "simulated_s": simulated_s,
        "wall_s": simulator.wall_s,
        "sim_s_per_wall_s": simulated_s / simulator.wall_s if simulator.wall_s > 0 else None,
        "rounds": simulator.rounds,
        "wall_us_per_round": 1e6 * simulator.wall_s / simulator.rounds if simulator.rounds else None,
        "replicas": config.replicas,
        "gpu": config.gpu,
        "model": config.model,
        "policy": config.scheduler.policy.value,
        "router": config.router.policy.value,
        "preemption": config.scheduler.preemption_mode.value,
        "num_blocks_per_replica": simulator.num_blocks,
        "max_model_len": simulator.max_model_len,
        "seed": config.seed,
    }
    stats = simulator.admission.stats(simulated_s)
    summary["admission"] = {
        "reservation": config.admission.reservation.policy.value,
        "ttft_slo_s": config.admission.ttft_slo_s,
        "client_max_tokens": config.client_max_tokens,
        "rejected": dict(stats.rejected),
        "growths": stats.growths,
        "overcommitted_growths": stats.overcommitted_growths,
        "reclaimed_output_tokens": stats.reclaimed_output_tokens,
    }
    summary["ttft_prediction"] = prediction_error(records, simulator.predicted)
    if config.disagg is not None:
        summary["disagg"] = simulator.disagg_report()  # type: ignore[attr-defined]
    if isinstance(simulator, FleetSimulator):
        summary["fleet"] = simulator.report.to_dict()
    return SimResult(config, records, simulator.series, summary)
