"""A blocking facade for synchronous code: the handler is a plain function, run in a thread pool.

    from pelican_worker import Outcome
    from pelican_worker.sync import Worker

    def handle(message):
        ...
        return Outcome.done()

    Worker("redis://redis:6379", "jobs", "workers").run(handle)  # until SIGTERM or SIGINT

Each message is handled in a daemon thread of its own. A handler still running when the shutdown grace runs out
cannot be stopped (Python cannot stop a thread): its message is given back all the same, whatever the function
answers later is ignored, and the process can exit without waiting for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import signal
import threading
from collections.abc import Callable
from typing import Any

from pelican_worker._redis import RedisSource
from pelican_worker.message import Message, Outcome
from pelican_worker.worker import Worker as AsyncWorker
from pelican_worker.worker import WorkerStats

__all__ = ["SyncHandler", "Worker"]

SyncHandler = Callable[[Message], Outcome]


class Worker:
    """:class:`pelican_worker.Worker` with the same arguments, for a handler that is a plain function."""

    def __init__(
        self, redis: RedisSource, stream: str, group: str, consumer: str | None = None, **options: Any
    ) -> None:
        self.worker = AsyncWorker(redis, stream, group, consumer, **options)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._stop_asked = False

    @property
    def stats(self) -> WorkerStats:
        return self.worker.stats

    def run(self, handler: SyncHandler, *, signals: bool = True) -> WorkerStats:
        """Runs until :meth:`stop` or, with ``signals`` (from the main thread), SIGTERM or SIGINT."""
        return asyncio.run(self._run(handler, signals))

    def stop(self) -> None:
        """Shuts the worker down gracefully; callable from any thread, before or while it runs."""
        with self._lock:
            self._stop_asked = True
            if self._loop is not None and self._stopped is not None:
                self._loop.call_soon_threadsafe(self._stopped.set)

    async def _run(self, handler: SyncHandler, signals: bool) -> WorkerStats:
        loop = asyncio.get_running_loop()
        stopped = asyncio.Event()
        with self._lock:
            self._loop, self._stopped = loop, stopped
            if self._stop_asked:
                stopped.set()

        async def handle(message: Message) -> Outcome:
            answer: asyncio.Future[Outcome] = loop.create_future()
            # A daemon thread, not a pool's: the interpreter joins a pool's threads at exit, so a handler blocked
            # past the grace would keep the process alive after run() returned. It runs in this task's context
            # variables (a thread starts with none): the handler's own spans are children of its run's.
            thread = threading.Thread(
                target=contextvars.copy_context().run,
                args=(_call, handler, message, loop, answer),
                name=f"pelican-handler-{message.id}",
                daemon=True,
            )
            thread.start()
            return await answer

        caught = (signal.SIGTERM, signal.SIGINT) if signals else ()
        for sig in caught:
            loop.add_signal_handler(sig, stopped.set)
        try:
            return await self.worker.run(handle, stopped)
        finally:
            for sig in caught:
                loop.remove_signal_handler(sig)
            with self._lock:
                self._loop = self._stopped = None


def _call(
    handler: SyncHandler, message: Message, loop: asyncio.AbstractEventLoop, answer: asyncio.Future[Outcome]
) -> None:
    """Runs ``handler`` in the calling thread and hands what it answered or raised to ``answer``, on its loop."""
    try:
        outcome = handler(message)
    except BaseException as error:  # whatever the handler raised is the message's failure, on the loop's side
        _settle(loop, answer, error)
    else:
        _settle(loop, answer, outcome)


def _settle(loop: asyncio.AbstractEventLoop, answer: asyncio.Future[Outcome], value: Outcome | BaseException) -> None:
    def settle() -> None:
        if answer.done():  # cancelled: the grace ran out
            return
        if isinstance(value, BaseException):
            answer.set_exception(value)
        else:
            answer.set_result(value)

    # The loop is closed once the worker gave the message back and returned: nothing waits for the answer any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(settle)
