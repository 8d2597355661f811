//! The `DeadLetterRedrive` controller, in the same operator as the policies and on their
//! connections. A reconcile runs in phases:
//!
//! 1. finished? A `Succeeded` or `Failed` redrive never runs again; only its TTL is handled;
//! 2. resolve: the policy (from the policy controller's store, so a shard handles the redrives of its own
//!    policies), its server and credentials;
//! 3. decide: suspended, already running, or waiting for another redrive of the same dead-letter stream;
//! 4. act: start the task ([`task`]) that moves the entries and owns the status until it ends.
//!
//! The moves themselves, and the record of progress kept on the server with them, are in
//! [`crate::jobs::redrive`].

mod task;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Preconditions};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, predicates, reflector, watcher};
use kube::{Resource, ResourceExt};
use tokio::sync::watch;
use tracing::{Instrument, info, instrument, warn};

use crate::api::{ConsumerGroupPolicy, DeadLetterRedrive, DeadLetterRedriveStatus, RedrivePhase, SOURCE_TARGET};
use crate::context::Shared;
use crate::context::conditions::{JobState, job_conditions};
use crate::controller::{Claimant, run_elsewhere};
use crate::jobs::redrive::{Destination, Plan};
use crate::keys;
use crate::redis::{Conn, server_identity};
use crate::tenancy::KeyRules;
use crate::{Error, Result};

/// How soon a redrive that waits (for its policy, or another redrive of its dead-letter stream) looks again.
const WAIT_RECHECK: Duration = Duration::from_secs(5);
/// How soon a redrive whose server or Secrets are wrong looks again.
const BLOCKED_RECHECK: Duration = Duration::from_secs(30);

/// A dead-letter stream: the server (canonical URL) and the key.
type StreamKey = (String, String);

/// Why a running task is asked to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Halt {
    /// `spec.suspend`: the task writes `Suspended`.
    Suspend,
    /// The operator stops: the status stays `Running`, the next leader resumes.
    Stop,
}

struct Running {
    rate: watch::Sender<Option<u32>>,
    halt: watch::Sender<Option<Halt>>,
}

/// Shared by the redrive reconciles and their tasks.
pub struct Redrives {
    shared: Arc<Shared>,
    redrives: Store<DeadLetterRedrive>,
    /// When the operator serves one shard, a redrive of a policy outside it belongs to another replica.
    sharded: bool,
    /// Running tasks by object uid.
    tasks: Mutex<HashMap<String, Running>>,
    /// The dead-letter stream of each redrive resolved so far, by uid, for the one-at-a-time rule.
    streams: Mutex<HashMap<String, StreamKey>>,
    /// This install: a redrive of a group another install runs waits for it (two installs on one Redis).
    claimant: Claimant,
}

/// Runs the redrive controller until `shutdown` resolves; running tasks are told to stop then.
pub async fn run(
    shared: Arc<Shared>,
    namespace: Option<String>,
    sharded: bool,
    claimant: Claimant,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let client = shared.client.clone();
    let api: Api<DeadLetterRedrive> = match &namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    let (store, writer) = reflector::store();
    // Only spec changes wake a reconcile: the task writes the status, and waiting redrives look again on a timer.
    let changes = watcher(api, watcher::Config::default().any_semantic())
        .default_backoff()
        .reflect(writer)
        .applied_objects()
        .predicate_filter(predicates::generation, Default::default());
    let ctx = Arc::new(Redrives {
        shared,
        redrives: store.clone(),
        sharded,
        tasks: Mutex::default(),
        streams: Mutex::default(),
        claimant,
    });
    // A redrive names its policy: wait until the policies are listed, or a restarted operator would report
    // policies missing that are only not seen yet.
    let shutdown = shutdown.shared();
    if !ctx.shared.policies_listed(shutdown.clone()).await {
        return;
    }
    let halt_ctx = ctx.clone();
    let shutdown = async move {
        shutdown.await;
        for running in halt_ctx.tasks.lock().expect("tasks lock").values() {
            let _ = running.halt.send(Some(Halt::Stop));
        }
    };
    Controller::for_stream(changes, store)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            // Reconciler errors were logged by error_policy; these are the watch's (a missing RBAC rule, say).
            if let Err(e) = result
                && !matches!(e, kube::runtime::controller::Error::ReconcilerFailed(..))
            {
                warn!(error = %e, "redrive controller error");
            }
        })
        .await;
}

#[instrument(skip_all, fields(namespace = redrive.namespace().unwrap_or_default(), redrive = redrive.name_any()))]
async fn reconcile(redrive: Arc<DeadLetterRedrive>, ctx: Arc<Redrives>) -> Result<Action> {
    let status = redrive.status.clone().unwrap_or_default();
    // 1. A finished redrive is terminal: an operator restart or the same manifest applied again changes nothing.
    if status.phase.is_finished() {
        ctx.forget_gone(&redrive);
        return expire(&ctx, &redrive, &status).await;
    }
    if !ctx.shared.leadership.may_write() {
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    let uid = redrive.uid().unwrap_or_default();
    if let Some(running) = ctx.tasks.lock().expect("tasks lock").get(&uid) {
        if redrive.spec.suspend {
            let _ = running.halt.send(Some(Halt::Suspend));
        } else if running.halt.borrow().is_none() {
            running.rate.send_replace(rate(&redrive));
            // Looked at again when it has finished, for its TTL.
            return Ok(Action::requeue(WAIT_RECHECK));
        }
        // Halting: look again once the task is gone.
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    // 2. Resolve the policy and its server.
    let namespace = redrive.namespace().unwrap_or_default();
    let policy_name = &redrive.spec.policy_ref.name;
    let policy = ctx.shared.policies.get(&ObjectRef::new(policy_name).within(&namespace));
    let Some(policy) = policy else {
        if ctx.sharded {
            // Another shard's policy, or none at all: the shard that serves it writes the status.
            return Ok(Action::requeue(BLOCKED_RECHECK));
        }
        let note = format!(
            "ConsumerGroupPolicy {policy_name:?} not found in namespace {namespace:?}: the redrive starts once it exists"
        );
        ctx.pending(&redrive, &status, "PolicyNotFound", note).await?;
        return Ok(Action::requeue(WAIT_RECHECK));
    };
    let resolved = match ctx.shared.resolve(&policy).await {
        Ok(resolved) => resolved,
        Err(e) if e.is_stalled() => {
            ctx.pending(&redrive, &status, e.reason(), e.to_string()).await?;
            return Ok(Action::requeue(BLOCKED_RECHECK));
        }
        Err(e) => return Err(e),
    };
    let stream: StreamKey = (server_identity(&policy), policy.spec.dead_letter.stream.clone());
    ctx.streams.lock().expect("streams lock").insert(uid.clone(), stream.clone());
    // 3. Decide.
    if redrive.spec.suspend {
        if status.phase != RedrivePhase::Suspended {
            let note = "suspended before it started (spec.suspend)".to_string();
            let mut next = status.clone();
            ctx.set_phase(&redrive, &mut next, RedrivePhase::Suspended, "Suspended", note.clone()).await?;
            ctx.publish(&redrive, EventType::Normal, "Suspended", note).await;
        }
        return Ok(Action::await_change());
    }
    if let Some(other) = ctx.ahead_of(&redrive, &stream) {
        let note = format!(
            "waiting for DeadLetterRedrive {other}, which redrives the same dead-letter stream {:?}: one redrive \
             runs per dead-letter stream at a time",
            stream.1
        );
        if status.conditions.iter().all(|c| c.reason != "Waiting") {
            ctx.publish(&redrive, EventType::Normal, "Waiting", note.clone()).await;
        }
        ctx.pending(&redrive, &status, "Waiting", note).await?;
        return Ok(Action::requeue(WAIT_RECHECK));
    }
    // 4. Act: connect and hand the work to a task.
    let (mut conn, target) = match ctx.shared.pools.connect_primary(&resolved.target).await.map(|(t, c)| (c, t)) {
        Ok(conn) => conn,
        Err(e) if e.is_stalled() => {
            ctx.pending(&redrive, &status, e.reason(), e.to_string()).await?;
            return Ok(Action::requeue(BLOCKED_RECHECK));
        }
        Err(e) => return Err(e),
    };
    // The install that runs the group redrives its dead letters (the same manifest applied in both clusters of a DR
    // pair runs once: where the group runs, and the other finds it finished after a failover).
    if let Some(elsewhere) = run_elsewhere(&mut conn, &target.server(), &policy, &ctx.claimant).await? {
        ctx.pending(&redrive, &status, elsewhere.reason(), elsewhere.to_string()).await?;
        return Ok(Action::requeue(BLOCKED_RECHECK));
    }
    // A dead letter that names no source goes to the policy's stream; on a topic (which is no stream), to its first
    // partition.
    let fallback = match policy.spec.partitions {
        Some(_) => keys::partition_stream(&policy.spec.stream, 0),
        None => policy.spec.stream.clone(),
    };
    let keys = resolved.keys;
    let plan = plan(&redrive, &policy.spec.dead_letter.stream, fallback, target.cluster, keys.clone());
    // A topic on a Cluster has a dead-letter stream per partition, in the partition's slot: a plan for each, its
    // dead letters without a source going back to the partition.
    let partitions = match policy.spec.partitions.filter(|_| target.cluster) {
        Some(_) => crate::controller::streams(&policy)
            .into_iter()
            .map(|stream| {
                let dead_letter = crate::controller::dead_letter_of(&policy, &stream, true);
                self::plan(&redrive, &dead_letter, stream, true, keys.clone())
            })
            .collect(),
        None => Vec::new(),
    };
    let (rate_tx, rate_rx) = watch::channel(rate(&redrive));
    let (halt_tx, halt_rx) = watch::channel(None);
    ctx.tasks.lock().expect("tasks lock").insert(uid.clone(), Running { rate: rate_tx, halt: halt_tx });
    let work = task::Work { conn, server: target.server(), plan, partitions, rate: rate_rx, halt: halt_rx };
    let task_ctx = ctx.clone();
    // The task's log lines carry the redrive's span (namespace and name), as the reconcile's do.
    tokio::spawn(
        async move {
            task::run(task_ctx.clone(), redrive, work).await;
            task_ctx.tasks.lock().expect("tasks lock").remove(&uid);
        }
        .in_current_span(),
    );
    Ok(Action::requeue(WAIT_RECHECK))
}

fn error_policy(redrive: Arc<DeadLetterRedrive>, error: &Error, _ctx: Arc<Redrives>) -> Action {
    warn!(namespace = redrive.namespace(), name = redrive.name_any(), reason = error.reason(), error = %error, "redrive reconcile failed; retrying");
    Action::requeue(WAIT_RECHECK)
}

fn rate(redrive: &DeadLetterRedrive) -> Option<u32> {
    redrive.spec.rate_per_second.map(|r| r.max(1) as u32)
}

/// The plan of the redrive of `dead_letter`, whose dead letters without a `pelican-source-stream` go to `fallback`.
fn plan(
    redrive: &DeadLetterRedrive,
    dead_letter: &str,
    fallback: String,
    cluster: bool,
    keys: Option<KeyRules>,
) -> Plan {
    let namespace = redrive.namespace().unwrap_or_default();
    let filter = redrive.spec.filter.clone().unwrap_or_default();
    Plan {
        progress_key: keys::redrive_key(dead_letter, &namespace, &redrive.name_any()),
        lock_key: keys::redrive_lock_key(dead_letter),
        full_name: format!("{namespace}/{}", redrive.name_any()),
        dead_letter: dead_letter.to_string(),
        uid: redrive.uid().unwrap_or_default(),
        name: redrive.name_any(),
        target: if redrive.spec.target == SOURCE_TARGET {
            Destination::Source { fallback }
        } else {
            Destination::Stream(redrive.spec.target.clone())
        },
        reasons: filter.reasons.into_iter().map(|r| r.0).collect(),
        from: filter.from,
        to: filter.to,
        max_messages: redrive.spec.max_messages.map(|m| m.max(1) as u64),
        cluster,
        keys,
    }
}

/// Deletes a finished redrive once `ttlSecondsAfterFinished` passed, as the Job controller does. The record on the
/// server stays, so the same manifest applied again is not run again.
async fn expire(ctx: &Redrives, redrive: &DeadLetterRedrive, status: &DeadLetterRedriveStatus) -> Result<Action> {
    let (Some(ttl), Some(done)) = (redrive.spec.ttl_seconds_after_finished, status.completion_time.as_deref()) else {
        return Ok(Action::await_change());
    };
    let Ok(done) = done.parse::<Timestamp>() else {
        return Ok(Action::await_change());
    };
    let left = done.as_second() + i64::from(ttl) - Timestamp::now().as_second();
    if left > 0 {
        return Ok(Action::requeue(Duration::from_secs(left as u64)));
    }
    if !ctx.shared.leadership.may_write() {
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    let api: Api<DeadLetterRedrive> =
        Api::namespaced(ctx.shared.client.clone(), &redrive.namespace().unwrap_or_default());
    let params = DeleteParams {
        preconditions: Some(Preconditions { uid: redrive.uid(), resource_version: None }),
        ..DeleteParams::default()
    };
    match api.delete(&redrive.name_any(), &params).await {
        Ok(_) => info!(ttl, "deleted after its TTL"),
        // Gone already, or replaced by a new object of the same name.
        Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
        Err(e) => return Err(e.into()),
    }
    Ok(Action::await_change())
}

impl Redrives {
    /// A connection to where the redrive's policy points now (its Secrets read again, the sentinels asked again),
    /// for a task whose step failed: a failover, a rotated password or a fixed Secret is followed, as the policy's
    /// own jobs follow it.
    async fn reconnect(&self, redrive: &DeadLetterRedrive) -> Result<(Conn, String)> {
        let policy = self.policy_of(redrive)?;
        let target = self.shared.target(&policy).await?;
        let (target, conn) = self.shared.pools.connect_primary(&target).await?;
        Ok((conn, target.server()))
    }

    /// Drops the dead-letter streams remembered for redrives that finished or no longer exist.
    fn forget_gone(&self, finished: &DeadLetterRedrive) {
        let live: std::collections::HashSet<String> = self
            .redrives
            .state()
            .iter()
            .filter(|r| !r.status.as_ref().is_some_and(|s| s.phase.is_finished()))
            .filter_map(|r| r.uid())
            .collect();
        let finished = finished.uid();
        self.streams
            .lock()
            .expect("streams lock")
            .retain(|uid, _| live.contains(uid) && Some(uid) != finished.as_ref());
    }

    /// Whether the redrive with this uid is deleted or finished: its lock on the dead-letter stream is then stale
    /// and may be taken over. A suspended redrive keeps its place (delete it to let the next one run). Never true
    /// before the redrives are listed: a restarted operator would take every lock.
    async fn is_gone(&self, uid: &str) -> bool {
        match tokio::time::timeout(Duration::from_secs(10), self.redrives.wait_until_ready()).await {
            Ok(Ok(())) => {}
            _ => return false,
        }
        !self
            .redrives
            .state()
            .iter()
            .any(|r| r.uid().as_deref() == Some(uid) && !r.status.as_ref().is_some_and(|s| s.phase.is_finished()))
    }

    /// Another redrive that goes first on the same dead-letter stream, as far as this process knows: the first of
    /// the unfinished, unsuspended ones (a started one before a pending one, then by creation), by name. This only
    /// orders the queue; whether a redrive may move is decided by the lock on the server (a task that starts
    /// while another holds it waits), so a restarted operator that has not seen every redrive yet cannot start one
    /// beside another.
    fn ahead_of(&self, redrive: &DeadLetterRedrive, stream: &StreamKey) -> Option<String> {
        let uid = redrive.uid().unwrap_or_default();
        let streams = self.streams.lock().expect("streams lock");
        let rank = |r: &DeadLetterRedrive| {
            let started = r.status.as_ref().is_some_and(|s| s.phase == RedrivePhase::Running);
            (!started, r.metadata.creation_timestamp.clone().map(|t| t.0), r.namespace(), r.name_any())
        };
        let mine = rank(redrive);
        self.redrives
            .state()
            .into_iter()
            .filter(|other| {
                let other_uid = other.uid().unwrap_or_default();
                other_uid != uid
                    && streams.get(&other_uid) == Some(stream)
                    && !other.spec.suspend
                    && !other.status.as_ref().is_some_and(|s| s.phase.is_finished())
                    && rank(other) < mine
            })
            .map(|other| format!("{}/{}", other.namespace().unwrap_or_default(), other.name_any()))
            .next()
    }

    /// `Pending` with the reason it waits, written only when the reason or message changed.
    async fn pending(
        &self,
        redrive: &DeadLetterRedrive,
        status: &DeadLetterRedriveStatus,
        reason: &str,
        note: String,
    ) -> Result<()> {
        let already = status.phase == RedrivePhase::Pending
            && status.conditions.iter().any(|c| c.type_ == "Reconciling" && c.reason == reason && c.message == note);
        if already {
            return Ok(());
        }
        let mut next = status.clone();
        self.set_phase(redrive, &mut next, RedrivePhase::Pending, reason, note).await
    }

    async fn set_phase(
        &self,
        redrive: &DeadLetterRedrive,
        status: &mut DeadLetterRedriveStatus,
        phase: RedrivePhase,
        reason: &str,
        note: String,
    ) -> Result<()> {
        status.phase = phase;
        status.observed_generation = redrive.metadata.generation;
        let generation = redrive.metadata.generation;
        status.conditions = conditions(&status.conditions, phase, reason, &note, generation, Timestamp::now());
        self.write(redrive, status).await
    }

    /// Writes a terminal phase, its completion time and Event.
    async fn finish(
        &self,
        redrive: &DeadLetterRedrive,
        status: &mut DeadLetterRedriveStatus,
        phase: RedrivePhase,
        reason: &str,
        note: String,
    ) -> Result<()> {
        status.completion_time = Some(Timestamp::now().to_string());
        self.set_phase(redrive, status, phase, reason, note.clone()).await?;
        let type_ = if phase == RedrivePhase::Failed { EventType::Warning } else { EventType::Normal };
        let event_reason = if phase == RedrivePhase::Failed { reason } else { "Succeeded" };
        self.shared.metrics.redrive_finished(reason);
        self.publish(redrive, type_, event_reason, note).await;
        Ok(())
    }

    /// Writes the status of this object only: the patch names its uid, so a task of a deleted redrive never writes
    /// onto a new object of the same name (the API server refuses it with a conflict).
    async fn write(&self, redrive: &DeadLetterRedrive, status: &DeadLetterRedriveStatus) -> Result<()> {
        self.shared.apply_status_of_uid(redrive, status).await
    }

    /// Whether this object still exists (as far as the watch has seen): not deleted, nor replaced by a new object of
    /// the same name.
    fn exists(&self, redrive: &DeadLetterRedrive) -> bool {
        self.redrives.get(&ObjectRef::from_obj(redrive)).is_some_and(|now| now.uid() == redrive.uid())
    }

    /// The redrive's policy, as the policy controller's store holds it now.
    fn policy_of(&self, redrive: &DeadLetterRedrive) -> Result<Arc<ConsumerGroupPolicy>> {
        let namespace = redrive.namespace().unwrap_or_default();
        let name = &redrive.spec.policy_ref.name;
        self.shared.policies.get(&ObjectRef::new(name).within(&namespace)).ok_or_else(|| {
            Error::InvalidSpec(format!("ConsumerGroupPolicy {name:?} not found in namespace {namespace:?}"))
        })
    }

    /// Admits the redrive's policy again (its `RedisServer` or namespace may have changed since the task started):
    /// the server's current key rules, or the refusal that ends the redrive.
    async fn readmit(&self, redrive: &DeadLetterRedrive) -> Result<Option<KeyRules>> {
        let policy = self.policy_of(redrive)?;
        self.shared.admission(&policy).await
    }

    async fn publish(&self, redrive: &DeadLetterRedrive, type_: EventType, reason: &str, note: String) {
        self.shared.publish(&redrive.object_ref(&()), "Redrive", type_, reason, note).await;
    }
}

/// The job conditions of a redrive's phase: pending or running -> in progress; failed -> stalled; succeeded or
/// suspended -> current.
fn conditions(
    previous: &[Condition],
    phase: RedrivePhase,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    let state = match phase {
        RedrivePhase::Pending | RedrivePhase::Running => JobState::InProgress,
        RedrivePhase::Succeeded => JobState::Succeeded,
        RedrivePhase::Failed => JobState::Failed,
        RedrivePhase::Suspended => JobState::Idle,
    };
    job_conditions(previous, state, reason, message, generation, now)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn true_ones(conditions: &[Condition]) -> Vec<&str> {
        conditions.iter().filter(|c| c.status == "True").map(|c| c.type_.as_str()).collect()
    }

    #[test]
    fn phases_read_as_jobs_and_kstatus_read_them() {
        let t0 = Timestamp::UNIX_EPOCH;
        let running = conditions(&[], RedrivePhase::Running, "Running", "moving", Some(1), t0);
        assert_eq!(true_ones(&running), ["Reconciling"]);
        assert_eq!(running.iter().find(|c| c.type_ == "Reconciling").unwrap().message, "moving");
        let t1 = Timestamp::from_second(60).unwrap();
        let done = conditions(&running, RedrivePhase::Succeeded, "Complete", "moved 3 of 3", Some(1), t1);
        assert_eq!(true_ones(&done), ["Complete"]);
        let failed_before = running.iter().find(|c| c.type_ == "Failed").unwrap().last_transition_time.clone();
        let failed_now = done.iter().find(|c| c.type_ == "Failed").unwrap().last_transition_time.clone();
        assert_eq!(failed_before, failed_now, "Failed stayed False: its transition time stays");
        let failed = conditions(&running, RedrivePhase::Failed, "CrossSlot", "other slot", Some(1), t1);
        assert_eq!(true_ones(&failed), ["Failed", "Stalled"]);
        assert!(true_ones(&conditions(&[], RedrivePhase::Suspended, "Suspended", "", None, t0)).is_empty());
    }

    /// Reconciles against a scripted API server: each request the reconcile sends is checked, and answered.
    mod scripted {
        use super::super::*;
        use crate::api::{DeadLetterRedriveSpec, PolicyRef};
        use crate::context::scripted::{self, Handle, expect};
        use crate::leader::Leadership;
        use http::Method;

        /// The redrive controller's context on a client whose every request goes to the returned handle.
        fn context() -> (Arc<Redrives>, Handle) {
            let (client, handle) = scripted::client();
            let (shared, _policies) =
                Shared::new(client, None, Arc::default(), Leadership::always(), None, Default::default());
            let redrives = Redrives {
                shared,
                redrives: reflector::store().0,
                sharded: false,
                tasks: Mutex::default(),
                streams: Mutex::default(),
                claimant: Claimant { id: "test".into(), passive: false },
            };
            (Arc::new(redrives), handle)
        }

        fn redrive(status: Option<DeadLetterRedriveStatus>, ttl: Option<i32>) -> Arc<DeadLetterRedrive> {
            let spec = DeadLetterRedriveSpec {
                policy_ref: PolicyRef { name: "orders".into() },
                target: SOURCE_TARGET.into(),
                filter: None,
                max_messages: None,
                rate_per_second: None,
                dry_run: false,
                suspend: false,
                ttl_seconds_after_finished: ttl,
            };
            let mut redrive = DeadLetterRedrive::new("back", spec);
            redrive.metadata.namespace = Some("apps".into());
            redrive.metadata.uid = Some("uid-back".into());
            redrive.metadata.generation = Some(1);
            redrive.status = status;
            Arc::new(redrive)
        }

        #[tokio::test]
        async fn a_missing_policy_is_pending_with_the_reason_and_looked_at_again() {
            let (ctx, mut handle) = context();
            let object = redrive(None, None);
            let reply = serde_json::to_value(object.as_ref()).unwrap();
            let server = tokio::spawn(async move { expect(&mut handle, reply).await });
            let action = reconcile(object, ctx).await.unwrap();
            let (method, path, body) = server.await.unwrap();
            assert_eq!(method, Method::PATCH);
            assert_eq!(path, "/apis/pelican.io/v1alpha1/namespaces/apps/deadletterredrives/back/status");
            assert_eq!(body["status"]["phase"], "Pending");
            let reconciling =
                body["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Reconciling");
            let reconciling = reconciling.unwrap();
            assert_eq!((&reconciling["status"], &reconciling["reason"]), (&"True".into(), &"PolicyNotFound".into()));
            assert!(reconciling["message"].as_str().unwrap().contains("ConsumerGroupPolicy \"orders\" not found"));
            assert_eq!(action, Action::requeue(WAIT_RECHECK));
        }

        #[tokio::test]
        async fn a_finished_redrive_is_deleted_once_its_ttl_passed_and_only_this_object() {
            let (ctx, mut handle) = context();
            let done = Timestamp::now().as_second() - 120;
            let status = DeadLetterRedriveStatus {
                phase: RedrivePhase::Succeeded,
                completion_time: Some(Timestamp::from_second(done).unwrap().to_string()),
                ..DeadLetterRedriveStatus::default()
            };
            let reply = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Success"});
            let server = tokio::spawn(async move { expect(&mut handle, reply).await });
            let action = reconcile(redrive(Some(status), Some(60)), ctx).await.unwrap();
            let (method, path, body) = server.await.unwrap();
            assert_eq!(method, Method::DELETE);
            assert_eq!(path, "/apis/pelican.io/v1alpha1/namespaces/apps/deadletterredrives/back");
            assert_eq!(body["preconditions"]["uid"], "uid-back", "a new object of the same name is never deleted");
            assert_eq!(action, Action::await_change());
        }

        #[tokio::test]
        async fn a_finished_redrive_within_its_ttl_waits_without_a_request() {
            let (ctx, mut handle) = context();
            let status = DeadLetterRedriveStatus {
                phase: RedrivePhase::Failed,
                completion_time: Some(Timestamp::now().to_string()),
                ..DeadLetterRedriveStatus::default()
            };
            let action = reconcile(redrive(Some(status), Some(600)), ctx.clone()).await.unwrap();
            assert!(matches!(action, a if a != Action::await_change()), "it looks again when the TTL ends");
            assert!(scripted::silent(&mut handle).await, "no request to the API server");
        }
    }
}
