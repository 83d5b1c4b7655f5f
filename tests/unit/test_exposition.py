"""The metrics endpoint answers every scraper with the names as registered (`vllm:*` keeps its colon)."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import generate_latest

from sluice.prom import (
    OPENMETRICS_CONTENT_TYPE,
    TEXT_CONTENT_TYPE,
    TPOT_BUCKETS,
    AdmissionMetrics,
    RouterMetrics,
    SchedulerMetrics,
    WorkerMetrics,
    choose_format,
    exposition,
    serve_metrics,
)

# Captured from Debian's Prometheus 2.42 scraping a target on this machine.
PROMETHEUS_2 = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
# Prometheus 3.x's default (scrape_protocols OpenMetricsText1.0.0, OpenMetricsText0.0.1, PrometheusText1.0.0,
# PrometheusText0.0.4), and with PrometheusText1.0.0 first.
PROMETHEUS_3 = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;"
                "version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;"
                "q=0.3,*/*;q=0.2")
PROMETHEUS_3_TEXT = ("text/plain;version=1.0.0;escaping=allow-utf-8;q=0.6,text/plain;version=0.0.4;q=0.5,"
                     "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.4,*/*;q=0.3")


@pytest.mark.parametrize("accept, expected", [
    (PROMETHEUS_2, "openmetrics"), (PROMETHEUS_3, "openmetrics"), (PROMETHEUS_3_TEXT, "text"),
    ("", "text"), ("text/plain;version=0.0.4", "text"), ("*/*", "text"),
    ("application/openmetrics-text;version=1.0.0;escaping=dots,text/plain;q=0.1", "text"),
    ("application/openmetrics-text;version=0.0.1", "text"),
    ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.7,"
     "text/plain;version=0.0.4;q=0.3", "text"),
])
def test_the_format_follows_the_scrapers_preference(accept: str, expected: str) -> None:
    """OpenMetrics only when it is the scraper's best range with an escaping that keeps names; else text 0.0.4."""
    assert choose_format(accept) == expected


@pytest.mark.parametrize("accept", [PROMETHEUS_2, PROMETHEUS_3, PROMETHEUS_3_TEXT, ""])
def test_vllm_names_keep_their_colon_in_every_format(accept: str) -> None:
    """Every sample line of a scheduler's vLLM families starts `vllm:`, never `vllm_`, whatever was negotiated."""
    metrics = SchedulerMetrics(model_name="tiny")
    metrics.running.set(3)
    metrics.ttft.observe(0.05)
    metrics.request_success("stop")
    body, content_type = exposition(metrics.registry, accept)
    samples = [line for line in body.decode().splitlines() if line and not line.startswith("#")]
    assert not [line for line in samples if line.startswith("vllm_")], samples
    assert 'vllm:num_requests_running{model_name="tiny"} 3.0' in samples
    assert any(line.startswith("vllm:time_to_first_token_seconds_bucket{") for line in samples)
    assert content_type == (OPENMETRICS_CONTENT_TYPE if choose_format(accept) == "openmetrics" else TEXT_CONTENT_TYPE)
    assert body.decode().endswith("# EOF\n") == (content_type == OPENMETRICS_CONTENT_TYPE)


def test_every_registered_name_is_a_legacy_prometheus_name() -> None:
    """The unescaped OpenMetrics answer is valid under any escaping only because no name needs escaping."""
    import re

    legacy = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
    for metrics in (SchedulerMetrics(), AdmissionMetrics(), RouterMetrics(), WorkerMetrics()):
        for family in metrics.registry.collect():
            assert legacy.match(family.name), family.name
            for sample in family.samples:
                assert legacy.match(sample.name) and all(legacy.match(k) for k in sample.labels), sample


def test_the_endpoint_binds_loopback_by_default_and_negotiates_over_http() -> None:
    """serve_metrics listens on 127.0.0.1 unless told otherwise, and answers /metrics in the negotiated format."""
    metrics = SchedulerMetrics(model_name="tiny")
    port = serve_metrics(metrics.registry, 0)
    for accept, content_type in ((PROMETHEUS_2, OPENMETRICS_CONTENT_TYPE), ("", TEXT_CONTENT_TYPE)):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept})
        with urllib.request.urlopen(request, timeout=5) as reply:
            assert reply.headers["Content-Type"] == content_type
            assert b"\nvllm:num_requests_running{" in reply.read()
    import socket

    with socket.socket() as probe:  # not bound on any other address of this machine
        probe.settimeout(1)
        assert probe.connect_ex(("127.0.0.2", port)) != 0
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=5)
    assert missing.value.code == 404


def test_observe_many_counts_exactly_what_one_observe_each_would() -> None:
    """A round's inter-token gaps fed at once give the same buckets, count and sum in both histogram twins
    (Sluice's and vLLM's names) as one observation per gap, values on a bucket's bound included."""
    gaps = [0.0, 0.004, TPOT_BUCKETS[0], 0.02, 0.02, TPOT_BUCKETS[3], 0.3, 2.5, 99.0, 1e9]
    each, bulk = SchedulerMetrics(), SchedulerMetrics()
    each.bind_model("m")
    bulk.bind_model("m")
    for gap in gaps:
        each.itl.observe(gap)
    bulk.itl.observe_many(gaps)
    bulk.itl.observe_many([])

    def itl_lines(metrics: SchedulerMetrics) -> list[str]:
        text = generate_latest(metrics.registry).decode()
        return [line for line in text.splitlines() if "inter_token_latency" in line and not line.startswith("#") and "_created" not in line]

    assert itl_lines(bulk) == itl_lines(each)
    assert any("vllm:inter_token_latency_seconds_count" in line and line.endswith(f" {float(len(gaps))}")
               for line in itl_lines(bulk))
