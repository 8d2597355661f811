"""One partition of an ``ordering: PerKey`` topic (``contract/README.md``, "Order per key").

Entries are dispatched in id order into per-key queues: at most one entry of a key in flight, different keys side
by side up to the concurrency. A failure or a retry holds its key: the entry stays pending, this worker's, and runs
again in place after the backoff, its delivery counted on the server first (``XCLAIM ... RETRYCOUNT n+1 JUSTID``).
At the cap it is left to the operator's pass (``DeadLetterOnly`` on such a topic), which dead-letters it once idle;
the key goes on once the entry left this consumer's pending list.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from pelican_worker._meter import Ended, worker_meter
from pelican_worker._redis import Client, RedisSource, make_client, raw_command, read_entries
from pelican_worker._trace import processing
from pelican_worker.keys import settings_key
from pelican_worker.message import Message, Outcome, error_text
from pelican_worker.settings import (
    TOPIC_CONTRACT_VERSIONS,
    ContractVersionError,
    SettingsError,
    WorkerSettings,
    lease_interval,
    parse_settings,
)
from pelican_worker.worker import (
    CANCEL_WAIT,
    READ_TIMEOUT_OVER_BLOCK,
    Handler,
    WorkerStats,
    _cancelled_by_the_worker,
    _messages,
    _Writer,
)

__all__ = ["InOrderPartition", "Spacing"]

log = logging.getLogger("pelican_worker")

#: How many entries are held at once per unit of concurrency: read ahead, so that keys behind a slow one still run.
HELD_PER_SLOT = 4
#: The longest wait between two retries in place, whatever the settings say (no overflow).
LONGEST_SPACING_MS = 86_400_000


@dataclass(frozen=True, slots=True)
class Spacing:
    """How retries in place are spaced: ``minIdleMs * factor^(n-1)``, at most ``max_ms`` (0: no most)."""

    factor: float = 1.0
    max_ms: int = 0

    def after(self, min_idle_ms: int, deliveries: int) -> float:
        """Seconds until the run again of an entry delivered ``deliveries`` times."""
        wait = min(min_idle_ms * self.factor ** max(deliveries - 1, 0), LONGEST_SPACING_MS)
        if self.max_ms > 0:
            wait = min(wait, self.max_ms)
        return wait / 1000


@dataclass(slots=True)
class _Held:
    """An entry read and not yet done, terminal or dead-lettered."""

    message: Message
    failed: bool = False  # it ran here and failed: its next run counts a delivery first
    capped: bool = False  # at the cap: no longer leased, left to the operator's pass


class _Next(enum.Enum):
    """What a key does after its head ran."""

    GO_ON = enum.auto()  # the head left: the key's next entry may start
    WAIT = enum.auto()  # the head runs again in place after the backoff
    AT_THE_CAP = enum.auto()  # left to the pass: the key waits until the head left the pending list


# An entry's key: its pelican-key, or (an entry without one) the entry alone.
_Key = tuple[bool, bytes | str]


def _key_of(message: Message) -> _Key:
    key = message.key
    return (True, key) if key is not None else (False, message.id)


class InOrderPartition:
    """Runs partition ``stream`` of a ``PerKey`` topic as ``consumer``, once its pending list was taken over."""

    def __init__(
        self,
        redis: RedisSource,
        stream: str,
        group: str,
        consumer: str,
        partition: int,
        *,
        concurrency: int,
        block: float,
        shutdown_grace: float,
        spacing: Spacing,
        fresh: Callable[[], bool],
    ) -> None:
        self.stream, self.group, self.consumer, self.partition = stream, group, consumer, partition
        self._redis = redis
        self._concurrency, self._block, self._grace = concurrency, block, shutdown_grace
        self._spacing, self._fresh = spacing, fresh
        self._counts = {"done": 0, "terminal": 0, "failed": 0, "retried": 0, "abandoned": 0}
        # The same counts through OpenTelemetry's API, recorded with them.
        self._meter = worker_meter(stream, group)
        self._settings: WorkerSettings | None = None
        self._queues: dict[_Key, deque[_Held]] = {}
        self._ready: deque[_Key] = deque()
        self._waiting: dict[_Key, float] = {}  # key -> when its head runs again (loop time)
        self._running: dict[_Key, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()  # a read, a head that ended, the stop, the loss
        self._room = asyncio.Event()  # an entry left: the reader may read more
        self._stopping = False
        self._lost = False
        self._fatal: ContractVersionError | None = None

    @property
    def stats(self) -> WorkerStats:
        return WorkerStats(**self._counts, in_flight=len(self._running))

    def abort(self) -> None:
        """The partition is another's now: stops at once, handlers running are cancelled, nothing more is written."""
        self._lost = True
        self._wake.set()

    async def run(self, handler: Handler, stop: asyncio.Event) -> WorkerStats:
        """Runs until ``stop`` is set (then handlers finish within the grace and the rest is given back) or
        :meth:`abort`. Raises :class:`~pelican_worker.settings.ContractVersionError` when the settings say another
        contract, :class:`~pelican_worker.settings.SettingsError` when the partition has none."""
        reader = make_client(self._redis, socket_timeout=self._block + READ_TIMEOUT_OVER_BLOCK, resend=True)
        writer = make_client(self._redis, socket_timeout=10.0, resend=True)
        calls = _Writer(writer, self.stream, self.group, self.consumer)
        bridge = asyncio.create_task(self._follow(stop))
        reading: asyncio.Task[None] | None = None
        try:
            await self._read_settings(writer)
            if self._settings is None:
                raise SettingsError(f"partition {self.stream} has no settings of the topic's contract")
            reading = asyncio.create_task(self._read(reader))
            await self._dispatch(handler, calls)
            await self._shut_down(calls, reading)
        finally:
            for task in (bridge, reading, *self._running.values()):
                if task is not None:
                    task.cancel()
            await asyncio.gather(bridge, *(t for t in (reading,) if t is not None), return_exceptions=True)
            await reader.aclose()
            await writer.aclose()
        if self._fatal is not None:
            raise self._fatal
        return self.stats

    async def _follow(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._stopping = True
        self._wake.set()
        self._room.set()

    async def _read_settings(self, conn: Client) -> None:
        raw = await raw_command(conn, "HGETALL", settings_key(self.stream, self.group))
        self._settings = parse_settings(raw, TOPIC_CONTRACT_VERSIONS)

    # Reading: its own pending list first (what it took over), then new entries, while there is room.

    def _held(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    async def _read(self, reader: Client) -> None:
        cursor: str | None = "0"
        while not self._stopping and not self._lost:
            room = self._concurrency * HELD_PER_SLOT - self._held()
            if room <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            try:
                if cursor is not None:
                    found = read_entries(await self._xreadgroup(reader, room, cursor))
                    cursor = found[-1][0] if found else None
                else:
                    found = read_entries(await self._xreadgroup(reader, room, ">"))
            except (RedisError, OSError) as error:
                log.warning("read failed; retrying: %s", error, extra=self._where())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self._wake.wait()
                continue
            # Read after the stop too: what it brought is held, and given back.
            self._enqueue(_messages(found, self.partition))

    async def _xreadgroup(self, reader: Client, count: int, cursor: str) -> Any:
        block = ("BLOCK", max(1, round(self._block * 1000))) if cursor == ">" else ()
        return await raw_command(
            reader, "XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", count, *block,
            "STREAMS", self.stream, cursor,
        )  # fmt: skip

    def _enqueue(self, messages: list[Message]) -> None:
        """Puts entries read, in id order, behind their keys."""
        for message in messages:
            key = _key_of(message)
            queue = self._queues.setdefault(key, deque())
            if any(held.message.id == message.id for held in queue):
                continue
            if not queue:
                self._ready.append(key)
            queue.append(_Held(message))
        if messages:
            self._wake.set()

    # Dispatching

    async def _dispatch(self, handler: Handler, calls: _Writer) -> None:
        loop = asyncio.get_running_loop()
        next_lease = loop.time() + lease_interval(self._settings)
        while not self._stopping and not self._lost:
            now = loop.time()
            for key, at in list(self._waiting.items()):
                if at <= now:
                    del self._waiting[key]
                    self._ready.append(key)
            while len(self._running) < self._concurrency and self._ready:
                if not self._fresh():
                    log.warning(
                        "no membership heartbeat answered within the ttl: the partition is stopped",
                        extra=self._where(),
                    )
                    self.abort()
                    return
                key = self._ready.popleft()
                task = asyncio.create_task(self._run_head(handler, calls, key))
                self._running[key] = task
                self._meter.started()
            if now >= next_lease:
                await self._hold(calls)
                next_lease = loop.time() + lease_interval(self._settings)
            until = min([next_lease, *self._waiting.values()]) - loop.time()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(until, 0)):
                    await self._wake.wait()

    async def _run_head(self, handler: Handler, calls: _Writer, key: _Key) -> None:
        """Runs a key's head, writes its outcome and lets the key go on, wait or stay at the cap."""
        held = self._queues[key][0]
        try:
            if held.failed and not await self._count_delivery(calls.conn, held.message.id):
                self._pop(key)  # no longer this worker's (the pass took it): the key goes on
                return
            outcome: Outcome | None = None
            failure: BaseException | None = None
            started = asyncio.get_running_loop().time()
            try:
                with processing(self, held.message) as run:
                    outcome = await handler(held.message)
                    if not isinstance(outcome, Outcome):
                        raise TypeError(f"the handler returned {outcome!r}, not an Outcome")
                    run.ended(outcome)
            except BaseException as error:
                if _cancelled_by_the_worker() or self._lost:
                    raise
                failure = error
            if self._lost:
                return  # another's now: nothing is written
            ran = asyncio.get_running_loop().time() - started
            then, deliveries = await self._settle(calls, held, outcome, failure, ran)
            if then is _Next.GO_ON:
                self._pop(key)
            elif then is _Next.WAIT:
                self._waiting[key] = asyncio.get_running_loop().time() + self._spacing.after(
                    self._min_idle_ms(), deliveries
                )
            if isinstance(failure, (KeyboardInterrupt, SystemExit)):
                raise failure
        finally:
            if self._running.pop(key, None) is not None:
                self._meter.landed()
            self._wake.set()

    def _pop(self, key: _Key) -> None:
        """Takes the key's head out; its next entry, if any, is ready."""
        queue = self._queues[key]
        queue.popleft()
        if queue:
            self._ready.append(key)
        else:
            del self._queues[key]
        self._room.set()

    def _min_idle_ms(self) -> int:
        return self._settings.min_idle_ms if self._settings is not None else 0

    def _count(self, ended: Ended, seconds: float, error: BaseException | None = None) -> None:
        """Counts a run that took ``seconds`` as ``ended``, in the stats and their metrics (``error``: what the
        handler raised)."""
        self._counts[ended] += 1
        self._meter.ended(ended, seconds, error)

    async def _settle(
        self, calls: _Writer, held: _Held, outcome: Outcome | None, failure: BaseException | None, ran: float
    ) -> tuple[_Next, int]:
        """Writes the outcome of a key's head (which ran for ``ran`` seconds); a failure or a retry answers the
        entry's deliveries so far."""
        entry_id = held.message.id
        if outcome is not None and outcome.kind == "done":
            try:
                await calls.ack(entry_id, clear_error=held.failed)
                self._count("done", ran)
            except RedisError as error:
                # The key goes on: the entry stays pending, and whoever takes the partition over runs it again.
                log.warning("XACK of %s failed; it stays pending: %s", entry_id, error, extra=self._where())
                self._count("failed", ran)
            return _Next.GO_ON, 0
        if outcome is not None and outcome.kind == "terminal":
            log.warning("message ended as terminal: %s reason=%s", entry_id, outcome.reason, extra=self._where())
            try:
                await calls.terminal_ack(entry_id, str(outcome.reason))
                self._count("terminal", ran)
            except RedisError as error:
                log.warning("terminal ACK of %s failed; it stays pending: %s", entry_id, error, extra=self._where())
                self._count("failed", ran)
            return _Next.GO_ON, 0
        if failure is None:
            self._count("retried", ran)
        else:
            self._count("failed", ran, failure)
            text_ = error_text(failure)
            log.warning(
                "handler failed on %s (%s); run again in place after the backoff", entry_id, text_, extra=self._where()
            )
            try:
                await calls.record_error(entry_id, text_)
            except RedisError as error:
                log.warning("could not record the last error of %s: %s", entry_id, error, extra=self._where())
        held.failed = True
        try:
            deliveries = await self._deliveries(calls.conn, entry_id)
        except RedisError as error:
            log.warning("could not read the deliveries of %s: %s", entry_id, error, extra=self._where())
            return _Next.WAIT, 1
        if deliveries is None:
            return _Next.GO_ON, 0  # no longer this worker's (the pass took it, the partition moved)
        cap = self._settings.max_deliveries if self._settings is not None else None
        if cap is not None and cap > 0 and deliveries >= cap:
            log.info(
                "%s at the cap (%d deliveries): left to the operator's pass, which dead-letters it; its key waits",
                entry_id,
                deliveries,
                extra=self._where(),
            )
            held.capped = True
            return _Next.AT_THE_CAP, deliveries
        return _Next.WAIT, deliveries

    async def _deliveries(self, conn: Client, entry_id: str) -> int | None:
        """The entry's delivery count while it is this consumer's; ``None`` once it is not (acknowledged,
        dead-lettered, another's)."""
        reply = await raw_command(
            conn, "XPENDING", self.stream, self.group, entry_id, entry_id, 1, self.consumer
        )  # fmt: skip
        return int(reply[0][3]) if reply else None

    async def _count_delivery(self, conn: Client, entry_id: str) -> bool:
        """Counts the delivery of a run in place (``XCLAIM ... RETRYCOUNT n+1 JUSTID``, only while the entry is this
        consumer's); ``False`` when it no longer is."""
        try:
            deliveries = await self._deliveries(conn, entry_id)
            if deliveries is None:
                return False
            claimed = await raw_command(
                conn, "XCLAIM", self.stream, self.group, self.consumer, 0, entry_id,
                "RETRYCOUNT", deliveries + 1, "JUSTID",
            )  # fmt: skip
        except RedisError as error:
            log.warning("could not count the delivery of %s: %s", entry_id, error, extra=self._where())
            return False
        return bool(claimed)

    async def _hold(self, calls: _Writer) -> None:
        """Re-reads the settings, extends the lease of every entry held but those at the cap (the consumer's
        heartbeat too), and lets the keys whose capped head left the pending list go on."""
        try:
            await self._read_settings(calls.conn)
        except ContractVersionError as error:
            log.error("%s; shutting down", error, extra=self._where())
            self._fatal = error
            self._stopping = True
            return
        except (RedisError, SettingsError) as error:
            log.warning("could not re-read the settings: %s", error, extra=self._where())
        leased = [held.message.id for queue in self._queues.values() for held in queue if not held.capped]
        capped = [key for key, queue in self._queues.items() if queue[0].capped and key not in self._running]
        try:
            await calls.lease(leased)
            for key in capped:
                if await self._deliveries(calls.conn, self._queues[key][0].message.id) is None:
                    self._pop(key)
        except RedisError as error:
            log.warning("could not extend the leases; retrying at the next tick: %s", error, extra=self._where())

    # Shutdown

    async def _shut_down(self, calls: _Writer, reading: asyncio.Task[None]) -> None:
        """Lost: handlers are cancelled, nothing is written. Stopped: the read on its way returns (what it brought is
        given back), handlers finish within the grace, the rest is given back uncounted, its key's order kept for
        the next owner (it takes the pending list in id order). Entries that failed here stay pending, counted."""
        running = set(self._running.values())
        if self._lost:
            reading.cancel()
            for task in running:
                task.cancel()
            if running:
                await asyncio.wait(running, timeout=CANCEL_WAIT)
            return
        self._room.set()
        await asyncio.wait({reading}, timeout=self._block + READ_TIMEOUT_OVER_BLOCK)
        if running:
            _, late = await asyncio.wait(running, timeout=self._grace)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=CANCEL_WAIT)
        left = [held.message.id for queue in self._queues.values() for held in queue if not held.failed]
        idle = self._settings.retry_after_ms if self._settings is not None else 0
        try:
            given = await calls.give_back(left, idle, uncount=True)
        except RedisError as error:
            log.warning("shutdown: could not give back %d messages: %s", len(left), error, extra=self._where())
            return
        self._counts["abandoned"] += given
        self._meter.abandoned(given)

    def _where(self) -> dict[str, Any]:
        return {"stream": self.stream, "group": self.group, "consumer": self.consumer, "partition": self.partition}
