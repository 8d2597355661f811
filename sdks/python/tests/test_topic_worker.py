"""The topic worker against a real server: members share the partitions, hand them over, and PerKey runs each key in
order. The operator's part (the settings hashes, the groups) is written by hand, as the operator would."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from helpers import client, eventually
from redis.asyncio import Redis

from pelican_worker import (
    Message,
    NotATopic,
    Ordering,
    OrderingError,
    Outcome,
    TopicContractError,
    TopicProducer,
    TopicWorker,
    WorkerStats,
    partition_of,
)
from pelican_worker.keys import owners_key, partition_stream, settings_key, topic_key

TOPIC = "orders"
GROUP = "workers"


async def make_topic(r: Redis, partitions: int, *, ordering: str = "None", **fields: str | int) -> None:
    """What the operator writes for a topic: its description, its settings and each partition's, each group."""
    settings: dict[str, str | int] = {
        "contractVersion": 2,
        "partitions": partitions,
        "ordering": ordering,
        "minIdleMs": 60_000,
        "retryAfterMs": 1_000,
        "maxDeliveries": 5,
        "backoffFactor": 1,
        "backoffMaxMs": 0,
        **fields,
    }
    await r.hset(topic_key(TOPIC), mapping={"partitions": partitions, "contractVersion": 2})
    await r.hset(settings_key(TOPIC, GROUP), mapping=settings)  # type: ignore[arg-type]
    for p in range(partitions):
        stream = partition_stream(TOPIC, p)
        await r.hset(settings_key(stream, GROUP), mapping=settings)  # type: ignore[arg-type]
        await r.xgroup_create(stream, GROUP, id="0", mkstream=True)


@dataclass
class Run:
    member: str
    partition: int | None
    id: str
    key: str | None
    name: str
    started: float
    ended: float = 0.0


Handle = Callable[[Message], Awaitable[Outcome]]


class Runs:
    """Every handler run of every member, in the order they started."""

    def __init__(self) -> None:
        self.all: list[Run] = []

    def handler(self, member: str, handle: Handle | None = None) -> Handle:
        async def record(message: Message) -> Outcome:
            key = message.key
            run = Run(
                member, message.partition, message.id, key.decode() if key is not None else None,
                message.text("name") or "", time.monotonic(),
            )  # fmt: skip
            self.all.append(run)
            try:
                return await handle(message) if handle is not None else Outcome.done()
            finally:
                run.ended = time.monotonic()

        return record

    def named(self, name: str) -> list[Run]:
        return [run for run in self.all if run.name == name]


@contextlib.asynccontextmanager
async def member(
    url: str, name: str, handler: Handle, *, ttl: float = 3.0, concurrency: int = 8
) -> AsyncIterator[asyncio.Task[WorkerStats]]:
    """A member running in the background; stopped gracefully (and waited for) on exit unless its task ended."""
    worker = await TopicWorker.connect(url, TOPIC, GROUP, name, membership_ttl=ttl, concurrency=concurrency, block=0.1)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(handler, stop))
    try:
        yield task
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)


async def owners(r: Redis) -> dict[int, str]:
    return {int(p): str(m) for p, m in (await r.hgetall(owners_key(TOPIC, GROUP))).items()}


async def wait_owners(r: Redis, want: Callable[[dict[int, str]], bool], within: float = 10.0) -> dict[int, str]:
    async def check() -> bool:
        return want(await owners(r))

    await eventually(check, within, "the owners wanted")
    return await owners(r)


def key_in(partition: int, partitions: int, prefix: str = "key") -> str:
    """A key whose partition is ``partition``."""
    return next(k for i in itertools.count() if partition_of(k := f"{prefix}-{i}", partitions) == partition)


async def deliveries(r: Redis, partition: int, entry_id: str) -> tuple[str, int] | None:
    rows = await r.xpending_range(partition_stream(TOPIC, partition), GROUP, entry_id, entry_id, 1)
    return (str(rows[0]["consumer"]), int(rows[0]["times_delivered"])) if rows else None


def test_two_members_share_four_partitions_and_each_message_is_handled_once_by_its_owner(redis_url: str) -> None:
    async def scenario() -> None:
        r = client(redis_url)
        await make_topic(r, 4)
        runs = Runs()
        async with (
            member(redis_url, "member-a", runs.handler("member-a")),
            member(redis_url, "member-b", runs.handler("member-b")),
        ):
            owned = await wait_owners(r, lambda o: sorted(o.values()) == ["member-a"] * 2 + ["member-b"] * 2)
            async with await TopicProducer.connect(redis_url, TOPIC) as producer:
                for i in range(40):
                    await producer.publish({"name": f"m-{i}"}, key=f"order-{i % 10}")
            await eventually(lambda: _true(len(runs.all) >= 40), 10, "40 runs")
        assert sorted(run.name for run in runs.all) == sorted(f"m-{i}" for i in range(40))
        for run in runs.all:
            assert run.key is not None
            assert run.partition == partition_of(run.key, 4)
            assert run.member == owned[run.partition]
        assert {run.member for run in runs.all} == {"member-a", "member-b"}
        await r.aclose()

    asyncio.run(scenario())


def test_a_member_that_leaves_hands_its_partitions_to_the_other(redis_url: str) -> None:
    async def scenario() -> None:
        r = client(redis_url)
        await make_topic(r, 4)
        runs = Runs()
        async with member(redis_url, "member-a", runs.handler("member-a")):
            async with member(redis_url, "member-b", runs.handler("member-b")) as b:
                await wait_owners(r, lambda o: sorted(o.values()) == ["member-a"] * 2 + ["member-b"] * 2)
            assert b.done()
            assert not b.cancelled()
            # Left at once: the partitions move at a's next heartbeat, well before b's ttl (3 s) would free them.
            await wait_owners(r, lambda o: o == dict.fromkeys(range(4), "member-a"), within=2.0)
            async with await TopicProducer.connect(redis_url, TOPIC) as producer:
                for i in range(8):
                    await producer.publish({"name": f"m-{i}"}, key=f"order-{i}")
            await eventually(lambda: _true(len(runs.all) >= 8), 10, "8 runs")
        assert sorted(run.name for run in runs.all) == sorted(f"m-{i}" for i in range(8))
        assert {run.member for run in runs.all} == {"member-a"}
        assert {run.partition for run in runs.all} == {partition_of(f"order-{i}", 4) for i in range(8)}
        await r.aclose()

    asyncio.run(scenario())


def test_a_member_that_stops_heart_beating_loses_its_partitions_and_its_pending_entry_runs_once_more(
    redis_url: str,
) -> None:
    async def scenario() -> None:
        r = client(redis_url)
        await make_topic(r, 4)
        runs = Runs()
        held = asyncio.Event()
        forever = asyncio.Event()

        async def hang(_: Message) -> Outcome:
            held.set()
            await forever.wait()
            return Outcome.done()

        async with member(redis_url, "member-a", runs.handler("member-a"), ttl=1.0):
            b = await TopicWorker.connect(redis_url, TOPIC, GROUP, "member-b", membership_ttl=1.0, block=0.1)
            dying = asyncio.create_task(b.run(runs.handler("member-b", hang)))
            owned = await wait_owners(r, lambda o: sorted(o.values()) == ["member-a"] * 2 + ["member-b"] * 2)
            partition = next(p for p, m in owned.items() if m == "member-b")
            async with await TopicProducer.connect(redis_url, TOPIC) as producer:
                sent = await producer.publish({"name": "stuck"}, key=key_in(partition, 4))
            await asyncio.wait_for(held.wait(), 5)
            # Killed: its run ends without leaving, its handler never answers.
            dying.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await dying
            assert await deliveries(r, partition, sent.id) == ("member-b", 1)
            started = time.monotonic()
            await wait_owners(r, lambda o: o == dict.fromkeys(range(4), "member-a"), within=3.0)
            await eventually(lambda: _true(len(runs.named("stuck")) == 2), 5, "the stuck entry run again")
            assert time.monotonic() - started < 2.5  # within the ttl (1 s) and a heartbeat
        stuck = runs.named("stuck")
        assert [run.member for run in stuck] == ["member-b", "member-a"]
        assert stuck[1].partition == partition
        assert await deliveries(r, partition, sent.id) is None  # acknowledged by member-a
        await r.aclose()

    asyncio.run(scenario())


def test_the_new_owner_sees_the_entry_delivered_twice_not_three_times(redis_url: str) -> None:
    async def scenario() -> None:
        r = client(redis_url)
        await make_topic(r, 1)
        await r.xadd(partition_stream(TOPIC, 0), {"name": "taken"})
        # The previous owner read it and died with it.
        await r.xreadgroup(GROUP, "member-gone", {partition_stream(TOPIC, 0): ">"})
        seen: list[tuple[str, int] | None] = []

        async def look(message: Message) -> Outcome:
            seen.append(await deliveries(r, 0, message.id))
            return Outcome.done()

        runs = Runs()
        async with member(redis_url, "member-a", runs.handler("member-a", look)):
            await eventually(lambda: _true(len(seen) == 1), 5, "the entry taken over")
        assert seen == [("member-a", 2)]
        await r.aclose()

    asyncio.run(scenario())


def test_per_key_messages_of_a_key_run_in_order_one_at_a_time_and_keys_side_by_side(redis_url: str) -> None:
    async def scenario() -> None:
        r = client(redis_url)
        await make_topic(r, 1, ordering="PerKey")
        runs = Runs()

        async def work(_: Message) -> Outcome:
            await asyncio.sleep(0.02)  # the handler's work, not a synchronisation
            return Outcome.done()

        async with await TopicProducer.connect(redis_url, TOPIC) as producer:
            for i, k in itertools.product(range(6), range(5)):
                await producer.publish({"name": f"k{k}-{i}"}, key=f"k{k}")
        # More slots than keys: only the per-key rule keeps two messages of a key apart.
        async with member(redis_url, "member-a", runs.handler("member-a", work), concurrency=8):
            await eventually(lambda: _true(sum(run.ended > 0 for run in runs.all) == 30), 10, "30 runs")
        for k in range(5):
            mine = [run for run in runs.all if run.key == f"k{k}"]
            assert [run.name for run in mine] == [f"k{k}-{i}" for i in range(6)]
            for before, after in itertools.pairwise(mine):
                assert before.ended <= after.started, "two messages of one key at once"
        most = max(sum(o.started <= run.started < o.ended for o in runs.all) for run in runs.all)
        assert most >= 2, "no two keys ran at once"
        await r.aclose()

    asyncio.run(scenario())


def test_per_key_a_failure_runs_again_in_place_while_its_key_waits_and_another_key_goes_on(redis_url: str) -> None:
    async def scenario() -> None:
        r = client(redis_url)
        await make_topic(r, 1, ordering="PerKey", minIdleMs=300, backoffFactor=2, backoffMaxMs=500)
        runs = Runs()
        counted: list[tuple[str, int] | None] = []

        async def flaky(message: Message) -> Outcome:
            if message.text("name") == "a-0":
                counted.append(await deliveries(r, 0, message.id))
                if len(counted) < 3:
                    raise RuntimeError("the store is down")
            return Outcome.done()

        async with await TopicProducer.connect(redis_url, TOPIC) as producer:
            first = await producer.publish({"name": "a-0"}, key="a")
            await producer.publish({"name": "a-1"}, key="a")
            for i in range(3):
                await producer.publish({"name": f"b-{i}"}, key="b")
        async with member(redis_url, "member-a", runs.handler("member-a", flaky)):
            await eventually(lambda: _true(len(runs.named("a-1")) == 1), 10, "a-1 run")
        a0 = runs.named("a-0")
        assert len(a0) == 3
        # Each run again counted on the server first: the delivery count the handler saw.
        assert counted == [("member-a", 1), ("member-a", 2), ("member-a", 3)]
        # Spaced minIdle * 2^(n-1), at most 500 ms: 300 ms, then 500 ms.
        assert a0[1].started - a0[0].ended >= 0.29
        assert a0[2].started - a0[1].ended >= 0.49
        assert runs.named("a-1")[0].started >= a0[2].ended  # the key waited
        assert all(run.ended <= a0[1].started for run in runs.all if run.key == "b")  # the other did not
        assert await deliveries(r, 0, first.id) is None
        assert await r.hget(f"{{{TOPIC}:0}}:pelican:{{{TOPIC}:0}}:{GROUP}:errors", first.id) is None
        await r.aclose()

    asyncio.run(scenario())


def test_per_key_at_the_cap_the_entry_is_no_longer_leased_and_the_key_goes_on_once_it_left(redis_url: str) -> None:
    async def scenario() -> None:
        r = client(redis_url)
        await make_topic(r, 1, ordering="PerKey", minIdleMs=300, maxDeliveries=2)
        runs = Runs()

        async def failing(message: Message) -> Outcome:
            if message.text("name") == "a-0":
                raise RuntimeError("never works")
            return Outcome.done()

        async with await TopicProducer.connect(redis_url, TOPIC) as producer:
            capped = await producer.publish({"name": "a-0"}, key="a")
            await producer.publish({"name": "a-1"}, key="a")
        stream = partition_stream(TOPIC, 0)
        async with member(redis_url, "member-a", runs.handler("member-a", failing)):
            await eventually(lambda: _true(len(runs.named("a-0")) == 2), 5, "two runs of a-0")

            # Leases tick every 100 ms (minIdle / 3): idle past a second, it is no longer leased.
            async def unleased() -> bool:
                rows = await r.xpending_range(stream, GROUP, capped.id, capped.id, 1)
                return int(rows[0]["time_since_delivered"]) > 1000

            await eventually(unleased, 5, "the capped entry left unleased")
            assert await deliveries(r, 0, capped.id) == ("member-a", 2)
            assert runs.named("a-1") == []  # the key waits
            await r.xack(stream, GROUP, capped.id)  # the operator's pass dead-letters it
            await eventually(lambda: _true(len(runs.named("a-1")) == 1), 5, "a-1 run once a-0 left")
        assert len(runs.named("a-0")) == 2
        await r.aclose()

    asyncio.run(scenario())


def test_topics_it_cannot_serve_are_refused_by_name(redis_url: str) -> None:
    async def scenario() -> None:
        r = client(redis_url)
        with pytest.raises(NotATopic, match="topic 'orders' group 'workers' describe no topic"):
            await TopicWorker.connect(redis_url, TOPIC, GROUP, "m")
        await r.hset(settings_key(TOPIC, GROUP), mapping={"minIdleMs": 1000, "retryAfterMs": 1000})
        with pytest.raises(NotATopic):
            await TopicWorker.connect(redis_url, TOPIC, GROUP, "m")
        await r.hset(settings_key(TOPIC, GROUP), mapping={"contractVersion": 3, "partitions": 4})
        with pytest.raises(TopicContractError, match="worker contract 3"):
            await TopicWorker.connect(redis_url, TOPIC, GROUP, "m")
        await r.delete(settings_key(TOPIC, GROUP))
        await make_topic(r, 4, ordering="Global")
        with pytest.raises(OrderingError, match="ordering 'Global'"):
            await TopicWorker.connect(redis_url, TOPIC, GROUP, "m")
        await r.hset(settings_key(TOPIC, GROUP), "ordering", "PerKey")
        for ttl in (0.5, 86_401.0):
            with pytest.raises(ValueError, match=r"membership_ttl must be 1 s \.\. 1 day"):
                await TopicWorker.connect(redis_url, TOPIC, GROUP, "m", membership_ttl=ttl)
        worker = await TopicWorker.connect(redis_url, TOPIC, GROUP, "m")
        assert (worker.partitions, worker.ordering) == (4, Ordering.PER_KEY)
        await r.aclose()

    asyncio.run(scenario())


async def _true(value: bool) -> bool:
    return value
