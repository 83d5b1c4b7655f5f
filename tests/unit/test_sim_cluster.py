"""The simulator: real cores (the very classes the services import), determinism, and request outcomes."""

from __future__ import annotations

import json
from dataclasses import astuple, replace
from pathlib import Path

import pytest

import admission_svc.core
import router_svc.core
import scheduler_svc.core
from router_svc.core import RouterConfig, RoutingPolicy
from scheduler_svc.core.config import Policy
from sluice_tools.cli import main
from sluice_tools.commands.sim import parse_compare_item
from sluice_tools.metrics import RequestRecord
from sluice_tools.sim import SimConfig, Simulator, simulate
from sluice_tools.sim import cluster as sim_cluster
from sluice_tools.sim.config import SCHEDULER, with_tenant_weights
from sluice_tools.workload import WorkloadRequest, load_workload

SMALL = "synthetic:poisson?rate=40&n=120&input=lognormal:600:0.6:3000&output=lognormal:60:0.6:300"


def outcome(records: list[RequestRecord]) -> list[tuple]:
    """Return everything observable about the records, token times included."""
    return [
        (*astuple(r)[:5], r.finish_s, r.status, r.output_tokens, tuple(r.token_times or ())) for r in records
    ]


def test_simulator_uses_the_service_cores_unchanged() -> None:
    """The simulator's scheduler, router and admission are the classes the services import, not copies."""
    assert sim_cluster.SchedulerCore is scheduler_svc.core.SchedulerCore
    assert sim_cluster.RouterCore is router_svc.core.RouterCore
    assert sim_cluster.AdmissionCore is admission_svc.core.AdmissionCore
    simulator = Simulator(SimConfig(replicas=2), [])
    assert all(type(r.core) is scheduler_svc.core.SchedulerCore for r in simulator.replicas)
    assert type(simulator.router) is router_svc.core.RouterCore


def test_tiny_run_through_the_real_cores() -> None:
    """Every request of a small Poisson workload finishes ok with exactly its output length."""
    requests = load_workload(SMALL, seed=1).requests
    result = simulate(SimConfig(replicas=2), requests)
    assert result.summary["counts"]["ok"] == len(requests)  # type: ignore[index]
    by_id = {r.request_id: r for r in result.records}
    for request in requests:
        record = by_id[request.request_id]
        assert record.output_tokens == request.output_length
        assert record.ttft_s is not None and record.ttft_s > 0
        assert len(record.token_times or ()) == request.output_length


def test_same_seed_same_run_and_other_seed_differs() -> None:
    """Two runs with one seed are identical to the token time; the random router with another seed is not."""
    requests = load_workload(SMALL, seed=2).requests
    for router in (RoutingPolicy.SCORE, RoutingPolicy.RANDOM):
        first = simulate(SimConfig(replicas=3, router=RouterConfig(router), seed=5), requests).records
        second = simulate(SimConfig(replicas=3, router=RouterConfig(router), seed=5), requests).records
        assert outcome(first) == outcome(second)
    other = simulate(SimConfig(replicas=3, router=RouterConfig(RoutingPolicy.RANDOM), seed=6), requests).records
    assert [r.replica for r in other] != [r.replica for r in first]


def test_over_long_request_is_rejected_explicitly_not_truncated() -> None:
    """A prompt over max_model_len (8192 for llama-3-8b) is a counted rejection with the numbers."""
    requests = [WorkloadRequest("long", 0.0, 9000, 10), WorkloadRequest("fine", 0.0, 100, 10)]
    records = {r.request_id: r for r in simulate(SimConfig(replicas=1), requests).records}
    assert records["long"].status == "rejected"
    assert "9000" in records["long"].detail and "8192" in records["long"].detail
    assert records["fine"].status == "ok"


def test_cancel_and_deadline_end_requests_early() -> None:
    """cancel_after_s cancels mid-stream and deadline_s times out; both stop short of their output length."""
    requests = [
        WorkloadRequest("c", 0.0, 200, 5000, cancel_after_s=0.5),
        WorkloadRequest("d", 0.0, 200, 5000, deadline_s=0.4),
    ]
    records = {r.request_id: r for r in simulate(SimConfig(replicas=1), requests).records}
    assert records["c"].status == "cancelled" and 0 < records["c"].output_tokens < 5000
    assert records["c"].finish_s is not None and records["c"].finish_s >= 0.5
    assert records["d"].status == "timed_out" and records["d"].output_tokens < 5000


def test_warmup_refuses_until_ready_and_retries_get_through() -> None:
    """Before warm-up ends no replica is READY: a refusal, or with retries, service after warm-up."""
    requests = [WorkloadRequest("early", 0.0, 100, 5)]
    refused = simulate(SimConfig(replicas=1, warmup_s=2.0), requests).records[0]
    assert refused.status == "rejected" and "unavailable" in refused.detail
    retried = simulate(SimConfig(replicas=1, warmup_s=2.0, max_retries=3), requests).records[0]
    assert retried.status == "ok" and retried.retries >= 1
    assert retried.first_token_s is not None and retried.first_token_s >= 2.0


def test_kv_events_reach_the_router_and_prefixes_are_reused() -> None:
    """With shared-prefix groups, the score router sends siblings to the replica holding the prefix."""
    spec = "synthetic:poisson?rate=20&n=80&prefix_groups=2&prefix_len=2048&input=fixed:2300&output=fixed:20"
    requests = load_workload(spec, seed=3).requests
    result = simulate(SimConfig(replicas=4), requests)
    stats = result.summary["replica_stats"]
    assert stats["prefix_hit_rate"] > 0.5  # type: ignore[index]
    assert stats["kv_snapshots"] == 0  # type: ignore[index]
    rr = simulate(SimConfig(replicas=4, router=RouterConfig(RoutingPolicy.ROUND_ROBIN)), requests).summary["replica_stats"]
    assert stats["prefix_hit_rate"] > rr["prefix_hit_rate"]  # type: ignore[index]


def test_cli_sim_writes_json_and_scenario_exit_status(tmp_path: Path, capsys: object) -> None:
    """`sluice sim` prints a comparison, writes JSON per configuration, and a scenario run exits 0."""
    out = tmp_path / "sim.json"
    code = main(
        ["sim", SMALL, "--replicas", "2", "--compare", "fcfs+round_robin,priority+score", "--json", str(out)]
    )
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"fcfs+round_robin", "priority+score"}
    assert runs["priority+score"]["sim"]["policy"] == "priority"
    assert main(["sim", "--scenario", "seed-round-budget"]) == 0
    assert main(["sim", SMALL, "--compare", "fcfs+warp"]) == 2


def test_sim_progress_reports_the_simulated_time_on_stderr_only_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    """`--progress` prints the simulated time against the arrivals' span while a run goes; `--no-progress` prints none."""
    assert main(["sim", SMALL, "--progress"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "simulated" in line and "arrivals'" in line]
    assert lines and lines[0].startswith("  fcfs+score: simulated 0 s of the arrivals'"), lines
    assert main(["sim", SMALL, "--no-progress"]) == 0
    assert "arrivals'" not in capsys.readouterr().err


def test_far_deadlines_do_not_stretch_the_simulated_time() -> None:
    """A long deadline on a request that finishes early does not keep the clock running to it."""
    requests = [WorkloadRequest("a", 0.0, 100, 5, deadline_s=10_000.0)]
    result = simulate(SimConfig(replicas=1), requests)
    assert result.records[0].status == "ok"
    assert result.summary["sim"]["simulated_s"] < 1.0  # type: ignore[index]
    assert max(t for t, _ in result.series["waiting"]) < 2.0


def test_fair_policy_follows_tenant_weights_under_backlog() -> None:
    """With equal demand and weights 3:1, the fair policy's windowed Jain index beats FCFS's."""
    spec = "synthetic:poisson?rate=60&n=600&tenants=a:1,b:1&tenant_weights=a:3,b:1&input=fixed:800&output=fixed:100"
    workload = load_workload(spec, seed=4)
    jain = {}
    for policy in (Policy.FCFS, Policy.FAIR):
        config = with_tenant_weights(SimConfig(replicas=1, scheduler=replace(SCHEDULER, policy=policy)),
                                     workload.tenant_weights)
        summary = simulate(config, workload.requests).summary
        jain[policy] = summary["fairness"]["windowed_jain_index"]  # type: ignore[index]
    assert jain[Policy.FAIR] > jain[Policy.FCFS] + 0.02


def test_compare_admission_words_set_that_items_budget_only() -> None:
    """`max-queued=N` (or another setting word) in a --compare item changes that item only; a bad value is a clear error."""
    base = SimConfig()
    shed = parse_compare_item("fcfs+score+max-queued=32", base)
    assert shed.admission.budgets.max_queue_length == 32 and base.admission.budgets.max_queue_length == 100_000
    assert parse_compare_item("max-active=7", base).admission.budgets.max_active_requests == 7
    assert parse_compare_item("score+prefill-weight=2.5", base).router.prefill_weight == 2.5
    with pytest.raises(ValueError, match="positive int"):
        parse_compare_item("max-queued=zero", base)
    with pytest.raises(ValueError, match="unknown setting"):
        parse_compare_item("max-tokens=3", base)


def test_tenant_weights_reach_the_simulated_schedulers_on_each_request() -> None:
    """Tenants weighted 2:1 in admission's tenants, both backlogged (2-8 s of a 10 s overload), get weighted service within 5% of 2:1."""
    spec = "synthetic:poisson?rate=120&n=1200&tenants=a:1,b:1&tenant_weights=a:2,b:1&input=fixed:800&output=fixed:100"
    workload = load_workload(spec, seed=4)
    config = with_tenant_weights(SimConfig(replicas=1, scheduler=replace(SCHEDULER, policy=Policy.FAIR)),
                                 workload.tenant_weights)
    assert config.scheduler_config(64, 0, 4096).tenant_weights == (), "weights travel on the requests, as in production"
    served: dict[str, float] = {"a": 0.0, "b": 0.0}
    for record in simulate(config, workload.requests).records:
        served[record.tenant] += 2 * sum(1 for t in record.token_times or () if 2.0 <= t < 8.0)
        if record.first_token_s is not None and 2.0 <= record.first_token_s < 8.0:
            served[record.tenant] += record.input_tokens
    ratio = served["a"] / served["b"]
    assert abs(ratio - 2.0) / 2.0 < 0.05, f"a/b = {ratio:.3f}"  # 0.98 when the weight is not sent
