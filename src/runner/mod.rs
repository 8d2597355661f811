//! The data plane: one task per policy that runs its reclaim / dead-letter passes and consumer expiry, started,
//! updated and stopped by the controller.
//!
//! Why a pass did or did not run is decided here and only here:
//! - **Schedule.** Every `interval`, one sweep of the group's PEL: passes of at most `maxPerPass` entries, each
//!   following the last at once while the sweep is not done (a pass that hit its bound), so a backlog drains at
//!   the server's speed, not at `maxPerPass` per `interval`. Then the task sleeps until the next interval. A
//!   sweep's Events and log lines come once, when it ends.
//! - **Fairness.** A pass needs one of [`PASSES_PER_SERVER`] permits of its server; permits are handed out first
//!   come, first served, and released after every pass, so a policy with a million idle entries takes its turn
//!   between the passes of its small neighbours instead of before all of them. A pass ends at `maxPerPass`
//!   entries or after [`PASS_SLICE`], whichever comes first (the rest of the sweep follows at once, behind
//!   whoever waits), so no one holds a permit longer than that.
//! - **Drain pause.** With `--drain-pause` (0 by default; a `RedisServer`'s `drainPause` for its policies), a pass that ended before the end of its PEL (a backlog
//!   draining, after an outage) keeps its permit that long before letting the next pass of the server have it: the
//!   passes then take at most `PASS_SLICE / (PASS_SLICE + pause)` of each permit's time, whatever the policies.
//! - **Leadership.** No pass starts, and a running pass stops between two script calls, once this replica may no
//!   longer write ([`Leadership`]).
//! - **Retention.** When the stream's retention is `Acknowledged`, a sweep that reached the end of the PEL is
//!   followed, under the same permit, by one trim of what every group acknowledged.
//! - **Pods.** With `spec.consumers.pods`, each sweep starts by matching the group's consumers to the Pods the
//!   selector names ([`PodsOf`]): a consumer whose Pod was missing at two sweeps in a row (so a Pod created a moment
//!   ago and not yet in the watch is never taken for gone) has its entries retried by the sweep whatever their idle
//!   time, and is removed from the group once it holds nothing.
//! - **Failures.** Each job (pass, trim, consumer expiry) fails on its own: a failed trim or expiry takes nothing
//!   from the pass, and the next sweep runs them again. A failed pass is retried after 1 s, 2 s, 4 s ... 60 s. Every
//!   failure is logged, counted (`pelican_job_failures_total`) and kept in [`JobState::failures`] until that job
//!   succeeds, for the controller's Ready condition and Event.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::core::{PartialObjectMeta, Selector, SelectorExt};
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::Store;
use kube::{Resource, ResourceExt};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use crate::jobs::{self, PassReport, PassSettings};
use crate::leader::Leadership;
use crate::redis::{Conn, GroupKeys, PoolKey, Pools, Target};
use crate::telemetry::{Events, Metrics};

/// Where a policy's jobs say what they did: as Kubernetes Events about the policy (the operator), or, without a
/// cluster (`pelican local`), on a channel whose reader prints them.
#[derive(Clone)]
pub enum Announcer {
    Events(Events),
    Channel(tokio::sync::mpsc::UnboundedSender<Said>),
}

/// What a job announced, as its Event would have said it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Said {
    /// `namespace/name`.
    pub policy: String,
    pub type_: EventType,
    pub reason: String,
    pub note: String,
}

/// Passes running at once against one server. The server runs scripts one at a time anyway; two keep it busy
/// while the other pass waits on the network.
pub const PASSES_PER_SERVER: usize = 2;
/// The longest a pass holds its permit, give or take one script call (a few ms): a policy draining a million entries
/// then lets its neighbours' passes in every 100 ms, not every `maxPerPass` entries (a second or more of wide entries).
pub const PASS_SLICE: Duration = Duration::from_millis(100);
/// The longest wait between attempts after failed passes.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Everything a policy's task needs to run its jobs; sent again by the controller whenever it changes.
#[derive(Clone)]
pub struct Job {
    /// The shared connection to the policy's server, and which one it is (server and credentials).
    pub conn: Conn,
    pub pool: PoolKey,
    /// The server as shown in messages and used for fairness (one set of permits per server).
    pub server: String,
    pub stream: String,
    pub group: String,
    pub dead_letter: String,
    pub interval: Duration,
    pub pass: PassSettings,
    pub expire_after: Option<Duration>,
    /// `minAge` when the stream's effective retention is `Acknowledged`; `None`: never trim.
    pub retention: Option<Duration>,
    /// The server has `XTRIM ... ACKED`: the trim asks it to keep what any group has not acknowledged, too.
    pub acked_trim: bool,
    /// The policy, for Events.
    pub object: ObjectReference,
    /// `mode: Sentinel`: the sentinel target, asked again for the primary after a failed pass, so the jobs follow
    /// a failover at once instead of at the next reconcile.
    pub sentinel_source: Option<Target>,
    /// `spec.consumers.pods`.
    pub pods: Option<PodsOf>,
    /// The server's `drainPause`; `None`: the install's `--drain-pause`.
    pub drain_pause: Option<Duration>,
}

/// Where a policy's consumers run (`spec.consumers.pods`): the Pods of `namespace` that `selector` matches, as the
/// operator's watch of Pod metadata holds them.
#[derive(Clone)]
pub struct PodsOf {
    pub watch: PodWatch,
    pub namespace: String,
    pub selector: Selector,
}

/// The operator's watch of Pod metadata: its store, and whether the store is current (the watch's last word was a
/// listing or a change, not an error or a re-list in progress). A store the watch cannot keep current may miss Pods
/// created since, whose consumers would be taken for gone.
#[derive(Clone)]
pub struct PodWatch {
    pub store: Store<PartialObjectMeta<Pod>>,
    pub current: Arc<std::sync::atomic::AtomicBool>,
    /// The API server's words when it refused the watch for lack of a right (403), until the watch is current again:
    /// shown on every policy that names Pods, since no retry heals it until someone grants the right.
    pub forbidden: Arc<Mutex<Option<String>>>,
}

impl PartialEq for PodsOf {
    fn eq(&self, other: &PodsOf) -> bool {
        self.namespace == other.namespace && self.selector == other.selector
    }
}

impl PodsOf {
    /// The names of the Pods the selector matches (a terminating Pod still counts: its worker gives back what it
    /// will not finish); `None` while the watch has not listed the Pods yet, or is in trouble.
    fn names(&self) -> Option<BTreeSet<String>> {
        let store = &self.watch.store;
        store.wait_until_ready().now_or_never()?.ok()?;
        if !self.watch.current.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        let pods = store.state();
        let here = pods.iter().filter(|pod| pod.meta().namespace.as_deref() == Some(self.namespace.as_str()));
        Some(here.filter(|pod| self.selector.matches(pod.labels())).map(|pod| pod.name_any()).collect())
    }
}

impl Job {
    fn keys(&self) -> GroupKeys<'_> {
        GroupKeys { stream: &self.stream, group: &self.group, dead_letter: &self.dead_letter }
    }

    /// Whether `other` asks for the same work over the same connection. A replaced credential is another
    /// connection: the task must drop the old one, or it would keep it open.
    fn same_work(&self, other: &Job) -> bool {
        self.pool == other.pool
            && self.server == other.server
            && self.stream == other.stream
            && self.group == other.group
            && self.dead_letter == other.dead_letter
            && self.interval == other.interval
            && self.pass == other.pass
            && self.expire_after == other.expire_after
            && self.retention == other.retention
            && self.acked_trim == other.acked_trim
            && self.sentinel_source == other.sentinel_source
            && self.pods == other.pods
    }
}

/// How many consumers without a Pod the status names.
const WITHOUT_POD_SHOWN: usize = 10;

/// What the controller shows of a policy's jobs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobState {
    /// `spec.consumers.pods`: consumers whose Pod is gone, as the last sweep found them (the first few).
    pub without_pod: Vec<String>,
    /// When the last pass ended.
    pub last_pass: Option<Timestamp>,
    /// What the last retention trim did.
    pub trim: Option<jobs::Trim>,
    /// The jobs whose last run failed, each with why; a job's next success removes it.
    pub failures: BTreeMap<JobKind, JobFailure>,
}

impl JobState {
    /// Two partitions' jobs as one: the consumers without a Pod of both (the first few), the later pass, a trim that
    /// is pinned, and every failure (the first of a kind stays).
    pub fn merge(mut self, other: &JobState) -> JobState {
        for name in &other.without_pod {
            if self.without_pod.len() < WITHOUT_POD_SHOWN && !self.without_pod.contains(name) {
                self.without_pod.push(name.clone());
            }
        }
        self.last_pass = self.last_pass.max(other.last_pass);
        if self.trim.as_ref().is_none_or(|t| t.pinned_by.is_none()) && other.trim.is_some() {
            self.trim = other.trim.clone();
        }
        for (kind, failure) in &other.failures {
            self.failures.entry(*kind).or_insert_with(|| failure.clone());
        }
        self
    }
}

/// The task id of partition `index` of a policy's topic: `<namespace>/<name>#<index>` (a name holds no `#`).
pub fn partition_task(policy: &str, index: u32) -> String {
    format!("{policy}#{index}")
}

/// The policy a partition's task id belongs to; `None` for a policy's own task.
fn partition_of(id: &str) -> Option<&str> {
    id.rsplit_once('#').map(|(policy, _)| policy)
}

/// `(namespace, name)` of the policy a task belongs to, for logs and metric labels.
fn policy_names(id: &str) -> (&str, &str) {
    let policy = partition_of(id).unwrap_or(id);
    policy.split_once('/').unwrap_or_default()
}

/// The jobs of a policy, each run and failing on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum JobKind {
    Reclaim,
    Retention,
    ConsumerExpiry,
    /// `spec.consumers.pods`: matching the consumers to the Pods of the operator's watch.
    ConsumerPods,
}

impl JobKind {
    /// As the condition message, the log and the `task` label of `pelican_job_failures_total` name it.
    pub fn name(self) -> &'static str {
        match self {
            JobKind::Reclaim => "reclaim",
            JobKind::Retention => "retention",
            JobKind::ConsumerExpiry => "consumer-expiry",
            JobKind::ConsumerPods => "consumer-pods",
        }
    }
}

/// Why a job's last run failed: the error's condition reason, whether only a person can fix it, its message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobFailure {
    pub reason: &'static str,
    pub stalled: bool,
    pub message: String,
}

/// The policies' tasks, keyed by `namespace/name`.
pub struct Runner {
    tasks: Mutex<HashMap<String, Task>>,
    servers: Mutex<HashMap<String, Arc<Semaphore>>>,
    states: Arc<Mutex<HashMap<String, JobState>>>,
    metrics: Arc<Metrics>,
    leadership: Leadership,
    announcer: Announcer,
    pools: Arc<Pools>,
    drain_pause: Duration,
}

struct Task {
    job: watch::Sender<Job>,
    handle: JoinHandle<()>,
}

impl Drop for Task {
    fn drop(&mut self) {
        self.handle.abort();
    }
}

impl Runner {
    pub fn new(leadership: Leadership, announcer: Announcer, metrics: Arc<Metrics>, pools: Arc<Pools>) -> Runner {
        Runner {
            tasks: Mutex::default(),
            servers: Mutex::default(),
            states: Arc::default(),
            metrics,
            leadership,
            announcer,
            pools,
            drain_pause: Duration::ZERO,
        }
    }

    /// With the drain throttled: see the module's "Drain pause".
    pub fn with_drain_pause(mut self, pause: Duration) -> Runner {
        self.drain_pause = pause;
        self
    }

    /// Starts the policy's task, or hands it `job` when the work changed. A task keeps its cursor and schedule
    /// across updates.
    pub fn run(&self, policy: &str, job: Job) {
        let mut tasks = self.tasks.lock().expect("runner lock");
        if let Some(task) = tasks.get(policy).filter(|t| !t.handle.is_finished()) {
            task.job.send_if_modified(|current| {
                let changed = !current.same_work(&job);
                if changed {
                    *current = job;
                }
                changed
            });
            return;
        }
        let permits = self.permits(&job.server);
        let (sender, receiver) = watch::channel(job);
        let worker = PolicyTask {
            policy: policy.to_string(),
            job: receiver,
            permits,
            leadership: self.leadership.clone(),
            announcer: self.announcer.clone(),
            states: self.states.clone(),
            metrics: self.metrics.clone(),
            pools: self.pools.clone(),
            drain_pause: self.drain_pause,
        };
        self.states.lock().expect("runner states lock").entry(policy.to_string()).or_default();
        let handle = tokio::spawn(worker.run());
        tasks.insert(policy.to_string(), Task { job: sender, handle });
    }

    /// Stops the policy's task, and the task of each partition of its topic (suspended, Stalled, deleted). A script
    /// call in flight completes on the server.
    pub fn stop(&self, policy: &str) {
        let of_policy = |id: &String| id == policy || partition_of(id) == Some(policy);
        self.tasks.lock().expect("runner lock").retain(|id, _| !of_policy(id));
        self.states.lock().expect("runner states lock").retain(|id, _| !of_policy(id));
    }

    /// Forgets the pass permits of servers no task uses any more (each task holds its server's permits).
    pub fn sweep(&self) {
        self.servers.lock().expect("runner servers lock").retain(|_, permits| Arc::strong_count(permits) > 1);
    }

    /// Sizes of the runner's maps, for `pelican_state_entries`.
    pub fn sizes(&self) -> [(&'static str, usize); 3] {
        [
            ("runner_tasks", self.tasks.lock().expect("runner lock").len()),
            ("runner_servers", self.servers.lock().expect("runner servers lock").len()),
            ("runner_states", self.states.lock().expect("runner states lock").len()),
        ]
    }

    /// What the policy's jobs show: for a topic, its partitions' jobs as one ([`JobState::merge`]).
    pub fn state(&self, policy: &str) -> JobState {
        let states = self.states.lock().expect("runner states lock");
        let mut mine = states.iter().filter(|(id, _)| *id == policy || partition_of(id) == Some(policy));
        let Some((_, first)) = mine.next() else { return JobState::default() };
        mine.fold(first.clone(), |all, (_, state)| all.merge(state))
    }

    fn permits(&self, server: &str) -> Arc<Semaphore> {
        let mut servers = self.servers.lock().expect("runner servers lock");
        servers.entry(server.to_string()).or_insert_with(|| Arc::new(Semaphore::new(PASSES_PER_SERVER))).clone()
    }
}

struct PolicyTask {
    policy: String,
    job: watch::Receiver<Job>,
    permits: Arc<Semaphore>,
    leadership: Leadership,
    announcer: Announcer,
    states: Arc<Mutex<HashMap<String, JobState>>>,
    metrics: Arc<Metrics>,
    pools: Arc<Pools>,
    drain_pause: Duration,
}

/// A primary found after a failed pass, used until the controller sends the job again.
struct Followed {
    conn: Conn,
    pool: PoolKey,
    server: String,
}

/// Sleeps until `due`; returns at once when it is past (the next pass of a sweep), without waiting for the timer's
/// next tick, which a drain of a thousand passes would pay a thousand times.
async fn until(due: Instant) {
    if due > Instant::now() {
        tokio::time::sleep_until(due).await;
    }
}

impl PolicyTask {
    async fn run(mut self) {
        let mut cursor = jobs::Cursor::default();
        let mut next_sweep = Instant::now();
        let mut next_expiry = Instant::now();
        let mut failures: u32 = 0;
        let mut due = Instant::now();
        // What the passes of the current sweep did, announced once when the sweep ends.
        let mut sweep = PassReport::default();
        let mut followed: Option<Followed> = None;
        // Consumers whose Pod was missing at the last sweep's start: missing again, they are gone.
        let mut suspects = BTreeSet::new();
        loop {
            tokio::select! {
                _ = until(due) => {}
                changed = self.job.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    followed = None;
                    if self.job.borrow().retention.is_none() {
                        // No retention any more: what the last trim saw (who pinned the stream) is no longer true.
                        self.update_state(|state| {
                            state.trim = None;
                            state.failures.remove(&JobKind::Retention);
                        });
                    }
                    if self.job.borrow().pods.is_none() {
                        self.update_state(|state| {
                            state.failures.remove(&JobKind::ConsumerPods);
                        });
                    }
                    // New settings take effect at once (a shorter interval, say).
                    due = Instant::now();
                    continue;
                }
            }
            let mut job = self.job.borrow_and_update().clone();
            if let Some(primary) = &followed {
                (job.conn, job.pool, job.server) = (primary.conn.clone(), primary.pool.clone(), primary.server.clone());
            }
            if !self.leadership.may_write() {
                due = Instant::now() + Duration::from_millis(500);
                continue;
            }
            // From the moment the pass was due (its interval elapsed, or the previous pass of its sweep ended), or
            // later when a sweep outlasted its interval, to the moment it got a permit of its server.
            let asking = Instant::now();
            let Ok(permit) = self.permits.clone().acquire_owned().await else { return };
            self.metrics.pass_started(asking.elapsed());
            let sweep_start = cursor.at_start();
            if sweep_start {
                cursor.gone_listed_at = Some(std::time::Instant::now());
                cursor.gone = match &job.pods {
                    Some(pods) => Box::pin(self.without_pods(&job, pods, &mut suspects)).await,
                    None => Vec::new(),
                };
            }
            // Boxed: a sleeping task then holds only its small loop state, not the largest state of a pass (10,000
            // policies mean 10,000 sleeping tasks).
            let result = Box::pin(self.pass(&job, &mut cursor)).await;
            self.outcome(JobKind::Reclaim, &result);
            // A failed trim is reported on its own and retried after the next sweep; it takes nothing from the pass.
            if let (Ok(report), Some(min_age)) = (&result, job.retention)
                && cursor.at_start()
                && !report.interrupted
                && self.leadership.may_write()
            {
                let trimmed = Box::pin(self.trim(&job, min_age)).await;
                self.outcome(JobKind::Retention, &trimmed);
            }
            // A backlog draining: the server's permit rests before the next pass may have it (its `drainPause`, or
            // the install's `--drain-pause`).
            let draining = result.as_ref().is_ok_and(|report| !cursor.at_start() && !report.interrupted);
            let pause = job.drain_pause.unwrap_or(self.drain_pause);
            if draining && !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            drop(permit);
            match result {
                Ok(report) => {
                    failures = 0;
                    if sweep_start {
                        next_sweep = Instant::now() + job.interval;
                    }
                    sweep.merge(&report);
                    // Mid-sweep (the pass hit maxPerPass): go on at once, behind whoever waits for a permit.
                    let mid_sweep = !cursor.at_start() && !report.interrupted;
                    if !mid_sweep {
                        Box::pin(self.announce(&job, &std::mem::take(&mut sweep))).await;
                        if !cursor.gone.is_empty() && self.leadership.may_write() {
                            Box::pin(self.remove_gone(&job, &cursor.gone)).await;
                        }
                    }
                    due = if mid_sweep { Instant::now() } else { next_sweep };
                }
                Err(_) => {
                    failures = (failures + 1).min(7);
                    due = Instant::now() + Duration::from_secs(1 << (failures - 1)).min(MAX_BACKOFF);
                    if let Some(source) = &job.sentinel_source {
                        followed = self.follow_primary(source, &job).await.or(followed);
                    }
                }
            }
            if let Some(expire_after) = job.expire_after
                && Instant::now() >= next_expiry
                && self.leadership.may_write()
            {
                next_expiry = Instant::now() + job.interval;
                let mut conn = job.conn.clone();
                let expired = Box::pin(jobs::expire_consumers(&mut conn, &job.server, &job.keys(), expire_after)).await;
                self.outcome(JobKind::ConsumerExpiry, &expired);
                if let Ok(expired @ 1..) = expired {
                    let note =
                        format!("deleted {expired} consumers idle for {expire_after:?} that owned no pending entries");
                    self.publish(&job, EventType::Normal, "ConsumersExpired", note).await;
                }
            }
        }
    }

    /// The consumers whose Pod is gone: missing from the Pods the selector matches now and at the last sweep's start
    /// (`suspects`, replaced by what is missing now). None while the watch has not listed the Pods, or when the
    /// consumers cannot be listed (the `consumer-pods` job's failure says why: more than
    /// [`jobs::CONSUMERS_LISTED_MAX`], say).
    async fn without_pods(&self, job: &Job, pods: &PodsOf, suspects: &mut BTreeSet<String>) -> Vec<String> {
        let Some(live) = pods.names() else {
            // Nothing is taken for gone on a store that may be stale; two sweeps of a current one are needed again.
            suspects.clear();
            if let Some(detail) = pods.watch.forbidden.lock().expect("pod watch lock").clone() {
                self.outcome(JobKind::ConsumerPods, &Err::<(), _>(crate::Error::PodsForbidden { detail }));
            }
            return Vec::new();
        };
        let mut conn = job.conn.clone();
        let listed = jobs::consumers(&mut conn, &job.server, &job.keys()).await;
        self.outcome(JobKind::ConsumerPods, &listed);
        let Ok(consumers) = listed else { return Vec::new() };
        let missing: BTreeSet<String> = consumers.into_iter().filter(|c| !live.contains(c)).collect();
        let gone: Vec<String> = missing.intersection(suspects).take(jobs::GONE_MAX).cloned().collect();
        *suspects = missing;
        self.update_state(|state| state.without_pod = gone.iter().take(WITHOUT_POD_SHOWN).cloned().collect());
        gone
    }

    /// Removes the consumers without a Pod that hold nothing any more (the sweep retried their entries).
    async fn remove_gone(&self, job: &Job, gone: &[String]) {
        let mut conn = job.conn.clone();
        let removed = jobs::remove_consumers(&mut conn, &job.server, &job.keys(), gone).await;
        self.outcome(JobKind::ConsumerExpiry, &removed);
        if let Ok(removed @ 1..) = removed {
            let names = gone.iter().take(WITHOUT_POD_SHOWN).cloned().collect::<Vec<_>>().join(", ");
            let note =
                format!("removed {removed} consumers whose Pod is gone and that held nothing any more ({names})");
            self.publish(job, EventType::Normal, "ConsumersRemoved", note).await;
        }
    }

    /// After a failed pass in Sentinel mode: the primary the sentinels name now, when it is another server than the
    /// job's and answers as a primary (a failover the next reconcile would only see an interval later).
    async fn follow_primary(&self, source: &Target, job: &Job) -> Option<Followed> {
        let (primary, conn) = self.pools.connect_primary(source).await.ok()?;
        let pool = primary.pool_key();
        if pool == job.pool {
            return None;
        }
        let (namespace, name) = policy_names(&self.policy);
        info!(namespace, name, from = job.server, to = primary.server(), "following the primary the sentinels name");
        Some(Followed { conn, pool, server: primary.server() })
    }

    /// Changes what the controller shows of this policy's jobs; nothing once the task was stopped (its state is
    /// gone with it and must not come back).
    fn update_state(&self, change: impl FnOnce(&mut JobState)) {
        if let Some(state) = self.states.lock().expect("runner states lock").get_mut(&self.policy) {
            change(state);
        }
    }

    /// Records how a job's run ended, for the policy's status and `pelican_job_failures_total`.
    fn outcome<T>(&self, kind: JobKind, result: &crate::Result<T>) {
        self.update_state(|state| match result {
            Ok(_) => {
                state.failures.remove(&kind);
            }
            Err(e) => {
                let (namespace, name) = policy_names(&self.policy);
                warn!(namespace, name, job = kind.name(), reason = e.reason(), error = %e, "job failed");
                self.metrics.job_failed((namespace.into(), name.into()), kind.name(), e.reason());
                let failure = JobFailure { reason: e.reason(), stalled: e.is_stalled(), message: e.to_string() };
                state.failures.insert(kind, failure);
            }
        });
    }

    async fn pass(&self, job: &Job, cursor: &mut jobs::Cursor) -> crate::Result<PassReport> {
        let leadership = &self.leadership;
        let mut conn = job.conn.clone();
        let report =
            jobs::reclaim_pass(&mut conn, &job.server, &job.keys(), &job.pass, cursor, &|| leadership.may_write())
                .await?;
        let (namespace, name) = policy_names(&self.policy);
        debug!(
            namespace,
            name,
            scanned = report.scanned,
            idle = report.idle,
            skipped = report.skipped,
            interrupted = report.interrupted,
            "reclaim pass: {}",
            report.summary()
        );
        let now = Timestamp::now();
        self.update_state(|state| state.last_pass = Some(now));
        Ok(report)
    }

    async fn trim(&self, job: &Job, min_age: Duration) -> crate::Result<()> {
        let mut conn = job.conn.clone();
        let trim = jobs::trim_acknowledged(&mut conn, &job.server, &job.keys(), min_age, job.acked_trim).await?;
        if trim.trimmed > 0 {
            let (namespace, name) = policy_names(&self.policy);
            let pinned_by = trim.pinned_by.as_ref().map(ToString::to_string);
            info!(namespace, name, trimmed = trim.trimmed, pinned_by, "trimmed entries every group acknowledged");
        }
        self.update_state(|state| state.trim = Some(trim));
        Ok(())
    }

    /// One Event per sweep that moved something, never one per message or per pass.
    async fn announce(&self, job: &Job, report: &PassReport) {
        let (namespace, name) = policy_names(&self.policy);
        if report.dead_letter_evicted > 0 {
            let note = format!(
                "spec.deadLetter.maxLen {} dropped {} older dead letters to make room",
                job.pass.dead_letter_max_len.unwrap_or_default(),
                report.dead_letter_evicted
            );
            warn!(namespace, name, evicted = report.dead_letter_evicted, "{note}");
            self.publish(job, EventType::Warning, "DeadLettersEvicted", note).await;
        }
        if report.consumers_unlisted > 0 {
            let note = format!(
                "Reassign requeued instead of handing over: the group has {} consumers, more than the {} Pelican lists \
                 in one call (XINFO CONSUMERS holds the server for as long as there are); delete the consumers nobody \
                 uses (XGROUP DELCONSUMER) and give workers stable names (the Pod's)",
                report.consumers_unlisted,
                jobs::CONSUMERS_LISTED_MAX
            );
            warn!(namespace, name, consumers = report.consumers_unlisted, "{note}");
            self.publish(job, EventType::Warning, "TooManyConsumers", note).await;
        }
        if report.moved() == 0 && report.too_large == 0 {
            return;
        }
        let note = format!("pass: {}", report.summary());
        info!(
            namespace,
            name,
            requeued = report.requeued,
            reassigned = report.reassigned,
            dead_lettered = report.dead_lettered,
            payload_deleted = report.payload_deleted,
            too_large = report.too_large,
            "{note}"
        );
        let (type_, reason) = match (report.dead_lettered, report.too_large) {
            (0, 0) => (EventType::Normal, "Reclaimed"),
            (_, 0) => (EventType::Warning, "DeadLettered"),
            _ => (EventType::Warning, "EntryTooLarge"),
        };
        self.publish(job, type_, reason, note).await;
    }

    async fn publish(&self, job: &Job, type_: EventType, reason: &str, note: String) {
        match &self.announcer {
            Announcer::Events(events) => {
                let event =
                    Event { type_, reason: reason.into(), note: Some(note), action: "Reclaim".into(), secondary: None };
                if let Err(e) = events.publish(&event, &job.object).await {
                    warn!(policy = self.policy, error = %e, reason, "could not publish event");
                }
            }
            Announcer::Channel(said) => {
                // The reader is gone only when the process is stopping.
                let _ = said.send(Said { policy: self.policy.clone(), type_, reason: reason.into(), note });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_task_belongs_to_its_policy() {
        let task = partition_task("ns/orders", 7);
        assert_eq!(task, "ns/orders#7");
        assert_eq!(partition_of(&task), Some("ns/orders"));
        assert_eq!(partition_of("ns/orders"), None);
        assert_eq!(policy_names(&task), ("ns", "orders"), "metrics and logs name the policy, not the partition");
    }

    #[test]
    fn the_partitions_jobs_show_as_one() {
        let failure =
            |message: &str| JobFailure { reason: "RedisUnavailable", stalled: false, message: message.into() };
        let first = JobState {
            without_pod: vec!["a".into()],
            last_pass: Some(Timestamp::from_second(100).unwrap()),
            failures: [(JobKind::Reclaim, failure("partition 0"))].into(),
            ..JobState::default()
        };
        let second = JobState {
            without_pod: vec!["a".into(), "b".into()],
            last_pass: Some(Timestamp::from_second(200).unwrap()),
            failures: [(JobKind::Reclaim, failure("partition 1")), (JobKind::Retention, failure("partition 1"))].into(),
            ..JobState::default()
        };
        let all = first.merge(&second);
        assert_eq!(all.without_pod, ["a", "b"]);
        assert_eq!(all.last_pass, Some(Timestamp::from_second(200).unwrap()), "the latest pass of any partition");
        assert_eq!(all.failures.len(), 2);
        assert_eq!(all.failures[&JobKind::Reclaim].message, "partition 0");
    }
}
