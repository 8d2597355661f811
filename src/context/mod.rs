//! What the controllers share, so that none of them imports another: the API client, the connections to servers,
//! Events and metrics, whether this replica may write, the Secret cache that turns a policy into a server and
//! credentials, and the store of policies the policy controller watches (the redrive controller finds a redrive's
//! policy there). `main.rs` builds one [`Shared`] and starts the controllers beside each other with it.

pub mod conditions;
mod resolve;

pub use resolve::{SecretCache, secret_refs};

use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{Api, Patch, PatchParams};
use kube::core::NamespaceResourceScope;
use kube::runtime::events::{Event, EventType, Reporter};
use kube::runtime::reflector::{self, Store, store::Writer};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::fmt::Debug;

use tracing::warn;

use crate::Result;
use crate::api::ConsumerGroupPolicy;
use crate::leader::Leadership;
use crate::redis::{Pools, Target};
use crate::telemetry::{Events, Metrics};

/// Field manager of every status write; the operator owns nothing else of its objects but the policies' finalizer.
pub const FIELD_MANAGER: &str = "pelican";

pub struct Shared {
    pub client: Client,
    /// One connection per server and identity, shared by every policy and redrive that uses it.
    pub pools: Arc<Pools>,
    pub events: Events,
    pub metrics: Arc<Metrics>,
    /// Whether this replica may write.
    pub leadership: Leadership,
    pub secrets: SecretCache,
    /// Every policy the policy controller watches, kept by its reflector.
    pub policies: Store<ConsumerGroupPolicy>,
}

impl Shared {
    /// The shared handles, and the writer of the policy store for the policy controller's reflector. Secrets are
    /// read only in `secret_namespaces` when given (the operator's RBAC is namespaced then).
    pub fn new(
        client: Client,
        instance: Option<String>,
        metrics: Arc<Metrics>,
        leadership: Leadership,
        secret_namespaces: Option<BTreeSet<String>>,
    ) -> (Arc<Shared>, Writer<ConsumerGroupPolicy>) {
        let (policies, writer) = reflector::store();
        let reporter = Reporter { controller: "pelican".into(), instance };
        let shared = Shared {
            events: Events::new(client.clone(), reporter),
            client,
            pools: Arc::default(),
            metrics,
            leadership,
            secrets: SecretCache::new(secret_namespaces),
            policies,
        };
        (Arc::new(shared), writer)
    }

    /// The server and credentials a policy names, its Secrets read through the cache.
    pub async fn target(&self, policy: &ConsumerGroupPolicy) -> Result<Target> {
        resolve::target(policy, &self.client, &self.secrets).await
    }
}

impl Shared {
    /// Writes `status` as the object's status by server-side apply under [`FIELD_MANAGER`] (forced: the operator
    /// owns the status of its objects).
    pub async fn apply_status<K>(&self, object: &K, status: &impl Serialize) -> Result<()>
    where
        K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + Clone + DeserializeOwned + Debug,
    {
        let api: Api<K> = Api::namespaced(self.client.clone(), &object.namespace().unwrap_or_default());
        let patch = serde_json::json!({"apiVersion": K::api_version(&()), "kind": K::kind(&()), "status": status});
        let params = PatchParams::apply(FIELD_MANAGER).force();
        api.patch_status(&object.name_any(), &params, &Patch::Apply(&patch)).await?;
        Ok(())
    }

    /// Publishes an Event about `object` (`action`: `Reconcile`, `Redrive`, ...). Events are best effort: a failure
    /// is logged with the reason, never returned.
    pub async fn publish(&self, object: &ObjectReference, action: &str, type_: EventType, reason: &str, note: String) {
        let event = Event { type_, reason: reason.into(), note: Some(note), action: action.into(), secondary: None };
        if let Err(e) = self.events.publish(&event, object).await {
            warn!(namespace = object.namespace, name = object.name, error = %e, reason, "could not publish event");
        }
    }
}

/// The server and credentials of a policy, its Secrets read with `client`'s permissions (for `kubectl pelican`).
pub async fn read_target(policy: &ConsumerGroupPolicy, client: &Client) -> Result<Target> {
    resolve::target(policy, client, &SecretCache::default()).await
}

/// `namespace/name`: how the runner and the logs name a policy.
pub fn policy_id(policy: &ConsumerGroupPolicy) -> String {
    format!("{}/{}", policy.namespace().unwrap_or_default(), policy.name_any())
}
