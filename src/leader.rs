//! Leader election on a `coordination.k8s.io/v1` Lease (SPEC section 7): with several replicas, only the leader
//! runs the controller, so only it writes to Redis and to the API. A replica that loses the lease exits (its Pod is
//! restarted as a standby), as controller-runtime's managers do; if the lease task itself dies, so does the process.

use kube::Client;
use kube_lease_manager::LeaseManagerBuilder;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::info;

/// How long a lease is valid without renewal; a standby takes over at most this long after the leader vanished.
pub const LEASE_DURATION_SECONDS: u64 = 15;
/// Renewal starts this long before the lease expires.
pub const LEASE_GRACE_SECONDS: u64 = 5;

pub struct Elector {
    leading: watch::Receiver<bool>,
    task: JoinHandle<kube_lease_manager::Result<kube_lease_manager::LeaseManager>>,
}

/// Why the leader stopped leading.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// Another replica holds the lease now.
    Lost,
    /// The lease task stopped (API unreachable for good, say).
    TaskDied,
}

impl Elector {
    /// Starts competing for `namespace/name` as `identity`.
    pub async fn start(client: Client, namespace: &str, name: &str, identity: &str) -> anyhow::Result<Elector> {
        let manager = LeaseManagerBuilder::new(client, name)
            .with_namespace(namespace)
            .with_identity(identity)
            .with_duration(LEASE_DURATION_SECONDS)
            .with_grace(LEASE_GRACE_SECONDS)
            .with_field_manager("pelican")
            .build()
            .await?;
        let (leading, task) = manager.watch().await;
        Ok(Elector { leading, task })
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

    /// Resolves when leadership ends. Cheap to call from a `select!`; independent of `self`.
    pub fn ended(&self) -> impl Future<Output = Ended> + Send + Sync + 'static {
        let mut leading = self.leading.clone();
        async move {
            loop {
                if leading.changed().await.is_err() {
                    return Ended::TaskDied;
                }
                if !*leading.borrow_and_update() {
                    return Ended::Lost;
                }
            }
        }
    }

    /// Gives the lease up so a standby takes over at once instead of after it expires.
    pub async fn release(self) {
        drop(self.leading);
        match self.task.await {
            Ok(Ok(_)) => info!("released the leader lease"),
            Ok(Err(e)) => tracing::warn!(error = %e, "could not release the leader lease"),
            Err(e) => tracing::warn!(error = %e, "lease task failed"),
        }
    }
}
