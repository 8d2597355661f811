//! The policy's Secrets -> the server and identity to connect with.
//!
//! Secret values come from a cache holding only the Secrets policies reference, filled by one GET on first use
//! and dropped when the metadata-only watch reports a change to that Secret, so a reconcile costs no API request
//! while nothing changes. The watch itself carries no Secret values.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::Client;
use kube::api::Api;

use crate::api::{RedisMode, RedisSpec, SecretKeyRef};
use crate::redis::{Credentials, Sentinel, Target, Tls};
use crate::{Error, Result};

/// `namespace/name` of a Secret.
pub type SecretName = (String, String);
/// A Secret's data, or `None` when it does not exist.
type SecretData = Option<Arc<BTreeMap<String, ByteString>>>;

#[derive(Default)]
pub struct SecretCache {
    entries: Mutex<Entries>,
    /// The namespaces whose Secrets may be read (the operator's RBAC); all when `None`.
    namespaces: Option<BTreeSet<String>>,
}

#[derive(Default)]
struct Entries {
    values: HashMap<SecretName, SecretData>,
    /// Bumped by every invalidation: a GET that started before one may have read an old value and is not cached.
    epoch: u64,
}

impl SecretCache {
    /// A cache that reads Secrets in `namespaces` only, or in every namespace when `None`.
    pub fn new(namespaces: Option<BTreeSet<String>>) -> Self {
        SecretCache { entries: Mutex::default(), namespaces }
    }

    /// Forgets a Secret the watch saw change (created, updated, deleted): the next read fetches it again.
    pub fn invalidate(&self, namespace: &str, name: &str) {
        let mut entries = self.entries.lock().expect("secret cache lock");
        entries.values.remove(&(namespace.to_string(), name.to_string()));
        entries.epoch += 1;
    }

    /// Drops every Secret not in `referenced` (`namespace`, `name`): what no policy or server uses any more.
    pub fn retain_referenced(&self, referenced: &HashSet<SecretName>) {
        self.entries.lock().expect("secret cache lock").values.retain(|key, _| referenced.contains(key));
    }

    /// Secrets cached now.
    pub(crate) fn len(&self) -> usize {
        self.entries.lock().expect("secret cache lock").values.len()
    }

    async fn data(&self, client: &Client, namespace: &str, name: &str) -> Result<SecretData> {
        if let Some(allowed) = &self.namespaces
            && !allowed.contains(namespace)
        {
            return Err(Error::SecretNamespaceNotAllowed {
                namespace: namespace.into(),
                name: name.into(),
                allowed: allowed.iter().cloned().collect::<Vec<_>>().join(", "),
            });
        }
        let key = (namespace.to_string(), name.to_string());
        let epoch = {
            let entries = self.entries.lock().expect("secret cache lock");
            if let Some(data) = entries.values.get(&key) {
                return Ok(data.clone());
            }
            entries.epoch
        };
        let secret = Api::<Secret>::namespaced(client.clone(), namespace).get_opt(name).await?;
        let data = secret.map(|s| {
            let mut data = s.data.unwrap_or_default();
            for (k, v) in s.string_data.unwrap_or_default() {
                data.entry(k).or_insert(ByteString(v.into_bytes()));
            }
            Arc::new(data)
        });
        let mut entries = self.entries.lock().expect("secret cache lock");
        if entries.epoch == epoch {
            entries.values.insert(key, data.clone());
        }
        Ok(data)
    }

    async fn value(
        &self,
        client: &Client,
        namespace: &str,
        reference: Option<&SecretKeyRef>,
    ) -> Result<Option<Vec<u8>>> {
        let Some(reference) = reference else {
            return Ok(None);
        };
        let not_found = || Error::SecretNotFound {
            namespace: namespace.into(),
            name: reference.name.clone(),
            key: reference.key.clone(),
        };
        let data = self.data(client, namespace, &reference.name).await?.ok_or_else(not_found)?;
        let bytes = data.get(&reference.key).ok_or_else(not_found)?;
        Ok(Some(bytes.0.clone()))
    }

    /// A username or password: text, without the newline `echo pass | kubectl create secret --from-file` adds.
    async fn text(&self, client: &Client, namespace: &str, reference: Option<&SecretKeyRef>) -> Result<Option<String>> {
        let Some(bytes) = self.value(client, namespace, reference).await? else {
            return Ok(None);
        };
        let reference = reference.expect("a value came from a reference");
        let text = String::from_utf8(bytes).map_err(|_| Error::SecretInvalid {
            namespace: namespace.into(),
            name: reference.name.clone(),
            key: reference.key.clone(),
        })?;
        Ok(Some(text.trim_end_matches(['\r', '\n']).to_string()))
    }
}

/// Every Secret a connection references (a policy's inline one, or a server's).
pub fn secret_refs(redis: &RedisSpec) -> impl Iterator<Item = &SecretKeyRef> {
    let tls = redis.tls.iter().flat_map(|t| [&t.ca_secret_ref, &t.cert_secret_ref, &t.key_secret_ref]);
    let sentinel = redis.sentinel.iter().flat_map(|s| [&s.username_secret_ref, &s.password_secret_ref]);
    [&redis.username_secret_ref, &redis.password_secret_ref].into_iter().chain(tls).chain(sentinel).flatten()
}

/// The server and credentials of a connection, its Secrets read in `namespace` (the policy's own for an inline
/// connection, the `RedisServer`'s for a referenced one).
pub async fn target(redis: &RedisSpec, namespace: &str, client: &Client, secrets: &SecretCache) -> Result<Target> {
    let credentials = Credentials {
        username: secrets.text(client, namespace, redis.username_secret_ref.as_ref()).await?,
        password: secrets.text(client, namespace, redis.password_secret_ref.as_ref()).await?,
    };
    let tls = match &redis.tls {
        None => Tls::default(),
        Some(spec) => Tls {
            ca: secrets.value(client, namespace, spec.ca_secret_ref.as_ref()).await?,
            client_cert: secrets.value(client, namespace, spec.cert_secret_ref.as_ref()).await?,
            client_key: secrets.value(client, namespace, spec.key_secret_ref.as_ref()).await?,
            insecure_skip_verify: spec.insecure_skip_verify,
        },
    };
    let sentinel = match &redis.sentinel {
        Some(spec) if redis.mode == RedisMode::Sentinel => Some(Sentinel {
            master_name: spec.master_name.clone(),
            credentials: Credentials {
                username: secrets.text(client, namespace, spec.username_secret_ref.as_ref()).await?,
                password: secrets.text(client, namespace, spec.password_secret_ref.as_ref()).await?,
            },
        }),
        _ => None,
    };
    Ok(Target { url: redis.url.clone(), credentials, tls, cluster: redis.mode == RedisMode::Cluster, sentinel })
}
