"""The full gRPC names of Sluice's services, read from the protos (health checks and reflection use them)."""

from __future__ import annotations

from sluice.v1 import admission_pb2, router_pb2, scheduler_pb2, worker_pb2

ADMISSION = admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"].full_name
ROUTER = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name
SCHEDULER = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name
WORKER = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
