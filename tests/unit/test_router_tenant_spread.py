"""Tenant spread: each tenant's routed requests split evenly over replicas, so per-replica fair queues add up."""

from __future__ import annotations

from router_svc.core import RouteQuery, RouterConfig, RouterCore
from router_svc.fleet import ReplicaSpec
from sluice.types import KvEvent, KvEventKind, ReplicaLoad


def make_router(spread: int) -> RouterCore:
    router = RouterCore(RouterConfig(tenant_spread=spread))
    for replica_id in ("a", "b"):
        router.register(ReplicaSpec(replica_id, "m", address=f"{replica_id}:1", decode_round_s=0.0), now=0.0)
        router.mark_ready(replica_id, now=0.0)
        router.heartbeat(replica_id, ReplicaLoad(), now=0.0)
    # Replica a holds the shared prefix: a cache hit draws every request there when the spread is off.
    router.apply_kv_events("a", [KvEvent(1, KvEventKind.STORED, (11, 12, 13, 14))], now=0.0)
    return router


def route_all(router: RouterCore, tenant: str, count: int) -> list[str]:
    return [router.route(RouteQuery(f"{tenant}{i}", "m", block_hashes=(11, 12, 13, 14), prompt_tokens=80,
                                    tenant=tenant), now=0.0).replica_id for i in range(count)]


def test_a_tenants_requests_spread_evenly_when_asked() -> None:
    """With --tenant-spread 1, a tenant's outstanding requests never differ by more than one across replicas,
    whatever the prefix hit; other tenants are counted apart."""
    router = make_router(spread=1)
    gold = route_all(router, "gold", 6)
    assert abs(gold.count("a") - gold.count("b")) <= 1
    bronze = route_all(router, "bronze", 4)
    assert abs(bronze.count("a") - bronze.count("b")) <= 1


def test_a_finished_request_frees_its_tenants_count() -> None:
    """on_request_done takes the request off its tenant's count, so the next one may go back there."""
    router = make_router(spread=1)
    first, second = route_all(router, "gold", 2)
    assert {first, second} == {"a", "b"}
    router.on_request_done("b", "gold1" if second == "b" else "gold0", now=0.1)
    replica = router.fleet.get("b")
    assert replica.tenant_inflight.get("gold", 0) == 0 and not replica.inflight_tenants


def test_without_the_spread_the_prefix_hit_decides() -> None:
    """Off (the default), the cached prefix draws a tenant's second request to the same replica; with the spread
    it goes to the other."""
    assert route_all(make_router(spread=0), "gold", 2) == ["a", "a"]
    assert route_all(make_router(spread=1), "gold", 2) == ["a", "b"]
