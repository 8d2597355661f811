"""The worker against a real server: what it leaves in Redis for each outcome, lease, hand-over and shutdown."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

import pytest
from helpers import (
    CONSUMER,
    GROUP,
    STREAM,
    HeldReadReply,
    SlowCommand,
    client,
    eventually,
    pending,
    running,
    worker,
    write_settings,
)
from redis.asyncio import Redis

from pelican_worker import ContractVersionError, Message, Outcome, Producer, Worker
from pelican_worker._scripts import script_source
from pelican_worker.keys import consumers_key, errors_key, terminal_key


async def _group(r: Redis) -> None:
    await r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)


def test_done_acknowledges_and_reads_the_own_pel_first(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        before = [await r.xadd(STREAM, {"n": str(i)}) for i in range(2)]
        # Delivered to this consumer before a "restart": in its PEL.
        await r.xreadgroup(GROUP, CONSUMER, {STREAM: ">"})
        after = [await r.xadd(STREAM, {"n": str(i)}) for i in range(2, 4)]
        seen: list[str] = []

        async def handle(message: Message) -> Outcome:
            seen.append(message.id)
            return Outcome.done()

        w = worker(redis_url, concurrency=1)
        async with running(w, handle):
            await eventually(lambda: _equal(len(seen), 4), what="4 messages handled")
            await eventually(lambda: _empty(r), what="an empty PEL")
        assert seen == before + after
        assert w.stats.done == 4
        assert w.stats.in_flight == 0
        assert await r.exists(errors_key(STREAM, GROUP)) == 0

    asyncio.run(main())


async def _equal(a: object, b: object) -> bool:
    return a == b


async def _empty(r: Redis) -> bool:
    return not await pending(r)


def test_an_entry_whose_payload_was_deleted_is_not_handled(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        gone = await r.xadd(STREAM, {"n": "gone"})
        kept = await r.xadd(STREAM, {"n": "kept"})
        await r.xreadgroup(GROUP, CONSUMER, {STREAM: ">"})
        await r.xdel(STREAM, gone)
        seen: list[str] = []

        async def handle(message: Message) -> Outcome:
            seen.append(message.id)
            return Outcome.done()

        async with running(worker(redis_url), handle):
            await eventually(lambda: _equal(seen, [kept]), what="the kept entry handled")
            await asyncio.sleep(0.2)
        assert seen == [kept]
        # Left for the operator's pass, which drops it.
        assert [p.id for p in await pending(r)] == [gone]

    asyncio.run(main())


def test_fields_are_raw_bytes_in_order_even_from_a_decoding_client(redis_url: str) -> None:
    async def main() -> None:
        r = Redis.from_url(redis_url)
        await r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        async with Producer(redis_url, STREAM) as producer:
            await producer.publish([("a", b"\xff\x00"), ("b", "2"), ("a", "3")])
        got: list[Message] = []

        async def handle(message: Message) -> Outcome:
            got.append(message)
            return Outcome.done()

        # A factory whose clients decode responses, on RESP3: the worker still hands over bytes, in order.
        w = Worker(lambda: Redis.from_url(redis_url, decode_responses=True, protocol=3), STREAM, GROUP, CONSUMER)
        async with running(w, handle):
            await eventually(lambda: _equal(len(got), 1))
        assert got[0].fields == [(b"a", b"\xff\x00"), (b"b", b"2"), (b"a", b"3")]
        assert got[0].field("a") == b"\xff\x00"
        assert got[0].text("a") is None
        assert got[0].text("b") == "2"
        assert got[0].field("c") is None

    asyncio.run(main())


def test_a_failure_records_the_error_cut_at_a_character_and_is_not_read_again(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        entry = await r.xadd(STREAM, {"n": "1"})
        runs = 0

        async def handle(message: Message) -> Outcome:
            nonlocal runs
            runs += 1
            raise ValueError("€" * 2000)

        await write_settings(r, min_idle_ms=300)  # a lease tick, and a look for hand-overs, every 100 ms
        w = worker(redis_url, block=0.05)
        async with running(w, handle):
            await eventually(lambda: _exists(r, errors_key(STREAM, GROUP), entry), what="the error recorded")
            # Several hand-over looks: an entry that failed here is left to the operator's retry.
            await _lease_ticks(r, 5)
        assert runs == 1
        assert w.stats.failed == 1
        text = await Redis.from_url(redis_url).hget(errors_key(STREAM, GROUP), entry)
        assert isinstance(text, bytes)
        assert len(text) <= 1024
        decoded = text.decode("utf-8")  # cut at a character boundary: still valid UTF-8
        assert decoded.startswith("ValueError: €€")
        assert len(text) == 1023  # "ValueError: " (12 bytes) + 337 three-byte characters
        assert [(p.id, p.consumer, p.deliveries) for p in await pending(r)] == [(entry, CONSUMER, 1)]
        assert await consumers(r) == [CONSUMER]  # it still owns the failed entry: kept

    asyncio.run(main())


async def _exists(r: Redis, key: str, field: str | bytes) -> bool:
    return bool(await r.hexists(key, field))


def test_a_failed_message_handed_back_is_handled_and_its_error_removed_with_the_ack(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        entry = await r.xadd(STREAM, {"n": "1"})
        outcomes: list[Exception | Outcome] = [ValueError("first delivery fails"), Outcome.done()]

        async def handle(message: Message) -> Outcome:
            outcome = outcomes.pop(0)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        await write_settings(r, min_idle_ms=300)
        w = worker(redis_url)
        async with running(w, handle):
            await eventually(lambda: _exists(r, errors_key(STREAM, GROUP), entry))
            # What `strategy: Reassign` does once the entry was idle: it hands it over (here, back) with XCLAIM.
            await asyncio.sleep(1.2)
            await r.xclaim(STREAM, GROUP, CONSUMER, 0, [entry])
            await eventually(lambda: _empty(r), what="the handed-back entry acknowledged")
        assert outcomes == []
        assert await r.hexists(errors_key(STREAM, GROUP), entry) == 0
        assert (w.stats.failed, w.stats.done) == (1, 1)

    asyncio.run(main())


def test_done_on_a_requeued_copy_removes_its_last_error(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        copy = await r.xadd(STREAM, {"n": "1", "pelican-origin-id": "1-1", "pelican-deliveries": "2"})
        await r.hset(errors_key(STREAM, GROUP), copy, "ValueError: before")
        await r.hset(errors_key(STREAM, GROUP), "9-9", "someone else's")

        async def handle(message: Message) -> Outcome:
            return Outcome.done()

        w = worker(redis_url)
        async with running(w, handle):
            await eventually(lambda: _equal(w.stats.done, 1))
        assert await pending(r) == []
        assert await r.hgetall(errors_key(STREAM, GROUP)) == {"9-9": "someone else's"}

    asyncio.run(main())


def test_terminal_acknowledges_and_counts_the_reason_once(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        first = await r.xadd(STREAM, {"n": "1"})
        await r.xadd(STREAM, {"n": "2"})
        await r.hset(errors_key(STREAM, GROUP), first, "ValueError: earlier")

        async def handle(message: Message) -> Outcome:
            return Outcome.terminal("RecordNotFound")

        w = worker(redis_url)
        async with running(w, handle):
            await eventually(lambda: _equal(w.stats.terminal, 2))
        assert await pending(r) == []
        assert await r.hgetall(terminal_key(STREAM, GROUP)) == {"RecordNotFound": "2"}
        assert await r.hexists(errors_key(STREAM, GROUP), first) == 0
        assert w.stats.terminal == 2

    asyncio.run(main())


def test_an_invalid_reason_is_a_failure_never_an_ack(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        entry = await r.xadd(STREAM, {"n": "1"})

        async def handle(message: Message) -> Outcome:
            return Outcome.terminal("record not found")

        w = worker(redis_url)
        async with running(w, handle):
            await eventually(lambda: _exists(r, errors_key(STREAM, GROUP), entry))
        assert "^[A-Z][A-Za-z0-9]{0,62}$" in (await r.hget(errors_key(STREAM, GROUP), entry) or "")
        assert await r.exists(terminal_key(STREAM, GROUP)) == 0
        assert [p.id for p in await pending(r)] == [entry]
        assert (w.stats.failed, w.stats.terminal) == (1, 0)

    asyncio.run(main())


def test_retry_gives_back_counted_with_an_idle_of_min_idle(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        await write_settings(r, min_idle_ms=7000, retry_after_ms=50_000)
        entry = await r.xadd(STREAM, {"n": "1"})

        async def handle(message: Message) -> Outcome:
            return Outcome.retry()

        w = worker(redis_url)
        async with running(w, handle):
            await eventually(lambda: _equal(w.stats.retried, 1))
        [p] = await pending(r)
        # Still this consumer's, the delivery counted (1: the read), idle set to minIdle for the pass's backoff.
        assert (p.id, p.consumer, p.deliveries) == (entry, CONSUMER, 1)
        assert 7000 <= p.idle_ms < 9000

    asyncio.run(main())


def test_a_retry_given_back_while_a_lease_is_on_its_way_is_not_run_again(redis_url: str, redis_port: int) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        await write_settings(r, min_idle_ms=900)  # a lease tick every 300 ms
        entry = await r.xadd(STREAM, {"n": "1"})
        lease_sha = hashlib.sha1(script_source("lease").encode()).hexdigest().encode()
        # Each lease waits 400 ms on its way to the server; the other calls go on the pool's other connections.
        proxy = SlowCommand(redis_port, lease_sha, 0.4)
        runs: list[str] = []

        async def handle(message: Message) -> Outcome:
            runs.append(message.id)
            if len(runs) == 1:
                proxy.held.clear()
                await proxy.held.wait()  # the next lease, which gathered this entry, is on its way
            return Outcome.retry()

        async with proxy.serving() as proxy_port:
            w = worker(f"redis://127.0.0.1:{proxy_port}")
            async with running(w, handle):
                await eventually(lambda: _equal(w.stats.retried, 1), what="the retry")
                # Were the give-back first, that lease would reset the idle time it set, and the own-PEL checks of
                # the next ticks would take the entry as handed back.
                await asyncio.sleep(2.0)
        [p] = await pending(r)
        assert runs == [entry]
        assert (p.id, p.consumer, p.deliveries) == (entry, CONSUMER, 1)
        assert p.idle_ms >= 900

    asyncio.run(main())


def test_a_worker_run_again_under_another_event_loop_retries_while_a_lease_is_on_its_way(
    redis_url: str, redis_port: int
) -> None:
    lease_sha = hashlib.sha1(script_source("lease").encode()).hexdigest().encode()
    proxy_port: list[int] = []
    # One worker, run once under each of two event loops (two asyncio.run calls), its clients made through a proxy
    # of the running loop.
    w = Worker(lambda: Redis.from_url(f"redis://127.0.0.1:{proxy_port[0]}"), STREAM, GROUP, CONSUMER)

    async def run(n: int) -> None:
        r = client(redis_url)
        if n == 1:
            await _group(r)
            await write_settings(r, min_idle_ms=900)  # a lease tick every 300 ms
        entry = await r.xadd(STREAM, {"n": str(n)})
        proxy = SlowCommand(redis_port, lease_sha, 0.4)

        async def handle(message: Message) -> Outcome:
            proxy.held.clear()
            await proxy.held.wait()  # a lease is on its way: the give-back waits for the leasing lock
            return Outcome.retry()

        async with proxy.serving() as port:
            proxy_port[:] = [port]
            async with running(w, handle) as task:
                await eventually(lambda: _equal(w.stats.retried, n), what=f"run {n}'s retry")
        assert task.exception() is None
        [p] = await pending(r)
        assert (p.id, p.consumer) == (entry, CONSUMER)
        await r.xack(STREAM, GROUP, entry)
        await r.aclose()

    asyncio.run(run(1))
    # A lock made under the first loop and waited on there would refuse the second: "bound to a different event loop".
    asyncio.run(run(2))


async def _max_idle_while(r: Redis, seconds: float) -> int:
    """The highest idle time of the PEL's entries, sampled every 50 ms for ``seconds``."""
    highest = 0
    end = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < end:
        highest = max([highest, *(p.idle_ms for p in await pending(r))])
        await asyncio.sleep(0.05)
    return highest


def test_the_lease_keeps_a_slow_handler_s_entry_from_going_idle(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        await write_settings(r, min_idle_ms=600)  # a lease every 200 ms
        await r.xadd(STREAM, {"n": "1"})
        started = asyncio.Event()

        async def handle(message: Message) -> Outcome:
            started.set()
            await asyncio.sleep(2.0)  # over 3 x minIdle
            return Outcome.done()

        w = worker(redis_url)
        async with running(w, handle):
            await asyncio.wait_for(started.wait(), 5)
            highest = await _max_idle_while(r, 1.8)
            [p] = await pending(r)
            await eventually(lambda: _empty(r))
        assert highest < 600, highest
        assert p.deliveries == 1  # a lease leaves the count alone
        assert w.stats.done == 1

    asyncio.run(main())


def test_settings_are_re_read_at_every_lease_tick(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        await write_settings(r, min_idle_ms=3000)  # a lease every second
        await r.xadd(STREAM, {"n": "1"})
        started = asyncio.Event()

        async def handle(message: Message) -> Outcome:
            started.set()
            await asyncio.sleep(3.0)
            return Outcome.done()

        w = worker(redis_url)
        async with running(w, handle):
            await asyncio.wait_for(started.wait(), 5)
            await write_settings(r, min_idle_ms=300)  # a lease every 100 ms from the next tick on
            await asyncio.sleep(1.2)
            highest = await _max_idle_while(r, 1.5)
        assert w.settings is not None
        assert w.settings.min_idle_ms == 300
        assert highest < 300, highest

    asyncio.run(main())


def test_past_max_handling_the_lease_is_no_longer_extended(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        await write_settings(r, min_idle_ms=300)
        await r.xadd(STREAM, {"n": "1"})
        started = asyncio.Event()

        async def handle(message: Message) -> Outcome:
            started.set()
            await asyncio.sleep(1.6)
            return Outcome.done()

        async with running(worker(redis_url, max_handling=0.4), handle):
            await asyncio.wait_for(started.wait(), 5)
            await asyncio.sleep(1.3)
            [p] = await pending(r)
        assert p.idle_ms >= 700, p.idle_ms

    asyncio.run(main())


def test_shutdown_gives_back_unowned_with_the_delivery_uncounted(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        await write_settings(r, min_idle_ms=60_000, retry_after_ms=4321)
        entry = await r.xadd(STREAM, {"n": "1"})
        started = asyncio.Event()

        async def handle(message: Message) -> Outcome:
            started.set()
            await asyncio.sleep(60)
            return Outcome.done()

        w = worker(redis_url, shutdown_grace=0.3)
        async with running(w, handle) as task:
            await asyncio.wait_for(started.wait(), 5)
            assert [(p.consumer, p.deliveries) for p in await pending(r)] == [(CONSUMER, 1)]
        stats = task.result()
        [p] = await pending(r)
        assert (p.id, p.consumer, p.deliveries) == (entry, "", 0)
        assert 4321 <= p.idle_ms < 6000
        assert (stats.abandoned, stats.done, stats.in_flight) == (1, 0, 0)
        assert CONSUMER not in await consumers(r)  # it owns nothing any more: deleted

    asyncio.run(main())


async def consumers(r: Redis) -> list[str]:
    return [str(c["name"]) for c in await r.xinfo_consumers(STREAM, GROUP)]


def test_a_read_in_flight_at_the_stop_gives_back_what_it_brought_unhandled(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        await write_settings(r, min_idle_ms=60_000, retry_after_ms=4321)
        seen: list[str] = []

        async def handle(message: Message) -> Outcome:
            seen.append(message.id)
            return Outcome.done()

        stop = asyncio.Event()
        task = asyncio.create_task(worker(redis_url, block=3.0).run(handle, stop))
        await eventually(lambda: _has_consumer(r), what="the first read")
        await asyncio.sleep(0.3)  # the blocking read is on its way
        stop.set()
        await asyncio.sleep(0.1)
        # The read in flight is awaited: what it brings now is delivered to this consumer, and given back.
        entry = await r.xadd(STREAM, {"n": "1"})
        stats = await asyncio.wait_for(task, 10)
        assert seen == []
        [p] = await pending(r)
        assert (p.id, p.consumer, p.deliveries) == (entry, "", 0)
        assert stats.abandoned == 1
        assert CONSUMER not in await consumers(r)

    asyncio.run(main())


async def _has_consumer(r: Redis) -> bool:
    return CONSUMER in await consumers(r)


def test_shutdown_lets_handlers_finish_within_the_grace(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        await r.xadd(STREAM, {"n": "1"})
        started = asyncio.Event()

        async def handle(message: Message) -> Outcome:
            started.set()
            await asyncio.sleep(0.5)
            return Outcome.done()

        w = worker(redis_url, shutdown_grace=5.0)
        async with running(w, handle) as task:
            await asyncio.wait_for(started.wait(), 5)
        assert (task.result().done, task.result().abandoned) == (1, 0)
        assert await pending(r) == []
        assert await consumers(r) == []  # given back nothing, and deleted all the same

    asyncio.run(main())


def test_messages_done_as_the_stop_comes_are_acknowledged_before_the_worker_leaves(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        for i in range(16):
            await r.xadd(STREAM, {"n": str(i)})
        stop = asyncio.Event()

        async def handle(message: Message) -> Outcome:
            stop.set()  # the ACKs wait for a read that does not come
            return Outcome.done()

        stats = await asyncio.wait_for(worker(redis_url, concurrency=16).run(handle, stop), 10)
        assert (stats.done, stats.failed, stats.abandoned, stats.in_flight) == (16, 0, 0, 0)
        assert await pending(r) == []
        assert await consumers(r) == []  # it owned nothing when it gave back: deleted

    asyncio.run(main())


def test_an_ack_never_waits_behind_a_blocking_read(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        await r.xadd(STREAM, {"n": "1"})
        started = asyncio.Event()

        async def handle(message: Message) -> Outcome:
            started.set()
            await asyncio.sleep(0.3)  # the worker's next read, for the free slot, blocks meanwhile
            return Outcome.done()

        w = worker(redis_url, concurrency=2, block=3.0)
        async with running(w, handle):
            await asyncio.wait_for(started.wait(), 5)
            await eventually(lambda: _empty(r), within=2.0, what="the ACK, long before the read's 3 s")
            assert w.stats.done == 1

    asyncio.run(main())


class _AckRaises(Redis):
    """A client whose ``XACK`` raises what no Redis client raises of its own (a wrapper's defect, say)."""

    async def xack(self, name: Any, groupname: Any, *ids: Any) -> Any:
        raise RuntimeError("the wrapper around XACK broke")


def test_an_ack_the_client_fails_in_an_unexpected_way_is_counted_failed(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        entry = await r.xadd(STREAM, {"n": "1"})

        async def handle(message: Message) -> Outcome:
            await asyncio.sleep(0.3)  # the worker's next read, for the free slot, blocks: the writer sends the XACK
            return Outcome.done()

        w = Worker(lambda: _AckRaises.from_url(redis_url), STREAM, GROUP, CONSUMER, concurrency=2, block=3.0)
        async with running(w, handle):
            await eventually(lambda: _equal(w.stats.failed, 1), what="the failed XACK counted")
            assert w.stats.in_flight == 0
        assert (w.stats.done, w.stats.failed) == (0, 1)
        # Not acknowledged: still pending, for the operator's pass.
        assert [p.id for p in await pending(r)] == [entry]
        assert ": outcome unknown (RuntimeError)" in caplog.text

    asyncio.run(main())


def test_a_hand_over_is_taken_up_at_the_next_lease_ticks_with_its_count_unchanged(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        await write_settings(r, min_idle_ms=600)  # a lease tick every 200 ms
        entry = await r.xadd(STREAM, {"n": "1"})
        await r.xreadgroup(GROUP, "other", {STREAM: ">"})
        handling = asyncio.Event()

        async def handle(message: Message) -> Outcome:
            handling.set()
            await asyncio.sleep(0.3)
            return Outcome.done()

        # An idle worker: its blocking read (5 s) is not what finds the hand-over.
        w = worker(redis_url, block=5.0)
        async with running(w, handle):
            await _lease_ticks(r, 2)
            # What `strategy: Reassign` does: XCLAIM to this worker's name, the delivery counted (RETRYCOUNT + 1).
            await r.xclaim(STREAM, GROUP, CONSUMER, 0, [entry], retrycount=2)
            handed_at = asyncio.get_running_loop().time()
            await asyncio.wait_for(handling.wait(), 5)
            took = asyncio.get_running_loop().time() - handed_at
            [p] = await pending(r)
            await eventually(lambda: _empty(r))
        assert took < 1.0, f"taken up {took:.2f} s after the hand-over: not at the next lease ticks (200 ms)"
        assert (p.consumer, p.deliveries) == (CONSUMER, 2)  # taken with lease.lua and XRANGE: not counted again
        assert w.stats.done == 1

    asyncio.run(main())


def test_an_entry_a_read_delivered_is_no_hand_over_while_its_reply_is_on_its_way(
    redis_url: str, redis_port: int
) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        await write_settings(r, min_idle_ms=600)  # a lease tick every 200 ms
        runs: list[str] = []

        async def handle(message: Message) -> Outcome:
            runs.append(message.id)
            return Outcome.done()

        proxy = HeldReadReply(redis_port, b"held by the proxy")
        async with proxy.serving() as proxy_port:
            w = worker(f"redis://127.0.0.1:{proxy_port}", block=5.0)
            async with running(w, handle):
                entry = await r.xadd(STREAM, {"n": "held by the proxy"})
                await eventually(lambda: _delivered(r), what="the read's delivery")
                # In the worker's PEL, the reply that brings it held back: the lease ticks look at the PEL meanwhile.
                await _lease_ticks(r, 3)
                reads = proxy.reads
                proxy.release()
                # The next read is sent once what the held one brought was handled.
                await eventually(lambda: _more_reads(proxy, reads), what="the next read")
        assert runs == [entry]
        assert w.stats.done == 1
        assert await pending(r) == []

    asyncio.run(main())


async def _delivered(r: Redis) -> bool:
    return len(await pending(r)) == 1


async def _more_reads(proxy: HeldReadReply, reads: int) -> bool:
    return proxy.reads > reads


def test_nogroup_is_waited_out_and_the_group_never_created(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        r = client(redis_url)
        seen: list[str] = []

        async def handle(message: Message) -> Outcome:
            seen.append(message.id)
            return Outcome.done()

        async with running(worker(redis_url), handle):
            await asyncio.sleep(1.5)
            assert await r.exists(STREAM) == 0
            await r.xadd(STREAM, {"n": "0"})
            await asyncio.sleep(0.5)
            assert await r.xinfo_groups(STREAM) == []
            await r.xgroup_create(STREAM, GROUP, id="0")
            entry = await r.xadd(STREAM, {"n": "1"})
            await eventually(lambda: _equal(len(seen), 2), within=12, what="both entries handled")
        assert seen[1] == entry
        said = [rec for rec in caplog.records if "does not exist" in rec.getMessage()]
        assert len(said) == 1  # said once, though the read failed several times

    asyncio.run(main())


def test_an_unknown_contract_version_refuses_to_start(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        await write_settings(r, min_idle_ms=1000, contractVersion=2)
        await r.xadd(STREAM, {"n": "1"})

        async def handle(message: Message) -> Outcome:
            raise AssertionError("no message may be read")

        with pytest.raises(ContractVersionError) as raised:
            await worker(redis_url).run(handle, asyncio.Event())
        text = str(raised.value)
        assert "worker contract 2" in text
        assert "knows 1" in text
        assert "upgrade the library" in text
        # Nothing was read.
        assert await pending(r) == []
        assert (await r.xinfo_groups(STREAM))[0]["last-delivered-id"] == "0-0"

    asyncio.run(main())


def test_concurrency_bounds_the_handlers_running(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        for i in range(8):
            await r.xadd(STREAM, {"n": str(i)})
        running_now = highest = 0

        async def handle(message: Message) -> Outcome:
            nonlocal running_now, highest
            running_now += 1
            highest = max(highest, running_now)
            await asyncio.sleep(0.1)
            running_now -= 1
            return Outcome.done()

        w = worker(redis_url, concurrency=3)
        async with running(w, handle):
            await eventually(lambda: _equal(w.stats.done, 8))
        assert highest == 3

    asyncio.run(main())


def test_a_handler_answering_no_outcome_fails_the_message(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        entry = await r.xadd(STREAM, {"n": "1"})

        async def handle(message: Message) -> Outcome:
            return None  # type: ignore[return-value]

        w = worker(redis_url)
        async with running(w, handle):
            await eventually(lambda: _exists(r, errors_key(STREAM, GROUP), entry))
        assert str(await r.hget(errors_key(STREAM, GROUP), entry)).startswith("TypeError: the handler returned None")
        assert [p.id for p in await pending(r)] == [entry]

    asyncio.run(main())


async def _heartbeat(r: Redis) -> int | None:
    value = await r.hget(consumers_key(STREAM, GROUP), CONSUMER)
    return None if value is None else int(value)


async def _lease_ticks(r: Redis, count: int, within: float = 10.0) -> None:
    """Waits until the worker's heartbeat changed ``count`` times: as many lease ticks went by."""
    for _ in range(count):
        before = await _heartbeat(r)

        async def advanced(before: int | None = before) -> bool:
            return (await _heartbeat(r)) not in (None, before)

        await eventually(advanced, within=within, what="the next lease tick (the heartbeat advancing)")


def test_the_heartbeat_is_written_at_every_lease_tick_also_when_idle(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        await write_settings(r, min_idle_ms=300)  # a lease tick every 100 ms

        async def handle(message: Message) -> Outcome:
            raise AssertionError("nothing to handle")

        async with running(worker(redis_url), handle):
            await eventually(lambda: _has_heartbeat(r), what="the heartbeat field")
            first = await _heartbeat(r)
            await _lease_ticks(r, 3)
            last = await _heartbeat(r)
            server_ms = (await r.time())[0] * 1000
        assert first is not None
        assert last is not None
        assert last > first
        assert abs(last - server_ms) < 5000  # the server's time in ms

    asyncio.run(main())


async def _has_heartbeat(r: Redis) -> bool:
    return await _heartbeat(r) is not None


def test_a_cancelled_error_the_handler_raises_is_a_failure_handled_once(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        await write_settings(r, min_idle_ms=300)  # a look for hand-overs every 100 ms
        entry = await r.xadd(STREAM, {"n": "1"})
        runs = 0

        async def handle(message: Message) -> Outcome:
            nonlocal runs
            runs += 1
            raise asyncio.CancelledError("a timeout of the handler's own")

        w = worker(redis_url)
        async with running(w, handle):
            await eventually(lambda: _exists(r, errors_key(STREAM, GROUP), entry), what="the error recorded")
            await _lease_ticks(r, 5)
        assert runs == 1
        assert (w.stats.failed, w.stats.done) == (1, 0)
        assert await r.hget(errors_key(STREAM, GROUP), entry) == "CancelledError: a timeout of the handler's own"
        # Left pending, still this consumer's, for the operator's retry.
        assert [(p.id, p.consumer, p.deliveries) for p in await pending(r)] == [(entry, CONSUMER, 1)]

    asyncio.run(main())


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit])
def test_keyboard_interrupt_and_system_exit_are_recorded_then_stop_the_process(
    redis_url: str, raised: type[BaseException]
) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        await r.xadd(STREAM, {"n": "1"})

        async def handle(message: Message) -> Outcome:
            raise raised("stop")

        await worker(redis_url).run(handle, asyncio.Event())

    with pytest.raises(raised):
        asyncio.run(main())
    errors = client(redis_url)

    async def recorded() -> dict[Any, Any]:
        return await errors.hgetall(errors_key(STREAM, GROUP))

    assert list(asyncio.run(recorded()).values()) == [f"{raised.__name__}: stop"]


def test_abandoned_counts_only_what_the_give_back_released(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        entry = await r.xadd(STREAM, {"n": "1"})
        started = asyncio.Event()

        async def handle(message: Message) -> Outcome:
            started.set()
            await asyncio.sleep(60)
            return Outcome.done()

        w = worker(redis_url, shutdown_grace=0.2)
        async with running(w, handle) as task:
            await asyncio.wait_for(started.wait(), 5)
            # Acknowledged while its handler runs (the operator's pass dead-lettered it, say): not this worker's.
            await r.xack(STREAM, GROUP, entry)
        assert task.result().abandoned == 0
        assert await pending(r) == []

    asyncio.run(main())


def test_block_below_a_millisecond_is_refused_when_the_worker_is_built(redis_url: str) -> None:
    for block in (0, 0.0004, -1):
        with pytest.raises(ValueError, match=r"^block must be at least 0\.001 s"):
            worker(redis_url, block=block)


def test_block_at_or_above_the_factory_s_socket_timeout_is_refused(redis_url: str) -> None:
    async def main() -> None:
        w = Worker(lambda: Redis.from_url(redis_url, socket_timeout=2.0), STREAM, GROUP, CONSUMER, block=2.0)

        async def handle(message: Message) -> Outcome:
            return Outcome.done()

        stopped = asyncio.Event()
        stopped.set()  # were it accepted, the run would end at once
        with pytest.raises(ValueError, match=r"^block \(2\.0 s\) must be below the socket_timeout"):
            await w.run(handle, stopped)

    asyncio.run(main())


class _LosesCancellations(Redis):
    """A client whose lease calls take 100 ms and lose a cancellation that comes meanwhile, as a redis-py call can
    lose one inside ``asyncio.wait_for`` on Python 3.11."""

    lease_sha = hashlib.sha1(script_source("lease").encode()).hexdigest()
    lost = 0
    #: Set when a lease call starts.
    leasing: asyncio.Event

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if args[:2] != ("EVALSHA", self.lease_sha):
            return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
        call = asyncio.ensure_future(self._slowly(*args, **options))
        while True:
            try:
                return await asyncio.shield(call)
            except asyncio.CancelledError:
                type(self).lost += 1

    async def _slowly(self, *args: Any, **options: Any) -> Any:
        type(self).leasing.set()
        await asyncio.sleep(0.1)
        return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]


def test_run_returns_after_every_stop_even_when_a_cancellation_is_lost(redis_url: str, redis_port: int) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        await write_settings(r, min_idle_ms=300)  # a lease tick every 100 ms, each call 100 ms long

        async def handle(message: Message) -> Outcome:
            return Outcome.done()

        for cycle in range(20):
            source = lambda: _LosesCancellations(host="127.0.0.1", port=redis_port)  # noqa: E731
            stop, _LosesCancellations.leasing = asyncio.Event(), asyncio.Event()
            task = asyncio.create_task(Worker(source, STREAM, GROUP, f"cycle-{cycle}", block=0.05).run(handle, stop))
            # Stopped while a lease call is on its way: the run's end cancels the lease loop inside it.
            await asyncio.wait_for(_LosesCancellations.leasing.wait(), 5)
            stop.set()
            done, _ = await asyncio.wait({task}, timeout=5)
            assert done, f"run() did not return after stop (cycle {cycle}, {_LosesCancellations.lost} lost)"
            task.result()
        assert _LosesCancellations.lost > 0  # runs whose end lost the cancellation (most of them)

    asyncio.run(main())


def test_a_failure_is_one_warn_line_without_a_stack_trace_and_the_shutdown_one_info_line(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pelican_worker")

    async def main() -> str:
        r = client(redis_url)
        await _group(r)
        entry = await r.xadd(STREAM, {"n": "1"})

        async def handle(message: Message) -> Outcome:
            raise ConnectionError("the store did not answer")

        w = worker(redis_url)
        async with running(w, handle):
            await eventually(lambda: _equal(w.stats.failed, 1))
        return str(entry)

    entry = asyncio.run(main())
    failures = [r for r in caplog.records if entry in r.getMessage()]
    assert len(failures) == 1
    [failure] = failures
    assert failure.levelno == logging.WARNING
    assert failure.exc_info is None  # no stack trace per message
    assert "(ConnectionError: the store did not answer)" in failure.getMessage()
    given = [r for r in caplog.records if r.getMessage().startswith("shutdown:")]
    assert [(r.levelno, r.getMessage().split(" messages")[0]) for r in given] == [(logging.INFO, "shutdown: 0")]


def test_a_handler_that_swallows_its_cancellation_at_the_grace_s_end_writes_nothing(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _group(r)
        entry = await r.xadd(STREAM, {"n": "1"})
        started = asyncio.Event()

        async def handle(message: Message) -> Outcome:
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                return Outcome.done()  # too late: the entry is given back
            return Outcome.done()

        w = worker(redis_url, shutdown_grace=0.2)
        async with running(w, handle) as task:
            await asyncio.wait_for(started.wait(), 5)
        assert (task.result().done, task.result().abandoned) == (0, 1)
        [p] = await pending(r)
        assert (p.id, p.consumer, p.deliveries) == (entry, "", 0)  # given back, not acknowledged

    asyncio.run(main())
