"""Wire <-> core conversions of the router's own types: replica specs and views, route queries and decisions.

Replica states, loads and heartbeats are shared with the scheduler: they convert in `sluice.convert`.
"""

from __future__ import annotations

from router_svc.fleet import ReplicaSpec, ReplicaView
from router_svc.scoring import RouteDecision, RouteQuery
from sluice.convert import replica_state_to_proto, role_from_proto, role_to_proto
from sluice.v1 import router_pb2

__all__ = ["decision_to_proto", "query_from_proto", "replica_to_proto", "spec_from_proto"]


def spec_from_proto(msg: router_pb2.Replica) -> ReplicaSpec:
    """Return the ReplicaSpec a registering replica described (zero rates fall back to the core defaults)."""
    defaults = ReplicaSpec(replica_id="", model="")
    return ReplicaSpec(
        replica_id=msg.replica_id, model=msg.model, adapter_version=msg.adapter_version,
        address=msg.scheduler_address, block_size=msg.block_size or defaults.block_size,
        num_blocks=msg.num_blocks, max_num_batched_tokens=msg.max_num_batched_tokens or defaults.max_num_batched_tokens,
        prefill_tokens_per_s=msg.prefill_tokens_per_s or defaults.prefill_tokens_per_s,
        decode_round_s=msg.decode_round_s or defaults.decode_round_s, prefill_pair_s=msg.prefill_pair_s,
        incarnation=msg.incarnation, role=role_from_proto(msg.role),
        attention_pairs_per_token=msg.attention_pairs_per_token, attention_free_context=msg.attention_free_context,
    )


def replica_to_proto(view: ReplicaView) -> router_pb2.Replica:
    """Return the wire Replica of a registry entry."""
    spec = view.spec
    return router_pb2.Replica(
        replica_id=spec.replica_id, model=spec.model, adapter_version=spec.adapter_version,
        scheduler_address=spec.address, state=replica_state_to_proto(view.state), block_size=spec.block_size,
        num_blocks=spec.num_blocks, max_num_batched_tokens=spec.max_num_batched_tokens,
        prefill_tokens_per_s=spec.prefill_tokens_per_s, decode_round_s=spec.decode_round_s,
        prefill_pair_s=spec.prefill_pair_s, last_heartbeat_unix_s=view.last_heartbeat,
        incarnation=spec.incarnation, role=role_to_proto(spec.role),
        attention_pairs_per_token=spec.attention_pairs_per_token, attention_free_context=spec.attention_free_context,
    )


def query_from_proto(msg: router_pb2.RouteRequest) -> RouteQuery:
    """Return the core RouteQuery of a Route call."""
    return RouteQuery(request_id=msg.request_id, model=msg.model, adapter_version=msg.adapter_version,
                      block_hashes=tuple(msg.block_hashes), prompt_tokens=msg.prompt_tokens,
                      max_tokens=msg.max_tokens, tenant=msg.tenant, dry_run=msg.dry_run)


def decision_to_proto(decision: RouteDecision) -> router_pb2.RouteResponse:
    """Return the wire RouteResponse of a routing decision."""
    return router_pb2.RouteResponse(replica_id=decision.replica_id, scheduler_address=decision.address,
                                    predicted_ttft_s=decision.predicted_ttft_s,
                                    cached_blocks=decision.cached_blocks)
