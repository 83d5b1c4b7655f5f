"""Counters read from the services' Prometheus endpoints, as differences between two reads.

The local planner (`sluice up --autoscale`) and the benches read the stack's own `/metrics` pages rather
than a Prometheus server: `Scraper.delta()` returns how much each named counter, histogram sum and
histogram count grew since the previous call, summed over every endpoint and every label set. A process
that restarted (its counters went down) counts from zero.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterable

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Scraper", "read_samples"]


def read_samples(url: str, names: Iterable[str], timeout_s: float = 1.0) -> dict[str, float]:
    """Return the named samples of one endpoint, each summed over its label sets (an unreachable one: {})."""
    wanted = set(names)
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 (the stack's loopback URLs)
            text = reply.read().decode()
    except OSError:
        return {}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


class Scraper:
    """Growth of counters over a changing set of endpoints between calls of `delta`."""

    def __init__(self, urls: Callable[[], Iterable[str]], names: Iterable[str]) -> None:
        self.urls = urls
        self.names = tuple(names)
        self._last: dict[str, dict[str, float]] = {}

    def delta(self) -> dict[str, float]:
        """Return each name's growth since the previous call, summed over the endpoints now listed."""
        growth = dict.fromkeys(self.names, 0.0)
        seen: dict[str, dict[str, float]] = {}
        for url in self.urls():
            if not url:
                continue
            before = self._last.get(url, {})
            now = read_samples(url, self.names)
            if not now:  # unreachable this time: keep its last reading, count nothing
                seen[url] = before
                continue
            for name, value in now.items():
                previous = before.get(name, 0.0)
                growth[name] += value - previous if value >= previous else value
            seen[url] = now
        self._last = seen
        return growth
