//! Leader election on a `coordination.k8s.io/v1` Lease: with several replicas, only the leader
//! runs the controller, so only it writes to Redis and to the API. A replica that loses the lease exits (its Pod is
//! restarted as a standby), as controller-runtime's managers do; if the lease task itself dies, so does the process.
//!
//! Leading is not enough to write: a leader cut off from the API server cannot renew its lease and does not learn
//! that it lost it, while a standby takes over once the lease has expired. [`Leadership`] therefore says "may
//! write" only until the last renewal this replica has *seen on the Lease object* plus the lease duration, less a
//! safety margin: the runner checks it between script calls, so an isolated leader stops writing before any
//! standby can start.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::{Api, Client};
use kube_lease_manager::LeaseManagerBuilder;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

/// How long a lease is valid without renewal; a standby takes over at most this long after the leader vanished.
pub const LEASE_DURATION_SECONDS: u64 = 15;
/// Renewal starts this long before the lease expires.
pub const LEASE_GRACE_SECONDS: u64 = 5;

/// Stop writing this long before the lease a standby watches would expire: covers the standby's poll and clock
/// differences between replicas.
pub const SAFETY_MARGIN: Duration = Duration::from_secs(2);
/// How often the leader reads its Lease back to learn how long it may still write.
const LEASE_CHECK: Duration = Duration::from_secs(1);

/// Whether this replica may write to Redis now. Cheap to clone and to check.
#[derive(Clone, Debug)]
pub struct Leadership {
    valid_until: Arc<Mutex<Option<Instant>>>,
}

impl Leadership {
    /// A single replica without election: always may write.
    pub fn always() -> Leadership {
        let forever = Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
        Leadership { valid_until: Arc::new(Mutex::new(Some(forever))) }
    }

    pub(crate) fn none() -> Leadership {
        Leadership { valid_until: Arc::new(Mutex::new(None)) }
    }

    pub fn may_write(&self) -> bool {
        self.valid_until.lock().expect("leadership lock").is_some_and(|until| Instant::now() < until)
    }

    fn set(&self, until: Option<Instant>) {
        *self.valid_until.lock().expect("leadership lock") = until;
    }
}

pub struct Elector {
    leading: watch::Receiver<bool>,
    task: JoinHandle<kube_lease_manager::Result<kube_lease_manager::LeaseManager>>,
    leadership: Leadership,
    guard: JoinHandle<()>,
}

/// Why the leader stopped leading.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// Another replica holds the lease now.
    Lost,
    /// The lease task stopped (API unreachable for good, say).
    TaskDied,
    /// No renewal was seen on the Lease in time: a standby may take over soon.
    NotRenewed,
}

/// The field manager under which `identity` applies its lock on the Lease. Every replica has its own, so that
/// server-side apply refuses a replica's lock on a Lease another one locked a moment before; kube-lease-manager
/// requires it.
pub fn field_manager(identity: &str) -> String {
    format!("pelican-lease-{identity}")
}

impl Elector {
    /// Starts competing for `namespace/name` as `identity`.
    pub async fn start(client: Client, namespace: &str, name: &str, identity: &str) -> anyhow::Result<Elector> {
        let manager = LeaseManagerBuilder::new(client.clone(), name)
            .with_namespace(namespace)
            .with_identity(identity)
            .with_duration(LEASE_DURATION_SECONDS)
            .with_grace(LEASE_GRACE_SECONDS)
            .with_field_manager(field_manager(identity))
            .build()
            .await?;
        let (leading, task) = manager.watch().await;
        let leadership = Leadership::none();
        let guard = tokio::spawn(guard(
            Api::namespaced(client, namespace),
            name.to_string(),
            identity.to_string(),
            leading.clone(),
            leadership.clone(),
        ));
        Ok(Elector { leading, task, leadership, guard })
    }

    /// Whether this replica may write now (see the module documentation).
    pub fn leadership(&self) -> Leadership {
        self.leadership.clone()
    }

    /// Resolves once this replica leads; `Err` when the lease task died first.
    pub async fn acquired(&mut self) -> Result<(), Ended> {
        loop {
            if *self.leading.borrow_and_update() {
                info!("acquired the leader lease");
                return Ok(());
            }
            if self.leading.changed().await.is_err() {
                return Err(Ended::TaskDied);
            }
        }
    }

    /// Resolves when leadership ends: the lease went to another replica, or this one could not renew it in time
    /// (cut off from the API server). Cheap to call from a `select!`; independent of `self`.
    pub fn ended(&self) -> impl Future<Output = Ended> + Send + Sync + 'static {
        let mut leading = self.leading.clone();
        let leadership = self.leadership.clone();
        async move {
            let lost = async {
                loop {
                    if leading.changed().await.is_err() {
                        return Ended::TaskDied;
                    }
                    if !*leading.borrow_and_update() {
                        return Ended::Lost;
                    }
                }
            };
            let expired = async {
                // The guard reads the Lease within a second of the acquisition; when it cannot (the API server went
                // away right then), this replica never may write, and waiting for a first read would leave it up
                // leading nothing. So: writable within the lease's duration, and then for as long as it leads.
                let acquired = Instant::now();
                let mut was_writable = false;
                loop {
                    if leadership.may_write() {
                        was_writable = true;
                    } else if was_writable || acquired.elapsed() > Duration::from_secs(LEASE_DURATION_SECONDS) {
                        return Ended::NotRenewed;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            };
            tokio::select! {
                why = lost => why,
                why = expired => why,
            }
        }
    }

    /// Gives the lease up so a standby takes over at once instead of after it expires.
    pub async fn release(self) {
        self.guard.abort();
        self.leadership.set(None);
        drop(self.leading);
        match self.task.await {
            Ok(Ok(_)) => info!("released the leader lease"),
            Ok(Err(e)) => tracing::warn!(error = %e, "could not release the leader lease"),
            Err(e) => tracing::warn!(error = %e, "lease task failed"),
        }
    }
}

/// Keeps `leadership` equal to "the lease manager says we lead, and the Lease object shows a renewal by us recent
/// enough that no standby can have taken over". A read that fails keeps what was known, so the deadline runs out.
async fn guard(
    leases: Api<Lease>,
    name: String,
    identity: String,
    leading: watch::Receiver<bool>,
    leadership: Leadership,
) {
    let mut renewed: Option<Instant> = None;
    loop {
        match tokio::time::timeout(LEASE_CHECK * 2, leases.get_opt(&name)).await {
            Ok(Ok(lease)) => {
                let spec = lease.and_then(|l| l.spec).unwrap_or_default();
                renewed = match (spec.holder_identity.as_deref() == Some(identity.as_str()), spec.renew_time) {
                    (true, Some(t)) => {
                        let age = Timestamp::now().duration_since(t.0).unsigned_abs();
                        Instant::now().checked_sub(age)
                    }
                    _ => None,
                };
            }
            Ok(Err(e)) => warn!(error = %e, "could not read the leader lease; writes stop when it would expire"),
            Err(_) => warn!("reading the leader lease timed out; writes stop when it would expire"),
        }
        let duration = Duration::from_secs(LEASE_DURATION_SECONDS) - SAFETY_MARGIN;
        let until = if *leading.borrow() { renewed.map(|at| at + duration) } else { None };
        leadership.set(until);
        tokio::time::sleep(LEASE_CHECK).await;
    }
}

/// The cluster this process runs in, as clusters are told apart: the UID of its `kube-system` namespace (made once,
/// with the cluster). `unknown-cluster` (said in a warning) when it cannot be read: two clusters then differ only by
/// their release namespace, so give each install its own `--install-id`.
pub async fn cluster_id(client: &Client) -> String {
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    match namespaces.get("kube-system").await.map(|ns| ns.metadata.uid) {
        Ok(Some(uid)) => uid,
        Ok(None) | Err(_) => {
            warn!(
                "could not read the kube-system namespace's UID to name this install on the Redis servers: set --install-id"
            );
            "unknown-cluster".into()
        }
    }
}

/// The Lease a replica takes when none is named: `pelican-leader`, or for one shard (`--watch-label-selector`)
/// `pelican-leader-<hash of the selector>`, so that shards never share one and two copies of one shard always do.
pub fn default_lease_name(selector: Option<&str>) -> String {
    match selector {
        None => "pelican-leader".to_string(),
        Some(selector) => {
            // FNV-1a: stable across builds and platforms, unlike std's hasher.
            let hash = selector
                .bytes()
                .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
            format!("pelican-leader-{:08x}", hash as u32)
        }
    }
}

/// This process's identity on the Lease: `<instance>-<pid>`, where the instance is the Pod's name, else the host's.
pub fn identity(instance: Option<&str>) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string());
    let instance = instance.map(str::to_string).or(host.ok()).unwrap_or_else(|| "pelican".into());
    format!("{instance}-{}", std::process::id())
}

/// Another process holding a Lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub identity: String,
    /// How long ago it last renewed the Lease.
    pub renewed_ago: Duration,
}

/// The live holder of `namespace/name` other than `identity`: one that renewed within the Lease's duration. A holder
/// that was a process of this same instance (same Pod or host) and is gone now (killed without releasing the Lease:
/// a crash, `kill -9`) is no holder: its Lease is deleted so that this process takes it at once, not after it expires.
pub async fn live_holder(client: &Client, namespace: &str, name: &str, identity: &str) -> kube::Result<Option<Holder>> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), namespace);
    let Some(lease) = leases.get_opt(name).await? else { return Ok(None) };
    let spec = lease.spec.clone().unwrap_or_default();
    let Some(holder) = spec.holder_identity.filter(|h| !h.is_empty() && h != identity) else { return Ok(None) };
    let duration = Duration::from_secs(spec.lease_duration_seconds.map_or(LEASE_DURATION_SECONDS, |s| s.max(0) as u64));
    let renewed_ago = spec.renew_time.map(|t| Timestamp::now().duration_since(t.0).unsigned_abs());
    if renewed_ago.is_none_or(|ago| ago >= duration) {
        return Ok(None);
    }
    if gone_from_this_instance(&holder, identity) {
        let preconditions = kube::api::Preconditions { resource_version: lease.metadata.resource_version, uid: None };
        let params = kube::api::DeleteParams { preconditions: Some(preconditions), ..Default::default() };
        match leases.delete(name, &params).await {
            Ok(_) => {
                info!(%holder, "took the Lease of a process of this instance that is gone");
                return Ok(None);
            }
            // Changed meanwhile: somebody renewed or took it; read it again next time.
            Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    Ok(renewed_ago.map(|renewed_ago| Holder { identity: holder, renewed_ago }))
}

/// Whether `holder` is `<same instance>-<pid>` of a process that no longer runs here (or is a zombie).
fn gone_from_this_instance(holder: &str, identity: &str) -> bool {
    let (Some((instance, pid)), Some((own_instance, _))) = (holder.rsplit_once('-'), identity.rsplit_once('-')) else {
        return false;
    };
    if instance != own_instance || pid.parse::<u32>().is_err() {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name in parentheses: Z (zombie) and X (dead) run no more.
        Ok(stat) => stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_get_their_own_lease_and_copies_of_one_share_it() {
        assert_eq!(default_lease_name(None), "pelican-leader");
        let a = default_lease_name(Some("sharding.pelican.io/key=a"));
        assert_eq!(a, default_lease_name(Some("sharding.pelican.io/key=a")));
        assert_ne!(a, default_lease_name(Some("sharding.pelican.io/key=b")));
        assert_ne!(a, default_lease_name(Some("!sharding.pelican.io/key")));
        assert!(a.starts_with("pelican-leader-") && a.len() == "pelican-leader-".len() + 8, "{a}");
    }

    #[test]
    fn a_holder_of_another_instance_is_never_taken_for_gone() {
        let own = format!("host-a-{}", std::process::id());
        assert!(!gone_from_this_instance("host-b-999999999", &own));
        assert!(!gone_from_this_instance("host-a", &own));
        assert!(!gone_from_this_instance(&format!("host-a-{}", std::process::id()), &own));
        // A pid no process has on this machine (above pid_max's ceiling of 2^22).
        assert!(gone_from_this_instance("host-a-99999999", &own));
    }
}
