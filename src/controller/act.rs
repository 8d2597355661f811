//! Phase 3b, act: the IO of converging Redis on what the policy says, in the order [`super::plan`] decides it:
//! connect, set the group up, hand the data-plane work to the runner, read the numbers the status shows, write
//! the bound. On deletion, apply the `deletionPolicy`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::Api;
use kube::core::Selector;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use tracing::{info, warn};

use futures::{StreamExt, TryStreamExt};

use super::validate::{self, Schedule};
use super::{Context, id, plan, publish, topic};
use crate::api::{ConsumerGroupPolicy, DeletionPolicy, PartitionsStatus};
use crate::context::policy_id;
use crate::keys::{self, WorkerSettings};
use crate::redis::{
    self as redis_ops, Claim, Conn, Destroyed, Features, GroupFacts, GroupKeys, GroupSetup, Pools, ServerInfo, Target,
    TopicSettings, Unread,
};
use crate::runner::{Job, PodWatch, PodsOf, Runner, partition_task};
use crate::{Error, Result};

/// What one reconcile saw on the server.
pub struct Observation {
    pub server: ServerInfo,
    pub facts: GroupFacts,
    /// The stream's effective retention in words, when this policy or a neighbour on its stream sets one.
    pub retention: Option<String>,
    /// `mode: Sentinel`: the primary the sentinel named.
    pub primary: Option<String>,
    /// What the server can do (`COMMAND INFO`, `COMMAND DOCS`).
    pub features: Features,
    /// `spec.reclaim.interval`, as the reconcile parsed it: the spacing of the progress samples.
    pub interval: std::time::Duration,
    /// The stream's window of idempotent production.
    pub idempotence: plan::Idempotence,
    /// How long the passes still apply a higher `minIdle` than the policy's, lowered a moment ago (zero: none).
    pub min_idle_held_for: Duration,
    /// A topic's partitions at a glance (`spec.partitions`); `facts` are then the topic's sums ([`topic::facts`]).
    pub partitions: Option<PartitionsStatus>,
}

/// What converging a policy needs from whoever runs it: the operator's reconcile ([`Context`]), or `pelican local`,
/// which has Redis and no cluster. Both converge through [`converge`], so the jobs have one code path.
/// This install as it claims each group on its server (`scripts/claim_group.lua`): `--install-id` (by default the
/// cluster's and the leader Lease's names), and `--passive` (claim nothing, only report).
#[derive(Clone, Debug)]
pub struct Claimant {
    pub id: String,
    pub passive: bool,
}

/// How long a group's claim outlives its owner's last renewal: three reconciles (each renews it), at least 15 s.
pub fn claim_lifetime(schedule: &Schedule) -> Duration {
    (schedule.interval * 3).max(Duration::from_secs(15))
}

/// Why this install must leave the policy's group to another (two installs on one Redis): another holds its claim,
/// or this one is passive. Only looks: a redrive or a seek never claims a group; the install that runs it does.
pub async fn run_elsewhere(
    conn: &mut Conn,
    server: &str,
    policy: &ConsumerGroupPolicy,
    claimant: &Claimant,
) -> Result<Option<Error>> {
    let group = (policy.spec.stream.as_str(), policy.spec.group.as_str());
    let claim = redis_ops::claim_group(conn, server, group, &claimant.id, Duration::ZERO, true).await?;
    let (server, me) = (server.to_string(), claimant.id.clone());
    Ok(match claim {
        Claim::Theirs { owner, left } if !claimant.passive => {
            Some(Error::AnotherInstallRuns { server, owner, me, left: left.as_secs() })
        }
        Claim::Theirs { owner, .. } => {
            Some(Error::Passive { server, me, owner: format!("the install {owner} runs its jobs") })
        }
        _ if claimant.passive => Some(Error::Passive { server, me, owner: "no install runs its jobs now".into() }),
        _ => None,
    })
}

pub trait Host {
    fn pools(&self) -> &Arc<Pools>;
    fn claimant(&self) -> &Claimant;
    fn runner(&self) -> &Runner;
    /// The policy uses this connection now (an earlier one no policy uses any more is closed).
    fn uses(&self, policy: &ConsumerGroupPolicy, target: &Target);
    /// What the last probe of the group saw unread, so the next probe can skip its `XRANGE`.
    fn unread(&self, policy: &ConsumerGroupPolicy) -> Option<Unread>;
    /// The watch of Pod metadata for `spec.consumers.pods`; `None` without a cluster.
    fn pods(&self) -> Option<PodWatch>;
    /// Says what a step of the plan did: an Event and a log line, or a printed line.
    fn announce(&self, policy: &ConsumerGroupPolicy, said: plan::Announcement) -> impl Future<Output = ()> + Send;
}

impl Host for Context {
    fn pools(&self) -> &Arc<Pools> {
        &self.shared.pools
    }

    fn claimant(&self) -> &Claimant {
        &self.claimant
    }

    fn runner(&self) -> &Runner {
        &self.runner
    }

    fn uses(&self, policy: &ConsumerGroupPolicy, target: &Target) {
        self.shared.pools.assign(&self.pool_users, &ObjectRef::from_obj(policy), Some(target));
    }

    fn unread(&self, policy: &ConsumerGroupPolicy) -> Option<Unread> {
        let windows = self.progress.lock().expect("progress lock");
        windows.get(&ObjectRef::from_obj(policy)).and_then(|w| w.unread.clone())
    }

    fn pods(&self) -> Option<PodWatch> {
        Some(Context::pods(self))
    }

    async fn announce(&self, policy: &ConsumerGroupPolicy, said: plan::Announcement) {
        info!(reason = said.reason, "{}", said.note);
        publish(self, policy, said.type_, said.reason, said.note).await;
    }
}

pub fn group_keys(policy: &ConsumerGroupPolicy) -> GroupKeys<'_> {
    GroupKeys { stream: &policy.spec.stream, group: &policy.spec.group, dead_letter: &policy.spec.dead_letter.stream }
}

/// Connects, creates the group when missing, starts, updates or stops the policy's jobs, and probes the group: on
/// the policy's stream, or on each partition of its topic ([`converge_stream`], [`PARTITIONS_AT_ONCE`] at a time).
pub async fn converge(
    policy: &ConsumerGroupPolicy,
    host: &impl Host,
    target: &Target,
    drain_pause: Option<Duration>,
    schedule: &Schedule,
    others: &[Arc<ConsumerGroupPolicy>],
) -> Result<Observation> {
    // Sentinel mode: the primary the sentinel names now. A failover gives a new target, so a new connection for
    // the probe and the runner, and the old one is closed by `assign`.
    let original = target;
    let (target, mut conn) = host.pools().reach_primary(target).await?;
    let target = &target;
    let primary = policy.spec.redis.sentinel.as_ref().map(|_| target.server());
    host.uses(policy, target);
    let server = target.server();
    // Every pass is a script: a server without Lua is said so, before anything is written.
    let features = host.pools().features(&mut conn, &server).await?;
    if !features.scripting {
        // Asked again at the next reconcile: the module may be loaded by then.
        host.pools().features.forget(&server);
        return Err(Error::ScriptingUnavailable { server, version: features.version });
    }
    let id = policy_id(policy);
    // One install runs a group's jobs, claimed on the server: another install on the same Redis (in another cluster,
    // say) stands by, as a passive one does, writing nothing.
    let claimant = host.claimant();
    let group = (policy.spec.stream.as_str(), policy.spec.group.as_str());
    let claim =
        redis_ops::claim_group(&mut conn, &server, group, &claimant.id, claim_lifetime(schedule), claimant.passive);
    // The first command on the group's keys: a standalone connection redirected is talking to a cluster node.
    let claim = claim.await.map_err(|e| if target.cluster { e } else { e.for_standalone() });
    match claim? {
        Claim::Ours => {}
        Claim::Theirs { owner, left } if !claimant.passive => {
            host.runner().stop(&id);
            return Err(Error::AnotherInstallRuns { server, owner, me: claimant.id.clone(), left: left.as_secs() });
        }
        other => {
            host.runner().stop(&id);
            let owner = match other {
                Claim::Theirs { owner, .. } => format!("the install {owner} runs its jobs"),
                _ => "no install runs its jobs now".to_string(),
            };
            return Err(Error::Passive { server, me: claimant.id.clone(), owner });
        }
    }
    let jobs = plan::jobs(policy, schedule, others);
    if jobs.work.is_none() {
        host.runner().stop(&id);
    }
    let mut settings = schedule.pass.worker_settings();
    let backoff = schedule.pass.backoff;
    let topic = policy.spec.partitions.map(|partitions| TopicSettings {
        partitions,
        ordering: policy.spec.ordering,
        backoff_factor: backoff.map_or(1, |b| b.factor),
        backoff_max_ms: backoff.map_or(0, |b| b.max.as_millis() as u64),
    });
    if let Some(topic) = topic {
        // The topic's own settings key, where workers learn the partitions before they read any of them.
        settings.contract_version = Some(keys::TOPIC_CONTRACT_VERSION);
        let (stream, group) = (&policy.spec.stream, &policy.spec.group);
        redis_ops::publish_settings(&mut conn, &server, stream, group, settings, Some(topic)).await?;
        redis_ops::describe_topic(&mut conn, &server, stream, topic.partitions).await?;
    }
    let each = Converging {
        policy,
        host,
        conn: conn.clone(),
        target,
        original,
        server: server.clone(),
        carry_over: plan::carry_over(policy, others),
        uid: policy.uid().unwrap_or_default(),
        settings,
        work: jobs.work.clone(),
        acked_trim: features.has("XTRIM ACKED"),
        pods: pods_of(policy, host)?,
        drain_pause,
    };
    // Each partition's facts, for what is decided per partition (the bound, the idempotence window).
    let mut each_partition = Vec::new();
    let (setup, mut facts, min_idle_held_for, partitions) = if policy.spec.partitions.is_some() {
        let (each, id) = (&each, &id);
        // Owned stream names: a stream of futures borrowing from its own items is not `Send`.
        let seen: Vec<StreamSeen> = futures::stream::iter(plan::streams(policy).into_iter().enumerate())
            .map(|(index, stream)| async move { each.stream(&stream, partition_task(id, index as u32), None).await })
            .buffered(PARTITIONS_AT_ONCE)
            .try_collect()
            .await?;
        let setup = GroupSetup {
            created: seen.iter().any(|s| s.setup.created),
            carried_over: seen.iter().map(|s| s.setup.carried_over).sum(),
            ..seen[0].setup.clone()
        };
        let held_for = seen.iter().map(|s| s.held_for).max().unwrap_or_default();
        let facts: Vec<GroupFacts> = seen.into_iter().map(|s| s.facts).collect();
        // The backlog bound is each partition's (its producers run the bounded publish script on it).
        for (stream, partition) in plan::streams(policy).iter().zip(&facts) {
            if let Some(bound) = plan::bound_change(policy, partition.bound.as_deref()) {
                redis_ops::set_bound(&mut conn, &server, stream, &policy.spec.group, bound).await?;
            }
        }
        let slots = if target.cluster { redis_ops::slot_primaries(&mut conn, &server).await? } else { Vec::new() };
        let mut summary = topic::summary(&policy.spec.stream, &facts, &slots);
        // Members that stopped beating leave the group here too, not only at another member's heartbeat.
        let (stream, group) = (&policy.spec.stream, &policy.spec.group);
        let swept = crate::topic::sweep(&mut conn, stream, group, summary.count).await;
        summary.members = swept.map_err(|e| Error::from_redis(&server, e))?;
        // On a Cluster each partition has a dead-letter stream of its own (plan::dead_letter_of).
        let topic_facts = topic::facts(&facts, target.cluster);
        each_partition = facts;
        (setup, topic_facts, held_for, Some(summary))
    } else {
        let seen = each.stream(&policy.spec.stream, id.clone(), host.unread(policy).as_ref()).await?;
        (seen.setup, seen.facts, seen.held_for, None)
    };
    if setup.server.to_string() != features.version {
        // Upgraded (or downgraded) in place: detected again at the next reconcile.
        host.pools().features.forget(&server);
    }
    for said in plan::setup_announcements(policy, &setup) {
        host.announce(policy, said).await;
    }
    let keys = group_keys(policy);
    if policy.spec.partitions.is_none()
        && let Some(bound) = plan::bound_change(policy, facts.bound.as_deref())
    {
        redis_ops::set_bound(&mut conn, &server, keys.stream, keys.group, bound).await?;
    }
    let window = validate::effective_idempotence(policy, schedule.idempotence, others);
    // The stream's own `idmp-*` fields tell as well as COMMAND DOCS, which an ACL without +command|docs refuses.
    let has_idmp = features.has("XADD IDMP")
        || facts.idempotence.is_some()
        || each_partition.iter().any(|p| p.idempotence.is_some());
    let idempotence = match policy.spec.partitions {
        None => {
            let said = agree_window(&mut conn, &server, keys.stream, policy, window, &mut facts, has_idmp).await;
            if let Some(said) = said.announcement {
                host.announce(policy, said).await;
            }
            said.verdict
        }
        // On a topic the window is each partition's (a producer's `XADD ... IDMP` goes to one partition); the
        // verdict is the first refusal, else the window every partition agreed on, said once for the topic.
        Some(count) => {
            let mut verdicts = Vec::with_capacity(each_partition.len());
            let mut set = 0;
            for (stream, partition) in plan::streams(policy).iter().zip(each_partition.iter_mut()) {
                let said = agree_window(&mut conn, &server, stream, policy, window, partition, has_idmp).await;
                set += usize::from(said.announcement.is_some());
                verdicts.push(said.verdict);
            }
            facts.idempotence = topic::idempotence(&each_partition);
            if let (true, Some(plan::Idempotence::Applied(in_force))) = (set > 0, verdicts.first()) {
                host.announce(policy, plan::topic_idempotence_announcement(keys.stream, count, set, *in_force)).await;
            }
            let refused = verdicts.iter().find(|v| matches!(v, plan::Idempotence::Refused(..)));
            refused.or(verdicts.first()).cloned().unwrap_or(plan::Idempotence::Undeclared)
        }
    };
    let interval = schedule.interval;
    let retention = jobs.retention_note;
    Ok(Observation {
        server: setup.server,
        facts,
        retention,
        primary,
        features,
        interval,
        idempotence,
        min_idle_held_for,
        partitions,
    })
}

/// What agreeing on one stream's idempotence window came to: the verdict, and the Event to publish when the
/// window was set (`XCFGSET` clears the server's record of producers and message ids).
struct WindowAgreed {
    verdict: plan::Idempotence,
    announcement: Option<plan::Announcement>,
}

/// Agrees on `stream`'s idempotence window with the other policies of the stream (`IDEMPOTENCE_WINDOW`), setting
/// it when it differs, and updates `facts.idempotence` to what is in force.
async fn agree_window(
    conn: &mut Conn,
    server: &str,
    stream: &str,
    policy: &ConsumerGroupPolicy,
    window: Option<validate::Window>,
    facts: &mut GroupFacts,
    has_idmp: bool,
) -> WindowAgreed {
    let verdict = plan::idempotence(window, facts.idempotence.as_ref(), has_idmp);
    let (plan::Idempotence::Set(window) | plan::Idempotence::Applied(window)) = verdict else {
        return WindowAgreed { verdict, announcement: None };
    };
    let uid = policy.uid().unwrap_or_default();
    match redis_ops::agree_idempotence(conn, server, stream, &uid, window.seconds, window.max_size).await {
        Ok((seconds, max_size, set)) => {
            let in_force = validate::Window { seconds, max_size };
            let announcement =
                set.then(|| plan::idempotence_announcement(stream, in_force, facts.idempotence.as_ref()));
            if set && let Some(now) = facts.idempotence.as_mut() {
                (now.duration_seconds, now.max_size, now.producers, now.message_ids) = (seconds, max_size, 0, 0);
            }
            WindowAgreed { verdict: plan::Idempotence::Applied(in_force), announcement }
        }
        // Nothing else depends on it: the policy stays Ready, and the condition says why.
        Err(e) => WindowAgreed { verdict: plan::Idempotence::Refused(window, e.to_string()), announcement: None },
    }
}

/// Partitions of a topic converged at once: their commands share the connection, so they travel together (a
/// multiplexed connection pipelines what is in flight) instead of one round trip after another, and a server is
/// never sent more than this many partitions' work at a time.
pub const PARTITIONS_AT_ONCE: usize = 32;

/// What every stream of one policy shares in a reconcile.
struct Converging<'a, H> {
    policy: &'a ConsumerGroupPolicy,
    host: &'a H,
    conn: Conn,
    target: &'a Target,
    /// The target as the policy names it (the sentinels, in Sentinel mode), for the passes to follow a failover.
    original: &'a Target,
    server: String,
    carry_over: bool,
    uid: String,
    settings: WorkerSettings,
    /// `None`: suspended, the jobs are stopped.
    work: Option<plan::Work>,
    acked_trim: bool,
    pods: Option<PodsOf>,
    drain_pause: Option<Duration>,
}

/// What converging one stream found there.
struct StreamSeen {
    setup: GroupSetup,
    facts: GroupFacts,
    /// How long the passes still apply a higher `minIdle` than the policy's on this stream.
    held_for: Duration,
}

impl<H: Host> Converging<'_, H> {
    /// One stream of the policy (its stream, or one partition): the group set up, the settings published, the jobs
    /// handed to the runner as the task `task`, the group probed (`unread`: what the last probe saw unread).
    async fn stream(&self, stream: &str, task: String, unread: Option<&Unread>) -> Result<StreamSeen> {
        let (policy, host, server) = (self.policy, self.host, &self.server);
        let mut conn = self.conn.clone();
        let dead_letter = plan::dead_letter_of(policy, stream, self.target.cluster);
        let keys = GroupKeys { stream, group: &policy.spec.group, dead_letter: &dead_letter };
        let setup =
            redis_ops::ensure_group(&mut conn, server, &keys, &policy.spec.start_id, self.carry_over, &self.uid)
                .await
                .map_err(|e| if self.target.cluster { e } else { e.for_standalone() });
        if let Err(Error::AuthenticationFailed { .. } | Error::TlsFailed { .. }) = &setup {
            host.pools().forget(self.target);
        }
        let setup = setup?;
        // Before the passes get their settings: a lowered minIdle reaches the workers first and the passes only
        // after the hold, so no slow handler still leasing at the old pace is taken from under its worker.
        let pass_min_idle =
            redis_ops::publish_settings(&mut conn, server, stream, keys.group, self.settings, None).await?;
        if let Some(work) = &self.work {
            let mut pass = work.pass.clone();
            pass.min_idle = pass_min_idle.min_idle;
            let job = Job {
                conn: conn.clone(),
                pool: self.target.pool_key(),
                server: server.clone(),
                stream: stream.to_string(),
                group: policy.spec.group.clone(),
                dead_letter: dead_letter.clone(),
                interval: work.interval,
                pass,
                expire_after: work.expire_after,
                retention: work.retention,
                acked_trim: self.acked_trim,
                object: policy.object_ref(&()),
                sentinel_source: self.original.sentinel.is_some().then(|| self.original.clone()),
                pods: self.pods.clone(),
                drain_pause: self.drain_pause,
            };
            host.runner().run(&task, job);
        }
        let facts = redis_ops::probe_group(&mut conn, server, &keys, unread).await?;
        Ok(StreamSeen { setup, facts, held_for: pass_min_idle.held_for })
    }
}

/// `spec.consumers.pods`, for the passes: the selector, and the operator's store of Pod metadata.
fn pods_of(policy: &ConsumerGroupPolicy, host: &impl Host) -> Result<Option<PodsOf>> {
    let Some(selector) = policy.spec.consumers.as_ref().and_then(|c| c.pods.as_ref()) else { return Ok(None) };
    let selector = Selector::try_from(LabelSelector::from(selector))
        .map_err(|e| Error::InvalidSpec(format!("spec.consumers.pods: {e}")))?;
    let Some(watch) = host.pods() else {
        return Err(Error::InvalidSpec(
            "spec.consumers.pods matches consumers to Pods, which only a cluster has: remove it where no cluster runs"
                .into(),
        ));
    };
    Ok(Some(PodsOf { watch, namespace: policy.namespace().unwrap_or_default(), selector }))
}

/// Whether deleting the policy has work to do in Redis, and so whether it carries the finalizer.
pub fn needs_cleanup(policy: &ConsumerGroupPolicy) -> bool {
    policy.spec.deletion_policy == DeletionPolicy::Delete || policy.spec.backlog.is_some()
}

/// Runs on deletion of a policy with the finalizer: the jobs stop, Redis is treated by `deletionPolicy` and the
/// bound removed, then the policy's state and connection are forgotten.
pub async fn cleanup(policy: &ConsumerGroupPolicy, ctx: &Context) -> Result<Action> {
    let key = ObjectRef::from_obj(policy);
    ctx.runner.stop(&policy_id(policy));
    let done = release_redis(policy, ctx).await;
    forget(ctx, &key);
    ctx.shared.secrets.retain_referenced(&ctx.shared.referenced_secrets());
    done
}

/// Drops what the operator keeps about a policy that is gone: its jobs, retry count, metric series and its use
/// of a shared connection.
pub fn forget(ctx: &Context, key: &ObjectRef<ConsumerGroupPolicy>) {
    if let Some(uid) = &key.extra.uid {
        ctx.deleted.bury(uid);
    }
    let namespace = key.namespace.clone().unwrap_or_default();
    ctx.runner.stop(&id(&namespace, &key.name));
    ctx.failures.lock().expect("failures lock").remove(key);
    ctx.progress.lock().expect("progress lock").remove(key);
    ctx.wrote.lock().expect("wrote lock").remove(key);
    ctx.shared.metrics.forget_policy(&(namespace, key.name.clone()));
    ctx.shared.pools.assign(&ctx.pool_users, key, None);
}

/// The group's backlog bound goes with the policy (producers are no longer refused for a group nobody manages).
/// `Retain` leaves the rest of Redis untouched; `Delete` destroys the group (never the streams).
async fn release_redis(policy: &ConsumerGroupPolicy, ctx: &Context) -> Result<Action> {
    let destroy = policy.spec.deletion_policy == DeletionPolicy::Delete;
    if let Some(conflict) = conflict(policy, ctx).await {
        // The group, and its bound, belong to the older policy.
        if destroy {
            let note = format!("group {:?} not destroyed: {conflict}", policy.spec.group);
            publish(ctx, policy, EventType::Normal, "GroupRetained", note).await;
        }
        return Ok(Action::await_change());
    }
    match release_on_server(policy, ctx, destroy).await {
        Ok(()) => Ok(Action::await_change()),
        // A policy that never reached its server changed nothing there. One that cannot reach it for a reason only
        // a person can fix (credentials, TLS, a database the server lacks) would hold the finalizer, and the
        // namespace, forever. Both let go and say what was left behind; a server that is only down (transient)
        // is waited for.
        Err(e) if e.is_stalled() || policy.status.as_ref().is_none_or(|s| s.server_version.is_none()) => {
            let what = if destroy { "group" } else { "backlog bound of group" };
            let note = format!("{what} {:?} left in Redis: {e}", policy.spec.group);
            publish(ctx, policy, EventType::Warning, "CleanupSkipped", note).await;
            Ok(Action::await_change())
        }
        // A namespace being deleted takes the policy's Redis, its Secret and the operator's Roles there with it, in
        // no particular order: waiting for the server would hold the namespace in Terminating for good.
        Err(e) if namespace_terminating(policy, ctx).await => {
            let what = if destroy { "group" } else { "backlog bound of group" };
            let note = format!("{what} {:?} left in Redis: the namespace is being deleted and {e}", policy.spec.group);
            let (namespace, name) = (policy.namespace().unwrap_or_default(), policy.name_any());
            // The Event cannot be created in a terminating namespace; the log keeps the note.
            warn!(namespace, name, reason = "CleanupSkipped", "{note}");
            Ok(Action::await_change())
        }
        Err(e) => Err(e),
    }
}

/// Takes the group's backlog bound off the server, before the finalizer of a policy whose `spec.backlog` was
/// removed goes.
pub async fn release_bound(policy: &ConsumerGroupPolicy, ctx: &Context) -> Result<()> {
    // A policy that lost a conflict never set the bound: it is the owner's, and stays.
    if conflict(policy, ctx).await.is_some() {
        return Ok(());
    }
    release_on_server(policy, ctx, false).await
}

/// The conflict with an older policy on the same stream and group, when there is one: the group and its bound are
/// that policy's.
async fn conflict(policy: &ConsumerGroupPolicy, ctx: &Context) -> Option<validate::Conflict> {
    let others = ctx.shared.admitted(ctx.neighbours.of(policy, &ctx.shared.policies)).await;
    validate::conflict(policy, &others)
}

/// Whether the policy's namespace is being deleted (false when that cannot be read). Read once for all of the
/// namespace's policies every [`TERMINATING_KEPT`]: a namespace deleted with a thousand policies in it asks once.
async fn namespace_terminating(policy: &ConsumerGroupPolicy, ctx: &Context) -> bool {
    let Some(namespace) = policy.namespace() else { return false };
    let known = ctx.terminating.lock().expect("terminating lock").get(&namespace).copied();
    if let Some((terminating, at)) = known
        && at.elapsed() < TERMINATING_KEPT
    {
        return terminating;
    }
    let terminating = match Api::<Namespace>::all(ctx.shared.client.clone()).get_opt(&namespace).await {
        Ok(Some(ns)) => ns.metadata.deletion_timestamp.is_some(),
        Ok(None) => true,
        Err(_) => return false,
    };
    let mut known = ctx.terminating.lock().expect("terminating lock");
    known.retain(|_, (_, at)| at.elapsed() < TERMINATING_KEPT);
    known.insert(namespace, (terminating, Instant::now()));
    terminating
}

/// Drops what was read of namespaces' deletion once it is too old to be used.
pub fn prune_terminating(ctx: &Context) {
    ctx.terminating.lock().expect("terminating lock").retain(|_, (_, at)| at.elapsed() < TERMINATING_KEPT);
}

/// How long what was read of a namespace's deletion is used.
const TERMINATING_KEPT: Duration = Duration::from_secs(5);

/// Removes the bound (also when the spec no longer sets one: the finalizer stays until a reconcile took it off),
/// then destroys the group when `destroy`: on the policy's stream, or on every partition of its topic.
async fn release_on_server(policy: &ConsumerGroupPolicy, ctx: &Context, destroy: bool) -> Result<()> {
    let target = ctx.shared.target(policy).await?;
    let (target, mut conn) = ctx.shared.pools.reach_primary(&target).await?;
    let server = target.server();
    for stream in plan::streams(policy) {
        redis_ops::set_bound(&mut conn, &server, &stream, &policy.spec.group, None).await?;
    }
    if policy.spec.idempotence.is_some() {
        let uid = policy.uid().unwrap_or_default();
        for stream in plan::streams(policy) {
            redis_ops::withdraw_idempotence(&mut conn, &server, &stream, &uid).await?;
        }
    }
    if !destroy {
        return Ok(());
    }
    let group = &policy.spec.group;
    let uid = policy.uid().unwrap_or_default();
    let (mut destroyed, mut retained) = (Vec::new(), Vec::new());
    for stream in plan::streams(policy) {
        match redis_ops::destroy_group(&mut conn, &server, &stream, group, &uid, policy.spec.adopt_group).await? {
            Destroyed::Destroyed => destroyed.push(stream),
            Destroyed::Retained { creator } => retained.push((stream, creator)),
            Destroyed::Absent => {}
        }
    }
    let on = |streams: usize| match policy.spec.partitions {
        Some(count) => format!("{streams} of the {count} partitions of topic {:?}", policy.spec.stream),
        None => format!("stream {:?}", policy.spec.stream),
    };
    if !destroyed.is_empty() {
        let note = format!("destroyed group {group:?} on {}", on(destroyed.len()));
        publish(ctx, policy, EventType::Normal, "GroupDestroyed", note).await;
    }
    if let Some((_, creator)) = retained.first() {
        let by = if creator.is_empty() { "not by a policy".to_string() } else { format!("by policy uid {creator}") };
        let note = format!(
            "group {group:?} on {} not destroyed: it was created {by}, not by this policy, which does not adopt it \
             (spec.adoptGroup); its pending entries are still there",
            on(retained.len())
        );
        publish(ctx, policy, EventType::Normal, "GroupRetained", note).await;
    }
    Ok(())
}
