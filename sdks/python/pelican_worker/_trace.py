"""A message's trace through the stream (contract/README.md, "Trace context").

A publish is a ``send <stream>`` span whose context travels in the entry's fields (``traceparent``, ``tracestate``),
and each handler run is a ``process <stream>`` span continuing it. Everything goes through OpenTelemetry's API (its
global tracer provider and propagator), the optional extra ``otel``, imported at the first publish or handler run:
without it nothing is traced, and with it nothing is recorded nor added to an entry until the application installs
an SDK. The spans themselves are :mod:`pelican_worker._otel`'s.
"""

from __future__ import annotations

import functools
from types import TracebackType
from typing import Protocol

from pelican_worker.message import Message, Outcome

__all__ = [
    "KEPT",
    "NOT_TRACED",
    "Carried",
    "Processing",
    "Run",
    "Sending",
    "TraceFields",
    "processing",
    "start_sending",
]

#: The fields a message's trace context is carried in, in order.
TraceFields = list[tuple[str, str]]


class Sending(Protocol):
    """A publish being sent: the fields that carry its span's context into the entry, and the span's end."""

    @property
    def fields(self) -> TraceFields: ...

    def sent(self, entry_id: str | None = None) -> None:
        """Ends the span: with the entry's id when there is one (not for a batch)."""

    def failed(self, error: BaseException) -> None:
        """Ends the span with the error."""


class Processing(Protocol):
    """Where a handler runs: the consumer's names, for the span's attributes."""

    @property
    def stream(self) -> str: ...
    @property
    def group(self) -> str: ...
    @property
    def consumer(self) -> str: ...


class Run(Protocol):
    """A handler run inside ``process <stream>``, a block: :meth:`ended` with its outcome; an exception leaving the
    block ends the span with status ERROR and the exception's text (the entry's last error's)."""

    def __enter__(self) -> Run: ...
    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None: ...
    def ended(self, outcome: Outcome) -> None: ...


class Tracing(Protocol):
    def start_sending(
        self,
        stream: str,
        message_id: str | None,
        key: str | bytes | None,
        count: int | None,
        carried: TraceFields | None,
    ) -> Sending: ...
    def processing(self, where: Processing, message: Message) -> Run: ...


class _NotTraced:
    """Without OpenTelemetry's API, or without an SDK: no span, no field."""

    @property
    def fields(self) -> TraceFields:
        return []

    def start_sending(
        self,
        stream: str,
        message_id: str | None,
        key: str | bytes | None,
        count: int | None,
        carried: TraceFields | None,
    ) -> Sending:
        return self

    def sent(self, entry_id: str | None = None) -> None:
        pass

    def failed(self, error: BaseException) -> None:
        pass

    def processing(self, where: Processing, message: Message) -> Run:
        return self

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        pass

    def ended(self, outcome: Outcome) -> None:
        pass


#: No span, no field.
NOT_TRACED = _NotTraced()


@functools.cache
def _tracing() -> Tracing:
    try:
        from pelican_worker._otel import OpenTelemetry
    except ImportError:  # the extra `otel` is not installed
        return NOT_TRACED
    return OpenTelemetry()


def start_sending(
    stream: str,
    *,
    message_id: str | None = None,
    key: str | bytes | None = None,
    count: int | None = None,
    carried: TraceFields | None = None,
) -> Sending:
    """Starts ``send <stream>`` as a child of the current context. ``carried``: the fields of an earlier attempt of
    the same idempotent publish, sent again instead of this span's (the entry keeps its first context)."""
    return _tracing().start_sending(stream, message_id, key, count, carried)


def processing(where: Processing, message: Message) -> Run:
    """The block that runs the handler on ``message`` inside ``process <stream>``, continuing the trace the entry
    carries (a new trace without one): the handler's own spans are its children."""
    return _tracing().processing(where, message)


#: How many message ids :class:`Carried` keeps.
KEPT = 1024


class Carried:
    """The trace fields of idempotent publishes whose outcome was unknown or unavailable, by message id, so that a
    publish of the same message id sends them again; the last :data:`KEPT` at most (a dict keeps insertion order)."""

    def __init__(self) -> None:
        self._fields: dict[str, TraceFields] = {}

    def take(self, message_id: str) -> TraceFields | None:
        return self._fields.pop(message_id, None)

    def keep(self, message_id: str, fields: TraceFields) -> None:
        if message_id not in self._fields and len(self._fields) >= KEPT:
            del self._fields[next(iter(self._fields))]
        self._fields[message_id] = fields
