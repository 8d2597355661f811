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
