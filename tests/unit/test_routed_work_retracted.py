"""Routing work that did not happen is taken back: a request refused (or ended) before the next heartbeat
returns its uncached prompt tokens to the router at once, in the pure core and in the simulator."""

from __future__ import annotations

import pytest

from router_svc.core import ReplicaLoad, ReplicaSpec, RouteQuery, RouterConfig, RouterCore
from sluice_tools.commands.sim import parse_compare_item
from sluice_tools.sim import SimConfig, Simulator
from sluice_tools.workload import WorkloadRequest


def make_router(*ids: str) -> RouterCore:
    router = RouterCore(RouterConfig())
    for replica_id in ids:
        router.register(ReplicaSpec(replica_id, "m", prefill_tokens_per_s=10_000.0, decode_round_s=0.0), now=0.0)
        router.mark_ready(replica_id, now=0.0)
    return router


def test_a_request_done_before_the_next_heartbeat_takes_its_unreported_tokens_back() -> None:
    """Routing 4,000 uncached tokens raises the next prediction by 0.4 s; forgetting that request restores
    the prediction exactly, while a sibling routed with it keeps its own tokens counted."""
    router = make_router("a")
    idle = router.route(RouteQuery("probe", "m", prompt_tokens=1000), now=0.0).predicted_ttft_s
    router.on_request_done("a", "probe", now=0.0)
    router.route(RouteQuery("big", "m", prompt_tokens=4000), now=0.0)
    router.route(RouteQuery("sibling", "m", prompt_tokens=2000), now=0.0)
    router.on_request_done("a", "big", now=0.0)  # refused after routing: admission's REJECTED completion
    replica = router.fleet.get("a")
    assert replica.unreported_tokens == 2000
    router.on_request_done("a", "sibling", now=0.0)
    router.on_request_done("a", "sibling", now=0.0)  # a redelivered completion takes nothing twice
    assert replica.unreported_tokens == 0 and not replica.unreported
    assert router.route(RouteQuery("next", "m", prompt_tokens=1000), now=0.0).predicted_ttft_s == pytest.approx(idle)


def test_a_request_reported_by_a_heartbeat_is_not_taken_back_twice() -> None:
    """After a heartbeat the replica's report holds the work: a request done later does not subtract it
    again from the work routed since (no negative or missing queue)."""
    router = make_router("a")
    router.route(RouteQuery("early", "m", prompt_tokens=3000), now=0.0)
    router.heartbeat("a", ReplicaLoad(waiting=1, queued_prefill_tokens=3000), now=0.05)
    router.route(RouteQuery("late", "m", prompt_tokens=500), now=0.06)
    router.on_request_done("a", "early", now=0.07)
    assert router.fleet.get("a").unreported_tokens == 500


def _request(index: int, arrival_s: float, input_length: int) -> WorkloadRequest:
    return WorkloadRequest(f"r{index}", arrival_s, input_length, 8)


def test_early_refusals_on_an_idle_fleet_do_not_make_later_requests_refused() -> None:
    """Thirty prompts whose own prefill exceeds a 0.1 s TTFT SLO are refused on an idle 2-replica fleet; the short ones
    that arrive after them, spaced out, are all admitted, and the router ends holding no unreported work
    (the bug: each refusal left its tokens on an idle replica, whose skipped heartbeats never reset them,
    so every later request was predicted late and refused)."""
    long_ones = [_request(i, 0.2 + 0.01 * i, 6_000) for i in range(30)]
    short_ones = [_request(100 + i, 2.0 + 0.5 * i, 300) for i in range(10)]
    config = parse_compare_item("early-refusal", SimConfig(replicas=2, slo_ttft_s=0.1))
    simulator = Simulator(config, long_ones + short_ones)
    records = {r.request_id: r for r in simulator.run()}
    assert all(records[r.request_id].status == "rejected" for r in long_ones)
    assert [records[r.request_id].status for r in short_ones] == ["ok"] * len(short_ones)
    assert all(r.unreported_tokens == 0 and not r.unreported for r in simulator.router.fleet._replicas.values())


def test_a_dry_run_route_predicts_the_same_choice_and_records_nothing() -> None:
    """A dry run (a probe, or an operator asking where a request would go) answers what a route would, but
    leaves no in-flight request, no unreported work and no predicted blocks: fifty probes in a row do not move
    the next real request's prediction or choice (the bug they caught: a test's probes weighed on the replica
    they probed until the real request went elsewhere)."""
    router = make_router("a", "b")
    router.heartbeat("b", ReplicaLoad(waiting=1, queued_prefill_tokens=500), now=0.0)  # "a" wins, but not by much
    hashes = (11, 12, 13)
    probe = RouteQuery("probe", "m", block_hashes=hashes, prompt_tokens=1000, dry_run=True)
    first = router.route(probe, now=0.0)
    for _ in range(50):
        assert router.route(probe, now=0.0) == first
    assert all(not r.inflight and not r.unreported and r.unreported_tokens == 0 and not r.routed_at
               for r in router.fleet._replicas.values())
    assert router.cached_blocks(first.replica_id, hashes, now=0.0) == 0  # nothing predicted from a probe
    real = router.route(RouteQuery("real", "m", block_hashes=hashes, prompt_tokens=1000), now=0.0)
    assert (real.replica_id, real.predicted_ttft_s) == (first.replica_id, first.predicted_ttft_s)
    assert router.fleet.get(real.replica_id).inflight == {"real": 1000}
    assert router.cached_blocks(real.replica_id, hashes, now=0.0) == 3


def test_an_idle_report_forgets_requests_routed_long_before_and_only_those() -> None:
    """A request whose caller died between Route and Submit never reaches the replica: the first heartbeat that
    reports the replica idle over a heartbeat timeout after the route forgets it, so it stops counting as load.
    A busy report, or an idle one within the grace (the Submit may still be on its way), keeps it."""
    router = make_router("a")
    timeout = router.config.heartbeat_timeout_s
    router.route(RouteQuery("orphan", "m", prompt_tokens=1000), now=0.0)
    router.route(RouteQuery("recent", "m", prompt_tokens=1000), now=timeout)
    replica = router.fleet.get("a")
    router.heartbeat("a", ReplicaLoad(waiting=1), now=timeout + 1)  # busy: it may hold both
    assert set(replica.inflight) == {"orphan", "recent"}
    router.heartbeat("a", ReplicaLoad(), now=timeout + 1)  # idle, but "recent" is within the grace
    assert set(replica.inflight) == {"recent"} and set(replica.routed_at) == {"recent"}
    assert router.stale_routes == 1
    router.on_request_done("a", "orphan", now=timeout + 2)  # a completion that comes after all changes nothing
    assert set(replica.inflight) == {"recent"} and router.stale_routes == 1


def _cached_on(router: RouterCore, hashes: tuple[int, ...], now: float) -> dict[str, int]:
    return {view.spec.replica_id: router.cached_blocks(view.spec.replica_id, hashes, now) for view in router.replicas()}


def test_a_refused_request_takes_its_predicted_blocks_back_a_finished_one_does_not() -> None:
    """Routing counts a prompt's blocks as held by its replica for the prediction's TTL. A REJECTED request
    (`ran=False`: refused after routing, nothing computed) takes that back at once, so a sibling is not drawn to a
    cache that does not exist; a sibling routed there with the same prefix keeps the blocks predicted; a request
    that ran (finished) leaves its prediction to expire (its KV events confirm or remove the blocks)."""
    router = make_router("a", "b")
    hashes = (11, 12, 13, 14)
    first = router.route(RouteQuery("first", "m", prompt_tokens=64, block_hashes=hashes), now=0.0)
    home = first.replica_id
    assert _cached_on(router, hashes, 0.1)[home] == 4
    router.on_request_done(home, "first", now=0.1, ran=False)
    assert _cached_on(router, hashes, 0.1) == {"a": 0, "b": 0}
    assert not router.fleet.get(home).cache.predicted

    # Siblings on one replica: refusing one of them keeps the other's prediction, whichever was routed last.
    router = make_router("a")
    router.route(RouteQuery("one", "m", prompt_tokens=64, block_hashes=hashes), now=0.2)
    assert router.route(RouteQuery("two", "m", prompt_tokens=64, block_hashes=hashes[:2]), now=0.3).cached_blocks == 2
    router.on_request_done("a", "two", now=0.4, ran=False)
    assert _cached_on(router, hashes, 0.4) == {"a": 4}
    router.on_request_done("a", "one", now=0.4, ran=False)
    assert _cached_on(router, hashes, 0.4) == {"a": 0}

    router.route(RouteQuery("three", "m", prompt_tokens=64, block_hashes=hashes[:2]), now=0.5)
    assert router.route(RouteQuery("four", "m", prompt_tokens=64, block_hashes=hashes), now=0.6).cached_blocks == 2
    router.on_request_done("a", "four", now=0.7, ran=False)  # the later, longer one goes; the shorter one stays
    assert _cached_on(router, hashes, 0.7) == {"a": 2}

    router.on_request_done("a", "three", now=0.8)  # it ran: the prediction stands until it expires
    assert _cached_on(router, hashes, 0.8) == {"a": 2}
    router.on_request_done("a", "three", now=0.8, ran=False)  # a late duplicate changes nothing
    assert _cached_on(router, hashes, 0.8) == {"a": 2}
    assert not router.fleet.get("a").predictions
    router.index.prune(10.0)
    assert _cached_on(router, hashes, 10.0) == {"a": 0} and not router.fleet.get("a").cache.predicted
