"""Drift: the simulator and the services, fed the same events, produce the same load reports and routes.

The simulator runs unchanged (the subclass below only records and mirrors: every method calls the
simulator's own). Each event it gives its router is fed, at the same simulated time, to the services'
path: the scheduler's `ReplicaAgent.heartbeat_request` over a `Driver` whose core is the simulated
replica's core and whose `rates` observe the same rounds, through the wire to `RouterServicer.Heartbeat`
and `RouterServicer.Route`, KV batches and completions through `RouterRuntime.on_kv_entry` and
`on_completion`. No network: the servicer's coroutines are awaited directly on a private loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import pytest

from router_svc.core import ReplicaSpec, ReplicaView, RouteDecision, RouteQuery, RouterConfig, RouterCore
from router_svc.server import RouterRuntime, RouterServicer
from scheduler_svc.core import SchedulerCore
from scheduler_svc.driver import Driver
from scheduler_svc.server import ReplicaAgent
from sluice import convert
from sluice.core_errors import CoreError
from sluice.types import CoreEvents, ReplicaState, RoundPlan
from sluice.v1 import common_pb2, events_pb2, router_pb2
from sluice_tools.commands.sim import parse_compare_item
from sluice_tools.sim import SimConfig, Simulator, fastforward
from sluice_tools.workload import load_workload

T = TypeVar("T")

WORKLOAD = ("synthetic:poisson?rate=60&n=80&input=lognormal:700:0.5:2500&output=lognormal:40:0.5:120"
            "&prefix_groups=4&prefix_len=512")


class _Context:
    """What the servicer reads of a gRPC call context: no metadata."""

    def invocation_metadata(self) -> tuple[()]:
        return ()


class Services:
    """The services' path: one ReplicaAgent (over a Driver) per replica, the router's servicer and runtime."""

    def __init__(self, config: RouterConfig, clock: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.runtime = RouterRuntime(RouterCore(config), bus=None, clock=clock)  # type: ignore[arg-type]
        self.servicer = RouterServicer(self.runtime)
        self.agents: dict[str, ReplicaAgent] = {}

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        result = self.loop.run_until_complete(coroutine)
        for _ in range(3):  # let tasks the call started (the registration snapshot fetch) finish
            self.loop.run_until_complete(asyncio.sleep(0))
        return result

    def register(self, spec: ReplicaSpec, core: SchedulerCore) -> None:
        replica = router_pb2.Replica(
            replica_id=spec.replica_id, model=spec.model, scheduler_address=spec.address, state=router_pb2.WARMING,
            block_size=spec.block_size, num_blocks=spec.num_blocks,
            max_num_batched_tokens=spec.max_num_batched_tokens, prefill_tokens_per_s=spec.prefill_tokens_per_s,
            decode_round_s=spec.decode_round_s, prefill_pair_s=spec.prefill_pair_s)
        driver = Driver(core, None, None, replica_id=spec.replica_id, model_id=spec.model,  # type: ignore[arg-type]
                        eos_token_id=0)
        self.agents[spec.replica_id] = ReplicaAgent(driver, None, replica)  # type: ignore[arg-type]
        self.call(self.servicer.RegisterReplica(router_pb2.RegisterReplicaRequest(replica=replica), _Context()))

    def heartbeat(self, replica_id: str) -> None:
        wire = self.agents[replica_id].heartbeat_request().SerializeToString()
        self.call(self.servicer.Heartbeat(router_pb2.HeartbeatRequest.FromString(wire), _Context()))

    def route(self, query: RouteQuery) -> router_pb2.RouteResponse:
        request = router_pb2.RouteRequest(request_id=query.request_id, model=query.model,
                                          adapter_version=query.adapter_version, block_hashes=query.block_hashes,
                                          prompt_tokens=query.prompt_tokens, max_tokens=query.max_tokens)
        return self.call(self.servicer.Route(request, _Context()))

    def refuse(self, replica_id: str, request_id: str) -> None:
        """A routed request refused before it ran: the REJECTED completion admission publishes
        (`Migrator.forget_attempt`), through the router's completions consumer."""
        completion = events_pb2.Completion(request_id=request_id, tenant="default", status=common_pb2.REJECTED,
                                           finish_reason="rejected", owner="admission", replica_id=replica_id)
        self.call(self.runtime.on_completion("0-0", completion.SerializeToString(), None))  # type: ignore[arg-type]

    def absorb(self, replica_id: str, events: CoreEvents) -> None:
        for finished in events.finished:
            completion = convert.completion_to_proto(finished, replica_id=replica_id, owner="admission",
                                                     timestamps=common_pb2.LifecycleTimestamps())
            self.call(self.runtime.on_completion("0-0", completion.SerializeToString(), None))  # type: ignore[arg-type]
        if events.kv_events:
            batch = convert.kv_batch_to_proto(replica_id, events.kv_events)
            self.call(self.runtime.on_kv_entry("0-0", batch.SerializeToString(), None))  # type: ignore[arg-type]


def _picture(view: ReplicaView) -> tuple[object, ...]:
    return (view.spec.replica_id, view.state, view.load, view.inflight, view.indexed_blocks, view.last_event_id)


def _unreported(router: RouterCore) -> list[tuple[str, int, dict[str, int]]]:
    return [(v.spec.replica_id, router.fleet.get(v.spec.replica_id).unreported_tokens,
             router.fleet.get(v.spec.replica_id).unreported) for v in router.replicas()]


class MirroredSimulator(Simulator):
    """The simulator as it is, mirroring each router-facing event to `Services` and comparing the outcomes."""

    def __init__(self, config: SimConfig, requests: Sequence[Any]) -> None:
        super().__init__(config, requests)
        self.services = Services(self.router.config, lambda: self.now)  # the very config the simulated router runs
        self.heartbeats: list[tuple[float, tuple[object, ...]]] = []
        self.routes: list[tuple[str, int, str]] = []
        self.refusals = 0

    def _register(self, replica: Any) -> None:
        super()._register(replica)
        self.services.register(self._replica_spec(replica), replica.core)

    def _on_ready(self, replica: Any) -> None:
        self.services.agents[replica.replica_id].state = ReplicaState.READY  # what ReplicaAgent.run does
        super()._on_ready(replica)

    def _on_round_done(self, payload: tuple[Any, RoundPlan, Any]) -> None:
        replica, plan, result = payload
        self.services.agents[replica.replica_id].driver.rates.observe(plan, result.elapsed_s)  # as Driver._round
        super()._on_round_done(payload)

    def _heartbeat(self, replica: Any) -> None:
        super()._heartbeat(replica)
        self.services.heartbeat(replica.replica_id)
        simulated = [_picture(v) for v in self.router.replicas()]
        served = [_picture(v) for v in self.services.runtime.core.replicas()]
        assert served == simulated, f"drift at t={self.now}"
        assert _unreported(self.services.runtime.core) == _unreported(self.router), f"drift at t={self.now}"
        self.heartbeats.append((self.now, next(p for p in simulated if p[0] == replica.replica_id)))

    def _route(self, query: RouteQuery) -> RouteDecision:
        try:
            decision = super()._route(query)
        except CoreError as error:
            with pytest.raises(type(error)):
                self.services.route(query)
            raise
        served = self.services.route(query)
        assert (served.replica_id, served.cached_blocks) == (decision.replica_id, decision.cached_blocks)
        assert served.predicted_ttft_s == pytest.approx(decision.predicted_ttft_s, rel=1e-12)
        self.routes.append((query.request_id, decision.cached_blocks, decision.replica_id))
        return decision

    def _absorb(self, replica: Any, events: CoreEvents) -> None:
        self.services.absorb(replica.replica_id, events)
        super()._absorb(replica, events)

    def _forget_routed(self, replica: Any, request_id: str) -> None:
        super()._forget_routed(replica, request_id)
        self.services.refuse(replica.replica_id, request_id)
        self.refusals += 1
        assert _unreported(self.services.runtime.core) == _unreported(self.router), f"drift at t={self.now}"


def test_simulator_and_services_agree_on_every_load_report_and_routing_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a shared-prefix workload with a warm-up (early requests find no READY replica and retry), each
    heartbeat leaves the services' router with the simulator's view of every replica (state, load with
    the measured rates, in-flight, index) and each Route picks the simulator's replica, cached prefix and
    predicted TTFT."""
    # The mirror feeds the services' drivers round by round (_on_round_done), so the simulator runs every
    # round as its own event here; that the fast-forward changes nothing is test_sim_fastforward's proof.
    monkeypatch.setenv(fastforward.ENV_SWITCH, "0")
    requests = load_workload(WORKLOAD, seed=3).requests
    config = SimConfig(replicas=3, warmup_s=0.3, max_retries=5, seed=7)
    simulator = MirroredSimulator(config, requests)
    records = simulator.run()
    assert all(r.status == "ok" for r in records)
    assert any(r.retries for r in records)  # the WARMING -> READY path was crossed by traffic
    assert simulator.kv_snapshots == 0
    assert len(simulator.routes) == len(requests)
    assert sum(1 for _, cached, _ in simulator.routes if cached) > len(requests) // 4
    assert len({replica for _, _, replica in simulator.routes}) == 3
    loads = [picture[2] for _, picture in simulator.heartbeats]
    assert len(loads) > 50
    measured = [load for load in loads if load.prefill_tokens_per_s > 0 and load.decode_round_s > 0]  # type: ignore[attr-defined]
    assert measured and any(load.queued_prefill_tokens for load in loads)  # type: ignore[attr-defined]


REFUSED = ("synthetic:poisson?rate=120&n=150&input=lognormal:1500:0.6:6000&output=lognormal:30:0.5:80"
           "&prefix_groups=4&prefix_len=512")


def test_simulator_and_services_agree_when_admission_refuses_routed_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the early TTFT refusal past a tight SLO, every refusal after routing reaches the services' router as
    admission's REJECTED completion and leaves it with the simulator's unreported work and in-flight counts;
    later heartbeats and routes still agree (the refused request's tokens are taken back on both)."""
    monkeypatch.setenv(fastforward.ENV_SWITCH, "0")
    requests = load_workload(REFUSED, seed=5).requests
    config = parse_compare_item("early-refusal", SimConfig(replicas=2, slo_ttft_s=0.12, seed=7))
    simulator = MirroredSimulator(config, requests)
    records = simulator.run()
    refused = sum(r.status == "rejected" for r in records)
    assert refused == simulator.refusals and 10 < refused < len(requests) - 10
    assert len(simulator.routes) == len(requests)
    assert _unreported(simulator.router) == [(f"replica-{i}", 0, {}) for i in range(2)]
