"""Wire <-> core conversions of the router: replicas, loads, route queries and decisions, KV events."""

from __future__ import annotations

from router_svc.core import ReplicaLoad, ReplicaSpec, ReplicaState, ReplicaView, RouteDecision, RouteQuery
from sluice.v1 import router_pb2

__all__ = [
    "load_from_proto", "query_from_proto", "decision_to_proto", "replica_to_proto",
    "spec_from_proto", "state_from_proto", "state_to_proto",
]

_STATE_TO_PROTO: dict[ReplicaState, router_pb2.ReplicaState] = {
    ReplicaState.WARMING: router_pb2.WARMING,
    ReplicaState.READY: router_pb2.READY,
    ReplicaState.DRAINING: router_pb2.DRAINING,
    ReplicaState.GONE: router_pb2.GONE,
    ReplicaState.UNHEALTHY: router_pb2.UNHEALTHY,
}
_STATE_FROM_PROTO: dict[int, ReplicaState] = {int(v): k for k, v in _STATE_TO_PROTO.items()}


def state_to_proto(state: ReplicaState | None) -> router_pb2.ReplicaState:
    """Return the wire ReplicaState (None, an unknown replica, is GONE)."""
    return _STATE_TO_PROTO[state] if state is not None else router_pb2.GONE


def state_from_proto(value: int) -> ReplicaState | None:
    """Return the core ReplicaState of a wire value (None for UNSPECIFIED)."""
    return _STATE_FROM_PROTO.get(value)


def spec_from_proto(msg: router_pb2.Replica) -> ReplicaSpec:
    """Return the ReplicaSpec a registering replica described (zero rates fall back to the core defaults)."""
    defaults = ReplicaSpec(replica_id="", model="")
    return ReplicaSpec(
        replica_id=msg.replica_id, model=msg.model, adapter_version=msg.adapter_version,
        address=msg.scheduler_address, block_size=msg.block_size or defaults.block_size,
        num_blocks=msg.num_blocks, max_num_batched_tokens=msg.max_num_batched_tokens or defaults.max_num_batched_tokens,
        prefill_tokens_per_s=msg.prefill_tokens_per_s or defaults.prefill_tokens_per_s,
        decode_round_s=msg.decode_round_s or defaults.decode_round_s,
    )


def replica_to_proto(view: ReplicaView) -> router_pb2.Replica:
    """Return the wire Replica of a registry entry."""
    spec = view.spec
    return router_pb2.Replica(
        replica_id=spec.replica_id, model=spec.model, adapter_version=spec.adapter_version,
        scheduler_address=spec.address, state=state_to_proto(view.state), block_size=spec.block_size,
        num_blocks=spec.num_blocks, max_num_batched_tokens=spec.max_num_batched_tokens,
        prefill_tokens_per_s=spec.prefill_tokens_per_s, decode_round_s=spec.decode_round_s,
        last_heartbeat_unix_s=view.last_heartbeat,
    )


def load_from_proto(msg: router_pb2.ReplicaLoad) -> ReplicaLoad:
    """Return the core ReplicaLoad of a heartbeat's load (measured rates 0 when the replica has none yet)."""
    return ReplicaLoad(waiting=msg.waiting, running=msg.running, queued_prefill_tokens=msg.queued_prefill_tokens,
                       kv_blocks_free=msg.kv_blocks_free, prefill_tokens_per_s=max(msg.prefill_tokens_per_s, 0.0),
                       decode_round_s=max(msg.decode_round_s, 0.0))


def query_from_proto(msg: router_pb2.RouteRequest) -> RouteQuery:
    """Return the core RouteQuery of a Route call."""
    return RouteQuery(request_id=msg.request_id, model=msg.model, adapter_version=msg.adapter_version,
                      block_hashes=tuple(msg.block_hashes), prompt_tokens=msg.prompt_tokens,
                      max_tokens=msg.max_tokens)


def decision_to_proto(decision: RouteDecision) -> router_pb2.RouteResponse:
    """Return the wire RouteResponse of a routing decision."""
    return router_pb2.RouteResponse(replica_id=decision.replica_id, scheduler_address=decision.address,
                                    predicted_ttft_s=decision.predicted_ttft_s,
                                    cached_blocks=decision.cached_blocks)
