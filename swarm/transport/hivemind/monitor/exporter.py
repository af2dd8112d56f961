"""A peer's Prometheus endpoint (`--metrics_port`): its own collectors plus the process's (RSS, CPU,
open files: prometheus_client's process collector), read when Prometheus scrapes, never before.

Collectors build fresh families on every scrape (`Families`), so nothing is counted twice and a
peer that does nothing costs nothing.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)
PREFIX = "hivepipe_"


class Families:
    """The metric families of one scrape; a family's label names are those of its first sample."""

    def __init__(self) -> None:
        self._families: dict[str, tuple[object, tuple[str, ...]]] = {}

    def _add(self, kind, name: str, doc: str, value: float, labels: dict[str, object]) -> None:
        name = PREFIX + name
        if name not in self._families:
            self._families[name] = (kind(name, doc, labels=sorted(labels)), tuple(sorted(labels)))
        family, names = self._families[name]
        if names != tuple(sorted(labels)):  # two series that differ only in a dropped label would clash
            raise ValueError(f"{name}: labels {sorted(labels)}, the family has {list(names)}")
        family.add_metric([str(labels[n]) for n in names], float(value))

    def gauge(self, name: str, doc: str, value: float, **labels) -> None:
        self._add(GaugeMetricFamily, name, doc, value, labels)

    def counter(self, name: str, doc: str, value: float, **labels) -> None:
        """`name` without `_total` (prometheus_client adds it)."""
        self._add(CounterMetricFamily, name, doc, value, labels)

    def __iter__(self):
        return (family for family, _ in self._families.values())


class Collector:
    """A custom collector: `fill(families)` on every scrape."""

    def fill(self, families: Families) -> None:
        raise NotImplementedError

    def collect(self):
        families = Families()
        try:
            self.fill(families)
        except Exception as e:  # a scrape must not take the peer down; Prometheus sees the gap
            log.warning("metrics of %s: %s", type(self).__name__, e)
        return iter(families)

    def describe(self):
        return []  # not read at registration: collect() may need the peer running


class MetricsServer:
    """Serves /metrics on `port` (0: any free one) at `host` in a thread of its own."""

    def __init__(self, port: int, collectors=(), host: str = "127.0.0.1") -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        for collector in collectors:
            self.registry.register(collector)
        try:
            self.httpd, self._thread = start_http_server(port, host, self.registry)
        except OSError as e:
            raise RuntimeError(f"--metrics_port {port}: {e.strerror or e}") from None
        self.port = self.httpd.server_port

    def add(self, *collectors: Collector) -> None:
        """More collectors (the peer's parts exist only once it runs; the port is taken before)."""
        for collector in collectors:
            self.registry.register(collector)

    def close(self) -> None:
        self.httpd.shutdown()  # waits for its thread's loop (half a second at most)
        self.httpd.server_close()
