"""Fast-forward: a replica's steady decode rounds in bulk, with the same results as one event per round.

Most simulated rounds of a busy trace are plain decodes: every running request of a replica gains one
token (a block boundary takes a block, a full block is registered), and nothing else happens (no queue,
no first token, no finish). Such a round touches only its own replica (its core, its `RoundRates`, its
requests' token times) and the router's KV index, which is read only when routing. So while no event that
could look at the replica, change what it does or route falls before a round's end (an arrival, a
submission, a retry, a cancel, a deadline, a fleet event: every heap event but other replicas' round
results, which touch only their own replicas, heartbeats and samples), the rounds can be applied at once:

- the core's bulk API (`SchedulerCore.steady_decodes`, `advance_decodes`) applies k pipelined result +
  schedule-ahead cycles exactly as k single calls would, and stops before a cycle that needs attention
  (a first or last token, the KV read cap, a block the pool cannot give);
- each round's time is the cost model's (`CostModel.decode_time`, the arithmetic `execute` does for that
  plan), its tokens the cost model's (`decode_tokens`); the round times fold into `RoundRates` in order
  (`observe_decodes`), every token gets its round's time as `_absorb` would give it, and the run's KV
  events go to the router in their order, in one call;
- a heartbeat or a sample during a run reads the replica's load as of its time (`load_at`: the rates and
  the free and cached blocks logged per round; the rest of what they read is constant in a steady run);
  a round ending exactly at a heartbeat's or a sample's time ends the run (their order is the heap's);
- the last round left in flight is executed by the cost model and put on the heap as usual, and the
  round planned ahead becomes the replica's `ahead`.

The fast path is for pipelined runs without admission's growth signal (per-token calls) and with the
cost model's inline tokens; elsewhere it is off. `SLUICE_SIM_FASTFORWARD=0` turns it off everywhere
(the equivalence tests, tests/unit/test_sim_fastforward.py and test_core_bulk.py, run both ways).
"""

from __future__ import annotations

import heapq
import os
from bisect import bisect_left, bisect_right
from typing import TYPE_CHECKING

from sluice.glue import RoundRates
from sluice.slots import retyping_constructor
from sluice.types import CoreStats, RoundPlan, RoundResult
from sluice_tools.sim.replica import RatesLog

if TYPE_CHECKING:
    from sluice_tools.sim.cluster import Simulator, _Replica

ENV_SWITCH = "SLUICE_SIM_FASTFORWARD"
"""Environment variable: "0" turns the fast path off (default on)."""

MAX_CYCLES = 1 << 16
"""A bound on one run (the horizon ends runs long before it; it bounds the core's limit search)."""

MIN_CYCLES = 2
"""Shorter runs go the ordinary way (the bulk call's fixed cost is about one round's)."""


_Kinds = tuple[int, int, int]
"""The heap kinds of a round result, a heartbeat and a sample."""


def enabled() -> bool:
    """Return whether the fast path is switched on (`SLUICE_SIM_FASTFORWARD` is not "0")."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def _horizon(sim: Simulator, kinds: _Kinds) -> tuple[float, list[tuple[float, float]]]:
    """Return (the earliest heap event that bounds a run, the heap's pass-through events as (time, interval)).

    Bounds: every event but round results, heartbeats and samples (they read a running replica's load and
    stats: constant in a steady run but for `decode_round_s` and the free, cached and used blocks, which
    `load_at` gives as of their time). Heartbeats and samples come back with the interval the loop pushes
    the next one at (`_first_tie`); one scan of the heap gives both."""
    horizon = float("inf")
    periodic: list[tuple[float, float]] = []
    round_done, heartbeat, sample = kinds
    for when, _, kind, _ in sim._heap:
        if kind == round_done:
            continue
        if kind == heartbeat:
            periodic.append((when, sim.config.heartbeat_interval_s))
        elif kind == sample:
            periodic.append((when, sim.config.sample_interval_s))
        elif when < horizon:
            horizon = when
    return horizon, periodic


def _first_tie(times: list[float], periodic: list[tuple[float, float]]) -> int:
    """Return the first m >= 1 whose `times[m]` is a heartbeat's or a sample's time, else len(times).

    Their times are those on the heap and the ones the loop will push after them (when + interval, again
    and again); each is looked up in the ascending `times` by bisection (a few per run, not a set lookup
    per round)."""
    end = len(times)
    for when, interval in periodic:
        while when <= times[end - 1]:
            m = bisect_left(times, when, 1, end)
            if m < end and times[m] == when:
                end = m  # this chain's later times are past it
                break
            if interval <= 0:
                break
            when = when + interval
    return end


def load_at(replica: _Replica, now: float) -> tuple[RoundRates, CoreStats]:
    """Return the replica's round rates and core stats as of `now` (a heartbeat during a run taken in bulk)."""
    log, stats = replica.rates_log, replica.core.stats()
    if log is None or now >= log.times[-1]:
        replica.rates_log = None
        return replica.rates, stats
    last = bisect_right(log.times, now) - 1  # the last round ended by now
    decode_round_s, (free, cached) = log.decode_round_s[last], log.blocks[last]
    rates = replica.rates
    if decode_round_s != rates.decode_round_s:
        rates = RoundRates(rates.alpha, decode_round_s, rates.prefill_tokens, rates.prefill_s)
    if free != stats.kv_blocks_free or cached != stats.kv_blocks_cached:
        stats = _with_blocks(stats, free, cached)
    return rates, stats


_new_stats = retyping_constructor(CoreStats)
"""CoreStats built through a shell class (sluice/slots.py): its frozen __init__ pays object.__setattr__ for each of 20."""


def _with_blocks(stats: CoreStats, free: int, cached: int) -> CoreStats:
    """Return `stats` with the free and cached blocks replaced (used follows); `dataclasses.replace`, faster."""
    s = stats
    return _new_stats(s.waiting, s.running, s.kv_blocks_total, s.kv_blocks_total - free - cached, free, cached,
                     s.host_blocks_total, s.host_blocks_used, s.preemptions, s.recomputed_tokens, s.dropped_results,
                     s.rounds, s.queued_prefill_tokens, s.finished, s.cancelled, s.timed_out, s.prefix_hit_tokens,
                     s.prefix_query_tokens, s.host_hit_tokens, s.host_blocks_cached)


def fast_forward(sim: Simulator, replica: _Replica, plan: RoundPlan, result: RoundResult, kinds: _Kinds) -> bool:
    """At the result of `plan` on `replica`: apply the steady cycles from here in bulk; False: none taken.

    Cycle 0 applies this result; cycle m >= 1 the result of the round ending at t_m, taken only when
    t_m is before every event that could matter (strictly: an equal time may be ordered first) and
    equal to no heartbeat's or sample's time.
    """
    ahead = replica.ahead
    budget = ahead.budget if ahead is not None else None
    if budget is None or budget.num_prefill_tokens or budget.num_decode_tokens != len(ahead.seqs):  # type: ignore[union-attr]
        return False
    core = replica.core
    steady = core.steady_decodes(MIN_CYCLES, MAX_CYCLES)
    if steady is None:
        return False
    running, limit = steady
    cost, gap, now = sim.cost, sim._gap, sim.now
    horizon, periodic = _horizon(sim, kinds)
    context = sum([len(request.tokens) for request in running])
    # times[1] is the end of the round planned ahead (its plan reads context + len(running) positions): a run
    # whose first round ends at the horizon or at a heartbeat's or sample's time stops at k = 1 below.
    times, walls = cost.decode_run(len(running), context, now, gap, horizon, limit - 1)  # round m reads each len + m
    k = _first_tie(times, periodic) if len(times) > 1 else len(times)
    if k < len(times):  # a tie with a heartbeat or a sample: their order is the heap's
        del times[k:], walls[k - 1:]
    if k < MIN_CYCLES:
        return False
    tokens = []
    for request in running:
        row = cost.decode_tokens(request.request_id, len(request.tokens), k)
        if row is None:
            return False
        tokens.append(row)
    rates = replica.rates
    rates.observe(plan, result.elapsed_s)
    decode_round_s = [rates.decode_round_s, *rates.observe_decodes(walls)]
    events, older, newer, pool = core.advance_decodes(running, tokens, token_events=False)  # times: below
    replica.rates_log = RatesLog(times, decode_round_s, pool)
    # The router's index takes a replica's KV events in order and reads them only when routing (an
    # arrival, which bounds the run): all of the run's at once leave it as one call per round would.
    # (The last placements' evictions stay in the pool for the next round's result, as they would.)
    if events.kv_events and not sim.router.apply_kv_events(replica.replica_id, events.kv_events, now):
        raise AssertionError(f"fast-forward on {replica.replica_id}: a gap in the replica's own KV events")
    delay = sim._token_delay
    token_times = [t + delay for t in times] if delay else times  # t + 0.0 is t
    record_times = sim._token_times
    for request in running:
        record_times[request.request_id].extend(token_times)
    sim.rounds += k
    last = ahead if older is None else older
    final = cost.execute(last)  # type: ignore[arg-type]
    sim._seq += 1
    heapq.heappush(sim._heap, (times[-1] + gap + final.elapsed_s, sim._seq, kinds[0], (replica, last, final)))
    replica.busy = True
    replica.ahead = newer
    return True
