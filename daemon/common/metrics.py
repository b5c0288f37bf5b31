"""Prometheus metrics of the daemon (served at GET /metrics by daemon/api/app.py).

Counters and histograms live in a private `CollectorRegistry` per daemon so tests
can run several daemons in one process. Checkpoints by status are read from the
registry database at scrape time (the database is the truth, not a counter).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _StatusCollector(Collector):
    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "hotswap_checkpoints", "Checkpoints in the registry by status", labels=["status"]
        )
        try:
            counts = self._counts()
        except Exception:  # noqa: BLE001 - a scrape must not fail because the DB blinked
            counts = {}
        for status, n in sorted(counts.items()):
            g.add_metric([status], n)
        yield g


class DaemonMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.discovered_total = Counter(
            "hotswap_checkpoints_discovered",
            "Checkpoints registered, by commit signal",
            ["signal"],
            registry=self.registry,
        )
        self.verify_seconds = Histogram(
            "hotswap_verify_seconds",
            "Time to verify one checkpoint (all checks)",
            ["outcome"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
            registry=self.registry,
        )
        self.check_seconds = Histogram(
            "hotswap_check_seconds",
            "Time of one check",
            ["check"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300),
            registry=self.registry,
        )

        self.fetched_bytes = Counter(
            "hotswap_fetched_bytes",
            "Bytes of checkpoints taken in from a source: a delta's own files, or a full checkpoint's",
            ["source", "encoding"],
            registry=self.registry,
        )

    def track_statuses(self, counts: Callable[[], dict[str, int]]) -> None:
        self.registry.register(_StatusCollector(counts))

    def discovered(self, signal: str) -> None:
        self.discovered_total.labels(signal=signal).inc()

    def fetched(self, source: str, encoding: str, n: int) -> None:
        self.fetched_bytes.labels(source=source, encoding=encoding).inc(n)

    def verified(self, report: Any, duration_ms: float) -> None:
        outcome = "ok" if report.ok else ("deferred" if report.deferred else "rejected")
        self.verify_seconds.labels(outcome=outcome).observe(duration_ms / 1000.0)
        for r in report.results:
            self.check_seconds.labels(check=r.name).observe(r.duration_ms / 1000.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
