"""The simulator feeds the real admission core as the front door does: reservation policies under a KV-block
budget, growth and learning, and the early TTFT refusal after routing."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sluice.config import ReservationPolicy
from sluice_tools.commands.sim import parse_compare_item
from sluice_tools.sim import SimConfig, Simulator, simulate
from sluice_tools.workload import load_workload

STEADY = "synthetic:poisson?rate=40&n=300&input=lognormal:600:0.6:3000&output=lognormal:60:0.6:300"
OVERLOAD = "synthetic:poisson?rate=400&n=400&input=lognormal:1500:0.4:4000&output=lognormal:40:0.5:200"


def test_compare_words_set_the_admission_policy_budgets_and_refusal() -> None:
    """`reserve=`, `max-kv-blocks=`, `client-max-tokens=`, `num-blocks=` and `early-refusal` change what they name."""
    base = SimConfig(replicas=2, slo_ttft_s=0.7)
    config = parse_compare_item("reserve=predicted+max-kv-blocks=900+client-max-tokens=4000+num-blocks=512"
                                "+early-refusal", base)
    assert config.admission.reservation.policy is ReservationPolicy.PREDICTED
    assert config.admission.budgets.max_reserved_kv_blocks == 900
    assert (config.client_max_tokens, config.num_blocks, config.admission.ttft_slo_s) == (4000, 512, 0.7)
    assert parse_compare_item("ttft-slo-ms=250", base).admission.ttft_slo_s == 0.25


def test_predicted_reservation_admits_more_than_conservative_under_a_kv_block_budget() -> None:
    """Clients asking 4000 max_tokens for ~60-token answers: under the same KV-block budget the conservative
    policy refuses requests the predicted one admits (it learns the lengths and grows the few long ones),
    and both ledgers end empty."""
    requests = load_workload(STEADY, seed=3).requests
    base = parse_compare_item("max-kv-blocks=3000+client-max-tokens=4000", SimConfig(replicas=2))
    rejected = {}
    for policy in ReservationPolicy:
        config = parse_compare_item(f"reserve={policy.value}", base)
        simulator = Simulator(replace(config, admission=replace(config.admission, reservation=replace(
            config.admission.reservation, min_samples=20))), requests)
        records = simulator.run()
        rejected[policy] = sum(r.status == "rejected" for r in records)
        stats = simulator.admission.stats(simulator.now)
        assert (stats.active, stats.reserved_output_tokens, stats.reserved_kv_blocks) == (0, 0, 0)
        if policy is ReservationPolicy.PREDICTED:
            assert stats.growths > 0 and stats.reclaimed_output_tokens > 0
    assert rejected[ReservationPolicy.CONSERVATIVE] > 2 * rejected[ReservationPolicy.PREDICTED]


def test_early_refusal_keeps_admitted_ttft_near_the_slo_under_overload() -> None:
    """At a rate one replica cannot serve, admission without the refusal keeps everyone waiting; with it,
    requests predicted to miss the TTFT SLO are refused (RetryInfo from the excess) and the admitted p99
    TTFT drops by a large factor."""
    requests = load_workload(OVERLOAD, seed=4).requests
    base = SimConfig(replicas=1, slo_ttft_s=1.0)
    waiting = simulate(base, requests, include_series=False).summary
    refusing = simulate(parse_compare_item("early-refusal", base), requests, include_series=False).summary
    assert waiting["counts"]["rejected"] == 0  # type: ignore[index]
    assert refusing["counts"]["rejected"] > 0  # type: ignore[index]
    assert refusing["admission"]["rejected"]["ttft_slo"] == refusing["counts"]["rejected"]  # type: ignore[index]
    assert refusing["ttft_s"]["p99"] < waiting["ttft_s"]["p99"] / 3  # type: ignore[index]


def test_refusing_at_a_share_of_the_slo_leaves_fewer_admitted_requests_late() -> None:
    """`early-refusal=0.9` refuses past 0.9 x the TTFT SLO (values outside (0, 1] are refused, naming the word).
    The prediction errs low (a request predicted just within the SLO is often late, and delays the ones after it),
    so under the same overload it refuses about as many requests while several times fewer of those it admits
    are late, and more meet the SLO."""
    base = SimConfig(replicas=1, slo_ttft_s=1.0)
    assert parse_compare_item("early-refusal=0.9", base).admission.ttft_slo_s == 0.9
    for bad in ("0", "1.5", "nan", "x", ""):
        with pytest.raises(ValueError, match=r"early-refusal=F needs F in \(0, 1\]"):
            parse_compare_item(f"score+early-refusal={bad}", base)
    requests = load_workload(OVERLOAD, seed=4).requests
    runs = {word: simulate(parse_compare_item(word, base), requests, include_series=False)
            for word in ("early-refusal", "early-refusal=0.9")}
    late = {word: sum(r.status == "ok" and r.ttft_s > 1.0 for r in run.records) for word, run in runs.items()}
    refused = {word: run.summary["counts"]["rejected"] for word, run in runs.items()}  # type: ignore[index]
    assert late["early-refusal=0.9"] * 3 < late["early-refusal"]
    assert abs(refused["early-refusal=0.9"] - refused["early-refusal"]) <= 0.05 * refused["early-refusal"]
    assert runs["early-refusal=0.9"].summary["slo_attainment"] > runs["early-refusal"].summary["slo_attainment"]
