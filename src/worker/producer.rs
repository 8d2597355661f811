//! The producer side of a bounded stream: publish through the bounded-publish script and tell a
//! refusal (certainly not written, try again later) from an unknown outcome (may have been written).

use std::fmt;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use super::connection::{Connection, Source, Timeouts};
use redis::{Client, RedisError, RedisResult, Script, ToRedisArgs};

use super::meter::ProducerMeter;
use super::trace::{Carried, Sending};
use crate::keys::{KEY_FIELD, bounds_key, rejected_key};
use opentelemetry::KeyValue;
use tracing::warn;

/// The bounded-publish script, the same file any client can load (`KEYS = [stream, bounds, rejected]`,
/// `ARGV = field/value pairs`).
pub static BOUNDED_PUBLISH: LazyLock<Script> = LazyLock::new(|| Script::new(BOUNDED_PUBLISH_LUA));
/// Its source, for clients that load it themselves.
pub const BOUNDED_PUBLISH_LUA: &str = include_str!("../../contract/scripts/bounded_publish.lua");
/// The batch form: many entries, one backlog check (`KEYS` as above, `ARGV = n, then per entry its argument count
/// and its field/value pairs`); as many entries are added, in order, as the bound has room for.
pub static BOUNDED_PUBLISH_BATCH: LazyLock<Script> = LazyLock::new(|| Script::new(BOUNDED_PUBLISH_BATCH_LUA));
pub const BOUNDED_PUBLISH_BATCH_LUA: &str = include_str!("../../contract/scripts/bounded_publish_batch.lua");

/// Why a publish did not return an id.
#[derive(Debug)]
pub enum PublishError {
    /// The server refused the entry because a bounded group's backlog is full. Nothing was written: publish it
    /// again later, with backoff, jitter and a cap, never in a tight loop.
    Refused { group: String, backlog: u64, max: u64 },
    /// The connection broke or timed out after the call may have reached the server: the entry may or may not be
    /// in the stream. An immediate republish can duplicate it; reconcile first (look the message up by an id of
    /// your own in its fields).
    OutcomeUnknown(RedisError),
    /// The server answered with another error (a key of the wrong type, a script error, an ACL refusal): nothing
    /// was written, and publishing again will fail the same way until that is fixed.
    Failed(RedisError),
    /// Nothing was written, and publishing again may succeed: the server is a replica now (`READONLY`, after a
    /// failover: a producer on a sentinel source asks the sentinel again, and its next publish goes to the new
    /// primary), unreachable (the connection was refused: nothing was sent), loading, or busy.
    Unavailable(RedisError),
}

impl fmt::Display for PublishError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PublishError::Refused { group, backlog, max } => {
                write!(f, "refused: backlog of group {group:?} is {backlog}, its bound is {max}")
            }
            PublishError::OutcomeUnknown(e) => write!(f, "outcome unknown (may have been written): {e}"),
            PublishError::Failed(e) => write!(f, "failed (not written): {e}"),
            PublishError::Unavailable(e) => write!(f, "unavailable (not written, try again): {e}"),
        }
    }
}

impl std::error::Error for PublishError {}

/// What a batch publish wrote: the first `ids.len()` entries of the batch, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Published {
    pub ids: Vec<String>,
    /// Set when the bound had no room for the rest of the batch: those entries were certainly not written. Publish
    /// them again later, first to last, with backoff, jitter and a cap.
    pub refused: Option<Refusal>,
}

/// The bounded group with the least room when a batch was cut short.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub group: String,
    pub backlog: u64,
    pub max: u64,
}

impl PublishError {
    /// Refused or failed: the server certainly did not add the entry.
    pub fn certainly_not_written(&self) -> bool {
        !matches!(self, PublishError::OutcomeUnknown(_))
    }

    fn classify(error: RedisError) -> PublishError {
        if error.code() == Some("PELICAN_BACKLOG_FULL") {
            let detail = error.detail().unwrap_or_default();
            // `<group> <backlog> <max>`; the group name may itself hold spaces.
            let mut parts = detail.rsplitn(3, ' ');
            let (max, backlog, group) = (parts.next(), parts.next(), parts.next());
            if let (Some(Ok(max)), Some(Ok(backlog)), Some(group)) =
                (max.map(str::parse), backlog.map(str::parse), group)
            {
                return PublishError::Refused { group: group.to_string(), backlog, max };
            }
        }
        // No connection could be made (the server down, restarting, failing over): nothing was sent.
        if error.is_connection_refusal() {
            return PublishError::Unavailable(error);
        }
        // A batch that failed after its first entries were added.
        if error.is_io_error()
            || error.is_timeout()
            || error.is_connection_dropped()
            || error.code() == Some("PELICAN_PARTIAL")
        {
            PublishError::OutcomeUnknown(error)
        } else if matches!(error.code(), Some("READONLY" | "LOADING" | "MASTERDOWN" | "BUSY" | "TRYAGAIN")) {
            PublishError::Unavailable(error)
        } else {
            PublishError::Failed(error)
        }
    }
}

/// Publishes into one stream through the bounded-publish script. Cheap to clone; clones share the connection. On a
/// sentinel source a publish the server refused as a replica (`READONLY`, after a failover) or whose connection was
/// refused asks the sentinel again for the primary: the publish answers `Unavailable`, and the next one goes to the
/// primary the sentinel names now.
#[derive(Clone)]
pub struct Producer {
    conn: Arc<Mutex<Connection>>,
    source: Source,
    timeouts: Timeouts,
    stream: String,
    bounds: String,
    rejected: String,
    meter: Arc<ProducerMeter>,
}

impl Producer {
    pub async fn connect(client: &Client, stream: impl Into<String>) -> RedisResult<Producer> {
        Producer::connect_to(&Source::Server(client.clone()), stream).await
    }

    /// A producer on a server, a Redis Cluster (the stream's keys share its slot), or the primary a sentinel names
    /// when it connects.
    pub async fn connect_to(source: &Source, stream: impl Into<String>) -> RedisResult<Producer> {
        Producer::connect_with_timeout(source, stream, Duration::from_secs(10)).await
    }

    /// [`Producer::connect_to`] with how long a publish waits for its reply before it is `OutcomeUnknown` (10 s
    /// there).
    pub async fn connect_with_timeout(
        source: &Source,
        stream: impl Into<String>,
        response: Duration,
    ) -> RedisResult<Producer> {
        // A publish is never sent twice by the connection itself: whether to republish is the caller's call.
        let timeouts = Timeouts { response, retries: 0 };
        let conn = Arc::new(Mutex::new(source.connect(timeouts).await?));
        let stream = stream.into();
        Ok(Producer {
            bounds: bounds_key(&stream),
            rejected: rejected_key(&stream),
            meter: Arc::new(ProducerMeter::new(&stream)),
            stream,
            conn,
            source: source.clone(),
            timeouts,
        })
    }

    /// The current connection.
    pub(crate) fn connection(&self) -> Connection {
        self.conn.lock().expect("producer connection lock").clone()
    }

    /// Classifies a failed call; on a sentinel source, a primary that is gone or demoted is asked for again.
    async fn failed(&self, error: RedisError) -> PublishError {
        let error = PublishError::classify(error);
        if let PublishError::Unavailable(cause) = &error
            && self.source.follows_failovers()
            && (cause.is_connection_refusal() || cause.code() == Some("READONLY"))
        {
            match self.source.connect(self.timeouts).await {
                Ok(conn) => *self.conn.lock().expect("producer connection lock") = conn,
                Err(e) => {
                    warn!(stream = %self.stream, error = %e, "no primary from the sentinel yet; the next publish asks again")
                }
            }
        }
        error
    }

    /// Adds one entry (field/value pairs, in order) and returns its id.
    pub async fn publish<K: ToRedisArgs, V: ToRedisArgs>(&self, fields: &[(K, V)]) -> Result<String, PublishError> {
        self.invoke(None, None, fields, None).await
    }

    /// The same producer, its publishes made idempotent under `producer_id` (see [`IdempotentProducer`]). Fails
    /// with [`IdempotenceError::Unsupported`] on a server without `XADD ... IDMP` (before Redis 8.6, every Valkey up
    /// to 9.1): there a retried publish can duplicate, and the producer says so rather than pretend.
    pub async fn idempotent(self, producer_id: impl Into<String>) -> Result<IdempotentProducer, IdempotenceError> {
        let producer_id = producer_id.into();
        if producer_id.is_empty() {
            return Err(IdempotenceError::EmptyProducerId);
        }
        let docs: redis::Value = redis::cmd("COMMAND")
            .arg("DOCS")
            .arg("xadd")
            .query_async(&mut self.connection())
            .await
            .map_err(IdempotenceError::Redis)?;
        if !crate::command_docs::has_argument(&docs, "xadd", "IDMP") {
            return Err(IdempotenceError::Unsupported);
        }
        Ok(IdempotentProducer { producer: self, producer_id, carried: Arc::default() })
    }

    /// One call of the publish script: with IDMP's producer and message ids, and a first field before `fields`
    /// (a topic's `pelican-key`), when given; the trace context last, in a `send` span of its own. An idempotent
    /// publish (with `carried`) sends the trace fields of an earlier attempt of its message id whose outcome was
    /// unknown, and keeps its own when this one's is.
    pub(crate) async fn invoke<K: ToRedisArgs, V: ToRedisArgs>(
        &self,
        key: Option<(&str, &str)>,
        first: Option<(&str, &[u8])>,
        fields: &[(K, V)],
        carried: Option<&Carried>,
    ) -> Result<String, PublishError> {
        let earlier = key.zip(carried).and_then(|((_, message_id), carried)| carried.take(message_id));
        let sending = Sending::start(&self.stream, trace_attributes(key, first), earlier);
        let mut invocation = BOUNDED_PUBLISH.key(&self.stream);
        invocation.key(&self.bounds).key(&self.rejected);
        if let Some((producer_id, message_id)) = key {
            invocation.arg("IDMP").arg(producer_id).arg(message_id);
        }
        if let Some((field, value)) = first {
            invocation.arg(field).arg(value);
        }
        for (field, value) in fields {
            invocation.arg(field).arg(value);
        }
        for (field, value) in &sending.fields {
            invocation.arg(field).arg(value);
        }
        let result: Result<String, PublishError> = match invocation.invoke_async(&mut self.connection()).await {
            Ok(id) => Ok(id),
            Err(e) => Err(self.failed(e).await),
        };
        if let (Err(PublishError::OutcomeUnknown(_) | PublishError::Unavailable(_)), Some(((_, message_id), carried))) =
            (&result, key.zip(carried))
        {
            carried.keep(message_id, sending.fields.clone());
        }
        match &result {
            Ok(id) => {
                self.meter.sent(1);
                sending.sent(Some(id));
            }
            Err(e) => {
                self.meter.not_sent(1, e);
                sending.failed(e);
            }
        }
        result
    }

    /// Adds entries in order, with one backlog check for all of them, as many as every bounded group has room for:
    /// the first `ids.len()` were written; the rest, when `refused` is set, were not. An error concerns the whole
    /// batch, as [`Producer::publish`]'s does one entry: `OutcomeUnknown` means any prefix of the batch (none, some
    /// or all of it) may be in the stream.
    pub async fn publish_batch<E, K, V>(&self, entries: &[E]) -> Result<Published, PublishError>
    where
        E: AsRef<[(K, V)]>,
        K: ToRedisArgs,
        V: ToRedisArgs,
    {
        self.invoke_batch(entries.iter().map(|entry| (None, entry.as_ref()))).await
    }

    /// One call of the batch script: each entry with its IDMP producer and message ids, or none.
    async fn invoke_batch<'a, K, V>(
        &self,
        entries: impl ExactSizeIterator<Item = (Option<(&'a str, &'a str)>, &'a [(K, V)])>,
    ) -> Result<Published, PublishError>
    where
        K: ToRedisArgs + 'a,
        V: ToRedisArgs + 'a,
    {
        let count = entries.len();
        if count == 0 {
            return Ok(Published { ids: Vec::new(), refused: None });
        }
        // One `send` span for the batch: its context is every entry's.
        let batch = KeyValue::new("messaging.batch.message_count", count as i64);
        let sending = Sending::start(&self.stream, vec![batch], None);
        let traced = sending.fields.len() * 2;
        let mut invocation = BOUNDED_PUBLISH_BATCH.key(&self.stream);
        invocation.key(&self.bounds).key(&self.rejected).arg(entries.len());
        for (key, fields) in entries {
            match key {
                Some((producer_id, message_id)) => {
                    invocation.arg(fields.len() * 2 + traced + 3).arg("IDMP").arg(producer_id).arg(message_id);
                }
                None => {
                    invocation.arg(fields.len() * 2 + traced);
                }
            }
            for (field, value) in fields {
                invocation.arg(field).arg(value);
            }
            for (field, value) in &sending.fields {
                invocation.arg(field).arg(value);
            }
        }
        // The refusal's counts come as integers, read here as text like the group name.
        let (ids, refusal): (Vec<String>, Vec<String>) = match invocation.invoke_async(&mut self.connection()).await {
            Ok(reply) => {
                sending.sent(None);
                reply
            }
            Err(e) => {
                let e = self.failed(e).await;
                self.meter.not_sent(count, &e);
                sending.failed(&e);
                return Err(e);
            }
        };
        self.meter.sent(ids.len());
        self.meter.refused(count - ids.len());
        let refused = match refusal.as_slice() {
            [group, backlog, max] => Some(Refusal {
                group: group.clone(),
                backlog: backlog.parse().unwrap_or_default(),
                max: max.parse().unwrap_or_default(),
            }),
            _ => None,
        };
        Ok(Published { ids, refused })
    }

    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// A producer into `stream` on this one's connection (a topic's partitions share one).
    pub(crate) fn sibling(&self, stream: String) -> Producer {
        Producer {
            conn: self.conn.clone(),
            source: self.source.clone(),
            timeouts: self.timeouts,
            bounds: bounds_key(&stream),
            rejected: rejected_key(&stream),
            meter: Arc::new(ProducerMeter::new(&stream)),
            stream,
        }
    }
}

/// A publish's own attributes on its `send` span: an idempotent publish's message id, a topic's key.
fn trace_attributes(key: Option<(&str, &str)>, first: Option<(&str, &[u8])>) -> Vec<KeyValue> {
    let mut attributes = Vec::new();
    if let Some((_, message_id)) = key {
        attributes.push(KeyValue::new("pelican.message_id", message_id.to_string()));
    }
    if let Some((KEY_FIELD, value)) = first {
        attributes.push(KeyValue::new("pelican.key", String::from_utf8_lossy(value).into_owned()));
    }
    attributes
}

/// A producer whose every publish carries an idempotency key (`XADD ... IDMP <producer id> <message id>`, Redis
/// 8.6+): within the stream's window (`spec.idempotence`; the server's default 100 s and 100 message ids per
/// producer), a publish of a (producer id, message id) already published writes nothing and returns the first
/// entry's id. So a publish that ended `OutcomeUnknown` is simply published again with the same message id.
///
/// The producer id must be stable across the producer's restarts (a StatefulSet Pod's name, a service's instance
/// name), and unique among the stream's producers; the message id is the application's (an order number, an
/// upstream event's id) or derived from the payload, never random per attempt. A `Refused` publish wrote nothing
/// in this call; an earlier attempt of the same message may be in the stream, and publishing it again later returns
/// that entry's id.
#[derive(Clone)]
pub struct IdempotentProducer {
    producer: Producer,
    producer_id: String,
    /// The trace fields of publishes whose outcome was unknown, sent again by the next attempt.
    carried: Arc<Carried>,
}

impl IdempotentProducer {
    /// Adds the entry unless `message_id` was published by this producer within the window; either way returns the
    /// id of the one entry that holds it.
    pub async fn publish<K: ToRedisArgs, V: ToRedisArgs>(
        &self,
        message_id: &str,
        fields: &[(K, V)],
    ) -> Result<String, PublishError> {
        self.producer.invoke(Some((&self.producer_id, message_id)), None, fields, Some(&self.carried)).await
    }

    /// [`Producer::publish_batch`] with a message id per entry: the entries are published in order, as many as the
    /// bound has room for; an entry whose message id this producer already published (in an earlier call or earlier
    /// in this batch) writes nothing and its id is the first entry's. A batch that ended `OutcomeUnknown` is simply
    /// published again whole.
    pub async fn publish_batch<K, V>(&self, entries: &[(&str, &[(K, V)])]) -> Result<Published, PublishError>
    where
        K: ToRedisArgs,
        V: ToRedisArgs,
    {
        let producer_id = self.producer_id.as_str();
        self.producer
            .invoke_batch(entries.iter().map(|(message_id, fields)| (Some((producer_id, *message_id)), *fields)))
            .await
    }

    pub fn producer_id(&self) -> &str {
        &self.producer_id
    }

    pub fn stream(&self) -> &str {
        self.producer.stream()
    }
}

/// Why a producer cannot publish idempotently.
#[derive(Debug)]
pub enum IdempotenceError {
    /// The server has no `XADD ... IDMP` (Redis 8.6 added it; Valkey up to 9.1 has none).
    Unsupported,
    /// The producer id is empty.
    EmptyProducerId,
    /// Asking the server what it has failed (`COMMAND DOCS`; an ACL user needs `+command|docs`).
    Redis(RedisError),
}

impl fmt::Display for IdempotenceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdempotenceError::Unsupported => write!(
                f,
                "the server has no XADD ... IDMP (Redis 8.6 or later): a retried publish may duplicate; publish with \
                 Producer::publish and reconcile by an id of your own in the entry's fields"
            ),
            IdempotenceError::EmptyProducerId => {
                write!(f, "the producer id is empty: give one stable across restarts, e.g. the Pod's name")
            }
            IdempotenceError::Redis(e) => write!(f, "could not ask the server for XADD's arguments: {e}"),
        }
    }
}

impl std::error::Error for IdempotenceError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_connection_is_an_unknown_outcome() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        let error = PublishError::classify(RedisError::from(io));
        assert!(matches!(error, PublishError::OutcomeUnknown(_)), "{error:?}");
        assert!(!error.certainly_not_written());
    }

    /// Defect (issue 65.7): a publish whose connection was refused was "outcome unknown"; it was never sent.
    #[test]
    fn a_refused_connection_is_unavailable() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let error = PublishError::classify(RedisError::from(io));
        assert!(matches!(error, PublishError::Unavailable(_)), "{error:?}");
        assert!(error.certainly_not_written());
    }

    #[test]
    fn a_demoted_primary_is_unavailable_not_failed() {
        let readonly = RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly),
            "READONLY",
            "You can't write against a read only replica.".to_string(),
        ));
        let error = PublishError::classify(readonly);
        assert!(matches!(error, PublishError::Unavailable(_)), "{error:?}");
        assert!(error.certainly_not_written());
    }
}
