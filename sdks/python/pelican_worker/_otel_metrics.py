"""The instruments of :mod:`pelican_worker._meter` through OpenTelemetry's API, imported only when it is installed."""

from __future__ import annotations

from opentelemetry import metrics
from opentelemetry.util.types import Attributes

from pelican_worker._meter import Ended, Sent

#: The name of the library's meter (its tracer's).
METER = "pelican"
#: ``messaging.process.duration``'s buckets, in seconds: the conventions' advice.
_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


class OtelWorkerMeter:
    """A worker's instruments from the global meter provider, with their attribute sets made once."""

    def __init__(self, stream: str, group: str) -> None:
        meter = metrics.get_meter(METER)
        self._consumed = meter.create_counter(
            "messaging.client.consumed.messages", unit="{message}", description="Messages delivered to the handlers"
        )
        self._duration = meter.create_histogram(
            "messaging.process.duration",
            unit="s",
            description="Handler runs, by how they ended (pelican.outcome)",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
        )
        self._in_flight = meter.create_up_down_counter(
            "pelican.worker.in_flight", unit="{message}", description="Messages being handled by the worker now"
        )
        self._abandoned = meter.create_counter(
            "pelican.worker.abandoned",
            unit="{message}",
            description="Messages given back unfinished on shutdown, their delivery not counted",
        )
        self._names: Attributes = {"messaging.destination.name": stream, "messaging.consumer.group.name": group}

        def messaging(operation: str) -> dict[str, str]:
            return {
                "messaging.system": "redis",
                "messaging.operation.name": operation,
                "messaging.operation.type": operation,
                "messaging.destination.name": stream,
                "messaging.consumer.group.name": group,
            }

        self._receive: Attributes = messaging("receive")
        process = messaging("process")
        self._outcomes: dict[Ended, dict[str, str]] = {
            "done": process | {"pelican.outcome": "done"},
            "terminal": process | {"pelican.outcome": "terminal"},
            "failed": process | {"pelican.outcome": "failed"},
            "retried": process | {"pelican.outcome": "retried"},
        }

    def started(self) -> None:
        self._consumed.add(1, self._receive)
        self._in_flight.add(1, self._names)

    def landed(self) -> None:
        self._in_flight.add(-1, self._names)

    def ended(self, ended: Ended, seconds: float, error: BaseException | None = None) -> None:
        attributes = self._outcomes[ended]
        if error is not None:
            attributes = attributes | {"error.type": type(error).__qualname__}
        self._duration.record(seconds, attributes)

    def abandoned(self, count: int) -> None:
        if count > 0:
            self._abandoned.add(count, self._names)


class OtelProducerMeter:
    """A producer's instrument from the global meter provider, with its attribute sets made once."""

    def __init__(self, stream: str) -> None:
        self._sent = metrics.get_meter(METER).create_counter(
            "messaging.client.sent.messages",
            unit="{message}",
            description="Entries published, with error.type when not written (or not known to be)",
        )
        written = {
            "messaging.system": "redis",
            "messaging.destination.name": stream,
            "messaging.operation.name": "publish",
            "messaging.operation.type": "send",
        }
        self._attributes: dict[Sent, dict[str, str]] = {
            "sent": written,
            "refused": written | {"error.type": "refused"},
            "unavailable": written | {"error.type": "unavailable"},
            "unknown": written | {"error.type": "unknown"},
            "failed": written | {"error.type": "failed"},
        }

    def __call__(self, sent: Sent, count: int) -> None:
        if count > 0:
            self._sent.add(count, self._attributes[sent])
