"""Counters read from the services' Prometheus endpoints, as differences between two reads.

The local planner (`sluice up --autoscale`) and the benches read the stack's own `/metrics` pages rather
than a Prometheus server: `Scraper.delta()` returns how much each named counter, histogram sum and
histogram count grew since the previous call, summed over every endpoint and every label set (or, with
`by_series`, kept apart by label set: `name{label="value"}`). A process that restarted (its counters went down)
counts from zero.
"""

from __future__ import annotations

import http.client
import urllib.request
from collections.abc import Callable, Iterable

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Scraper", "read_samples"]


def read_samples(url: str, names: Iterable[str], timeout_s: float = 1.0, by_series: bool = False) -> dict[str, float]:
    """Return the named samples of one endpoint, each summed over its label sets, or with `by_series` one entry per
    label set, keyed `name{a="x",b="y"}` (labels sorted; no labels: `name`). An endpoint that cannot be read this
    time: {} (unreachable, or a page cut off or garbled because its process died while answering, as a chaos
    run's kill -9 does: `http.client.IncompleteRead` is no OSError, and a loop that let it out stopped counting)."""
    wanted = set(names)
    totals: dict[str, float] = {}
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 (the stack's loopback URLs)
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    key = _series(sample.name, sample.labels) if by_series else sample.name
                    totals[key] = totals.get(key, 0.0) + float(sample.value)
    except (OSError, http.client.HTTPException, ValueError):  # ValueError: a garbled page, UTF-8 included
        return {}
    return totals


def _series(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


class Scraper:
    """Growth of counters over a changing set of endpoints between calls of `delta`."""

    def __init__(self, urls: Callable[[], Iterable[str]], names: Iterable[str], by_series: bool = False) -> None:
        self.urls = urls
        self.names = tuple(names)
        self.by_series = by_series
        """Keep label sets apart (`read_samples`): the growth is then keyed by series, only those that exist."""
        self._last: dict[str, dict[str, float]] = {}

    def delta(self) -> dict[str, float]:
        """Return each name's growth since the previous call, summed over the endpoints now listed."""
        growth = {} if self.by_series else dict.fromkeys(self.names, 0.0)
        seen: dict[str, dict[str, float]] = {}
        for url in self.urls():
            if not url:
                continue
            before = self._last.get(url, {})
            now = read_samples(url, self.names, by_series=self.by_series)
            if not now:  # unreachable this time: keep its last reading, count nothing
                seen[url] = before
                continue
            for name, value in now.items():
                previous = before.get(name, 0.0)
                growth[name] = growth.get(name, 0.0) + (value - previous if value >= previous else value)
            seen[url] = now
        self._last = seen
        return growth
