//! The worker SDK: the dispatch layer of an application consumer. It reads the consumer's own PEL
//! first, then new entries, hands each message to a handler with bounded concurrency, and is the only place that
//! acknowledges:
//!
//! - `Ok(Outcome::Done)` -> `XACK`;
//! - `Ok(Outcome::Terminal(reason))` -> `XACK` and `HINCRBY {T}:pelican:<stream>:<group>:terminal <reason> 1` in one script,
//!   counted only when the `XACK` removed the entry, plus one structured WARN line (never the payload);
//! - `Err(_)` or a panic -> no ACK, one log line, and the error's text (or the panic's) recorded as the entry's last
//!   error: `HSET {T}:pelican:<stream>:<group>:errors <id> <text>` (at most 1 KiB); the message stays pending for the
//!   operator's reclaim, which carries the text to the requeued copy or into the dead letter (`pelican-last-error`).
//!   A later ACK or terminal ACK removes the field.
//!
//! - `Ok(Outcome::Retry)` -> the entry is given back to the operator's pass at once (its idle time set to the group's
//!   `minIdle`, the delivery counted): the next pass retries it under the policy's backoff and cap.
//!
//! While a handler runs, the worker holds a lease on its entry: every third of the group's `minIdle` (at least every
//! 10 s; the operator publishes it in `{T}:pelican:<stream>:<group>:settings`, which the worker re-reads at every
//! tick, so a lowered `minIdle` is followed within one tick) it extends the entries in flight with the owner's
//! `XCLAIM <id> JUSTID` (`lease.lua`: idle back to 0, the count unchanged), so a handler slower than `minIdle` is
//! never taken for abandoned and handled twice. A lease lasts at most `max_handling`; past it the worker stops
//! extending, says so, and the pass may retry the message. On shutdown, what did not finish within `shutdown_grace`
//! is given back with `give_back.lua`, the aborted delivery not counted: the entry is left without an owner, as
//! `XNACK ... SILENT` (Redis 8.8) leaves it, and the next pass takes it at once. Not with `XNACK` itself: it takes no
//! consumer, so it could release an entry the pass has meanwhile handed to another worker; the script checks the
//! owner in the same atomic call. The worker contract all of this follows is `contract/README.md`.
//!
//! At every lease tick the lease call is also the worker's heartbeat (`{T}:pelican:<stream>:<group>:consumers`, the
//! evidence `strategy: Reassign` hands entries over on), and the worker looks at its own PEL again for entries the
//! operator handed to it (Reassign, whose `XCLAIM ... RETRYCOUNT` counted the delivery): it takes each with the lease
//! script (its idle time starts again, its count stays) and reads it with `XRANGE`. Entries whose handler failed here are never
//! read again by the worker itself: they wait for the operator's pass, which retries them as the policy says
//! (`minIdle`, `retry.backoff`, `maxDeliveries`), whatever this interval is. Re-reading them (each read a delivery
//! that resets the idle time) would retry a failing message every interval, never dead-lettered.
//!
//! A contract version the worker does not know stops it: refused by [`Worker::connect_to`], and met while running (a
//! worker started before its policy) it shuts down as on SIGTERM and [`Worker::run`] answers [`ContractStop`].
//!
//! This module needs no Kubernetes client: depend on `pelican` with `default-features = false`.

mod connection;
mod in_order;
mod meter;
#[cfg(feature = "metrics")]
pub mod metrics;
mod partitions;
mod producer;
mod reason;
mod topic;
mod trace;

use connection::write_again_if_broken;
pub use connection::{Connection, Source};
use meter::{Ended, WorkerMeter};
pub use partitions::{DEFAULT_TTL, TopicWorker, TopicWorkerConfig, TopicWorkerError};
pub use producer::{
    BOUNDED_PUBLISH, BOUNDED_PUBLISH_BATCH, BOUNDED_PUBLISH_BATCH_LUA, BOUNDED_PUBLISH_LUA, IdempotenceError,
    IdempotentProducer, Producer, PublishError, Published, Refusal,
};
pub use reason::{InvalidReason, Reason};
pub use topic::{IdempotentTopicProducer, TopicError, TopicProducer};

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use opentelemetry::context::FutureExt as _;
use redis::aio::ConnectionLike;
use redis::{Client, RedisError, RedisResult, Script, Value};
use tokio::sync::{Mutex as AsyncMutex, Semaphore, mpsc, watch};
use tokio::time::Instant;
use tracing::{Instrument, error, info, warn};

use crate::keys::{
    CONTRACT_VERSION, DELIVERIES_FIELD, ERROR_TEXT_MAX, UnknownContract, WorkerSettings, consumers_key, errors_key,
    settings_key, terminal_key,
};

static TERMINAL_ACK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../contract/scripts/terminal_ack.lua")));
static LEASE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../../contract/scripts/lease.lua")));
static GIVE_BACK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../contract/scripts/give_back.lua")));

pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// One stream entry as the handler sees it. Fields are raw bytes, in the order they were added.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub id: String,
    pub fields: Vec<(Vec<u8>, Vec<u8>)>,
    /// The partition of a topic the entry was read from ([`TopicWorker`]); `None` for a stream's [`Worker`].
    pub partition: Option<u32>,
}

impl Message {
    /// The value of a field (the first one when the name repeats).
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        self.fields.iter().find(|(k, _)| k == name.as_bytes()).map(|(_, v)| v.as_slice())
    }

    /// The value of a field as text, when it is UTF-8.
    pub fn field_str(&self, name: &str) -> Option<&str> {
        std::str::from_utf8(self.field(name)?).ok()
    }
}

/// How the handler ended a message. Errors are the handler's `Err`, not an outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Processed: acknowledge.
    Done,
    /// Will never succeed (the record it refers to is gone, say): acknowledge and count under this reason.
    Terminal(Reason),
    /// Failed, and should be retried without waiting out `minIdle`: given back to the operator's pass, which retries
    /// it under the policy's backoff (the delivery counts towards `maxDeliveries`).
    Retry,
}

impl Outcome {
    /// `Outcome::Terminal` from a literal code. An invalid code is a programming error: this panics with a message
    /// naming the rule, and the dispatch layer treats the panic as a failure (no ACK), never as a silent ACK.
    pub fn terminal(code: &str) -> Outcome {
        match Reason::new(code) {
            Ok(reason) => Outcome::Terminal(reason),
            Err(e) => panic!("{e}"),
        }
    }
}

#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub stream: String,
    pub group: String,
    pub consumer: String,
    /// Messages handled at once. A handler is first polled in the task of [`Worker::run`]: one that finishes
    /// without waiting costs no task of its own; one that waits goes on in a task of its own (the handlers that wait
    /// run in parallel on the runtime's threads). So a handler with much work for the CPU before its first `.await`
    /// hands it to `tokio::task::spawn_blocking`, as in any task.
    pub concurrency: usize,
    /// How long one read waits for new entries (`XREADGROUP ... BLOCK`): at least a millisecond, since `BLOCK 0`
    /// waits for ever on the server ([`Worker::connect_to`] refuses zero).
    pub block: Duration,
    /// On shutdown, how long in-flight handlers may take before they are abandoned (not acknowledged).
    pub shutdown_grace: Duration,
    /// How long the worker keeps a message it is handling from looking idle (its lease). Past it the worker stops
    /// extending the lease and logs so: a handler stuck that long lets the operator's pass retry the message.
    pub max_handling: Duration,
}

/// The default shutdown grace: below Kubernetes' default `terminationGracePeriodSeconds` (30 s), so the give-back
/// and the exit happen before the kubelet's SIGKILL. Keep it 10 s below the Pod's grace when you change either.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(20);

/// The Pod's name, as a worker's default consumer name (`spec.consumers.pods` matches consumers to Pods by it):
/// `POD_NAME` (the downward API), else `HOSTNAME` (which Kubernetes sets to the Pod's name), else the host's name
/// (contract/README.md, "Name"); `None` only when the host has no name either.
pub fn pod_name() -> Option<String> {
    ["POD_NAME", "HOSTNAME"]
        .into_iter()
        .find_map(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
        .or_else(|| hostname::get().ok()?.into_string().ok().filter(|name| !name.is_empty()))
}

impl WorkerConfig {
    /// A worker named after its Pod ([`pod_name`]); `None` outside a Pod without `POD_NAME` or `HOSTNAME`.
    pub fn for_pod(stream: impl Into<String>, group: impl Into<String>) -> Option<Self> {
        Some(WorkerConfig::new(stream, group, pod_name()?))
    }

    pub fn new(stream: impl Into<String>, group: impl Into<String>, consumer: impl Into<String>) -> Self {
        WorkerConfig {
            stream: stream.into(),
            group: group.into(),
            consumer: consumer.into(),
            concurrency: 16,
            block: Duration::from_secs(1),
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            max_handling: Duration::from_secs(30 * 60),
        }
    }
}

/// What a worker did, returned when it stops.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerStats {
    pub done: u64,
    pub terminal: u64,
    /// Handler errors and panics: left pending.
    pub failed: u64,
    /// `Outcome::Retry`: given back to the operator's pass, counted as a delivery.
    pub retried: u64,
    /// Still running when the shutdown grace ran out (or read after the shutdown began): given back to the
    /// operator's pass, not counted. Only entries the give-back found still this consumer's.
    pub abandoned: u64,
}

/// A worker that stopped by itself: the operator speaks a worker contract this SDK does not know. It shut down as on
/// SIGTERM first (its handlers finished within the grace, the rest was given back uncounted); `stats` are its counts.
#[derive(Debug)]
pub struct ContractStop {
    pub unknown: UnknownContract,
    pub stats: WorkerStats,
}

impl std::fmt::Display for ContractStop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}; the worker shut down", self.unknown)
    }
}

impl std::error::Error for ContractStop {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.unknown)
    }
}

/// An entry being handled: when its handler started, and whether its outcome is being written (it is no longer
/// leased then: a lease after a retry's give-back would undo the idle time the give-back set, and one during a
/// failure's error write would make the entry look handed back).
struct Flight {
    started: Instant,
    settled: bool,
}

type InFlight = Arc<Mutex<HashMap<String, Flight>>>;

struct Counters {
    done: AtomicU64,
    terminal: AtomicU64,
    failed: AtomicU64,
    retried: AtomicU64,
    abandoned: AtomicU64,
    /// The group's settings as the operator published them; `None` until read (or when no policy publishes any).
    settings: Mutex<Option<WorkerSettings>>,
    /// Entries whose last error this worker recorded: their field goes with their ACK.
    errors_recorded: Mutex<HashSet<String>>,
    /// Entries whose handler failed here, or whose outcome could not be written, and that stay pending, with since
    /// when they are untouched on the server as this worker left them (a retry's set back by the idle time its
    /// give-back writes): the operator's pass retries them, never this worker.
    failed_here: Mutex<HashMap<String, Instant>>,
    /// Held by a lease tick from gathering its ids to its last correction, by the own-PEL check from its XPENDING to
    /// its take-up, and by a retry from its mark to its give-back's reply. A retry's give-back (which sets the
    /// entry's idle time) must reach the server after a lease that gathered its id (which would undo that idle time),
    /// and not be answered while the own PEL's XPENDING is out (its idle times from before it): either way the entry
    /// would look handed back and be run again here, no delivery counted. The writer's one connection serves calls in
    /// the order they are put on it, but that order is not the order of the clocks read before them on two threads.
    leasing: AsyncMutex<()>,
    /// `Done` outcomes waiting for their XACK.
    acks: Mutex<AckQueue>,
    /// The worker contract this worker speaks: [`CONTRACT_VERSION`], or a topic's for a partition's worker.
    contract: u32,
    /// The same counts through OpenTelemetry's API, recorded with them.
    meter: WorkerMeter,
}

impl Counters {
    fn new(config: &WorkerConfig, contract: u32) -> Counters {
        Counters {
            done: AtomicU64::default(),
            terminal: AtomicU64::default(),
            failed: AtomicU64::default(),
            retried: AtomicU64::default(),
            abandoned: AtomicU64::default(),
            settings: Mutex::default(),
            errors_recorded: Mutex::default(),
            failed_here: Mutex::default(),
            leasing: AsyncMutex::new(()),
            acks: Mutex::default(),
            contract,
            meter: WorkerMeter::new(&config.stream, &config.group),
        }
    }

    /// Counts a handler run that took `ran` as `ended`, in the stats and their metrics.
    fn count(&self, ended: Ended, ran: Duration) {
        let counter = match ended {
            Ended::Done => &self.done,
            Ended::Terminal => &self.terminal,
            Ended::Retried => &self.retried,
            Ended::Errored | Ended::Panicked | Ended::NotWritten => &self.failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.meter.ended(ended, ran);
    }

    /// `id` failed here (its handler, or writing its outcome) and stays pending for the operator's pass: this worker
    /// takes it up again only once it is handed back.
    fn left_pending(&self, id: &str, ran: Duration) {
        self.failed_here.lock().expect("failed lock").insert(id.to_string(), Instant::now());
        self.count(Ended::NotWritten, ran);
    }

    /// Takes `id` out of flight.
    fn landed(&self, in_flight: &InFlight, id: &str) {
        if in_flight.lock().expect("in-flight lock").remove(id).is_some() {
            self.meter.landed(1);
        }
    }
}

pub struct Worker {
    source: Source,
    /// Blocking reads get a connection of their own, so acknowledgements never wait behind them.
    reader: Connection,
    /// The writer, replaced when a sentinel names a new primary: leases, acknowledgements and give-backs always take
    /// the current one.
    writer: watch::Sender<Connection>,
    config: WorkerConfig,
    counters: Arc<Counters>,
    in_flight: InFlight,
}

/// A running worker's counts, read at any time (for a metrics exporter): [`Worker::live_stats`].
#[derive(Clone)]
pub struct LiveStats {
    counters: Arc<Counters>,
    in_flight: InFlight,
}

impl LiveStats {
    /// The counts so far.
    pub fn snapshot(&self) -> WorkerStats {
        let c = &self.counters;
        WorkerStats {
            done: c.done.load(Ordering::Relaxed),
            terminal: c.terminal.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
            retried: c.retried.load(Ordering::Relaxed),
            abandoned: c.abandoned.load(Ordering::Relaxed),
        }
    }

    /// The messages being handled now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.lock().expect("in-flight lock").len()
    }
}

impl Worker {
    /// A worker on one server.
    pub async fn connect(client: &Client, config: WorkerConfig) -> RedisResult<Worker> {
        Worker::connect_to(Source::Server(client.clone()), config).await
    }

    /// A worker on a server, a Redis Cluster, or the primary a sentinel names (followed across failovers: after a
    /// failed read the worker asks the sentinel again). Refused when the group's settings name a worker contract
    /// this SDK does not know (the error says which, and to upgrade).
    pub async fn connect_to(source: Source, config: WorkerConfig) -> RedisResult<Worker> {
        if config.block.as_millis() == 0 {
            return Err(RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "WorkerConfig.block must be at least 1 ms",
                "0 would send BLOCK 0, which waits for ever on the server while the client gives up".to_string(),
            )));
        }
        Worker::speaking(source, config, CONTRACT_VERSION).await
    }

    /// A worker of contract `contract`: a topic's partition is a stream whose settings say the topic's.
    pub(crate) async fn speaking(source: Source, config: WorkerConfig, contract: u32) -> RedisResult<Worker> {
        let (reader, mut writer) = connections(&source, &config).await?;
        if let Ok(Err(unknown)) = read_settings(&mut writer, &config, contract).await {
            return Err(RedisError::from((redis::ErrorKind::Client, "unknown worker contract", unknown.to_string())));
        }
        let counters = Counters::new(&config, contract);
        Ok(Worker {
            source,
            reader,
            writer: watch::Sender::new(writer),
            config,
            counters: Arc::new(counters),
            in_flight: Arc::default(),
        })
    }

    /// The worker's counts while it runs (take it before [`Worker::run`], which consumes the worker).
    pub fn live_stats(&self) -> LiveStats {
        LiveStats { counters: self.counters.clone(), in_flight: self.in_flight.clone() }
    }

    /// The current writer.
    fn writer(&self) -> Connection {
        self.writer.borrow().clone()
    }

    /// Runs until `shutdown` resolves: then stops reading, lets in-flight handlers finish (up to the grace period)
    /// and returns. Read errors (the server restarting, say) are logged and retried; they do not stop the worker.
    /// When the settings name a worker contract this SDK does not know (met at a lease tick: an operator upgraded
    /// under running workers, or a worker started before its policy) it shuts down the same way by itself and
    /// answers [`ContractStop`].
    pub async fn run<H, Fut>(
        mut self,
        handler: H,
        shutdown: impl Future<Output = ()>,
    ) -> Result<WorkerStats, ContractStop>
    where
        H: Fn(Message) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Outcome, BoxError>> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let counters = self.counters.clone();
        if let Err(unknown) = refresh_settings(&mut self.writer(), &self.config, &counters).await {
            error!(stream = %self.config.stream, group = %self.config.group, "{unknown}; not starting");
            return Err(ContractStop { unknown, stats: WorkerStats::default() });
        }
        let permits = Arc::new(Semaphore::new(self.config.concurrency.max(1)));
        let in_flight = self.in_flight.clone();
        // Set by the lease loop when the settings name a contract this SDK does not know: the worker shuts down.
        let (stop_tx, stopped_by) = watch::channel(None::<UnknownContract>);
        let mut stop_rx = stopped_by.clone();
        // On the writer's connection: a lease sent before a give-back is served before it.
        let leases = AbortOnDrop(tokio::spawn(hold_leases(
            self.config.clone(),
            self.writer.subscribe(),
            in_flight.clone(),
            counters.clone(),
            stop_tx,
        )));
        // Acknowledgements no read carries: those of handlers that finish together go in one XACK.
        let (acks, wakes) = mpsc::unbounded_channel();
        let mut acknowledger = AbortOnDrop(tokio::spawn(acknowledge(
            self.config.clone(),
            self.writer.subscribe(),
            counters.clone(),
            in_flight.clone(),
            wakes,
        )));
        let (config, writers) = (self.config.clone(), self.writer.subscribe());
        // The handlers start in this task, polled beside the reads (see `driving`), and only those that wait get a
        // task of their own (`in_place_or_spawned`): a spawned task per message cost more than a no-op handler's
        // whole run (a wake of the other thread for each).
        let mut running = FuturesUnordered::new();
        // Our own PEL first (entries delivered to us before a crash or restart), then new entries.
        let mut own_pel_cursor = Some("0".to_string());
        // Hand-overs are looked for at every lease tick.
        let mut next_pel_check = Instant::now();
        let shutdown = async move {
            tokio::select! {
                _ = shutdown => {}
                _ = stop_rx.wait_for(Option::is_some) => {}
            }
        };
        let mut shutdown = std::pin::pin!(shutdown);
        // Entries a read brought after the shutdown began: never handled, given back.
        let mut unread = Vec::new();
        let mut missing_group = MissingGroup::default();
        loop {
            // The acknowledgements of the handlers that free slots wait for the next read.
            counters.acks.lock().expect("acks lock").carried = true;
            let first = driving(&mut running, async {
                tokio::select! {
                    _ = &mut shutdown => None,
                    permit = permits.clone().acquire_owned() => Some(permit.expect("semaphore is never closed")),
                }
            });
            let Some(first) = first.await else { break };
            // Handlers that finished with this one free their slots about now: wait a little (up to GATHER_WAIT) for
            // half the slots, so that one read fetches for them all rather than a read (a round trip) for each few.
            let mut batch_permits = vec![first];
            let wanted = self.config.concurrency.div_ceil(2);
            let gathered_by = Instant::now() + GATHER_WAIT;
            loop {
                run_ready(&mut running);
                while let Ok(p) = permits.clone().try_acquire_owned() {
                    batch_permits.push(p);
                }
                if batch_permits.len() >= wanted {
                    break;
                }
                let freed = driving(&mut running, async {
                    tokio::select! {
                        biased;
                        permit = permits.clone().acquire_owned() => Some(permit.expect("semaphore is never closed")),
                        _ = tokio::time::sleep_until(gathered_by) => None,
                    }
                });
                match freed.await {
                    Some(permit) => batch_permits.push(permit),
                    None => break,
                }
            }
            let pel_check_due = own_pel_cursor.is_none() && Instant::now() >= next_pel_check;
            if pel_check_due {
                let settings = *counters.settings.lock().expect("settings lock");
                next_pel_check = Instant::now() + lease_interval(settings);
            }
            let skip: Option<HashSet<String>> =
                pel_check_due.then(|| in_flight.lock().expect("in-flight lock").keys().cloned().collect());
            let carried = std::mem::take(&mut counters.acks.lock().expect("acks lock").waiting);
            let read = self.read(batch_permits.len(), &mut own_pel_cursor, skip.as_ref(), carried, &acks);
            let outcome = driving(&mut running, async {
                tokio::pin!(read);
                tokio::select! {
                    // A blocking read already sent delivers to this consumer whatever becomes of the future: its
                    // reply is awaited (at most `block`), and what it brought is given back with the rest.
                    _ = &mut shutdown => Err(read.await.unwrap_or_default()),
                    result = &mut read => Ok(result),
                }
            })
            .await;
            let messages = match outcome {
                Err(late) => {
                    unread.extend(late.into_iter().map(|m| m.id));
                    break;
                }
                Ok(Ok(messages)) => {
                    missing_group.found(&self.config);
                    messages
                }
                Ok(Err(e)) if e.code() == Some("NOGROUP") => {
                    release_acks(&counters, &acks);
                    // The group is the operator's to create: wait for it, saying so once.
                    let wait = missing_group.missing(&self.config);
                    let waited = driving(&mut running, async {
                        tokio::select! {
                            _ = &mut shutdown => false,
                            _ = tokio::time::sleep(wait) => true,
                        }
                    });
                    if waited.await {
                        continue;
                    }
                    break;
                }
                Ok(Err(e)) => {
                    release_acks(&counters, &acks);
                    warn!(stream = %self.config.stream, group = %self.config.group, error = %e, "read failed; retrying");
                    driving(&mut running, tokio::time::sleep(Duration::from_millis(500))).await;
                    if self.source.follows_failovers() {
                        // The primary may have moved (or be a replica now): ask the sentinel again.
                        match driving(&mut running, connections(&self.source, &self.config)).await {
                            Ok((reader, writer)) => {
                                self.reader = reader;
                                self.writer.send_replace(writer);
                            }
                            Err(e) => warn!(error = %e, "no primary from the sentinel yet; retrying"),
                        }
                    }
                    continue;
                }
            };
            for (message, permit) in messages.into_iter().zip(batch_permits) {
                let flight = Flight { started: Instant::now(), settled: false };
                in_flight.lock().expect("in-flight lock").insert(message.id.clone(), flight);
                counters.meter.started();
                let runtime = Dispatch {
                    config: &config,
                    writers: &writers,
                    acks: &acks,
                    counters: &counters,
                    in_flight: &in_flight,
                };
                let handler = handler.as_ref();
                running.push(async move {
                    dispatch(runtime, message, handler).await;
                    drop(permit);
                });
            }
        }
        // No read comes to carry what waits: the acknowledger writes it, and whatever the handlers still finish.
        release_acks(&counters, &acks);
        // The leases go on while in-flight handlers finish: a slow one is not taken from under them.
        let drained = async { while running.next().await.is_some() {} };
        // Past the grace the handlers still running are dropped, unfinished: given back below.
        let _ = tokio::time::timeout(self.config.shutdown_grace, drained).await;
        drop(leases);
        drop(running);
        // Every handler is gone: the acknowledger ends once it answered them all.
        drop(acks);
        let _ = (&mut acknowledger.0).await;
        // What the grace cut off is given back, and the worker leaves the group (its consumer deleted once it owns
        // nothing), also when nothing was cut off: a consumer that just read looks live, and Reassign would hand
        // work to it.
        let mut left: Vec<String> = in_flight.lock().expect("in-flight lock").keys().cloned().collect();
        counters.meter.landed(left.len());
        left.append(&mut unread);
        let abandoned = self.give_back_and_leave(&left, &counters).await;
        counters.abandoned.store(abandoned, Ordering::Relaxed);
        counters.meter.abandoned(abandoned);
        let stats = self.live_stats().snapshot();
        let unknown = stopped_by.borrow().clone();
        match unknown {
            Some(unknown) => Err(ContractStop { unknown, stats }),
            None => Ok(stats),
        }
    }

    /// Gives back what a shutdown cut off: the next pass retries it at once, and the cut-off delivery does not
    /// count (`give_back.lua`, which leaves an entry no longer ours alone); then leaves the group. Returns how many
    /// entries were given back (those still this consumer's).
    async fn give_back_and_leave(&mut self, left: &[String], counters: &Counters) -> u64 {
        let (stream, group) = (&self.config.stream, &self.config.group);
        let idle = counters.settings.lock().expect("settings lock").map(|s| s.retry_after_ms);
        let idle = idle.unwrap_or(UNPUBLISHED_IDLE.as_millis() as u64);
        match give_back(&mut self.writer(), &self.config, left, idle, false).await {
            Ok(given) => {
                info!(%stream, %group, given, "shut down: messages not finished were given back for the next pass, their delivery not counted");
                given.max(0) as u64
            }
            Err(e) => {
                warn!(%stream, %group, error = %e, left = left.len(), "shut down, and the messages not finished could not be given back: they are retried after minIdle");
                0
            }
        }
    }

    /// Up to `count` messages: from our own PEL while it has entries, then new ones (blocking up to `block`). With
    /// `pel_check` (the ids in flight), the entries the operator handed to us instead. `carried`: acknowledgements
    /// written in the same round trip, before a read that does not block (they never wait behind a blocking read);
    /// the blocking read follows when that one brought nothing. The acknowledger (woken through `wake`) writes them
    /// when the hand-over check reads instead, or when the connection broke under them, and, from a blocking read on,
    /// what the handlers finish.
    async fn read(
        &mut self,
        count: usize,
        own_pel_cursor: &mut Option<String>,
        pel_check: Option<&HashSet<String>>,
        carried: Vec<AckRequest>,
        wake: &mpsc::UnboundedSender<()>,
    ) -> RedisResult<Vec<Message>> {
        let counters = self.counters.clone();
        let to_acknowledger = |acks: Vec<AckRequest>| {
            counters.acks.lock().expect("acks lock").waiting.extend(acks);
            release_acks(&counters, wake);
        };
        if let Some(in_flight) = pel_check {
            to_acknowledger(carried);
            return self.read_handed_over(count, in_flight, &counters).await;
        }
        if carried.is_empty() {
            if own_pel_cursor.is_none() {
                release_acks(&counters, wake);
            }
            return read_group(&mut self.reader, &self.config, count, own_pel_cursor).await;
        }
        let mut pipe = ack_pipeline(&self.config, &carried);
        pipe.add_command(xreadgroup(&self.config, count, own_pel_cursor.as_deref(), None)).ignore_errors();
        let replies: Vec<Value> = match pipe.query_async(&mut self.reader).await {
            Ok(replies) => replies,
            Err(e) => {
                if connection::broken(&e) {
                    to_acknowledger(carried);
                } else {
                    settle_acks(&self.config, carried, Err(AckFailure::of(&e)), &counters, &self.in_flight);
                    release_acks(&counters, wake);
                }
                return Err(e);
            }
        };
        let [acked, read]: [Value; 2] = replies.try_into().map_err(|_| {
            RedisError::from((redis::ErrorKind::Client, "a pipeline of an XACK and a read answered otherwise"))
        })?;
        let acked = acked.extract_error().map(drop).map_err(|e| AckFailure::of(&e));
        settle_acks(&self.config, carried, acked, &counters, &self.in_flight);
        let messages = entries_read(read.extract_error()?, own_pel_cursor);
        if messages.is_empty() && own_pel_cursor.is_none() {
            release_acks(&counters, wake);
            return read_group(&mut self.reader, &self.config, count, own_pel_cursor).await;
        }
        Ok(messages)
    }

    /// Up to `count` entries of our own PEL that are neither in flight nor failed here: the ones the operator handed
    /// to us. Each is taken with `XCLAIM <id> JUSTID` (the idle time starts again, so the operator's pass does not
    /// take it back while it is handled; the delivery count stays, the hand-over counted it) and read with `XRANGE`.
    async fn read_handed_over(
        &mut self,
        count: usize,
        in_flight: &HashSet<String>,
        counters: &Counters,
    ) -> RedisResult<Vec<Message>> {
        let mut writer = self.writer();
        let config = &self.config;
        let _leasing = counters.leasing.lock().await;
        let failed_here = counters.failed_here.lock().expect("failed lock").clone();
        let asked = count + in_flight.len() + failed_here.len();
        // Measured before the server measures idle times: an entry nobody touched since it failed here has been
        // idle at least this long.
        let asked_at = Instant::now();
        let pending: Vec<(String, String, i64, i64)> = redis::cmd("XPENDING")
            .arg(&config.stream)
            .arg(&config.group)
            .arg("-")
            .arg("+")
            .arg(asked)
            .arg(&config.consumer)
            .query_async(&mut writer)
            .await?;
        if pending.len() < asked {
            // The whole PEL: what failed here and is no longer in it (the operator requeued, reassigned or
            // dead-lettered it) is forgotten, so the set stays as small as the PEL.
            let listed: HashSet<&String> = pending.iter().map(|(id, ..)| id).collect();
            counters.failed_here.lock().expect("failed lock").retain(|id, _| listed.contains(id));
        }
        // An entry that failed here and was handed back to us later (a hand-over resets its idle time) is a new
        // delivery; one still idle since it failed here waits for the operator.
        let handed_back = |id: &str, idle_ms: i64| {
            failed_here.get(id).is_none_or(|failed| {
                let since = asked_at.saturating_duration_since(*failed);
                Duration::from_millis(idle_ms.max(0) as u64) + HAND_OVER_MARGIN <= since
            })
        };
        let ids: Vec<String> = pending
            .into_iter()
            .filter(|(id, _, idle_ms, _)| !in_flight.contains(id) && handed_back(id, *idle_ms))
            .map(|(id, ..)| id)
            .take(count)
            .collect();
        {
            let mut failed = counters.failed_here.lock().expect("failed lock");
            ids.iter().for_each(|id| _ = failed.remove(id));
        }
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        // Taken with the lease script, which checks the owner: a plain XCLAIM would take back an entry the pass
        // handed to another worker since the XPENDING above.
        let taken = lease(&mut writer, config, &ids).await?;
        if taken.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for id in &taken {
            pipe.cmd("XRANGE").arg(&config.stream).arg(id).arg(id);
        }
        let ranges: Vec<Vec<(String, Vec<Vec<u8>>)>> = pipe.query_async(&mut writer).await?;
        // An entry deleted from the stream while pending has no payload to handle: the operator's pass drops it.
        let entries = ranges.into_iter().flatten().map(|(id, flat)| (id, Some(pairs(flat)))).collect();
        Ok(messages(entries))
    }
}

/// Up to `count` messages: from the consumer's own PEL while `own_pel_cursor` is set (it moves to the last one read;
/// `None` once that PEL is read to its end), then new ones, blocking up to `block`.
async fn read_group(
    reader: &mut Connection,
    config: &WorkerConfig,
    count: usize,
    own_pel_cursor: &mut Option<String>,
) -> RedisResult<Vec<Message>> {
    let cmd = xreadgroup(config, count, own_pel_cursor.as_deref(), Some(config.block));
    let reply: Value = cmd.query_async(reader).await?;
    Ok(entries_read(reply, own_pel_cursor))
}

/// `XREADGROUP` of up to `count` entries: after `own_pel_cursor` in the consumer's own PEL, else new ones, waiting
/// up to `block` for them.
fn xreadgroup(
    config: &WorkerConfig,
    count: usize,
    own_pel_cursor: Option<&str>,
    block: Option<Duration>,
) -> redis::Cmd {
    let mut cmd = redis::cmd("XREADGROUP");
    cmd.arg("GROUP").arg(&config.group).arg(&config.consumer).arg("COUNT").arg(count);
    match (own_pel_cursor, block) {
        (Some(cursor), _) => cmd.arg("STREAMS").arg(&config.stream).arg(cursor),
        (None, Some(block)) => {
            cmd.arg("BLOCK").arg(block.as_millis() as u64).arg("STREAMS").arg(&config.stream).arg(">")
        }
        (None, None) => cmd.arg("STREAMS").arg(&config.stream).arg(">"),
    };
    cmd
}

/// The messages of an `XREADGROUP` reply; a read of the own PEL moves `own_pel_cursor` to the last entry read (to
/// `None` at its end).
fn entries_read(reply: Value, own_pel_cursor: &mut Option<String>) -> Vec<Message> {
    let entries = parse_entries(reply);
    if own_pel_cursor.is_some() {
        *own_pel_cursor = entries.last().map(|(id, _)| id.clone());
    }
    messages(entries)
}

/// A spawned task, aborted when dropped: a run dropped mid-way (a topic's partition lost) leaves no task behind.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The longest a read waits for half the slots to be free.
const GATHER_WAIT: Duration = Duration::from_millis(1);

/// The most entries one lease or give-back call carries.
const LEASE_BATCH: usize = 100;

/// The idle time given back entries get when the operator published no settings: Pelican's default `minIdle`.
const UNPUBLISHED_IDLE: Duration = Duration::from_secs(5 * 60);

/// How often the leases are extended, the settings re-read and hand-overs looked for: [`crate::keys::lease_interval`]
/// of the published `minIdle`, every second when no settings are published.
fn lease_interval(settings: Option<WorkerSettings>) -> Duration {
    settings.map_or(Duration::from_secs(1), |s| crate::keys::lease_interval(Duration::from_millis(s.min_idle_ms)))
}

/// The group's settings as the operator published them, or `None` when it published none (no policy, an older
/// operator); an error inside when they name a contract this SDK does not know.
async fn read_settings(
    conn: &mut Connection,
    config: &WorkerConfig,
    contract: u32,
) -> RedisResult<Result<Option<WorkerSettings>, UnknownContract>> {
    let key = settings_key(&config.stream, &config.group);
    let hash: BTreeMap<String, String> = redis::cmd("HGETALL").arg(&key).query_async(conn).await?;
    Ok(WorkerSettings::from_fields_of(&hash, contract))
}

/// Re-reads the settings into `counters`. A failed read (an ACL without `hgetall` on the key, the server restarting)
/// keeps the last ones read, and says so; without any, leases are extended every second and give-backs use
/// [`UNPUBLISHED_IDLE`]. Settings of a contract this SDK does not know are the error.
async fn refresh_settings(
    conn: &mut Connection,
    config: &WorkerConfig,
    counters: &Counters,
) -> Result<(), UnknownContract> {
    let (stream, group) = (&config.stream, &config.group);
    match read_settings(conn, config, counters.contract).await {
        Ok(Ok(settings)) => *counters.settings.lock().expect("settings lock") = settings,
        Ok(Err(unknown)) => return Err(unknown),
        Err(e) => warn!(%stream, %group, error = %e, "could not read the group's settings; the last ones read stay"),
    }
    Ok(())
}

/// Every lease tick, until aborted: re-reads the settings, then extends the lease of every entry in flight for up to
/// `max_handling` and not settled, with the worker's heartbeat (also with nothing in flight). Past `max_handling` an
/// entry is left to go idle, once, with a warning: the operator's pass may then retry it while its handler still
/// runs. Settings of a contract this SDK does not know stop the worker (`stop`), once; the leases go on while its
/// handlers finish.
async fn hold_leases(
    config: WorkerConfig,
    writers: watch::Receiver<Connection>,
    in_flight: InFlight,
    counters: Arc<Counters>,
    stop: watch::Sender<Option<UnknownContract>>,
) {
    let mut overdue = HashSet::<String>::new();
    let (stream, group) = (&config.stream, &config.group);
    loop {
        let settings = *counters.settings.lock().expect("settings lock");
        tokio::time::sleep(lease_interval(settings)).await;
        let mut conn = writers.borrow().clone();
        // Before the lease: a lowered minIdle is followed from this tick on.
        if let Err(unknown) = refresh_settings(&mut conn, &config, &counters).await
            && stop.borrow().is_none()
        {
            error!(%stream, %group, "{unknown}; shutting down");
            stop.send_replace(Some(unknown));
        }
        let _leasing = counters.leasing.lock().await;
        let now = Instant::now();
        let ids: Vec<String> = {
            let held = in_flight.lock().expect("in-flight lock");
            overdue.retain(|id| held.contains_key(id));
            let mut ids = Vec::with_capacity(held.len());
            for (id, flight) in held.iter().filter(|(_, flight)| !flight.settled) {
                if now.saturating_duration_since(flight.started) < config.max_handling {
                    ids.push(id.clone());
                } else if overdue.insert(id.clone()) {
                    warn!(%stream, %group, entry_id = %id, max_handling = ?config.max_handling, "handler still running after max_handling: its lease is no longer extended, and the operator's pass may retry the message");
                }
            }
            ids
        };
        // Taken before the ids were gathered: a handler that fails (on another thread, or while an earlier chunk is on
        // its way) after its id was taken for this lease fails after it, and each chunk's lease is accounted for below.
        let sent = now;
        // At least one call: the heartbeat.
        for chunk in ids.chunks(LEASE_BATCH).chain(ids.is_empty().then_some(&[][..])) {
            if let Err(e) = lease(&mut conn, &config, chunk).await {
                warn!(%stream, %group, error = %e, "could not extend the leases of the messages being handled; retrying");
            }
            // A handler that failed while this lease was on its way (a paused server answers late): the lease may
            // have reset the entry's idle time after the failure, so the entry looks untouched since now, not since
            // it failed; else the own-PEL check would take it for a hand-over and run it again here. (No retry is
            // marked meanwhile: it waits for `leasing`.)
            let now = Instant::now();
            let mut failed = counters.failed_here.lock().expect("failed lock");
            for id in chunk {
                if let Some(untouched) = failed.get_mut(id).filter(|untouched| **untouched >= sent) {
                    *untouched = now;
                }
            }
        }
    }
}

/// `lease.lua`: extends `ids` (this consumer's) and beats the worker's heart; answers the ids still this consumer's.
async fn lease(conn: &mut Connection, config: &WorkerConfig, ids: &[String]) -> RedisResult<Vec<String>> {
    LEASE
        .key(&config.stream)
        .key(consumers_key(&config.stream, &config.group))
        .arg(&config.group)
        .arg(&config.consumer)
        .arg(ids)
        .invoke_async(conn)
        .await
}

/// Waiting out a group that does not exist yet (`NOGROUP`): the operator creates it. The wait starts at a second and
/// doubles up to 10 s; the first miss is said once, and the group's appearance once.
#[derive(Default)]
struct MissingGroup {
    wait: Option<Duration>,
}

impl MissingGroup {
    /// The group is missing: how long to wait before the next read.
    fn missing(&mut self, config: &WorkerConfig) -> Duration {
        let wait = match self.wait {
            None => {
                warn!(stream = %config.stream, group = %config.group, "the group does not exist yet: waiting for the operator to create it (no policy names it yet?)");
                Duration::from_secs(1)
            }
            Some(wait) => (wait * 2).min(Duration::from_secs(10)),
        };
        self.wait = Some(wait);
        wait
    }

    /// A read succeeded.
    fn found(&mut self, config: &WorkerConfig) {
        if self.wait.take().is_some() {
            info!(stream = %config.stream, group = %config.group, "the group exists now: reading");
        }
    }
}

/// Gives `ids` (this consumer's) back to the operator's pass with an idle time of `idle_ms`; `counted`: whether the
/// delivery being given back counts towards `maxDeliveries`. Returns how many were still this consumer's.
async fn give_back(
    conn: &mut Connection,
    config: &WorkerConfig,
    ids: &[String],
    idle_ms: u64,
    counted: bool,
) -> RedisResult<i64> {
    let mut given = 0;
    // At least one call: a shutdown with nothing to give back still leaves the group.
    let chunks = ids.chunks(LEASE_BATCH).chain(ids.is_empty().then_some(&[][..]));
    for chunk in chunks {
        let uncount = if counted { 0 } else { 1 };
        let mut call = GIVE_BACK.key(&config.stream);
        call.arg(&config.group).arg(&config.consumer).arg(idle_ms).arg(uncount).arg(chunk);
        given += call.invoke_async::<i64>(conn).await?;
    }
    Ok(given)
}

/// How much shorter than the time since an entry failed here its idle time must be for it to count as handed back to
/// this worker: the operator hands an entry over only once it was idle `minIdle` (at least a second).
const HAND_OVER_MARGIN: Duration = Duration::from_secs(1);

/// The reader (its response timeout covers a blocking read) and the writer.
async fn connections(source: &Source, config: &WorkerConfig) -> RedisResult<(Connection, Connection)> {
    let reader = connection::Timeouts { response: config.block + Duration::from_secs(10), retries: 6 };
    let writer = connection::Timeouts { response: Duration::from_secs(10), retries: 6 };
    Ok((source.connect(reader).await?, source.connect(writer).await?))
}

/// An entry of our PEL whose payload was deleted comes back without fields: a stale reference that the operator
/// drops as PayloadDeleted. It is not a message, so the handler never sees it.
fn messages(entries: Vec<RawEntry>) -> Vec<Message> {
    entries.into_iter().filter_map(|(id, fields)| Some(Message { id, fields: fields?, partition: None })).collect()
}

/// Whether a failed acknowledgement certainly wrote nothing: the server answered with an error (the scripts check
/// everything before their first write), as opposed to a connection that broke after the command was sent.
fn certainly_not_written(e: &RedisError) -> bool {
    e.code().is_some() && !e.is_io_error() && !e.is_timeout() && !e.is_connection_dropped()
}

/// Acknowledges `id` and counts it under `reason` in `{T}:pelican:<stream>:<group>:terminal`, atomically. Returns whether
/// this call removed the entry from the PEL; a repeated call returns `false` and counts nothing.
pub async fn ack_terminal(
    conn: &mut (impl ConnectionLike + Send),
    stream: &str,
    group: &str,
    id: &str,
    reason: &Reason,
) -> RedisResult<bool> {
    let acked: i64 = TERMINAL_ACK
        .key(stream)
        .key(terminal_key(stream, group))
        .key(errors_key(stream, group))
        .arg(group)
        .arg(id)
        .arg(reason.as_str())
        .invoke_async(conn)
        .await?;
    Ok(acked == 1)
}

/// How many ids of failed messages a worker remembers, to remove their last error with their ACK.
const ERRORS_REMEMBERED: usize = 10_000;

/// Records why the handler failed, as the entry's last error (cut to [`ERROR_TEXT_MAX`] bytes at a character
/// boundary). Best effort: a refusal (an ACL without `hset` on the errors key) is logged, and the message is retried
/// all the same.
async fn record_error(conn: &Connection, stream: &str, group: &str, id: &str, text: &str, counters: &Counters) {
    let mut end = text.len().min(ERROR_TEXT_MAX);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut record = redis::cmd("HSET");
    record.arg(errors_key(stream, group)).arg(id).arg(&text[..end]);
    let written: RedisResult<i64> = write_again_if_broken(conn, |mut conn| {
        let record = &record;
        async move { record.query_async(&mut conn).await }
    })
    .await;
    match written {
        Ok(_) => {
            let mut recorded = counters.errors_recorded.lock().expect("errors lock");
            // A message the operator requeues comes back under a new id, so its old id is never ACKed here: the
            // set is bounded instead of growing with every requeued failure. A field whose ACK then skips the HDEL
            // is removed by the operator's passes.
            if recorded.len() >= ERRORS_REMEMBERED {
                recorded.clear();
            }
            recorded.insert(id.to_string());
        }
        Err(e) => warn!(stream, group, entry_id = %id, error = %e, "could not record the message's last error"),
    }
}

/// Runs the handlers in flight that can go on now, until each waits: those that finish free their slots before the
/// read counts them (else a read would fetch for the slots left from the last one, and never for the ones its
/// handlers are about to free).
fn run_ready(running: &mut FuturesUnordered<impl Future<Output = ()>>) {
    while let Some(Some(())) = running.next().now_or_never() {}
}

/// Awaits `until` while polling the handlers in flight, which run in the read loop's task: every wait of that loop
/// goes through here, so that no handler waits for the loop.
async fn driving<T>(running: &mut FuturesUnordered<impl Future<Output = ()>>, until: impl Future<Output = T>) -> T {
    let mut until = std::pin::pin!(until);
    loop {
        tokio::select! {
            biased;
            out = &mut until => return out,
            Some(()) = running.next() => {}
        }
    }
}

/// A handler's future, polled once where it is (a handler that finishes without waiting, as most do between their
/// awaits, costs no task and no wake of another thread); one that has to wait goes on in a task of its own, so that
/// the handlers that wait run on all the runtime's threads, in parallel with each other and with the reads. Its
/// panic is raised again here (for the caller's catch); the task is aborted when this future is dropped (a handler
/// cut off by the shutdown grace stops with it).
async fn in_place_or_spawned<F>(handler: F) -> Result<Outcome, BoxError>
where
    F: Future<Output = Result<Outcome, BoxError>> + Send + 'static,
{
    let mut handler = Box::pin(handler);
    if let Some(result) = handler.as_mut().now_or_never() {
        return result;
    }
    // The trace context and the log span the handler runs in go with it.
    let mut task = AbortOnDrop(tokio::spawn(handler.with_current_context().in_current_span()));
    match (&mut task.0).await {
        Ok(result) => result,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Err("the handler's task was cancelled (the runtime is shutting down)".into()),
    }
}

/// Runs the handler for one message and performs its outcome, the only place that acknowledges: a `Done` by
/// queueing its XACK, the others by writing theirs.
async fn dispatch<H, Fut>(runtime: Dispatch<'_>, message: Message, handler: &H)
where
    H: Fn(Message) -> Fut,
    Fut: Future<Output = Result<Outcome, BoxError>> + Send + 'static,
{
    let Dispatch { config, writers, acks, counters, in_flight } = runtime;
    let id = message.id.clone();
    let (stream, group) = (config.stream.as_str(), config.group.as_str());
    // A requeued copy carries the message's earlier deliveries, and its last error under the copy's id.
    let retried = message.field(DELIVERIES_FIELD).is_some();
    let processing = trace::Processing { stream, group, consumer: &config.consumer };
    let started = Instant::now();
    let result = processing.run(&|message| in_place_or_spawned(handler(message)), message).await;
    let ran = started.elapsed();
    // Its outcome is being written from here on: no longer leased.
    if let Some(flight) = in_flight.lock().expect("in-flight lock").get_mut(&id) {
        flight.settled = true;
    }
    // The writer as it is now: a failover while the handler ran gave a new one.
    let conn = writers.borrow().clone();
    match result {
        Ok(Ok(Outcome::Done)) => {
            // A message that failed before (here, or elsewhere before it was requeued) may have a last error.
            let recorded = counters.errors_recorded.lock().expect("errors lock").remove(&id) || retried;
            // Settled (counted, out of flight) once its XACK is answered.
            let carried = {
                let mut queue = counters.acks.lock().expect("acks lock");
                queue.waiting.push(AckRequest { id, clear_error: recorded, ran });
                queue.carried
            };
            if !carried {
                let _ = acks.send(());
            }
            return;
        }
        Ok(Ok(Outcome::Terminal(reason))) => {
            warn!(stream, group, entry_id = %id, reason = %reason, will_ack = true, "message ended as terminal");
            counters.errors_recorded.lock().expect("errors lock").remove(&id);
            let acked = write_again_if_broken(&conn, |mut conn| {
                let (id, reason) = (&id, &reason);
                async move { ack_terminal(&mut conn, stream, group, id, reason).await }
            });
            match acked.await {
                Ok(_) => counters.count(Ended::Terminal, ran),
                Err(e) if certainly_not_written(&e) => {
                    warn!(stream, group, entry_id = %id, error = %e, "terminal ACK refused before any write; the message stays pending");
                    counters.left_pending(&id, ran)
                }
                Err(e) => {
                    warn!(stream, group, entry_id = %id, error = %e, "terminal ACK outcome unknown (the connection failed): the message may have been acknowledged and counted, or stays pending");
                    counters.left_pending(&id, ran)
                }
            }
        }
        Ok(Ok(Outcome::Retry)) => {
            // Not re-read here: the pass retries it (the give-back makes it look idle, not handed over). It looks
            // untouched since `idle` ago: a hand-over back to this worker (the only live one) may come within a
            // second, and is told by its idle all the same.
            let idle = counters.settings.lock().expect("settings lock").map(|s| s.min_idle_ms);
            let idle = idle.unwrap_or(UNPUBLISHED_IDLE.as_millis() as u64);
            let leasing = counters.leasing.lock().await;
            let now = Instant::now();
            let untouched = now.checked_sub(Duration::from_millis(idle)).unwrap_or(now);
            counters.failed_here.lock().expect("failed lock").insert(id.clone(), untouched);
            let given = write_again_if_broken(&conn, |mut conn| {
                let ids = std::slice::from_ref(&id);
                async move { give_back(&mut conn, config, ids, idle, true).await }
            });
            if let Err(e) = given.await {
                warn!(stream, group, entry_id = %id, error = %e, "could not give the message back for a retry: it is retried after minIdle");
                // Not given back: untouched since it failed here, never since `idle` ago.
                counters.failed_here.lock().expect("failed lock").insert(id.clone(), Instant::now());
            }
            drop(leasing);
            counters.count(Ended::Retried, ran);
        }
        Ok(Err(e)) => {
            warn!(stream, group, entry_id = %id, error = %e, "handler failed; the message stays pending for the operator's retry");
            counters.failed_here.lock().expect("failed lock").insert(id.clone(), Instant::now());
            record_error(&conn, stream, group, &id, &e.to_string(), counters).await;
            counters.count(Ended::Errored, ran);
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("a panic");
            error!(stream, group, entry_id = %id, panic = what, "handler panicked; the message stays pending");
            counters.failed_here.lock().expect("failed lock").insert(id.clone(), Instant::now());
            record_error(&conn, stream, group, &id, &format!("the handler panicked: {what}"), counters).await;
            counters.count(Ended::Panicked, ran);
        }
    }
    counters.landed(in_flight, &id);
}

/// What one handler's dispatch works with.
struct Dispatch<'a> {
    config: &'a WorkerConfig,
    writers: &'a watch::Receiver<Connection>,
    /// Wakes the acknowledger: a `Done` queued while no read is about to carry it.
    acks: &'a mpsc::UnboundedSender<()>,
    counters: &'a Counters,
    in_flight: &'a InFlight,
}

/// A `Done` acknowledgement, with whether the entry's last error goes with it, and how long its handler ran.
struct AckRequest {
    id: String,
    clear_error: bool,
    ran: Duration,
}

/// `Done` outcomes waiting for their XACK. The read loop's next read carries them (one round trip for the
/// acknowledgements and the read, as in a hand-written loop) until it sends a blocking read, waits or stops; from
/// then on the acknowledger writes them.
#[derive(Default)]
struct AckQueue {
    waiting: Vec<AckRequest>,
    /// The read loop reads again soon, without blocking: that read carries what waits here.
    carried: bool,
}

impl AckQueue {
    /// No read comes soon (a blocking one is sent, or the loop waits or stops): from here on a `Done` wakes the
    /// acknowledger. Answers whether something waits already, for the acknowledger to be woken.
    fn release(&mut self) -> bool {
        self.carried = false;
        !self.waiting.is_empty()
    }
}

/// Hands what waits to the acknowledger, which writes from here on what the handlers still finish.
fn release_acks(counters: &Counters, wake: &mpsc::UnboundedSender<()>) {
    if counters.acks.lock().expect("acks lock").release() {
        let _ = wake.send(());
    }
}

/// Why an acknowledgement failed: refused by the server (nothing written), or unknown (the connection failed).
enum AckFailure {
    Refused(String),
    Unknown(String),
}

impl AckFailure {
    fn of(e: &RedisError) -> AckFailure {
        if certainly_not_written(e) { AckFailure::Refused(e.to_string()) } else { AckFailure::Unknown(e.to_string()) }
    }
}

/// The most acknowledgements one XACK carries.
const ACK_BATCH: usize = 256;

/// One XACK of `acks`, and one HDEL of the errors hash for those that may have a last error (its reply ignored).
fn ack_pipeline(config: &WorkerConfig, acks: &[AckRequest]) -> redis::Pipeline {
    let (stream, group) = (&config.stream, &config.group);
    let mut pipe = redis::pipe();
    pipe.cmd("XACK").arg(stream).arg(group).arg(acks.iter().map(|r| &r.id).collect::<Vec<_>>());
    let cleared: Vec<&String> = acks.iter().filter(|r| r.clear_error).map(|r| &r.id).collect();
    if !cleared.is_empty() {
        pipe.cmd("HDEL").arg(errors_key(stream, group)).arg(cleared).ignore();
    }
    pipe
}

/// Counts acknowledgements answered (`Done`, or left pending when the XACK failed) and takes them out of flight.
fn settle_acks(
    config: &WorkerConfig,
    acks: Vec<AckRequest>,
    acked: Result<(), AckFailure>,
    counters: &Counters,
    in_flight: &InFlight,
) {
    let (stream, group) = (&config.stream, &config.group);
    for AckRequest { id, ran, .. } in acks {
        match &acked {
            Ok(()) => counters.count(Ended::Done, ran),
            Err(AckFailure::Refused(e)) => {
                warn!(stream, group, entry_id = %id, error = %e, "XACK refused; the message stays pending");
                counters.left_pending(&id, ran)
            }
            Err(AckFailure::Unknown(e)) => {
                warn!(stream, group, entry_id = %id, error = %e, "XACK outcome unknown (the connection failed): the message may have been acknowledged, or stays pending");
                counters.left_pending(&id, ran)
            }
        }
        counters.landed(in_flight, &id);
    }
}

/// Writes the `Done` acknowledgements no read carries, those of handlers that finished together in one round trip:
/// with 16 handlers in flight a message costs the server a sixteenth of a command, as in a hand-written batch loop.
/// Woken by each `Done` queued while no read is about to carry it; ends when every sender is gone and nothing waits.
async fn acknowledge(
    config: WorkerConfig,
    writers: watch::Receiver<Connection>,
    counters: Arc<Counters>,
    in_flight: InFlight,
    mut wakes: mpsc::UnboundedReceiver<()>,
) {
    while wakes.recv().await.is_some() {
        // Handlers that finished together queue theirs in the same turn of the runtime: let them.
        tokio::task::yield_now().await;
        while wakes.try_recv().is_ok() {}
        loop {
            let batch = {
                let mut queue = counters.acks.lock().expect("acks lock");
                let take = queue.waiting.len().min(ACK_BATCH);
                queue.waiting.drain(..take).collect::<Vec<_>>()
            };
            if batch.is_empty() {
                break;
            }
            let pipe = ack_pipeline(&config, &batch);
            let conn = writers.borrow().clone();
            let acked: RedisResult<(i64,)> = write_again_if_broken(&conn, |mut conn| {
                let pipe = &pipe;
                async move { pipe.query_async(&mut conn).await }
            })
            .await;
            settle_acks(&config, batch, acked.map(drop).map_err(|e| AckFailure::of(&e)), &counters, &in_flight);
        }
    }
}

/// `[[stream, [[id, [field, value, ...] | nil], ...]]]` -> (id, fields); `None` fields for a deleted payload.
type RawEntry = (String, Option<Vec<(Vec<u8>, Vec<u8>)>>);

fn parse_entries(reply: Value) -> Vec<RawEntry> {
    type Streams = Option<Vec<(String, Vec<(String, Option<Vec<Vec<u8>>>)>)>>;
    let streams: Streams = redis::from_redis_value(reply).unwrap_or_default();
    streams.into_iter().flatten().flat_map(|(_, entries)| entries).map(|(id, flat)| (id, flat.map(pairs))).collect()
}

/// `[field, value, ...]` -> pairs.
fn pairs(flat: Vec<Vec<u8>>) -> Vec<(Vec<u8>, Vec<u8>)> {
    flat.chunks_exact(2).map(|p| (p[0].clone(), p[1].clone())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "must be CamelCase")]
    fn terminal_with_an_invalid_code_panics_with_the_rule() {
        Outcome::terminal("record not found");
    }

    #[test]
    fn message_fields_are_raw_and_ordered() {
        let m = Message {
            id: "1-0".into(),
            fields: vec![(b"a".to_vec(), vec![0xff]), (b"a".to_vec(), b"2".to_vec())],
            partition: None,
        };
        assert_eq!(m.field("a"), Some(&[0xff][..]));
        assert_eq!(m.field_str("a"), None);
        assert_eq!(m.field("b"), None);
    }
}
