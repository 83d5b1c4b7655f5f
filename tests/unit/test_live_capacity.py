"""The pure parts of the live capacity search: probe requests, SLO deadlines, the rate check, configurations."""

from __future__ import annotations

import pytest

from sluice_tools.live_capacity import ProbeLimits, check_rate, configurations, probe_requests, slo_deadline_s
from sluice_tools.stack import StackConfig
from sluice_tools.workload import WorkloadRequest

SLO = (0.5, 0.1)


def _requests(n: int = 10, gap_s: float = 1.0) -> list[WorkloadRequest]:
    """n requests one `gap_s` apart, each sharing block 7 as its prompt's first 16 tokens."""
    return [WorkloadRequest(f"r{i}", i * gap_s, 32, 5, hash_ids=(7,), hash_block_tokens=16, prefix_tokens=16)
            for i in range(n)]


def test_the_deadline_is_the_latest_finish_that_still_meets_the_slo_plus_the_margin() -> None:
    """TTFT target + (outputs - 1) x TPOT target + margin; one output token adds no TPOT time."""
    assert slo_deadline_s(5, 0.5, 0.1, 1.0) == pytest.approx(0.5 + 4 * 0.1 + 1.0)
    assert slo_deadline_s(1, 0.5, 0.1, 0.0) == pytest.approx(0.5)


def test_a_probe_takes_the_same_first_requests_at_every_scale_with_arrivals_compressed() -> None:
    """The cap picks the workload's first N requests whatever the scale; the scale divides the arrival times."""
    limits = ProbeLimits(max_requests=4, min_arrival_s=0)
    slow, fast = probe_requests(_requests(), 1.0, 1, limits, SLO), probe_requests(_requests(), 2.0, 2, limits, SLO)
    assert [r.request_id for r in slow] == [r.request_id for r in fast] == ["r0", "r1", "r2", "r3"]
    assert [r.arrival_s for r in fast] == pytest.approx([r.arrival_s / 2 for r in slow])


def test_the_arrival_window_bounds_a_slow_probe() -> None:
    """At a low scale, requests arriving after `max_arrival_s` are left out."""
    kept = probe_requests(_requests(), 0.5, 1, ProbeLimits(max_arrival_s=5.0), SLO)
    assert [r.arrival_s for r in kept] == [0.0, 2.0, 4.0]


def test_a_short_probe_is_sustained_at_its_rate_for_the_minimum_time() -> None:
    """Requests that would all arrive within 1.5 s repeat, one copy after the other at the same rate (new ids:
    fresh prompts), until arrivals reach min_arrival_s; the arrival window still caps it."""
    kept = probe_requests(_requests(4), 2.0, 1, ProbeLimits(min_arrival_s=5.0), SLO)
    assert [r.arrival_s for r in kept] == pytest.approx([0.5 * i for i in range(10)])
    assert [r.request_id for r in kept[:6]] == ["r0", "r1", "r2", "r3", "r0~1", "r1~1"]
    assert len({r.request_id for r in kept}) == len(kept)
    assert kept[0].prompt_token_ids(256)[16:] != kept[4].prompt_token_ids(256)[16:]
    capped = probe_requests(_requests(4), 2.0, 1, ProbeLimits(min_arrival_s=30.0, max_arrival_s=3.0), SLO)
    assert capped[-1].arrival_s < 3.0 and len(capped) == 6


def test_each_probe_draws_fresh_prompts_with_the_same_sharing() -> None:
    """Two probes send different tokens (no prefix-cache carry-over), yet within a probe the shared block is shared."""
    first, second = (probe_requests(_requests(2), 1.0, n, ProbeLimits(min_arrival_s=0), SLO) for n in (1, 2))
    a, b = (r.prompt_token_ids(256) for r in first)
    assert a[:16] == b[:16] and a[16:] != b[16:], "within a probe the prefix is shared, the rest is not"
    assert first[0].prompt_token_ids(256)[:16] != second[0].prompt_token_ids(256)[:16], "across probes: fresh"
    assert [len(r.prompt_token_ids(256)) for r in second] == [32, 32]


def test_a_workload_deadline_shorter_than_the_slo_bound_is_kept() -> None:
    """A request's own deadline wins when it is shorter; otherwise the SLO bound is its deadline."""
    requests = _requests(2)
    requests[0].deadline_s = 0.2
    kept = probe_requests(requests, 1.0, 1, ProbeLimits(deadline_margin_s=1.0, min_arrival_s=0), SLO)
    assert [r.deadline_s for r in kept] == pytest.approx([0.2, 0.5 + 4 * 0.1 + 1.0])


@pytest.mark.parametrize("requests", [_requests(1), _requests(3, gap_s=0.0)], ids=["one request", "all at once"])
def test_a_workload_without_a_rate_is_refused(requests: list[WorkloadRequest]) -> None:
    """One request, or all arriving at once, leaves no rate to scale: a ValueError naming the need."""
    with pytest.raises(ValueError, match="arrive over time"):
        check_rate(requests, ProbeLimits())


def test_the_rate_is_that_of_the_capped_requests() -> None:
    """The offered rate is measured over the probe's requests, not the whole workload."""
    requests = _requests(4) + [WorkloadRequest("late", 100.0, 8, 1)]
    assert check_rate(requests, ProbeLimits(max_requests=4)) == pytest.approx(1.0)


def test_configurations_set_router_queue_and_replicas() -> None:
    """Comma- or argument-separated items; a router word sets the router's policy, a queue word the schedulers'."""
    configs = configurations(["round_robin,score+priority", "dynamo_kv+replicas=2"], StackConfig())
    assert list(configs) == ["round_robin", "score+priority", "dynamo_kv+replicas=2"]
    assert configs["round_robin"].router_args == ("--policy", "round_robin")
    assert configs["score+priority"].scheduler_args == ("--policy", "priority")
    assert configs["dynamo_kv+replicas=2"].replicas == 2 and configs["round_robin"].replicas == 1


@pytest.mark.parametrize(("item", "message"), [("warp", "unknown word 'warp'"), ("score+replicas=0", "positive")])
def test_a_bad_configuration_is_refused(item: str, message: str) -> None:
    """An unknown word or a non-positive replica count is a ValueError naming it."""
    with pytest.raises(ValueError, match=message):
        configurations([item], StackConfig())


def test_probe_limits_must_be_positive() -> None:
    """A zero request cap or window is refused when the limits are made."""
    with pytest.raises(ValueError, match="positive"):
        ProbeLimits(max_requests=0)
