"""Owner leases of a replica (scheduler_svc/leases.py): requests live while their admission process renews."""

from __future__ import annotations

from scheduler_svc.leases import Owner, OwnerLeases


def test_an_owner_that_stops_renewing_loses_its_live_requests_and_only_those() -> None:
    """A lease started by Submit and renewed keeps its requests; once it lapses `lapsed` returns the owner with its
    requests still live (not the ones that ended) exactly once; another incarnation under the same name, and a
    request submitted without one, are not touched."""
    leases = OwnerLeases(first_lease_s=10.0)
    leases.track("a", "adm", "inc-1", now=0.0)
    leases.track("b", "adm", "inc-1", now=0.0)
    leases.track("done", "adm", "inc-1", now=0.0)
    leases.track("c", "adm", "inc-2", now=0.0)
    leases.track("legacy", "adm", "", now=0.0)
    live = {"a", "b", "c", "legacy"}
    assert leases.renew("adm", "inc-1", 5.0, now=8.0) == 3
    assert leases.renew("adm", "inc-2", 5.0, now=9.0) == 1
    assert leases.lapsed(12.0, live) == []
    assert leases.renew("adm", "inc-2", 5.0, now=12.0) == 1
    assert leases.lapsed(13.5, live) == [(Owner("adm", "inc-1"), ["a", "b"])]
    assert leases.lapsed(14.0, live) == []
    assert leases.lapsed(17.5, live) == [(Owner("adm", "inc-2"), ["c"])]


def test_a_pause_of_the_replica_moves_every_lease_later_by_as_much() -> None:
    """Time in which the replica could not hear renewals (`pause`) does not count against the owners: a lease that
    would have lapsed during the pause lapses that much later, and one that is renewed after it does not."""
    leases = OwnerLeases(first_lease_s=5.0)
    leases.track("a", "adm", "inc-1", now=0.0)
    leases.track("b", "other", "inc-9", now=0.0)
    leases.pause(7.0)
    assert leases.lapsed(11.5, {"a", "b"}) == []
    assert leases.renew("adm", "inc-1", 5.0, now=11.5) == 1
    assert leases.lapsed(12.5, {"a", "b"}) == [(Owner("other", "inc-9"), ["b"])]
    assert leases.lapsed(16.0, {"a"}) == [] and leases.lapsed(16.6, {"a"}) == [(Owner("adm", "inc-1"), ["a"])]
