"""Every Kubernetes manifest in deploy/k8s validates offline against the Kubernetes API schemas."""

from __future__ import annotations

import copy
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
# The oldest Kubernetes the manifests are meant for (gRPC probes are GA from 1.27) and the newest
# whose schemas kubernetes-validate 1.37.0 ships.
VERSIONS = ("1.30.0", "1.37.0")
# Custom resources have no schema in the package: each is listed with the one apiVersion it must use.
CUSTOM_KINDS = {"PodMonitor": "monitoring.coreos.com/v1"}


def documents(root: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (file:index kind/name, document) for every non-empty YAML document under root, subfolders too."""
    for path in sorted(root.rglob("*.yaml")):
        for index, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc:
                name = doc.get("metadata", {}).get("name", "?")
                yield f"{path.relative_to(root)}:{index} {doc.get('kind')}/{name}", doc


def schema_errors(doc: dict[str, Any], version: str) -> list[str]:
    """Return the schema violations of one document (strict: unknown fields too), or [] when it is valid."""
    if doc.get("kind") in CUSTOM_KINDS:
        wanted = CUSTOM_KINDS[doc["kind"]]
        return [] if doc.get("apiVersion") == wanted else [f"{doc['kind']} must be {wanted}"]
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(map(str, exc.path))}: {exc.message}"]
    except SchemaNotFoundError as exc:
        return [exc.message]
    return []


def manifest_errors(root: Path, version: str) -> list[str]:
    """Return every violation of every manifest under root, each prefixed with where it is."""
    return [f"{where}: {error}" for where, doc in documents(root) for error in schema_errors(doc, version)]


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any network connection fail, so validation can only use the schemas shipped in the package."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("network access during manifest validation")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_offline(version: str, offline: None) -> None:
    """All manifests (extras included) pass strict schema validation with the network cut off."""
    found = list(documents(K8S))
    kinds = {doc["kind"] for _, doc in found}
    assert {"Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "Role", "RoleBinding",
            "ServiceAccount", "Secret", "PersistentVolumeClaim", "Ingress", "HorizontalPodAutoscaler"} <= kinds
    assert manifest_errors(K8S, version) == []


def _unknown_field(d: dict[str, Any]) -> None:
    d["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPorts"] = 1


def _wrong_type(d: dict[str, Any]) -> None:
    d["spec"]["replicas"] = "two"


def _missing_selector(d: dict[str, Any]) -> None:
    del d["spec"]["selector"]


def _bad_probe(d: dict[str, Any]) -> None:
    d["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["exec"]["command"] = "python -m sluice.healthcheck"


def _misspelled_kind(d: dict[str, Any]) -> None:
    d["kind"] = "Deploymnet"


@pytest.mark.parametrize("breaks", [_unknown_field, _wrong_type, _missing_selector, _bad_probe, _misspelled_kind])
def test_a_broken_manifest_fails_validation(breaks: Callable[[dict[str, Any]], None], tmp_path: Path,
                                            offline: None) -> None:
    """A copy of deploy/k8s with one broken field in the replica Deployment is reported, at that document."""
    root = tmp_path / "k8s"
    shutil.copytree(K8S, root)
    docs = list(yaml.safe_load_all((root / "30-replica.yaml").read_text()))
    broken = copy.deepcopy(docs[0])
    breaks(broken)
    (root / "30-replica.yaml").write_text(yaml.safe_dump_all([broken, *docs[1:]]))
    errors = manifest_errors(root, VERSIONS[0])
    assert len(errors) == 1 and errors[0].startswith("30-replica.yaml:0 "), errors


def test_a_custom_resource_with_the_wrong_api_version_fails() -> None:
    """A PodMonitor, which has no bundled schema, is still refused under an apiVersion other than the Operator's."""
    doc = yaml.safe_load((K8S / "extras" / "podmonitor.yaml").read_text())
    assert schema_errors(doc, VERSIONS[0]) == []
    doc["apiVersion"] = "monitoring.coreos.com/v1alpha1"
    assert schema_errors(doc, VERSIONS[0]) != []
