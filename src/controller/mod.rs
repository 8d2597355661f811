//! The reconciler: gather facts (Secrets, Redis), act (create or recreate the group), write status.

mod status;

pub use status::{READY, RECONCILED, RECONCILING, STALLED};

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};

use serde_json::json;
use tracing::{debug, info, instrument, warn};

use crate::api::{
    ConsumerGroupPolicy, ConsumerGroupPolicySpec, ConsumerGroupPolicyStatus, DeletionPolicy, RedisMode, SecretKeyRef,
    parse_duration,
};
use crate::jobs::{self, PassSettings};
use crate::keys;
use crate::redis::{self as redis_ops, Conn, Credentials, GroupKeys, PoolKey, Pools, Target, Tls};
use crate::telemetry::{Metrics, PolicyKey, PolicySnapshot, Readiness};
use crate::{Error, Result};
use status::Outcome;

/// Field manager of every status write; the operator owns nothing else of the object but its finalizer.
pub const FIELD_MANAGER: &str = "pelican";
pub const FINALIZER: &str = "pelican.io/cleanup";
/// How often a Stalled policy whose interval cannot be read is looked at again.
const STALLED_RECHECK: Duration = Duration::from_secs(60);

/// Shared by all reconciles.
pub struct Context {
    pub client: Client,
    pub pools: Pools,
    pub recorder: Recorder,
    /// Every policy the controller sees, for the (server, stream, group) ownership check.
    pub policies: Store<ConsumerGroupPolicy>,
    pub metrics: Arc<Metrics>,
    failures: Mutex<HashMap<ObjectRef<ConsumerGroupPolicy>, u32>>,
    passes: Mutex<HashMap<ObjectRef<ConsumerGroupPolicy>, PassState>>,
    /// Which shared connection each policy uses, so unused ones (old credentials) are closed.
    pool_users: Mutex<HashMap<ObjectRef<ConsumerGroupPolicy>, PoolKey>>,
}

/// Where to watch, how to identify ourselves, where to report.
pub struct Settings {
    /// Watch one namespace, or all when `None`.
    pub namespace: Option<String>,
    pub instance: Option<String>,
    pub metrics: Arc<Metrics>,
    pub readiness: Readiness,
}

/// Runs the controller until `shutdown` resolves.
pub async fn run(client: Client, settings: Settings, shutdown: impl Future<Output = ()> + Send + Sync + 'static) {
    let (policies, secrets): (Api<ConsumerGroupPolicy>, Api<PartialObjectMeta<Secret>>) = match &settings.namespace {
        Some(ns) => (Api::namespaced(client.clone(), ns), Api::namespaced(client.clone(), ns)),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let controller = Controller::new(policies, watcher::Config::default().any_semantic());
    let store = controller.store();
    let reporter = Reporter { controller: "pelican".into(), instance: settings.instance };
    let (ready_store, readiness) = (store.clone(), settings.readiness);
    tokio::spawn(async move {
        // The store's readiness signal wakes only its latest waiter (the controller also waits on it), so ask
        // again every second instead of waiting once.
        loop {
            match tokio::time::timeout(Duration::from_secs(1), ready_store.wait_until_ready()).await {
                Ok(Ok(())) => return readiness.set_ready(),
                Ok(Err(_)) => return,
                Err(_) => continue,
            }
        }
    });
    let ctx = Arc::new(Context {
        client: client.clone(),
        pools: Pools::default(),
        recorder: Recorder::new(client, reporter),
        policies: store.clone(),
        metrics: settings.metrics,
        failures: Mutex::default(),
        passes: Mutex::default(),
        pool_users: Mutex::default(),
    });
    // Only Secret metadata is watched: a change to a referenced Secret re-runs its policies at once, and
    // no Secret value is held in the watch cache.
    controller
        .watches(secrets, watcher::Config::default(), move |secret| policies_using_secret(&store, &secret))
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            // Reconciler errors were logged by error_policy, with the policy's namespace and name.
            if let Err(e) = result
                && !matches!(e, kube::runtime::controller::Error::ReconcilerFailed(..))
            {
                warn!(error = %e, "controller error");
            }
        })
        .await;
}

fn policies_using_secret<S: Resource>(
    store: &Store<ConsumerGroupPolicy>,
    secret: &S,
) -> Vec<ObjectRef<ConsumerGroupPolicy>> {
    let (namespace, name) = (secret.meta().namespace.as_deref(), secret.meta().name.as_deref().unwrap_or_default());
    store
        .state()
        .iter()
        .filter(|p| p.namespace().as_deref() == namespace && secret_refs(p).any(|r| r.name == name))
        .map(|p| ObjectRef::from_obj(p.as_ref()))
        .collect()
}

fn secret_refs(policy: &ConsumerGroupPolicy) -> impl Iterator<Item = &SecretKeyRef> {
    let redis = &policy.spec.redis;
    let tls = redis.tls.iter().flat_map(|t| [&t.ca_secret_ref, &t.cert_secret_ref, &t.key_secret_ref]);
    [&redis.username_secret_ref, &redis.password_secret_ref].into_iter().chain(tls).flatten()
}

#[instrument(skip_all, fields(namespace = policy.namespace().unwrap_or_default(), name = policy.name_any()))]
async fn reconcile(policy: Arc<ConsumerGroupPolicy>, ctx: Arc<Context>) -> Result<Action> {
    let start = Instant::now();
    let result = reconcile_inner(policy, &ctx).await;
    ctx.metrics.reconciled(start.elapsed(), result.is_err());
    result
}

async fn reconcile_inner(policy: Arc<ConsumerGroupPolicy>, ctx: &Arc<Context>) -> Result<Action> {
    let namespace = policy.namespace().unwrap_or_default();
    let api: Api<ConsumerGroupPolicy> = Api::namespaced(ctx.client.clone(), &namespace);
    let action = finalizer(&api, FINALIZER, policy, |event| async {
        match event {
            Finalizer::Apply(policy) => apply(&policy, ctx, &api).await,
            Finalizer::Cleanup(policy) => cleanup(&policy, ctx).await,
        }
    })
    .await
    .map_err(|e| match e {
        kube::runtime::finalizer::Error::ApplyFailed(e) | kube::runtime::finalizer::Error::CleanupFailed(e) => e,
        other => Error::Finalizer(Box::new(other)),
    })?;
    Ok(action)
}

/// Retries with exponential backoff per policy (1s, 2s, 4s ... 60s), reset by the next success.
fn error_policy(policy: Arc<ConsumerGroupPolicy>, error: &Error, ctx: Arc<Context>) -> Action {
    let mut failures = ctx.failures.lock().expect("failures lock");
    let count = failures.entry(ObjectRef::from_obj(policy.as_ref())).or_insert(0);
    *count = (*count + 1).min(7);
    warn!(namespace = policy.namespace().unwrap_or_default(), name = policy.name_any(), reason = error.reason(), error = %error, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(1 << (*count - 1)).min(Duration::from_secs(60)))
}

async fn apply(policy: &ConsumerGroupPolicy, ctx: &Context, api: &Api<ConsumerGroupPolicy>) -> Result<Action> {
    let previous = policy.status.clone().unwrap_or_default();
    let schedule = Schedule::from_spec(&policy.spec);
    let result = match &schedule {
        Ok(schedule) => observe(policy, ctx, schedule).await,
        Err(e) => Err(Error::InvalidSpec(e.clone())),
    };
    let now = Timestamp::now();
    let age = result.as_ref().ok().and_then(|seen| status::oldest_pending_age_seconds(&seen.facts));
    let (status, outcome) = match &result {
        Ok(seen) => {
            let message = format!("group {:?} on stream {:?} is ready", policy.spec.group, policy.spec.stream);
            let mut status = status::observed(&previous, &seen.server, &seen.facts);
            if seen.passed {
                status.last_pass_time = Timestamp::from_second(now.as_second()).ok().map(|t| t.to_string());
            }
            (status, Outcome::Ready { message })
        }
        Err(error) => (previous.clone(), Outcome::Failed(error)),
    };
    let status = ConsumerGroupPolicyStatus {
        observed_generation: policy.metadata.generation,
        conditions: status::conditions(&previous.conditions, &outcome, policy.metadata.generation, now),
        ..status
    };
    announce_transition(policy, ctx, &previous, &status).await;
    let snapshot = PolicySnapshot {
        stream: policy.spec.stream.clone(),
        group: policy.spec.group.clone(),
        ready: result.is_ok(),
        status: status.clone(),
        oldest_pending_age_seconds: age,
    };
    ctx.metrics.observe_policy(policy_key(policy), snapshot);
    if policy.status.as_ref() != Some(&status) {
        write_status(api, policy, &status).await?;
    }
    let recheck = schedule.map_or(STALLED_RECHECK, |s| s.interval);
    match result {
        Ok(_) => {
            ctx.failures.lock().expect("failures lock").remove(&ObjectRef::from_obj(policy));
            Ok(Action::requeue(recheck))
        }
        // A Stalled policy waits for a change, but Redis can heal without any Kubernetes event (a key of the
        // wrong type deleted, an ACL fixed), so it is looked at again every interval.
        Err(e) if e.is_stalled() => Ok(Action::requeue(recheck)),
        Err(e) => Err(e),
    }
}

/// The spec's durations, parsed once per reconcile.
struct Schedule {
    interval: Duration,
    pass: PassSettings,
    expire_after: Option<Duration>,
}

impl Schedule {
    fn from_spec(spec: &ConsumerGroupPolicySpec) -> Result<Schedule, String> {
        let duration = |field: &str, text: &str| parse_duration(text).map_err(|e| format!("{field}: {e}"));
        let expire_after = spec.consumers.as_ref().and_then(|c| c.expire_after.as_deref());
        Ok(Schedule {
            interval: duration("spec.reclaim.interval", &spec.reclaim.interval)?,
            pass: PassSettings {
                min_idle: duration("spec.reclaim.minIdle", &spec.reclaim.min_idle)?,
                max_per_pass: spec.reclaim.max_per_pass.max(1) as usize,
                max_deliveries: spec.retry.max_deliveries.max(1) as u32,
                strategy: spec.reclaim.strategy,
                dead_letter_max_len: spec.dead_letter.max_len.map(|n| n.max(1) as u64),
            },
            expire_after: expire_after.map(|text| duration("spec.consumers.expireAfter", text)).transpose()?,
        })
    }
}

/// What one reconcile saw on the server.
struct Observation {
    server: redis_ops::ServerInfo,
    facts: redis_ops::GroupFacts,
    /// A reclaim pass ran in this reconcile.
    passed: bool,
}

/// Where the reclaim scan of one policy stands between passes.
#[derive(Default)]
struct PassState {
    last_started: Option<Instant>,
    cursor: Option<String>,
}

/// Connects, creates the group when missing, runs the jobs when due and reads the numbers the status shows.
async fn observe(policy: &ConsumerGroupPolicy, ctx: &Context, schedule: &Schedule) -> Result<Observation> {
    if let Some(conflict) = conflict(policy, &ctx.policies) {
        return Err(Error::ResourceConflict(conflict.to_string()));
    }
    if policy.spec.redis.mode == RedisMode::Cluster {
        same_slot(&policy.spec)?;
    }
    let target = target(policy, &ctx.client).await?;
    ctx.pools.assign(&ctx.pool_users, &ObjectRef::from_obj(policy), Some(&target));
    let server = target.server();
    let mut conn = ctx.pools.get(&target).await?;
    let keys = group_keys(policy);
    let carry_over = !shares_legacy_counters(policy, &ctx.policies);
    let setup = redis_ops::ensure_group(&mut conn, &server, &keys, &policy.spec.start_id, carry_over).await;
    if let Err(Error::AuthenticationFailed { .. } | Error::TlsFailed { .. }) = &setup {
        ctx.pools.forget(&target);
    }
    let setup = setup?;
    if setup.carried_over > 0 {
        let [totals, terminal] = keys::legacy_keys(keys.stream, keys.group);
        let note = format!(
            "carried {} counter fields over from {totals:?} and {terminal:?} to the keys that name the stream",
            setup.carried_over
        );
        let (namespace, name) = policy_key(policy);
        info!(namespace, name, "{note}");
        publish(ctx, policy, EventType::Normal, "CountersCarriedOver", note).await;
    }
    if setup.created {
        // A status that shows server numbers means this policy saw its group before, whatever its condition is
        // now (a restart without persistence first shows RedisUnavailable): the group was lost, and recreating it
        // at startId may skip or replay messages, so it is a Warning every time.
        let seen_before = policy.status.as_ref().is_some_and(|s| s.server_version.is_some());
        let (type_, reason, note) = if seen_before {
            let note = format!(
                "group {:?} on stream {:?} was missing and has been recreated at {:?}",
                keys.group, keys.stream, policy.spec.start_id
            );
            (EventType::Warning, "GroupRecreated", note)
        } else {
            let note =
                format!("created group {:?} on stream {:?} at {:?}", keys.group, keys.stream, policy.spec.start_id);
            (EventType::Normal, "GroupCreated", note)
        };
        let (namespace, name) = policy_key(policy);
        info!(namespace, name, group = keys.group, stream = keys.stream, reason, "{note}");
        publish(ctx, policy, type_, reason, note).await;
    }
    let passed = !policy.spec.suspend && run_jobs_if_due(policy, ctx, schedule, &mut conn, &server).await?;
    let facts = redis_ops::probe_group(&mut conn, &server, &keys).await?;
    Ok(Observation { server: setup.server, facts, passed })
}

/// Runs the reclaim / dead-letter pass and consumer expiry when `interval` has passed since the last pass
/// (reconciles also happen on watch events, which must not speed the jobs up). Returns whether they ran.
async fn run_jobs_if_due(
    policy: &ConsumerGroupPolicy,
    ctx: &Context,
    schedule: &Schedule,
    conn: &mut Conn,
    server: &str,
) -> Result<bool> {
    let key = ObjectRef::from_obj(policy);
    let mut state = {
        let mut passes = ctx.passes.lock().expect("passes lock");
        let state = passes.entry(key.clone()).or_default();
        if state.last_started.is_some_and(|t| t.elapsed() < schedule.interval) {
            return Ok(false);
        }
        std::mem::take(state)
    };
    state.last_started = Some(Instant::now());
    let keys = group_keys(policy);
    let result = jobs::reclaim_pass(conn, server, &keys, &schedule.pass, &mut state.cursor).await;
    ctx.passes.lock().expect("passes lock").insert(key, state);
    let report = result?;
    let (namespace, name) = policy_key(policy);
    debug!(
        namespace,
        name,
        scanned = report.scanned,
        idle = report.idle,
        skipped = report.skipped,
        "reclaim pass: {}",
        report.summary()
    );
    if report.dead_letter_evicted > 0 {
        let note = format!(
            "spec.deadLetter.maxLen {} dropped {} older dead letters to make room",
            schedule.pass.dead_letter_max_len.unwrap_or_default(),
            report.dead_letter_evicted
        );
        warn!(namespace, name, evicted = report.dead_letter_evicted, "{note}");
        publish(ctx, policy, EventType::Warning, "DeadLettersEvicted", note).await;
    }
    if report.moved() > 0 || report.too_large > 0 {
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
        publish(ctx, policy, type_, reason, note).await;
    }
    if let Some(expire_after) = schedule.expire_after {
        let expired = jobs::expire_consumers(conn, server, &keys, expire_after).await?;
        if expired > 0 {
            let note =
                format!("deleted {expired} consumers inactive for {expire_after:?} that owned no pending entries");
            publish(ctx, policy, EventType::Normal, "ConsumersExpired", note).await;
        }
    }
    Ok(true)
}

/// In a cluster the scripts touch the stream, the dead-letter stream and the counters at once, so every key any
/// script touches must live in the stream's hash slot (SPEC sections 3 and 4). Checked before anything is written.
fn same_slot(spec: &ConsumerGroupPolicySpec) -> Result<()> {
    let stream_slot = keys::slot(&spec.stream);
    if !keys::has_same_slot_keys(&spec.stream) {
        let renamed = spec.stream.replace(['{', '}'], "");
        return Err(Error::CrossSlot(format!(
            "spec.stream {:?} has a '}}' but no hash tag, so Redis hashes the whole name and no key of Pelican's              counters can be built in its slot (slot {stream_slot}); give the stream a hash tag, e.g.              \"{{{renamed}}}:events\", or a name without braces",
            spec.stream
        )));
    }
    let dead_letter_slot = keys::slot(&spec.dead_letter.stream);
    if stream_slot == dead_letter_slot {
        return Ok(());
    }
    let tag = keys::hash_tag(&spec.stream);
    Err(Error::CrossSlot(format!(
        "spec.stream {:?} (slot {stream_slot}) and spec.deadLetter.stream {:?} (slot {dead_letter_slot}) are in different \
         cluster slots; give both the same hash tag, e.g. stream \"{{{tag}}}:events\" and deadLetter.stream \"{{{tag}}}:dlq\" \
         (Pelican's counters follow the stream's tag)",
        spec.stream, spec.dead_letter.stream
    )))
}

fn policy_key(policy: &ConsumerGroupPolicy) -> PolicyKey {
    (policy.namespace().unwrap_or_default(), policy.name_any())
}

fn group_keys(policy: &ConsumerGroupPolicy) -> GroupKeys<'_> {
    GroupKeys { stream: &policy.spec.stream, group: &policy.spec.group, dead_letter: &policy.spec.dead_letter.stream }
}

/// Why a policy cannot own what it claims: an older policy on the same server claims the same (stream, group), or
/// a different pair whose counter keys have the same names (SPEC sections 3 and 4).
#[derive(Debug, PartialEq, Eq)]
enum Conflict {
    SameGroup { stream: String, group: String, owner: String },
    SameKeys { key: String, owner: String, stream: String, group: String },
}

impl std::fmt::Display for Conflict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Conflict::SameGroup { stream, group, owner } => write!(
                f,
                "stream {stream:?} group {group:?} on this server is already managed by ConsumerGroupPolicy {owner}"
            ),
            Conflict::SameKeys { key, owner, stream, group } => write!(
                f,
                "the counter key {key:?} of this policy is also the key of ConsumerGroupPolicy {owner} (stream                  {stream:?}, group {group:?}): names are joined with ':', so rename the group or the stream so that                  the two differ"
            ),
        }
    }
}

/// The older of two policies claiming one group or one key name wins (SPEC section 3).
fn conflict(policy: &ConsumerGroupPolicy, store: &Store<ConsumerGroupPolicy>) -> Option<Conflict> {
    let rank =
        |p: &ConsumerGroupPolicy| (p.metadata.creation_timestamp.clone().map(|t| t.0), p.namespace(), p.name_any());
    let (stream, group) = (&policy.spec.stream, &policy.spec.group);
    let key = keys::totals_key(stream, group);
    let mut older: Vec<_> = store
        .state()
        .into_iter()
        .filter(|other| {
            other.metadata.uid != policy.metadata.uid
                && other.metadata.deletion_timestamp.is_none()
                && other.spec.redis.url == policy.spec.redis.url
                && rank(other) < rank(policy)
        })
        .collect();
    older.sort_by_key(|other| rank(other));
    older.iter().find_map(|other| {
        let owner = format!("{}/{}", other.namespace().unwrap_or_default(), other.name_any());
        let (other_stream, other_group) = (&other.spec.stream, &other.spec.group);
        if other_stream == stream && other_group == group {
            Some(Conflict::SameGroup { stream: stream.clone(), group: group.clone(), owner })
        } else if keys::totals_key(other_stream, other_group) == key {
            let (stream, group) = (other_stream.clone(), other_group.clone());
            Some(Conflict::SameKeys {
                key: keys::terminal_key(&policy.spec.stream, &policy.spec.group),
                owner,
                stream,
                group,
            })
        } else {
            None
        }
    })
}

/// Whether another policy on the same server has a stream of the same hash tag and the same group name: the 0.1
/// counter keys (`{T}:pelican:<group>:...`) were shared by such policies, so their counts belong to no one of
/// them alone and are not carried over (SPEC section 4).
fn shares_legacy_counters(policy: &ConsumerGroupPolicy, store: &Store<ConsumerGroupPolicy>) -> bool {
    let legacy = keys::legacy_keys(&policy.spec.stream, &policy.spec.group);
    store.state().iter().any(|other| {
        other.metadata.uid != policy.metadata.uid
            && other.spec.redis.url == policy.spec.redis.url
            && other.spec.stream != policy.spec.stream
            && keys::legacy_keys(&other.spec.stream, &other.spec.group) == legacy
    })
}

/// The server and credentials of a policy, read from Secrets in its own namespace.
async fn target(policy: &ConsumerGroupPolicy, client: &Client) -> Result<Target> {
    let namespace = policy.namespace().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    let redis = &policy.spec.redis;
    let credentials = Credentials {
        username: secret_value(&secrets, &namespace, redis.username_secret_ref.as_ref()).await?,
        password: secret_value(&secrets, &namespace, redis.password_secret_ref.as_ref()).await?,
    };
    let tls = match &redis.tls {
        None => Tls::default(),
        Some(spec) => Tls {
            ca: secret_value(&secrets, &namespace, spec.ca_secret_ref.as_ref()).await?.map(String::into_bytes),
            client_cert: secret_value(&secrets, &namespace, spec.cert_secret_ref.as_ref())
                .await?
                .map(String::into_bytes),
            client_key: secret_value(&secrets, &namespace, spec.key_secret_ref.as_ref()).await?.map(String::into_bytes),
            insecure_skip_verify: spec.insecure_skip_verify,
        },
    };
    Ok(Target { url: redis.url.clone(), credentials, tls, cluster: redis.mode == RedisMode::Cluster })
}

async fn secret_value(
    secrets: &Api<Secret>,
    namespace: &str,
    reference: Option<&SecretKeyRef>,
) -> Result<Option<String>> {
    let Some(reference) = reference else {
        return Ok(None);
    };
    let not_found = || Error::SecretNotFound {
        namespace: namespace.into(),
        name: reference.name.clone(),
        key: reference.key.clone(),
    };
    let secret = secrets.get_opt(&reference.name).await?.ok_or_else(not_found)?;
    let bytes = secret.data.as_ref().and_then(|d| d.get(&reference.key)).map(|v| v.0.clone());
    let bytes = bytes
        .or_else(|| secret.string_data.as_ref()?.get(&reference.key).map(|s| s.clone().into_bytes()))
        .ok_or_else(not_found)?;
    let text = String::from_utf8(bytes).map_err(|_| Error::SecretInvalid {
        namespace: namespace.into(),
        name: reference.name.clone(),
        key: reference.key.clone(),
    })?;
    // Secrets written by hand often end in a newline (`echo pass | kubectl create secret --from-file`).
    Ok(Some(text.trim_end_matches(['\r', '\n']).to_string()))
}

/// Runs on deletion: Redis by `deletionPolicy`, then the policy's state and connection are forgotten.
async fn cleanup(policy: &ConsumerGroupPolicy, ctx: &Context) -> Result<Action> {
    let key = ObjectRef::from_obj(policy);
    ctx.passes.lock().expect("passes lock").remove(&key);
    ctx.failures.lock().expect("failures lock").remove(&key);
    ctx.metrics.forget_policy(&policy_key(policy));
    let done = release_redis(policy, ctx).await;
    ctx.pools.assign(&ctx.pool_users, &key, None);
    done
}

/// `Retain` leaves Redis untouched; `Delete` destroys the group (never the streams).
async fn release_redis(policy: &ConsumerGroupPolicy, ctx: &Context) -> Result<Action> {
    if policy.spec.deletion_policy == DeletionPolicy::Retain {
        return Ok(Action::await_change());
    }
    if let Some(conflict) = conflict(policy, &ctx.policies) {
        let note = format!("group {:?} not destroyed: {conflict}", policy.spec.group);
        publish(ctx, policy, EventType::Normal, "GroupRetained", note).await;
        return Ok(Action::await_change());
    }
    let target = match target(policy, &ctx.client).await {
        Ok(target) => target,
        // Without credentials the group cannot be destroyed; holding the finalizer would hang the deletion
        // (and its namespace) forever, so the group is left in place and the user told.
        Err(e @ (Error::SecretNotFound { .. } | Error::SecretInvalid { .. })) => {
            let note = format!("group {:?} left in Redis: {e}", policy.spec.group);
            publish(ctx, policy, EventType::Warning, "CleanupSkipped", note).await;
            return Ok(Action::await_change());
        }
        Err(e) => return Err(e),
    };
    let server = target.server();
    let mut conn = ctx.pools.get(&target).await?;
    let destroyed = redis_ops::destroy_group(&mut conn, &server, &policy.spec.stream, &policy.spec.group).await?;
    if destroyed {
        let note = format!("destroyed group {:?} on stream {:?}", policy.spec.group, policy.spec.stream);
        publish(ctx, policy, EventType::Normal, "GroupDestroyed", note).await;
    }
    Ok(Action::await_change())
}

async fn write_status(
    api: &Api<ConsumerGroupPolicy>,
    policy: &ConsumerGroupPolicy,
    status: &ConsumerGroupPolicyStatus,
) -> Result<()> {
    let patch = json!({
        "apiVersion": "pelican.io/v1alpha1",
        "kind": "ConsumerGroupPolicy",
        "status": status,
    });
    api.patch_status(&policy.name_any(), &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch)).await?;
    Ok(())
}

/// One Event per change of the Ready reason, never one per retry.
async fn announce_transition(
    policy: &ConsumerGroupPolicy,
    ctx: &Context,
    previous: &ConsumerGroupPolicyStatus,
    next: &ConsumerGroupPolicyStatus,
) {
    let ready = |s: &ConsumerGroupPolicyStatus| {
        s.conditions.iter().find(|c| c.type_ == READY).map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
    };
    let (before, after) = (ready(previous), ready(next));
    let Some((status, reason, message)) = after else {
        return;
    };
    if before.as_ref().map(|(s, r, _)| (s, r)) == Some((&status, &reason)) {
        return;
    }
    let (namespace, name) = policy_key(policy);
    if status == "True" {
        info!(namespace, name, reason, "{message}");
        publish(ctx, policy, EventType::Normal, "Ready", message).await;
        if policy.spec.redis.tls.as_ref().is_some_and(|t| t.insecure_skip_verify) {
            let note =
                "spec.redis.tls.insecureSkipVerify is true: the server's certificate is not verified".to_string();
            warn!(namespace, name, "{note}");
            publish(ctx, policy, EventType::Warning, "InsecureSkipVerify", note).await;
        }
    } else {
        warn!(namespace, name, reason, "{message}");
        publish(ctx, policy, EventType::Warning, &reason, message).await;
    }
}

async fn publish(ctx: &Context, policy: &ConsumerGroupPolicy, type_: EventType, reason: &str, note: String) {
    let event = Event { type_, reason: reason.into(), note: Some(note), action: "Reconcile".into(), secondary: None };
    if let Err(e) = ctx.recorder.publish(&event, &policy.object_ref(&())).await {
        let (namespace, name) = policy_key(policy);
        warn!(namespace, name, error = %e, reason, "could not publish event");
    }
}
