"""The metrics server (sluice.prom.serve_metrics) when a scraper leaves before its answer: no traceback on stderr
(it used to print one per timed-out scrape of a paused process), and the next scrape is served."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import socket, struct, time, urllib.request
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from sluice.prom import serve_metrics

class Big:
    def collect(self):
        family = GaugeMetricFamily("big", "a body larger than the socket buffers", labels=["i"])
        for i in range(60000):
            family.add_metric([str(i)], i)
        yield family

registry = CollectorRegistry()
registry.register(Big())
port = serve_metrics(registry, 0)
for _ in range(3):  # each scraper asks, then resets the connection before the answer is written
    client = socket.create_connection(("127.0.0.1", port))
    client.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()
    time.sleep(0.3)
body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read()
print(body.count(b"\\nbig{"))
"""


def test_a_scraper_that_left_costs_no_traceback_and_the_next_scrape_is_served() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) == 60000
    assert "Traceback" not in done.stderr and "Exception occurred" not in done.stderr, done.stderr
