//! The `GroupSeek` controller, in the same operator as the policies and on their connections. A reconcile runs in
//! phases:
//!
//! 1. finished? A `Succeeded` or `Failed` seek never runs again (an operator restart, the manifest applied again);
//! 2. resolve: the policy (from the policy controller's store, so a shard handles the seeks of its own policies),
//!    whether it is Ready, the target, its server and credentials (tenancy applies);
//! 3. decide: one seek per stream at a time in this process (the server refuses one beside a running redrive);
//! 4. act: the seek script's bounded steps ([`crate::jobs::seek`]), on a topic each partition's after every
//!    partition was planned ([`seek_topic`]), then the status, the Events and the metric.
//!
//! The script records each seek's progress and result on the server under its namespace/name, so an operator
//! killed between two steps resumes where the last ended, one killed between the move and the status write finds
//! it done and writes the recorded result, and the same manifest applied again after a delete is told the group
//! moved before (`AlreadyFinished`): a seek happens once or not at all.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, predicates, reflector, watcher};
use kube::{Resource, ResourceExt};
use tracing::{info, instrument, warn};

use crate::api::{
    ConsumerGroupPolicy, DeadLetterRedrive, GroupSeek, GroupSeekStatus, PartitionSeek, READY, SeekPhase, SeekPosition,
    SeekTarget, parse_duration,
};
use crate::context::Shared;
use crate::context::conditions::{JobState, job_conditions};
use crate::controller;
use crate::controller::{Claimant, run_elsewhere};
use crate::jobs::redrive as redrive_moves;
use crate::jobs::seek::{self, Moved, Outcome, Target};
use crate::keys::redrive_lock_key;
use crate::redis::{Conn, GroupKeys, server_identity};
use crate::{Error, Result};

/// How soon a seek that waits (for its policy to exist or be reconciled, for its server) looks again.
const WAIT_RECHECK: Duration = Duration::from_secs(2);

/// A stream: the server (canonical URL) and the key.
type StreamKey = (String, String);

/// Shared by the seek reconciles.
pub struct Seeks {
    shared: Arc<Shared>,
    /// When the operator serves one shard, a seek of a policy outside it belongs to another replica.
    sharded: bool,
    /// Streams a seek of this process is moving now.
    moving: Mutex<HashSet<StreamKey>>,
    /// This install: a seek of a group another install runs waits for it (two installs on one Redis).
    claimant: Claimant,
}

/// Runs the seek controller until `shutdown` resolves.
pub async fn run(
    shared: Arc<Shared>,
    namespace: Option<String>,
    sharded: bool,
    claimant: Claimant,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let client = shared.client.clone();
    let api: Api<GroupSeek> = match &namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    let (store, writer) = reflector::store();
    let changes = watcher(api, watcher::Config::default().any_semantic())
        .default_backoff()
        .reflect(writer)
        .applied_objects()
        .predicate_filter(predicates::generation, Default::default());
    let ctx = Arc::new(Seeks { shared, sharded, moving: Mutex::default(), claimant });
    // A seek names its policy: wait until the policies are listed, or a restarted operator would find policies
    // missing that are only not seen yet.
    let shutdown = shutdown.shared();
    if !ctx.shared.policies_listed(shutdown.clone()).await {
        return;
    }
    Controller::for_stream(changes, store)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result
                && !matches!(e, kube::runtime::controller::Error::ReconcilerFailed(..))
            {
                warn!(error = %e, "seek controller error");
            }
        })
        .await;
}

#[instrument(skip_all, fields(namespace = object.namespace().unwrap_or_default(), seek = object.name_any()))]
async fn reconcile(object: Arc<GroupSeek>, ctx: Arc<Seeks>) -> Result<Action> {
    let status = object.status.clone().unwrap_or_default();
    // 1. A finished seek is terminal.
    if status.phase.is_finished() {
        return Ok(Action::await_change());
    }
    if !ctx.shared.leadership.may_write() {
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    // 2. Resolve.
    let namespace = object.namespace().unwrap_or_default();
    let policy_name = &object.spec.policy_ref.name;
    let Some(policy) = ctx.shared.policies.get(&ObjectRef::new(policy_name).within(&namespace)) else {
        if ctx.sharded {
            return Ok(Action::requeue(WAIT_RECHECK));
        }
        let note = format!(
            "ConsumerGroupPolicy {policy_name:?} not found in namespace {namespace:?}: the seek runs once it exists"
        );
        ctx.pending(&object, &status, "PolicyNotFound", note).await?;
        return Ok(Action::requeue(WAIT_RECHECK));
    };
    match policy.condition(READY) {
        None => {
            let note = format!("ConsumerGroupPolicy {policy_name:?} has not been reconciled yet");
            ctx.pending(&object, &status, "PolicyNotReconciled", note).await?;
            return Ok(Action::requeue(WAIT_RECHECK));
        }
        Some(ready) if ready.status != "True" => {
            let note = format!(
                "ConsumerGroupPolicy {policy_name:?} is not Ready ({}: {}): nothing moved; seek once it is",
                ready.reason, ready.message
            );
            return ctx.fail(&object, status, "PolicyNotReady", note).await;
        }
        Some(_) => {}
    }
    let plan = match plan(&object, &policy) {
        Ok(plan) => plan,
        Err(note) => return ctx.fail(&object, status, "InvalidSpec", note).await,
    };
    let resolved = match ctx.shared.resolve(&policy).await {
        Ok(resolved) => resolved,
        Err(e) if e.is_stalled() => return ctx.fail(&object, status, e.reason(), e.to_string()).await,
        Err(e) => return ctx.retry(&object, &status, e).await,
    };
    // 3. Decide: one seek per stream at a time.
    let stream: StreamKey = (server_identity(&policy), policy.spec.stream.clone());
    let Some(_moving) = Moving::claim(&ctx.moving, stream.clone()) else {
        let note = format!("another GroupSeek moves a group of stream {:?} now: seek once it has finished", stream.1);
        return ctx.fail(&object, status, "SeekInProgress", note).await;
    };
    // 4. Act.
    let (target, mut conn) = match ctx.shared.pools.connect_primary(&resolved.target).await {
        Ok(connected) => connected,
        Err(e) if e.is_stalled() => return ctx.fail(&object, status, e.reason(), e.to_string()).await,
        Err(e) => return ctx.retry(&object, &status, e).await,
    };
    // The install that runs the group moves it: a seek here waits while another install runs it.
    if let Some(elsewhere) = run_elsewhere(&mut conn, &target.server(), &policy, &ctx.claimant).await? {
        ctx.pending(&object, &status, elsewhere.reason(), elsewhere.to_string()).await?;
        return Ok(Action::requeue(Duration::from_secs(30)));
    }
    let started = Timestamp::now().to_string();
    let go_on = || ctx.shared.leadership.may_write();
    if policy.spec.partitions.is_some() {
        let ended = seek_topic(&ctx, &mut conn, &target.server(), &policy, target.cluster, &plan, go_on).await;
        return match ended {
            Ok(TopicEnd::Done(moves)) => ctx.succeed(&object, &policy, status, Moves::Topic(moves), started).await,
            Ok(TopicEnd::Finished(moves, uid)) => {
                ctx.already_finished(&object, status, Moves::Partitions(moves), &uid).await
            }
            Ok(TopicEnd::Refused { partition, reason, message, moved }) => {
                let note = match moved.len() {
                    0 => format!("partition {partition}: {message}; no partition moved"),
                    n => format!(
                        "partition {partition}: {message}; partitions 0 to {} had moved before it (a consumer came \
                         back between the plan and the move?) and stay moved, the rest did not move",
                        n - 1
                    ),
                };
                let mut status = status;
                Moves::Topic(moved).record(&mut status);
                ctx.fail(&object, status, &reason, note).await
            }
            Err(e) if e.is_stalled() => ctx.fail(&object, status, e.reason(), e.to_string()).await,
            Err(e) => ctx.retry(&object, &status, e).await,
        };
    }
    let keys = GroupKeys {
        stream: &policy.spec.stream,
        group: &policy.spec.group,
        dead_letter: &policy.spec.dead_letter.stream,
    };
    if let Err(e) = ctx.release_stale_redrive_lock(&mut conn, &target.server(), &keys).await {
        return ctx.retry(&object, &status, e).await;
    }
    match seek::run(&mut conn, &target.server(), &keys, &plan, go_on).await {
        Ok(Outcome::Done(moved)) => ctx.succeed(&object, &policy, status, Moves::One(moved), started).await,
        Ok(Outcome::Finished { moved, uid }) => ctx.already_finished(&object, status, Moves::One(moved), &uid).await,
        Ok(Outcome::Refused { reason, message }) => ctx.fail(&object, status, &reason, message).await,
        Err(e) if e.is_stalled() => ctx.fail(&object, status, e.reason(), e.to_string()).await,
        Err(e) => ctx.retry(&object, &status, e).await,
    }
}

/// How a topic's seek ended.
enum TopicEnd {
    /// Every partition moved (or, with `dryRun`, planned), in partition order.
    Done(Vec<Moved>),
    /// Another object of this name moved these partitions before (its uid): nothing moved now.
    Finished(Vec<(u32, Moved)>, String),
    /// `partition` refused; `moved` are the partitions before it that moved (none when the plan refused).
    Refused { partition: u32, reason: String, message: String, moved: Vec<Moved> },
}

/// A topic's seek (SPEC 22): the same target on every partition, each partition's move atomic and once (the script's
/// record in that partition's seeks hash, so a retry or another replica finds the partitions already moved and
/// moves the rest). Every partition is planned (a dry run) before the first moves: a refusal found then moves
/// nothing. One that comes up between the plan and the move (a consumer active since) leaves the partitions before
/// it moved, and says so.
async fn seek_topic(
    ctx: &Seeks,
    conn: &mut Conn,
    server: &str,
    policy: &ConsumerGroupPolicy,
    cluster: bool,
    plan: &seek::Seek,
    go_on: impl Fn() -> bool + Copy,
) -> Result<TopicEnd> {
    let streams = controller::streams(policy);
    let dead_letters: Vec<String> = streams.iter().map(|s| controller::dead_letter_of(policy, s, cluster)).collect();
    let keys = |i: usize| GroupKeys { stream: &streams[i], group: &policy.spec.group, dead_letter: &dead_letters[i] };
    for i in 0..streams.len() {
        // One server: one dead-letter stream for the topic, looked at once.
        if i == 0 || dead_letters[i] != dead_letters[0] {
            ctx.release_stale_redrive_lock(conn, server, &keys(i)).await?;
        }
    }
    let dry_run = seek::Seek { dry_run: true, ..plan.clone() };
    let passes = if plan.dry_run { vec![&dry_run] } else { vec![&dry_run, plan] };
    let mut moved = Vec::new();
    for pass in passes {
        moved.clear();
        let mut finished = Vec::new();
        for (i, partition) in (0..streams.len()).zip(0u32..) {
            match seek::run(conn, server, &keys(i), pass, go_on).await? {
                Outcome::Done(m) => moved.push(m),
                Outcome::Finished { moved: m, uid } => finished.push((partition, m, uid)),
                Outcome::Refused { reason, message } => {
                    let moved = if pass.dry_run { Vec::new() } else { std::mem::take(&mut moved) };
                    return Ok(TopicEnd::Refused { partition, reason, message, moved });
                }
            }
        }
        if let Some((_, _, uid)) = finished.first() {
            let uid = uid.clone();
            return Ok(TopicEnd::Finished(finished.into_iter().map(|(p, m, _)| (p, m)).collect(), uid));
        }
    }
    Ok(TopicEnd::Done(moved))
}

fn error_policy(object: Arc<GroupSeek>, error: &Error, _ctx: Arc<Seeks>) -> Action {
    warn!(namespace = object.namespace(), name = object.name_any(), reason = error.reason(), error = %error,
        "seek reconcile failed; retrying");
    Action::requeue(WAIT_RECHECK)
}

/// The script's arguments from the spec, or what is wrong with the spec.
fn plan(object: &GroupSeek, policy: &ConsumerGroupPolicy) -> std::result::Result<seek::Seek, String> {
    if let (Some(n), Some(id)) = (policy.spec.partitions, &object.spec.to.id) {
        return Err(format!(
            "spec.to.id {id:?} names an entry of one stream, and ConsumerGroupPolicy {:?} is a topic of {n} \
             partitions, each with ids of its own: seek a topic by time, position or shift (each partition moves by \
             it)",
            policy.name_any()
        ));
    }
    let idle = parse_duration(&object.spec.consumers_idle_for).map_err(|e| format!("spec.consumersIdleFor: {e}"))?;
    Ok(seek::Seek {
        name: format!("{}/{}", object.namespace().unwrap_or_default(), object.name_any()),
        uid: object.uid().unwrap_or_default(),
        target: target(&object.spec.to)?,
        pending: object.spec.pending,
        idle_ms: idle.as_millis() as u64,
        dry_run: object.spec.dry_run,
        dead_letter_max_len: policy.spec.dead_letter.max_len.map(|m| m.max(1) as u64),
    })
}

fn target(to: &SeekTarget) -> std::result::Result<Target, String> {
    match (&to.time, &to.id, to.position, to.shift) {
        (Some(time), None, None, None) => match time.parse::<Timestamp>() {
            Ok(t) if t.as_millisecond() >= 0 => Ok(Target::Time(t.as_millisecond())),
            Ok(_) => Err(format!("spec.to.time {time:?} lies before 1970-01-01T00:00:00Z, where stream ids begin")),
            Err(e) => Err(format!("spec.to.time {time:?} is no RFC 3339 time ({e})")),
        },
        (None, Some(id), None, None) => match id.split_once('-').unwrap_or((id, "0")) {
            (ms, seq) if ms.parse::<u64>().is_ok() && seq.parse::<u64>().is_ok() => Ok(Target::Id(id.clone())),
            _ => Err(format!(
                "spec.to.id {id:?} is no stream id: <milliseconds>-<sequence> (or <milliseconds>), each a whole \
                 number up to 18446744073709551615"
            )),
        },
        (None, None, Some(SeekPosition::Earliest), None) => Ok(Target::Earliest),
        (None, None, Some(SeekPosition::Latest), None) => Ok(Target::Latest),
        (None, None, None, Some(shift)) if shift != 0 => Ok(Target::Shift(shift)),
        _ => Err("spec.to needs exactly one of time, id, position, shift (a shift other than 0)".into()),
    }
}

/// A stream claimed by one seek of this process until dropped.
struct Moving<'a> {
    set: &'a Mutex<HashSet<StreamKey>>,
    stream: StreamKey,
}

impl<'a> Moving<'a> {
    fn claim(set: &'a Mutex<HashSet<StreamKey>>, stream: StreamKey) -> Option<Moving<'a>> {
        // Built only once claimed: a `Moving` dropped unclaimed would release the other seek's claim.
        let claimed = set.lock().expect("moving lock").insert(stream.clone());
        if claimed { Some(Moving { set, stream }) } else { None }
    }
}

impl Drop for Moving<'_> {
    fn drop(&mut self) {
        self.set.lock().expect("moving lock").remove(&self.stream);
    }
}

/// What a seek did (or plans): one stream's move, or each partition's of a topic.
enum Moves {
    One(Moved),
    /// In partition order, or (a seek found already finished) each with its partition.
    Topic(Vec<Moved>),
    Partitions(Vec<(u32, Moved)>),
}

impl Moves {
    /// How it reads in words: `from -> to` and the counts, or a topic's partitions and sums.
    fn summary(&self) -> String {
        match self {
            Moves::One(moved) => format!(
                "{} -> {}: {} redelivered, {} skipped, {} pending handled",
                moved.from.id, moved.to.id, moved.redelivered, moved.skipped, moved.pending_handled
            ),
            Moves::Topic(_) | Moves::Partitions(_) => {
                let each = self.partitions();
                let sum = |count: fn(&PartitionSeek) -> i64| each.iter().map(count).sum::<i64>();
                format!(
                    "{} partitions: {} redelivered, {} skipped, {} pending handled",
                    each.len(),
                    sum(|p| p.redelivered),
                    sum(|p| p.skipped),
                    sum(|p| p.pending_handled)
                )
            }
        }
    }

    fn partitions(&self) -> Vec<PartitionSeek> {
        let each = |partition: u32, moved: &Moved| PartitionSeek {
            partition,
            from: moved.from.clone(),
            to: moved.to.clone(),
            redelivered: moved.redelivered,
            skipped: moved.skipped,
            pending_handled: moved.pending_handled,
            oldest_available: moved.oldest_available.clone(),
        };
        match self {
            Moves::One(_) => Vec::new(),
            Moves::Topic(moves) => (0u32..).zip(moves).map(|(p, m)| each(p, m)).collect(),
            Moves::Partitions(moves) => moves.iter().map(|(p, m)| each(*p, m)).collect(),
        }
    }

    /// Into the status: the positions and counts, or a topic's partitions and their sums.
    fn record(self, status: &mut GroupSeekStatus) {
        status.partitions = self.partitions();
        match self {
            Moves::One(moved) => {
                status.from = Some(moved.from);
                status.to = Some(moved.to);
                status.redelivered = Some(moved.redelivered);
                status.skipped = Some(moved.skipped);
                status.pending_handled = Some(moved.pending_handled);
                status.oldest_available = moved.oldest_available;
            }
            Moves::Topic(_) | Moves::Partitions(_) => {
                let sum = |count: fn(&PartitionSeek) -> i64| Some(status.partitions.iter().map(count).sum::<i64>());
                status.redelivered = sum(|p| p.redelivered);
                status.skipped = sum(|p| p.skipped);
                status.pending_handled = sum(|p| p.pending_handled);
            }
        }
    }
}

impl Seeks {
    /// A redrive deleted while no operator ran (its task could not let go) leaves its lock on the dead-letter
    /// stream, and the seek script refuses every seek beside it: the lock of a redrive that no longer exists (or
    /// finished) is released here first.
    async fn release_stale_redrive_lock(&self, conn: &mut Conn, server: &str, keys: &GroupKeys<'_>) -> Result<()> {
        let lock_key = redrive_lock_key(keys.dead_letter);
        let Some(owner) = redrive_moves::holder(conn, server, &lock_key).await? else { return Ok(()) };
        let Some((namespace, name)) = owner.name.split_once('/') else { return Ok(()) };
        let api: Api<DeadLetterRedrive> = Api::namespaced(self.shared.client.clone(), namespace);
        // Not known (the namespace not watched, the API server not answering): the lock stands, and the script
        // says which redrive holds it.
        let found = match api.get_opt(name).await {
            Ok(found) => found,
            Err(e) => {
                warn!(redrive = owner.name, error = %e, "cannot tell whether the DeadLetterRedrive holding the stream runs");
                return Ok(());
            }
        };
        let running = found.is_some_and(|redrive| {
            redrive.uid().as_deref() == Some(owner.uid.as_str())
                && !redrive.status.as_ref().is_some_and(|s| s.phase.is_finished())
        });
        if !running {
            info!(redrive = owner.name, "releasing the lock of a DeadLetterRedrive that no longer runs");
            redrive_moves::release_of(conn, server, &lock_key, &owner).await?;
        }
        Ok(())
    }

    /// `Pending` with the reason it waits, written only when the reason or message changed.
    async fn pending(&self, object: &GroupSeek, status: &GroupSeekStatus, reason: &str, note: String) -> Result<()> {
        let already =
            status.conditions.iter().any(|c| c.type_ == "Reconciling" && c.reason == reason && c.message == note);
        if already {
            return Ok(());
        }
        let mut next = status.clone();
        self.write(object, &mut next, SeekPhase::Pending, reason, &note).await
    }

    /// A transient error (the server unavailable, a failover under way): the seek stays `Pending`, its
    /// `Reconciling` condition naming the error, and is retried by [`error_policy`]. The script records a seek that
    /// ran, so a retry after an answer that was lost never moves twice. `Deferred` is no failure and not shown.
    async fn retry(&self, object: &GroupSeek, status: &GroupSeekStatus, error: Error) -> Result<Action> {
        if !matches!(error, Error::Deferred(_)) {
            self.pending(object, status, error.reason(), error.to_string()).await?;
        }
        Err(error)
    }

    async fn fail(
        &self,
        object: &GroupSeek,
        mut status: GroupSeekStatus,
        reason: &str,
        note: String,
    ) -> Result<Action> {
        warn!(reason, "{note}");
        status.completion_time = Some(Timestamp::now().to_string());
        self.write(object, &mut status, SeekPhase::Failed, reason, &note).await?;
        self.shared.metrics.seek_finished(reason);
        self.publish(&object.object_ref(&()), EventType::Warning, reason, note).await;
        Ok(Action::await_change())
    }

    /// The manifest applied again (another object of this name, after a delete): the group moved once, by the
    /// object `uid`; this one says what that did and moves nothing.
    async fn already_finished(
        &self,
        object: &GroupSeek,
        mut status: GroupSeekStatus,
        moves: Moves,
        uid: &str,
    ) -> Result<Action> {
        let note = format!(
            "a GroupSeek of this name (uid {uid}) already moved this group ({}); nothing moved again. To move the \
             group again on purpose, create a GroupSeek with another name",
            moves.summary()
        );
        moves.record(&mut status);
        status.completion_time = Some(Timestamp::now().to_string());
        info!("{note}");
        self.write(object, &mut status, SeekPhase::Succeeded, "AlreadyFinished", &note).await?;
        self.shared.metrics.seek_finished("AlreadyFinished");
        self.publish(&object.object_ref(&()), EventType::Normal, "AlreadyFinished", note).await;
        Ok(Action::await_change())
    }

    async fn succeed(
        &self,
        object: &GroupSeek,
        policy: &ConsumerGroupPolicy,
        mut status: GroupSeekStatus,
        moves: Moves,
        started: String,
    ) -> Result<Action> {
        let dry_run = object.spec.dry_run;
        let said = moves.summary();
        moves.record(&mut status);
        status.start_time = status.start_time.or(Some(started));
        status.completion_time = Some(Timestamp::now().to_string());
        let (reason, note) = match dry_run {
            true => ("Planned", format!("dry run, nothing moved: {said}")),
            false => ("Seeked", format!("group {:?} moved {said}", policy.spec.group)),
        };
        info!(reason, "{note}");
        self.write(object, &mut status, SeekPhase::Succeeded, reason, &note).await?;
        self.shared.metrics.seek_finished(reason);
        self.publish(&object.object_ref(&()), EventType::Normal, reason, note.clone()).await;
        if !dry_run {
            let by = format!("{note} (GroupSeek {})", object.name_any());
            self.publish(&policy.object_ref(&()), EventType::Normal, "Seeked", by).await;
        }
        Ok(Action::await_change())
    }

    /// Writes the phase and its conditions, onto this object only (the patch names its uid).
    async fn write(
        &self,
        object: &GroupSeek,
        status: &mut GroupSeekStatus,
        phase: SeekPhase,
        reason: &str,
        note: &str,
    ) -> Result<()> {
        status.phase = phase;
        status.observed_generation = object.metadata.generation;
        let state = match phase {
            SeekPhase::Pending => JobState::InProgress,
            SeekPhase::Succeeded => JobState::Succeeded,
            SeekPhase::Failed => JobState::Failed,
        };
        status.conditions =
            job_conditions(&status.conditions, state, reason, note, object.metadata.generation, Timestamp::now());
        self.shared.apply_status_of_uid(object, status).await
    }

    async fn publish(
        &self,
        about: &k8s_openapi::api::core::v1::ObjectReference,
        type_: EventType,
        reason: &str,
        note: String,
    ) {
        self.shared.publish(about, "Seek", type_, reason, note).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_target_comes_from_exactly_one_field() {
        let to = |json: serde_json::Value| target(&serde_json::from_value(json).unwrap());
        assert_eq!(to(serde_json::json!({"time": "2026-12-02T09:00:00Z"})), Ok(Target::Time(1_796_202_000_000)));
        assert_eq!(to(serde_json::json!({"id": "5-1"})), Ok(Target::Id("5-1".into())));
        assert_eq!(to(serde_json::json!({"position": "Latest"})), Ok(Target::Latest));
        assert_eq!(to(serde_json::json!({"shift": -50})), Ok(Target::Shift(-50)));
        assert!(to(serde_json::json!({"shift": -50, "id": "5-1"})).is_err());
        assert!(to(serde_json::json!({"time": "yesterday"})).unwrap_err().contains("no RFC 3339 time"));
    }

    #[test]
    fn one_seek_per_stream_at_a_time() {
        let set = Mutex::default();
        let stream = || ("redis://r:6379/0".to_string(), "orders".to_string());
        let first = Moving::claim(&set, stream()).unwrap();
        assert!(Moving::claim(&set, stream()).is_none());
        drop(first);
        assert!(Moving::claim(&set, stream()).is_some());
    }

    /// Reconciles against a scripted API server and a real, closed port.
    mod scripted {
        use super::super::*;
        use crate::context::scripted::{self, expect};
        use crate::leader::Leadership;
        use http::Method;
        use serde_json::json;

        #[tokio::test]
        async fn a_server_that_does_not_answer_keeps_the_seek_pending_with_the_reason() {
            let (client, mut handle) = scripted::client();
            let (shared, mut writers) =
                Shared::new(client, None, Arc::default(), Leadership::always(), None, Default::default());
            // A Ready policy whose server stopped listening: a port bound, then released.
            let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let policy: ConsumerGroupPolicy = serde_json::from_value(json!({
                "apiVersion": "pelican.io/v1alpha1", "kind": "ConsumerGroupPolicy",
                "metadata": {"name": "orders", "namespace": "apps", "uid": "uid-p"},
                "spec": {"redis": {"url": format!("redis://127.0.0.1:{port}/0")}, "stream": "orders",
                    "group": "billing", "deadLetter": {"stream": "orders:dlq"}},
                "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "Reconciled", "message": "",
                    "lastTransitionTime": "2026-12-03T00:00:00Z"}]},
            }))
            .unwrap();
            writers.policies.apply_watcher_event(&watcher::Event::Apply(policy));
            let claimant = Claimant { id: "test".into(), passive: false };
            let seeks = Arc::new(Seeks { shared, sharded: false, moving: Mutex::default(), claimant });
            let seek: GroupSeek = serde_json::from_value(json!({
                "apiVersion": "pelican.io/v1alpha1", "kind": "GroupSeek",
                "metadata": {"name": "back", "namespace": "apps", "uid": "uid-back", "generation": 1},
                "spec": {"policyRef": {"name": "orders"}, "to": {"position": "Earliest"}},
            }))
            .unwrap();
            let reply = serde_json::to_value(&seek).unwrap();
            let server = tokio::spawn(async move { expect(&mut handle, reply).await });
            let error = reconcile(Arc::new(seek), seeks).await.unwrap_err();
            assert_eq!(error.reason(), "RedisUnavailable", "{error}");
            // The status was written before the reconcile returned: the request is there, or it never comes.
            let written = tokio::time::timeout(Duration::from_secs(1), server).await;
            let (method, path, body) =
                written.expect("no status written: the seek says nothing of why it waits").unwrap();
            assert_eq!(method, Method::PATCH);
            assert_eq!(path, "/apis/pelican.io/v1alpha1/namespaces/apps/groupseeks/back/status");
            assert_eq!(body["status"]["phase"], "Pending");
            let conditions = body["status"]["conditions"].as_array().unwrap();
            let reconciling = conditions.iter().find(|c| c["type"] == "Reconciling").unwrap();
            assert_eq!((&reconciling["status"], &reconciling["reason"]), (&"True".into(), &"RedisUnavailable".into()));
            let message = reconciling["message"].as_str().unwrap();
            assert!(message.contains(&format!("127.0.0.1:{port}")), "{message}");
            assert!(conditions.iter().all(|c| c["type"] != "Failed" || c["status"] == "False"), "{conditions:?}");
        }
    }
}
