//! One partition of an `ordering: PerKey` topic (contract/README.md, "Order per key"): entries dispatched in id order
//! into per-key queues, at most one entry of a key in flight, different keys side by side up to the concurrency. A
//! failure or a retry holds its key: the entry stays pending, this worker's, and runs again in place after the
//! backoff, its delivery counted on the server first (`XCLAIM ... RETRYCOUNT`). At the cap it is left to the
//! operator's pass (`DeadLetterOnly` on such a topic), which dead-letters it once idle; the key goes on when it left
//! the pending list.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use redis::{RedisError, RedisResult};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::{info, warn};

use super::connection::{Connection, Source, write_again_if_broken};
use super::meter::Ended;
use super::partitions::take_over;
use super::trace::Processing;
use super::{
    AbortOnDrop, BoxError, Counters, Message, Outcome, WorkerConfig, WorkerStats, ack_terminal, connections, give_back,
    lease, lease_interval, read_group, read_settings, record_error,
};
use crate::keys::{KEY_FIELD, TOPIC_CONTRACT_VERSION, WorkerSettings, errors_key};

/// How retries are spaced in place: `min_idle * factor^(n-1)`, at most `max` (the topic's `backoffFactor`,
/// `backoffMaxMs`).
#[derive(Clone, Copy, Debug)]
pub(super) struct Spacing {
    pub factor: u32,
    pub max: Option<Duration>,
}

impl Spacing {
    fn after(&self, min_idle: Duration, deliveries: u64) -> Duration {
        let exponent = i32::try_from(deliveries.saturating_sub(1)).unwrap_or(i32::MAX);
        let wait = min_idle.as_secs_f64() * f64::from(self.factor).powi(exponent);
        let wait = Duration::try_from_secs_f64(wait).unwrap_or(Duration::MAX);
        self.max.map_or(wait, |max| wait.min(max))
    }
}

/// An entry's key: its `pelican-key`, or the entry alone.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Key {
    Of(Vec<u8>),
    Alone(String),
}

/// An entry held by this worker: read, and not yet done, terminal or dead-lettered.
struct Held {
    message: Message,
    /// It failed here: its next run counts a delivery first.
    failed: bool,
    /// At the cap: no longer leased, left to the pass.
    capped: bool,
}

/// How one run ended.
enum Ran {
    /// The handler's result (a panic's text as the `Err`), and how long it ran.
    Handled(Result<Result<Outcome, BoxError>, String>, Duration),
    /// The entry was no longer this worker's when its run was to count a delivery.
    Gone,
    /// Its delivery could not be counted (the server failed or refused the call): not run, tried again later.
    NotCounted(RedisError),
}

/// The most entries held at once per unit of concurrency: read ahead so that keys behind a slow one still run.
const HELD_PER_SLOT: usize = 4;

/// Takes the partition's pending list over, then runs it in order per key until `stop`.
pub(super) async fn run_in_order<H, Fut>(
    source: Source,
    config: WorkerConfig,
    spacing: Spacing,
    handler: Arc<H>,
    stop: watch::Receiver<bool>,
) -> RedisResult<WorkerStats>
where
    H: Fn(Message) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Outcome, BoxError>> + Send + 'static,
{
    let (reader, mut writer) = connections(&source, &config).await?;
    take_over(&mut writer, &config).await?;
    let settings = read_settings(&mut writer, &config, TOPIC_CONTRACT_VERSION).await?.ok().flatten();
    let Some(settings) = settings else {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "the partition has no settings of the topic's contract",
            config.stream.clone(),
        )));
    };
    let counters = Counters::new(&config, TOPIC_CONTRACT_VERSION);
    let concurrency = config.concurrency.max(1);
    let room = Arc::new(Semaphore::new(concurrency * HELD_PER_SLOT));
    let (read_tx, mut read_rx) = mpsc::channel::<Vec<Message>>(1);
    let reading = AbortOnDrop(tokio::spawn(read(reader, config.clone(), room.clone(), read_tx)));
    let mut queues: HashMap<Key, VecDeque<Held>> = HashMap::new();
    let mut ready: VecDeque<Key> = VecDeque::new();
    let mut waiting: Vec<(Instant, Key)> = Vec::new();
    let mut running: JoinSet<(Key, Ran)> = JoinSet::new();
    let min_idle = Duration::from_millis(settings.min_idle_ms);
    let mut lease_tick = tokio::time::interval(lease_interval(Some(settings)));
    let stopped = async move {
        let mut stop = stop;
        let _ = stop.wait_for(|stopped| *stopped).await;
    };
    tokio::pin!(stopped);
    loop {
        while running.len() < concurrency
            && let Some(key) = ready.pop_front()
        {
            let head = queues.get(&key).and_then(VecDeque::front).expect("a ready key has a head");
            let (message, rerun) = (head.message.clone(), head.failed);
            let (conn, config, handler) = (writer.clone(), config.clone(), handler.clone());
            counters.meter.started();
            running.spawn(async move {
                if rerun {
                    match count_delivery(conn, &config, &message.id).await {
                        Ok(true) => {}
                        Ok(false) => return (key, Ran::Gone),
                        Err(e) => return (key, Ran::NotCounted(e)),
                    }
                }
                let processing =
                    Processing { stream: &config.stream, group: &config.group, consumer: &config.consumer };
                let started = Instant::now();
                let result = processing.run(handler.as_ref(), message).await.map_err(|panic| {
                    let what = panic.downcast_ref::<String>().map(String::as_str);
                    what.or_else(|| panic.downcast_ref::<&str>().copied()).unwrap_or("a panic").to_string()
                });
                (key, Ran::Handled(result, started.elapsed()))
            });
        }
        let due = waiting.iter().map(|(at, _)| *at).min();
        tokio::select! {
            _ = &mut stopped => break,
            Some(read) = read_rx.recv() => {
                for message in read {
                    let key = match message.field(KEY_FIELD) {
                        Some(key) => Key::Of(key.to_vec()),
                        None => Key::Alone(message.id.clone()),
                    };
                    let queue = queues.entry(key.clone()).or_default();
                    if queue.is_empty() {
                        ready.push_back(key);
                    }
                    queue.push_back(Held { message, failed: false, capped: false });
                }
            }
            Some(ended) = running.join_next(), if !running.is_empty() => {
                let (key, ran) = ended.expect("runs are never aborted while the loop runs");
                let outcome = settle(&mut writer, &config, &counters, &settings, &mut queues, &key, ran).await;
                match outcome {
                    Next::Go => {
                        room.add_permits(1);
                        if queues.get(&key).is_some_and(|q| !q.is_empty()) {
                            ready.push_back(key);
                        } else {
                            queues.remove(&key);
                        }
                    }
                    Next::Wait(deliveries) => waiting.push((Instant::now() + spacing.after(min_idle, deliveries), key)),
                    Next::Capped => {}
                }
            }
            _ = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => {
                let now = Instant::now();
                waiting.retain(|(at, key)| if *at <= now { ready.push_back(key.clone()); false } else { true });
            }
            _ = lease_tick.tick() => {
                hold(&mut writer, &config, &mut queues, &mut ready, &room).await;
            }
        }
    }
    // Handlers running finish within the grace and their outcomes are written; everything else held is given back
    // uncounted, its key's order kept for the next owner (it takes the pending list in id order).
    let finish = async {
        while let Some(Ok((key, ran))) = running.join_next().await {
            let _ = settle(&mut writer, &config, &counters, &settings, &mut queues, &key, ran).await;
        }
    };
    if tokio::time::timeout(config.shutdown_grace, finish).await.is_err() {
        counters.meter.landed(running.len());
        running.abort_all();
    }
    drop(reading);
    while let Ok(read) = read_rx.try_recv() {
        for message in read {
            queues.entry(Key::Alone(message.id.clone())).or_default().push_back(Held {
                message,
                failed: false,
                capped: false,
            });
        }
    }
    let left: Vec<String> =
        queues.values().flatten().filter(|held| !held.capped).map(|held| held.message.id.clone()).collect();
    let given = give_back(&mut writer, &config, &left, settings.retry_after_ms, false).await;
    let abandoned = match given {
        Ok(given) => given.max(0) as u64,
        Err(e) => {
            warn!(stream = %config.stream, error = %e, left = left.len(), "could not give back what was left");
            0
        }
    };
    info!(stream = %config.stream, given = abandoned, "partition stopped: the messages not finished were given back");
    counters.meter.abandoned(abandoned);
    Ok(WorkerStats {
        done: counters.done.load(Ordering::Relaxed),
        terminal: counters.terminal.load(Ordering::Relaxed),
        failed: counters.failed.load(Ordering::Relaxed),
        retried: counters.retried.load(Ordering::Relaxed),
        abandoned,
    })
}

/// What a key does after its head's run.
enum Next {
    /// The head left (done, terminal, gone): the next entry of the key may start.
    Go,
    /// The head runs again in place after the backoff for this many deliveries.
    Wait(u64),
    /// The head is at the cap, left to the pass: the key waits until it left the pending list.
    Capped,
}

/// Writes the outcome of the run of `key`'s head.
async fn settle(
    writer: &mut Connection,
    config: &WorkerConfig,
    counters: &Counters,
    settings: &WorkerSettings,
    queues: &mut HashMap<Key, VecDeque<Held>>,
    key: &Key,
    ran: Ran,
) -> Next {
    let (stream, group) = (config.stream.as_str(), config.group.as_str());
    let queue = queues.get_mut(key).expect("a running key has a queue");
    let head = queue.front_mut().expect("a running key has a head");
    let id = head.message.id.clone();
    counters.meter.landed(1);
    let failure = match ran {
        Ran::Gone => {
            queue.pop_front();
            return Next::Go;
        }
        // The entry is still pending here: its key waits, and it runs again after the backoff of a first
        // failure (dropping it would let the key's later entries run before it).
        Ran::NotCounted(e) => {
            warn!(stream, group, entry_id = %id, error = %e, "could not count the delivery of a run in place; tried again after the backoff");
            return Next::Wait(1);
        }
        Ran::Handled(Ok(Ok(Outcome::Done)), ran) => {
            let mut pipe = redis::pipe();
            pipe.cmd("XACK").arg(stream).arg(group).arg(&id);
            if head.failed {
                pipe.cmd("HDEL").arg(errors_key(stream, group)).arg(&id).ignore();
            }
            let acked: RedisResult<(i64,)> = write_again_if_broken(writer, |mut conn| {
                let pipe = &pipe;
                async move { pipe.query_async(&mut conn).await }
            })
            .await;
            match acked {
                Ok(_) => counters.count(Ended::Done, ran),
                Err(e) => {
                    // The key goes on: the entry stays pending, and whoever takes the partition over runs it again.
                    warn!(stream, group, entry_id = %id, error = %e, "XACK failed; the message stays pending");
                    counters.count(Ended::NotWritten, ran)
                }
            }
            queue.pop_front();
            return Next::Go;
        }
        Ran::Handled(Ok(Ok(Outcome::Terminal(reason))), ran) => {
            warn!(stream, group, entry_id = %id, reason = %reason, will_ack = true, "message ended as terminal");
            let acked = write_again_if_broken(writer, |mut conn| {
                let (id, reason) = (&id, &reason);
                async move { ack_terminal(&mut conn, stream, group, id, reason).await }
            })
            .await;
            match acked {
                Ok(_) => counters.count(Ended::Terminal, ran),
                Err(e) => {
                    warn!(stream, group, entry_id = %id, error = %e, "terminal ACK failed; the message stays pending");
                    counters.count(Ended::NotWritten, ran)
                }
            }
            queue.pop_front();
            return Next::Go;
        }
        Ran::Handled(Ok(Ok(Outcome::Retry)), ran) => {
            counters.count(Ended::Retried, ran);
            None
        }
        Ran::Handled(Ok(Err(e)), ran) => Some((e.to_string(), Ended::Errored, ran)),
        Ran::Handled(Err(panic), ran) => Some((format!("the handler panicked: {panic}"), Ended::Panicked, ran)),
    };
    head.failed = true;
    if let Some((text, ended, ran)) = &failure {
        warn!(stream, group, entry_id = %id, error = %text, "handler failed; run again in place after the backoff");
        counters.count(*ended, *ran);
        record_error(writer, stream, group, &id, text, counters).await;
    }
    let deliveries = match deliveries_of(writer, config, &id).await {
        Ok(Some(deliveries)) => deliveries,
        // No longer pending here (the pass took it, the partition moved): the key goes on.
        Ok(None) => {
            queue.pop_front();
            return Next::Go;
        }
        Err(e) => {
            warn!(stream, group, entry_id = %id, error = %e, "could not read the delivery count; retried after the backoff");
            1
        }
    };
    if deliveries >= u64::from(settings.max_deliveries) {
        info!(stream, group, entry_id = %id, deliveries, "at the cap: left to the pass, which dead-letters it; its key waits");
        head.capped = true;
        return Next::Capped;
    }
    Next::Wait(deliveries)
}

/// Extends the leases of every entry held but those at the cap (the consumer's heartbeat too), and lets the keys whose
/// capped head left the pending list go on.
async fn hold(
    writer: &mut Connection,
    config: &WorkerConfig,
    queues: &mut HashMap<Key, VecDeque<Held>>,
    ready: &mut VecDeque<Key>,
    room: &Semaphore,
) {
    let leased: Vec<String> =
        queues.values().flatten().filter(|held| !held.capped).map(|held| held.message.id.clone()).collect();
    let chunks = leased.chunks(super::LEASE_BATCH).chain(leased.is_empty().then_some(&[][..]));
    for chunk in chunks {
        if let Err(e) = lease(writer, config, chunk).await {
            warn!(stream = %config.stream, error = %e, "could not extend the leases; retrying at the next tick");
            return;
        }
    }
    let capped: Vec<(Key, String)> = queues
        .iter()
        .filter_map(|(key, queue)| {
            queue.front().filter(|held| held.capped).map(|h| (key.clone(), h.message.id.clone()))
        })
        .collect();
    for (key, id) in capped {
        if let Ok(None) = deliveries_of(writer, config, &id).await {
            let queue = queues.get_mut(&key).expect("listed");
            queue.pop_front();
            room.add_permits(1);
            if queue.is_empty() {
                queues.remove(&key);
            } else {
                ready.push_back(key);
            }
        }
    }
}

/// The entry's delivery count while it is this consumer's; `None` once it is not (acknowledged, dead-lettered,
/// another's).
async fn deliveries_of(conn: &mut Connection, config: &WorkerConfig, id: &str) -> RedisResult<Option<u64>> {
    let pending: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(&config.stream)
        .arg(&config.group)
        .arg(id)
        .arg(id)
        .arg(1)
        .arg(&config.consumer)
        .query_async(conn)
        .await?;
    Ok(pending.first().map(|(_, _, _, deliveries)| *deliveries))
}

/// Counts the delivery of a run in place (`XCLAIM ... RETRYCOUNT n+1 JUSTID`, only while the entry is this
/// consumer's); `false` when it no longer is.
async fn count_delivery(mut conn: Connection, config: &WorkerConfig, id: &str) -> RedisResult<bool> {
    let Some(deliveries) = deliveries_of(&mut conn, config, id).await? else { return Ok(false) };
    let claimed: Vec<String> = redis::cmd("XCLAIM")
        .arg(&config.stream)
        .arg(&config.group)
        .arg(&config.consumer)
        .arg(0)
        .arg(id)
        .arg("RETRYCOUNT")
        .arg(deliveries + 1)
        .arg("JUSTID")
        .query_async(&mut conn)
        .await?;
    Ok(!claimed.is_empty())
}

/// Reads the partition while there is room: its own pending list first (what it took over), then new entries.
async fn read(mut reader: Connection, config: WorkerConfig, room: Arc<Semaphore>, out: mpsc::Sender<Vec<Message>>) {
    let mut cursor = Some("0".to_string());
    loop {
        let Ok(first) = room.acquire().await else { return };
        first.forget();
        let mut count = 1;
        while count < 100
            && let Ok(more) = room.try_acquire()
        {
            more.forget();
            count += 1;
        }
        let read = match read_group(&mut reader, &config, count, &mut cursor).await {
            Ok(read) => read,
            Err(e) => {
                warn!(stream = %config.stream, error = %e, "read failed; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
                Vec::new()
            }
        };
        room.add_permits(count - read.len());
        if !read.is_empty() && out.send(read).await.is_err() {
            return;
        }
    }
}
