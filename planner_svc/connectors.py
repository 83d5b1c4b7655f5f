"""Connectors: the I/O that carries out the planner's decisions on a real fleet.

The core decides; a connector acts. Every connector answers the same three calls (`ReplicaConnector`):
how many replicas there are, add n, remove this one. `apply_decision` maps a decision onto them.

* `KubernetesConnector` sets `spec.replicas` of the replica Deployment through its scale
  subresource with the official `kubernetes` client (optimistic concurrency: a write carries the
  resourceVersion it read, and a 409 Conflict is read again and retried). To remove one named
  replica it first lowers that pod's `controller.kubernetes.io/pod-deletion-cost`, so the
  ReplicaSet deletes that pod and not another; the pod's SIGTERM then drains its scheduler.
  RBAC it needs: deploy/k8s/70-planner-rbac.yaml. The pool planner gets one per pool, each scaling
  its pool's Deployment (`python -m planner_svc --pools`).
* `PrometheusConnector` acts on nothing: the planner loop's desired and current replica gauges
  are the output, for clusters whose own autoscaler (an HPA on an external metric) does the scaling.
  `PoolPrometheusConnector` is the same for one pool of the pool planner (its gauges' `pool` label).
* `LocalProcessConnector` adapts a `ReplicaLauncher` (start, stop, list replica processes on this
  machine), which `sluice up --autoscale` implements.

The calls block (the kubernetes client is synchronous); an asyncio caller runs them in a thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from planner_svc.core import Decision, ScaleDown, ScaleUp

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

    from planner_svc.driver import PlannerMetrics, PoolPlannerMetrics

# Lower than any cost a pod gets by default (0): the ReplicaSet deletes this pod first on scale-down.
POD_DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
VICTIM_DELETION_COST = "-1000000"


class ReplicaConnector(Protocol):
    """Where the replicas live: count them, add some, remove a named one."""

    def current_replicas(self) -> int:
        """The number of replicas asked for (running, starting or draining)."""
        ...

    def add(self, n: int) -> None:
        """Start `n` more replicas."""
        ...

    def remove(self, replica_id: str) -> None:
        """Drain and retire this replica (and only this one)."""
        ...


def apply_decision(connector: ReplicaConnector, decision: Decision) -> bool:
    """Carry out a decision; return True if it changed the fleet (a Hold changes nothing)."""
    if isinstance(decision, ScaleUp):
        connector.add(decision.n)
        return True
    if isinstance(decision, ScaleDown):
        connector.remove(decision.replica_id)
        return True
    return False


class KubernetesConnector:
    """Scales the replica Deployment through its scale subresource; replica ids are pod names."""

    def __init__(self, api_client: ApiClient, namespace: str = "sluice", deployment: str = "replica",
                 conflict_retries: int = 5) -> None:
        from kubernetes import client

        self._apps = client.AppsV1Api(api_client)
        self._core = client.CoreV1Api(api_client)
        self.namespace, self.deployment, self.conflict_retries = namespace, deployment, conflict_retries

    def current_replicas(self) -> int:
        """spec.replicas of the Deployment's scale. Raises kubernetes ApiException on an API error."""
        scale = self._apps.read_namespaced_deployment_scale(self.deployment, self.namespace)
        return int(scale.spec.replicas or 0) if scale.spec else 0

    def add(self, n: int) -> None:
        """Raise spec.replicas by n. Raises ApiException (409 after `conflict_retries` lost races)."""
        self._update(lambda replicas: replicas + n)

    def remove(self, replica_id: str) -> None:
        """Mark pod `replica_id` cheapest to delete, then lower spec.replicas by one.

        Raises ApiException (404 when there is no such pod: nothing is scaled then).
        """
        body = {"metadata": {"annotations": {POD_DELETION_COST_ANNOTATION: VICTIM_DELETION_COST}}}
        self._core.patch_namespaced_pod(replica_id, self.namespace, body,
                                        _content_type="application/merge-patch+json")
        self._update(lambda replicas: max(0, replicas - 1))

    def _update(self, change: Callable[[int], int]) -> None:
        from kubernetes.client.exceptions import ApiException

        for attempt in range(self.conflict_retries + 1):
            scale = self._apps.read_namespaced_deployment_scale(self.deployment, self.namespace)
            assert scale.spec is not None
            scale.spec.replicas = change(int(scale.spec.replicas or 0))
            try:
                # The read resourceVersion rides along: a write that raced another one gets 409.
                self._apps.replace_namespaced_deployment_scale(self.deployment, self.namespace, scale)
                return
            except ApiException as error:
                if error.status != 409 or attempt == self.conflict_retries:
                    raise


class PrometheusConnector:
    """For clusters whose own autoscaler acts: the planner only publishes its figure, the HPA scales.

    The figure is `PlannerMetrics.desired` (sluice_planner_desired_replicas), set by the planner loop;
    this connector changes nothing else, so the loop can run unchanged with it (docs/planner.md has
    the HPA example). `current_replicas` is the count the loop last observed.
    """

    def __init__(self, metrics: PlannerMetrics) -> None:
        self.metrics = metrics

    def current_replicas(self) -> int:
        return int(self.metrics.registry.get_sample_value("sluice_planner_current_replicas") or 0)

    def add(self, n: int) -> None:
        """Nothing to do: the loop has raised the desired gauge; the external autoscaler acts on it."""

    def remove(self, replica_id: str) -> None:
        """Nothing to do: the loop has lowered the desired gauge and named the retire candidate."""


class PoolPrometheusConnector:
    """PrometheusConnector for one pool of the pool planner: its figure is the pool's
    `sluice_planner_pool_desired_replicas{pool}` (PoolPlannerMetrics, set by PoolPlannerLoop), for an external
    autoscaler of that pool's Deployment; `current_replicas` is the pool's count the loop last observed."""

    def __init__(self, metrics: PoolPlannerMetrics, pool: str) -> None:
        self.metrics, self.pool = metrics, pool

    def current_replicas(self) -> int:
        value = self.metrics.registry.get_sample_value("sluice_planner_pool_current_replicas", {"pool": self.pool})
        return int(value or 0)

    def add(self, n: int) -> None:
        """Nothing to do: the loop has raised the pool's desired gauge; the external autoscaler acts on it."""

    def remove(self, replica_id: str) -> None:
        """Nothing to do: the loop has lowered the pool's desired gauge."""


class ReplicaLauncher(Protocol):
    """Starts and stops replica processes on this machine (implemented by `sluice up --autoscale`)."""

    def start_replica(self) -> str:
        """Start one replica (scheduler + worker); return its replica id. It registers with the router itself."""
        ...

    def stop_replica(self, replica_id: str) -> None:
        """Drain the replica, then stop its processes."""
        ...

    def replica_ids(self) -> Sequence[str]:
        """The replicas started and not yet stopped."""
        ...


class LocalProcessConnector:
    """A ReplicaConnector over a ReplicaLauncher: replica processes on this machine."""

    def __init__(self, launcher: ReplicaLauncher) -> None:
        self.launcher = launcher

    def current_replicas(self) -> int:
        return len(self.launcher.replica_ids())

    def add(self, n: int) -> None:
        for _ in range(n):
            self.launcher.start_replica()

    def remove(self, replica_id: str) -> None:
        """Stop that replica. Raises KeyError if the launcher did not start it."""
        if replica_id not in self.launcher.replica_ids():
            raise KeyError(f"no local replica {replica_id!r}; running: {sorted(self.launcher.replica_ids())}")
        self.launcher.stop_replica(replica_id)
