"""Producers against a real server: refused, failed, unavailable, no resend after a lost reply, idempotence."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest
from helpers import GROUP, STREAM, client
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import BusyLoadingError, ConnectionError, ReadOnlyError, ResponseError, TimeoutError

from pelican_worker import (
    IdempotenceUnsupported,
    Producer,
    PublishFailed,
    PublishOutcomeUnknown,
    PublishRefused,
    PublishUnavailable,
    Refusal,
)
from pelican_worker._redis import make_client, raw_command
from pelican_worker._scripts import script_source
from pelican_worker.keys import bounds_key, rejected_key
from pelican_worker.producer import _classify, _has_token


def test_publish_adds_the_fields_in_order(redis_url: str) -> None:
    async def main() -> None:
        async with Producer(redis_url, STREAM) as producer:
            entry = await producer.publish([("job", "42"), ("path", b"/in/a.txt"), ("job", 7)])
            mapped = await producer.publish({"job": "43"})
        rows = await raw_command(make_client(redis_url, socket_timeout=5.0, resend=True), "XRANGE", STREAM, "-", "+")
        assert rows == [
            [entry.encode(), [b"job", b"42", b"path", b"/in/a.txt", b"job", b"7"]],
            [mapped.encode(), [b"job", b"43"]],
        ]

    asyncio.run(main())


async def _bounded(r: Redis, max_length: int, backlog: int) -> None:
    await r.xgroup_create(STREAM, GROUP, id="$", mkstream=True)
    await r.hset(bounds_key(STREAM), GROUP, max_length)
    for i in range(backlog):
        await r.xadd(STREAM, {"n": str(i)})


def test_a_full_backlog_refuses_and_writes_nothing(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _bounded(r, max_length=2, backlog=2)
        async with Producer(redis_url, STREAM) as producer:
            with pytest.raises(PublishRefused) as raised:
                await producer.publish({"n": "over"})
        assert (raised.value.group, raised.value.backlog, raised.value.max) == (GROUP, 2, 2)
        assert raised.value.certainly_not_written
        assert await r.xlen(STREAM) == 2
        assert await r.hgetall(rejected_key(STREAM)) == {GROUP: "1"}

    asyncio.run(main())


def test_a_batch_writes_what_the_bound_has_room_for(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await _bounded(r, max_length=3, backlog=1)
        async with Producer(redis_url, STREAM) as producer:
            published = await producer.publish_batch([{"n": str(i)} for i in range(4)])
        assert len(published.ids) == 2
        assert published.refused == Refusal(GROUP, 1, 3)
        assert [str(f["n"]) for _, f in await r.xrange(STREAM) or [] if f] == ["0", "0", "1"]
        assert await r.hgetall(rejected_key(STREAM)) == {GROUP: "2"}

    asyncio.run(main())


def test_another_server_error_is_failed(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        await r.set(STREAM, "not a stream")
        async with Producer(redis_url, STREAM) as producer:
            with pytest.raises(PublishFailed, match="WRONGTYPE"):
                await producer.publish({"n": "1"})

    asyncio.run(main())


def test_a_read_only_replica_is_unavailable(redis_url: str) -> None:
    async def main() -> None:
        r = client(redis_url)
        # A replica of a primary that is not there: it keeps refusing writes.
        await r.replicaof("127.0.0.1", "1")
        try:
            async with Producer(redis_url, STREAM) as producer:
                with pytest.raises(PublishUnavailable, match=r"READONLY|read only"):
                    await producer.publish({"n": "1"})
        finally:
            await r.replicaof("NO", "ONE")
        assert await r.exists(STREAM) == 0

    asyncio.run(main())


def test_a_refused_connection_is_unavailable_nothing_sent(redis_url: str) -> None:
    async def main() -> None:
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        async with Producer(f"redis://127.0.0.1:{port}", STREAM) as producer:
            with pytest.raises(PublishUnavailable) as raised:
                await producer.publish({"n": "1"})
            assert raised.value.certainly_not_written
            with pytest.raises(PublishUnavailable):
                await producer.publish_batch([{"n": "1"}])

    asyncio.run(main())


def test_server_errors_are_classified_as_the_contract_says() -> None:
    assert isinstance(_classify(ResponseError("PELICAN_BACKLOG_FULL my group 5 5")), PublishRefused)
    refused = _classify(ResponseError("PELICAN_BACKLOG_FULL my group 5 5"))
    assert isinstance(refused, PublishRefused)
    assert (refused.group, refused.backlog, refused.max) == ("my group", 5, 5)
    for unavailable in [
        ReadOnlyError("You can't write against a read only replica."),
        BusyLoadingError("Redis is loading the dataset in memory"),
        ResponseError("BUSY Redis is busy running a script."),
        ResponseError("MASTERDOWN Link with MASTER is down"),
        ResponseError("TRYAGAIN Multiple keys request during rehashing of slot"),
    ]:
        assert isinstance(_classify(unavailable), PublishUnavailable), unavailable
    assert isinstance(
        _classify(ResponseError("PELICAN_PARTIAL 1 of 3 entries written before: OOM")), PublishOutcomeUnknown
    )
    assert isinstance(_classify(ResponseError("ERR bounded publish needs field value pairs")), PublishFailed)
    for unavailable in [
        ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused."),
        TimeoutError("Timeout connecting to server"),
    ]:
        classified = _classify(unavailable)
        assert isinstance(classified, PublishUnavailable), unavailable
        assert classified.certainly_not_written
    for unknown in [ConnectionError("Connection closed by server."), TimeoutError("Timeout reading from socket")]:
        classified = _classify(unknown)
        assert isinstance(classified, PublishOutcomeUnknown)
        assert not classified.certainly_not_written


class LostReply:
    """A loopback proxy to the server that loses one reply: on the first connection whose client sends ``EVALSHA``,
    it lets the command through and closes the connection instead of passing the answer on. Later connections pass
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
        armed = False

        async def upstream() -> None:
            nonlocal armed
            while data := await from_client.read(65536):
                armed = armed or (not self.cut and b"EVALSHA" in data.upper())
                to_server.write(data)
                await to_server.drain()

        async def downstream() -> None:
            while data := await from_server.read(65536):
                if armed:
                    self.cut = True
                    return
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


def resending(port: int) -> Redis:
    """A client that resends a command after a broken connection, as redis-py's ``Redis(host=...)`` does by default
    since 6.0; configured here so that it does with every redis-py version tested."""
    return Redis(host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 3), retry_on_error=[ConnectionError])


async def _publish_through_lost_reply(redis_url: str, port: int, use_factory: bool) -> None:
    r = client(redis_url)
    await r.script_load(script_source("bounded_publish"))  # so the EVALSHA runs, rather than answering NOSCRIPT
    proxy = LostReply(port)
    async with proxy.serving() as proxy_port:
        # The factory's clients resend: the producer must turn that off all the same.
        source = (lambda: resending(proxy_port)) if use_factory else f"redis://127.0.0.1:{proxy_port}"
        async with Producer(source, STREAM, timeout=5.0) as producer:
            with pytest.raises(PublishOutcomeUnknown):
                await producer.publish({"n": "once"})
    assert proxy.cut
    assert await r.xlen(STREAM) == 1


@pytest.mark.parametrize("use_factory", [False, True], ids=["url", "factory"])
def test_a_publish_whose_reply_was_lost_is_outcome_unknown_and_written_once(
    redis_url: str, redis_port: int, use_factory: bool
) -> None:
    asyncio.run(_publish_through_lost_reply(redis_url, redis_port, use_factory))


def test_the_lost_reply_makes_a_resending_client_write_twice(redis_url: str, redis_port: int) -> None:
    """The control of the test above: the same lost reply through a client that resends."""

    async def main() -> None:
        r = client(redis_url)
        source = script_source("bounded_publish")
        await r.script_load(source)
        proxy = LostReply(redis_port)
        async with proxy.serving() as proxy_port:
            resends = resending(proxy_port)
            script = resends.register_script(source)
            await script(keys=[STREAM, bounds_key(STREAM), rejected_key(STREAM)], args=["n", "once"])
            await resends.aclose()
        assert proxy.cut
        assert await r.xlen(STREAM) == 2

    asyncio.run(main())


async def _idmp(redis_url: str) -> bool:
    async with Producer(redis_url, STREAM) as producer:
        try:
            await producer.idempotent("producer-0")
            return True
        except IdempotenceUnsupported:
            return False


def test_an_idempotent_publish_is_written_once(idmp_redis_url: str) -> None:
    redis_url = idmp_redis_url

    async def main() -> None:
        assert await _idmp(redis_url), "IDMP_REDIS_SERVER has no XADD ... IDMP"
        async with await Producer(redis_url, STREAM).idempotent("producer-0") as producer:
            first = await producer.publish("order-1", {"n": "1"})
            again = await producer.publish("order-1", {"n": "1"})
            batch = await producer.publish_batch([("order-1", {"n": "1"}), ("order-2", {"n": "2"})])
        assert again == first
        assert batch.ids[0] == first
        assert await client(redis_url).xlen(STREAM) == 2

    asyncio.run(main())


def test_without_idmp_an_idempotent_producer_is_refused_up_front_naming_redis_8_6(redis_url: str) -> None:
    async def main() -> None:
        async with Producer(redis_url, STREAM) as producer:
            with pytest.raises(IdempotenceUnsupported, match=r"no XADD \.\.\. IDMP \(Redis 8\.6 or later\)"):
                await producer.idempotent("producer-0")  # before any publish
        assert await client(redis_url).exists(STREAM) == 0

    asyncio.run(main())


def test_idmp_is_detected_from_the_token_in_command_docs() -> None:
    # COMMAND DOCS XADD as Redis 8.6 answers it, abridged: RESP2 (flat lists) and RESP3 (maps).
    resp2 = [
        b"xadd",
        [b"summary", b"Appends a new message to a stream.", b"arguments",
         [[b"name", b"key", b"type", b"key"],
          [b"name", b"idmp", b"type", b"block", b"token", b"IDMP", b"arguments", [[b"name", b"pid"]]]]],
    ]  # fmt: skip
    resp3 = {"xadd": {"summary": "x", "arguments": [{"name": "idmp", "type": "block", "token": "IDMP"}]}}
    older = [
        b"xadd",
        [b"summary", b"mentions IDMP only in text", b"arguments", [[b"name", b"key", b"token", b"MAXLEN"]]],
    ]
    assert _has_token(resp2, "IDMP")
    assert _has_token(resp3, "IDMP")
    assert not _has_token(older, "IDMP")
    assert not _has_token([], "IDMP")
