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

_OUTCOMES = ("done", "terminal", "failed", "retried", "abandoned")


class WorkerCollector(Collector):
    """Reads the worker's stats at each scrape, under the contract's one schema:

    ``pelican_worker_messages_total{stream, group, outcome}`` (outcome: done | terminal | failed | retried |
    abandoned) and ``pelican_worker_in_flight{stream, group}``. The consumer (the Pod) is the scrape target's label.
    """

    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    def collect(self) -> Iterator[Metric]:
        stats = self._worker.stats
        where = [self._worker.stream, self._worker.group]
        messages = CounterMetricFamily(
            "pelican_worker_messages",
            "Handler runs by how they ended (abandoned: given back on shutdown, the delivery not counted).",
            labels=["stream", "group", "outcome"],
        )
        for outcome in _OUTCOMES:
            messages.add_metric([*where, outcome], getattr(stats, outcome))
        yield messages
        in_flight = GaugeMetricFamily(
            "pelican_worker_in_flight", "Messages being handled now.", labels=["stream", "group"]
        )
        in_flight.add_metric(where, stats.in_flight)
        yield in_flight


def register(worker: Worker, registry: CollectorRegistry = REGISTRY) -> WorkerCollector:
    """Registers a collector of ``worker``'s stats (the default registry unless told)."""
    collector = WorkerCollector(worker)
    registry.register(collector)
    return collector
