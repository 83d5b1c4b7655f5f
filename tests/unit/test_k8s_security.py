"""Every pod of the hand-written Kubernetes manifests runs locked down, as the Helm chart's do."""

from __future__ import annotations

from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def test_every_pod_and_container_of_the_manifests_is_locked_down() -> None:
    """runAsNonRoot and seccomp RuntimeDefault on each Deployment's and Job's pod, no service-account token but the
    planner's; every container (init containers too) without privilege escalation, with a read-only root
    filesystem and every capability dropped."""
    seen = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") not in ("Deployment", "Job"):
                continue
            name, spec = doc["metadata"]["name"], doc["spec"]["template"]["spec"]
            seen.append(name)
            assert spec["securityContext"]["runAsNonRoot"] is True, name
            assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
            assert spec.get("automountServiceAccountToken", True) is (name == "planner"), name
            for container in spec["containers"] + spec.get("initContainers", []):
                context = container["securityContext"]
                assert context == {**context, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                   "capabilities": {"drop": ["ALL"]}}, (name, container["name"])
    assert {"router", "replica", "admission", "planner", "redis", "model-init-tiny"} <= set(seen)
