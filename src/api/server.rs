//! The `RedisServer` resource: one server (or Cluster, or Sentinel set), its credentials, and which namespaces may
//! use it for which keys. Written by whoever runs the server; policies name it with `spec.redis.serverRef`.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, LabelSelectorRequirement};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{RedisMode, RedisSpec, SecretKeyRef, SentinelSpec, TlsSpec};

/// A Redis or Valkey server that policies in the admitted namespaces use by reference, without access to its
/// credentials: the operator reads its Secrets, in this object's namespace.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "pelican.io",
    version = "v1alpha1",
    kind = "RedisServer",
    namespaced,
    shortname = "rsrv",
    category = "pelican",
    status = "RedisServerStatus",
    doc = "A Redis or Valkey server, its credentials, and which namespaces may use it for which keys; ConsumerGroupPolicies name it with spec.redis.serverRef.",
    printcolumn(name = "URL", type_ = "string", json_path = ".spec.url"),
    printcolumn(name = "Mode", type_ = "string", json_path = ".spec.mode"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(name = "Policies", type_ = "integer", json_path = ".status.policies"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    printcolumn(name = "Version", type_ = "string", json_path = ".status.serverVersion", priority = "1"),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason",
        priority = "1"
    )
)]
#[x_kube(validation = Rule::new("self.mode != 'Cluster' || !self.url.matches('/0*[1-9][0-9]*$')").message("spec.url selects a database other than 0, but a Redis Cluster has only database 0: remove the path or use /0"))]
#[x_kube(validation = Rule::new("self.mode == 'Sentinel' ? has(self.sentinel) : !has(self.sentinel)").message("spec.sentinel goes with spec.mode Sentinel: set both (the sentinel's address in url, the primary's name in sentinel.masterName) or neither"))]
#[x_kube(validation = Rule::new("!has(self.tls) || self.url.startsWith('rediss://')").message("spec.tls is set but spec.url is redis://, which never uses TLS: use a rediss:// URL or remove spec.tls"))]
#[serde(rename_all = "camelCase")]
pub struct RedisServerSpec {
    /// `redis://host:port/db` or `rediss://host:port/db`. Credentials go in Secrets, never in the URL. May be
    /// changed: every policy using the server follows within seconds.
    #[x_kube(validation = Rule::new("!self.matches('^rediss?://[^/]*@')").message("spec.url must not contain credentials: put them in a Secret and use spec.usernameSecretRef / passwordSecretRef"))]
    #[x_kube(validation = Rule::new("self.matches('^rediss?://(\\\\[[0-9A-Fa-f:.]+\\\\]|[^\\\\s/:@?#\\\\[\\\\]]+)(:[0-9]{1,5})?(/[0-9]{0,9})?$')").message("spec.url must be redis://host[:port][/database] or rediss://host[:port][/database]: a host name or address, an optional port, an optional database number (at most 9 digits), and nothing else (no query, no other path)"))]
    #[schemars(regex(pattern = r"^rediss?://[^\s]+$"), length(max = 2048))]
    pub url: String,
    /// `Standalone` (default), `Cluster` (`url` names any node) or `Sentinel` (`url` names a sentinel, and
    /// `sentinel.masterName` the primary).
    #[serde(default)]
    pub mode: RedisMode,
    /// The sentinels' settings (`mode: Sentinel` only); their Secrets are in this object's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sentinel: Option<SentinelSpec>,
    /// The ACL user name, from a Secret in this object's namespace (optional; `default` when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username_secret_ref: Option<SecretKeyRef>,
    /// The password, from a Secret in this object's namespace (optional).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_secret_ref: Option<SecretKeyRef>,
    /// TLS settings for `rediss://` URLs, the Secrets in this object's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSpec>,
    /// Which namespaces may use the server, and which keys each may touch. Empty: only this object's own
    /// namespace, every key.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub tenants: Vec<Tenant>,
    /// The drain's pace on this server (a Redis other applications share): after a pass that ended before the end of
    /// its PEL (a backlog draining, after an outage), the server's pass permit rests this long before the next pass
    /// may have it, so passes take at most 100 ms / (100 ms + pause) of each of its two permits (`400ms`: a fifth).
    /// For every policy using this server, in place of the install's `--drain-pause` (chart `drainPause`); `0s`: the
    /// next pass follows at once. At most `1m`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^([0-9]+(ms|s|m|h))+$"), length(max = 32))]
    #[x_kube(validation = Rule::new("duration(self) <= duration('1m')").message("spec.drainPause must be at most 1m: a pass waits that long for its turn"))]
    pub drain_pause: Option<String>,
}

/// Namespaces (by name, by label, or both) and the keys their policies may touch.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("size(self.namespaces) > 0 || has(self.namespaceSelector)").message("a tenant needs namespaces, a namespaceSelector, or both"))]
pub struct Tenant {
    /// Namespaces admitted by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1024))]
    pub namespaces: Vec<NamespaceName>,
    /// Namespaces admitted by their labels (`matchLabels`, `matchExpressions`, as a Deployment's selector); `{}`
    /// admits every namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelectorSpec>,
    /// Glob patterns a key must match: the policy's stream and dead-letter stream and a redrive's target.
    #[schemars(length(min = 1, max = 64))]
    pub keys: Vec<KeyPattern>,
}

/// A namespace's name.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(transparent)]
pub struct NamespaceName(#[schemars(length(min = 1, max = 63))] pub String);

/// A key pattern as Redis ACL key patterns are matched: `*`, `?`, `[abc]`, `[a-z]`, `[^...]`, `\\` escaping the next
/// character; `{` and `}` are plain characters.
/// `${namespace}` stands for the policy's namespace. Pelican's own keys follow from the stream and are not listed.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(transparent)]
pub struct KeyPattern(#[schemars(length(min = 1, max = 1024))] pub String);

/// A label selector (over namespaces, or Pods): every `matchLabels` pair and every `matchExpressions` requirement must
/// hold.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelectorSpec {
    /// Labels the object must have, with these values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, String>,
    /// Requirements on the labels.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<LabelRequirement>,
}

/// One requirement on a label: `In` / `NotIn` a set of values, `Exists`, `DoesNotExist`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct LabelRequirement {
    /// The label's key.
    pub key: String,
    /// `In`, `NotIn`, `Exists` or `DoesNotExist`.
    pub operator: String,
    /// The values for `In` and `NotIn`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<LabelValue>,
}

/// A label's value.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(transparent)]
pub struct LabelValue(pub String);

impl From<&LabelSelectorSpec> for LabelSelector {
    fn from(selector: &LabelSelectorSpec) -> LabelSelector {
        LabelSelector {
            match_labels: Some(selector.match_labels.clone()),
            match_expressions: Some(
                selector
                    .match_expressions
                    .iter()
                    .map(|r| LabelSelectorRequirement {
                        key: r.key.clone(),
                        operator: r.operator.clone(),
                        values: Some(r.values.iter().map(|v| v.0.clone()).collect()),
                    })
                    .collect(),
            ),
        }
    }
}

/// What Pelican last saw of the server.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RedisServerStatus {
    /// `Ready`: True when the server answers with the credentials of the spec.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `redis_version` (or `valkey_version`) from INFO server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_version: Option<String>,
    /// How many ConsumerGroupPolicies name this server.
    #[serde(default)]
    pub policies: i64,
}

impl RedisServerSpec {
    /// The connection as a policy would give it inline, for the resolution the two share.
    pub fn connection(&self) -> RedisSpec {
        RedisSpec {
            url: self.url.clone(),
            server_ref: None,
            mode: self.mode,
            sentinel: self.sentinel.clone(),
            username_secret_ref: self.username_secret_ref.clone(),
            password_secret_ref: self.password_secret_ref.clone(),
            tls: self.tls.clone(),
        }
    }

    /// `drainPause`, when set (the schema admits only durations; one unreadable counts as unset).
    pub fn drain_pause(&self) -> Option<std::time::Duration> {
        self.drain_pause.as_deref().and_then(|text| super::duration::parse_duration(text).ok())
    }
}
