"""The router's fleet tells a restarted scheduler (a new incarnation under the same replica id) from the old one."""

from __future__ import annotations

from router_svc.core import RouterCore
from router_svc.fleet import ReplicaSpec
from sluice.types import ReplicaState


def test_a_heartbeat_of_another_incarnation_than_the_registered_one_is_not_accepted() -> None:
    """After registering as incarnation A, only A's heartbeats (or one naming none) count; once the replica
    registers again as B (a restart), A's are refused and the old row, with its routed requests, is gone."""
    core = RouterCore()
    core.register(ReplicaSpec("r0", "m", address="h:1", incarnation="A"), now=0.0)
    core.fleet.get("r0").inflight["req"] = 10
    assert core.fleet.heartbeat_from("r0", "A") and core.fleet.heartbeat_from("r0", "")
    assert not core.fleet.heartbeat_from("r0", "B")
    assert core.register(ReplicaSpec("r0", "m", address="h:1", incarnation="B"), now=1.0) is ReplicaState.WARMING
    assert core.fleet.heartbeat_from("r0", "B") and not core.fleet.heartbeat_from("r0", "A")
    assert core.fleet.get("r0").inflight == {}
    assert [v.spec.incarnation for v in core.replicas()] == ["B"]
