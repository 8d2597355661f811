"""The worker, the producers and a topic's members on a Redis Cluster of 3 primaries, through redis-py's
``RedisCluster``: a topic's partitions are spread over the shards."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable

from helpers import GROUP, STREAM, eventually, running
from redis.asyncio.cluster import RedisCluster
from test_programs import _lines as read_lines
from test_programs import _start as start_program

from pelican_worker import Handler, Message, Outcome, Producer, TopicProducer, TopicWorker, Worker, partition_of
from pelican_worker.keys import owners_key, partition_stream, settings_key, topic_key

TOPIC = "orders"


def cluster(url: str) -> Callable[[], RedisCluster]:
    def connect() -> RedisCluster:
        return RedisCluster.from_url(url, socket_timeout=10.0)

    return connect


async def _true(value: bool) -> bool:
    return value


def test_a_worker_and_a_producer_on_a_cluster(cluster_url: str) -> None:
    async def scenario() -> None:
        r = RedisCluster.from_url(cluster_url, decode_responses=True)
        await r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        await r.hset(settings_key(STREAM, GROUP), mapping={"minIdleMs": 60_000, "retryAfterMs": 1_000})
        async with Producer(cluster(cluster_url), STREAM) as producer:
            sent = [await producer.publish({"n": str(n)}) for n in range(5)]
        handled: list[str] = []

        async def handle(message: Message) -> Outcome:
            handled.append(message.id)
            return Outcome.done()

        async with running(Worker(cluster(cluster_url), STREAM, GROUP, "worker-1", block=0.1), handle):
            await eventually(lambda: _true(len(handled) == 5), 10, "5 runs")

            async def acknowledged() -> bool:
                return int((await r.xpending(STREAM, GROUP))["pending"]) == 0

            await eventually(acknowledged, 5, "every entry acknowledged")
        assert sorted(handled) == sorted(sent)
        await r.aclose()

    asyncio.run(scenario())


def test_members_share_a_topic_s_partitions_over_the_shards(cluster_url: str) -> None:
    async def scenario() -> None:
        r = RedisCluster.from_url(cluster_url, decode_responses=True)
        settings = {"contractVersion": 2, "partitions": 4, "ordering": "PerKey", "minIdleMs": 60_000}
        settings |= {"retryAfterMs": 1_000, "maxDeliveries": 5}
        await r.hset(topic_key(TOPIC), mapping={"partitions": 4, "contractVersion": 2})
        await r.hset(settings_key(TOPIC, GROUP), mapping=settings)  # type: ignore[arg-type]
        for p in range(4):
            await r.hset(settings_key(partition_stream(TOPIC, p), GROUP), mapping=settings)  # type: ignore[arg-type]
            await r.xgroup_create(partition_stream(TOPIC, p), GROUP, id="0", mkstream=True)
        slots = {r.keyslot(partition_stream(TOPIC, p)) for p in range(4)}
        shards = {str(r.get_node_from_key(partition_stream(TOPIC, p))) for p in range(4)}
        assert len(slots) == 4
        assert len(shards) >= 2
        runs: list[tuple[str, int | None, str | None]] = []

        def handler(member: str) -> Handler:
            async def handle(message: Message) -> Outcome:
                runs.append((member, message.partition, message.text("pelican-key")))
                return Outcome.done()

            return handle

        stop = asyncio.Event()
        members = [
            await TopicWorker.connect(cluster(cluster_url), TOPIC, GROUP, name, membership_ttl=3.0, block=0.1)
            for name in ("member-a", "member-b")
        ]
        tasks = [asyncio.create_task(m.run(handler(m.member), stop)) for m in members]
        try:

            async def shared() -> bool:
                owners = await r.hgetall(owners_key(TOPIC, GROUP))
                return sorted(owners.values()) == ["member-a"] * 2 + ["member-b"] * 2

            await eventually(shared, 10, "the partitions shared")
            owners = {int(p): m for p, m in (await r.hgetall(owners_key(TOPIC, GROUP))).items()}
            async with await TopicProducer.connect(cluster(cluster_url), TOPIC) as producer:
                for i in range(20):
                    await producer.publish({"n": str(i)}, key=f"order-{i}")
            await eventually(lambda: _true(len(runs) == 20), 10, "20 runs")
        finally:
            stop.set()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert sorted(key or "" for _, _, key in runs) == sorted(f"order-{i}" for i in range(20))
        for member, partition, key in runs:
            assert partition == partition_of(key or "", 4)
            assert member == owners[partition]
        assert await r.hgetall(owners_key(TOPIC, GROUP)) == {}  # both left
        await r.aclose()

    asyncio.run(scenario())


def test_the_conformance_worker_serves_a_topic_on_a_cluster(cluster_url: str) -> None:
    async def setup() -> dict[tuple[int, bytes | str], str]:
        r = RedisCluster.from_url(cluster_url, decode_responses=True)
        settings = {"contractVersion": 2, "partitions": 3, "minIdleMs": 60_000, "retryAfterMs": 1_000}
        await r.hset(settings_key(TOPIC, GROUP), mapping=settings)  # type: ignore[arg-type]
        for p in range(3):
            await r.hset(settings_key(partition_stream(TOPIC, p), GROUP), mapping=settings)  # type: ignore[arg-type]
            await r.xgroup_create(partition_stream(TOPIC, p), GROUP, id="0", mkstream=True)
        sent: dict[tuple[int, bytes | str], str] = {}
        for i in range(6):
            key = f"order-{i}"
            partition = partition_of(key, 3)
            sent[partition, await r.xadd(partition_stream(TOPIC, partition), {"pelican-key": key})] = key
        await r.aclose()
        return sent

    sent = asyncio.run(setup())
    env = {"REDIS_URL": cluster_url, "REDIS_CLUSTER": "1", "TOPIC": TOPIC, "GROUP": GROUP, "CONSUMER": "member-1"}
    process = start_program(["-m", "pelican_worker.conformance"], env)
    try:
        lines = read_lines(process, 6)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    assert {(line["partition"], line["id"]): line["key"] for line in lines} == sent
