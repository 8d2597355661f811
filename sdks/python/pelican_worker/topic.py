"""Topics (``contract/README.md``, "Topics (contract version 2)"): a policy with ``spec.partitions`` makes its stream
``T`` a topic of N partition streams ``{T:0}`` .. ``{T:N-1}``, which a Redis Cluster spreads over its shards.

This module has the partition of a key and the producers of a topic; the worker is :mod:`pelican_worker.topic_worker`.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from redis.exceptions import RedisError

from pelican_worker._redis import RedisSource, make_client, raw_command
from pelican_worker._trace import Carried
from pelican_worker.keys import partition_stream, topic_key
from pelican_worker.producer import Fields, Producer, _arguments, _classify, _Idempotence
from pelican_worker.settings import _fields

__all__ = [
    "MAX_PARTITIONS",
    "TOPIC_CONTRACT_VERSION",
    "IdempotentTopicProducer",
    "NotATopic",
    "TopicContractError",
    "TopicProducer",
    "TopicPublished",
    "partition_of",
]

#: The worker contract of a topic: its description and its settings say it.
TOPIC_CONTRACT_VERSION = 2
#: The most partitions a topic has (the operator's admission refuses more).
MAX_PARTITIONS = 1024


def partition_of(key: bytes | str, partitions: int) -> int:
    """The partition of ``key`` in a topic of ``partitions``: CRC-32 (ISO-HDLC, zlib's) of its bytes (a text key: its
    UTF-8 bytes), modulo ``partitions``, as every library computes it (``contract/partitions.json``)."""
    if partitions < 1:
        raise ValueError(f"a topic has 1 or more partitions, not {partitions}")
    data = key.encode("utf-8") if isinstance(key, str) else key
    return zlib.crc32(data) % partitions


class NotATopic(Exception):
    """No policy with ``spec.partitions`` describes the topic (yet): for ``group`` when it is set (a worker), for any
    group (a producer)."""

    def __init__(self, topic: str, group: str | None = None) -> None:
        self.topic, self.group = topic, group
        if group is not None:
            text = (
                f"the settings of topic {topic!r} group {group!r} describe no topic: apply its policy with "
                "spec.partitions, or run a Worker for a stream"
            )
        else:
            text = (
                f"{topic!r} is not a topic: no policy with spec.partitions describes it (yet); apply one, or publish "
                "with a Producer if it is a plain stream"
            )
        super().__init__(text)


class TopicContractError(Exception):
    """The topic is described under a worker contract this library does not know for topics."""

    def __init__(self, topic: str, operator_version: str | None) -> None:
        self.topic, self.operator_version = topic, operator_version
        super().__init__(
            f"topic {topic!r} is described under worker contract {operator_version or 'none'}, this library knows "
            f"topics of contract {TOPIC_CONTRACT_VERSION}: upgrade the library (pip install --upgrade pelican-worker)"
        )


def topic_partitions(topic: str, group: str | None, fields: Mapping[str, str]) -> int:
    """N from a topic's description (``group`` ``None``) or settings hash, its ``contractVersion`` checked first: a
    later version may describe partitions anew."""
    version = fields.get("contractVersion")
    partitions = fields.get("partitions")
    if partitions is None and version in (None, "1"):
        raise NotATopic(topic, group)  # nothing there, or a plain stream's settings
    if version != str(TOPIC_CONTRACT_VERSION):
        raise TopicContractError(topic, version)
    if partitions is None or not partitions.isascii() or not partitions.isdigit():
        raise NotATopic(topic, group)
    if not 1 <= int(partitions) <= MAX_PARTITIONS:
        raise NotATopic(topic, group)
    return int(partitions)


@dataclass(frozen=True, slots=True)
class TopicPublished:
    """Where a message went: its partition, and its entry id in that partition's stream."""

    partition: int
    id: str


class TopicProducer:
    """Publishes into the partitions of one topic: a message with a key to the key's partition (the key its first
    field, ``pelican-key``), one without round robin (one step per message). Each partition is published to as a
    :class:`~pelican_worker.Producer` publishes to its stream (``bounded_publish.lua``): a partition's bound refuses
    as a stream's does, with the same exceptions. Made by :meth:`connect`, which reads the topic's description.
    """

    def __init__(self, producers: list[Producer], topic: str) -> None:
        self.topic = topic
        self._producers = producers
        self._next = itertools.cycle(range(len(producers)))

    @classmethod
    async def connect(cls, redis: RedisSource, topic: str, *, publish_timeout: float = 10.0) -> TopicProducer:
        """Reads the topic's description (``{T}:pelican:T:topic``) and answers its producer. Raises
        :class:`NotATopic` when no policy describes it, :class:`TopicContractError` when it is described under a
        contract this library does not know. ``publish_timeout``: a :class:`~pelican_worker.Producer`'s
        ``timeout``."""
        if not topic or "{" in topic or "}" in topic:
            raise ValueError(f"a topic's name is not empty and holds no {{ or }}: {topic!r}")
        client = make_client(redis, socket_timeout=publish_timeout, resend=False)
        try:
            description = _fields(await raw_command(client, "HGETALL", topic_key(topic)))
            partitions = topic_partitions(topic, None, description)
        except RedisError as error:
            await client.aclose()
            raise _classify(error) from error
        except Exception:
            await client.aclose()
            raise
        return cls([Producer._sharing(client, partition_stream(topic, p)) for p in range(partitions)], topic)

    @property
    def partitions(self) -> int:
        """N: the partitions ``{T:0}`` .. ``{T:N-1}``."""
        return len(self._producers)

    async def publish(self, fields: Fields, *, key: str | bytes | None = None) -> TopicPublished:
        """Adds one entry: with a ``key`` (``""`` is a key too) to the key's partition, ``pelican-key`` its first
        field, then ``fields`` in order; without one to the next partition round robin. Raises a
        :class:`~pelican_worker.PublishError`."""
        args = _arguments(fields)
        partition = next(self._next) if key is None else partition_of(key, self.partitions)
        entry_id = await self._producers[partition]._invoke(args, key=key)
        return TopicPublished(partition, entry_id)

    async def idempotent(self, producer_id: str | None = None) -> IdempotentTopicProducer:
        """This producer, its publishes idempotent under ``producer_id``, as
        :meth:`~pelican_worker.Producer.idempotent` (raises :class:`~pelican_worker.IdempotenceUnsupported`)."""
        # The check is the server's, the same for every partition.
        first = await self._producers[0].idempotent(producer_id)
        return IdempotentTopicProducer(self, first.producer_id)

    async def aclose(self) -> None:
        await self._producers[0].aclose()

    async def __aenter__(self) -> TopicProducer:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()


class IdempotentTopicProducer:
    """Publishes into a topic with ``XADD ... IDMP``, as :class:`~pelican_worker.IdempotentProducer` does into a
    stream. A message without a key goes to the partition of its message id rather than round robin, so that
    publishing it again reaches the partition that has it. It shares its producer's connection."""

    def __init__(self, producer: TopicProducer, producer_id: str) -> None:
        self.producer_id = producer_id
        self.topic = producer.topic
        self._producer = producer
        # The trace fields of publishes whose outcome was unknown, sent again by the next attempt.
        self._carried = Carried()

    @property
    def partitions(self) -> int:
        return self._producer.partitions

    async def publish(self, message_id: str, fields: Fields, *, key: str | bytes | None = None) -> TopicPublished:
        """Adds the message ``message_id`` once within the window, to the partition of ``key`` (``pelican-key`` its
        first field) or, without one, of ``message_id``; publishing it again answers the first entry's id."""
        args = _arguments(fields)
        partition = partition_of(message_id if key is None else key, self.partitions)
        idempotence = _Idempotence(self.producer_id, message_id, self._carried)
        entry_id = await self._producer._producers[partition]._invoke(args, key=key, idempotence=idempotence)
        return TopicPublished(partition, entry_id)

    async def aclose(self) -> None:
        """Closes the producer's connection (the :class:`TopicProducer` it was made from too)."""
        await self._producer.aclose()

    async def __aenter__(self) -> IdempotentTopicProducer:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()
