"""Exports a worker's stats with ``prometheus_client`` (``pip install 'pelican-worker[prometheus]'``).

from prometheus_client import start_http_server
from pelican_worker.prometheus import register

register(worker)
start_http_server(9100)
"""

from __future__ import annotations

from collections.abc import Iterator

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry
except ImportError as error:  # pragma: no cover - depends on what is installed
    raise ImportError(
        "pelican_worker.prometheus needs prometheus_client: pip install 'pelican-worker[prometheus]'"
    ) from error

from pelican_worker.worker import Worker

__all__ = ["WorkerCollector", "register"]

_COUNTERS = (
    ("done", "Messages acknowledged as done."),
    ("terminal", "Messages acknowledged as terminal and counted under their reason."),
    ("failed", "Handler errors (and failed acknowledgements): left pending for the operator's retry."),
    ("retried", "Messages given back for a retry under the policy's backoff, the delivery counted."),
    ("abandoned", "Messages given back on shutdown, the delivery not counted."),
)


class WorkerCollector(Collector):
    """Reads the worker's stats at each scrape."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    def collect(self) -> Iterator[Metric]:
        stats = self._worker.stats
        labels = ["stream", "group", "consumer"]
        values = [self._worker.stream, self._worker.group, self._worker.consumer]
        for name, documentation in _COUNTERS:
            counter = CounterMetricFamily(f"pelican_worker_{name}", documentation, labels=labels)
            counter.add_metric(values, getattr(stats, name))
            yield counter
        gauge = GaugeMetricFamily("pelican_worker_in_flight", "Messages being handled now.", labels=labels)
        gauge.add_metric(values, stats.in_flight)
        yield gauge


def register(worker: Worker, registry: CollectorRegistry = REGISTRY) -> WorkerCollector:
    """Registers a collector of ``worker``'s stats (the default registry unless told)."""
    collector = WorkerCollector(worker)
    registry.register(collector)
    return collector
