"""deploy/helm/sluice renders (with the test-only renderer, tests/helm_render.py, which test_helm_sdk.py matches to Helm's)
into manifests that validate against the Kubernetes schemas, run every container locked down, start each Sluice
service with flags its parser accepts, expose the OpenAI HTTP port, deploy the planner, run vLLM's own image
beside the Sluice agent when engine is vllm, and with disagg.enabled run the prefill and decode pools as two
Deployments that the planner sizes apart."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from admission_svc.__main__ import build_parser as admission_parser
from planner_svc.__main__ import build_parser as planner_parser
from planner_svc.__main__ import parse_args as planner_args
from planner_svc.__main__ import pool_deployments
from router_svc.__main__ import build_parser as router_parser
from scheduler_svc.__main__ import build_parser as scheduler_parser
from sluice.types import ReplicaRole
from tests.helm_render import RenderFailed, render_chart
from tests.unit.test_k8s_policies import selects
from worker_svc.__main__ import build_parser as worker_parser

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "sluice"
PARSERS = {"admission": admission_parser, "router": router_parser, "scheduler": scheduler_parser,
           "worker": worker_parser, "planner": planner_parser}
VARIANTS = {
    "defaults": {},
    "vllm": {"engine": "vllm"},
    "external-redis, no planner, public TLS": {"redis": {"enabled": False, "host": "redis.example.com",
                                                         "scheme": "rediss"},
                                               "planner": {"enabled": False}, "admission": {"publicTls": True}},
    "bare": {"ingress": {"enabled": False}, "networkPolicies": {"enabled": False},
             "prometheus": {"scrapeConfig": False}, "grafana": {"dashboard": False}},
    "disagg": {"disagg": {"enabled": True}},
    "extra flags, host tier": {"worker": {"hostBlocks": 4096, "extraArgs": ["--num-blocks", "8192"]},
                               "scheduler": {"hostPrefixCache": True,
                                             "extraArgs": ["--policy", "fair", "--tpot-slo-ms", "50"]},
                               "router": {"extraArgs": ["--policy", "score", "--prefill-weight", "8"]},
                               "admission": {"extraArgs": ["--log-level", "DEBUG"], "publicTls": True}},
}
VLLM_COMMAND = ["vllm", "serve", "Qwen/Qwen3-0.6B", "--host", "127.0.0.1", "--port", "8000", "--kv-events-config",
                '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557",'
                '"replay_endpoint":"tcp://*:5558","topic":"kv"}']
AGENT_FLAGS = ["--engine", "vllm", "--engine-url", "http://127.0.0.1:8000", "--engine-kv-events",
               "tcp://127.0.0.1:5557", "--engine-kv-replay", "tcp://127.0.0.1:5558"]


def rendered(variant: str) -> list[dict[str, Any]]:
    return render_chart(CHART, VARIANTS[variant])


def pods(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(Deployment name, pod spec) of every Deployment."""
    return [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in docs if d["kind"] == "Deployment"]


def sluice_service(container: dict[str, Any]) -> str | None:
    """The Sluice service a container runs (from its image name), None for another image."""
    found = re.search(r"sluice-(\w+):", container["image"])
    return found.group(1) if found else None


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
def test_every_rendered_document_validates_against_the_kubernetes_schemas(variant: str, version: str) -> None:
    """Strict schema validation (unknown fields are errors) of every document the chart renders."""
    errors = []
    for doc in rendered(variant):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}")
    assert errors == []


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_pod_and_container_is_locked_down(variant: str) -> None:
    """runAsNonRoot, seccomp RuntimeDefault on every pod; no privilege escalation, a read-only root filesystem and
    every capability dropped in every container; no service account token but the planner's."""
    for name, spec in pods(rendered(variant)):
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec.get("automountServiceAccountToken", True) is (name == "planner"), name
        for container in spec["containers"] + spec.get("initContainers", []):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, (name, container["name"])
            assert context["readOnlyRootFilesystem"] is True, (name, container["name"])
            assert context["capabilities"] == {"drop": ["ALL"]}, (name, container["name"])
            mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
            assert name == "redis" or "/tmp" in mounts, (name, container["name"])  # writable scratch space


def _entrypoint(service: str) -> list[str]:
    text = (ROOT / "deploy" / "docker" / f"{service}.Dockerfile").read_text()
    found = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.MULTILINE)
    assert found
    return list(json.loads(found.group(1)))[3:]


def parse(service: str, args: list[str]) -> argparse.Namespace:
    try:
        return PARSERS[service]().parse_args([*_entrypoint(service), *args])
    except SystemExit:
        pytest.fail(f"python -m {service}_svc rejects {args}")


@pytest.mark.parametrize("variant", ["defaults", "external-redis, no planner, public TLS", "disagg"])
def test_sluice_containers_start_with_flags_their_parsers_accept_and_probe_their_own_port(variant: str) -> None:
    """Each Sluice container's args parse; its gRPC containerPort is the port it listens on, and its probes are
    sluice.healthcheck on that port with its own role."""
    seen = set()
    for _name, spec in pods(rendered(variant)):
        for container in spec["containers"]:
            service = sluice_service(container)
            if service is None:
                continue
            seen.add(service)
            args = parse(service, container.get("args", []))
            grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
            assert grpc_port == args.port, (service, grpc_port, args.port)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in container:
                    assert container[probe]["exec"]["command"] == [
                        "python", "-m", "sluice.healthcheck", str(args.port), "--role", service], (service, probe)
    expected = {"admission", "router", "scheduler", "worker"} | ({"planner"} if "no planner" not in variant else set())
    assert seen == expected


def test_public_tls_reaches_admission_and_the_ingress() -> None:
    """admission.publicTls adds --public-tls, and the Ingresses speak TLS to the pods (GRPCS, HTTPS)."""
    docs = rendered("external-redis, no planner, public TLS")
    [admission] = [spec for name, spec in pods(docs) if name == "admission"]
    assert parse("admission", admission["containers"][0]["args"]).public_tls is True
    protocols = {d["metadata"]["name"]: d["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"]
                 for d in docs if d["kind"] == "Ingress"}
    assert protocols == {"admission-grpc": "GRPCS", "admission-http": "HTTPS"}
    urls = {e["value"] for _n, spec in pods(docs) for c in spec["containers"] for e in c.get("env", [])
            if e["name"] == "SLUICE_REDIS_URL"}
    assert urls == {f"rediss://{role}:$(REDIS_PASSWORD)@redis.example.com:6379/0"
                    for role in ("admission", "router", "scheduler")}


def test_the_ingress_exposes_the_openai_http_port() -> None:
    """One Ingress routes /v1 to admission's Service port named http, which targets the HTTP API's port 8000."""
    docs = rendered("defaults")
    [http] = [d for d in docs if d["kind"] == "Ingress" and d["metadata"]["name"] == "admission-http"]
    [path] = http["spec"]["rules"][0]["http"]["paths"]
    assert path["path"] == "/v1" and path["backend"]["service"] == {"name": "admission", "port": {"name": "http"}}
    [service] = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "admission"]
    assert {"name": "http", "port": 8000, "targetPort": 8000} in service["spec"]["ports"]
    [admission] = [spec for name, spec in pods(docs) if name == "admission"]
    assert {"name": "http", "containerPort": 8000} in admission["containers"][0]["ports"]
    assert parse("admission", admission["containers"][0]["args"]).http_port == 8000


def test_the_planner_runs_with_its_service_account_and_the_replica_count_is_a_value() -> None:
    """The planner Deployment runs python -m planner_svc (its image) under the planner ServiceAccount, bounded by
    the values; the replica Deployment's size is `replicas`."""
    docs = render_chart(CHART, {"replicas": 3, "planner": {"minReplicas": 2, "maxReplicas": 6}})
    [planner] = [spec for name, spec in pods(docs) if name == "planner"]
    assert planner["serviceAccountName"] == "planner"
    args = parse("planner", planner["containers"][0]["args"])
    assert (args.min_replicas, args.max_replicas, args.connector, args.deployment) == (2, 6, "kubernetes", "replica")
    [replica] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "replica"]
    assert replica["spec"]["replicas"] == 3


def test_engine_vllm_runs_vllms_image_beside_the_sluice_agent() -> None:
    """engine: vllm gives replica pods vLLM's own image serving on the pod's loopback with KV events on 5557/5558,
    and a scheduler container started as the Sluice agent with exactly the agreed flags; no Sluice worker."""
    docs = rendered("vllm")
    [replica] = [spec for name, spec in pods(docs) if name == "replica"]
    containers = {c["name"]: c for c in replica["containers"]}
    assert set(containers) == {"vllm", "scheduler"}
    vllm = containers["vllm"]
    assert vllm["image"].startswith("vllm/vllm-openai:")
    assert vllm["command"] == VLLM_COMMAND
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    agent = containers["scheduler"]["args"]
    assert agent[:len(AGENT_FLAGS)] == AGENT_FLAGS
    for flag in ("--router", "--replica-id", "--advertise-host", "--metrics-port", "--tls-dir", "--drain-timeout"):
        assert flag in agent, flag
    assert "--worker" not in agent


def test_the_scheduler_advertises_its_pods_worker_for_kv_pulls_and_replicas_may_reach_each_other() -> None:
    """A Sluice replica's scheduler dials its worker on the pod's loopback but tells decode replicas (HeldKv) the
    worker's pod DNS name on the worker's port (--kv-worker-address, from the downward API's pod name and namespace,
    a name the worker's certificate can carry); the replica NetworkPolicy lets replica pods reach each other's
    scheduler and worker ports (KV hand-offs) and nothing else of each other."""
    docs = rendered("defaults")
    [replica] = [spec for name, spec in pods(docs) if name == "replica"]
    containers = {c["name"]: c for c in replica["containers"]}
    args = parse("scheduler", containers["scheduler"]["args"])
    worker_port = next(p["containerPort"] for p in containers["worker"]["ports"] if p["name"] == "grpc")
    assert args.worker == f"127.0.0.1:{worker_port}"
    assert args.kv_worker_address == f"$(POD_NAME).replica.$(POD_NAMESPACE).svc.cluster.local:{worker_port}"
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in containers["scheduler"]["env"]}
    assert (env["POD_NAME"], env["POD_NAMESPACE"]) == ("metadata.name", "metadata.namespace")
    assert replica["subdomain"] == "replica"  # the headless Service that gives each pod that DNS name
    [policy] = [d["spec"] for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "replica"]
    def ports(rules: list[dict[str, Any]], side: str) -> set[int]:
        return {p["port"] for rule in rules for peer in rule.get(side, [])
                if peer.get("podSelector", {}).get("matchLabels") == {"app": "replica"} for p in rule["ports"]}
    assert ports(policy["ingress"], "from") == ports(policy["egress"], "to") == {args.port, worker_port}


def test_the_dashboard_in_the_chart_is_the_one_in_deploy_grafana() -> None:
    """The chart ships a copy (Helm reads only files inside the chart): it must not drift from the original."""
    copy = (CHART / "files" / "sluice-dashboard.json").read_text()
    assert copy == (ROOT / "deploy" / "grafana" / "sluice-dashboard.json").read_text()
    [config_map] = [d for d in rendered("defaults") if d["metadata"]["name"] == "sluice-grafana-dashboard"]
    assert json.loads(config_map["data"]["sluice-dashboard.json"]) == json.loads(copy)


def test_every_value_is_documented() -> None:
    """Each leaf of values.yaml is named in docs/operations.md's chart table (as `a.b.c`)."""
    def leaves(tree: dict[str, Any], prefix: str = "") -> list[str]:
        out = []
        for key, value in tree.items():
            path = f"{prefix}{key}"
            out += leaves(value, path + ".") if isinstance(value, dict) and key not in (
                "resources", "podSecurityContext", "containerSecurityContext") else [path]
        return out
    docs = (ROOT / "docs" / "operations.md").read_text()
    missing = [leaf for leaf in leaves(yaml.safe_load((CHART / "values.yaml").read_text())) if f"`{leaf}`" not in docs]
    assert missing == []


def test_the_renderer_refuses_what_it_does_not_understand(tmp_path: Path) -> None:
    """A template using a construct the test renderer lacks fails loudly instead of rendering wrongly."""
    (tmp_path / "templates").mkdir()
    (tmp_path / "Chart.yaml").write_text("appVersion: '1'\n")
    (tmp_path / "values.yaml").write_text("a: {b: 1}\n")
    (tmp_path / "templates" / "x.yaml").write_text("{{ range .Values.a }}x{{ end }}\n")
    with pytest.raises(ValueError, match="does not support"):
        render_chart(tmp_path)
    (tmp_path / "templates" / "x.yaml").write_text("v: {{ .Values.a.c }}\n")
    with pytest.raises(KeyError, match="no such value"):
        render_chart(tmp_path)
    (tmp_path / "templates" / "x.yaml").write_text('v: {{ include "nowhere" . }}\n')
    with pytest.raises(KeyError, match="no such define"):
        render_chart(tmp_path)


CHART_CALLS = {
    ("admission", "router", 50052), ("admission", "replica", 50071), ("admission", "redis", 6379),
    ("router", "redis", 6379), ("router", "replica", 50071),
    ("replica", "router", 50052), ("replica", "redis", 6379),
    ("planner", "router", 50052), ("planner", "replica", 50071),
}


@pytest.mark.parametrize("variant", ["defaults", "vllm", "disagg"])
def test_the_charts_network_policies_allow_exactly_the_calls_each_service_makes(variant: str) -> None:
    """Among the release's pods, the allowed (caller, callee, port) triples are exactly the call graph (the
    evaluator of tests/unit/test_k8s_policies.py); the worker's port and reverse calls stay closed."""
    from tests.unit.test_k8s_policies import allowed

    policies = [d for d in rendered(variant) if d["kind"] == "NetworkPolicy"]
    apps = ("admission", "router", "replica", "redis", "planner")
    ports = {50051, 50052, 50061, 50071, 50081, 6379, 8000, 9464, 9465}
    opened = {(s, t, port) for s in apps for t in apps for port in ports if s != t and allowed(policies, s, t, port)}
    assert opened == CHART_CALLS, f"extra: {sorted(opened - CHART_CALLS)}; missing: {sorted(CHART_CALLS - opened)}"


def deployments(docs: list[dict[str, Any]], app: str) -> dict[str, dict[str, Any]]:
    """Deployment name -> Deployment, for the Deployments whose pods carry label app=`app`."""
    return {d["metadata"]["name"]: d for d in docs
            if d["kind"] == "Deployment" and d["spec"]["template"]["metadata"]["labels"]["app"] == app}


def scheduler_args(deployment: dict[str, Any]) -> list[str]:
    [scheduler] = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "scheduler"]
    return list(scheduler["args"])


def planner_role_rules(docs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Resource -> the resourceNames the planner's Role grants on it (apps group)."""
    [binding] = [d for d in docs if d["kind"] == "RoleBinding" and d["subjects"][0]["name"] == "planner"]
    [role] = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == binding["roleRef"]["name"]]
    return {rule["resources"][0]: rule["resourceNames"] for rule in role["rules"] if rule["apiGroups"] == ["apps"]}


DISAGG = {"disagg": {"enabled": True, "prefill": {"replicas": 3}, "decode": {"replicas": 2}}}


def test_disagg_runs_a_prefill_and_a_decode_deployment_instead_of_the_replica_one() -> None:
    """disagg.enabled: exactly two replica Deployments, replica-prefill and replica-decode, sized by their values,
    whose schedulers start with --role prefill (with the whole round budget as chunk cap, as `sluice up --disagg`)
    and --role decode; each selector takes its own pods only; the headless Service still names every pod of both
    (the scheduler's --advertise-host and --kv-worker-address are that DNS name)."""
    docs = render_chart(CHART, DISAGG)
    replicas = deployments(docs, "replica")
    assert set(replicas) == {"replica-prefill", "replica-decode"}
    assert {name: d["spec"]["replicas"] for name, d in replicas.items()} == {"replica-prefill": 3, "replica-decode": 2}
    prefill, decode = (parse("scheduler", scheduler_args(replicas[name])) for name in ("replica-prefill", "replica-decode"))
    assert (ReplicaRole(prefill.role), ReplicaRole(decode.role)) == (ReplicaRole.PREFILL, ReplicaRole.DECODE)
    assert prefill.max_prefill_chunk == prefill.max_num_batched_tokens == 2048
    assert decode.max_prefill_chunk == parse("scheduler", ["--replica-id", "r"]).max_prefill_chunk  # the default
    pod_labels = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in replicas.items()}
    for name, deployment in replicas.items():
        assert {other for other, labels in pod_labels.items()
                if selects(deployment["spec"]["selector"], labels)} == {name}
        assert deployment["spec"]["template"]["spec"]["subdomain"] == "replica"
    [service] = [d["spec"] for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "replica"]
    assert all(selects({"matchLabels": service["selector"]}, labels) for labels in pod_labels.values())
    for args in (prefill, decode):
        assert args.kv_worker_address == "$(POD_NAME).replica.$(POD_NAMESPACE).svc.cluster.local:50061"


def _without_role(deployment: dict[str, Any]) -> dict[str, Any]:
    """The pod template with its pool's marks taken out: the role label and the scheduler's role flags."""
    template = json.loads(json.dumps(deployment["spec"]["template"]))
    template["metadata"]["labels"].pop("sluice.io/role")
    for container in template["spec"]["containers"]:
        if container["name"] == "scheduler":
            args = container["args"]
            for flag in ("--role", "--max-prefill-chunk"):
                if flag in args:
                    del args[args.index(flag):args.index(flag) + 2]
    return dict(template)


def test_the_pools_pod_templates_are_the_aggregated_one_plus_their_role() -> None:
    """Both pools' pods are the replica pod of an aggregated release but for their role (one pod template, not two
    copies that drift); a pool's own worker resources, when set, replace worker.resources there only."""
    [aggregated] = deployments(rendered("defaults"), "replica").values()
    decode_resources = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "8", "memory": "64Gi"}}
    values = {"disagg": {"enabled": True, "decode": {"resources": decode_resources}}}
    replicas = deployments(render_chart(CHART, values), "replica")
    assert _without_role(replicas["replica-prefill"]) == aggregated["spec"]["template"]
    decode = _without_role(replicas["replica-decode"])
    [worker] = [c for c in decode["spec"]["containers"] if c["name"] == "worker"]
    assert worker["resources"] == decode_resources
    worker["resources"] = yaml.safe_load((CHART / "values.yaml").read_text())["worker"]["resources"]
    assert decode == aggregated["spec"]["template"]


def test_without_disagg_the_chart_renders_the_one_aggregated_replica_deployment() -> None:
    """disagg off (the default): one Deployment `replica` of `replicas` pods selected by app=replica alone, no
    --role (the scheduler's default, both), and the planner scales that one Deployment."""
    docs = render_chart(CHART, {"replicas": 3})
    [(name, replica)] = deployments(docs, "replica").items()
    assert (name, replica["spec"]["replicas"], replica["spec"]["selector"]) == ("replica", 3,
                                                                                {"matchLabels": {"app": "replica"}})
    assert "sluice.io/role" not in replica["spec"]["template"]["metadata"]["labels"]
    args = scheduler_args(replica)
    assert "--role" not in args and ReplicaRole(parse("scheduler", args).role) is ReplicaRole.BOTH
    [planner] = [spec for name, spec in pods(docs) if name == "planner"]
    options = planner_args([*_entrypoint("planner"), *planner["containers"][0]["args"]])
    assert (options.pools, options.deployment) == (False, "replica")
    assert planner_role_rules(docs) == {"deployments/scale": ["replica"], "deployments": ["replica"]}


@pytest.mark.parametrize("connector", ["kubernetes", "prometheus"])
def test_with_disagg_the_planner_sizes_each_pool_and_may_scale_exactly_their_deployments(connector: str) -> None:
    """The planner runs with --pools and names the two rendered Deployments as its pools' (a combination its
    own parser accepts), and its Role lets it read and scale those two and no other Deployment."""
    docs = render_chart(CHART, {**DISAGG, "planner": {"connector": connector}})
    [planner] = [spec for name, spec in pods(docs) if name == "planner"]
    options = planner_args([*_entrypoint("planner"), *planner["containers"][0]["args"]])
    assert options.pools is True and options.connector == connector
    names = set(deployments(docs, "replica"))
    assert set(pool_deployments(options).values()) == names
    assert pool_deployments(options) == {ReplicaRole.PREFILL: "replica-prefill", ReplicaRole.DECODE: "replica-decode"}
    rules = planner_role_rules(docs)
    assert set(rules) == {"deployments/scale", "deployments"}
    assert all(sorted(granted) == sorted(names) for granted in rules.values())


def test_disagg_with_engine_vllm_fails_rendering_naming_the_values() -> None:
    """engine vllm and disagg.enabled refuse to render, with a message naming both values (as `sluice up --disagg
    --engine vllm` refuses): vLLM engines cannot be either side of a KV hand-off yet."""
    with pytest.raises(RenderFailed, match=r"disagg\.enabled needs engine: sluice") as failed:
        render_chart(CHART, {"engine": "vllm", "disagg": {"enabled": True}})
    assert "disagg.enabled to false" in str(failed.value)
    assert deployments(render_chart(CHART, {"engine": "vllm", "disagg": {"enabled": False}}), "replica")


def test_the_pools_replicas_may_reach_each_others_kv_ports_and_nothing_else_of_each_other() -> None:
    """The chart's replica NetworkPolicy admits a prefill pod and a decode pod to each other's scheduler (HeldKv,
    ReleaseKv) and worker (ReadKv) ports, both ways, and to no other port of each other (the evaluator of
    tests/unit/test_k8s_policies.py, on the pods' rendered labels)."""
    from tests.unit.test_k8s_policies import allowed

    docs = render_chart(CHART, DISAGG)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    labels = [d["spec"]["template"]["metadata"]["labels"] for d in deployments(docs, "replica").values()]
    assert len(labels) == 2
    for source, target in (labels, labels[::-1]):
        opened = {port for port in (50051, 50052, 50061, 50071, 50081, 6379, 8000, 9464, 9465)
                  if allowed(policies, source, target, port)}
        assert opened == {50061, 50071}, (source, target)


def test_the_host_prefix_tier_is_two_values_and_one_without_the_other_fails_rendering() -> None:
    """worker.hostBlocks reaches the worker as --host-blocks and scheduler.hostPrefixCache the scheduler as
    --host-prefix-cache (both accepted by their parsers); the tier without host blocks refuses to render, as the
    scheduler would refuse to start."""
    docs = render_chart(CHART, {"worker": {"hostBlocks": 4096}, "scheduler": {"hostPrefixCache": True}})
    (replica,) = deployments(docs, "replica").values()
    containers = {c["name"]: c for c in replica["spec"]["template"]["spec"]["containers"]}
    worker, scheduler = containers["worker"]["args"], containers["scheduler"]["args"]
    assert worker[worker.index("--host-blocks") + 1] == "4096" and "--host-prefix-cache" in scheduler
    assert worker_parser().parse_args(worker).host_blocks == 4096
    assert scheduler_parser().parse_args(scheduler).host_prefix_cache
    (bare,) = deployments(render_chart(CHART, {}), "replica").values()
    plain = {c["name"]: c for c in bare["spec"]["template"]["spec"]["containers"]}
    assert "--host-blocks" not in plain["worker"]["args"] and "--host-prefix-cache" not in plain["scheduler"]["args"]
    with pytest.raises(RenderFailed, match=r"scheduler\.hostPrefixCache needs host blocks: set worker\.hostBlocks"):
        render_chart(CHART, {"scheduler": {"hostPrefixCache": True}})


@pytest.mark.parametrize("engine", ["sluice", "vllm"])
def test_extra_args_reach_every_scheduler_and_worker_last_and_parse(engine: str) -> None:
    """scheduler.extraArgs and worker.extraArgs come after the chart's own flags (so one given twice takes their
    value) in every scheduler (the vLLM agent's too) and every Sluice worker, and the services' parsers take them;
    without them the argument lists are the chart's alone."""
    extra = {"scheduler": {"extraArgs": ["--policy", "fair", "--drain-timeout", "5"]},
             "worker": {"extraArgs": ["--num-blocks", "8192"]}, "engine": engine}
    (replica,) = deployments(render_chart(CHART, extra), "replica").values()
    containers = {c["name"]: c for c in replica["spec"]["template"]["spec"]["containers"]}
    scheduler = containers["scheduler"]["args"]
    assert scheduler[-4:] == ["--policy", "fair", "--drain-timeout", "5"]
    parsed = parse("scheduler", scheduler)
    assert (parsed.policy, parsed.drain_timeout) == ("fair", 5.0)  # the extra --drain-timeout wins over the chart's
    if engine == "sluice":
        worker = containers["worker"]["args"]
        assert worker[-2:] == ["--num-blocks", "8192"] and parse("worker", worker).num_blocks == 8192
    (bare,) = deployments(render_chart(CHART, {"engine": engine}), "replica").values()
    plain = {c["name"]: c["args"] for c in bare["spec"]["template"]["spec"]["containers"]}
    assert plain["scheduler"] == scheduler[:-4] and "--policy" not in plain["scheduler"]
    if engine == "sluice":
        assert plain["worker"] == containers["worker"]["args"][:-2]


def test_router_and_admission_extra_args_come_last_and_parse() -> None:
    """router.extraArgs and admission.extraArgs follow the chart's own flags (admission's --public-tls included) and
    their parsers take them."""
    docs = render_chart(CHART, {"router": {"extraArgs": ["--policy", "round_robin", "--prefill-weight", "4"]},
                                "admission": {"extraArgs": ["--log-level", "DEBUG"], "publicTls": True}})
    deps = deployments(docs, "router")
    (router,) = deps.values()
    router_args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert router_args[-4:] == ["--policy", "round_robin", "--prefill-weight", "4"]
    parsed = parse("router", router_args)
    assert (parsed.policy, parsed.prefill_weight) == ("round_robin", 4.0)
    (admission,) = deployments(docs, "admission").values()
    admission_args = admission["spec"]["template"]["spec"]["containers"][0]["args"]
    assert admission_args[-3:] == ["--public-tls", "--log-level", "DEBUG"]
    assert parse("admission", admission_args).log_level == "DEBUG"
