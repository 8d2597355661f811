"""A topic's partition of a key and its producers, against a real server."""

from __future__ import annotations

import asyncio
import json
from importlib.resources import files

import pytest
from helpers import client
from redis.asyncio import Redis

from pelican_worker import NotATopic, PublishRefused, TopicContractError, TopicProducer, partition_of
from pelican_worker._redis import range_entries, raw_command
from pelican_worker.keys import bounds_key, partition_stream, topic_key

TOPIC = "orders"


def test_partition_of_is_every_case_of_the_contract_s_test_vector() -> None:
    cases = json.loads(files("pelican_worker").joinpath("partitions.json").read_bytes())["cases"]
    assert len(cases) > 10
    for case in cases:
        key = case["key"].encode() if "key" in case else bytes.fromhex(case["keyHex"])
        assert partition_of(key, case["partitions"]) == case["partition"], case
        if "key" in case:
            assert partition_of(case["key"], case["partitions"]) == case["partition"], case


def test_partition_of_refuses_no_partitions() -> None:
    with pytest.raises(ValueError, match="1 or more partitions"):
        partition_of("k", 0)


async def describe(r: Redis, partitions: int, version: str = "2") -> None:
    await r.hset(topic_key(TOPIC), mapping={"partitions": partitions, "contractVersion": version})


async def entries(r: Redis, partition: int) -> list[list[tuple[str, str]]]:
    found = range_entries(await raw_command(r, "XRANGE", partition_stream(TOPIC, partition), "-", "+"))
    return [[(k.decode(), v.decode()) for k, v in fields or []] for _, fields in found]


def test_a_keyed_message_goes_to_its_key_s_partition_with_the_key_first(redis_url: str) -> None:
    async def scenario() -> None:
        r = client(redis_url)
        await describe(r, 4)
        async with await TopicProducer.connect(redis_url, TOPIC) as producer:
            assert producer.partitions == 4
            published = [await producer.publish({"n": str(i)}, key=f"order-{i % 3}") for i in range(6)]
        for i, sent in enumerate(published):
            assert sent.partition == partition_of(f"order-{i % 3}", 4)
        for p in range(4):
            for fields in await entries(r, p):
                assert fields[0][0] == "pelican-key"
                assert partition_of(fields[0][1], 4) == p
                assert fields[1][0] == "n"
        assert sum([len(await entries(r, p)) for p in range(4)]) == 6
        await r.aclose()

    asyncio.run(scenario())


def test_messages_without_a_key_go_round_robin(redis_url: str) -> None:
    async def scenario() -> None:
        r = client(redis_url)
        await describe(r, 3)
        async with await TopicProducer.connect(redis_url, TOPIC) as producer:
            partitions = [(await producer.publish([("n", i)])).partition for i in range(7)]
        assert partitions == [0, 1, 2, 0, 1, 2, 0]
        assert [len(await entries(r, p)) for p in range(3)] == [3, 2, 2]
        assert [f[0][0] for f in await entries(r, 0)] == ["n", "n", "n"]
        await r.aclose()

    asyncio.run(scenario())


def test_a_partition_s_bound_refuses_as_a_stream_s_does(redis_url: str) -> None:
    async def scenario() -> None:
        r = client(redis_url)
        await describe(r, 2)
        stream = partition_stream(TOPIC, partition_of("k", 2))
        await r.xgroup_create(stream, "workers", id="0", mkstream=True)
        await r.hset(bounds_key(stream), "workers", 1)
        async with await TopicProducer.connect(redis_url, TOPIC) as producer:
            await producer.publish({"n": 1}, key="k")
            with pytest.raises(PublishRefused) as refused:
                await producer.publish({"n": 2}, key="k")
        assert (refused.value.group, refused.value.max) == ("workers", 1)
        await r.aclose()

    asyncio.run(scenario())


def test_a_topic_no_policy_describes_or_of_another_contract_is_refused_by_name(redis_url: str) -> None:
    async def scenario() -> None:
        r = client(redis_url)
        with pytest.raises(NotATopic, match="'orders' is not a topic"):
            await TopicProducer.connect(redis_url, TOPIC)
        await describe(r, 4, version="3")
        with pytest.raises(TopicContractError, match="topic 'orders' is described under worker contract 3"):
            await TopicProducer.connect(redis_url, TOPIC)
        await r.aclose()

    asyncio.run(scenario())


def test_an_idempotent_message_without_a_key_goes_to_its_id_s_partition_once(idmp_redis_url: str) -> None:
    async def scenario() -> None:
        r = client(idmp_redis_url)
        await describe(r, 4)
        async with await TopicProducer.connect(idmp_redis_url, TOPIC) as plain:
            producer = await plain.idempotent("producer-1")
            first = await producer.publish("m-7", {"n": 7})
            again = await producer.publish("m-7", {"n": 7})
            keyed = await producer.publish("m-8", {"n": 8}, key="order-1")
        assert first == again
        assert first.partition == partition_of("m-7", 4)
        assert keyed.partition == partition_of("order-1", 4)
        assert len(await entries(r, first.partition)) == 1 + (keyed.partition == first.partition)
        assert (await entries(r, keyed.partition))[-1][0] == ("pelican-key", "order-1")
        await r.aclose()

    asyncio.run(scenario())
