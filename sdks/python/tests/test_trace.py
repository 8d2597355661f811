"""A message's trace through the stream (SPEC 23, contract/README.md "Trace context") against a real server, with the
OpenTelemetry SDK's in-memory exporter and the W3C propagator installed as an application would: what the entry
carries, and the spans of each publish and handler run, one trace from the application's request to every run.

OpenTelemetry takes one tracer provider per process: the SDK is installed once, and each test here turns the W3C
propagator on, and off again after it, so that no other test's entry carries a context. Without an SDK, and without
the ``otel`` extra, a fresh interpreter runs the library.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence

import pytest
from helpers import CONSUMER, GROUP, STREAM, client, eventually, running, worker
from opentelemetry import propagate, trace
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from redis.asyncio import Redis

from pelican_worker import (
    Message,
    Outcome,
    Producer,
    PublishOutcomeUnknown,
    PublishUnavailable,
    TopicProducer,
    TopicWorker,
    sync,
)
from pelican_worker._trace import KEPT, Carried
from pelican_worker.keys import KEY_FIELD, errors_key, partition_stream, settings_key, topic_key

_EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The SDK (installed once) and the W3C propagator, for one test; its spans only."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
    _EXPORTER.clear()
    propagate.set_global_textmap(TraceContextTextMapPropagator())
    try:
        yield _EXPORTER
    finally:
        propagate.set_global_textmap(CompositePropagator([]))


@contextlib.asynccontextmanager
async def request(name: str) -> AsyncIterator[trace.Span]:
    """A span of the application's, current while the block runs."""
    with trace.get_tracer("shop").start_as_current_span(name) as span:
        yield span


def named(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def of_message(spans: Sequence[ReadableSpan], entry_id: str) -> ReadableSpan:
    found = [span for span in spans if attribute(span, "messaging.message.id") == entry_id]
    assert len(found) == 1, f"one span of message {entry_id}: {found}"
    return found[0]


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent else None


def span_id(span: ReadableSpan) -> int | None:
    return span.context.span_id if span.context else None


def trace_id(span: ReadableSpan) -> int | None:
    return span.context.trace_id if span.context else None


def attribute(span: ReadableSpan, key: str) -> object:
    return (span.attributes or {}).get(key)


def context_of(span: ReadableSpan | trace.Span) -> str:
    """The ``traceparent`` of a span."""
    context = span.get_span_context()
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


async def entries(r: Redis, stream: str) -> list[tuple[str, list[str]]]:
    """Each entry of ``stream``: its id and its fields as text, in order."""
    return [
        (str(entry_id), [str(part) for pair in (fields or {}).items() for part in pair])
        for entry_id, fields in await r.xrange(stream) or []
    ]


async def obey(message: Message) -> Outcome:
    """The handler the tests run: it obeys the field ``handle``."""
    handle = message.text("handle")
    if handle == "fail":
        raise ValueError("the card was declined")
    if handle == "terminal:Gone":
        return Outcome.terminal("Gone")
    if handle == "retry":
        return Outcome.retry()
    return Outcome.done()


_UNTRACED = """
import asyncio, json, sys
if sys.argv[2] == "no-api":
    sys.modules["opentelemetry"] = None  # as if the extra `otel` were not installed: importing it fails
from redis.asyncio import Redis
from pelican_worker import Outcome, Producer, Worker

async def main(url):
    async with Producer(url, "orders") as producer:
        await producer.publish({"handle": "done"})
    seen = []

    async def handle(message):
        if "opentelemetry" in sys.modules and sys.modules["opentelemetry"] is not None:
            from opentelemetry import trace
            seen.append(trace.get_current_span().is_recording())
        else:
            seen.append(None)
        return Outcome.done()

    stop = asyncio.Event()
    worker = Worker(url, "orders", "billing", "worker-1", block=0.05)
    task = asyncio.create_task(worker.run(handle, stop))
    for _ in range(500):
        if seen:
            break
        await asyncio.sleep(0.01)
    stop.set()
    await task
    raw = await Redis.from_url(url, decode_responses=True).execute_command("XRANGE", "orders", "-", "+")
    print(json.dumps({"fields": [[p for pair in f.items() for p in pair] for _, f in raw], "recording": seen}))

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.parametrize("setup", ["no-sdk", "no-api"])
def test_without_an_sdk_or_the_otel_extra_nothing_is_added_and_the_handler_runs_in_no_recording_span(
    redis_url: str, setup: str
) -> None:
    async def create_group() -> None:
        await client(redis_url).xgroup_create("orders", "billing", id="0", mkstream=True)

    asyncio.run(create_group())
    ran = subprocess.run(
        [sys.executable, "-c", _UNTRACED, redis_url, setup], capture_output=True, text=True, timeout=60, check=False
    )
    assert ran.returncode == 0, ran.stderr
    seen = json.loads(ran.stdout)
    assert seen == {"fields": [["handle", "done"]], "recording": [False if setup == "no-sdk" else None]}


def test_a_message_is_one_trace_from_the_request_through_its_publish_to_each_handler_run(
    redis_url: str, spans: InMemorySpanExporter
) -> None:
    handles = ["done", "fail", "terminal:Gone", "retry"]
    active: dict[str, trace.SpanContext] = {}

    async def remembering(message: Message) -> Outcome:
        active[message.id] = trace.get_current_span().get_span_context()
        return await obey(message)

    async def scenario() -> None:
        r = client(redis_url)
        await r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        async with Producer(redis_url, STREAM) as producer, request("checkout") as checkout:
            ids = [await producer.publish({"handle": handle}) for handle in handles]
        request_trace = checkout.get_span_context().trace_id
        for _, fields in await entries(r, STREAM):
            assert fields[:1] == ["handle"], "the application's fields first"
            assert fields[-2] == "traceparent", "the context last"
            assert fields[-1].startswith(f"00-{request_trace:032x}-"), "the request's trace"
            assert len(fields) == 4, "no tracestate without entries"

        async def all_ran() -> bool:
            return len(active) == len(handles)

        async with running(worker(redis_url, block=0.05), remembering):
            await eventually(all_ran, what="a run of each message")

        finished = spans.get_finished_spans()
        sends, runs = named(finished, f"send {STREAM}"), named(finished, f"process {STREAM}")
        assert (len(sends), len(runs)) == (4, 4), [span.name for span in finished]
        for entry_id in ids:
            send, run = of_message(sends, entry_id), of_message(runs, entry_id)
            assert send.kind == SpanKind.PRODUCER
            assert parent_id(send) == checkout.get_span_context().span_id, "a publish is a child of the request"
            assert (attribute(send, "messaging.system"), attribute(send, "messaging.destination.name")) == (
                "redis",
                STREAM,
            )
            assert attribute(send, "messaging.operation.type") == "send"
            assert run.kind == SpanKind.CONSUMER
            assert trace_id(run) == request_trace, "one trace from the request to the handler"
            assert parent_id(run) == span_id(send), "each run continues its publish"
            assert attribute(run, "messaging.consumer.group.name") == GROUP
            assert attribute(run, "messaging.client.id") == CONSUMER
            assert attribute(run, "messaging.operation.type") == "process"
            assert active[entry_id].span_id == span_id(run), "the handler runs in its run's span"
        done, failed, terminal, retried = (of_message(runs, entry_id) for entry_id in ids)
        assert attribute(done, "pelican.outcome") == "done"
        assert done.status.status_code == StatusCode.UNSET
        assert attribute(failed, "pelican.outcome") == "fail"
        assert failed.status.status_code == StatusCode.ERROR
        assert failed.status.description == "ValueError: the card was declined"
        assert await r.hget(errors_key(STREAM, GROUP), ids[1]) == failed.status.description, "the last error's text"
        assert (attribute(terminal, "pelican.outcome"), attribute(terminal, "pelican.reason")) == ("terminal", "Gone")
        assert attribute(retried, "pelican.outcome") == "retry"

    asyncio.run(scenario())


def test_a_batch_is_one_send_span_whose_context_every_entry_carries(
    redis_url: str, spans: InMemorySpanExporter
) -> None:
    async def scenario() -> None:
        async with Producer(redis_url, STREAM) as producer, request("import"):
            published = await producer.publish_batch([{"n": "1"}, {"n": "2"}])
        [send] = named(spans.get_finished_spans(), f"send {STREAM}")
        assert attribute(send, "messaging.batch.message_count") == 2
        context = context_of(send)
        assert await entries(client(redis_url), STREAM) == [
            (published.ids[0], ["n", "1", "traceparent", context]),
            (published.ids[1], ["n", "2", "traceparent", context]),
        ]

    asyncio.run(scenario())


@pytest.mark.parametrize("ordering", ["None", "PerKey"])
def test_a_topics_publish_and_handler_run_name_the_topic_the_key_and_the_partition(
    redis_url: str, spans: InMemorySpanExporter, ordering: str
) -> None:
    topic = "events"

    async def scenario() -> None:
        r = client(redis_url)
        settings: dict[str, str | int] = {
            "contractVersion": 2,
            "partitions": 2,
            "ordering": ordering,
            "minIdleMs": 60_000,
            "retryAfterMs": 60_000,
            "maxDeliveries": 5,
            "backoffFactor": 1,
            "backoffMaxMs": 0,
        }
        await r.hset(topic_key(topic), mapping={"partitions": 2, "contractVersion": 2})
        for key in [settings_key(topic, GROUP), *(settings_key(partition_stream(topic, p), GROUP) for p in (0, 1))]:
            await r.hset(key, mapping=settings)  # type: ignore[arg-type]
        for p in (0, 1):
            await r.xgroup_create(partition_stream(topic, p), GROUP, id="0", mkstream=True)
        async with await TopicProducer.connect(redis_url, topic) as producer, request("checkout"):
            published = await producer.publish({"handle": "done"}, key="order-42")
        stream = partition_stream(topic, published.partition)

        member = await TopicWorker.connect(redis_url, topic, GROUP, "member-1", block=0.05)
        stop = asyncio.Event()
        task = asyncio.create_task(member.run(obey, stop))

        async def ran() -> bool:
            return len(named(spans.get_finished_spans(), f"process {stream}")) == 1

        try:
            await eventually(ran, what="the handler run")
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
        finished = spans.get_finished_spans()
        send = of_message(named(finished, f"send {stream}"), published.id)
        run = of_message(named(finished, f"process {stream}"), published.id)
        for span in (send, run):
            assert (
                attribute(span, "pelican.topic"),
                attribute(span, "pelican.key"),
                attribute(span, "messaging.destination.name"),
            ) == (topic, "order-42", stream)
        assert parent_id(run) == span_id(send), "the run continues its publish"
        assert attribute(run, "pelican.outcome") == "done"
        [(_, fields)] = await entries(r, stream)
        assert fields[:4] == [KEY_FIELD, "order-42", "handle", "done"], "the key first"
        assert fields[4] == "traceparent", "the context last"

    asyncio.run(scenario())


def test_a_sync_handler_runs_in_its_runs_span(redis_url: str, spans: InMemorySpanExporter) -> None:
    seen: list[trace.SpanContext] = []

    def handle(message: Message) -> Outcome:
        seen.append(trace.get_current_span().get_span_context())
        facade.stop()
        return Outcome.done()

    async def publish() -> str:
        await client(redis_url).xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        async with Producer(redis_url, STREAM) as producer:
            return await producer.publish({"handle": "done"})

    entry_id = asyncio.run(publish())
    facade = sync.Worker(redis_url, STREAM, GROUP, CONSUMER, block=0.05)
    facade.run(handle, signals=False)
    run = of_message(named(spans.get_finished_spans(), f"process {STREAM}"), entry_id)
    assert [context.span_id for context in seen] == [span_id(run)]


class LostRequest:
    """A loopback proxy to the server that loses one request: on the first connection whose client sends
    ``EVALSHA``, it closes the connection instead of passing the command on (so it never ran). Later connections pass
    through."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.cut = False

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[int]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        try:
            yield server.sockets[0].getsockname()[1]
        finally:
            server.close()

    async def _serve(self, from_client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        from_server, to_server = await asyncio.open_connection("127.0.0.1", self.port)

        async def upstream() -> None:
            while data := await from_client.read(65536):
                if not self.cut and b"EVALSHA" in data.upper():
                    self.cut = True
                    return
                to_server.write(data)
                await to_server.drain()

        async def downstream() -> None:
            while data := await from_server.read(65536):
                to_client.write(data)
                await to_client.drain()

        tasks = [asyncio.create_task(upstream()), asyncio.create_task(downstream())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            to_client.close()
            to_server.close()


def test_a_retried_idempotent_publish_writes_the_context_of_its_first_attempt(
    idmp_redis_url: str, idmp_port: int, spans: InMemorySpanExporter
) -> None:
    async def scenario() -> None:
        proxy = LostRequest(idmp_port)
        async with proxy.serving() as port:
            producer = await Producer(f"redis://127.0.0.1:{port}", STREAM, timeout=5.0).idempotent("shop-1")
            async with producer:
                # The first attempt never reaches the server: its outcome is unknown to the producer.
                async with request("checkout") as checkout:
                    with pytest.raises(PublishOutcomeUnknown):
                        await producer.publish("order-7", {"order": "7"})
                assert proxy.cut
                assert await client(idmp_redis_url).xlen(STREAM) == 0, "the first attempt wrote nothing"
                # The application publishes it again, later, in another span (an attempt before the connection is
                # back is unavailable).
                entry_id = None
                for _ in range(50):
                    async with request("retry"):
                        with contextlib.suppress(PublishUnavailable):
                            entry_id = await producer.publish("order-7", {"order": "7"})
                    if entry_id is not None:
                        break
                    await asyncio.sleep(0.1)
        assert entry_id is not None, "published again"
        sends = named(spans.get_finished_spans(), f"send {STREAM}")
        first = sends[0]
        assert parent_id(first) == checkout.get_span_context().span_id
        assert first.status.status_code == StatusCode.ERROR
        assert attribute(first, "pelican.message_id") == "order-7"
        written = of_message(sends, entry_id)
        assert trace_id(written) != trace_id(first), "published again in another trace"
        assert await entries(client(idmp_redis_url), STREAM) == [
            (entry_id, ["order", "7", "traceparent", context_of(first)])
        ]

    asyncio.run(scenario())


def test_the_carried_fields_are_kept_for_the_last_1024_message_ids_only_each_taken_once() -> None:
    carried = Carried()
    for n in range(KEPT + 1):
        carried.keep(f"m-{n}", [("traceparent", str(n))])
    assert carried.take("m-0") is None, "the oldest was dropped"
    assert carried.take(f"m-{KEPT}") == [("traceparent", str(KEPT))]
    assert carried.take(f"m-{KEPT}") is None, "taken once"
