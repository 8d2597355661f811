"""What the tests share: reading Redis state, running a worker in the background, waiting for a condition."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from pelican_worker import Handler, Worker, WorkerStats
from pelican_worker.keys import settings_key

STREAM = "{jobs}:files"
GROUP = "workers"
CONSUMER = "worker-1"


def client(url: str) -> Redis:
    return Redis.from_url(url, decode_responses=True, protocol=2)


async def write_settings(
    r: Redis, *, min_idle_ms: int, retry_after_ms: int = 60_000, max_deliveries: int = 5, **extra: str | int
) -> None:
    fields: dict[str, str | int] = {
        "minIdleMs": min_idle_ms,
        "retryAfterMs": retry_after_ms,
        "maxDeliveries": max_deliveries,
        **extra,
    }
    await r.hset(settings_key(STREAM, GROUP), mapping=fields)  # type: ignore[arg-type]


@dataclass
class Pending:
    id: str
    consumer: str
    idle_ms: int
    deliveries: int


async def pending(r: Redis) -> list[Pending]:
    rows = await r.xpending_range(STREAM, GROUP, "-", "+", 1000)
    return [
        Pending(str(p["message_id"]), str(p["consumer"]), int(p["time_since_delivered"]), int(p["times_delivered"]))
        for p in rows
    ]


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(worker: Worker, handler: Handler) -> AsyncIterator[asyncio.Task[WorkerStats]]:
    """Runs the worker in the background; stops it and waits for it on exit."""
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(handler, stop))
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def worker(url: str, **options: Any) -> Worker:
    return Worker(url, STREAM, GROUP, CONSUMER, **options)


class _Proxy:
    """A loopback proxy to the server on a port of its own; the subclasses' hooks see what passes, a chunk at a time
    (redis-py writes each command whole: on loopback a command comes in one chunk), and may hold it back."""

    def __init__(self, port: int) -> None:
        self.port = port

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[int]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        try:
            yield server.sockets[0].getsockname()[1]
        finally:
            self._closing()
            server.close()

    def _closing(self) -> None:
        """Called as the proxy stops: nothing may stay held."""

    async def _to_server(self, connection: _Connection, data: bytes) -> None:
        """Called with each chunk a client sends, before it goes on."""

    async def _to_client(self, connection: _Connection, data: bytes) -> None:
        """Called with each chunk the server replies, before it goes on."""

    async def _serve(self, from_client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        from_server, to_server = await asyncio.open_connection("127.0.0.1", self.port)
        connection = _Connection()

        async def pump(
            source: asyncio.StreamReader,
            sink: asyncio.StreamWriter,
            hook: Callable[[_Connection, bytes], Awaitable[None]],
        ) -> None:
            while data := await source.read(65536):
                await hook(connection, data)  # what comes after waits in the socket meanwhile
                sink.write(data)
                await sink.drain()

        tasks = [
            asyncio.create_task(pump(from_client, to_server, self._to_server)),
            asyncio.create_task(pump(from_server, to_client, self._to_client)),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            to_client.close()
            to_server.close()


@dataclass
class _Connection:
    """What a proxy knows of one client connection: whether its client sent ``XREADGROUP``."""

    reader: bool = False


class HeldReadReply(_Proxy):
    """Holds back the reply of a read: on a connection whose client sent ``XREADGROUP``, the first reply holding
    ``marker`` and all after it wait until ``release()``. The server delivered what the read asked for; the client
    does not see it. ``reads`` counts the ``XREADGROUP`` requests."""

    def __init__(self, port: int, marker: bytes) -> None:
        super().__init__(port)
        self.marker = marker
        self.reads = 0
        self.released = asyncio.Event()

    def release(self) -> None:
        self.released.set()

    def _closing(self) -> None:
        self.released.set()

    async def _to_server(self, connection: _Connection, data: bytes) -> None:
        sent = data.upper().count(b"XREADGROUP")
        self.reads += sent
        connection.reader = connection.reader or sent > 0

    async def _to_client(self, connection: _Connection, data: bytes) -> None:
        if connection.reader and self.marker in data and not self.released.is_set():
            await self.released.wait()


class SlowCommand(_Proxy):
    """A network slow on some connections: each command holding ``marker`` (and what its connection sends after it)
    waits ``delay`` seconds on its way to the server; ``held`` is set as the first starts to wait."""

    def __init__(self, port: int, marker: bytes, delay: float) -> None:
        super().__init__(port)
        self.marker = marker
        self.delay = delay
        self.held = asyncio.Event()

    async def _to_server(self, connection: _Connection, data: bytes) -> None:
        if self.marker in data:
            self.held.set()
            await asyncio.sleep(self.delay)
