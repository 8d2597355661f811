"""The worker's and the producer's metrics through OpenTelemetry (SPEC 23, docs/src/tracing.md "Metrics") against a
real redis-server, with the OpenTelemetry SDK's in-memory reader installed as an application would: the instruments'
names, units, attribute sets and values a dashboard reads, and that they agree with the worker's stats (the
Prometheus view). Without the SDK, or without the extra ``otel``, a worker and a producer run as ever (in a process
of their own: the meter provider is global, and set once)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Mapping

import pytest
from helpers import GROUP, client, eventually
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader, NumberDataPoint

from pelican_worker import Message, Outcome, Producer, PublishFailed, Worker, WorkerStats
from pelican_worker.keys import DELIVERIES_FIELD

_READER = InMemoryMetricReader()

#: A data point: its attributes, sorted, and its value (a histogram's count).
Points = dict[tuple[tuple[str, str], ...], int]


#: The streams of the test: the provider is the session's, and the tests after this one record into it too.
_STREAM = "orders-metered"
_WRONG = "not-a-stream"


def _points(name: str) -> tuple[str, Points]:
    """The unit and the points of the instrument ``name`` of the meter ``pelican``, on the test's streams."""
    data = _READER.get_metrics_data()
    assert data is not None
    found = [
        metric
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        if scope.scope.name == "pelican"
        for metric in scope.metrics
        if metric.name == name
    ]
    assert found, f"no instrument {name}"
    points: Points = {}
    for point in found[0].data.data_points:
        assert isinstance(point, (HistogramDataPoint, NumberDataPoint))
        value = point.count if isinstance(point, HistogramDataPoint) else point.value
        attributes = dict(point.attributes or {})
        if attributes.get("messaging.destination.name") in (_STREAM, _WRONG):
            points[_key(attributes)] = int(value)
    return found[0].unit or "", points


def _key(attributes: Mapping[str, object]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((key, str(value)) for key, value in attributes.items()))


async def _obey(message: Message) -> Outcome:
    """The handler the test runs: it obeys the field ``handle``; a requeued copy of a retry is done."""
    handle = message.text("handle")
    if handle == "fail":
        raise ValueError("the card was declined")
    if handle == "terminal":
        return Outcome.terminal("Gone")
    if handle == "retry" and message.field(DELIVERIES_FIELD) is None:
        return Outcome.retry()
    if handle == "slow":
        await asyncio.sleep(30)
    return Outcome.done()


_UNMEASURED = """
import asyncio, sys
if sys.argv[2] == "no-api":
    sys.modules["opentelemetry"] = None  # as if the extra `otel` were not installed: importing it fails
from redis.asyncio import Redis
from pelican_worker import Outcome, Producer, Worker

async def main(url):
    await Redis.from_url(url).xgroup_create("orders", "billing", id="0", mkstream=True)
    async with Producer(url, "orders") as producer:
        await producer.publish({"handle": "done"})
    stop = asyncio.Event()
    worker = Worker(url, "orders", "billing", "worker-1", block=0.05)

    async def handle(message):
        stop.set()
        return Outcome.done()

    print((await worker.run(handle, stop)).done)

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.parametrize("setup", ["no-sdk", "no-api"])
def test_without_an_sdk_or_the_otel_extra_a_worker_and_a_producer_run_as_ever(redis_url: str, setup: str) -> None:
    ran = subprocess.run(
        [sys.executable, "-c", _UNMEASURED, redis_url, setup], capture_output=True, text=True, timeout=60, check=False
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "1"


def test_a_worker_and_a_producer_record_the_messaging_conventions_instruments_as_the_stats_count(
    redis_url: str,
) -> None:
    # The application installs an SDK, before it makes its producers and workers.
    metrics.set_meter_provider(MeterProvider(metric_readers=[_READER]))
    stream = _STREAM

    async def scenario() -> WorkerStats:
        r = client(redis_url)
        await r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        await r.set(_WRONG, "x")
        worker = Worker(redis_url, stream, GROUP, "worker-1", block=0.05, shutdown_grace=0.2)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(_obey, stop))
        async with Producer(redis_url, stream) as producer:
            ids = {
                handle: await producer.publish({"handle": handle}) for handle in ("done", "fail", "retry", "terminal")
            }

            async def runs(done: int, failed: int) -> bool:
                stats = worker.stats
                return (stats.done, stats.failed, stats.retried, stats.terminal) == (done, failed, 1, 1)

            await eventually(lambda: runs(1, 1), what="the four runs")
            # The pass retries the failure and the retry (a copy at the end, the original ACKed); the failure's copy
            # fails again (at the cap: dead-letter-bound).
            for handle in ("fail", "retry"):
                await r.xadd(stream, {"handle": handle, "pelican-origin-id": ids[handle], DELIVERIES_FIELD: "1"})
                await r.xack(stream, GROUP, ids[handle])
            await eventually(lambda: runs(2, 2), what="the copies' runs")
            await producer.publish({"handle": "slow"})

            async def slow_in_flight() -> bool:
                return worker.stats.in_flight == 1

            await eventually(slow_in_flight, what="the slow one in flight")
        stop.set()
        stats = await task
        async with Producer(redis_url, _WRONG) as wrong:
            with pytest.raises(PublishFailed):
                await wrong.publish({"handle": "done"})
        await r.aclose()
        return stats

    stats = asyncio.run(scenario())
    assert stats == WorkerStats(done=2, terminal=1, failed=2, retried=1, abandoned=1, in_flight=0)

    names = {"messaging.destination.name": stream, "messaging.consumer.group.name": GROUP}

    def messaging(operation: str, **more: str) -> tuple[tuple[str, str], ...]:
        return _key(
            {
                "messaging.system": "redis",
                "messaging.operation.name": operation,
                "messaging.operation.type": operation,
                **names,
                **{key.replace("_", "."): value for key, value in more.items()},
            }
        )

    assert _points("messaging.client.consumed.messages") == ("{message}", {messaging("receive"): 7})
    assert _points("messaging.process.duration") == (
        "s",
        {
            messaging("process", pelican_outcome="done"): 2,
            messaging("process", pelican_outcome="failed", error_type="ValueError"): 2,
            messaging("process", pelican_outcome="retried"): 1,
            messaging("process", pelican_outcome="terminal"): 1,
        },
    )
    assert _points("pelican.worker.in_flight") == ("{message}", {_key(names): 0})
    assert _points("pelican.worker.abandoned") == ("{message}", {_key(names): 1})

    def publish(destination: str, **more: str) -> tuple[tuple[str, str], ...]:
        return _key(
            {
                "messaging.system": "redis",
                "messaging.destination.name": destination,
                "messaging.operation.name": "publish",
                "messaging.operation.type": "send",
                **{key.replace("_", "."): value for key, value in more.items()},
            }
        )

    assert _points("messaging.client.sent.messages") == (
        "{message}",
        {publish(stream): 5, publish(_WRONG, error_type="failed"): 1},
    )
