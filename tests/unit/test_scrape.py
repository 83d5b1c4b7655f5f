"""Counter growth read from real /metrics endpoints: summed over label sets and endpoints, restarts count from zero."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from sluice.prom import serve_metrics
from sluice_tools.scrape import Scraper


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
