"""A real Prometheus server for tests: Debian's `prometheus` binary (Makefile target `prometheus`), scraping
given targets every second, and queried over its HTTP API."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from sluice.redis_server import free_port
from tests.processes import stop_process


def prometheus_binary() -> str:
    """The prometheus binary ($SLUICE_PROMETHEUS, else the one on PATH); raises RuntimeError naming the fix."""
    found = os.environ.get("SLUICE_PROMETHEUS") or shutil.which("prometheus")
    if not found:
        raise RuntimeError("no prometheus binary: run `make prometheus` (Debian's package) or set SLUICE_PROMETHEUS")
    return found


class Prometheus:
    """One Prometheus process scraping `targets` ({job: [host:port, ...]}) every second, storage under `work`."""

    def __init__(self, work: Path, targets: dict[str, list[str]]) -> None:
        work.mkdir(parents=True, exist_ok=True)
        jobs = [{"job_name": job, "scrape_interval": "1s", "scrape_timeout": "900ms",
                 "static_configs": [{"targets": hosts}]} for job, hosts in targets.items()]
        config = work / "prometheus.yml"
        config.write_text(json.dumps({"global": {"scrape_interval": "1s"}, "scrape_configs": jobs}))  # YAML ⊃ JSON
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work / "prometheus.log"
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [prometheus_binary(), f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"], stdout=out, stderr=subprocess.STDOUT)

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; return its `data` (raises on an error answer)."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as reply:
                answer = json.loads(reply.read())
        except urllib.error.HTTPError as exc:  # a malformed query: say which, and what Prometheus said
            raise AssertionError(f"{path} {params}: {exc.code} {exc.read().decode()[:500]}") from None
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar as one element) of `expr` now."""
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] == "vector" else [{"value": data["result"]}]

    def wait_targets_up(self, scrapes: int = 3, timeout_s: float = 60) -> None:
        """Wait until every target is up and has been scraped `scrapes` times (by Prometheus' own counter)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                active = self.api("targets")["activeTargets"]
                if active and all(t["health"] == "up" for t in active) and self._scrapes() >= scrapes:
                    return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"targets not up: {self._targets()}\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def _scrapes(self) -> int:
        samples = self.query("min(count_over_time(up[1m]))")
        return int(float(samples[0]["value"][1])) if samples else 0

    def _targets(self) -> Any:
        try:
            return [(t["scrapeUrl"], t["health"], t["lastError"]) for t in self.api("targets")["activeTargets"]]
        except OSError as exc:
            return str(exc)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        stop_process(self.process)
