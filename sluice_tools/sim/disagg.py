"""Prefill/decode disaggregation in the simulator: P prefill replicas, D decode replicas, KV blocks moved between.

Theory of operation. The deployment is the Simulator's (cluster.py) with the same cores; this subclass adds only
the hand-off between two of them, and the cost model's transfer term (transfer.py):

- routing: `router_svc.disagg.DisaggRouter.route_pair` (prefill side by predicted TTFT, prefix reuse included;
  decode side by KV room and decode load), as the router service does for a fleet with roles;
- prefill: the request is submitted to the prefill replica's core with max_tokens 1: its prompt is prefilled
  (chunked, batched with other prompts, by the same round builder) and its first token sampled there. The
  prefill replicas' per-request chunk cap is the round budget unless `disagg_prefill_chunk` says otherwise (the
  cap bounds decodes' inter-token latency, and no decode runs there);
- the reader rule across the pair: before the result of the round that completes the prompt is applied, the
  request's blocks are pinned on the prefill pool (`BlockPool.pin`, the explicit-reader pin a swap copy takes).
  The request then ends there as usual, but its blocks stay used until the transfer's last reader is done:
  only then are they unpinned (`unpin`), when the full ones stay in the prefix cache, the rest are freed;
- transfer: the decode replica allocates blocks for the prompt (`BlockPool.allocate`; when it has no room the
  transfer waits, first come first served, until a round there frees some), the link is booked (one transfer
  at a time per replica and direction, `LinkClock`) for latency + bytes / bandwidth;
- receive: when the transfer ends, the received full blocks get their hashes (`BlockPool.register`: their KV is
  there now) and the request is submitted to the decode core with its prompt + first token and max_tokens
  output - 1, so its first decode finds the prompt in the prefix cache and schedules at once. The received
  blocks are held until the core has taken them (the request is placed), then released to it. What the core
  computes itself in that first round is the prompt's partial last block (< block_size tokens: a prefix cache
  holds full blocks only) and the new token: a small, honest overcount of the decode side's work;
- a request of output length 1 ends at its prefill (no transfer); cancel during a transfer ends the request at
  once (the client's record) and releases both sides when the transfer's reader is done; a request the prefill
  core ends otherwise (cancelled, timed out, failed) releases its pin and its decode claim at once.

Tokens are the cost model's, a function of (request id, position), so the two halves produce exactly the tokens
aggregated serving does; the record adds the prefill's first token to the decode side's count.

Fast-forward (fastforward.py) stays on for the decode replicas' steady rounds: a prefill replica's round results
and the transfers' ends are heap kinds of their own, which bound every bulk run (they may change a decode pool).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from router_svc.core import ReplicaSpec, RouteDecision, RouteQuery
from router_svc.disagg import DisaggRouter
from scheduler_svc.core import SchedulerCore
from sluice.types import CoreEvents, NewRequest, ReplicaRole, RoundPlan, SamplingParams, Stage
from sluice_tools.metrics import RequestRecord
from sluice_tools.sim import outputs
from sluice_tools.sim.cluster import Simulator
from sluice_tools.sim.config import SimConfig
from sluice_tools.sim.replica import Replica
from sluice_tools.sim.transfer import LinkClock, link_profile, transfer_seconds
from sluice_tools.workload import WorkloadRequest

__all__ = ["DisaggSimulator", "Flow", "parse_split"]

_PREFILL_DONE, _TRANSFER_DONE = 100, 101
"""Heap kinds of a prefill replica's round result and of a transfer's end (not fast kinds: they bound bulk runs)."""

PREFILLING, WAITING_ROOM, TRANSFERRING, DECODING, ENDED = "prefilling", "waiting_room", "transferring", "decoding", "ended"


def parse_split(text: str) -> tuple[int, int]:
    """Return (P, D) of "P:D" (both >= 1); raises ValueError naming what is wrong."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--disagg wants P:D (prefill:decode replicas, e.g. 3:5), got {text!r}")
    prefill, decode = int(parts[0]), int(parts[1])
    if prefill < 1 or decode < 1:
        raise ValueError(f"--disagg P:D needs at least one replica on each side, got {text!r}")
    return prefill, decode


@dataclass
class Flow:
    """One request's way through the pair."""

    request: WorkloadRequest
    record: RequestRecord
    prompt: Sequence[int]
    prefill: Replica
    decode: Replica
    state: str = PREFILLING
    pinned: list[int] = field(default_factory=list)
    """Prefill-side blocks pinned for the transfer (released when its reader is done)."""
    hashes: list[int] = field(default_factory=list)
    """The prompt's full-block hashes (registered on the decode side on receipt)."""
    received: list[int] = field(default_factory=list)
    """Decode-side blocks allocated for the transfer, held until the decode core has taken them."""
    first_token: int = -1
    cached_tokens: int = 0
    """Prompt tokens the prefill side found cached (the request's own prefix reuse)."""
    preemptions: int = 0
    recomputed_tokens: int = 0
    transfer_s: float = 0.0
    waited_room_s: float = 0.0
    cancelled: bool = False


class DisaggSimulator(Simulator):
    """The Simulator with `config.disagg = (P, D)`: replicas 0..P-1 prefill, P..P+D-1 decode (module docstring)."""

    superseded_heartbeats = False  # its own events read the router's loads (see Simulator)

    def __init__(self, config: SimConfig, requests: Sequence[WorkloadRequest], **more: Any) -> None:
        """`more` goes on to the next class's constructor: the fleet's (`fleet=`) in DisaggFleetSimulator."""
        if config.disagg is None:
            raise ValueError("DisaggSimulator needs config.disagg = (prefill, decode) replicas")
        prefill, decode = config.disagg
        if prefill < 1 or decode < 1 or prefill + decode != config.replicas:
            raise ValueError(f"disagg {prefill}:{decode} must have both sides >= 1 and sum to replicas "
                             f"({config.replicas})")
        self.link = link_profile(config.kv_link)
        super().__init__(config, requests, **more)
        self.roles = {r.replica_id: (ReplicaRole.PREFILL if r.index < prefill else ReplicaRole.DECODE)
                      for r in self.replicas}
        # The prefill replicas' rounds carry no decodes, so the per-request chunk cap (which bounds the decodes'
        # inter-token latency) protects nothing there: by default one prompt may fill a round. Same core class.
        self._decode_core_config = base = self.replicas[0].core.config
        chunk = config.disagg_prefill_chunk or base.max_num_batched_tokens
        self._prefill_core_config = dataclasses.replace(base, max_prefill_chunk=chunk)
        for replica in self.replicas[:prefill]:
            replica.core = self._core_for(ReplicaRole.PREFILL, replica.replica_id)
        self.pairs = DisaggRouter(self.router)
        self.flows: dict[str, Flow] = {}
        self._decode_of: dict[str, Replica] = {}
        """Routed, not yet submitted: request id -> its decode replica (the pair's other half)."""
        self._waiting_room: dict[str, deque[Flow]] = {r.replica_id: deque() for r in self.replicas}
        self._held: dict[str, list[Flow]] = {r.replica_id: [] for r in self.replicas}
        """Per decode replica: flows received whose blocks the core has not taken yet."""
        self._links = LinkClock.empty()
        self._kv_bytes_per_token = self.cost.kv_bytes_per_token
        self.transfers = 0
        self.transferred_tokens = 0
        self.transfer_seconds_total = 0.0
        self.waited_room_total = 0.0
        self.held_block_peak = 0
        self._moving = 0
        """Flows waiting for room or in transfer (no core holds them: `_busy` must still say so)."""

    def _core_for(self, role: ReplicaRole, replica_id: str) -> SchedulerCore:
        """A fresh scheduler core for a replica of `role` (a prefill one with the lifted chunk cap)."""
        config = self._prefill_core_config if role is ReplicaRole.PREFILL else self._decode_core_config
        return SchedulerCore(config, replica_id)

    def _is_prefill(self, replica: Replica) -> bool:
        return self.roles[replica.replica_id] is ReplicaRole.PREFILL

    # ---- registration and routing ------------------------------------------------------------
    def _replica_spec(self, replica: Replica) -> ReplicaSpec:
        return dataclasses.replace(super()._replica_spec(replica), role=self.roles[replica.replica_id])

    def _handlers(self) -> dict[int, Callable[[Any], None]]:
        handlers = super()._handlers()
        handlers[_PREFILL_DONE] = self._on_round_done
        handlers[_TRANSFER_DONE] = self._on_transfer_done
        return handlers

    def _route(self, query: RouteQuery) -> RouteDecision:
        pair = self.pairs.route_pair(query, self.now)
        self._decode_of[query.request_id] = self.replicas[int(pair.decode_replica_id.rsplit("-", 1)[1])]
        return pair.prefill

    def _forget_routed(self, replica: Replica, request_id: str) -> None:
        super()._forget_routed(replica, request_id)
        decode = self._decode_of.pop(request_id, None)
        if decode is not None:
            self.pairs.on_request_done(decode.replica_id, request_id)

    def _busy(self) -> bool:
        return self._moving > 0 or super()._busy()

    # ---- prefill ----------------------------------------------------------------------------
    def _submit(self, replica: Replica, request: WorkloadRequest, record: RequestRecord,
                prompt: Sequence[int], hashes: tuple[int, ...] = ()) -> None:
        decode = self._decode_of.pop(request.request_id)
        if request.output_length <= 1:  # nothing to decode: the prefill replica serves it whole
            self.pairs.on_request_done(decode.replica_id, request.request_id)
            super()._submit(replica, request, record, prompt, hashes)
            return
        flow = Flow(request, record, prompt, replica, decode)
        self.flows[request.request_id] = flow
        super()._submit(replica, dataclasses.replace(request, output_length=1), record, prompt, hashes)
        if not record.replica and request.request_id in self.flows:  # refused by the prefill core
            del self.flows[request.request_id]
            self.pairs.on_request_done(decode.replica_id, request.request_id)

    def _start(self, replica: Replica, plan: RoundPlan) -> None:
        """As Simulator._start; a prefill replica's result goes on the heap as its own kind (it bounds bulk runs)."""
        if not self._is_prefill(replica):
            super()._start(replica, plan)
            self._release_taken(replica)
            return
        now = self.now
        result = self.cost.execute(plan)
        replica.busy = True
        self.rounds += 1
        self.push(now + self._gap + result.elapsed_s, _PREFILL_DONE, (replica, plan, result))
        if self._pipeline:
            ahead = replica.core.schedule(now, overlap=True)
            replica.ahead = None if ahead.is_empty else ahead

    def _on_round_done(self, payload: tuple[Replica, RoundPlan, Any]) -> None:
        replica, plan, result = payload
        if self._is_prefill(replica):
            self._pin_completed_prompts(replica, plan, result)
            super()._on_round_done(payload)
            return
        fast = self._fast
        if self._waiting_room[replica.replica_id]:
            # Transfers wait for this pool's blocks: take its rounds one at a time, so each allocation sees the
            # pool as of its own time (a bulk run would have spent the later rounds' blocks first).
            self._fast = False
        try:
            super()._on_round_done(payload)
        finally:
            self._fast = fast
        self._release_taken(replica)
        self._admit_waiting_transfers(replica)

    def _pin_completed_prompts(self, replica: Replica, plan: RoundPlan, result: Any) -> None:
        """The reader rule: pin the blocks of every prompt this round completes, before its result ends it."""
        if result.error:
            return
        live, flows = replica.core.requests.live, self.flows
        refused = {r.request_id for r in result.refused}
        sampled = {out.request_id: out.token_ids for out in result.outputs if out.token_ids}
        for seq in plan.seqs:
            flow = flows.get(seq.request_id)
            if flow is None or flow.state != PREFILLING or not seq.sample or seq.request_id in refused:
                continue
            request = live.get(seq.request_id)
            if request is None or request.epoch != seq.epoch or seq.request_id not in sampled:
                continue  # a stale round (the core drops its result) or no token
            blocks = list(request.block_ids)
            replica.core.pool.pin(blocks)
            flow.pinned = blocks
            full = flow.request.input_length // self.config.scheduler.block_size
            flow.hashes = list(request.block_hashes[:full])
            flow.first_token = sampled[seq.request_id][0]

    def _finish(self, replica: Replica, finished: Any) -> None:
        # Every end goes on to super()._finish (the Simulator's outputs.finish; the fleet's, which moves a request
        # its drain handed off, when composed in DisaggFleetSimulator).
        flow = self.flows.get(finished.request_id)
        if flow is None:
            super()._finish(replica, finished)
            return
        if replica is flow.prefill and flow.state == PREFILLING:
            if outputs.STATUS[finished.status] == "ok" and flow.pinned:
                self._hand_off(flow, finished)
                return
            self._unpin(flow)
            self.pairs.on_request_done(flow.decode.replica_id, finished.request_id)
            del self.flows[finished.request_id]
            super()._finish(replica, finished)
            return
        # the decode side's end: the whole request's record (the prefill's token and reuse included)
        usage = finished.usage
        usage.output_tokens += 1
        usage.cached_tokens = flow.cached_tokens
        usage.preemptions += flow.preemptions
        usage.recomputed_tokens += flow.recomputed_tokens
        flow.state = ENDED
        del self.flows[finished.request_id]
        self.pairs.on_request_done(replica.replica_id, finished.request_id)
        super()._finish(replica, finished)

    # ---- the hand-off -----------------------------------------------------------------------
    def _hand_off(self, flow: Flow, finished: Any) -> None:
        """The prompt is done and its first token out: the prefill side's request ended; move its KV."""
        rid = finished.request_id
        usage = finished.usage
        flow.cached_tokens, flow.preemptions, flow.recomputed_tokens = (usage.cached_tokens, usage.preemptions,
                                                                        usage.recomputed_tokens)
        self.router.on_request_done(flow.prefill.replica_id, rid, self.now)  # the prefill side's work is done
        self._placement[rid] = flow.decode
        flow.state = WAITING_ROOM
        self._moving += 1
        flow.waited_room_s = self.now
        room = self._waiting_room[flow.decode.replica_id]
        room.append(flow)
        self._admit_waiting_transfers(flow.decode)

    def _admit_waiting_transfers(self, decode: Replica) -> None:
        """Start the transfers waiting for room on `decode`, first come first served, while its pool can give the
        blocks of the next one."""
        room = self._waiting_room[decode.replica_id]
        pool, size = decode.core.pool, self.config.scheduler.block_size
        while room:
            flow = room[0]
            if flow.cancelled:
                room.popleft()
                self._end_cancelled_transfer(flow)
                continue
            blocks = pool.allocate(math.ceil(flow.request.input_length / size))
            if blocks is None:
                return
            room.popleft()
            flow.received = blocks
            self._start_transfer(flow)

    def _start_transfer(self, flow: Flow) -> None:
        seconds = transfer_seconds(flow.request.input_length, self._kv_bytes_per_token, self.link)
        _, end = self._links.book(flow.prefill.replica_id, flow.decode.replica_id, self.now, seconds)
        flow.waited_room_s = self.now - flow.waited_room_s
        flow.transfer_s = end - self.now
        flow.state = TRANSFERRING
        self.transfers += 1
        self.transferred_tokens += flow.request.input_length
        self.transfer_seconds_total += seconds
        self.waited_room_total += flow.waited_room_s
        self.push(end, _TRANSFER_DONE, flow)

    def _on_transfer_done(self, flow: Flow) -> None:
        """The transfer's last reader is done: the prefill side's pins go; the decode side receives and queues it."""
        self._unpin(flow)
        self._kick(flow.prefill)
        if flow.cancelled:
            self._end_cancelled_transfer(flow)
            return
        self._moving -= 1
        decode, pool = flow.decode, flow.decode.core.pool
        parent = 0
        for block, block_hash in zip(flow.received, flow.hashes, strict=False):
            pool.register(block, block_hash, parent)  # the received KV is there: findable by the prefix cache
            parent = block_hash
        flow.state = DECODING
        self._submit_decode(flow)
        self._held[decode.replica_id].append(flow)
        self.held_block_peak = max(self.held_block_peak, sum(len(f.received) for f in self._held[decode.replica_id]))
        self._kick(decode)
        self._release_taken(decode)

    def _submit_decode(self, flow: Flow) -> None:
        request, record, now = flow.request, flow.record, self.now
        deadline = None if request.deadline_s is None else record.arrival_s + request.deadline_s
        new = NewRequest(
            request.request_id, (*flow.prompt, flow.first_token),
            SamplingParams(max_tokens=request.output_length - 1, ignore_eos=True),
            tenant=request.tenant, priority=request.priority, arrival_time=record.arrival_s, deadline=deadline,
            eos_token_id=None, tenant_weight=self.admission.tenant_weight(request.tenant),
        )
        decode = flow.decode
        decode.reported_idle = False
        decode.core.submit(new, now)  # it fit the decode replica's model length and pool when routed
        self._absorb(decode, decode.core.take_events())
        self._watch_deadline(decode)

    def _release_taken(self, decode: Replica) -> None:
        """Give back the received blocks of every flow the decode core has placed (it holds its own references)."""
        held = self._held[decode.replica_id]
        if not held:
            return
        live, pool = decode.core.requests.live, decode.core.pool
        keep: list[Flow] = []
        for flow in held:
            request = live.get(flow.request.request_id)
            if request is not None and not request.block_ids:
                keep.append(flow)
                continue
            pool.free(reversed(flow.received))  # tail first, as the core frees a sequence's blocks
            flow.received = []
        self._held[decode.replica_id] = keep
        if len(keep) != len(held):
            self._admit_waiting_transfers(decode)

    def _absorb(self, replica: Replica, events: CoreEvents) -> None:
        """As Simulator._absorb; a decode replica's first scheduling of a received request is not the request's
        (that was on the prefill side, which the record keeps)."""
        if events.lifecycle and not self._is_prefill(replica):
            flows = self.flows
            events.lifecycle = [e for e in events.lifecycle
                                if not (e.stage is Stage.FIRST_SCHEDULED and e.request_id in flows)]
        super()._absorb(replica, events)

    def _unpin(self, flow: Flow) -> None:
        if flow.pinned:
            flow.prefill.core.pool.unpin(flow.pinned)
            flow.pinned = []

    # ---- cancel -----------------------------------------------------------------------------
    def _on_cancel(self, request_id: str) -> None:
        flow = self.flows.get(request_id)
        if flow is None or flow.state not in (WAITING_ROOM, TRANSFERRING):
            super()._on_cancel(request_id)
            return
        # No core holds it now: the client's record ends at once, the blocks when the transfer's reader is done.
        flow.cancelled = True
        record, now = flow.record, self.now
        record.status, record.finish_s, record.detail = "cancelled", now, "cancelled during the KV transfer"
        record.output_tokens = 1
        record.token_times = self._token_times.pop(request_id, None)
        self._placement.pop(request_id, None)
        self.front_door.release(request_id, now, None)
        self.pairs.on_request_done(flow.decode.replica_id, request_id)
        if flow.state == WAITING_ROOM:
            self._waiting_room[flow.decode.replica_id].remove(flow)
            self._end_cancelled_transfer(flow)

    def _end_cancelled_transfer(self, flow: Flow) -> None:
        self._moving -= 1
        self._unpin(flow)
        if flow.received:
            flow.decode.core.pool.free(reversed(flow.received))
            flow.received = []
        flow.state = ENDED
        self.flows.pop(flow.request.request_id, None)
        self._kick(flow.prefill)
        self._admit_waiting_transfers(flow.decode)

    # ---- report -----------------------------------------------------------------------------
    def replica_stats(self) -> dict[str, float]:
        """As Simulator.replica_stats, with the prefix hit rate of the prefill side only: a decode replica finds
        every received block in its cache, which is the transfer, not reuse."""
        totals = super().replica_stats()
        stats = [r.core.stats() for r in self.replicas if self._is_prefill(r)]
        hit, query = sum(s.prefix_hit_tokens for s in stats), sum(s.prefix_query_tokens for s in stats)
        totals["prefix_hit_rate"] = hit / query if query else 0.0
        return totals

    def disagg_report(self) -> dict[str, object]:
        """Return the hand-off's figures: split, link, transfers, tokens and bytes moved, transfer seconds."""
        prefill, decode = self.config.disagg or (0, 0)
        return {
            "prefill_replicas": prefill,
            "decode_replicas": decode,
            "link": self.link.name,
            "link_bandwidth_bytes_per_s": self.link.bandwidth_bytes_per_s,
            "link_latency_s": self.link.latency_s,
            "kv_bytes_per_token": self._kv_bytes_per_token,
            "transfers": self.transfers,
            "transferred_tokens": self.transferred_tokens,
            "transferred_bytes": self.transferred_tokens * self._kv_bytes_per_token,
            "transfer_s_mean": self.transfer_seconds_total / self.transfers if self.transfers else 0.0,
            "waited_for_room_s_mean": self.waited_room_total / self.transfers if self.transfers else 0.0,
            "pinned_blocks_left": sum(len(f.pinned) for f in self.flows.values()),
        }

