"""Fast-forward: a replica's steady decode rounds in bulk, with the same results as one event per round.

Most simulated rounds of a busy trace are plain decodes: every running request of a replica gains one
token, and nothing else happens (no queue, no first token, no finish, no block boundary). Such a round
touches only its own replica (its core, its `RoundRates`, its requests' token times), so while no event
that could look at the replica or change what it does falls before a round's end (an arrival, a
submission, a retry, a cancel, a deadline, a heartbeat, a sample: every heap event but other replicas'
round results, which touch only their own replicas), the rounds can be applied at once:

- the core's bulk API (`SchedulerCore.steady_decodes`, `decode_run_limit`, `advance_decodes`) applies k
  pipelined result + schedule-ahead cycles exactly as k single calls would, and stops before a cycle
  that needs attention (a first or last token, a block boundary or a full block, the KV read cap);
- each round's time is the cost model's (`CostModel.decode_time`, the arithmetic `execute` does for that
  plan), its tokens the cost model's (`decode_tokens`); the round times fold into `RoundRates` in order
  (`observe_decodes`) and every token gets its round's time, as `_absorb` would give it;
- the last round left in flight is executed by the cost model and put on the heap as usual, and the
  round planned ahead becomes the replica's `ahead`.

The fast path is for pipelined runs without admission's growth signal (per-token calls) and with the
cost model's inline tokens; elsewhere it is off. `SLUICE_SIM_FASTFORWARD=0` turns it off everywhere
(the equivalence test runs both ways).
"""

from __future__ import annotations

import heapq
import os
from typing import TYPE_CHECKING, Any

from sluice.types import RoundPlan, RoundResult

if TYPE_CHECKING:
    from sluice_tools.sim.cluster import Simulator, _Replica

ENV_SWITCH = "SLUICE_SIM_FASTFORWARD"
"""Environment variable: "0" turns the fast path off (default on)."""

MIN_CYCLES = 2
"""Shorter runs go the ordinary way (the bulk call's fixed cost is about one round's)."""


def enabled() -> bool:
    """Return whether the fast path is switched on (`SLUICE_SIM_FASTFORWARD` is not "0")."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def _horizon(heap: list[tuple[float, int, int, Any]], round_done: int) -> float:
    """Return the time of the earliest heap event that is not a round result (inf when none)."""
    horizon = float("inf")
    for when, _, kind, _ in heap:
        if kind != round_done and when < horizon:
            horizon = when
    return horizon


def fast_forward(sim: Simulator, replica: _Replica, plan: RoundPlan, result: RoundResult, round_done: int) -> bool:
    """At the result of `plan` on `replica`: apply the steady cycles from here in bulk; False: none taken.

    Cycle 0 applies this result; cycle m >= 1 the result of the round ending at t_m, taken only when
    t_m is before every event that could matter (`_horizon`, strictly: an equal time may be ordered first).
    """
    core = replica.core
    running = core.steady_decodes()
    if running is None:
        return False
    limit = core.decode_run_limit(running)
    if limit < MIN_CYCLES:
        return False
    horizon = _horizon(sim._heap, round_done)
    cost, gap = sim.cost, sim._gap
    n = len(running)
    context = sum(len(request.tokens) for request in running)
    times = [sim.now]
    walls: list[float] = []
    when = sim.now
    while len(times) < limit:
        wall = cost.decode_time(n, context + len(times) * n)  # round m reads each start + 1 = len + m
        when = when + gap + wall
        if when >= horizon:
            break
        times.append(when)
        walls.append(wall)
    k = len(times)
    if k < MIN_CYCLES:
        return False
    tokens = []
    for request in running:
        row = cost.decode_tokens(request.request_id, len(request.tokens), k)
        if row is None:
            return False
        tokens.append(row)
    replica.rates.observe(plan, result.elapsed_s)
    replica.rates.observe_decodes(walls)
    older, newer = core.advance_decodes(running, tokens)
    events = core.take_events()
    if events.lifecycle or events.finished or events.kv_events or events.dropped_results:
        raise AssertionError(f"fast-forward on {replica.replica_id}: a steady run emitted more than tokens")
    delay = sim._token_delay
    token_times = [t + delay for t in times]
    record_times = sim._token_times
    for request in running:
        record_times[request.request_id].extend(token_times)
    sim.rounds += k
    last = replica.ahead if older is None else older
    assert last is not None
    final = cost.execute(last)
    sim._seq += 1
    heapq.heappush(sim._heap, (times[-1] + gap + final.elapsed_s, sim._seq, round_done, (replica, last, final)))
    replica.busy = True
    replica.ahead = newer
    return True
