"""A topic beside one stream, on one server: the publish rate (one message after another, a key each of 1,000) and the
consume rate (one member, or one worker, at concurrency 16, a handler that does nothing) of a plain stream and of
topics of 1 and 8 partitions.

    python bench/topic.py [N]      (default 20000 messages a case; REDIS_URL, else a redis-server started on a free
                                    port; ROUNDS, default 3, each running every case in turn: the medians count)

The topic's settings are written here as the operator writes them (the tests' ``make_topic`` lives in a test module).
Every message carries its number: the consume rate counts the messages a handler saw exactly once, timed from
connecting (a member's join included) until each was seen; the messages seen more than once are printed.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.typing import EncodableT, FieldT
from throughput import start_server

from pelican_worker import Message, Outcome, Producer, TopicProducer, TopicWorker, Worker
from pelican_worker.keys import KEY_FIELD, partition_stream, settings_key, topic_key

GROUP = "g"
KEYS = 1_000
CONCURRENCY = 16
#: A case that has not seen every message after this long fails the run.
TIMEOUT = 120.0


@dataclass
class Case:
    """A plain stream (``partitions`` None) or a topic; the rates of each round, and the messages seen again."""

    label: str
    partitions: int | None
    ordering: str
    published: list[float] = field(default_factory=list)
    consumed: list[float] = field(default_factory=list)
    seen_again: int = 0


async def declare(r: Redis, stream: str, case: Case) -> None:
    """The settings the operator writes for the case's stream or topic, and the group on every stream."""
    settings: dict[FieldT, EncodableT] = {"minIdleMs": 30_000, "retryAfterMs": 1_000, "maxDeliveries": 5}
    if case.partitions is None:
        await r.hset(settings_key(stream, GROUP), mapping=settings | {"contractVersion": 1})
        await r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        return
    settings |= {"contractVersion": 2, "partitions": case.partitions, "ordering": case.ordering}
    settings |= {"backoffFactor": 1, "backoffMaxMs": 0}
    await r.hset(settings_key(stream, GROUP), mapping=settings)
    for p in range(case.partitions):
        await r.hset(settings_key(partition_stream(stream, p), GROUP), mapping=settings)
        await r.xgroup_create(partition_stream(stream, p), GROUP, id="0", mkstream=True)
    await r.hset(topic_key(stream), mapping={"partitions": case.partitions, "contractVersion": 2})


async def publish(url: str, stream: str, case: Case, n: int) -> float:
    """Publishes ``n`` messages one after another, message i with key i % KEYS; messages per second."""
    started = time.perf_counter()
    if case.partitions is None:
        producer = Producer(url, stream)
        for i in range(n):
            await producer.publish([(KEY_FIELD, f"key-{i % KEYS}"), ("n", str(i))])
        await producer.aclose()
    else:
        topic_producer = await TopicProducer.connect(url, stream)
        for i in range(n):
            await topic_producer.publish({"n": str(i)}, key=f"key-{i % KEYS}")
        await topic_producer.aclose()
    return n / (time.perf_counter() - started)


async def consume(url: str, stream: str, case: Case, n: int) -> float:
    """Runs one member (a topic) or one worker (a stream) until a handler saw every message; the messages seen
    exactly once per second."""
    sights: Counter[int] = Counter()
    every_seen = asyncio.Event()

    async def handle(message: Message) -> Outcome:
        number = int(message.text("n") or -1)
        sights[number] += 1
        if sights[number] == 1 and len(sights) == n:
            every_seen.set()
        return Outcome.done()

    stop = asyncio.Event()
    started = time.perf_counter()
    if case.partitions is None:
        worker: Worker | TopicWorker = Worker(url, stream, GROUP, "m1", concurrency=CONCURRENCY, block=0.05)
    else:
        worker = await TopicWorker.connect(
            url, stream, GROUP, "m1", membership_ttl=3, concurrency=CONCURRENCY, block=0.05
        )
    running = asyncio.create_task(worker.run(handle, stop))
    try:
        await asyncio.wait_for(every_seen.wait(), TIMEOUT)
    except TimeoutError:
        sys.exit(f"{stream}: {len(sights)} of {n} messages seen after {TIMEOUT:.0f} s")
    elapsed = time.perf_counter() - started
    stop.set()
    await running
    once = sum(1 for count in sights.values() if count == 1)
    case.seen_again += n - once
    return once / elapsed


async def measure(url: str, n: int, rounds: int) -> None:
    cases = [
        Case("one stream", None, "None"),
        Case("topic, 1 partition PerKey", 1, "PerKey"),
        Case("topic, 8 partitions PerKey", 8, "PerKey"),
        Case("topic, 8 partitions None", 8, "None"),
    ]
    r = Redis.from_url(url)
    version = (await r.info("server"))["redis_version"]
    print(
        f"{n} messages a case, {KEYS} keys, one member / worker at concurrency {CONCURRENCY}, redis-server {version}, "
        f"Python {sys.version.split()[0]}; medians of {rounds} rounds, each running every case in turn"
    )
    for round_ in range(rounds):
        for i, case in enumerate(cases):
            stream = f"topic-bench-{os.getpid()}-{round_}-{i}"
            await declare(r, stream, case)
            case.published.append(await publish(url, stream, case, n))
            case.consumed.append(await consume(url, stream, case, n))
    await r.aclose()
    print("| case | publish msgs/s | consume msgs/s | messages seen more than once |")
    print("| --- | --- | --- | --- |")
    for case in cases:
        published, consumed = statistics.median(case.published), statistics.median(case.consumed)
        print(f"| {case.label} | {published:.0f} | {consumed:.0f} | {case.seen_again} |")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    rounds = int(os.environ.get("ROUNDS", "3"))
    url = os.environ.get("REDIS_URL")
    server = None
    if url is None:
        server, url = start_server()
    try:
        asyncio.run(measure(url, n, rounds))
    finally:
        if server is not None:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
