"""A topic's worker (``contract/README.md``, "Topics (contract version 2)"): a member of the topic's group that owns
the partitions ``membership.lua`` assigns it and runs a worker on each, its pending list taken over first.

Released partitions are finished and given back as on SIGTERM, then said released at once; lost ones are dropped at
once, no outcome written. On an ``ordering: PerKey`` topic each partition runs in order per key
(:mod:`pelican_worker.in_order`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from pelican_worker._redis import Client, RedisSource, make_client, raw_command, text
from pelican_worker._scripts import script_source
from pelican_worker.in_order import InOrderPartition, Spacing
from pelican_worker.keys import epochs_key, members_key, owners_key, partition_stream, settings_key
from pelican_worker.settings import ContractVersionError, _fields
from pelican_worker.topic import NotATopic, topic_partitions
from pelican_worker.worker import CANCEL_WAIT, Handler, Worker, WorkerStats, default_consumer_name

__all__ = ["DEFAULT_MEMBERSHIP_TTL", "Ordering", "OrderingError", "TopicWorker"]

log = logging.getLogger("pelican_worker")

#: How long a membership lives without a heartbeat unless the application says otherwise (seconds).
DEFAULT_MEMBERSHIP_TTL = 10.0
#: The shortest and the longest membership ttl (seconds), as ``membership.lua`` takes it.
MEMBERSHIP_TTL_RANGE = (1.0, 86_400.0)
#: The most entries one ``XAUTOCLAIM`` of a take-over moves.
TAKE_OVER_BATCH = 100


class Ordering(enum.StrEnum):
    """How a topic's entries are handled: its settings' ``ordering``."""

    #: As on a stream: up to the concurrency at once, retried by the operator's pass.
    NONE = "None"
    #: The entries of one key run one at a time, in id order; a failure runs again in place.
    PER_KEY = "PerKey"


class OrderingError(Exception):
    """The topic's settings name an ordering this library does not know."""

    def __init__(self, topic: str, ordering: str) -> None:
        self.topic, self.ordering = topic, ordering
        super().__init__(
            f"topic {topic!r} has ordering {ordering!r}, which this library does not know (None, PerKey): "
            "upgrade the library (pip install --upgrade pelican-worker)"
        )


@dataclass(eq=False)
class _Owned:
    """A partition's worker while it runs."""

    partition: int
    epoch: int
    stop: asyncio.Event = field(default_factory=asyncio.Event)  # as on SIGTERM: finish within the grace
    releasing: bool = False
    lost: bool = False
    task: asyncio.Task[WorkerStats] | None = None
    # Stops the running worker at once, nothing written (set once it runs; before, the task is cancelled).
    abort_runner: Callable[[], None] | None = None

    def abort(self) -> None:
        self.lost = True
        if self.abort_runner is not None:
            self.abort_runner()
        elif self.task is not None:
            self.task.cancel()


async def take_over(conn: Client, stream: str, group: str, consumer: str) -> None:
    """Moves the partition's whole pending list to ``consumer`` (``XAUTOCLAIM ... 0 ... JUSTID``, a page at a time
    from the cursor it answers): the previous owner's entries, the member's own from before, those given back without
    an owner. The first read of the own pending list then hands them out in id order, each counted as one delivery
    there (``JUSTID`` counts none): deliveries 2 for an entry the previous owner had, not 3."""
    cursor = "0-0"
    while True:
        reply = await raw_command(
            conn, "XAUTOCLAIM", stream, group, consumer, 0, cursor, "COUNT", TAKE_OVER_BATCH, "JUSTID"
        )  # fmt: skip
        cursor = text(reply[0])
        if cursor == "0-0":
            return


class TopicWorker:
    """A member of topic ``topic``'s group ``group``, named ``member`` (the consumer on every partition it owns;
    default the Pod's name). Made by :meth:`connect`; :meth:`run` runs it.

    ``membership_ttl``: how long the membership lives without a heartbeat (1 s .. 1 day; a heartbeat every third of
    it). A worker whose heartbeats go unanswered that long stops every partition it had: keep it well above the
    pauses the application can have. ``concurrency`` and the other options are each partition's, as for
    :class:`~pelican_worker.Worker`.
    """

    def __init__(
        self,
        redis: RedisSource,
        topic: str,
        group: str,
        member: str,
        *,
        partitions: int,
        ordering: Ordering,
        spacing: Spacing,
        membership_ttl: float,
        worker_options: dict[str, Any],
    ) -> None:
        self.topic, self.group, self.member = topic, group, member
        self.partitions, self.ordering, self.membership_ttl = partitions, ordering, membership_ttl
        self._redis, self._spacing, self._options = redis, spacing, worker_options
        # When the last answered heartbeat was sent (loop time): past the ttl, no partition starts a message.
        self._beat_at: float | None = None
        self._running = False

    @classmethod
    async def connect(
        cls,
        redis: RedisSource,
        topic: str,
        group: str,
        member: str | None = None,
        *,
        membership_ttl: float = DEFAULT_MEMBERSHIP_TTL,
        concurrency: int = 16,
        block: float = 1.0,
        shutdown_grace: float = 20.0,
        max_handling: float = 1800.0,
    ) -> TopicWorker:
        """Checks the options and reads the topic's settings (``{T}:pelican:T:<group>:settings``),
        ``contractVersion`` first. Refuses, naming what is wrong: :class:`~pelican_worker.NotATopic` (no policy with
        ``spec.partitions``), :class:`~pelican_worker.TopicContractError` (another contract),
        :class:`OrderingError`, ``ValueError`` for a ``membership_ttl`` out of range."""
        low, high = MEMBERSHIP_TTL_RANGE
        if not low <= membership_ttl <= high:
            raise ValueError(f"membership_ttl must be 1 s .. 1 day (86400 s), got {membership_ttl!r}")
        options: dict[str, Any] = {
            "concurrency": concurrency,
            "block": block,
            "shutdown_grace": shutdown_grace,
            "max_handling": max_handling,
        }
        member = member or default_consumer_name()
        Worker(redis, topic, group, member, **options)  # checks the options every partition's worker takes
        client = make_client(redis, socket_timeout=10.0, resend=True)
        try:
            settings = _fields(await raw_command(client, "HGETALL", settings_key(topic, group)))
        finally:
            await client.aclose()
        if not settings:
            raise NotATopic(topic, group)
        partitions = topic_partitions(topic, group, settings)
        ordering_text = settings.get("ordering", Ordering.NONE.value)
        try:
            ordering = Ordering(ordering_text)
        except ValueError:
            raise OrderingError(topic, ordering_text) from None
        spacing = Spacing(
            factor=max(_number(settings.get("backoffFactor"), 1.0), 1.0),
            max_ms=int(_number(settings.get("backoffMaxMs"), 0.0)),
        )
        return cls(
            redis, topic, group, member, partitions=partitions, ordering=ordering, spacing=spacing,
            membership_ttl=membership_ttl, worker_options=options,
        )  # fmt: skip

    def _fresh(self) -> bool:
        """Whether the last answered heartbeat was sent less than the ttl ago (by this process' monotonic clock)."""
        at = self._beat_at
        return at is not None and asyncio.get_running_loop().time() - at < self.membership_ttl

    async def run(self, handler: Handler, stop: asyncio.Event | None = None) -> WorkerStats:
        """Joins the group, heartbeats every ``membership_ttl / 3`` and runs a worker on each partition it owns,
        until ``stop`` is set; then stops them all as a :class:`~pelican_worker.Worker` stops (handlers finish within
        the grace, the rest is given back) and leaves the group. Answers every partition's stats summed.

        Raises the server's error when the first heartbeat fails (``PELICAN_TOO_MANY_MEMBERS`` included), and
        :class:`~pelican_worker.ContractVersionError` when the settings change to a contract this library does not
        know (after the shutdown).
        """
        if self._running:
            raise RuntimeError("this topic worker is already running")
        self._running, self._beat_at = True, None
        loop = asyncio.get_running_loop()
        client = make_client(self._redis, socket_timeout=10.0, resend=True)
        membership = client.register_script(script_source("membership"))
        stopping = asyncio.Event()
        beat_now = asyncio.Event()  # a partition was released: said at once
        owned: dict[int, _Owned] = {}
        released: list[int] = []
        totals: dict[str, int] = {}
        fatal: list[ContractVersionError] = []
        # Every partition's worker not yet ended, lost ones included.
        every: dict[asyncio.Task[WorkerStats], _Owned] = {}

        def ended(run: _Owned, task: asyncio.Task[WorkerStats]) -> None:
            every.pop(task, None)
            error = None if task.cancelled() else task.exception()
            if not task.cancelled() and error is None:
                for name, value in vars_of(task.result()).items():
                    totals[name] = totals.get(name, 0) + value
            if owned.get(run.partition) is not run:
                return  # lost, and aborted
            del owned[run.partition]
            if isinstance(error, ContractVersionError):
                fatal.append(error)
                stopping.set()
                return
            if error is not None:
                log.warning(
                    "the worker of partition %d could not run; started again at the next heartbeat: %s",
                    run.partition,
                    error,
                    extra=self._where(),
                )
            if run.releasing:
                released.append(run.partition)
                beat_now.set()

        def follow(answer: tuple[dict[int, int], list[int]]) -> None:
            now_owned, release = answer
            for partition, run in list(owned.items()):
                if now_owned.get(partition) != run.epoch:
                    log.warning("partition %d lost: stopped at once", partition, extra=self._where())
                    run.abort()
                    del owned[partition]
            for partition, epoch in now_owned.items():
                if partition in owned:
                    continue
                run = _Owned(partition, epoch)
                run.task = asyncio.create_task(self._run_partition(client, run, handler))
                every[run.task] = run
                run.task.add_done_callback(functools.partial(ended, run))
                owned[partition] = run
                log.info("partition %d taken (epoch %d)", partition, epoch, extra=self._where())
            for partition in release:
                run_ = owned.get(partition)
                if run_ is not None and not run_.releasing:
                    log.info("releasing partition %d: its messages in flight finish first", partition,
                             extra=self._where())  # fmt: skip
                    run_.releasing = True
                    run_.stop.set()

        bridge = asyncio.create_task(_set_when(stop, stopping)) if stop is not None else None
        try:
            while not stopping.is_set():
                _raise_if_cancelled()
                sent = loop.time()
                saying, released[:] = list(released), []
                try:
                    answer = await self._heartbeat(membership, leaving=False, released=saying)
                except (RedisError, OSError) as error:
                    released[:0] = saying
                    if self._beat_at is None:
                        raise
                    log.warning("membership heartbeat failed; retrying: %s", error, extra=self._where())
                    if not self._fresh() and owned:
                        log.warning(
                            "no heartbeat answered within the ttl: the partitions may be another's, stopped at once",
                            extra=self._where(),
                        )
                        for run in owned.values():
                            run.abort()
                        owned.clear()
                else:
                    self._beat_at = sent
                    follow(answer)
                beat_now.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.membership_ttl / 3):
                        await _first_of(stopping, beat_now)
            # Every partition stops as a worker does on SIGTERM, then the member leaves.
            for run in owned.values():
                run.stop.set()
            if every:
                await asyncio.wait(set(every))
            try:
                await self._heartbeat(membership, leaving=True, released=[])
                log.info("left the topic's group", extra=self._where())
            except (RedisError, OSError) as error:
                log.warning(
                    "could not leave the group: its partitions move when the membership expires: %s",
                    error,
                    extra=self._where(),
                )
        finally:
            # Cancelled (or failed) before the partitions stopped: they are stopped as lost, nothing more written. A
            # worker's own stop, not only a cancellation: redis-py on Python 3.11 can swallow a CancelledError.
            for run in list(every.values()):
                run.abort()
            if bridge is not None:
                bridge.cancel()
            waited: set[asyncio.Task[Any]] = {*every, *([bridge] if bridge is not None else [])}
            if waited:
                await asyncio.wait(waited, timeout=CANCEL_WAIT + 1.0)
            await client.aclose()
            self._running = False
        if fatal:
            raise fatal[0]
        return WorkerStats(**totals)

    async def _heartbeat(
        self, membership: AsyncScript, *, leaving: bool, released: list[int]
    ) -> tuple[dict[int, int], list[int]]:
        """Runs ``membership.lua``: renews the membership, frees the partitions released, answers the partitions
        owned (with their epochs) and those to release."""
        keys = [members_key(self.topic, self.group), owners_key(self.topic, self.group)]
        keys.append(epochs_key(self.topic, self.group))
        args: list[str | int] = [self.member, round(self.membership_ttl * 1000), self.partitions, int(leaving)]
        args += released
        reply = await membership(keys=keys, args=args)
        owned = {int(partition): int(epoch) for partition, epoch in reply[0]}
        return owned, [int(partition) for partition in reply[1]]

    async def _run_partition(self, conn: Client, run: _Owned, handler: Handler) -> WorkerStats:
        """Takes the partition's pending list over, then runs its worker until stopped or aborted."""
        stream = partition_stream(self.topic, run.partition)
        await take_over(conn, stream, self.group, self.member)
        if self.ordering is Ordering.PER_KEY:
            options = {k: v for k, v in self._options.items() if k != "max_handling"}
            in_order = InOrderPartition(
                self._redis, stream, self.group, self.member, run.partition, spacing=self._spacing,
                fresh=self._fresh, **options,
            )  # fmt: skip
            run.abort_runner = in_order.abort
            return await in_order.run(handler, run.stop)
        worker = Worker(self._redis, stream, self.group, self.member, **self._options)
        worker._as_partition(run.partition, self._fresh)
        run.abort_runner = worker._abort
        return await worker.run(handler, run.stop)

    def _where(self) -> dict[str, Any]:
        return {"topic": self.topic, "group": self.group, "member": self.member}


def vars_of(stats: WorkerStats) -> dict[str, int]:
    """The counts of ``stats`` that add up across partitions (``in_flight`` is 0 once a partition ended)."""
    return {name: getattr(stats, name) for name in ("done", "terminal", "failed", "retried", "abandoned")}


def _number(value: str | None, default: float) -> float:
    try:
        return float(value) if value is not None else default
    except ValueError:
        return default


def _raise_if_cancelled() -> None:
    """Ends a task that was cancelled while a redis-py call swallowed the ``CancelledError`` (Python 3.11): its
    cancellation is still requested, and the loop would otherwise go on heart-beating."""
    task = asyncio.current_task()
    if task is not None and task.cancelling() > 0:
        raise asyncio.CancelledError


async def _set_when(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


async def _first_of(*events: asyncio.Event) -> None:
    """Waits until one of ``events`` is set."""
    waits = [asyncio.create_task(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
