"""The spans of :mod:`pelican_worker._trace` through OpenTelemetry's API, imported only when the API is installed."""

from __future__ import annotations

import re
from contextvars import Token
from types import TracebackType

from opentelemetry import context, propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from pelican_worker._trace import NOT_TRACED, Processing, Run, Sending, TraceFields
from pelican_worker.keys import KEY_FIELD
from pelican_worker.message import Message, Outcome, error_text

#: The name of the library's tracer.
TRACER = "pelican"
#: A topic's partition ``{T:i}`` names its topic.
_PARTITION = re.compile(r"\{(.*):\d+\}", re.DOTALL)


class OpenTelemetry:
    """Spans from the global tracer provider, contexts through the global propagator."""

    def __init__(self) -> None:
        # A proxy until the application sets its provider, then that provider's tracer.
        self._tracer = trace.get_tracer(TRACER)
        self._sdk = False

    def _installed(self) -> bool:
        """Whether the application installed an SDK (a tracer provider of its own): until then nothing is recorded
        and no field added, at the cost of this look. A process sets its provider once: once there, it stays."""
        if not self._sdk:
            provider = trace.get_tracer_provider()
            self._sdk = not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))
        return self._sdk

    def start_sending(
        self,
        stream: str,
        message_id: str | None,
        key: str | bytes | None,
        count: int | None,
        carried: TraceFields | None,
    ) -> Sending:
        if not self._installed():
            return NOT_TRACED
        span = self._tracer.start_span(f"send {stream}", kind=SpanKind.PRODUCER)
        # Without an SDK the span records nothing: its attributes are not even built.
        if span.is_recording():
            attributes = _topic(stream)
            if message_id is not None:
                attributes["pelican.message_id"] = message_id
            if key is not None:
                attributes["pelican.key"] = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
            if count is not None:
                attributes["messaging.batch.message_count"] = count
            span.set_attributes(
                attributes
                | {
                    "messaging.system": "redis",
                    "messaging.destination.name": stream,
                    "messaging.operation.type": "send",
                    "messaging.operation.name": "publish",
                }
            )
        if carried is None:
            carried = []
            propagate.inject(carried, trace.set_span_in_context(span), _FIELDS)
        return _Sending(span, carried)

    def processing(self, where: Processing, message: Message) -> Run:
        return _Run(self._tracer, where, message) if self._installed() else NOT_TRACED


class _Sending:
    def __init__(self, span: Span, fields: TraceFields) -> None:
        self.fields = fields
        self._span = span

    def sent(self, entry_id: str | None = None) -> None:
        if entry_id is not None:
            self._span.set_attribute("messaging.message.id", entry_id)
        self._span.end()

    def failed(self, error: BaseException) -> None:
        self._span.set_status(Status(StatusCode.ERROR, str(error)))
        self._span.end()


class _Run:
    def __init__(self, tracer: trace.Tracer, where: Processing, message: Message) -> None:
        parent = propagate.extract(message, getter=_ENTRY)
        self._span = span = tracer.start_span(f"process {where.stream}", context=parent, kind=SpanKind.CONSUMER)
        # Without an SDK the span records nothing: its attributes are not even built.
        if span.is_recording():
            span.set_attributes(_process_attributes(where, message))
        self._context = trace.set_span_in_context(span, parent)
        self._token: Token[Context] | None = None

    def __enter__(self) -> _Run:
        self._token = context.attach(self._context)
        return self

    def ended(self, outcome: Outcome) -> None:
        if self._span.is_recording():
            self._span.set_attribute("pelican.outcome", outcome.kind)
            if outcome.reason is not None:
                self._span.set_attribute("pelican.reason", outcome.reason)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._token is not None:
            context.detach(self._token)
        if error is not None and self._span.is_recording():
            self._span.set_status(Status(StatusCode.ERROR, error_text(error)))
            self._span.set_attribute("pelican.outcome", "fail")
        self._span.end()


def _topic(stream: str) -> dict[str, AttributeValue]:
    partition = _PARTITION.fullmatch(stream)
    return {"pelican.topic": partition.group(1)} if partition else {}


def _process_attributes(where: Processing, message: Message) -> dict[str, AttributeValue]:
    attributes = _topic(where.stream)
    key = message.field(KEY_FIELD)
    if key is not None:
        attributes["pelican.key"] = key.decode("utf-8", "replace")
    return attributes | {
        "messaging.system": "redis",
        "messaging.destination.name": where.stream,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.message.id": message.id,
        "messaging.consumer.group.name": where.group,
        "messaging.client.id": where.consumer,
    }


class _FieldSetter(Setter[TraceFields]):
    """An injector into the fields added to an entry: an empty value (a ``tracestate`` without entries) adds none."""

    def set(self, carrier: TraceFields, key: str, value: str) -> None:
        if value:
            carrier.append((key, value))


class _EntryGetter(Getter[Message]):
    """An extractor from an entry's fields (the first value of a name, as :meth:`Message.field`)."""

    def get(self, carrier: Message, key: str) -> list[str] | None:
        value = carrier.text(key)
        return None if value is None else [value]

    def keys(self, carrier: Message) -> list[str]:
        return [name.decode("utf-8", "replace") for name, _ in carrier.fields]


_FIELDS = _FieldSetter()
_ENTRY = _EntryGetter()
