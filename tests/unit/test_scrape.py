"""Counter growth read from real /metrics endpoints: summed over label sets and endpoints, restarts count from zero."""

from __future__ import annotations

import socket
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram

from sluice.prom import serve_metrics
from sluice_tools.scrape import Scraper, read_samples


def _endpoint() -> tuple[str, Counter, Histogram]:
    registry = CollectorRegistry()
    tokens = Counter("t_tokens", "tokens", ["model"], registry=registry)
    latency = Histogram("t_latency_seconds", "latency", registry=registry)
    return f"http://127.0.0.1:{serve_metrics(registry, 0, '127.0.0.1')}/metrics", tokens, latency


def test_delta_is_growth_since_the_last_read_over_endpoints_and_labels() -> None:
    """Two endpoints, two label sets: the first read counts from zero, the next only what grew; a vanished
    endpoint or an unreachable one adds nothing, and a replacement endpoint counts from zero."""
    (url_a, tokens_a, latency_a), (url_b, tokens_b, _) = _endpoint(), _endpoint()
    urls = [url_a, url_b]
    scraper = Scraper(lambda: urls, ["t_tokens_total", "t_latency_seconds_sum", "t_latency_seconds_count"])
    tokens_a.labels("x").inc(5)
    tokens_a.labels("y").inc(2)
    tokens_b.labels("x").inc(3)
    latency_a.observe(0.25)
    assert scraper.delta() == {"t_tokens_total": 10.0, "t_latency_seconds_sum": 0.25, "t_latency_seconds_count": 1.0}
    tokens_b.labels("x").inc(4)
    assert scraper.delta()["t_tokens_total"] == 4.0
    urls.append("http://127.0.0.1:9/metrics")  # nothing listens there
    tokens_a.labels("x").inc(1)
    assert scraper.delta()["t_tokens_total"] == 1.0
    (url_c, tokens_c, _), urls[0] = _endpoint(), ""
    urls[1] = url_c  # b restarted on a new port: its replacement counts from zero
    tokens_c.labels("x").inc(6)
    assert scraper.delta()["t_tokens_total"] == 6.0


def test_delta_by_series_keeps_label_sets_apart_and_counts_a_restart_from_zero() -> None:
    """With by_series each label set grows on its own, keyed `name{label="value"}`, summed over endpoints; a series
    not seen yet is absent, and an endpoint whose counters went down (restarted in place) counts from zero."""
    (url_a, tokens_a, _), (url_b, tokens_b, _) = _endpoint(), _endpoint()
    urls = [url_a, url_b]
    scraper = Scraper(lambda: urls, ["t_tokens_total"], by_series=True)
    tokens_a.labels("x").inc(5)
    tokens_b.labels("x").inc(1)
    tokens_b.labels("y").inc(2)
    assert scraper.delta() == {'t_tokens_total{model="x"}': 6.0, 't_tokens_total{model="y"}': 2.0}
    tokens_a.labels("y").inc(3)
    assert scraper.delta() == {'t_tokens_total{model="x"}': 0.0, 't_tokens_total{model="y"}': 3.0}
    (url_c, tokens_c, _), urls[1] = _endpoint(), ""
    urls.append(url_c)
    tokens_c.labels("y").inc(1)
    assert scraper.delta()['t_tokens_total{model="y"}'] == 1.0


def _cut_off_endpoint(body: bytes, declared: int) -> str:
    """A loopback HTTP endpoint that answers every request with `body` under a Content-Length of `declared` and
    closes: a /metrics page whose process died while sending it (declared > len(body)), or a garbled one."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s"
                             % (declared, body))

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"


def test_a_page_cut_off_or_garbled_counts_nothing_and_keeps_the_last_reading() -> None:
    """A page cut off mid-body (IncompleteRead: a scheduler killed while answering) or one that is not the
    exposition format reads as unreachable: no exception out of `delta` (a chaos run's scrape thread died of it and
    stopped counting), nothing counted, and the endpoint's last reading kept, so its next good page counts only
    what grew."""
    url, tokens, _ = _endpoint()
    urls = [url]
    scraper = Scraper(lambda: urls, ["t_tokens_total"])
    tokens.labels("x").inc(5)
    assert scraper.delta() == {"t_tokens_total": 5.0}
    page = b't_tokens_total{model="x"} 7.0\n'
    for bad in (_cut_off_endpoint(page[:10], len(page)), _cut_off_endpoint(b"t_tokens_total{{{ not a page\n", 29)):
        assert read_samples(bad, ["t_tokens_total"]) == {}
    urls.append(_cut_off_endpoint(page[:10], len(page)))
    tokens.labels("x").inc(2)
    assert scraper.delta() == {"t_tokens_total": 2.0}
