"""The caller table covers every internal RPC, and the role check reads the peer certificate's name."""

from __future__ import annotations

from sluice.tls import CALLERS, ROLES, may_call
from sluice.v1 import router_pb2, scheduler_pb2, worker_pb2


def test_every_internal_rpc_names_its_callers() -> None:
    """Each RPC of the router, scheduler and worker services is in CALLERS with known roles (a new RPC must be)."""
    methods = {f"/{service.full_name}/{method.name}"
               for module in (router_pb2, scheduler_pb2, worker_pb2)
               for service in module.DESCRIPTOR.services_by_name.values() for method in service.methods}
    assert methods == set(CALLERS)
    assert all(roles and roles <= set(ROLES) for roles in CALLERS.values())


def test_may_call_refuses_unknown_roles_and_methods_and_admits_health() -> None:
    """A missing role or an unlisted method is refused; health and reflection are open to any authenticated peer."""
    assert may_call("/sluice.v1.SchedulerService/Submit", "admission")
    assert not may_call("/sluice.v1.SchedulerService/Submit", "worker")
    assert not may_call("/sluice.v1.SchedulerService/Submit", None)
    assert not may_call("/sluice.v1.SchedulerService/NewRpc", "admission")
    assert may_call("/grpc.health.v1.Health/Check", "worker")
    assert not may_call("/grpc.health.v1.Health/Check", None)
