//! Publishing into a topic (a policy with `spec.partitions`, contract/README.md "Topics"): each message goes to the
//! partition of its key, round robin without one, through the partition's bounded-publish script.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};

use redis::{RedisError, ToRedisArgs};

use super::connection::Source;
use super::producer::{IdempotenceError, Producer, PublishError};
use super::trace::Carried;
use crate::keys::{KEY_FIELD, TOPIC_CONTRACT_VERSION, partition_stream, topic_key};
use crate::topic::{MAX_PARTITIONS, partition_of};

/// Why a topic producer could not start.
#[derive(Debug)]
pub enum TopicError {
    /// No policy describes the topic (yet): `{T}:pelican:T:topic` has no `partitions`.
    NotATopic {
        topic: String,
    },
    /// The topic's description is of a contract version this library does not know.
    UnknownContract {
        topic: String,
        version: String,
    },
    Redis(RedisError),
}

impl fmt::Display for TopicError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TopicError::NotATopic { topic } => write!(
                f,
                "{topic:?} is not a topic: no policy with spec.partitions describes it (yet); apply one, or publish \
                 with a Producer if it is a plain stream"
            ),
            TopicError::UnknownContract { topic, version } => write!(
                f,
                "topic {topic:?} is described under worker contract {version:?}, this SDK knows topics of \
                 {TOPIC_CONTRACT_VERSION}: upgrade the SDK"
            ),
            TopicError::Redis(e) => write!(f, "could not read the topic's description: {e}"),
        }
    }
}

impl std::error::Error for TopicError {}

/// Publishes into the partitions of one topic, on one connection (a Cluster's routes each partition's call to its
/// shard). Cheap to share; the round-robin counter is the producer's own.
pub struct TopicProducer {
    topic: String,
    partitions: Vec<Producer>,
    next: AtomicU32,
}

impl TopicProducer {
    /// Reads the topic's description (its partitions) and connects.
    pub async fn connect_to(source: &Source, topic: impl Into<String>) -> Result<TopicProducer, TopicError> {
        let topic = topic.into();
        let first = Producer::connect_to(source, partition_stream(&topic, 0)).await.map_err(TopicError::Redis)?;
        let description: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(topic_key(&topic))
            .query_async(&mut first.connection())
            .await
            .map_err(TopicError::Redis)?;
        let version = description.get("contractVersion").map(String::as_str).unwrap_or_default();
        let partitions = description.get("partitions").and_then(|n| n.parse::<u32>().ok());
        let Some(partitions) = partitions.filter(|n| (1..=MAX_PARTITIONS).contains(n)) else {
            return Err(TopicError::NotATopic { topic });
        };
        if version != TOPIC_CONTRACT_VERSION.to_string() {
            return Err(TopicError::UnknownContract { topic, version: version.to_string() });
        }
        let partitions = (0..partitions).map(|i| first.sibling(partition_stream(&topic, i))).collect();
        Ok(TopicProducer { topic, partitions, next: AtomicU32::new(0) })
    }

    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// N.
    pub fn partitions(&self) -> u32 {
        self.partitions.len() as u32
    }

    /// The partition a message with `key` goes to; without a key, the next one round robin.
    pub fn partition(&self, key: Option<&[u8]>) -> u32 {
        match key {
            Some(key) => partition_of(key, self.partitions()),
            None => self.next.fetch_add(1, Ordering::Relaxed) % self.partitions(),
        }
    }

    /// Adds one entry to the partition of `key` (its first field `pelican-key`, then `fields` in order), or round
    /// robin without a key; returns the partition and the entry's id. The errors are a [`Producer`]'s, for that
    /// partition's stream: a partition's bound refuses as a stream's does.
    pub async fn publish<K: ToRedisArgs, V: ToRedisArgs>(
        &self,
        key: Option<&[u8]>,
        fields: &[(K, V)],
    ) -> Result<(u32, String), PublishError> {
        let partition = self.partition(key);
        let first = key.map(|key| (KEY_FIELD, key));
        let id = self.partitions[partition as usize].invoke(None, first, fields, None).await?;
        Ok((partition, id))
    }

    /// The same producer, its publishes idempotent under `producer_id` on each partition (`XADD ... IDMP`, Redis
    /// 8.6+), as [`Producer::idempotent`].
    pub async fn idempotent(self, producer_id: impl Into<String>) -> Result<IdempotentTopicProducer, IdempotenceError> {
        let producer_id = producer_id.into();
        // The check is the server's, the same for every partition.
        self.partitions[0].clone().idempotent(producer_id.clone()).await?;
        Ok(IdempotentTopicProducer { producer: self, producer_id, carried: Carried::default() })
    }
}

/// A topic producer whose publishes carry an idempotency key. A message without a key goes to the partition of its
/// message id rather than round robin, so that publishing it again reaches the partition that has it.
pub struct IdempotentTopicProducer {
    producer: TopicProducer,
    producer_id: String,
    /// The trace fields of publishes whose outcome was unknown, sent again by the next attempt.
    carried: Carried,
}

impl IdempotentTopicProducer {
    /// Adds the message `message_id` once within the window, to the partition of `key` (or of `message_id`).
    pub async fn publish<K: ToRedisArgs, V: ToRedisArgs>(
        &self,
        key: Option<&[u8]>,
        message_id: &str,
        fields: &[(K, V)],
    ) -> Result<(u32, String), PublishError> {
        let partition = partition_of(key.unwrap_or(message_id.as_bytes()), self.producer.partitions());
        let first = key.map(|key| (KEY_FIELD, key));
        let idmp = Some((self.producer_id.as_str(), message_id));
        let id = self.producer.partitions[partition as usize].invoke(idmp, first, fields, Some(&self.carried)).await?;
        Ok((partition, id))
    }

    pub fn topic(&self) -> &TopicProducer {
        &self.producer
    }
}
