"""Producers of a bounded stream: publish through the contract's bounded publish scripts and tell the outcomes apart.

The connection never sends a publish twice: redis-py's default ``Retry`` re-sends a command whose reply was lost,
which writes the message twice. Whether to publish again is the caller's decision, made from the exception class.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.commands.core import AsyncScript
from redis.exceptions import BusyLoadingError, ConnectionError, ReadOnlyError, RedisError, ResponseError, TimeoutError

from pelican_worker._meter import Sent, producer_meter
from pelican_worker._redis import Client, RedisSource, command_docs, make_client, text
from pelican_worker._scripts import script_source
from pelican_worker._trace import Carried, TraceFields, start_sending
from pelican_worker.keys import KEY_FIELD, bounds_key, rejected_key
from pelican_worker.worker import default_consumer_name

__all__ = [
    "Fields",
    "IdempotenceUnsupported",
    "IdempotentProducer",
    "Producer",
    "PublishError",
    "PublishFailed",
    "PublishOutcomeUnknown",
    "PublishRefused",
    "PublishUnavailable",
    "Published",
    "Refusal",
    "Value",
]

#: A field's value, as redis-py encodes it.
Value = str | bytes | int | float
#: An entry's fields: a mapping, or field/value pairs in order (names may repeat).
Fields = Mapping[str, Value] | Mapping[bytes, Value] | Iterable[tuple[str | bytes, Value]]

# Server errors after which nothing was written and publishing again may succeed.
_UNAVAILABLE = frozenset({"READONLY", "LOADING", "MASTERDOWN", "BUSY", "TRYAGAIN"})
# redis-py turns some error codes into classes and drops the code from the text.
_CODE_OF_CLASS: tuple[tuple[type[RedisError], str], ...] = (
    (BusyLoadingError, "LOADING"),
    (ReadOnlyError, "READONLY"),
)


class PublishError(Exception):
    """Why a publish returned no id. ``certainly_not_written`` tells whether the entry is surely not in the stream."""

    certainly_not_written = True


class PublishRefused(PublishError):
    """A bounded group's backlog is full: nothing was written. Publish again later, with backoff and jitter."""

    def __init__(self, group: str, backlog: int, max: int) -> None:
        self.group, self.backlog, self.max = group, backlog, max
        super().__init__(f"refused: the backlog of group {group!r} is {backlog}, its bound is {max}")


class PublishUnavailable(PublishError):
    """The server cannot take writes now (a replica, loading, busy), or no connection could be made to it: nothing
    was written, try again."""


class PublishFailed(PublishError):
    """The server answered with another error: nothing was written, and publishing again fails until it is fixed."""


class PublishOutcomeUnknown(PublishError):
    """The connection broke or timed out after the call may have been sent: the entry may be in the stream.

    Publishing again may write it twice: reconcile first, or publish with :class:`IdempotentProducer`.
    """

    certainly_not_written = False


class IdempotenceUnsupported(Exception):
    """The server has no ``XADD ... IDMP`` (Redis 8.6 or later), or would not say."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """The bounded group with the least room when a batch was cut short."""

    group: str
    backlog: int
    max: int


@dataclass(frozen=True, slots=True)
class Published:
    """What a batch wrote: its first ``len(ids)`` entries, in order; when ``refused`` is set the rest were not."""

    ids: list[str]
    refused: Refusal | None


def _code(error: RedisError) -> str:
    for cls, code in _CODE_OF_CLASS:
        if isinstance(error, cls):
            return code
    return str(error).split(" ", 1)[0]


def _not_sent(failure: PublishError) -> Sent:
    """A failed publish's ``error.type`` in ``messaging.client.sent.messages``."""
    if isinstance(failure, PublishRefused):
        return "refused"
    if isinstance(failure, PublishUnavailable):
        return "unavailable"
    if isinstance(failure, PublishOutcomeUnknown):
        return "unknown"
    return "failed"


def _classify(error: RedisError) -> PublishError:
    code = _code(error)
    if code == "PELICAN_BACKLOG_FULL":
        # `PELICAN_BACKLOG_FULL <group> <backlog> <max>`; the group name may hold spaces.
        parts = str(error).split(" ", 1)[1].rsplit(" ", 2)
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            return PublishRefused(parts[0], int(parts[1]), int(parts[2]))
    if code in _UNAVAILABLE:
        return PublishUnavailable(str(error))
    if code == "PELICAN_PARTIAL":
        # A batch that failed after its first entries were added.
        return PublishOutcomeUnknown(str(error))
    if isinstance(error, ResponseError):
        return PublishFailed(str(error))
    if _not_connected(error):
        return PublishUnavailable(f"{type(error).__name__}: {error}")
    return PublishOutcomeUnknown(f"{type(error).__name__}: {error}")


def _not_connected(error: RedisError) -> bool:
    """Whether the connection could not be made (refused, no route, a failed TLS handshake, a connect timeout): the
    command was never sent. redis-py says so in the text, ``Error 111 connecting to <host>:<port>`` and ``Timeout
    connecting to server``; a connection that broke after the call was sent says ``reading from`` or ``closed``."""
    return isinstance(error, (ConnectionError, TimeoutError)) and "connecting to" in str(error)


def _flat(fields: TraceFields) -> list[str]:
    return [part for pair in fields for part in pair]


@dataclass(frozen=True, slots=True)
class _Idempotence:
    """An idempotent publish's ids, and where its producer keeps the trace fields of attempts whose outcome was
    unknown."""

    producer_id: str
    message_id: str
    carried: Carried


def _arguments(fields: Fields) -> list[Any]:
    pairs = fields.items() if isinstance(fields, Mapping) else fields
    flat: list[Any] = [part for pair in pairs for part in pair]
    if not flat:
        raise ValueError("an entry needs at least one field")
    return flat


class Producer:
    """Publishes into ``stream`` through ``bounded_publish.lua``.

    ``redis`` is a ``redis://`` URL or a factory of ``redis.asyncio.Redis`` clients (whatever it configures, the
    producer turns the client's retries off). ``timeout``: how long a publish waits for its reply before it is
    :class:`PublishOutcomeUnknown`.
    """

    def __init__(self, redis: RedisSource, stream: str, *, timeout: float = 10.0) -> None:
        self._bind(make_client(redis, socket_timeout=timeout, resend=False), stream)

    @classmethod
    def _sharing(cls, client: Client, stream: str) -> Producer:
        """A producer of ``stream`` on a client another owns (a topic's partitions share their producer's)."""
        producer = cls.__new__(cls)
        producer._bind(client, stream)
        return producer

    def _bind(self, client: Client, stream: str) -> None:
        self.stream = stream
        self._client = client
        self._keys = [stream, bounds_key(stream), rejected_key(stream)]
        self._meter = producer_meter(stream)
        self._publish: AsyncScript = self._client.register_script(script_source("bounded_publish"))
        self._publish_batch: AsyncScript = self._client.register_script(script_source("bounded_publish_batch"))

    async def publish(self, fields: Fields) -> str:
        """Adds one entry and returns its id; raises a :class:`PublishError`."""
        return await self._invoke(_arguments(fields))

    async def publish_batch(self, entries: Sequence[Fields]) -> Published:
        """Adds entries in order, with one backlog check for all, as many as every bounded group has room for.

        An exception concerns the whole batch: :class:`PublishOutcomeUnknown` means any prefix of it may be written.
        """
        return await self._invoke_batch([_arguments(fields) for fields in entries])

    async def idempotent(self, producer_id: str | None = None) -> IdempotentProducer:
        """This producer, its publishes made idempotent under ``producer_id`` (default: the Pod's name). Raises
        :class:`IdempotenceUnsupported` here, before anything is published, unless the server's ``XADD`` takes
        ``IDMP`` (asked with ``COMMAND DOCS XADD``: by the command's arguments, not by the server's version)."""
        producer_id = producer_id if producer_id is not None else default_consumer_name()
        if not producer_id:
            raise ValueError("the producer id is empty: give one stable across restarts, e.g. the Pod's name")
        try:
            docs = await command_docs(self._client, "XADD")
        except ResponseError as error:
            raise IdempotenceUnsupported(f"could not ask the server for XADD's arguments: {error}") from error
        except RedisError as error:
            raise _classify(error) from error
        if not _has_token(docs, "IDMP"):
            raise IdempotenceUnsupported(
                "the server has no XADD ... IDMP (Redis 8.6 or later): a retried publish may duplicate; publish "
                "with Producer and reconcile by an id of your own in the entry's fields"
            )
        return IdempotentProducer(self, producer_id)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> Producer:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def _invoke(
        self, args: list[Any], *, key: str | bytes | None = None, idempotence: _Idempotence | None = None
    ) -> str:
        """One publish: IDMP's ids first when idempotent, then the key field, ``args`` (the fields), and the trace
        context last, in a ``send`` span of its own. An idempotent publish sends the trace fields of an earlier
        attempt of its message id whose outcome was unknown or unavailable, and keeps its own when this one's is."""
        message_id = idempotence.message_id if idempotence else None
        carried = idempotence.carried.take(idempotence.message_id) if idempotence else None
        sending = start_sending(self.stream, message_id=message_id, key=key, carried=carried)
        idmp = ["IDMP", idempotence.producer_id, idempotence.message_id] if idempotence else []
        first = [KEY_FIELD, key] if key is not None else []
        try:
            entry_id = text(await self._publish(keys=self._keys, args=[*idmp, *first, *args, *_flat(sending.fields)]))
        except RedisError as error:
            failure = _classify(error)
            if idempotence and isinstance(failure, (PublishOutcomeUnknown, PublishUnavailable)):
                idempotence.carried.keep(idempotence.message_id, sending.fields)
            self._meter(_not_sent(failure), 1)
            sending.failed(failure)
            raise failure from error
        except BaseException as error:  # a cancellation: the span ends all the same
            sending.failed(error)
            raise
        self._meter("sent", 1)
        sending.sent(entry_id)
        return entry_id

    async def _invoke_batch(self, entries: list[list[Any]]) -> Published:
        """One call of the batch script, in one ``send`` span whose context every entry carries."""
        if not entries:
            return Published([], None)
        sending = start_sending(self.stream, count=len(entries))
        traced = _flat(sending.fields)
        args: list[Any] = [len(entries)]
        for entry in entries:
            args += [len(entry) + len(traced), *entry, *traced]
        try:
            ids, refusal = await self._publish_batch(keys=self._keys, args=args)
        except RedisError as error:
            failure = _classify(error)
            self._meter(_not_sent(failure), len(entries))
            sending.failed(failure)
            raise failure from error
        except BaseException as error:  # a cancellation: the span ends all the same
            sending.failed(error)
            raise
        sending.sent()
        self._meter("sent", len(ids))
        self._meter("refused", len(entries) - len(ids))
        refused = Refusal(text(refusal[0]), int(refusal[1]), int(refusal[2])) if refusal else None
        return Published([text(i) for i in ids], refused)


class IdempotentProducer:
    """A producer whose every publish carries ``IDMP <producer id> <message id>`` (Redis 8.6+), made by
    :meth:`Producer.idempotent`, which checks the server first.

    Within the stream's window, a publish of a message id this producer already published writes nothing and answers
    the first entry's id: a publish that ended :class:`PublishOutcomeUnknown` is simply published again. The producer
    id must be stable across restarts and unique among the stream's producers (default: the Pod's name); the message
    id is the application's, never random per attempt. It shares its producer's connection.
    """

    def __init__(self, producer: Producer, producer_id: str) -> None:
        self.producer_id = producer_id
        self.stream = producer.stream
        self._producer = producer
        # The trace fields of publishes whose outcome was unknown, sent again by the next attempt.
        self._carried = Carried()

    async def publish(self, message_id: str, fields: Fields) -> str:
        """Adds the entry unless this producer published ``message_id`` within the window; either way answers the
        id of the one entry that holds it."""
        idempotence = _Idempotence(self.producer_id, message_id, self._carried)
        return await self._producer._invoke(_arguments(fields), idempotence=idempotence)

    async def publish_batch(self, entries: Sequence[tuple[str, Fields]]) -> Published:
        """:meth:`Producer.publish_batch` with a message id per entry; a batch that ended
        :class:`PublishOutcomeUnknown` is simply published again whole."""
        return await self._producer._invoke_batch(
            [["IDMP", self.producer_id, message_id, *_arguments(fields)] for message_id, fields in entries]
        )

    async def aclose(self) -> None:
        """Closes the producer's connection (the :class:`Producer` it was made from too)."""
        await self._producer.aclose()

    async def __aenter__(self) -> IdempotentProducer:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()


def _has_token(reply: Any, token: str) -> bool:
    """Whether a ``COMMAND DOCS`` reply (RESP2 flat lists or RESP3 maps) has an argument of that ``token``."""
    if isinstance(reply, Mapping):
        pairs, children = list(reply.items()), list(reply.values())
    elif isinstance(reply, (list, tuple)):
        # RESP2 spells a map as a flat list: a name is followed by its value.
        pairs, children = list(itertools.pairwise(reply)), list(reply)
    else:
        return False
    if any(_is(name, "token") and _is(value, token) for name, value in pairs):
        return True
    return any(_has_token(child, token) for child in children)


def _is(value: Any, word: str) -> bool:
    return isinstance(value, (bytes, str)) and text(value).lower() == word.lower()
