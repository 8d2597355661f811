"""The asyncio worker: the dispatch layer of an application consumer, as the worker contract's checklist says.

It reads its own PEL first, then new entries, hands each message to the handler with at most ``concurrency`` running,
and is the only place that acknowledges. At every lease tick it extends the lease of each entry in flight (the same
call is its heartbeat) and takes up the entries the operator handed over to it; on shutdown it gives back what did
not finish within the grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError, ResponseError

from pelican_worker._meter import Ended, worker_meter
from pelican_worker._redis import (
    Client,
    RedisSource,
    make_client,
    queue_raw,
    range_entries,
    raw_command,
    read_entries,
    socket_timeout_of,
    text,
)
from pelican_worker._scripts import script_source
from pelican_worker._trace import processing
from pelican_worker.keys import (
    DELIVERIES_FIELD,
    consumers_key,
    errors_key,
    settings_key,
    terminal_key,
)
from pelican_worker.message import Message, Outcome, error_text
from pelican_worker.settings import (
    KNOWN_CONTRACT_VERSIONS,
    TOPIC_CONTRACT_VERSIONS,
    UNPUBLISHED_IDLE_MS,
    ContractVersionError,
    SettingsError,
    WorkerSettings,
    lease_interval,
    parse_settings,
)

__all__ = ["Handler", "Worker", "WorkerStats", "default_consumer_name", "run_until_signal"]

log = logging.getLogger("pelican_worker")

Handler = Callable[[Message], Awaitable[Outcome]]

#: The most ids one lease or give-back call carries, and the most entries of the own PEL listed for hand-overs.
LEASE_BATCH = 100
#: An entry that failed here counts as handed back to this worker when its idle time is shorter than the time since
#: it failed by at least this much (the operator hands over only entries idle ``minIdle``, at least a second).
HAND_OVER_MARGIN = 1.0
#: How many ids whose last error this worker recorded it remembers, to remove the error with their ACK.
ERRORS_REMEMBERED = 10_000
#: How long handlers cancelled at the end of the grace are waited for before their entries are given back.
CANCEL_WAIT = 1.0
#: The shortest ``block``: 1 ms (``BLOCK 0`` waits for ever on the server while the client gives up).
MIN_BLOCK = 0.001
#: How much longer than ``block`` the reader's client waits for a blocking read's reply (a URL's client).
READ_TIMEOUT_OVER_BLOCK = 10.0


def default_consumer_name() -> str:
    """The Pod's name: ``POD_NAME``, else ``HOSTNAME``, else the host name."""
    return os.environ.get("POD_NAME") or os.environ.get("HOSTNAME") or socket.gethostname()


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """What a worker did so far: a frozen dataclass (fields by name, ``dataclasses.asdict``; not a tuple)."""

    done: int = 0
    terminal: int = 0
    #: Whatever the handlers raised, and acknowledgements that failed: left pending for the operator's retry.
    failed: int = 0
    #: ``Outcome.retry()``: given back to the operator's pass, the delivery counted.
    retried: int = 0
    #: Given back on shutdown (still running when the grace ran out, or read and not started), the delivery not
    #: counted: only entries the give-back released, never ones acknowledged meanwhile.
    abandoned: int = 0
    in_flight: int = 0


class Worker:
    """Reads ``stream`` as ``consumer`` of ``group`` and hands each message to a handler.

    ``redis`` is a ``redis://`` URL or a factory returning a new ``redis.asyncio.Redis`` each call (the worker
    opens two: the blocking reads get one of their own, so leases, ACKs and give-backs never queue behind them).
    """

    def __init__(
        self,
        redis: RedisSource,
        stream: str,
        group: str,
        consumer: str | None = None,
        *,
        concurrency: int = 16,
        block: float = 1.0,
        shutdown_grace: float = 20.0,
        max_handling: float = 1800.0,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if not block >= MIN_BLOCK:
            raise ValueError(f"block must be at least 0.001 s (BLOCK 0 waits for ever on the server); got {block!r}")
        if shutdown_grace < 0 or max_handling <= 0:
            raise ValueError("max_handling must be positive, shutdown_grace not negative")
        self.stream = stream
        self.group = group
        self.consumer = consumer or default_consumer_name()
        self.concurrency = concurrency
        self.block = block
        self.shutdown_grace = shutdown_grace
        self.max_handling = max_handling
        self._redis = redis
        self._counts = {"done": 0, "terminal": 0, "failed": 0, "retried": 0, "abandoned": 0}
        # The same counts through OpenTelemetry's API, recorded with them.
        self._meter = worker_meter(stream, group)
        self._settings: WorkerSettings | None = None
        # The problem with the settings last reported, so a warning is given once, not at every tick.
        self._settings_problem: str | None = None
        # Entry id -> when its handler started (loop time), while the handler runs: these are leased.
        self._in_flight: dict[str, float] = {}
        # Entries whose handler ended and whose outcome is being written: no longer leased (a lease after a retry's
        # give-back would undo the idle time it set), never taken up as hand-overs.
        self._settling: set[str] = set()
        # Entries delivered to this consumer that wait for a free slot (a read and a hand-over came back together):
        # leased meanwhile, given back on shutdown.
        self._queued: dict[str, Message] = {}
        # The own PEL was read to its end (entries delivered to this name before a restart): hand-overs from now on.
        self._own_pel_read = False
        # When the read on its way was sent (loop time; None once what it brought is in flight or queued): an entry
        # delivered since is in the own PEL before its reply is here, and may be that read's, not a hand-over.
        self._read_sent_at: float | None = None
        # Entry id -> when its handler failed or asked for a retry here: the pass retries it, never this worker.
        self._failed_here: dict[str, float] = {}
        # Held by a lease tick from gathering its ids to the end of its look at the own PEL, and by a retry's
        # give-back: the writer's pool keeps no order between two calls. A give-back sent while a lease that gathered
        # its entry is on its way could reach the server first (the lease would then undo the idle time it set); one
        # sent while the own PEL's XPENDING is out could be answered first (the entry no longer busy, its idle in that
        # reply from before the give-back: it would look handed back).
        self._leasing = asyncio.Lock()
        self._errors_recorded: set[str] = set()
        # Entry id -> its handler's task, until the task ends (it takes itself out).
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Set once the worker cancels handlers (the grace's end, a lost partition, run's end): until then a handler
        # that returns was not cancelled by the worker, and the check is skipped.
        self._cancelling = False
        # The writer's calls while running: a lost partition drops the ACKs waiting there.
        self._calls: _Writer | None = None
        self._stop = asyncio.Event()
        # Set when a handler's task ends or the worker stops: wakes the read loop waiting for slots.
        self._wake = asyncio.Event()
        # Set once the shutdown is over: ends the lease loop (a cancellation alone can be lost inside redis-py).
        self._done = asyncio.Event()
        self._fatal: ContractVersionError | None = None
        self._running = False
        # A topic's partition (TopicWorker, _as_partition): the contract versions its settings may say, the
        # partition its messages carry, whether the membership is fresh (no handler starts once it may have
        # expired), and aborted: the partition was lost, nothing more of it is written or given back.
        self._known_versions = KNOWN_CONTRACT_VERSIONS
        self._partition: int | None = None
        self._fresh: Callable[[], bool] | None = None
        self._aborted = False

    def _as_partition(self, partition: int, fresh: Callable[[], bool]) -> None:
        """Makes this worker partition ``partition`` of a topic (contract version 2), owned while ``fresh()``."""
        self._known_versions = TOPIC_CONTRACT_VERSIONS
        self._partition, self._fresh = partition, fresh

    def _abort(self) -> None:
        """The partition is lost (another's now): stops at once; handlers running are cancelled and nothing more is
        written, nothing given back: the new owner takes the entries over from the pending list."""
        if not self._aborted:
            log.warning("partition lost: stopped at once, its messages left to the new owner", extra=self._where())
        self._aborted = True
        self._request_stop()
        self._cancel(self._tasks.values())
        if self._calls is not None:
            for ack in self._calls.take_acks():
                self._land(ack.entry_id)

    @property
    def stats(self) -> WorkerStats:
        return WorkerStats(**self._counts, in_flight=len(self._in_flight) + len(self._settling))

    @property
    def settings(self) -> WorkerSettings | None:
        """The group's settings as last read; ``None`` when none are published."""
        return self._settings

    async def run(self, handler: Handler, stop: asyncio.Event | None = None) -> WorkerStats:
        """Runs until ``stop`` is set: then stops reading, lets handlers finish within ``shutdown_grace``, gives back
        the rest, and returns the stats.

        Raises :class:`~pelican_worker.settings.ContractVersionError` before reading anything when the operator
        speaks a contract this library does not know (and after a graceful shutdown when it starts to while running).
        Read errors (a server restarting, say) are logged and retried; they do not stop the worker.
        """
        if self._running:
            raise RuntimeError("this worker is already running")
        reader = make_client(self._redis, socket_timeout=self.block + READ_TIMEOUT_OVER_BLOCK, resend=True)
        read_timeout = socket_timeout_of(reader)
        if read_timeout is not None and read_timeout <= self.block:
            await reader.aclose()
            raise ValueError(
                f"block ({self.block} s) must be below the socket_timeout of the factory's clients ({read_timeout} s): "
                "the client would give up on every blocking read"
            )
        self._running, self._fatal, self._own_pel_read, self._cancelling = True, None, False, False
        # Made for this run's event loop (a worker may run again under another).
        self._stop, self._done, self._leasing = asyncio.Event(), asyncio.Event(), asyncio.Lock()
        writer = make_client(self._redis, socket_timeout=10.0, resend=True)
        self._calls = calls = _Writer(writer, self.stream, self.group, self.consumer)
        bridge = asyncio.create_task(self._follow(stop)) if stop is not None else None
        leases: asyncio.Task[None] | None = None
        try:
            if not await self._first_settings(writer):
                return self.stats
            leases = asyncio.create_task(self._hold_leases(handler, calls))
            unhandled = await self._read_loop(handler, reader, calls)
            await self._shut_down(calls, unhandled)
        finally:
            self._done.set()
            background = [t for t in (bridge, leases, calls.flusher) if t is not None]
            self._cancel(self._tasks.values())
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await reader.aclose()
            await writer.aclose()
            self._running, self._calls = False, None
        if self._fatal is not None:
            raise self._fatal
        return self.stats

    async def _follow(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._request_stop()

    # Settings

    async def _first_settings(self, conn: Client) -> bool:
        """Reads the settings (checking the contract version) before the first read; ``False`` when stopped first."""
        while not self._stop.is_set():
            try:
                await self._read_settings(conn)
                return True
            except ContractVersionError as error:
                log.error("%s", error, extra=self._where())
                raise
            except (RedisError, OSError) as error:  # the server's refusals are handled inside: a broken connection
                log.warning("could not read the group's settings yet; retrying: %s", error, extra=self._where())
                await self._sleep(0.5)
        return False

    async def _read_settings(self, conn: Client) -> None:
        """Reads the settings hash. A refusal (an ACL without ``hgetall`` on it) or a malformed hash leaves the worker
        without settings (leases every second), with a warning once; a broken connection keeps the last ones."""
        try:
            raw = await raw_command(conn, "HGETALL", settings_key(self.stream, self.group))
            settings, problem = parse_settings(raw, self._known_versions), None
        except (ResponseError, SettingsError) as error:
            settings, problem = None, str(error)
        if problem is not None and problem != self._settings_problem:
            log.warning(
                "no usable settings for the group (%s): leasing every second, giving back with an idle of %d ms",
                problem,
                UNPUBLISHED_IDLE_MS,
                extra=self._where(),
            )
        if settings != self._settings:
            log.info("group settings: %s", settings, extra=self._where())
        self._settings, self._settings_problem = settings, problem

    # Reading

    async def _read_loop(self, handler: Handler, reader: Client, calls: _Writer) -> list[str]:
        """Reads and dispatches until the stop; answers the ids of what a read brought after the stop, unhandled."""
        cursor: str | None = "0"  # own PEL first: entries delivered to this name before a restart
        nogroup_wait: float | None = None
        while not self._stop.is_set():
            # The ACKs of handlers that end from here on ride on the next read.
            calls.carried = True
            while self._queued and self._free_slots() > 0:
                self._start(handler, calls, self._queued.pop(next(iter(self._queued))), self._now())
            free = self._free_slots() - len(self._queued)
            if free <= 0:
                if calls.waiting:  # messages queued for a slot go first: no read comes to carry these
                    calls.release()
                await self._slot_freed()
                continue
            self._read_sent_at = asyncio.get_running_loop().time()
            try:
                if cursor is not None:
                    found, cursor = await self._read_own(reader, calls, free, cursor)
                    self._own_pel_read = cursor is None
                else:
                    found = await self._read_new(reader, calls, free)
            except ResponseError as error:
                self._read_sent_at = None
                calls.release()
                if not str(error).startswith("NOGROUP"):
                    log.warning("read refused; retrying: %s", error, extra=self._where())
                    await self._sleep(0.5)
                    continue
                # The group is the operator's to create: wait for it, say so once.
                if nogroup_wait is None:
                    log.warning(
                        "group %s does not exist on stream %s yet: waiting for the operator to create it",
                        self.group,
                        self.stream,
                        extra=self._where(),
                    )
                    nogroup_wait = 1.0
                await self._sleep(nogroup_wait)
                nogroup_wait = min(nogroup_wait * 2, 10.0)
                continue
            except (RedisError, OSError) as error:
                self._read_sent_at = None
                calls.release()
                log.warning("read failed; retrying: %s", error, extra=self._where())
                await self._sleep(0.5)
                continue
            if nogroup_wait is not None:
                log.info("group %s exists now: reading", self.group, extra=self._where())
                nogroup_wait = None
            if self._stop.is_set():
                # The read was sent before the stop, and the server delivered to this consumer all the same.
                calls.release()
                return [message.id for message in found]
            self._hand_out(handler, calls, found)
            self._read_sent_at = None
        calls.release()
        return []

    async def _slot_freed(self) -> None:
        """Waits until a handler's slot is free, or for the stop."""
        while self._free_slots() <= 0 and not self._stop.is_set():
            self._wake.clear()
            await self._wake.wait()

    def _free_slots(self) -> int:
        """Handlers that may start now."""
        return self.concurrency - len(self._tasks)

    def _hand_out(self, handler: Handler, calls: _Writer, messages: Iterable[Message]) -> None:
        """Starts a handler for each message while slots are free, and queues the rest."""
        # One clock read for the batch: the handlers start in this same turn of the loop.
        now = self._now()
        for message in messages:
            if message.id in self._in_flight or message.id in self._settling or message.id in self._queued:
                continue  # a hand-over and a read that brought the same entry: handled once
            if self._free_slots() > 0 and not self._stop.is_set():
                self._start(handler, calls, message, now)
            else:
                self._queued[message.id] = message

    async def _read_own(
        self, reader: Client, calls: _Writer, count: int, cursor: str
    ) -> tuple[list[Message], str | None]:
        found = read_entries(await self._read_carrying(reader, calls, count, cursor))
        if not found:
            return [], None
        return _messages(found, self._partition), found[-1][0]

    async def _read_new(self, reader: Client, calls: _Writer, count: int) -> list[Message]:
        """New entries: a read that does not block carries the ACKs waiting, and when it brings nothing (or none
        wait) the blocking read follows, the ACKs from then on left to the flusher (they never wait behind it)."""
        if calls.waiting:
            found = _messages(read_entries(await self._read_carrying(reader, calls, count, ">")), self._partition)
            if found:
                return found
        calls.release()
        block_ms = max(1, round(self.block * 1000))
        reply = await raw_command(
            reader, "XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", count, "BLOCK", block_ms,
            "STREAMS", self.stream, ">",
        )  # fmt: skip
        return _messages(read_entries(reply), self._partition)

    async def _read_carrying(self, reader: Client, calls: _Writer, count: int, cursor: str) -> Any:
        """``XREADGROUP`` from ``cursor`` without blocking, after the ``XACK`` of the ACKs waiting in the same round
        trip (a hand-written loop's two commands in one); answers the read's reply."""
        acks = calls.take_acks()
        read = ("XREADGROUP", "GROUP", self.group, self.consumer, "COUNT", count, "STREAMS", self.stream, cursor)
        if not acks:
            return await raw_command(reader, *read)
        pipe = reader.pipeline(transaction=False)
        calls.queue_acks(pipe, acks)
        queue_raw(pipe, *read)
        try:
            replies = await pipe.execute(raise_on_error=False)
        except BaseException as error:
            calls.settle(acks, error)
            raise
        acked, reply = replies[0], replies[-1]
        calls.settle(acks, acked if isinstance(acked, Exception) else None)
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def _take_up(self, handler: Handler, calls: _Writer) -> None:
        """Takes up as many hand-overs as slots are free and starts their handlers; the rest at the next tick. Not
        before the own PEL was read to its end (that read brings them) nor after the stop."""
        free = self._free_slots() - len(self._queued)
        if free <= 0 or not self._own_pel_read or self._stop.is_set():
            return
        try:
            found = await self._take_handed_over(calls, free)
        except (RedisError, OSError) as error:
            log.warning("could not take up hand-overs; retrying at the next tick: %s", error, extra=self._where())
            return
        self._hand_out(handler, calls, found)

    async def _take_handed_over(self, calls: _Writer, count: int) -> list[Message]:
        """Up to ``count`` entries of the own PEL (its first ``LEASE_BATCH``) that are neither in flight nor failed
        here (or failed here and handed back since) nor perhaps delivered by the read on its way: the ones
        ``strategy: Reassign`` handed over. Taken with ``lease.lua`` (which leaves alone what the pass gave to someone
        else meanwhile), then read with ``XRANGE``."""
        # Measured before the server measures idle times: an entry untouched since it failed here is idle this long.
        asked_at = asyncio.get_running_loop().time()
        pending = await raw_command(
            calls.conn, "XPENDING", self.stream, self.group, "-", "+", LEASE_BATCH, self.consumer
        )
        listed = [(text(p[0]), int(p[2]), int(p[3])) for p in pending]
        if len(listed) < LEASE_BATCH:
            # The whole PEL: what failed here and left it (requeued, dead-lettered, handed on) is forgotten.
            ids_listed = {entry_id for entry_id, _, _ in listed}
            self._failed_here = {k: v for k, v in self._failed_here.items() if k in ids_listed}

        def handed_back(entry_id: str, idle_ms: int) -> bool:
            # Read now, not before the call: one that failed while the XPENDING was out (its outcome written, so no
            # longer busy) failed after asked_at, and is not handed back.
            failed = self._failed_here.get(entry_id)
            return failed is None or idle_ms / 1000 + HAND_OVER_MARGIN <= asked_at - failed

        # Taken after the reply: an entry the read on its way delivered has been idle at most this long (give or take
        # the server's whole milliseconds), delivered once. Taking it would run it twice: here, and when the read's
        # reply is handed out (or after its ACK, which XRANGE does not see). A hand-over raises the count (Reassign's
        # RETRYCOUNT) and is taken at once; one whose count a shutdown's give-back had lowered to 0, like an entry
        # whose read's reply was lost, is taken once it is older than the read on its way.
        since_read_ms = (
            -1.0 if self._read_sent_at is None else (asyncio.get_running_loop().time() - self._read_sent_at) * 1000 + 1
        )

        def perhaps_read(idle_ms: int, deliveries: int) -> bool:
            return deliveries == 1 and idle_ms <= since_read_ms

        busy = self._in_flight.keys() | self._settling | self._queued.keys()
        candidates = [
            i
            for i, idle, deliveries in listed
            if i not in busy and not perhaps_read(idle, deliveries) and handed_back(i, idle)
        ][:count]
        if not candidates:
            return []
        taken = await calls.lease(candidates)
        for entry_id in taken:
            self._failed_here.pop(entry_id, None)
        if not taken:
            return []
        pipe = calls.conn.pipeline(transaction=False)
        for entry_id in taken:
            queue_raw(pipe, "XRANGE", self.stream, entry_id, entry_id)
        ranges = await pipe.execute()
        # An entry deleted while pending has no payload: the operator's pass drops it.
        return _messages([entry for found in ranges for entry in range_entries(found)], self._partition)

    # Dispatch: the only place that acknowledges

    def _start(self, handler: Handler, calls: _Writer, message: Message, started: float) -> None:
        if self._fresh is not None and not self._fresh():
            log.warning(
                "no membership heartbeat answered within the ttl: the partition may be another's", extra=self._where()
            )
            self._abort()
        if self._aborted:
            return
        self._in_flight[message.id] = started
        self._meter.started()
        self._tasks[message.id] = asyncio.create_task(self._dispatch(handler, calls, message, started))

    def _cancel(self, tasks: Iterable[asyncio.Task[None]]) -> None:
        self._cancelling = True
        for task in tasks:
            task.cancel()

    async def _dispatch(self, handler: Handler, calls: _Writer, message: Message, started: float) -> None:
        # A done message lands once its XACK is answered, after its task ended (its slot freed for the next read).
        acking = False
        try:
            try:
                with processing(self, message) as run:
                    outcome = await handler(message)
                    if not isinstance(outcome, Outcome):
                        raise TypeError(f"the handler returned {outcome!r}, not an Outcome")
                    run.ended(outcome)
            except BaseException as error:
                if _cancelled_by_the_worker() or self._aborted:
                    # The grace ran out and the entry is given back: whatever the handler made of its cancellation
                    # is not written.
                    if isinstance(error, asyncio.CancelledError):
                        raise
                    return
                # Whatever else the handler raised is a failure of the message, a CancelledError of its own
                # included. KeyboardInterrupt and SystemExit are recorded as the message's failure, then go on
                # stopping the process.
                self._settle(message.id)
                await self._fail(calls, message.id, error, self._since(started))
                if isinstance(error, (KeyboardInterrupt, SystemExit)):
                    # Retrieved once it ends: it has stopped the loop already.
                    task = asyncio.current_task()
                    if task is not None:
                        task.add_done_callback(lambda ended: ended.exception())
                    raise
                return
            if self._aborted or (self._cancelling and _cancelled_by_the_worker()):
                # The handler swallowed the cancellation at the end of the grace, or the partition was lost: its
                # outcome is not written.
                return
            self._settle(message.id)
            ran = self._since(started)
            if outcome.kind == "done":
                self._ack(calls, message, ran)
                acking = True
            elif outcome.kind == "terminal":
                await self._ack_terminal(calls, message.id, str(outcome.reason), ran)
            else:
                await self._give_back_for_retry(calls, message.id, ran)
        finally:
            self._in_flight.pop(message.id, None)
            if not acking:
                self._land(message.id)
            self._tasks.pop(message.id, None)
            self._wake.set()

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    @staticmethod
    def _since(started: float) -> float:
        """The seconds since ``started`` (loop time): how long a handler ran."""
        return asyncio.get_running_loop().time() - started

    def _count(self, ended: Ended, seconds: float, error: BaseException | None = None) -> None:
        """Counts a handler run that took ``seconds`` as ``ended``, in the stats and their metrics (``error``: what
        the handler raised)."""
        self._counts[ended] += 1
        self._meter.ended(ended, seconds, error)

    def _settle(self, entry_id: str) -> None:
        """The handler has ended: the entry's outcome is being written."""
        self._in_flight.pop(entry_id, None)
        self._settling.add(entry_id)

    def _land(self, entry_id: str) -> None:
        """The entry's outcome is written (or left to the pass): out of flight."""
        self._settling.discard(entry_id)
        self._meter.landed()

    def _ack(self, calls: _Writer, message: Message, ran: float) -> None:
        """Queues the entry's XACK; it is counted, and lands, once the XACK is answered."""
        # A message that failed before (here, or elsewhere before it was requeued) may have a last error to remove.
        recorded = message.id in self._errors_recorded or message.field(DELIVERIES_FIELD) is not None
        self._errors_recorded.discard(message.id)

        def written(failure: BaseException | None) -> None:
            if failure is None:
                self._count("done", ran)
            else:
                self._ack_failed("XACK", message.id, failure, ran)
            self._land(message.id)

        calls.queue_ack(message.id, recorded, written)

    async def _ack_terminal(self, calls: _Writer, entry_id: str, reason: str, ran: float) -> None:
        log.warning(
            "message ended as terminal: stream=%s group=%s entry_id=%s reason=%s",
            self.stream,
            self.group,
            entry_id,
            reason,
            extra={**self._where(), "entry_id": entry_id, "reason": reason},
        )
        self._errors_recorded.discard(entry_id)
        try:
            await calls.terminal_ack(entry_id, reason)
        except RedisError as error:
            self._ack_failed("terminal ACK", entry_id, error, ran)
            return
        self._count("terminal", ran)

    def _ack_failed(self, what: str, entry_id: str, error: BaseException, ran: float) -> None:
        if isinstance(error, ResponseError):
            log.warning("%s of %s refused; the message stays pending: %s", what, entry_id, error, extra=self._where())
        else:
            log.warning(
                "%s of %s: outcome unknown (%s), it may have been written or the message stays pending: %s",
                what,
                entry_id,
                type(error).__name__,
                error,
                extra=self._where(),
            )
        # Left pending for the pass: this worker takes it up again only once it is handed back.
        self._failed_here[entry_id] = asyncio.get_running_loop().time()
        self._count("failed", ran)

    async def _give_back_for_retry(self, calls: _Writer, entry_id: str, ran: float) -> None:
        # Not read again here: the give-back makes it look idle, not handed over, and the pass retries it.
        # It looks untouched since `idle` ago: a hand-over back to this worker (the only live one) may come within a
        # second, and is told by its idle all the same.
        # After any lease that gathered the entry while its handler ran (see _leasing).
        async with self._leasing:
            idle = self._settings.min_idle_ms if self._settings else UNPUBLISHED_IDLE_MS
            self._failed_here[entry_id] = asyncio.get_running_loop().time() - idle / 1000
            try:
                await calls.give_back([entry_id], idle, uncount=False)
            except RedisError as error:
                log.warning(
                    "could not give %s back for a retry: it is retried after minIdle: %s", entry_id, error,
                    extra=self._where(),
                )  # fmt: skip
                # Not given back: untouched since it failed here, never since `idle` ago.
                self._failed_here[entry_id] = asyncio.get_running_loop().time()
        self._count("retried", ran)

    async def _fail(self, calls: _Writer, entry_id: str, error: BaseException, ran: float) -> None:
        # One line per failure, never a stack trace: a store outage fails every message.
        log.warning(
            "handler failed on %s (%s: %s); the message stays pending for the operator's retry",
            entry_id,
            type(error).__name__,
            error,
            extra={**self._where(), "entry_id": entry_id},
        )
        self._failed_here[entry_id] = asyncio.get_running_loop().time()
        self._count("failed", ran, error)
        try:
            await calls.record_error(entry_id, error_text(error))
        except RedisError as failure:
            log.warning("could not record the last error of %s: %s", entry_id, failure, extra=self._where())
            return
        # A requeued message comes back under a new id, so an old id may never be ACKed here: bounded, not growing.
        if len(self._errors_recorded) >= ERRORS_REMEMBERED:
            self._errors_recorded.clear()
        self._errors_recorded.add(entry_id)

    # Leases

    def _failed_at_reply(self, ids: list[str], sent: float, answered: float) -> None:
        """A handler that failed while the lease of ``ids`` was on its way (a paused server answers late): the lease
        may have reset the entry's idle time after the failure, so the entry looks untouched since ``answered``, not
        since it failed; else the own-PEL check would take it for a hand-over and run it again here. (A retry's time
        is set back by ``min_idle``: its give-back waits for the reply of a lease that gathered it, see
        ``_leasing``.)"""
        for entry_id in ids:
            failed = self._failed_here.get(entry_id)
            if failed is not None and failed >= sent:
                self._failed_here[entry_id] = answered

    async def _hold_leases(self, handler: Handler, calls: _Writer) -> None:
        """Every tick until the shutdown is over: re-read the settings, extend the lease of every entry in flight for
        less than ``max_handling`` (the call is the worker's heartbeat, made also with no ids), then take up the
        hand-overs. The loop ends by ``_done``: a cancellation can be lost inside a redis-py call on Python 3.11."""
        loop = asyncio.get_running_loop()
        overdue: set[str] = set()
        # Ids a lease did not extend at the last tick: an entry ACKed while the lease was on its way is missed once,
        # one the pass took is missed at every tick.
        missed: set[str] = set()
        lost: set[str] = set()
        while not await self._wait(self._done, lease_interval(self._settings)):
            try:
                await self._read_settings(calls.conn)
            except ContractVersionError as error:
                if self._fatal is None:
                    log.error("%s; shutting down", error, extra=self._where())
                    self._fatal = error
                    self._request_stop()
            except (RedisError, OSError) as error:
                log.warning("could not re-read the group's settings: %s", error, extra=self._where())
            # Gathered, leased and the own PEL looked at before a retry gives back an entry (see _leasing).
            async with self._leasing:
                now = loop.time()
                held = dict(self._in_flight)
                overdue &= held.keys()
                lost &= held.keys()
                ids = list(self._queued)
                for entry_id, since in held.items():
                    if now - since < self.max_handling:
                        ids.append(entry_id)
                    elif entry_id not in overdue:
                        overdue.add(entry_id)
                        log.warning(
                            "handler of %s still running after max_handling (%.0f s): its lease is no longer extended, "
                            "and the operator's pass may retry the message",
                            entry_id,
                            self.max_handling,
                            extra=self._where(),
                        )
                sent = loop.time()
                try:
                    extended = set(await calls.lease(ids))
                except (RedisError, OSError) as error:
                    log.warning("could not extend the leases; retrying: %s", error, extra=self._where())
                    continue
                finally:
                    self._failed_at_reply(ids, sent, loop.time())
                now_missed = {i for i in ids if i not in extended and i in self._in_flight}
                for entry_id in now_missed & missed - lost:
                    lost.add(entry_id)
                    log.warning(
                        "%s is no longer this consumer's (the operator's pass took it) while its handler runs",
                        entry_id,
                        extra=self._where(),
                    )
                missed = now_missed
                await self._take_up(handler, calls)

    # Shutdown

    async def _shut_down(self, calls: _Writer, unhandled: list[str]) -> None:
        """Lets handlers finish within the grace (the leases go on), then gives back what is left, uncounted. The
        give-back runs also when nothing is left: it deletes the consumer once it owns nothing, so that
        ``strategy: Reassign`` never hands work to a worker that left."""
        left = [*unhandled, *self._queued]
        self._queued.clear()
        if self._aborted:
            if self._tasks:
                await asyncio.wait(set(self._tasks.values()), timeout=CANCEL_WAIT)
            return
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks.values()), timeout=self.shutdown_grace)
            if pending:
                left += list(self._in_flight)
                self._cancel(pending)
                # A handler that swallows its cancellation is not waited for: the give-back leaves it nothing to ACK.
                await asyncio.wait(pending, timeout=CANCEL_WAIT)
        # What finished is acknowledged before the give-back, which deletes the consumer only once it owns nothing.
        await calls.flushed()
        idle = self._settings.retry_after_ms if self._settings else UNPUBLISHED_IDLE_MS
        try:
            given = await calls.give_back(left, idle, uncount=True)
        except RedisError as error:
            log.warning(
                "shutdown: could not give back %d messages: they are retried after minIdle: %s",
                len(left),
                error,
                extra=self._where(),
            )
            return
        log.info(
            "shutdown: %d messages given back for the next pass (not finished within the grace, or read and not "
            "started), their delivery not counted",
            given,
            extra=self._where(),
        )
        # Only what the give-back released: an entry acknowledged (or taken by the pass) meanwhile was not.
        self._counts["abandoned"] += given
        self._meter.abandoned(given)

    # Helpers

    def _request_stop(self) -> None:
        self._stop.set()
        self._wake.set()

    async def _sleep(self, seconds: float) -> None:
        """Sleeps, or less when the worker is stopped."""
        await self._wait(self._stop, seconds)

    @staticmethod
    async def _wait(event: asyncio.Event, seconds: float) -> bool:
        """Waits up to ``seconds`` for ``event``; answers whether it is set."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await event.wait()
        return event.is_set()

    def _where(self) -> dict[str, Any]:
        return {"stream": self.stream, "group": self.group, "consumer": self.consumer}


class _Writer:
    """The calls on the writer's connection: the contract's scripts (each by ``EVALSHA``, loaded again on
    ``NOSCRIPT``) and the ACKs, batched."""

    def __init__(self, conn: Client, stream: str, group: str, consumer: str) -> None:
        self.conn = conn
        self._stream, self._group, self._consumer = stream, group, consumer
        self._errors = errors_key(stream, group)
        self._consumers = consumers_key(stream, group)
        self._lease: AsyncScript = conn.register_script(script_source("lease"))
        self._give_back: AsyncScript = conn.register_script(script_source("give_back"))
        self._terminal_ack: AsyncScript = conn.register_script(script_source("terminal_ack"))
        self._acks: list[_Ack] = []
        #: The read loop reads again soon without blocking: that read carries the acknowledgements queued meanwhile
        #: (one round trip for both, as a hand-written loop's). Otherwise the flusher writes them.
        self.carried = False
        self.flusher: asyncio.Task[None] | None = None

    async def ack(self, entry_id: str, clear_error: bool) -> None:
        """``XACK`` (with ``HDEL`` of the last error when ``clear_error``, in the same round trip), answered once
        written; see :meth:`queue_ack`."""
        done = asyncio.get_running_loop().create_future()

        def written(failure: BaseException | None) -> None:
            if done.done():  # its handler's task was cancelled by a shutdown
                return
            if failure is None:
                done.set_result(None)
            else:
                done.set_exception(failure)

        self.queue_ack(entry_id, clear_error, written)
        await done

    def queue_ack(self, entry_id: str, clear_error: bool, written: Callable[[BaseException | None], None]) -> None:
        """Queues an ``XACK`` and calls ``written`` with its failure (``None``: written) once it is answered. The
        ACKs of messages that finish together, or while a batch is on its way, go in one ``XACK``: a round trip for
        many; while :attr:`carried`, the read loop's next read takes them along."""
        self._acks.append(_Ack(entry_id, clear_error, written))
        if not self.carried:
            self._flush_soon()

    def release(self) -> None:
        """No read comes soon (a blocking one is sent, or the loop stops): the flusher writes what waits, and from
        here on what is queued."""
        self.carried = False
        if self._acks:
            self._flush_soon()

    @property
    def waiting(self) -> bool:
        """Whether ACKs wait to be written."""
        return bool(self._acks)

    def take_acks(self) -> list[_Ack]:
        """The ACKs waiting, for a read to carry (the caller answers them with :meth:`settle`)."""
        acks, self._acks = self._acks, []
        return acks

    def queue_acks(self, pipe: Pipeline | ClusterPipeline, acks: Sequence[_Ack]) -> None:
        """Queues the ``XACK`` of ``acks`` (its reply first), and the ``HDEL`` of the last errors to clear."""
        pipe.xack(self._stream, self._group, *(ack.entry_id for ack in acks))
        cleared = [ack.entry_id for ack in acks if ack.clear_error]
        if cleared:
            pipe.hdel(self._errors, *cleared)

    @staticmethod
    def settle(acks: Iterable[_Ack], failure: BaseException | None) -> None:
        for ack in acks:
            ack.written(failure)

    async def flushed(self) -> None:
        """Waits until every ACK queued so far is answered."""
        self.release()
        while self.flusher is not None and not self.flusher.done():
            await asyncio.wait([self.flusher])

    def _flush_soon(self) -> None:
        if self.flusher is None or self.flusher.done():
            self.flusher = asyncio.create_task(self._flush())

    async def _flush(self) -> None:
        while self._acks:
            batch = self.take_acks()
            failure: BaseException | None = None
            try:
                if not any(ack.clear_error for ack in batch):
                    await self.conn.xack(self._stream, self._group, *(ack.entry_id for ack in batch))  # no pipeline
                else:
                    pipe = self.conn.pipeline(transaction=False)
                    self.queue_acks(pipe, batch)
                    await pipe.execute()
            except Exception as error:  # whatever the client raised: every ACK of the batch is answered
                failure = error
            self.settle(batch, failure)

    async def lease(self, ids: Sequence[str]) -> list[str]:
        """Extends (or takes up) ``ids``; answers those still this consumer's. Called also without ids: it writes
        the worker's heartbeat in the group's consumers hash."""
        extended: list[str] = []
        for start in range(0, max(len(ids), 1), LEASE_BATCH):
            batch = ids[start : start + LEASE_BATCH]
            reply = await self._lease(keys=[self._stream, self._consumers], args=[self._group, self._consumer, *batch])
            extended.extend(text(i) for i in reply)
        return extended

    async def give_back(self, ids: Sequence[str], idle_ms: int, *, uncount: bool) -> int:
        """Gives ``ids`` back to the operator's pass; answers how many were still this consumer's. With ``uncount``
        the worker is leaving: called once even without ids, so that its consumer is deleted once it owns nothing."""
        given = 0
        for start in range(0, max(len(ids), 1), LEASE_BATCH):
            batch = ids[start : start + LEASE_BATCH]
            args: list[str | int] = [self._group, self._consumer, idle_ms, int(uncount), *batch]
            given += int(await self._give_back(keys=[self._stream], args=args))
        return given

    async def terminal_ack(self, entry_id: str, reason: str) -> bool:
        """Acknowledges and counts under ``reason`` once; ``False`` when the entry was no longer pending."""
        keys = [self._stream, terminal_key(self._stream, self._group), self._errors]
        return int(await self._terminal_ack(keys=keys, args=[self._group, entry_id, reason])) == 1

    async def record_error(self, entry_id: str, text: str) -> None:
        await self.conn.hset(self._errors, entry_id, text)


class _Ack(NamedTuple):
    """An ``XACK`` queued: the entry, whether its last error is cleared with it, and who is told once answered."""

    entry_id: str
    clear_error: bool
    written: Callable[[BaseException | None], None]


def _cancelled_by_the_worker() -> bool:
    """Whether the running task was asked to cancel (``Task.cancel``): the worker's own cancellation at the end of
    the grace, rather than a ``CancelledError`` the handler raised of its own."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _messages(found: Iterable[tuple[str, list[tuple[bytes, bytes]] | None]], partition: int | None) -> list[Message]:
    # An entry without fields (its payload was deleted) is not a message: the pass drops it.
    return [Message(entry_id, fields, partition) for entry_id, fields in found if fields is not None]


class Runnable(Protocol):
    """What :func:`run_until_signal` runs: a :class:`Worker` or a :class:`~pelican_worker.TopicWorker`."""

    async def run(self, handler: Handler, stop: asyncio.Event | None = None) -> WorkerStats: ...


async def run_until_signal(
    worker: Runnable,
    handler: Handler,
    signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
) -> WorkerStats:
    """Runs ``worker`` (a :class:`Worker` or a topic's) until SIGTERM or SIGINT (Unix; from the main thread), then
    shuts it down gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        return await worker.run(handler, stop)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
