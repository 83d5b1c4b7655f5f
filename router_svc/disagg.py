"""Prefill/decode disaggregation in the router: a request gets a pair, a prefill replica and a decode replica.

Rules
-----
* Roles come with registration (`ReplicaSpec.role`): PREFILL replicas run prompts, DECODE replicas run the
  decodes of requests whose KV blocks a prefill replica sent, BOTH replicas (the default) may do either. A fleet
  with no PREFILL or DECODE replica is aggregated: `is_disaggregated` is False and `RouterCore.route` serves it.
* Prefill side: among READY replicas that prefill, the router's own policy chooses (SCORE: minimum predicted
  TTFT, in which prefix reuse counts, since the prompt's KV is computed there) and the choice is recorded as
  `RouterCore.route` records it (routed-but-unreported prefill work, the predicted prefix).
* Decode side: among READY replicas that decode, the one with room for the request's KV (prompt + max_tokens,
  in blocks: the reported free blocks less what was routed there since that report) and, among those, the
  least decode load (running requests reported + decodes routed there and not done); then the most free blocks;
  then the id. With no replica that has room, the one with the most room is chosen (its scheduler queues the
  request until blocks free, as it does for any request). Prefix reuse does not count on this side: the blocks
  arrive with the transfer.
* A pair whose two ends are one BOTH replica is aggregated serving of that request: no transfer.
* `on_request_done` forgets a request's decode-side claim (the services call it with the router core's own).
  Claims are keyed by the request's own id (`origin_request_id`): the decode half runs as a later attempt.

Pure: no clock, no I/O; `now` is an argument; the tie-breaks are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router_svc.core import RouterCore
from router_svc.fleet import Replica
from router_svc.scoring import RouteDecision, RouteQuery, predict_ttft
from sluice.core_errors import NoReplicaAvailable
from sluice.types import ReplicaRole, origin_request_id

__all__ = ["DecodeClaims", "DisaggRouter", "PairDecision", "decode_key", "is_disaggregated"]


@dataclass(frozen=True)
class PairDecision:
    """Where one request runs: its prompt (`prefill`, the usual decision) and its decodes."""

    prefill: RouteDecision
    decode_replica_id: str
    decode_address: str
    decode_free_blocks: int
    """The decode replica's KV room, in blocks, when it was chosen (reported less routed since)."""
    decode_load: int
    """Its decode load when it was chosen: running + routed decodes not done."""

    @property
    def transfers(self) -> bool:
        """Return True when the KV blocks move (the two ends are different replicas)."""
        return self.decode_replica_id != self.prefill.replica_id


@dataclass
class DecodeClaims:
    """What the router routed to one decode replica and has not seen done: request id -> (blocks, routed at)."""

    claims: dict[str, tuple[int, float]] = field(default_factory=dict)

    def unreported_blocks(self, last_heartbeat: float) -> int:
        """Return the blocks claimed at or after the replica's last heartbeat (which cannot have counted them)."""
        return sum(blocks for blocks, at in self.claims.values() if at >= last_heartbeat)


def is_disaggregated(core: RouterCore) -> bool:
    """Return True when any registered replica has a PREFILL or DECODE role."""
    return any(view.spec.role is not ReplicaRole.BOTH for view in core.replicas())


def decode_key(replica: Replica, claims: DecodeClaims, need_blocks: int) -> tuple[bool, int, int, str]:
    """Return the sort key of a decode candidate (smallest wins): (no room, decode load, -room, id).

    Room is the smaller of two views: the reported free blocks less the claims routed since that report, and the
    replica's blocks less every claim not done (a request still in its prefill holds no block there yet, so the
    report alone would miss it). Load counts the requests routed there and not done, on both sides (decode claims
    and the core's own in-flight prefill routes), which no heartbeat has to confirm."""
    claimed = claims.claims
    reported = replica.load.kv_blocks_free - claims.unreported_blocks(replica.last_heartbeat)
    planned = replica.spec.num_blocks - sum(blocks for blocks, _ in claimed.values())
    room = min(reported, planned) if replica.spec.num_blocks > 0 else reported
    load = len(claimed) + len(replica.inflight)
    return (room < need_blocks, load, -room, replica.spec.replica_id)


class DisaggRouter:
    """Pairs for a RouterCore's fleet; holds the decode-side claims the core's fleet table does not."""

    def __init__(self, core: RouterCore) -> None:
        self.core = core
        self.claims: dict[str, DecodeClaims] = {}
        self.transfers = 0
        """Pairs routed whose two ends differ."""

    def route_pair(self, query: RouteQuery, now: float) -> PairDecision:
        """Choose a prefill and a decode replica for `query` and record both (unless `query.dry_run`). Raises UnknownModel (no replica of that model at
        all) or NoReplicaAvailable (no READY replica that prefills, or none that decodes)."""
        core = self.core
        core.index.prune(now)
        ready = core.fleet.ready_for(query.model, query.adapter_version)
        prefillers = [r for r in ready if r.spec.role.prefills]
        decoders = [r for r in ready if r.spec.role.decodes]
        if not prefillers or not decoders:
            side = "prefill" if not prefillers else "decode"
            raise NoReplicaAvailable(f"no READY {side} replica of model {query.model!r}")
        chosen = core.policy.choose(prefillers, query, now)
        cached = core.index.cached(chosen.cache, query.block_hashes, now)
        ttft, queue_wait, prefill = predict_ttft(chosen, query, cached)
        prefill_decision = RouteDecision(chosen.spec.replica_id, chosen.spec.address, ttft, queue_wait, prefill,
                                         cached)
        if not query.dry_run:
            core._record(chosen, query, cached, now)  # the same bookkeeping as RouterCore.route
        need = -(-(query.prompt_tokens + query.max_tokens) // max(chosen.spec.block_size, 1))
        decoder = self._choose_decoder(decoders, chosen, need)
        room_key = decode_key(decoder, self.claims.get(decoder.spec.replica_id, DecodeClaims()), need)
        pair = PairDecision(prefill_decision, decoder.spec.replica_id, decoder.spec.address, -room_key[2],
                            room_key[1])
        if query.dry_run:  # a prediction: nothing is claimed on either side
            return pair
        # Keyed by the request's own id: its decode half runs as a later attempt (`{id}#{n}`, admission's hand-off).
        self.claims.setdefault(decoder.spec.replica_id, DecodeClaims()).claims[origin_request_id(query.request_id)] = (
            need, now)
        if pair.transfers:
            self.transfers += 1
        return pair

    def _choose_decoder(self, decoders: list[Replica], prefiller: Replica, need: int) -> Replica:
        """The decode side's rule (module docstring); a BOTH prefill replica that is also the best decoder keeps
        the request (no transfer)."""
        empty = DecodeClaims()
        keyed = [(decode_key(r, self.claims.get(r.spec.replica_id, empty), need), r) for r in decoders]
        fits = [(key, r) for key, r in keyed if not key[0]]
        if fits:
            return min(fits, key=lambda item: item[0])[1]
        return min(keyed, key=lambda item: (item[0][2], item[0][3]))[1]  # no room anywhere: the most room

    def on_request_done(self, decode_replica_id: str, request_id: str) -> None:
        """Forget the request's decode-side claim (refused, failed, cancelled or finished); unknown ids are
        ignored."""
        claims = self.claims.get(decode_replica_id)
        if claims is not None:
            claims.claims.pop(origin_request_id(request_id), None)
            if not claims.claims:
                del self.claims[decode_replica_id]
