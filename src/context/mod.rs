//! What the controllers share, so that none of them imports another: the API client, the connections to servers,
//! Events and metrics, whether this replica may write, the Secret cache that turns a policy into a server and
//! credentials, and the store of policies the policy controller watches (the redrive controller finds a redrive's
//! policy there). `main.rs` builds one [`Shared`] and starts the controllers beside each other with it.

pub mod conditions;
mod resolve;

/// `KeyNotAllowed` unless the server admits every key the policy writes: its stream and dead-letter stream and
/// Pelican's keys in their slots; for a topic (SPEC 22) each partition `{<topic>:<i>}` and its keys, the dead-letter
/// stream of each (one for the topic on one server, the partition's own on a Cluster), and the topic's own keys
/// (`{<topic>}:pelican:<topic>:...`: its description and membership), which are named after no admitted key.
fn check_keys(keys: &KeyRules, policy: &ConsumerGroupPolicy, cluster: bool) -> Result<()> {
    let (stream, group) = (&policy.spec.stream, &policy.spec.group);
    let check_stream = |field: &str, stream: &str, dead_letter: &str| -> Result<()> {
        keys.check(field, stream)?;
        keys.check("spec.deadLetter.stream", dead_letter)?;
        keys.check_own(field, stream, &crate::keys::group_keys(stream, group))?;
        keys.check_own("spec.deadLetter.stream", dead_letter, &[crate::keys::redrive_lock_key(dead_letter)])
    };
    let Some(partitions) = policy.spec.partitions else {
        return check_stream("spec.stream", stream, &policy.spec.dead_letter.stream);
    };
    let own = [
        crate::keys::topic_key(stream),
        crate::keys::settings_key(stream, group),
        crate::keys::members_key(stream, group),
        crate::keys::owners_key(stream, group),
        crate::keys::epochs_key(stream, group),
    ];
    own.iter().try_for_each(|key| keys.check("Pelican's own key for the topic spec.stream", key))?;
    (0..partitions).try_for_each(|i| {
        let partition = crate::keys::partition_stream(stream, i);
        let dead_letter = crate::controller::dead_letter_of(policy, &partition, cluster);
        check_stream(&format!("spec.stream (partition {i})"), &partition, &dead_letter)
    })
}

#[cfg(test)]
pub(crate) mod scripted;

pub use resolve::{SecretCache, SecretName, secret_refs};

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Api, Patch, PatchParams};
use kube::core::NamespaceResourceScope;
use kube::runtime::events::{Event, EventType, Reporter};
use kube::runtime::reflector::{self, ObjectRef, Store, store::Writer};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::fmt::Debug;

use tracing::{info, warn};

use crate::api::{ConsumerGroupPolicy, RedisServer};
use crate::leader::Leadership;
use crate::redis::{Pools, Readings, Target};
use crate::telemetry::{Events, Metrics};
use crate::tenancy::{self, KeyRules};
use crate::{Error, Result};

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
    /// Every `RedisServer` the operator may read, kept by the policy controller's reflector.
    pub servers: Store<RedisServer>,
    /// Namespace labels, for the servers' tenant selectors.
    namespaces: NamespaceLabels,
    pub inline: InlineConnections,
    /// The latest backlog of each policy KEDA asks about (the external scaler), kept fresh by reconciles too.
    pub readings: Readings,
}

/// Whether policies may give their server inline (`spec.redis.url`) or only name a `RedisServer`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum InlineConnections {
    /// Inline servers and server references (single-team clusters, and the way there).
    #[default]
    Allow,
    /// Only server references: inline policies are Stalled `InlineConnectionDenied` and nothing is written.
    Deny,
}

/// The reflector writers [`Shared::new`] hands to the controller that fills the stores.
pub struct Writers {
    pub policies: Writer<ConsumerGroupPolicy>,
    pub servers: Writer<RedisServer>,
}

/// A policy's connection, resolved and admitted.
pub struct Resolved {
    pub target: Target,
    /// `namespace/name` of the `RedisServer` it names (none for an inline connection).
    pub server: Option<String>,
    /// The keys the server admits for the policy's namespace (none for an inline connection: every key).
    pub keys: Option<KeyRules>,
    /// The server's `drainPause` (none: the install's `--drain-pause`).
    pub drain_pause: Option<Duration>,
}

impl Shared {
    /// Waits until the policy controller has listed the policies: a controller of objects that name a policy
    /// (redrives, seeks) must not report a policy missing that is only not seen yet after a restart. False when
    /// `shutdown` came first or the store closed.
    pub async fn policies_listed(&self, shutdown: impl Future<Output = ()> + Clone) -> bool {
        loop {
            tokio::select! {
                _ = shutdown.clone() => return false,
                ready = tokio::time::timeout(Duration::from_secs(1), self.policies.wait_until_ready()) => match ready {
                    Ok(Ok(())) => return true,
                    Ok(Err(_)) => return false,
                    Err(_) => continue,
                },
            }
        }
    }

    /// The shared handles, and the writers of the policy and server stores for the policy controller's reflectors.
    /// Secrets are read only in `secret_namespaces` when given (the operator's RBAC is namespaced then).
    pub fn new(
        client: Client,
        instance: Option<String>,
        metrics: Arc<Metrics>,
        leadership: Leadership,
        secret_namespaces: Option<BTreeSet<String>>,
        inline: InlineConnections,
    ) -> (Arc<Shared>, Writers) {
        let (policies, policy_writer) = reflector::store();
        let (servers, server_writer) = reflector::store();
        let reporter = Reporter { controller: "pelican".into(), instance };
        let shared = Shared {
            events: Events::new(client.clone(), reporter),
            client,
            pools: Arc::default(),
            metrics,
            leadership,
            secrets: SecretCache::new(secret_namespaces),
            policies,
            servers,
            namespaces: NamespaceLabels::default(),
            inline,
            readings: Readings::default(),
        };
        (Arc::new(shared), Writers { policies: policy_writer, servers: server_writer })
    }

    /// The server and credentials a policy names, its Secrets read through the cache, once the server admits the
    /// policy's namespace and keys.
    pub async fn target(&self, policy: &ConsumerGroupPolicy) -> Result<Target> {
        Ok(self.resolve(policy).await?.target)
    }

    /// The policy's connection: inline (unless `--inline-connections=deny`), or the `RedisServer` it names, which
    /// must admit the policy's namespace and its stream and dead-letter stream. Nothing may be written to the
    /// server for a policy this refuses.
    pub async fn resolve(&self, policy: &ConsumerGroupPolicy) -> Result<Resolved> {
        let Some((server, keys)) = self.admit(policy).await? else {
            let namespace = policy.namespace().unwrap_or_default();
            let target = resolve::target(&policy.spec.redis, &namespace, &self.client, &self.secrets).await?;
            return Ok(Resolved { target, server: None, keys: None, drain_pause: None });
        };
        let target = self.server_target(&server).await?;
        let drain_pause = server.spec.drain_pause();
        Ok(Resolved { target, server: Some(tenancy::server_name(&server)), keys: Some(keys), drain_pause })
    }

    /// The tenancy checks of [`Shared::resolve`], which read no Secret: `None` for an inline policy that may connect
    /// inline, else the server it names and the keys it admits for the policy's namespace (its stream and
    /// dead-letter stream among them).
    async fn admit(&self, policy: &ConsumerGroupPolicy) -> Result<Option<(Arc<RedisServer>, KeyRules)>> {
        let Some((server_namespace, name)) = policy.server_ref() else {
            return match self.inline {
                InlineConnections::Allow => Ok(None),
                InlineConnections::Deny => Err(Error::InlineConnectionDenied),
            };
        };
        let server = self
            .servers
            .get(&ObjectRef::new(&name).within(&server_namespace))
            .ok_or_else(|| Error::ServerNotFound { namespace: server_namespace.clone(), name: name.clone() })?;
        let namespace = policy.namespace().unwrap_or_default();
        let labels = match tenancy::needs_labels(&server) {
            true => self.namespaces.labels(&self.client, &namespace).await,
            false => None,
        };
        let keys = tenancy::admit(&server, &namespace, labels.as_ref())?;
        let cluster = server.spec.mode == crate::api::RedisMode::Cluster;
        check_keys(&keys, policy, cluster)?;
        Ok(Some((server, keys)))
    }

    /// The key rules the policy's server admits for it now (`None` for an inline policy), or the refusal: what a
    /// running redrive checks again as the server or the namespace changes.
    pub async fn admission(&self, policy: &ConsumerGroupPolicy) -> Result<Option<KeyRules>> {
        Ok(self.admit(policy).await?.map(|(_, keys)| keys))
    }

    /// Of `others`, the policies their servers admit (namespace and keys; nothing is read from a Secret): one that is
    /// refused writes nothing, so it owns no group and no key name, however old it is. Otherwise a team could hold
    /// another's group hostage with a policy that may not touch it.
    pub async fn admitted(&self, others: Vec<Arc<ConsumerGroupPolicy>>) -> Vec<Arc<ConsumerGroupPolicy>> {
        let mut kept = Vec::with_capacity(others.len());
        for other in others {
            if self.admit(&other).await.is_ok() {
                kept.push(other);
            }
        }
        kept
    }

    /// A `RedisServer`'s connection, its Secrets read (through the cache) in its own namespace.
    pub async fn server_target(&self, server: &RedisServer) -> Result<Target> {
        let namespace = server.namespace().unwrap_or_default();
        resolve::target(&server.spec.connection(), &namespace, &self.client, &self.secrets).await
    }

    /// Every Secret a policy or a server of the stores uses, as (`namespace`, `name`).
    pub fn referenced_secrets(&self) -> HashSet<SecretName> {
        let policies = self.policies.state();
        let inline = policies.iter().flat_map(|p| {
            let namespace = p.namespace().unwrap_or_default();
            secret_refs(&p.spec.redis).map(move |r| (namespace.clone(), r.name.clone())).collect::<Vec<_>>()
        });
        let servers = self.servers.state();
        let referenced = servers.iter().flat_map(|s| {
            let namespace = s.namespace().unwrap_or_default();
            secret_refs(&s.spec.connection()).map(move |r| (namespace.clone(), r.name.clone())).collect::<Vec<_>>()
        });
        inline.chain(referenced).collect()
    }
}

/// Namespace labels read on demand (one GET per namespace, kept [`NamespaceLabels::FRESH`]): only servers whose
/// tenants select namespaces by label need them, and a namespace's labels change rarely.
#[derive(Default)]
struct NamespaceLabels(Mutex<HashMap<String, (Instant, Option<Labels>)>>);

type Labels = BTreeMap<String, String>;

impl NamespaceLabels {
    const FRESH: Duration = Duration::from_secs(30);

    /// The namespace's labels; `None` when it cannot be read (then no selector admits it).
    async fn labels(&self, client: &Client, namespace: &str) -> Option<Labels> {
        if let Some((at, labels)) = self.0.lock().expect("namespace labels lock").get(namespace)
            && at.elapsed() < Self::FRESH
        {
            return labels.clone();
        }
        let labels = match Api::<Namespace>::all(client.clone()).get_opt(namespace).await {
            Ok(found) => found.map(|ns| ns.metadata.labels.unwrap_or_default()),
            Err(e) => {
                warn!(namespace, error = %e, "cannot read the namespace's labels; no tenant selector admits it");
                None
            }
        };
        let mut cache = self.0.lock().expect("namespace labels lock");
        cache.retain(|_, (at, _)| at.elapsed() < Self::FRESH);
        cache.insert(namespace.to_string(), (Instant::now(), labels.clone()));
        labels
    }
}

impl Shared {
    /// Writes `status` as the object's status by server-side apply under [`FIELD_MANAGER`] (forced: the operator
    /// owns the status of its objects).
    pub async fn apply_status<K>(&self, object: &K, status: &impl Serialize) -> Result<()>
    where
        K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + Clone + DeserializeOwned + Debug,
    {
        let patch = serde_json::json!({"apiVersion": K::api_version(&()), "kind": K::kind(&()), "status": status});
        self.patch_status(object, patch).await
    }

    /// [`Shared::apply_status`] with the object's uid in the patch: refused (409) when the object of that name is
    /// another one now.
    pub async fn apply_status_of_uid<K>(&self, object: &K, status: &impl Serialize) -> Result<()>
    where
        K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + Clone + DeserializeOwned + Debug,
    {
        let metadata = serde_json::json!({"uid": object.uid()});
        let patch = serde_json::json!({"apiVersion": K::api_version(&()), "kind": K::kind(&()), "metadata": metadata, "status": status});
        self.patch_status(object, patch).await
    }

    async fn patch_status<K>(&self, object: &K, patch: serde_json::Value) -> Result<()>
    where
        K: Resource<DynamicType = (), Scope = NamespaceResourceScope> + Clone + DeserializeOwned + Debug,
    {
        let api: Api<K> = Api::namespaced(self.client.clone(), &object.namespace().unwrap_or_default());
        let params = PatchParams::apply(FIELD_MANAGER).force();
        api.patch_status(&object.name_any(), &params, &Patch::Apply(&patch)).await?;
        Ok(())
    }

    /// One Event per change of an object's `Ready` status or reason, never one per retry: Normal `Ready`, or a
    /// Warning named by the reason; with the change to Ready, a Warning `InsecureSkipVerify` when `insecure` names the
    /// spec field that turns certificate checks off.
    pub async fn announce_ready(
        &self,
        object: &ObjectReference,
        action: &str,
        (previous, next): (&[Condition], &[Condition]),
        insecure: Option<&str>,
    ) {
        let ready = |conditions: &[Condition]| {
            conditions.iter().find(|c| c.type_ == crate::api::READY).map(|c| (c.status.clone(), c.reason.clone()))
        };
        let Some(now) = next.iter().find(|c| c.type_ == crate::api::READY) else { return };
        if ready(previous) == ready(next) {
            return;
        }
        let (reason, message) = (now.reason.as_str(), now.message.clone());
        if now.status == "True" {
            info!(reason, "{message}");
            self.publish(object, action, EventType::Normal, "Ready", message).await;
            if let Some(field) = insecure {
                let note = format!("{field} is true: the server's certificate is not verified");
                warn!("{note}");
                self.publish(object, action, EventType::Warning, "InsecureSkipVerify", note).await;
            }
        } else {
            warn!(reason, "{message}");
            self.publish(object, action, EventType::Warning, reason, message).await;
        }
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

/// The server and credentials of a policy, its Secrets (or its `RedisServer`'s) read with `client`'s permissions
/// (for `kubectl pelican`). Reading a server's Secrets takes `get` on Secrets in the server's namespace, which a
/// team usually lacks: that refusal says so, and what works without it.
pub async fn read_target(policy: &ConsumerGroupPolicy, client: &Client) -> Result<Target> {
    let Some((namespace, name)) = policy.server_ref() else {
        let namespace = policy.namespace().unwrap_or_default();
        return resolve::target(&policy.spec.redis, &namespace, client, &SecretCache::default()).await;
    };
    let server = Api::<RedisServer>::namespaced(client.clone(), &namespace)
        .get_opt(&name)
        .await?
        .ok_or_else(|| Error::ServerNotFound { namespace: namespace.clone(), name: name.clone() })?;
    resolve::target(&server.spec.connection(), &namespace, client, &SecretCache::default()).await.map_err(|e| match e {
        Error::Kube(kube::Error::Api(response)) if response.code == 403 => {
            Error::ServerSecretsForbidden { server: format!("{namespace}/{name}"), namespace }
        }
        other => other,
    })
}

/// `namespace/name`: how the runner and the logs name a policy.
pub fn policy_id(policy: &ConsumerGroupPolicy) -> String {
    format!("{}/{}", policy.namespace().unwrap_or_default(), policy.name_any())
}
