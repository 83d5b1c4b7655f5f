"""Owner leases: a replica runs a request only while the admission process that owns it is alive.

Rules
-----
* An owner is (owner, owner_incarnation): the admission process's token-stream name and an id new on each
  start of it, so a restarted admission under the same name is another owner.
* A Submit that names an incarnation starts its owner's lease (`first_lease_s`, long enough for the first
  renewal to arrive: admission renews every 0.5 s) unless a longer one runs; `renew` (the RenewLease RPC, every watchdog tick of admission)
  extends it to now + ttl.
* `lapsed(now, live)` returns the owners whose lease ran out, with their live requests, and forgets them:
  the caller cancels those requests (detail `owner_gone`). Requests that ended are forgotten as they go.
* `pause(seconds)` moves every lease's end later by `seconds`: time in which this replica could not hear renewals
  (its own event loop did not run: a stop, a long pause, CPU starvation) does not count against the owners.
* A request submitted without an incarnation has no lease and runs to its end (older admission processes).

Pure: no clock, no I/O; `now` is an argument.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

__all__ = ["Owner", "OwnerLeases"]


class Owner(NamedTuple):
    """One admission process incarnation."""

    owner: str
    incarnation: str


class OwnerLeases:
    """The leases of the owners of a replica's requests. See the module docstring."""

    def __init__(self, first_lease_s: float = 5.0) -> None:
        self.first_lease_s = first_lease_s
        self._expiry: dict[Owner, float] = {}
        self._owner_of: dict[str, Owner] = {}

    def track(self, request_id: str, owner: str, incarnation: str, now: float) -> None:
        """Tie a submitted request to its owner's lease (started now when the owner has none)."""
        if not incarnation:
            return
        key = Owner(owner, incarnation)
        self._owner_of[request_id] = key
        self._expiry[key] = max(self._expiry.get(key, 0.0), now + self.first_lease_s)

    def renew(self, owner: str, incarnation: str, ttl_s: float, now: float) -> int:
        """Extend the owner's lease to now + ttl_s; return how many of its requests are tracked here."""
        key = Owner(owner, incarnation)
        self._expiry[key] = now + ttl_s
        return sum(1 for held in self._owner_of.values() if held == key)

    def pause(self, seconds: float) -> None:
        """Move every lease's end `seconds` later (this replica could not hear renewals for that long)."""
        for key in self._expiry:
            self._expiry[key] += seconds

    def lapsed(self, now: float, live: Collection[str]) -> list[tuple[Owner, list[str]]]:
        """Return the owners whose lease ran out with their requests still in `live`, and forget them."""
        for request_id in [r for r in self._owner_of if r not in live]:
            del self._owner_of[request_id]
        out = []
        for key in [k for k, expiry in self._expiry.items() if expiry < now]:
            del self._expiry[key]
            requests = [r for r, held in self._owner_of.items() if held == key]
            for request_id in requests:
                del self._owner_of[request_id]
            if requests:
                out.append((key, requests))
        return out
