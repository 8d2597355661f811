//! The control loop. Each reconcile runs four phases, each in its own file:
//!
//! 1. resolve: the policy's Secrets -> the server and identity to connect with (cached Secret values, in
//!    [`crate::context`], which the redrive controller uses too);
//! 2. [`validate`]: schedule, conflicts with other policies, cluster slots (pure);
//! 3. [`plan`] (pure) and [`act`] (its IO): the group on the server, the jobs handed to the [`Runner`], the numbers
//!    read back;
//! 4. [`report`]: status, conditions, Events, metrics.
//!
//! Phases 2 and 3 ask what they need of a [`Host`] (pools, runner, announcements), which the reconcile's
//! [`Context`] is, and so is `pelican local` ([`crate::local`]), which runs them without a cluster.
//!
//! The data-plane work (passes, expiry) lives in [`crate::runner`], on its own clock. A reconcile is woken by a
//! change of the spec (generation), of the finalizers or deletion, of a referenced Secret, or by its requeue
//! timer (`interval`), never by its own status writes.

mod act;
mod neighbours;
mod plan;
mod progress;
mod report;
mod status;
mod topic;
mod validate;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{Predicate, WatchStreamExt, predicates, watcher};
use kube::{Resource, ResourceExt};
use tracing::{debug, instrument, warn};

use crate::api::{ConsumerGroupPolicy, RedisServer};
use crate::context::{self, Shared, Writers, policy_id};
use crate::redis::{PoolKey, Target};
use crate::runner::{Announcer, PodWatch, Runner};
use crate::telemetry::Readiness;
use crate::{Error, Result};
use neighbours::Neighbours;
use validate::Schedule;

pub use act::{Claimant, Host, Observation, run_elsewhere};
pub use plan::{Announcement, dead_letter_of, streams};
pub use validate::validate;

pub const FINALIZER: &str = "pelican.io/cleanup";
/// How often a policy whose interval cannot be read is looked at again.
const STALLED_RECHECK: Duration = Duration::from_secs(60);
/// How soon a replica that may not write (yet) looks at a policy again.
const NOT_LEADING_RECHECK: Duration = Duration::from_secs(1);
/// The longest a reconcile may run; one that hangs longer (a call that never returns) is cut off and retried.
const RECONCILE_LIMIT: Duration = Duration::from_secs(30);
/// How many reconciles of failing policies (status and Events to write, a deletion to finish) run at once, of
/// `--max-concurrent-reconciles`: thousands of policies on servers that are gone or in namespaces being deleted
/// leave the other slots to the policies whose servers answer.
const FAILURE_LANE: usize = 4;
/// How soon a deferred reconcile looks again (plus up to as much again at random, so deferred ones spread out).
const DEFERRED_RECHECK: Duration = Duration::from_millis(500);

/// What the reconciles of policies share: the handles every controller has, and the policy controller's own state.
pub struct Context {
    pub shared: Arc<Shared>,
    /// Which of them share a server and a stream or a key name with a given policy.
    neighbours: Neighbours,
    runner: Runner,
    failures: Mutex<HashMap<ObjectRef<ConsumerGroupPolicy>, u32>>,
    /// Which shared connection each policy uses, so unused ones (old credentials) are closed.
    pool_users: Mutex<HashMap<ObjectRef<ConsumerGroupPolicy>, PoolKey>>,
    /// Policies (by uid) the watch saw deleted, so a reconcile that was in flight then does not start their jobs
    /// again when it finishes.
    deleted: Tombstones,
    /// Permits for reconciles of failing policies ([`FAILURE_LANE`]).
    failure_lane: tokio::sync::Semaphore,
    /// Whether a namespace is being deleted, as read in the last seconds (one read for all of its policies).
    terminating: Mutex<HashMap<String, (bool, Instant)>>,
    /// Each policy's latest samples of its group's counters, for the `Consuming` verdict and the rates.
    progress: Mutex<HashMap<ObjectRef<ConsumerGroupPolicy>, progress::Window>>,
    /// [`Settings::install`].
    install: String,
    /// [`Settings::claimant`].
    claimant: act::Claimant,
    /// The policies whose status this process wrote, each with the version its last look read: a status naming
    /// another install in any other version was written by it since (see [`report`]).
    wrote: Mutex<HashMap<ObjectRef<ConsumerGroupPolicy>, Option<String>>>,
    /// The watched namespace (`--namespace`), for the Pod watch.
    watch_namespace: Option<String>,
    /// Pod metadata of the watched namespaces, watched from the first policy with `spec.consumers.pods` on (an
    /// install whose policies never name Pods never reads them).
    pods: OnceLock<PodWatch>,
}

impl Context {
    /// The store of Pod metadata, its watch started on first use.
    fn pods(&self) -> PodWatch {
        self.pods
            .get_or_init(|| {
                let client = self.shared.client.clone();
                let api: Api<PartialObjectMeta<Pod>> = match &self.watch_namespace {
                    Some(ns) => Api::namespaced(client, ns),
                    None => Api::all(client),
                };
                let (store, writer) = reflector::store();
                let current = Arc::new(AtomicBool::new(false));
                let health = current.clone();
                let forbidden = Arc::new(Mutex::new(None));
                let refusal = forbidden.clone();
                let watch = watcher(api, watcher::Config::default())
                    .default_backoff()
                    .modify(|pod| {
                        pod.managed_fields_mut().clear();
                        pod.annotations_mut().clear();
                    })
                    .reflect(writer)
                    .for_each(move |event| {
                        // Current once a listing is complete and while changes arrive; not from an error or the
                        // start of a re-list until the listing is complete again.
                        let now_current = match &event {
                            Ok(watcher::Event::InitDone | watcher::Event::Apply(_) | watcher::Event::Delete(_)) => {
                                Some(true)
                            }
                            Ok(watcher::Event::Init) => Some(false),
                            Ok(watcher::Event::InitApply(_)) => None,
                            Err(e) => {
                                warn!(error = %e, "watching Pods for spec.consumers.pods failed; retrying (the operator needs list and watch on pods: the chart's rbac.consumerPods); no consumer is taken for gone meanwhile");
                                if let Some(detail) = forbidden_detail(e) {
                                    *refusal.lock().expect("pod watch lock") = Some(detail);
                                }
                                Some(false)
                            }
                        };
                        if let Some(now_current) = now_current {
                            health.store(now_current, Ordering::Relaxed);
                            if now_current {
                                *refusal.lock().expect("pod watch lock") = None;
                            }
                        }
                        std::future::ready(())
                    });
                tokio::spawn(watch);
                PodWatch { store, current, forbidden }
            })
            .clone()
    }
}

/// The API server's message when it refused a watch for lack of a right (403 Forbidden): no retry heals that until
/// someone grants the right, unlike a watch that failed on the way.
fn forbidden_detail(error: &watcher::Error) -> Option<String> {
    let status = match error {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status))
        | watcher::Error::WatchError(status) => status,
        _ => return None,
    };
    status.is_forbidden().then(|| status.message.clone())
}

/// The uids of recently deleted policies. A reconcile lasts seconds (a slow server), so a uid is kept
/// [`Tombstones::KEEP`] and then dropped: the set stays as small as the deletions of the last minutes.
#[derive(Default)]
struct Tombstones(Mutex<HashMap<String, Instant>>);

impl Tombstones {
    const KEEP: Duration = Duration::from_secs(600);

    fn bury(&self, uid: &str) {
        let mut gone = self.0.lock().expect("tombstones lock");
        gone.retain(|_, at| at.elapsed() < Self::KEEP);
        gone.insert(uid.to_string(), Instant::now());
    }

    fn contains(&self, uid: &str) -> bool {
        self.0.lock().expect("tombstones lock").contains_key(uid)
    }

    /// Drops the uids kept longer than [`Tombstones::KEEP`]; returns how many are left.
    fn prune(&self) -> usize {
        let mut gone = self.0.lock().expect("tombstones lock");
        gone.retain(|_, at| at.elapsed() < Self::KEEP);
        gone.len()
    }
}

/// How often what the operator keeps per server or Secret is checked against the policies that still use it.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

impl Context {
    /// A permit of the failing policies' lane, or [`Error::Deferred`] when all are taken.
    fn failure_permit(&self) -> Result<tokio::sync::SemaphorePermit<'_>> {
        self.failure_lane.try_acquire().map_err(|_| Error::Deferred("the failing policies' reconciles are busy".into()))
    }

    /// Forgets what no policy uses any more: cached Secret values, sentinel connections, a server's pass permits.
    /// Per-policy state goes when the policy goes ([`act::forget`]); these are shared by policies, so they are
    /// swept instead.
    fn sweep(&self) {
        self.shared.secrets.retain_referenced(&self.shared.referenced_secrets());
        let (policies, servers) = (self.shared.policies.state(), self.shared.servers.state());
        let inline = policies.iter().filter(|p| p.spec.redis.sentinel.is_some()).map(|p| p.spec.redis.url.as_str());
        let referenced = servers.iter().filter(|s| s.spec.sentinel.is_some()).map(|s| s.spec.url.as_str());
        self.shared.pools.retain_sentinels(inline.chain(referenced));
        // What is known of the reachability of servers no policy names any more.
        let urls = policies.iter().filter_map(|p| match p.server_ref() {
            None => Some(p.spec.redis.url.as_str()),
            Some((namespace, name)) => servers
                .iter()
                .find(|s| s.namespace().as_deref() == Some(namespace.as_str()) && s.name_any() == name)
                .map(|s| s.spec.url.as_str()),
        });
        let used: Vec<String> = urls.map(|url| crate::redis::Target::new(url).server()).collect();
        self.shared.pools.reach.retain(used.iter().map(String::as_str));
        self.shared.pools.features.retain(used.iter().map(String::as_str));
        act::prune_terminating(self);
        self.runner.sweep();
        self.deleted.prune();
    }

    /// Entries of each in-memory map, for `pelican_state_entries`.
    fn sizes(&self) -> Vec<(&'static str, usize)> {
        let mut sizes = vec![
            ("connections", self.shared.pools.len()),
            ("sentinel_connections", self.shared.pools.sentinels()),
            ("secrets", self.shared.secrets.len()),
            ("deleted_policies", self.deleted.prune()),
            ("reconcile_failures", self.failures.lock().expect("failures lock").len()),
            ("connection_users", self.pool_users.lock().expect("pool users lock").len()),
            ("neighbour_index", self.neighbours.len()),
            ("server_reachability", self.shared.pools.reach.len()),
            ("server_features", self.shared.pools.features.len()),
            ("terminating_namespaces", self.terminating.lock().expect("terminating lock").len()),
            ("scaler_readings", self.shared.readings.len()),
            ("progress_windows", self.progress.lock().expect("progress lock").len()),
        ];
        sizes.extend(self.runner.sizes());
        sizes
    }
}

/// Where to watch and how much at once.
pub struct Settings {
    /// Watch one namespace, or all when `None`.
    pub namespace: Option<String>,
    pub readiness: Readiness,
    /// Only policies matching this label selector (a shard); all when `None`.
    pub label_selector: Option<String>,
    /// How many policies are reconciled at once. Bounds the burst on the API server and on each Redis connection
    /// when thousands of policies are seen at start; passes are bounded separately, per server, by the runner.
    pub concurrency: u16,
    /// Watch Secrets only in these namespaces (the operator's RBAC); all watched namespaces when `None`.
    pub secret_namespaces: Option<BTreeSet<String>>,
    /// This install, named by its leader Lease (`<namespace>/<name>`): written in each policy's status, where
    /// another install's name shows that two serve it.
    pub install: String,
    /// This install as it claims each group on its server, so that two installs on one Redis never both run it.
    pub claimant: Claimant,
    /// `--drain-pause`: how long a server's pass permit rests after a pass that left a backlog.
    pub drain_pause: Duration,
}

/// Up to `max`, at random: spreads out retries that would otherwise come due together.
fn jitter(max: Duration) -> Duration {
    use std::hash::BuildHasher;
    let random = std::collections::hash_map::RandomState::new().hash_one(Instant::now());
    max.mul_f64((random % 1000) as f64 / 1000.0)
}

fn id(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// Runs the controller until `shutdown` resolves; `writers` fill `shared.policies` and `shared.servers`.
pub async fn run(
    shared: Arc<Shared>,
    writers: Writers,
    settings: Settings,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let client = shared.client.clone();
    let policies: Api<ConsumerGroupPolicy> = match &settings.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    // Where Secrets are watched (metadata only) and read: the watched namespace, the --secret-namespaces, or all.
    let secrets: Vec<Api<PartialObjectMeta<Secret>>> = match (&settings.namespace, &settings.secret_namespaces) {
        (Some(ns), _) => vec![Api::namespaced(client.clone(), ns)],
        (None, Some(namespaces)) => namespaces.iter().map(|ns| Api::namespaced(client.clone(), ns)).collect(),
        (None, None) => vec![Api::all(client.clone())],
    };
    let store = shared.policies.clone();
    let ctx = Arc::new(Context {
        runner: Runner::new(
            shared.leadership.clone(),
            Announcer::Events(shared.events.clone()),
            shared.metrics.clone(),
            shared.pools.clone(),
        )
        .with_drain_pause(settings.drain_pause),
        shared: shared.clone(),
        neighbours: Neighbours::default(),
        failures: Mutex::default(),
        pool_users: Mutex::default(),
        deleted: Tombstones::default(),
        failure_lane: tokio::sync::Semaphore::new(FAILURE_LANE),
        terminating: Mutex::default(),
        progress: Mutex::default(),
        install: settings.install.clone(),
        claimant: settings.claimant.clone(),
        wrote: Mutex::default(),
        watch_namespace: settings.namespace.clone(),
        pods: OnceLock::new(),
    });
    let sweep_ctx = Arc::downgrade(&ctx);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(SWEEP_EVERY).await;
            match sweep_ctx.upgrade() {
                Some(ctx) => ctx.sweep(),
                None => return,
            }
        }
    });
    let state_ctx = Arc::downgrade(&ctx);
    shared.metrics.watch_state(move || state_ctx.upgrade().map(|ctx| ctx.sizes()).unwrap_or_default());
    // Status writes change the resource version but not the generation: they must not wake the reconcile.
    let mut config = watcher::Config::default().any_semantic();
    if let Some(selector) = &settings.label_selector {
        config = config.labels(selector);
    }
    let watch_ctx = ctx.clone();
    let changes = watcher(policies, config)
        .default_backoff()
        // Nothing reads managedFields or kubectl's last-applied annotation; with thousands of policies they would
        // be most of what the store holds.
        .modify(|policy| {
            policy.managed_fields_mut().clear();
            policy.annotations_mut().remove("kubectl.kubernetes.io/last-applied-configuration");
        })
        .inspect_ok(move |event| {
            // A policy without a finalizer is gone without a reconcile: its jobs stop here.
            for gone in watch_ctx.neighbours.observe(event) {
                act::forget(&watch_ctx, &gone);
            }
        })
        .reflect(writers.policies)
        .applied_objects()
        .predicate_filter(predicates::generation.combine(predicates::finalizers), Default::default());
    // Only Secret metadata is watched (`Api<PartialObjectMeta<_>>` asks the API server for PartialObjectMetadata,
    // so no value crosses the watch): a change to a referenced Secret drops its cached value and re-runs its
    // policies at once.
    let secret_changes = futures::stream::select_all(
        secrets
            .into_iter()
            .map(|api| watcher(api, watcher::Config::default()).default_backoff().touched_objects().boxed()),
    );
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
    // RedisServers: the store the reconciles resolve `serverRef` in, and a change of one (its URL, credentials,
    // TLS or tenants) re-runs every policy that uses it.
    let server_api: Api<RedisServer> = match &settings.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let servers = watcher(server_api, watcher::Config::default())
        .default_backoff()
        .modify(|server| server.managed_fields_mut().clear())
        .reflect(writers.servers);
    let (secret_ctx, server_ctx) = (ctx.clone(), ctx.clone());
    Controller::for_stream(changes, store.clone())
        .watches_stream(secret_changes, move |secret| {
            let (namespace, name) = (secret.namespace().unwrap_or_default(), secret.name_any());
            secret_ctx.shared.secrets.invalidate(&namespace, &name);
            policies_using_secret(&secret_ctx.shared, &namespace, &name)
        })
        .watches_stream(server_changes(servers), move |server| policies_using_server(&server_ctx.shared, &server))
        .with_config(controller::Config::default().concurrency(settings.concurrency))
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

/// The policies a Secret change concerns: those that reference it inline, and those whose `RedisServer` does.
fn policies_using_secret(shared: &Shared, namespace: &str, name: &str) -> Vec<ObjectRef<ConsumerGroupPolicy>> {
    let servers: Vec<(String, String)> = shared
        .servers
        .state()
        .iter()
        .filter(|s| {
            s.namespace().as_deref() == Some(namespace)
                && context::secret_refs(&s.spec.connection()).any(|r| r.name == name)
        })
        .map(|s| (namespace.to_string(), s.name_any()))
        .collect();
    shared
        .policies
        .state()
        .iter()
        .filter(|p| match p.server_ref() {
            Some(reference) => servers.contains(&reference),
            None => {
                p.namespace().as_deref() == Some(namespace)
                    && context::secret_refs(&p.spec.redis).any(|r| r.name == name)
            }
        })
        .map(|p| ObjectRef::from_obj(p.as_ref()))
        .collect()
}

/// The policies that name a `RedisServer`.
fn policies_using_server(shared: &Shared, server: &RedisServer) -> Vec<ObjectRef<ConsumerGroupPolicy>> {
    let reference = Some((server.namespace().unwrap_or_default(), server.name_any()));
    shared
        .policies
        .state()
        .iter()
        .filter(|p| p.server_ref() == reference)
        .map(|p| ObjectRef::from_obj(p.as_ref()))
        .collect()
}

/// Server objects as they change in what policies depend on: a new spec (generation) or deletion; their status
/// writes are left out, or each would re-run every policy that uses the server.
fn server_changes(
    servers: impl futures::Stream<Item = watcher::Result<watcher::Event<RedisServer>>> + Send + 'static,
) -> impl futures::Stream<Item = watcher::Result<RedisServer>> + Send + 'static {
    let mut seen: HashMap<String, Option<i64>> = HashMap::new();
    servers.filter_map(move |event| {
        let changed = match event {
            Ok(watcher::Event::Apply(server) | watcher::Event::InitApply(server)) => {
                let uid = server.uid().unwrap_or_default();
                (seen.insert(uid, server.metadata.generation) != Some(server.metadata.generation)).then_some(Ok(server))
            }
            Ok(watcher::Event::Delete(server)) => {
                seen.remove(&server.uid().unwrap_or_default());
                Some(Ok(server))
            }
            Ok(watcher::Event::Init | watcher::Event::InitDone) => None,
            Err(e) => Some(Err(e)),
        };
        futures::future::ready(changed)
    })
}

#[instrument(skip_all, fields(namespace = policy.namespace().unwrap_or_default(), policy = policy.name_any()))]
async fn reconcile(policy: Arc<ConsumerGroupPolicy>, ctx: Arc<Context>) -> Result<Action> {
    let start = Instant::now();
    let _running = ctx.shared.metrics.reconcile_started((policy.namespace().unwrap_or_default(), policy.name_any()));
    let result = match tokio::time::timeout(RECONCILE_LIMIT, reconcile_inner(policy, &ctx)).await {
        Ok(result) => result,
        Err(_) => Err(Error::ReconcileTimedOut(RECONCILE_LIMIT)),
    };
    match &result {
        Err(Error::Deferred(_)) => {}
        _ => ctx.shared.metrics.reconciled(start.elapsed(), result.as_ref().err().map(Error::reason)),
    }
    result
}

async fn reconcile_inner(policy: Arc<ConsumerGroupPolicy>, ctx: &Arc<Context>) -> Result<Action> {
    // A replica that may not write does nothing (it is about to exit, or has not read its Lease yet).
    if !ctx.shared.leadership.may_write() {
        return Ok(Action::requeue(NOT_LEADING_RECHECK));
    }
    let namespace = policy.namespace().unwrap_or_default();
    let api: Api<ConsumerGroupPolicy> = Api::namespaced(ctx.shared.client.clone(), &namespace);
    let has_finalizer = policy.finalizers().iter().any(|f| f == FINALIZER);
    // The finalizer is there only when deleting the policy has something to do in Redis (destroy the group, remove
    // the backlog bound): a `Retain` policy without a bound is deleted at once, with or without the operator.
    if !act::needs_cleanup(&policy) && policy.metadata.deletion_timestamp.is_none() {
        let action = apply(&policy, ctx).await?;
        // The finalizer guards the bound: it goes only once the bound is off the server, or a policy deleted after
        // a failed removal would leave producers refused by a bound nobody owns.
        if has_finalizer {
            match act::release_bound(&policy, ctx).await {
                Ok(()) => remove_finalizer(&api, &policy).await?,
                // Stalled (the status says why): the finalizer stays, and the next look tries again.
                Err(e) if e.is_stalled() => {}
                Err(e) => return Err(e),
            }
        }
        return Ok(action);
    }
    // A deletion writes (the finalizer, an Event) whatever its server says: it takes a failing policy's permit.
    let _permit = match policy.metadata.deletion_timestamp {
        Some(_) => Some(ctx.failure_permit()?),
        None => None,
    };
    let action = finalizer(&api, FINALIZER, policy, |event| async {
        match event {
            Finalizer::Apply(policy) => apply(&policy, ctx).await,
            Finalizer::Cleanup(policy) => act::cleanup(&policy, ctx).await,
        }
    })
    .await
    .map_err(|e| match e {
        kube::runtime::finalizer::Error::ApplyFailed(e) | kube::runtime::finalizer::Error::CleanupFailed(e) => e,
        other => Error::Finalizer(Box::new(other)),
    })?;
    Ok(action)
}

/// Takes Pelican's finalizer off a policy that no longer needs it (switched to `Retain`, bound removed). The
/// resource version makes the patch fail, and the reconcile retry, if the finalizers changed meanwhile.
async fn remove_finalizer(api: &Api<ConsumerGroupPolicy>, policy: &ConsumerGroupPolicy) -> Result<()> {
    let others: Vec<&String> = policy.finalizers().iter().filter(|f| *f != FINALIZER).collect();
    let patch = serde_json::json!({
        "metadata": {"finalizers": others, "resourceVersion": policy.resource_version()},
    });
    api.patch(&policy.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(())
}

/// An Event about the policy, from its reconcile (phases act and report).
async fn publish(ctx: &Context, policy: &ConsumerGroupPolicy, type_: EventType, reason: &str, note: String) {
    ctx.shared.publish(&policy.object_ref(&()), "Reconcile", type_, reason, note).await;
}

/// Retries with exponential backoff per policy (1s, 2s, 4s ... 60s), reset by the next success. A deferred
/// reconcile looks again within a second; one whose server is known down, when the server's next probe is due.
fn error_policy(policy: Arc<ConsumerGroupPolicy>, error: &Error, ctx: Arc<Context>) -> Action {
    let retry_at = match error {
        Error::Deferred(_) => return Action::requeue(DEFERRED_RECHECK + jitter(DEFERRED_RECHECK)),
        Error::RedisUnavailable { server, .. } => ctx.shared.pools.reach.retry_at(server),
        _ => None,
    };
    if let Some(at) = retry_at {
        // Known down: the probe logged it once for all of its policies.
        debug!(namespace = policy.namespace().unwrap_or_default(), name = policy.name_any(), %error, "server down");
        return Action::requeue(at.saturating_duration_since(Instant::now()) + jitter(DEFERRED_RECHECK));
    }
    let mut failures = ctx.failures.lock().expect("failures lock");
    let count = failures.entry(ObjectRef::from_obj(policy.as_ref())).or_insert(0);
    *count = (*count + 1).min(7);
    warn!(namespace = policy.namespace().unwrap_or_default(), name = policy.name_any(), reason = error.reason(), error = %error, "reconcile failed; retrying");
    Action::requeue(Duration::from_secs(1 << (*count - 1)).min(Duration::from_secs(60)))
}

/// The four phases, then the next look: after `interval` when the policy is Ready or Stalled (Redis can heal
/// without any Kubernetes event: a key of the wrong type deleted, an ACL fixed), with backoff otherwise.
async fn apply(policy: &ConsumerGroupPolicy, ctx: &Context) -> Result<Action> {
    let others = ctx.shared.admitted(ctx.neighbours.of(policy, &ctx.shared.policies)).await;
    let schedule = Schedule::from_spec(&policy.spec);
    let result = async {
        let resolved = ctx.shared.resolve(policy).await?;
        validate_and_converge(policy, ctx, &resolved.target, resolved.drain_pause, &others).await
    }
    .await;
    if let Err(Error::Deferred(_)) = result {
        return result.map(|_| Action::await_change());
    }
    // Writing a failure (status, an Event) waits for a failing policy's permit, unless nothing would change.
    let _permit = match &result {
        Err(e) if !report::unchanged_failure(policy, e) => Some(ctx.failure_permit()?),
        _ => None,
    };
    // A Stalled policy's jobs stop until it heals; a transient error (a server restarting) leaves the runner to
    // retry with its own backoff.
    if let Err(e) = &result
        && e.is_stalled()
    {
        ctx.runner.stop(&policy_id(policy));
    }
    let reported = report::report(policy, ctx, &result).await;
    // Deleted while this reconcile ran: the watch already stopped its jobs, dropped its metric series and its
    // connection, and what this reconcile started or recorded since is dropped again.
    if policy.uid().is_some_and(|uid| ctx.deleted.contains(&uid)) {
        act::forget(ctx, &ObjectRef::from_obj(policy));
        return Ok(Action::await_change());
    }
    reported?;
    let recheck = schedule.map_or(STALLED_RECHECK, |s| s.interval);
    match result {
        Ok(seen) => {
            ctx.failures.lock().expect("failures lock").remove(&ObjectRef::from_obj(policy));
            // A lowered minIdle applies to the passes when its hold ends: looked at again then.
            let held = seen.min_idle_held_for;
            Ok(Action::requeue(if held.is_zero() { recheck } else { recheck.min(held + Duration::from_millis(100)) }))
        }
        Err(e) if e.is_stalled() => Ok(Action::requeue(recheck)),
        Err(e) => Err(e),
    }
}

/// Phases 2 and 3 once the policy's server is resolved: validate the policy against the `others` it shares servers
/// with, then converge Redis on it (the group, the worker settings, the jobs handed to the runner, the probe). The
/// reconcile runs them, and so does `pelican local`, which has no cluster. `drain_pause`: the server's own (its
/// `RedisServer`'s `drainPause`), in place of the install's.
pub async fn validate_and_converge(
    policy: &ConsumerGroupPolicy,
    host: &impl Host,
    target: &Target,
    drain_pause: Option<Duration>,
    others: &[Arc<ConsumerGroupPolicy>],
) -> Result<Observation> {
    let schedule = validate::validate(policy, others, target.cluster)?;
    let seen = act::converge(policy, host, target, drain_pause, &schedule, others).await;
    if let Err(e) = &seen {
        // A command that found the server gone: its other policies wait for one probe.
        host.pools().saw(target, e);
    }
    seen
}

/// The reconcile's deletion paths against a scripted API server and a Redis that does not answer (a closed loopback
/// port): what the operator asks the API server, in order, and what it leaves.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::scripted::{self, Handle, expect};
    use crate::leader::Leadership;
    use http::Method;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn context(leadership: Leadership) -> (Arc<Context>, Handle) {
        let (client, handle) = scripted::client();
        let (shared, _writers) = Shared::new(client, None, Arc::default(), leadership, None, Default::default());
        let runner = Runner::new(
            shared.leadership.clone(),
            Announcer::Events(shared.events.clone()),
            shared.metrics.clone(),
            shared.pools.clone(),
        );
        let ctx = Context {
            shared,
            neighbours: Neighbours::default(),
            runner,
            failures: Mutex::default(),
            pool_users: Mutex::default(),
            deleted: Tombstones::default(),
            failure_lane: tokio::sync::Semaphore::new(FAILURE_LANE),
            terminating: Mutex::default(),
            progress: Mutex::default(),
            install: "pelican-system/pelican-leader".into(),
            claimant: Claimant { id: "test/pelican-system/pelican-leader".into(), passive: false },
            wrote: Mutex::default(),
            watch_namespace: None,
            pods: OnceLock::new(),
        };
        (Arc::new(ctx), handle)
    }

    /// A policy being deleted, with the finalizer, whose server (nothing listens there) refuses connections;
    /// `reached`: whether it ever reached its server (a server version in its status).
    fn deleted_policy(reached: bool) -> Arc<ConsumerGroupPolicy> {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut policy: ConsumerGroupPolicy = serde_json::from_value(serde_json::json!({
            "apiVersion": "pelican.io/v1alpha1",
            "kind": "ConsumerGroupPolicy",
            "metadata": {"name": "orders", "namespace": "apps", "uid": "uid-orders", "resourceVersion": "7",
                         "finalizers": [FINALIZER]},
            "spec": {"redis": {"url": format!("redis://127.0.0.1:{closed}/0")}, "stream": "orders",
                     "group": "billing", "deadLetter": {"stream": "orders:dlq"}, "deletionPolicy": "Delete"},
        }))
        .unwrap();
        policy.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::now()));
        policy.status = Some(crate::api::ConsumerGroupPolicyStatus {
            server_version: reached.then(|| "redis 7.0.15".into()),
            ..Default::default()
        });
        Arc::new(policy)
    }

    fn namespace(terminating: bool) -> serde_json::Value {
        let mut ns = serde_json::json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "apps"}});
        if terminating {
            ns["metadata"]["deletionTimestamp"] = "2026-12-02T00:00:00Z".into();
        }
        ns
    }

    #[tokio::test]
    async fn a_replica_that_may_not_write_asks_nothing_and_looks_again_in_a_second() {
        let (ctx, mut handle) = context(Leadership::none());
        let action = reconcile_inner(deleted_policy(true), &ctx).await.unwrap();
        assert_eq!(action, Action::requeue(NOT_LEADING_RECHECK));
        assert!(scripted::silent(&mut handle).await, "no request to the API server");
    }

    #[tokio::test]
    async fn a_deleted_policy_whose_server_is_down_keeps_its_finalizer_and_retries() {
        let (ctx, mut handle) = context(Leadership::always());
        let api = tokio::spawn(async move {
            let asked = expect(&mut handle, namespace(false)).await;
            (asked, scripted::silent(&mut handle).await)
        });
        let error = reconcile_inner(deleted_policy(true), &ctx).await.unwrap_err();
        let ((method, path, _), then_silent) = api.await.unwrap();
        assert_eq!((method, path.as_str()), (Method::GET, "/api/v1/namespaces/apps"), "is the namespace going?");
        assert!(then_silent, "no patch: the finalizer stays until the group is destroyed");
        assert_eq!(error.reason(), "RedisUnavailable", "{error}");
    }

    #[tokio::test]
    async fn a_deleted_policy_in_a_terminating_namespace_lets_go_of_its_finalizer() {
        let (ctx, mut handle) = context(Leadership::always());
        let policy = deleted_policy(true);
        let released = serde_json::to_value(policy.as_ref()).unwrap();
        let api = tokio::spawn(async move {
            let namespace = expect(&mut handle, namespace(true)).await;
            let patch = expect(&mut handle, released).await;
            (namespace, patch)
        });
        let action = reconcile_inner(policy, &ctx).await.unwrap();
        let ((method, path, _), (patch, patched, body)) = api.await.unwrap();
        assert_eq!((method, path.as_str()), (Method::GET, "/api/v1/namespaces/apps"));
        assert_eq!(
            (patch, patched.as_str()),
            (Method::PATCH, "/apis/pelican.io/v1alpha1/namespaces/apps/consumergrouppolicies/orders")
        );
        assert!(
            body.to_string().contains("\"op\":\"remove\"") && body.to_string().contains("/metadata/finalizers"),
            "{body}"
        );
        assert_eq!(action, Action::await_change());
    }

    /// Issue 57: a Pod watch the API server refuses for lack of a right (the chart's `rbac.consumerPods: false`)
    /// keeps the API server's words for the policies that name Pods, and forgets them once a listing succeeds.
    #[tokio::test]
    async fn a_forbidden_pod_watch_keeps_the_refusal_until_a_listing_succeeds() {
        let (ctx, mut handle) = context(Leadership::always());
        let watch = ctx.pods();
        let refusal = r#"pods is forbidden: User "system:serviceaccount:pelican-system:pelican" cannot list resource "pods" in API group "" at the cluster scope"#;
        let (method, path) = scripted::refuse(&mut handle, 403, "Forbidden", refusal).await;
        assert_eq!((method, path.as_str()), (Method::GET, "/api/v1/pods"));
        let forbidden = || watch.forbidden.lock().unwrap().clone();
        let deadline = Instant::now() + Duration::from_secs(5);
        while forbidden().is_none() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(forbidden().as_deref(), Some(refusal));
        assert!(!watch.current.load(Ordering::Relaxed));

        // The right granted: the retried listing succeeds.
        let listing = serde_json::json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList",
                                         "metadata": {"resourceVersion": "1"}, "items": []});
        let (method, path, _) = expect(&mut handle, listing).await;
        assert_eq!((method, path.as_str()), (Method::GET, "/api/v1/pods"));
        let deadline = Instant::now() + Duration::from_secs(5);
        while forbidden().is_some() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(forbidden(), None);
        assert!(watch.current.load(Ordering::Relaxed));
    }

    /// Only a refusal is kept: a listing that failed on the way (the API server restarting) heals by itself.
    #[test]
    fn only_a_403_counts_as_a_forbidden_watch() {
        let status = |code: u16, reason: &str| {
            kube::Error::Api(kube::core::Status::failure("no", reason).with_code(code).boxed())
        };
        let forbidden = || status(403, "Forbidden");
        assert_eq!(forbidden_detail(&watcher::Error::InitialListFailed(forbidden())).as_deref(), Some("no"));
        assert_eq!(forbidden_detail(&watcher::Error::WatchStartFailed(forbidden())).as_deref(), Some("no"));
        assert_eq!(forbidden_detail(&watcher::Error::InitialListFailed(status(500, "InternalError"))), None);
        assert_eq!(forbidden_detail(&watcher::Error::NoResourceVersion), None);
    }

    #[tokio::test]
    async fn a_deleted_policy_that_never_reached_its_server_lets_go_at_once_and_says_what_it_left() {
        let (ctx, mut handle) = context(Leadership::always());
        let policy = deleted_policy(false);
        let released = serde_json::to_value(policy.as_ref()).unwrap();
        let api = tokio::spawn(async move {
            let event = expect(&mut handle, serde_json::json!({})).await;
            let patch = expect(&mut handle, released).await;
            (event, patch)
        });
        reconcile_inner(policy, &ctx).await.unwrap();
        let ((method, path, event), (patch, patched, _)) = api.await.unwrap();
        assert_eq!((method, path.as_str()), (Method::POST, "/apis/events.k8s.io/v1/namespaces/apps/events"));
        assert_eq!(event["reason"], "CleanupSkipped");
        assert!(event["note"].as_str().unwrap().starts_with("group \"billing\" left in Redis:"), "{event}");
        assert_eq!(
            (patch, patched.as_str()),
            (Method::PATCH, "/apis/pelican.io/v1alpha1/namespaces/apps/consumergrouppolicies/orders")
        );
    }
}
