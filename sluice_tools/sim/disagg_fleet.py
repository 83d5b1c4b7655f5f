"""Disaggregated pools sized apart in the simulator: `sluice sim WORKLOAD --disagg P:D --autoscale MIN:MAX`.

Theory of operation. `DisaggFleetSimulator` is `DisaggSimulator` (disagg.py: pairs, pinned prompts, the KV
transfer) composed with `FleetSimulator` (fleet.py: observations, scale-up, drain, migration, GPU-seconds) by
the classes' own order (`DisaggSimulator` first, then `FleetSimulator`, then `Simulator`); it adds only what the
pair changes in the fleet's life:

- decisions: `planner_svc.pools.PoolPlanner`, the planner `sluice up --disagg P:D --autoscale MIN:MAX` runs,
  decides for each pool from the one observation whose replicas carry their roles; a pool's ScaleUp starts
  replicas of its role (WARMING, holding a GPU, READY after that pool's load + warm-up), its ScaleDown drains the
  replica of that pool it names;
- a draining replica is routed nothing new (`RouterCore.drain`: the pair router takes READY replicas only) and
  retires when its core is empty *and* the pair ties no request to it: a prefill replica while prompts it
  computed are pinned for a transfer (waiting for room or moving), a decode replica while requests whose decode
  half is bound for it are still prefilling elsewhere, wait for room, move, or are held for its core;
- at the drain timeout the fleet hands the core's requests to migration, as for an aggregated replica; what the
  pair adds: a prompt pinned on the replica or bound for it and still waiting for room is moved at once (its pin
  released, its prompt + first token recomputed elsewhere), a request bound for a decode replica and still
  prefilling is handed over at its prefill replica, and a transfer that lands on a decode replica past its
  timeout is handed over as it lands. A moved request goes through a new pair (prefill with prompt + streamed
  tokens, transfer, decode), so its tokens continue and none is lost or counted twice (fleet.py's migration);
- GPU-seconds and a timeline per replica, summed per pool in the report's `fleet.pools`.

Crashes (`FleetConfig.crash_at_s`) are not simulated for pools: refused.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from typing import Any

from planner_svc.config import PlannerConfig
from planner_svc.core import Decision
from planner_svc.pools import PoolPlanner
from planner_svc.signals import Observation
from sluice.core_errors import RequestRejected
from sluice.types import ReplicaRole, ReplicaState
from sluice_tools.metrics import RequestRecord
from sluice_tools.sim.config import SimConfig
from sluice_tools.sim.disagg import (
    DECODING,
    ENDED,
    PREFILLING,
    TRANSFERRING,
    WAITING_ROOM,
    DisaggSimulator,
    Flow,
)
from sluice_tools.sim.fleet import FleetConfig, FleetSimulator
from sluice_tools.sim.replica import Replica
from sluice_tools.workload import WorkloadRequest

__all__ = ["POOLS", "DisaggFleetSimulator"]

POOLS = (ReplicaRole.PREFILL, ReplicaRole.DECODE)


class DisaggFleetSimulator(DisaggSimulator, FleetSimulator):
    """P prefill and D decode replicas whose pools the pool planner sizes apart (module docstring)."""

    def __init__(self, config: SimConfig, requests: Sequence[WorkloadRequest], fleet: FleetConfig) -> None:
        """Raises ValueError for a bad split or a crash asked of pools."""
        if fleet.crash_at_s is not None:
            raise ValueError("crashes are not simulated for disaggregated pools (FleetConfig.crash_at_s)")
        super().__init__(config, requests, fleet=fleet)
        self.pools = fleet.pools_config()
        self.pool_planner = PoolPlanner(self.pools)
        self._expired: set[str] = set()
        """Draining replicas past their drain timeout: nothing more lands on them."""

    def _pool_config(self, role: ReplicaRole) -> PlannerConfig:
        return self.pools.prefill if role is ReplicaRole.PREFILL else self.pools.decode

    # ---- the fleet's hooks ------------------------------------------------------------------
    def _decide(self, observation: Observation) -> list[tuple[ReplicaRole, Decision]]:
        decisions = self.pool_planner.step(observation)
        return [(ReplicaRole.PREFILL, decisions.prefill), (ReplicaRole.DECODE, decisions.decode)]

    def _role_of(self, replica: Replica) -> ReplicaRole:
        return self.roles[replica.replica_id]

    def _new_replica(self, index: int, role: ReplicaRole) -> Replica:
        replica_id = f"replica-{index}"
        self.roles[replica_id] = role  # before registration: the router learns the role from the spec
        self._waiting_room[replica_id] = deque()
        self._held[replica_id] = []
        return Replica(index, replica_id, self._core_for(role, replica_id))

    def _ready_delay_s(self, role: ReplicaRole) -> float:
        return self._pool_config(role).ready_delay_s

    def _holds_more(self, replica: Replica) -> bool:
        """True while the pair ties a request to the replica outside its core: a prompt computed there and pinned
        for its transfer, or a request whose decode half is bound for it (still prefilling elsewhere, waiting for
        room, moving, or held until its core takes the blocks)."""
        if self._held[replica.replica_id]:
            return True
        for flow in self.flows.values():
            if flow.decode is replica and flow.state != DECODING:
                return True
            if flow.prefill is replica and flow.state in (WAITING_ROOM, TRANSFERRING):
                return True
        return False

    def _submit_moved(self, replica: Replica, request: WorkloadRequest, prompt: tuple[int, ...],
                      max_tokens: int) -> None:
        """A moved request runs as a new pair: its prompt (+ streamed tokens) on `replica`, the prefill side the
        route chose, with max_tokens 1, then a transfer and its decodes on the decode side."""
        rid = request.request_id
        decode = self._decode_of.pop(rid)
        if max_tokens <= 1:  # nothing to decode: the prefill replica serves it whole
            self.pairs.on_request_done(decode.replica_id, rid)
            super()._submit_moved(replica, request, prompt, max_tokens)
            return
        attempt = dataclasses.replace(request, input_length=len(prompt), output_length=max_tokens,
                                      cancel_after_s=None)
        self.flows[rid] = Flow(attempt, self.records[rid], prompt, replica, decode)
        try:
            super()._submit_moved(replica, request, prompt, 1)
        except RequestRejected:
            del self.flows[rid]
            self.pairs.on_request_done(decode.replica_id, rid)
            raise

    # ---- drain across the pair --------------------------------------------------------------
    def _on_drain_deadline(self, replica: Replica) -> None:
        if replica.state is ReplicaState.DRAINING:
            self._expired.add(replica.replica_id)
            self._move_waiting()
            # Requests whose decode half is bound here and still prefilling elsewhere: handed over where they are.
            for flow in [f for f in self.flows.values() if f.decode is replica and f.state == PREFILLING]:
                self._hand_over(flow.prefill, [flow.request.request_id])
        super()._on_drain_deadline(replica)

    def _move_waiting(self) -> None:
        """Move every prompt waiting for room whose prefill or decode replica is past its drain timeout: its pin is
        released and the request placed again (prompt + first token recomputed on a new pair). Nothing waits for a
        replica past its timeout afterwards: the router pairs it with nothing new, and what was bound for it and
        still prefilling was handed over at the timeout."""
        expired = self._expired
        stuck = [flow for room in self._waiting_room.values() for flow in room
                 if flow.prefill.replica_id in expired or flow.decode.replica_id in expired]
        for flow in stuck:
            self._waiting_room[flow.decode.replica_id].remove(flow)
            rid = flow.request.request_id
            self._moving -= 1
            self._unpin(flow)
            flow.state = ENDED
            del self.flows[rid]
            self.pairs.on_request_done(flow.decode.replica_id, rid)
            self._placement.pop(rid, None)
            self._kick(flow.prefill)
            self._move(rid, "handed_off")
            self._retire_if_drained(flow.prefill)
            self._retire_if_drained(flow.decode)

    def _on_transfer_done(self, flow: Flow) -> None:
        super()._on_transfer_done(flow)
        decode = flow.decode
        if flow.state == DECODING and decode.replica_id in self._expired:
            self._hand_over(decode, [flow.request.request_id])
            self._release_taken(decode)
        self._retire_if_drained(flow.prefill)
        self._retire_if_drained(decode)

    def _end_cancelled_transfer(self, flow: Flow) -> None:
        super()._end_cancelled_transfer(flow)
        self._retire_if_drained(flow.prefill)
        self._retire_if_drained(flow.decode)

    def _finish(self, replica: Replica, finished: Any) -> None:
        flow = self.flows.get(finished.request_id)
        super()._finish(replica, finished)
        if flow is not None and flow.decode is not replica:  # a prompt ended: its decode replica may be free now
            self._retire_if_drained(flow.decode)

    def _on_round_done(self, payload: tuple[Replica, Any, Any]) -> None:
        super()._on_round_done(payload)
        self._retire_if_drained(payload[0])  # again: a decode replica gives back held blocks after the fleet's check

    # ---- report -----------------------------------------------------------------------------
    def run(self) -> list[RequestRecord]:
        """Play the workload with both pools changing under it; fill `report`, its `pools` included."""
        records = super().run()
        events = self.report.scale_events
        start = {ReplicaRole.PREFILL: self.config.disagg[0] if self.config.disagg else 0,
                 ReplicaRole.DECODE: self.config.disagg[1] if self.config.disagg else 0}
        pools: dict[str, dict[str, Any]] = {}
        for role in POOLS:
            ids = [r.replica_id for r in self.replicas if self.roles[r.replica_id] is role]
            mine = [e for e in events if e.get("pool") == role.value]
            pools[role.value] = {
                "gpu_seconds": sum(self._gpu_seconds(rid) for rid in ids),
                "scale_ups": sum(1 for e in mine if e["kind"] == "scale_up"),
                "scale_downs": sum(1 for e in mine if e["kind"] == "scale_down"),
                "peak_replicas": max([start[role], *(e["pool_replicas_after"] for e in mine)]),
                "replicas": [self._timeline(rid) for rid in ids],
            }
        self.report.pools = pools
        return records
