"""A loopback HTTP server that answers the few Kubernetes API endpoints the planner uses, as the API server does.

Only the remote end is fake: the code under test is the official `kubernetes` client, talking HTTP.
It serves, for one namespace:
  GET/PUT /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale   (autoscaling/v1 Scale; a PUT
      whose metadata.resourceVersion is stale gets 409 Conflict, as optimistic concurrency does)
  PATCH   /api/v1/namespaces/{ns}/pods/{name}                       (JSON merge patch of metadata)
Unknown objects get a 404 Status. Every request is recorded (method, path, content type, body).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
POD_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")


@dataclass
class ClusterState:
    """What the fake API server holds: deployments' replica counts, pods' annotations."""

    namespace: str = "sluice"
    deployments: dict[str, int] = field(default_factory=dict)
    pods: dict[str, dict[str, str]] = field(default_factory=dict)
    resource_version: int = 1
    races: int = 0
    """This many next scale reads are followed by another writer's change (bumps the version)."""
    requests: list[tuple[str, str, str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def _scale(state: ClusterState, name: str) -> dict[str, Any]:
    replicas = state.deployments[name]
    return {"kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {"name": name, "namespace": state.namespace, "resourceVersion": str(state.resource_version)},
            "spec": {"replicas": replicas}, "status": {"replicas": replicas, "selector": "app=replica"}}


class _Handler(BaseHTTPRequestHandler):
    state: ClusterState

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep test output quiet
        pass

    def _reply(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length)) if length else None

    def _handle(self, method: str) -> None:
        state, path = self.state, self.path.split("?")[0]
        body = self._body() if method in ("PUT", "PATCH") else None
        with state.lock:
            state.requests.append((method, path, self.headers.get("Content-Type", ""), body))
            code, reply = self._route(method, path, body)
        self._reply(code, reply)

    def _route(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        state = self.state
        if (match := SCALE_PATH.match(path)) and match[1] == state.namespace and match[2] in state.deployments:
            name = match[2]
            if method == "GET":
                reply = _scale(state, name)
                if state.races:  # another writer scales by one right after our read
                    state.races -= 1
                    state.deployments[name] += 1
                    state.resource_version += 1
                return 200, reply
            if method == "PUT":
                sent = body.get("metadata", {}).get("resourceVersion")
                if sent is not None and sent != str(state.resource_version):
                    return 409, _status(409, "Conflict", f'Operation cannot be fulfilled on deployments.apps "{name}": '
                                        "the object has been modified; please apply your changes to the latest "
                                        "version and try again")
                state.deployments[name] = int(body["spec"]["replicas"])
                state.resource_version += 1
                return 200, _scale(state, name)
        pod = POD_PATH.match(path)
        if method == "PATCH" and pod and pod[1] == state.namespace and pod[2] in state.pods:
            annotations = (body.get("metadata") or {}).get("annotations") or {}
            state.pods[pod[2]].update(annotations)
            return 200, {"kind": "Pod", "apiVersion": "v1", "metadata": {
                "name": pod[2], "namespace": state.namespace, "annotations": state.pods[pod[2]]}}
        return 404, _status(404, "NotFound", f"{path} not found")

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._handle("GET")

    def do_PUT(self) -> None:  # noqa: N802
        self._handle("PUT")

    def do_PATCH(self) -> None:  # noqa: N802
        self._handle("PATCH")


def serve(state: ClusterState) -> ThreadingHTTPServer:
    """Start the fake API server on a free loopback port in a daemon thread; shut it down when done."""
    handler = type("Handler", (_Handler,), {"state": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
