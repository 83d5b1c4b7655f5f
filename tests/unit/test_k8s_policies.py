"""The Kubernetes manifests let each service reach only what it calls, keep secrets off command lines, and give the planner only the scale it needs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
APPS = ("admission", "router", "replica", "redis", "otel-collector", "jaeger", "planner")
# Who calls whom on which port, and nothing else (inside the namespace; DNS and outside peers aside).
CALLS = {
    ("admission", "router", 50052), ("admission", "replica", 50071), ("admission", "redis", 6379),
    ("router", "redis", 6379), ("router", "replica", 50071),
    ("replica", "router", 50052), ("replica", "redis", 6379),
    ("planner", "router", 50052), ("planner", "replica", 50071),
    *((app, "otel-collector", port) for app in ("admission", "router", "replica", "planner") for port in (4317, 4318)),
    ("otel-collector", "jaeger", 4317),
}
PORTS = {50051, 50052, 50061, 50071, 6379, 4317, 4318, 16686, 9464, 9465}


def load(pattern: str = "*.yaml") -> list[dict[str, Any]]:
    """Return every document of the manifests applied by `kubectl apply -f deploy/k8s/`."""
    return [doc for path in sorted(K8S.glob(pattern)) for doc in yaml.safe_load_all(path.read_text()) if doc]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Return whether a label selector (matchLabels, matchExpressions with In) matches the labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


Pod = str | dict[str, str]
"""A pod: its app label (app=NAME), or all its labels."""


def labels_of(pod: Pod) -> dict[str, str]:
    """Return the labels of a pod given as its app name or as its labels."""
    return {"app": pod} if isinstance(pod, str) else pod


def rule_allows(rules: list[dict[str, Any]], side: str, peer: Pod, port: int) -> bool:
    """Return whether one of the ingress/egress rules admits the in-namespace pod `peer` on TCP port."""
    for rule in rules:
        peers = rule.get(side)
        ports = rule.get("ports")
        peer_ok = peers is None or any(
            "podSelector" in p and "namespaceSelector" not in p and selects(p["podSelector"], labels_of(peer))
            for p in peers)
        port_ok = ports is None or any(p.get("protocol", "TCP") == "TCP" and p.get("port") == port for p in ports)
        if peer_ok and port_ok:
            return True
    return False


def allowed(policies: list[dict[str, Any]], source: Pod, target: Pod, port: int) -> bool:
    """Return whether the policies let pod `source` open TCP port on pod `target` (both directions checked)."""
    def side(pod: Pod, kind: str, field: str, peer: Pod) -> bool:
        chosen = [p["spec"] for p in policies if selects(p["spec"]["podSelector"], labels_of(pod))
                  and kind in p["spec"]["policyTypes"]]
        return not chosen or any(rule_allows(spec.get(field, []), "to" if field == "egress" else "from", peer, port)
                                 for spec in chosen)
    return side(source, "Egress", "egress", target) and side(target, "Ingress", "ingress", source)


def test_network_policies_allow_exactly_the_calls_each_service_makes() -> None:
    """Among the namespace's pods, the allowed (caller, callee, port) triples are exactly the service call graph."""
    policies = [d for d in load() if d["kind"] == "NetworkPolicy"]
    opened = {(s, t, port) for s in APPS for t in APPS for port in PORTS if s != t and allowed(policies, s, t, port)}
    assert opened == CALLS, f"extra: {sorted(opened - CALLS)}; missing: {sorted(CALLS - opened)}"
    assert not allowed(policies, "admission", "replica", 50061)   # the worker: its scheduler's and other workers' only
    # KV hand-offs between replica pods (a caller and callee of the same app, so not in the loop above): the decode
    # scheduler's HeldKv/ReleaseKv to the prefill scheduler, the decode worker's ReadKv from the prefill worker.
    assert allowed(policies, "replica", "replica", 50071) and allowed(policies, "replica", "replica", 50061)
    assert not allowed(policies, "replica", "replica", 9464)
    assert not allowed(policies, "replica", "admission", 50051)
    assert not allowed(policies, "admission", "redis", 6380)


def test_the_disagg_examples_pools_are_governed_as_replica_pods() -> None:
    """The pods of extras/disagg-replicas.yaml (prefill and decode pools) reach each other's 50071 and 50061 (KV
    hand-offs) both ways and no other port of each other, and admission, the router and the planner reach both
    pools' schedulers as they reach 30-replica.yaml's: 60-network-policies.yaml, unchanged, covers them."""
    policies = [d for d in load() if d["kind"] == "NetworkPolicy"]
    pools = [d["spec"]["template"]["metadata"]["labels"] for d in load("extras/disagg-replicas.yaml")
             if d["kind"] == "Deployment" and d["metadata"]["name"] != "planner"]
    assert [labels.get("sluice.io/role") for labels in pools] == ["prefill", "decode"]
    for source, target in (pools, pools[::-1]):
        assert {port for port in PORTS if allowed(policies, source, target, port)} == {50061, 50071}
    others = [app for app in APPS if app != "replica"]  # replica pods to and from a pool: the KV ports, as above
    for pool in pools:
        assert {(caller, port) for caller in others for port in PORTS if allowed(policies, caller, pool, port)} == {
            (caller, port) for caller, callee, port in CALLS if callee == "replica"}
        assert {(callee, port) for callee in others for port in PORTS if allowed(policies, pool, callee, port)} == {
            (callee, port) for caller, callee, port in CALLS if caller == "replica"}


def test_the_evaluator_sees_a_policy_that_opens_too_much() -> None:
    """Adding an allow-all ingress on Redis makes the call-graph check fail: the check is not vacuous."""
    policies = [d for d in load() if d["kind"] == "NetworkPolicy"]
    leaky = {"spec": {"podSelector": {"matchLabels": {"app": "redis"}}, "policyTypes": ["Ingress"], "ingress": [{}]}}
    assert not allowed(policies, "jaeger", "redis", 6379)
    assert allowed([*policies, leaky], "replica", "redis", 6379) and not allowed([*policies, leaky], "jaeger", "redis", 6379)
    open_egress = {"spec": {"podSelector": {"matchLabels": {"app": "jaeger"}}, "policyTypes": ["Egress"], "egress": [{}]}}
    assert allowed([*policies, leaky, open_egress], "jaeger", "redis", 6379)


def test_every_pod_is_covered_by_default_deny_and_may_resolve_names() -> None:
    """A deny-all policy selects every pod in both directions, and another opens DNS (port 53) to kube-dns."""
    policies = [d for d in load() if d["kind"] == "NetworkPolicy"]
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and "ingress" not in p["spec"]
            and "egress" not in p["spec"]]
    assert deny and set(deny[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    dns = [r for p in policies if p["spec"]["podSelector"] == {} for r in p["spec"].get("egress", [])]
    assert {(port["protocol"], port["port"]) for r in dns for port in r["ports"]} == {("UDP", 53), ("TCP", 53)}


def test_planner_may_patch_only_the_replica_deployments_scale() -> None:
    """The planner's ServiceAccount is bound to a Role whose only writes are the scale of `replica` and pod patches
    (the deletion-cost annotation that picks the pod scale-down removes)."""
    docs = load()
    binding = next(d for d in docs if d["kind"] == "RoleBinding" and d["subjects"][0]["name"] == "planner")
    assert binding["subjects"][0]["kind"] == "ServiceAccount"
    assert any(d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "planner" for d in docs)
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == binding["roleRef"]["name"])
    writes = [r for r in role["rules"] if set(r["verbs"]) & {"create", "update", "patch", "delete", "*"}]
    assert writes == [{"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": ["replica"],
                       "verbs": ["get", "patch", "update"]},
                      {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch"]}]
    assert all("secrets" not in r["resources"] for r in role["rules"])
    assert any(d["kind"] == "Deployment" and d["metadata"]["name"] == "replica" for d in docs)


def containers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return every container and init container of every Deployment and Job."""
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "Job")]
    return [c for pod in pods for c in pod["containers"] + pod.get("initContainers", [])]


def test_secrets_reach_processes_by_env_or_file_never_on_a_command_line() -> None:
    """The Redis password is referenced from its Secret; no command line holds a secret value; every referenced Secret exists."""
    docs = load() + load("extras/*.yaml")
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    password = secrets["sluice-redis"]["stringData"]["password"]
    values = [v for s in secrets.values() for v in s.get("stringData", {}).values() if len(v) > 8]
    for container in containers(load()):
        line = " ".join(container.get("command", []) + container.get("args", []))
        assert password not in line and not any(v in line for v in values), container["name"]
        assert not re.search(r"redis://[^ ]*@", line), container["name"]
        env = {e["name"]: e for e in container.get("env", [])}
        if "SLUICE_REDIS_URL" in env:
            role = container["name"]  # each service its own Redis user (sluice/redis_acl.py)
            assert env["SLUICE_REDIS_URL"]["value"] == f"redis://{role}:$(REDIS_PASSWORD)@redis:6379/0"
            assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": f"sluice-redis-{role}",
                                                                          "key": "password"}
        refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in env.values() if "secretKeyRef" in e.get("valueFrom", {})]
        assert set(refs) <= set(secrets), container["name"]
    volumes = [v["secret"]["secretName"] for d in docs if d["kind"] == "Deployment"
               for v in d["spec"]["template"]["spec"].get("volumes", []) if "secret" in v]
    assert set(volumes) <= set(secrets) and {"sluice-tls-router", "sluice-tls-scheduler", "sluice-tls-worker",
                                                "sluice-tls-admission"} <= set(volumes)


def test_every_redis_client_gets_the_password_and_redis_requires_it() -> None:
    """Each container that talks to Redis builds its URL from the Secret, and redis-server reads its users from a file."""
    docs = load()
    by_name = {c["name"]: c for c in containers(docs)}
    for name in ("admission", "router", "scheduler"):
        assert "SLUICE_REDIS_URL" in {e["name"] for e in by_name[name]["env"]}, name
    redis = by_name["redis"]
    assert redis["command"][:3] == ["redis-server", "--aclfile", "/etc/redis/users.acl"]
    assert {"name": "acl", "mountPath": "/etc/redis", "readOnly": True} in redis["volumeMounts"]
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "sluice-env")
    assert "SLUICE_REDIS_URL" not in config["data"]


def test_workloads_use_the_model_volume_and_public_entry_is_l7() -> None:
    """Workers and admission mount the model claim read-only; admission is a ClusterIP behind a gRPC Ingress, plus a headless Service."""
    docs = load()
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for name in ("replica", "admission"):
        pod = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)["spec"]["template"]
        models = next(v for v in pod["spec"]["volumes"] if v["name"] == "models")
        assert models["persistentVolumeClaim"]["claimName"] in claims and models["persistentVolumeClaim"]["readOnly"]
    services = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Service"}
    assert services["admission"]["type"] == "ClusterIP" and services["admission-headless"]["clusterIP"] == "None"
    assert all(s.get("type", "ClusterIP") != "LoadBalancer" for s in services.values())
    ingress = next(d for d in docs if d["kind"] == "Ingress")
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == "admission" and backend["port"]["name"] in {p["name"] for p in services["admission"]["ports"]}
    budgets = {d["spec"]["selector"]["matchLabels"]["app"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert budgets == {"replica", "admission"}
    hpa = yaml.safe_load((K8S / "extras" / "hpa-replica-queue.yaml").read_text())
    assert hpa["spec"]["scaleTargetRef"]["name"] == "replica" and hpa["spec"]["metrics"][0]["type"] in {"Pods", "External"}
