//! A topic's worker (contract/README.md, "Topics (contract version 2)"): a member of the topic's group that owns the
//! partitions `membership.lua` assigns it, and runs a [`Worker`] on each one it owns: its pending list taken over
//! first, then new entries. Released partitions are finished and given back (as on SIGTERM); lost ones are dropped
//! at once, no outcome written. On an `ordering: PerKey` topic each partition runs in order per key instead
//! ([`super::in_order`]).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redis::{RedisError, RedisResult, Value};
use tokio::sync::watch;
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::Instant;
use tracing::{info, warn};

use super::connection::{Connection, Source, Timeouts};
use super::in_order::{Spacing, run_in_order};
use super::{BoxError, ContractStop, Message, Outcome, Worker, WorkerConfig, WorkerStats};
use crate::keys::{TOPIC_CONTRACT_VERSION, UnknownContract, partition_stream, settings_key};
use crate::topic::{Assignment, MAX_PARTITIONS, Member, heartbeat};

/// How a topic's worker is set up: `worker` as for a stream, its `stream` the topic (the policy's `spec.stream`),
/// its `consumer` the member's name (the consumer on every partition it owns), its concurrency each partition's.
#[derive(Clone, Debug)]
pub struct TopicWorkerConfig {
    pub worker: WorkerConfig,
    /// How long the membership lives without a heartbeat (1 s .. a day; 10 s by default): a heartbeat every third of
    /// it. A worker that cannot beat for that long stops every partition it had.
    pub ttl: Duration,
}

/// The membership's default ttl.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);

impl TopicWorkerConfig {
    pub fn new(topic: impl Into<String>, group: impl Into<String>, member: impl Into<String>) -> Self {
        TopicWorkerConfig { worker: WorkerConfig::new(topic, group, member), ttl: DEFAULT_TTL }
    }
}

/// Why a topic's worker does not start, or stopped.
#[derive(Debug)]
pub enum TopicWorkerError {
    /// The group's settings describe no topic: no policy with `spec.partitions` (yet) for this stream and group.
    NotATopic { topic: String, group: String },
    /// The settings speak a contract this SDK does not know for topics.
    UnknownContract(UnknownContract),
    /// An `ordering` this SDK does not know.
    OrderingUnsupported { topic: String, ordering: String },
    /// The ttl is outside 1 s .. a day, or the block is zero.
    InvalidConfig(String),
    /// The server refused or failed the membership or the settings read (`PELICAN_TOO_MANY_MEMBERS` included).
    Redis(RedisError),
}

impl std::fmt::Display for TopicWorkerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TopicWorkerError::NotATopic { topic, group } => write!(
                f,
                "the settings of {topic:?} group {group:?} describe no topic: apply its policy with spec.partitions, \
                 or run a Worker for a stream"
            ),
            TopicWorkerError::UnknownContract(unknown) => write!(f, "{unknown}"),
            TopicWorkerError::OrderingUnsupported { topic, ordering } => write!(
                f,
                "topic {topic:?} has ordering {ordering:?}, which this SDK does not know (None, PerKey): upgrade the SDK"
            ),
            TopicWorkerError::InvalidConfig(what) => write!(f, "{what}"),
            TopicWorkerError::Redis(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for TopicWorkerError {}

/// A member of a topic's group.
pub struct TopicWorker {
    source: Source,
    conn: Connection,
    config: TopicWorkerConfig,
    member: Member,
    /// `PerKey`: how its retries are spaced in place; `None` for `ordering: None`.
    in_order: Option<Spacing>,
}

/// A partition's worker while it runs.
struct Owned {
    epoch: u64,
    stop: watch::Sender<bool>,
    task: AbortHandle,
    releasing: bool,
}

/// How a partition's worker ended: its partition and epoch, and its counts (or why it could not run).
type Ended = (u32, u64, Result<WorkerStats, PartitionFailure>);

enum PartitionFailure {
    Redis(RedisError),
    Contract(ContractStop),
}

impl TopicWorker {
    /// Reads the topic's settings (`contractVersion` 2 first, then `partitions` and `ordering`) and connects.
    pub async fn connect_to(source: Source, config: TopicWorkerConfig) -> Result<TopicWorker, TopicWorkerError> {
        if !(Duration::from_secs(1)..=Duration::from_secs(86_400)).contains(&config.ttl) {
            let ttl = config.ttl;
            return Err(TopicWorkerError::InvalidConfig(format!(
                "TopicWorkerConfig.ttl must be 1 s .. 1 day, got {ttl:?}"
            )));
        }
        if config.worker.block.is_zero() {
            return Err(TopicWorkerError::InvalidConfig("WorkerConfig.block must be at least 1 ms".into()));
        }
        let timeouts = Timeouts { response: Duration::from_secs(10), retries: 6 };
        let mut conn = source.connect(timeouts).await.map_err(TopicWorkerError::Redis)?;
        let (topic, group) = (config.worker.stream.clone(), config.worker.group.clone());
        let settings: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(settings_key(&topic, &group))
            .query_async(&mut conn)
            .await
            .map_err(TopicWorkerError::Redis)?;
        let version = settings.get("contractVersion").cloned().unwrap_or_default();
        if version != TOPIC_CONTRACT_VERSION.to_string() {
            if !settings.contains_key("partitions") {
                return Err(TopicWorkerError::NotATopic { topic, group });
            }
            return Err(TopicWorkerError::UnknownContract(UnknownContract {
                operator: version,
                known: TOPIC_CONTRACT_VERSION,
            }));
        }
        let partitions = settings.get("partitions").and_then(|n| n.parse::<u32>().ok());
        let Some(partitions) = partitions.filter(|n| (1..=MAX_PARTITIONS).contains(n)) else {
            return Err(TopicWorkerError::NotATopic { topic, group });
        };
        let in_order = match settings.get("ordering").map(String::as_str) {
            None | Some("None") => None,
            Some("PerKey") => {
                let factor = settings.get("backoffFactor").and_then(|f| f.parse().ok()).unwrap_or(1);
                let max = settings.get("backoffMaxMs").and_then(|m| m.parse().ok()).filter(|m| *m > 0);
                Some(Spacing { factor, max: max.map(Duration::from_millis) })
            }
            Some(ordering) => return Err(TopicWorkerError::OrderingUnsupported { topic, ordering: ordering.into() }),
        };
        let member = Member { topic, group, name: config.worker.consumer.clone(), ttl: config.ttl, partitions };
        Ok(TopicWorker { source, conn, config, member, in_order })
    }

    /// The topic's partitions (N).
    pub fn partitions(&self) -> u32 {
        self.member.partitions
    }

    /// Runs until `shutdown` resolves: joins the group, beats every `ttl / 3`, runs a worker on each partition it
    /// owns; then stops them all as a [`Worker`] stops (in-flight handlers finish within the grace, the rest is
    /// given back) and leaves the group. Answers the counts of every partition's worker, summed. A join beyond the
    /// group's 1,024 members is the error, and so are settings that change to a contract this SDK does not know.
    pub async fn run<H, Fut>(
        mut self,
        handler: H,
        shutdown: impl Future<Output = ()>,
    ) -> Result<WorkerStats, TopicWorkerError>
    where
        H: Fn(Message) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Outcome, BoxError>> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let mut shutdown = std::pin::pin!(shutdown);
        let mut owned: BTreeMap<u32, Owned> = BTreeMap::new();
        let mut tasks: JoinSet<Ended> = JoinSet::new();
        let mut released: Vec<u32> = Vec::new();
        let mut stats = WorkerStats::default();
        // When the last answered heartbeat was sent: past the ttl, the partitions may be another's.
        let mut beat_at: Option<Instant> = None;
        let mut failure = None;
        loop {
            let sent = Instant::now();
            match heartbeat(&mut self.conn, &self.member, false, &released).await {
                Ok(assignment) => {
                    released.clear();
                    beat_at = Some(sent);
                    self.follow(assignment, &mut owned, &mut tasks, &handler);
                }
                Err(e) if beat_at.is_none() => return Err(TopicWorkerError::Redis(e)),
                Err(e) => {
                    warn!(topic = %self.member.topic, group = %self.member.group, error = %e, "membership heartbeat failed; retrying");
                    if beat_at.is_some_and(|at| at.elapsed() >= self.config.ttl) && !owned.is_empty() {
                        warn!(topic = %self.member.topic, partitions = ?owned.keys().collect::<Vec<_>>(), "no heartbeat answered within the ttl: the partitions may be another's, stopped at once");
                        owned.values().for_each(|o| o.task.abort());
                        owned.clear();
                    }
                }
            }
            let beat = tokio::time::sleep(self.config.ttl / 3);
            tokio::pin!(beat);
            // Until the next beat; a released partition whose worker finished is said at once.
            let said_at_once = loop {
                tokio::select! {
                    _ = &mut shutdown => break None,
                    _ = &mut beat => break Some(false),
                    Some(ended) = tasks.join_next(), if !tasks.is_empty() => {
                        let Ok((partition, epoch, result)) = ended else { continue }; // a lost partition, aborted
                        if owned.get(&partition).is_none_or(|o| o.epoch != epoch) {
                            continue;
                        }
                        let ended = owned.remove(&partition).expect("just found");
                        match result {
                            Ok(counts) => add(&mut stats, &counts),
                            Err(PartitionFailure::Contract(stop)) => {
                                add(&mut stats, &stop.stats);
                                failure = Some(TopicWorkerError::UnknownContract(stop.unknown));
                                break None;
                            }
                            Err(PartitionFailure::Redis(e)) => {
                                warn!(topic = %self.member.topic, partition, error = %e, "the partition's worker could not run; started again at the next heartbeat");
                            }
                        }
                        if ended.releasing {
                            released.push(partition);
                            break Some(true);
                        }
                    }
                }
            };
            if said_at_once.is_none() {
                break;
            }
        }
        // Every partition stops as a worker does on SIGTERM, then the member leaves.
        owned.values().for_each(|o| _ = o.stop.send(true));
        while let Some(ended) = tasks.join_next().await {
            match ended {
                Ok((_, _, Ok(counts))) => add(&mut stats, &counts),
                Ok((_, _, Err(PartitionFailure::Contract(stop)))) => add(&mut stats, &stop.stats),
                Ok((partition, _, Err(PartitionFailure::Redis(e)))) => {
                    warn!(topic = %self.member.topic, partition, error = %e, "the partition's worker could not run")
                }
                Err(_) => {}
            }
        }
        match heartbeat(&mut self.conn, &self.member, true, &[]).await {
            Ok(_) => {
                info!(topic = %self.member.topic, group = %self.member.group, member = %self.member.name, "left the topic's group")
            }
            Err(e) => {
                warn!(topic = %self.member.topic, error = %e, "could not leave the group: its partitions move when the membership expires")
            }
        }
        match failure {
            Some(failure) => Err(failure),
            None => Ok(stats),
        }
    }

    /// Starts a worker on each partition newly owned (or owned under a new epoch: it was lost and came back), drops
    /// the ones lost at once, and stops the ones to release as on SIGTERM.
    fn follow<H, Fut>(
        &self,
        assignment: Assignment,
        owned: &mut BTreeMap<u32, Owned>,
        tasks: &mut JoinSet<Ended>,
        handler: &Arc<H>,
    ) where
        H: Fn(Message) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Outcome, BoxError>> + Send + 'static,
    {
        let now: HashMap<u32, u64> = assignment.owned.iter().copied().collect();
        owned.retain(|partition, running| {
            let kept = now.get(partition) == Some(&running.epoch);
            if !kept {
                warn!(topic = %self.member.topic, partition, "partition lost (its membership expired): stopped at once");
                running.task.abort();
            }
            kept
        });
        for (partition, epoch) in assignment.owned {
            if owned.contains_key(&partition) {
                continue;
            }
            let (stop, stopped) = watch::channel(false);
            let config =
                WorkerConfig { stream: partition_stream(&self.member.topic, partition), ..self.config.worker.clone() };
            let (source, handler) = (self.source.clone(), handler.clone());
            let handler = Arc::new(move |message: Message| handler(Message { partition: Some(partition), ..message }));
            let task = match self.in_order {
                None => tasks
                    .spawn(async move { (partition, epoch, run_partition(source, config, handler, stopped).await) }),
                Some(spacing) => tasks.spawn(async move {
                    let run = run_in_order(source, config, spacing, handler, stopped);
                    (partition, epoch, run.await.map_err(PartitionFailure::Redis))
                }),
            };
            info!(topic = %self.member.topic, partition, epoch, "partition taken");
            owned.insert(partition, Owned { epoch, stop, task, releasing: false });
        }
        for partition in assignment.release {
            if let Some(running) = owned.get_mut(&partition).filter(|o| !o.releasing) {
                info!(topic = %self.member.topic, partition, "releasing the partition: its messages in flight finish first");
                running.releasing = true;
                let _ = running.stop.send(true);
            }
        }
    }
}

/// A partition's worker: takes over the partition's whole pending list, then runs until `stop` says true.
async fn run_partition<H, Fut>(
    source: Source,
    config: WorkerConfig,
    handler: Arc<H>,
    mut stop: watch::Receiver<bool>,
) -> Result<WorkerStats, PartitionFailure>
where
    H: Fn(Message) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Outcome, BoxError>> + Send + 'static,
{
    let worker =
        Worker::speaking(source, config.clone(), TOPIC_CONTRACT_VERSION).await.map_err(PartitionFailure::Redis)?;
    take_over(&mut worker.writer(), &config).await.map_err(PartitionFailure::Redis)?;
    let stopped = async move {
        let _ = stop.wait_for(|stopped| *stopped).await;
    };
    worker.run(move |message| handler(message), stopped).await.map_err(PartitionFailure::Contract)
}

/// The most entries one `XAUTOCLAIM` of a take-over moves.
const TAKE_OVER_BATCH: usize = 100;

/// Moves the partition's whole pending list to this member (`XAUTOCLAIM ... 0 ... JUSTID`, a page at a time from the
/// cursor it answers): the previous owner's entries, this member's own from before, those given back without an
/// owner. The worker's first read of its own pending list then hands them out in id order, each counted as a
/// delivery there, once (`JUSTID` counts none), so that a message that kills its workers still reaches the cap.
pub(super) async fn take_over(conn: &mut Connection, config: &WorkerConfig) -> RedisResult<()> {
    let mut cursor = "0-0".to_string();
    loop {
        let reply: Vec<Value> = redis::cmd("XAUTOCLAIM")
            .arg(&config.stream)
            .arg(&config.group)
            .arg(&config.consumer)
            .arg(0)
            .arg(&cursor)
            .arg("COUNT")
            .arg(TAKE_OVER_BATCH)
            .arg("JUSTID")
            .query_async(conn)
            .await?;
        cursor = match reply.first() {
            Some(next) => redis::from_redis_value(next.clone())?,
            None => return Ok(()),
        };
        if cursor == "0-0" {
            return Ok(());
        }
    }
}

fn add(total: &mut WorkerStats, counts: &WorkerStats) {
    total.done += counts.done;
    total.terminal += counts.terminal;
    total.failed += counts.failed;
    total.retried += counts.retried;
    total.abandoned += counts.abandoned;
}
