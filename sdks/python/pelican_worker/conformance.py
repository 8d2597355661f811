"""The conformance worker: ``python3 -m pelican_worker.conformance``.

Configured by environment: ``REDIS_URL``, ``STREAM``, ``GROUP``, ``CONSUMER`` (default: the Pod's name) and
``SHUTDOWN_GRACE_MS``. Its handler obeys the message: field ``ms`` = how long it takes, field ``handle`` = ``done`` |
``retry`` | ``fail`` | ``terminal:<Reason>`` | ``exit`` (the process exits at once with status 3). It prints one JSON
line per handler run on stdout, and exits 0 after a SIGTERM once its shutdown is complete, or 4 (after its shutdown)
when the operator speaks a contract version this library does not know.

With ``SENTINEL_MASTER=<name>``, ``REDIS_URL`` names a sentinel, and redis-py's ``Sentinel`` asks it for the primary
monitored under that name, again whenever a connection is made. With ``REDIS_CLUSTER=1``, ``REDIS_URL`` names one
primary of a Redis Cluster, reached through redis-py's ``RedisCluster``.

With ``TOPIC=<T>`` instead of ``STREAM`` it is a member of topic ``T``'s group: it runs the library's
:class:`~pelican_worker.TopicWorker` as member ``CONSUMER``, with a membership ttl of ``MEMBERSHIP_TTL_MS`` when set,
and each run line also says ``partition``, ``key`` (``null`` without one), ``startedAt`` and ``endedAt`` (ms since
the epoch; for ``exit`` both the start). A topic the library refuses exits with status 4.

With ``MODE=publish`` it is a producer instead: it publishes ``MESSAGES`` messages idempotently (message ids ``m-0``,
``m-1``, ...), each published again with the same id until it answers an entry id, one JSON line per attempt.

With ``OTEL_EXPORTER_OTLP_ENDPOINT`` set (and the extra ``conformance`` installed), the library's spans go to it over
OTLP (HTTP/protobuf, the standard ``OTEL_EXPORTER_OTLP_*`` variables), the service named by ``OTEL_SERVICE_NAME``
(``pelican-conformance-python`` by default); whichever way the program ends, the spans still queued are exported
first (for at most 5 s).

With ``METRICS_PORT`` set (a worker of a stream; the extra ``conformance`` installed), the worker's metrics
(:mod:`pelican_worker.prometheus`, in a ``prometheus_client`` registry of its own) are served at
``http://127.0.0.1:<port>/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, NoReturn
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel

from pelican_worker._redis import RedisSource
from pelican_worker.keys import KEY_FIELD
from pelican_worker.message import InvalidReason, Message, Outcome
from pelican_worker.producer import Producer, PublishOutcomeUnknown, PublishUnavailable
from pelican_worker.settings import ContractVersionError
from pelican_worker.topic import NotATopic, TopicContractError
from pelican_worker.topic_worker import DEFAULT_MEMBERSHIP_TTL, OrderingError, TopicWorker
from pelican_worker.worker import Handler, Worker, run_until_signal

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

#: The SDK exporting the library's spans, when the program was given an OTLP endpoint.
_traces: TracerProvider | None = None


def export_traces() -> None:
    """Installs the OpenTelemetry SDK when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set: a tracer provider whose batch
    processor hands the spans to the OTLP exporter (configured by the standard variables), and the W3C propagator."""
    global _traces
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return
    from opentelemetry import propagate, trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    service = os.environ.get("OTEL_SERVICE_NAME") or "pelican-conformance-python"
    # The program shuts it down itself, with a bound, on every way out (the SDK's own exit hook waits up to 30 s).
    _traces = TracerProvider(resource=Resource.create({SERVICE_NAME: service}), shutdown_on_exit=False)
    _traces.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(_traces)
    propagate.set_global_textmap(TraceContextTextMapPropagator())


def flush_traces() -> None:
    """Exports the spans still queued and stops the exporter, waiting at most 5 s (the SDK's shutdown takes no
    bound: it waits for an export as long as the exporter's timeout)."""
    if _traces is None:
        return
    stopping = threading.Thread(target=_traces.shutdown, name="otel-shutdown", daemon=True)
    stopping.start()
    stopping.join(5.0)


def _exit_now(code: int) -> NoReturn:
    """Ends the process at once, without the interpreter's cleanup, once the queued spans are exported."""
    flush_traces()
    os._exit(code)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def handler_for(consumer: str, *, topic: bool = False) -> Handler:
    """The handler that obeys the message; ``topic``: its run lines say the partition, the key and the times."""

    async def handle(message: Message) -> Outcome:
        started = _now_ms()

        def _report(message: Message, consumer: str, outcome: str, ms: int) -> None:
            line: dict[str, object] = {"id": message.id, "consumer": consumer, "outcome": outcome, "ms": ms}
            if topic:
                line |= {
                    "partition": message.partition,
                    "key": message.text(KEY_FIELD),
                    "startedAt": started,
                    "endedAt": started if outcome == "exit" else _now_ms(),
                }
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()

        ms = int(message.text("ms") or 0)
        if ms > 0:
            await asyncio.sleep(ms / 1000)
        # `HANDLE` overrides every message's `handle` (a worker that fails whatever it reads).
        action = os.environ.get("HANDLE") or message.text("handle") or "done"
        if action == "exit":
            _report(message, consumer, "exit", ms)
            _exit_now(3)
        if action == "fail":
            _report(message, consumer, "fail", ms)
            raise RuntimeError("the message asked the conformance worker to fail")
        if action.startswith("terminal:"):
            try:
                outcome = Outcome.terminal(action.removeprefix("terminal:"))
            except InvalidReason:
                # The library refuses it before anything is written: a failure of the message.
                _report(message, consumer, "fail", ms)
                raise
            _report(message, consumer, "terminal", ms)
            return outcome
        if action == "retry":
            _report(message, consumer, "retry", ms)
            return Outcome.retry()
        _report(message, consumer, "done", ms)
        return Outcome.done()

    return handle


def _line(**fields: str) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def source(url: str) -> RedisSource:
    """``REDIS_URL`` as the library takes it: the URL itself, a factory of clients of the primary that the sentinel
    it names (with ``SENTINEL_MASTER``) answers, or (``REDIS_CLUSTER=1``) of the Cluster of the primary it names."""
    if os.environ.get("REDIS_CLUSTER") == "1":

        def cluster() -> RedisCluster:
            # The worker's blocking reads wait up to 1 s on the server: the socket waits longer.
            return RedisCluster.from_url(url, socket_timeout=10.0, socket_connect_timeout=5.0)

        return cluster
    name = os.environ.get("SENTINEL_MASTER")
    if not name:
        return url
    sentinel_url = urlsplit(url)
    sentinel = Sentinel([(sentinel_url.hostname or "127.0.0.1", sentinel_url.port or 26379)])
    db = int(sentinel_url.path.strip("/") or 0)

    def primary() -> Redis:
        # The worker's blocking reads wait up to 1 s on the server: the socket waits longer.
        client: Redis = sentinel.master_for(name, db=db, socket_timeout=10.0, socket_connect_timeout=5.0)
        return client

    return primary


async def publish(url: RedisSource, stream: str, messages: int) -> None:
    """An attempt whose outcome is unknown (its reply was lost) or that found the server unavailable is published
    again with the same message id, as the contract says: the server answers the first entry's id."""
    for n in range(messages):
        message = f"m-{n}"
        while True:
            # A producer of its own per attempt: a lost reply leaves the last connection broken.
            async with Producer(url, stream) as producer:
                try:
                    entry = await (await producer.idempotent()).publish(message, {"n": str(n)})
                except (PublishOutcomeUnknown, PublishUnavailable):
                    _line(message=message, outcome="unknown")
                    await asyncio.sleep(0.1)
                    continue
            _line(message=message, outcome="published", id=entry)
            break


async def run_topic(url: RedisSource, topic: str, grace: float) -> None:
    ttl_ms = os.environ.get("MEMBERSHIP_TTL_MS")
    worker = await TopicWorker.connect(
        url,
        topic,
        os.environ["GROUP"],
        os.environ.get("CONSUMER") or None,
        membership_ttl=int(ttl_ms) / 1000 if ttl_ms else DEFAULT_MEMBERSHIP_TTL,
        shutdown_grace=grace,
    )
    await run_until_signal(worker, handler_for(worker.member, topic=True))


def serve_metrics(worker: Worker, port: int) -> None:
    """Serves ``worker``'s metrics as an application would: its collector in a registry, read at each scrape (a
    daemon thread of ``prometheus_client``)."""
    from prometheus_client import CollectorRegistry, start_http_server

    from pelican_worker.prometheus import register

    registry = CollectorRegistry()
    register(worker, registry)
    start_http_server(port, addr="127.0.0.1", registry=registry)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    export_traces()
    try:
        run()
    finally:
        flush_traces()


def run() -> None:
    url = source(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379"))
    if os.environ.get("MODE") == "publish":
        asyncio.run(publish(url, os.environ["STREAM"], int(os.environ["MESSAGES"])))
        return
    grace_ms = os.environ.get("SHUTDOWN_GRACE_MS")
    grace = int(grace_ms) / 1000 if grace_ms else 20.0  # the library's default
    topic = os.environ.get("TOPIC")
    if topic:
        try:
            asyncio.run(run_topic(url, topic, grace))
        except (NotATopic, TopicContractError, OrderingError, ContractVersionError) as error:
            logging.getLogger("pelican_worker").error("%s", error)
            sys.exit(4)
        return
    worker = Worker(
        url,
        os.environ["STREAM"],
        os.environ["GROUP"],
        os.environ.get("CONSUMER") or None,
        shutdown_grace=grace,
    )
    metrics_port = os.environ.get("METRICS_PORT")
    if metrics_port:
        serve_metrics(worker, int(metrics_port))
    try:
        asyncio.run(run_until_signal(worker, handler_for(worker.consumer)))
    except ContractVersionError:
        sys.exit(4)  # the worker logged it


if __name__ == "__main__":
    main()
