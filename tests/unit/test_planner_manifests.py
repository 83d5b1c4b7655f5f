"""The planner's Kubernetes manifests validate offline against the Kubernetes schemas, and grant exactly what the connector calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
MANIFESTS = [K8S / "70-planner-rbac.yaml", K8S / "planner" / "hpa-external-metric.yaml"]


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_planner_manifests_match_the_kubernetes_schemas(path: Path) -> None:
    """Every document validates strictly (unknown fields refused) against the bundled 1.37 schemas."""
    for doc in documents(path):
        kubernetes_validate.validate(doc, "1.37.0", strict=True)


def test_a_schema_violation_is_caught() -> None:
    """The check is not vacuous: a Role rule with a misspelt field fails validation."""
    role = next(d for d in documents(MANIFESTS[0]) if d["kind"] == "Role")
    role["rules"][0]["verb"] = role["rules"][0].pop("verbs")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(role, "1.37.0", strict=True)


def test_the_role_grants_what_the_connector_calls() -> None:
    """get/update on deployments/scale of 'replica' (read, replace) and patch on pods (deletion cost), bound to the planner."""
    docs = {d["kind"]: d for d in documents(MANIFESTS[0])}
    rules = {rule["resources"][0]: rule for rule in docs["Role"]["rules"]}
    scale, pods = rules["deployments/scale"], rules["pods"]
    assert scale["resources"] == ["deployments/scale"] and scale["resourceNames"] == ["replica"]
    assert {"get", "update"} <= set(scale["verbs"]) and "patch" in pods["verbs"] and pods["resources"] == ["pods"]
    assert docs["RoleBinding"]["subjects"][0]["name"] == docs["ServiceAccount"]["metadata"]["name"] == "planner"


def test_the_hpa_scales_the_replica_deployment_on_the_planner_figure() -> None:
    """The HPA example targets Deployment 'replica' on sluice_planner_desired_replicas with averageValue 1."""
    [hpa] = documents(MANIFESTS[1])
    assert hpa["spec"]["scaleTargetRef"]["name"] == "replica"
    [metric] = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] == "sluice_planner_desired_replicas"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
