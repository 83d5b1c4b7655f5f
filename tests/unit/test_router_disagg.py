"""The router's prefill/decode pairs (router_svc.disagg): roles, the prefill rule, the decode rule, claims."""

from __future__ import annotations

import pytest

from router_svc.convert import replica_to_proto, spec_from_proto
from router_svc.core import NoReplicaAvailable, ReplicaLoad, ReplicaSpec, RouteQuery, RouterConfig, RouterCore
from router_svc.disagg import DisaggRouter, is_disaggregated
from sluice.convert import role_from_proto
from sluice.hashing import hash_chain, salt_of
from sluice.types import KvEvent, KvEventKind, ReplicaRole
from sluice.v1 import router_pb2

SALT = salt_of("m")


def make_pairs(roles: dict[str, ReplicaRole], num_blocks: int = 1000) -> DisaggRouter:
    core = RouterCore(RouterConfig())
    for replica_id, role in roles.items():
        core.register(ReplicaSpec(replica_id, "m", address=f"{replica_id}:1", num_blocks=num_blocks,
                                  prefill_tokens_per_s=10_000.0, decode_round_s=0.0, role=role), now=0.0)
        core.mark_ready(replica_id, now=0.0)
        core.heartbeat(replica_id, ReplicaLoad(kv_blocks_free=num_blocks), now=0.0)
    return DisaggRouter(core)


def query(request_id: str, tokens: int = 160, max_tokens: int = 16, first: int = 0) -> RouteQuery:
    prompt = list(range(first, first + tokens))
    return RouteQuery(request_id, "m", block_hashes=tuple(hash_chain(prompt, 16, SALT)), prompt_tokens=tokens,
                      max_tokens=max_tokens)


P, D, B = ReplicaRole.PREFILL, ReplicaRole.DECODE, ReplicaRole.BOTH


def test_prefill_goes_to_a_prefill_replica_and_decode_to_a_decode_replica() -> None:
    """With one prefill and one decode replica, every pair is (prefill, decode) and counts as a transfer."""
    router = make_pairs({"p0": P, "d0": D})
    pair = router.route_pair(query("a"), now=1.0)
    assert (pair.prefill.replica_id, pair.decode_replica_id) == ("p0", "d0")
    assert pair.decode_address == "d0:1" and pair.transfers and router.transfers == 1


def test_prefill_side_counts_prefix_reuse() -> None:
    """The prefill replica holding the prompt's prefix wins when queues are equal (its TTFT is lower)."""
    router = make_pairs({"p0": P, "p1": P, "d0": D})
    hashes = query("x").block_hashes
    router.core.apply_kv_events("p1", [KvEvent(1, KvEventKind.STORED, hashes[:8])], now=0.5)
    pair = router.route_pair(query("a"), now=1.0)
    assert pair.prefill.replica_id == "p1" and pair.prefill.cached_blocks == 8


def test_prefill_side_avoids_a_long_queue_despite_a_prefix() -> None:
    """DESIGN's routing example on the prefill side: a prefix saving little does not beat a long queue."""
    router = make_pairs({"p0": P, "p1": P, "d0": D})
    router.core.apply_kv_events("p1", [KvEvent(1, KvEventKind.STORED, query("x").block_hashes[:8])], now=0.5)
    router.core.heartbeat("p1", ReplicaLoad(waiting=3, queued_prefill_tokens=50_000, kv_blocks_free=1000), now=0.5)
    assert router.route_pair(query("a"), now=1.0).prefill.replica_id == "p0"


def test_decode_side_prefers_the_least_decode_load_with_room() -> None:
    """Decodes spread by load: three requests over two decode replicas go d0, d1, d0 (ties to the id)."""
    router = make_pairs({"p0": P, "d0": D, "d1": D})
    chosen = [router.route_pair(query(f"r{i}", first=1000 * i), now=1.0).decode_replica_id for i in range(3)]
    assert chosen == ["d0", "d1", "d0"]


def test_decode_side_skips_a_replica_without_kv_room() -> None:
    """A decode replica whose reported free blocks cannot hold prompt + max_tokens is passed over, even idle."""
    router = make_pairs({"p0": P, "d0": D, "d1": D})
    router.core.heartbeat("d0", ReplicaLoad(kv_blocks_free=5), now=0.5)  # 160 + 16 tokens need 11 blocks
    router.route_pair(query("busy", first=5000), now=0.4)  # d1 now has one decode, d0 none
    assert router.route_pair(query("a"), now=1.0).decode_replica_id == "d1"


def test_decode_claims_count_until_the_request_is_done() -> None:
    """A claim holds room and load on its decode replica until on_request_done; then the replica is free again."""
    router = make_pairs({"p0": P, "d0": D, "d1": D}, num_blocks=20)
    first = router.route_pair(query("a"), now=1.0)
    assert first.decode_replica_id == "d0"
    second = router.route_pair(query("b", first=5000), now=1.0)
    assert second.decode_replica_id == "d1"  # d0 has 9 blocks of room left, b needs 11
    router.on_request_done("d0", "a")
    assert router.route_pair(query("c", first=9000), now=1.0).decode_replica_id == "d0"


def test_no_room_anywhere_picks_the_most_room() -> None:
    """When no decode replica has room, the one with the most is chosen (its queue waits for blocks)."""
    router = make_pairs({"p0": P, "d0": D, "d1": D}, num_blocks=8)
    router.core.heartbeat("d0", ReplicaLoad(kv_blocks_free=2), now=0.5)
    assert router.route_pair(query("a"), now=1.0).decode_replica_id == "d1"


def test_both_replicas_may_keep_a_request_without_transfer() -> None:
    """A fleet of BOTH replicas is not disaggregated; a pair on one BOTH replica moves no blocks."""
    router = make_pairs({"b0": B})
    assert not is_disaggregated(router.core)
    pair = router.route_pair(query("a"), now=1.0)
    assert (pair.prefill.replica_id, pair.decode_replica_id, pair.transfers) == ("b0", "b0", False)
    assert is_disaggregated(make_pairs({"b0": B, "d0": D}).core)


def test_missing_side_is_no_replica_available() -> None:
    """A fleet with prefill replicas only (or decode only) cannot place a pair: NoReplicaAvailable names the side."""
    with pytest.raises(NoReplicaAvailable, match="decode"):
        make_pairs({"p0": P}).route_pair(query("a"), now=1.0)
    with pytest.raises(NoReplicaAvailable, match="prefill"):
        make_pairs({"d0": D}).route_pair(query("a"), now=1.0)


def test_prefill_route_is_recorded_like_an_aggregated_route() -> None:
    """The prefill side's routed work is the core's unreported work, taken back by RouterCore.on_request_done."""
    router = make_pairs({"p0": P, "d0": D})
    router.route_pair(query("a"), now=1.0)
    replica = router.core.fleet.get("p0")
    assert replica.unreported_tokens == 160 and "a" in replica.inflight
    router.core.on_request_done("p0", "a", now=2.0)
    assert replica.unreported_tokens == 0 and not replica.inflight


def test_role_round_trips_the_wire_and_an_unknown_role_is_named() -> None:
    """ReplicaSpec.role survives Replica proto conversion both ways; an unknown wire value raises naming it."""
    core = RouterCore()
    core.register(ReplicaSpec("d0", "m", role=D), now=0.0)
    message = replica_to_proto(core.replicas()[0])
    assert message.role == router_pb2.REPLICA_ROLE_DECODE
    assert spec_from_proto(message).role is D
    assert spec_from_proto(router_pb2.Replica(replica_id="x", model="m")).role is B
    with pytest.raises(ValueError, match="unknown replica role 7"):
        role_from_proto(7)


def test_a_dry_run_pair_records_nothing() -> None:
    """A dry-run query answers the pair a real one would get and leaves no routed work and no decode claim."""
    router = make_pairs({"p0": P, "d0": D})
    dry = router.route_pair(RouteQuery("a", "m", prompt_tokens=160, max_tokens=16, dry_run=True), now=1.0)
    assert (dry.prefill.replica_id, dry.decode_replica_id) == ("p0", "d0")
    replica = router.core.fleet.get("p0")
    assert not replica.inflight and replica.unreported_tokens == 0
    assert not router.claims and router.transfers == 0


def test_a_decode_claim_is_the_requests_own_whatever_attempt_ends_it() -> None:
    """The claim made when attempt `a` was routed is released by the decode half's completion, attempt `a#1`
    (admission's hand-off runs the decode half as a later attempt)."""
    router = make_pairs({"p0": P, "d0": D})
    router.route_pair(query("a"), now=1.0)
    router.route_pair(query("b#2"), now=1.0)
    assert set(router.claims["d0"].claims) == {"a", "b"}
    router.on_request_done("d0", "a#1")
    router.on_request_done("d0", "b#3")
    assert "d0" not in router.claims
