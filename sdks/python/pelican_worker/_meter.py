"""The worker's and the producer's metrics through OpenTelemetry's metrics API (SPEC 23; docs/src/tracing.md,
"Metrics"): the messaging conventions' instruments and Pelican's own, the same names, units and attributes in every
library, recorded where the stats are counted so that they agree with ``Worker.stats()`` (and the Prometheus names
of :mod:`pelican_worker.prometheus`). The API is the optional extra ``otel``, imported when the first worker or
producer is made: without it nothing is recorded, and with it nothing until the application installs an SDK's meter
provider. The instruments themselves are :mod:`pelican_worker._otel_metrics`'.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal, Protocol

__all__ = ["Ended", "ProducerMeter", "Sent", "WorkerMeter", "producer_meter", "worker_meter"]

#: How a handler run ended, as the stats count it: ``pelican.outcome`` (the Prometheus ``outcome`` label).
Ended = Literal["done", "terminal", "failed", "retried"]
#: How a publish ended: written, or its ``error.type``.
Sent = Literal["sent", "refused", "unavailable", "unknown", "failed"]


class WorkerMeter(Protocol):
    def started(self) -> None:
        """A message handed to a handler."""

    def landed(self) -> None:
        """A message out of flight: its outcome written, or given back on shutdown."""

    def ended(self, ended: Ended, seconds: float, error: BaseException | None = None) -> None:
        """A handler run that took ``seconds``, counted as ``ended``; ``error`` is what the handler raised."""

    def abandoned(self, count: int) -> None:
        """Messages given back on shutdown."""


class ProducerMeter(Protocol):
    def __call__(self, sent: Sent, count: int) -> None:
        """``count`` entries published (``sent``), or not (an ``error.type``)."""


class _NotMeasured:
    """Without OpenTelemetry's API: nothing recorded."""

    def started(self) -> None:
        pass

    def landed(self) -> None:
        pass

    def ended(self, ended: Ended, seconds: float, error: BaseException | None = None) -> None:
        pass

    def abandoned(self, count: int) -> None:
        pass

    def __call__(self, sent: Sent, count: int) -> None:
        pass


_NOT_MEASURED = _NotMeasured()


@functools.cache
def _meters() -> tuple[Callable[[str, str], WorkerMeter], Callable[[str], ProducerMeter]] | None:
    try:
        from pelican_worker._otel_metrics import OtelProducerMeter, OtelWorkerMeter
    except ImportError:  # the extra `otel` is not installed
        return None
    return OtelWorkerMeter, OtelProducerMeter


def worker_meter(stream: str, group: str) -> WorkerMeter:
    meters = _meters()
    return _NOT_MEASURED if meters is None else meters[0](stream, group)


def producer_meter(stream: str) -> ProducerMeter:
    meters = _meters()
    return _NOT_MEASURED if meters is None else meters[1](stream)
