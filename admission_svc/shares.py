"""Budgets shared by N admission processes: each admits only within its grant, and the grants never sum past a cap.

Theory of operation. Several admission processes can serve one port (SO_REUSEPORT: `sluice up --admission-procs
N`) or one Service. Each keeps its own ledger (admission_svc/core.py, unchanged), but the configured caps (global
and per tenant: active, queued, pending input tokens, reserved output tokens, KV blocks) are the deployment's, not
each process's. So each capped budget is split into *grants*, one per live process, kept in one Redis hash
(`sluice:{<namespace>:budgets}`) and changed only by one Lua script, atomically:

* a process is *live* while its lease (`m:<owner>`, an expiry in Redis's own clock) is in the future; every
  call renews its own and deletes the expired ones, and a dead process's grants are dropped with them;
* a process asks for `requested` = max(what it holds now, its fair part: cap / live processes, the remainder to
  the first ranks, as of its last call); the script raises that to the fair part of the processes live now when
  that is larger (one died) and grants min(requested, cap - the other live processes' grants). Hence the grants'
  sum never exceeds the cap, and a grant never falls below what its process holds (that is never revoked).

Each process admits only within min(its old grant, requested) while a call is in flight and within its new grant
after it, so what all processes hold together never exceeds a cap. A process that joins asks for its fair part
and gets what the others have freed; they learn of it at their next call and shrink at the one after, so the
shares converge within three rebalance intervals (lease_s / 4 each). One that cannot renew its lease (Redis away) stops admitting before the lease can expire,
because the others may take its grant then.

kill -9: the dead process's grants are reclaimed when its lease expires, `lease_s` (6 s) after its last renewal at
the most, and taken by each other process at its next call (within one more interval: 7.5 s after the kill at
the most); its requests were cancelled before that by their schedulers
(their owner lease, 5 s: admission_svc/calls.py). A graceful stop gives its grants back at once (`leave`).

Known limit: a share is a hard cap of its process, so with uneven load one process may refuse while another has
room (up to one rebalance interval); a single request larger than a process's fair part of a cap waits for that
process's share to grow, which it does not do on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from admission_svc.core import _BUDGETS, AdmissionCore

__all__ = ["BudgetShares", "SHARES_STREAM"]

log = logging.getLogger(__name__)

SHARES_STREAM = "budgets"
"""The logical key of the grants hash (`Bus.key(SHARES_STREAM)`)."""

# KEYS[1]: the grants hash. ARGV: owner, lease ms (0: leave), then per shared budget: field, cap, requested.
# Returns {rank, live processes, grant per budget...}. Fields: m:<owner> = lease expiry (ms, Redis clock);
# g:<scope>:<budget> = cjson {owner: grant}.
_REBALANCE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local owner, lease = ARGV[1], tonumber(ARGV[2])
if lease > 0 then
  redis.call('HSET', KEYS[1], 'm:' .. owner, now + lease)
else
  redis.call('HDEL', KEYS[1], 'm:' .. owner)
end
local all = redis.call('HGETALL', KEYS[1])
local live, names = {}, {}
for i = 1, #all, 2 do
  local f = all[i]
  if string.sub(f, 1, 2) == 'm:' then
    if tonumber(all[i + 1]) > now then
      local who = string.sub(f, 3)
      live[who] = true
      table.insert(names, who)
    else
      redis.call('HDEL', KEYS[1], f)
    end
  end
end
table.sort(names)
local rank = 0
for i, who in ipairs(names) do if who == owner then rank = i - 1 end end
local out = {rank, #names}
for i = 3, #ARGV, 3 do
  local field, cap, requested = 'g:' .. ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  -- Fewer live processes than the caller knew: its fair part is larger now, and granting it at once is safe
  -- (the caller admits within min(old grant, requested) meanwhile). More: it shrinks at its next call.
  local fair = math.floor(cap / #names) + ((rank < cap % #names) and 1 or 0)
  if lease > 0 and fair > requested then requested = fair end
  local raw = redis.call('HGET', KEYS[1], field)
  local grants = raw and cjson.decode(raw) or {}
  local kept, others = {}, 0
  for who, g in pairs(grants) do
    if who ~= owner and live[who] then kept[who] = g; others = others + g end
  end
  local grant = 0
  if lease > 0 then grant = math.max(0, math.min(requested, cap - others)) end
  if lease > 0 then kept[owner] = grant end
  if next(kept) == nil then redis.call('HDEL', KEYS[1], field) else redis.call('HSET', KEYS[1], field, cjson.encode(kept)) end
  table.insert(out, grant)
end
return out
"""


def fair_part(cap: int, processes: int, rank: int) -> int:
    """Return process `rank`'s fair part of `cap` split over `processes` (the remainder to the first ranks)."""
    processes = max(processes, 1)
    return cap // processes + (1 if rank < cap % processes else 0)


class BudgetShares:
    """One admission process's grants of the shared caps, and the calls that renew and rebalance them."""

    def __init__(self, client: Any, key: str, owner: str, core: AdmissionCore, lease_s: float = 6.0) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.key = key
        self.owner = owner
        self.core = core
        self.lease_s = lease_s
        self._script = client.register_script(_REBALANCE)
        self.caps = core.capped_scopes()
        """Configured caps by scope (what the grants split)."""
        self.grants: dict[str | None, list[int | None]] = {
            scope: [None if cap is None else 0 for cap in caps] for scope, caps in self.caps.items()}
        """Granted part of each cap by scope (None: that budget is uncapped, not shared); 0 until the first call."""
        self.processes, self.rank = 0, 0
        self.renewed_at = -float("inf")
        """time.monotonic() when the last successful call was sent (the lease runs from no later than that)."""
        self.rebalances = 0
        self.failures = 0
        self._failures: Any = None
        self._apply()

    def _apply(self) -> None:
        for scope, grant in self.grants.items():
            self.core.set_share(scope, tuple(grant))

    def _plan(self) -> list[tuple[str | None, int, str, int, int]]:
        """Return (scope, budget index, field, cap, requested) of every shared budget, and narrow the local grants
        to min(grant, requested) for the time the call is in flight."""
        plan = []
        for scope, caps in self.caps.items():
            used = self.core.usage(scope)
            for index, cap in enumerate(caps):
                if cap is None:
                    continue
                fair = fair_part(cap, self.processes, self.rank) if self.processes else cap
                requested = max(used[index], fair)
                grant = self.grants[scope][index]
                self.grants[scope][index] = min(grant or 0, requested)
                plan.append((scope, index, f"{'*' if scope is None else 't=' + scope}:{_BUDGETS[index]}", cap,
                             requested))
        self._apply()
        return plan

    async def rebalance(self) -> None:
        """Renew this process's lease and move its grants toward its fair part (one script call). Raises what Redis
        raises; the grants stay narrowed then (never wider than what Redis holds for this process)."""
        plan = self._plan()
        sent = time.monotonic()
        args: list[Any] = [self.owner, int(self.lease_s * 1000)]
        for _, _, field, cap, requested in plan:
            args += [field, cap, requested]
        reply = await self._script(keys=[self.key], args=args)
        self.rank, self.processes = int(reply[0]), int(reply[1])
        for (scope, index, _, _, _), grant in zip(plan, reply[2:], strict=True):
            self.grants[scope][index] = int(grant)
        self.renewed_at = sent
        self.rebalances += 1
        self._apply()

    def settled(self) -> bool:
        """Return True when every grant is at least this process's fair part of its cap (the split has converged
        for it)."""
        return all(grant is None or cap is None or grant >= fair_part(cap, self.processes, self.rank)
                   for scope, caps in self.caps.items() for cap, grant in zip(caps, self.grants[scope], strict=True))

    async def join(self, timeout_s: float) -> bool:
        """Rebalance until `settled` (the others shrink at their own calls) or `timeout_s` passes; returns settled.
        A process that serves before it is settled refuses what its grant cannot hold."""
        deadline = time.monotonic() + timeout_s
        await self.rebalance()
        while not self.settled() and time.monotonic() < deadline:
            await asyncio.sleep(self.lease_s / 8)
            await self.rebalance()
        return self.settled()

    def expire(self, now: float) -> bool:
        """Stop admitting when the lease may have expired in Redis (another process may take these grants):
        every grant drops to what is held now. Returns True when it did."""
        if now - self.renewed_at < self.lease_s * 0.75:
            return False
        for scope, grants in self.grants.items():
            used = self.core.usage(scope)
            self.grants[scope] = [None if g is None else min(g, used[i]) for i, g in enumerate(grants)]
        self._apply()
        return True

    async def run(self, stop: asyncio.Event, interval_s: float | None = None) -> None:
        """Rebalance every `interval_s` (default lease_s / 4) until `stop`; Redis errors are logged and retried."""
        interval = interval_s or self.lease_s / 4
        while not stop.is_set():
            try:  # bounded: a Redis that hangs must not keep the lease check below from running
                await asyncio.wait_for(self.rebalance(), interval)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: admit nothing new once the lease may have run out
                self.failures += 1
                if self._failures is not None:
                    self._failures.inc()
                if self.expire(time.monotonic()):
                    log.error("budget shares not renewed for %.1f s (%s): admitting nothing new until Redis "
                              "answers", time.monotonic() - self.renewed_at, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    async def leave(self) -> None:
        """Give every grant back and end the lease at once (a graceful stop; what is held must be released first)."""
        args: list[Any] = [self.owner, 0]
        for scope, caps in self.caps.items():
            for index, cap in enumerate(caps):
                if cap is not None:
                    args += [f"{'*' if scope is None else 't=' + scope}:{_BUDGETS[index]}", cap, 0]
        await self._script(keys=[self.key], args=args)

    def expose(self, registry: Any) -> None:
        """Serve the grants (`sluice_admission_budget_share{scope,budget}`), the live processes and the failed
        renewals in a Prometheus registry."""
        from prometheus_client import Counter, Gauge

        share = Gauge("sluice_admission_budget_share", "This process's grant of a cap shared by the admission "
                      "processes (scope * = global, else a tenant).", ["scope", "budget"], registry=registry)
        for scope, caps in self.caps.items():
            for index, cap in enumerate(caps):
                if cap is not None:
                    share.labels("*" if scope is None else scope, _BUDGETS[index]).set_function(
                        self._grant_reader(scope, index))
        Gauge("sluice_admission_budget_share_processes", "Live admission processes sharing the caps.",
              registry=registry).set_function(lambda: float(self.processes))
        self._failures = Counter("sluice_admission_budget_share_failures", "Renewals of the budget shares that "
                                 "failed (Redis away).", registry=registry)

    def _grant_reader(self, scope: str | None, index: int) -> Callable[[], float]:
        return lambda: float(self.grants[scope][index] or 0)

    def describe(self) -> dict[str, Sequence[int | None]]:
        """Return the grants by scope name ("*" global), for logs and the metrics gauge."""
        return {("*" if scope is None else scope): list(grants) for scope, grants in self.grants.items()}
