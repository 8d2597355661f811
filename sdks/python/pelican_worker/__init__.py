"""Pelican's worker library: consume a Redis Streams group that a Pelican ``ConsumerGroupPolicy`` manages.

It implements the worker contract (version 1, and version 2's topics) in ``contract/README.md`` of the Pelican
repository.
"""

from pelican_worker.message import InvalidReason, Message, Outcome
from pelican_worker.producer import (
    IdempotenceUnsupported,
    IdempotentProducer,
    Producer,
    Published,
    PublishError,
    PublishFailed,
    PublishOutcomeUnknown,
    PublishRefused,
    PublishUnavailable,
    Refusal,
)
from pelican_worker.settings import KNOWN_CONTRACT_VERSIONS, ContractVersionError, WorkerSettings
from pelican_worker.topic import (
    IdempotentTopicProducer,
    NotATopic,
    TopicContractError,
    TopicProducer,
    TopicPublished,
    partition_of,
)
from pelican_worker.topic_worker import DEFAULT_MEMBERSHIP_TTL, Ordering, OrderingError, TopicWorker
from pelican_worker.worker import Handler, Worker, WorkerStats, default_consumer_name, run_until_signal

__version__ = "0.2.0.dev0"

__all__ = [
    "DEFAULT_MEMBERSHIP_TTL",
    "KNOWN_CONTRACT_VERSIONS",
    "ContractVersionError",
    "Handler",
    "IdempotenceUnsupported",
    "IdempotentProducer",
    "IdempotentTopicProducer",
    "InvalidReason",
    "Message",
    "NotATopic",
    "Ordering",
    "OrderingError",
    "Outcome",
    "Producer",
    "PublishError",
    "PublishFailed",
    "PublishOutcomeUnknown",
    "PublishRefused",
    "PublishUnavailable",
    "Published",
    "Refusal",
    "TopicContractError",
    "TopicProducer",
    "TopicPublished",
    "TopicWorker",
    "Worker",
    "WorkerSettings",
    "WorkerStats",
    "default_consumer_name",
    "partition_of",
    "run_until_signal",
]
