//! The `ConsumerGroupPolicy` resource: spec, status, admission rules and printer columns.

mod duration;
mod redrive;
mod seek;
mod server;

pub use duration::parse_duration;
pub use redrive::*;
pub use seek::*;
pub use server::*;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use std::collections::BTreeMap;

use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Go-style durations made of integer parts: `90s`, `5m`, `1h30m`, `250ms`.
pub const DURATION_PATTERN: &str = r"^([0-9]+(ms|s|m|h))+$";

/// The policy's condition types (kstatus's three, `Saturated` and `Consuming`).
pub const READY: &str = "Ready";
/// True while the group's backlog is at its `backlog.maxLength` (producers are refused); Ready stays True.
pub const SATURATED: &str = "Saturated";
/// Whether the group's consumers make progress, judged over a window of samples; outside Ready (a slow consumer is
/// no broken policy).
pub const CONSUMING: &str = "Consuming";
/// Whether the stream's window of idempotent production (`spec.idempotence`) is in place; only when one is declared.
pub const IDEMPOTENT: &str = "Idempotent";
pub const RECONCILING: &str = "Reconciling";
pub const STALLED: &str = "Stalled";
/// Reason on all three conditions when the last reconcile succeeded.
pub const RECONCILED: &str = "Reconciled";

/// What Pelican manages for one consumer group: the server, the stream and group, the reclaim / retry /
/// dead-letter policy, and optionally a backlog bound and retention.
// clippy reads the repeated `type_ = ...` of the printer columns as duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "pelican.io",
    version = "v1alpha1",
    kind = "ConsumerGroupPolicy",
    namespaced,
    shortname = "cgp",
    category = "pelican",
    status = "ConsumerGroupPolicyStatus",
    doc = "Declares a Redis/Valkey Streams consumer group and the reclaim, retry and dead-letter policy Pelican runs for it.",
    printcolumn(name = "Stream", type_ = "string", json_path = ".spec.stream"),
    printcolumn(name = "Group", type_ = "string", json_path = ".spec.group"),
    printcolumn(name = "Pending", type_ = "integer", json_path = ".status.pending"),
    printcolumn(
        name = "Oldest",
        type_ = "date",
        json_path = ".status.oldestPendingTime",
        description = "age of the oldest pending entry"
    ),
    printcolumn(name = "Lag", type_ = "integer", json_path = ".status.lag"),
    printcolumn(name = "Dead-Lettered", type_ = "integer", json_path = ".status.totals.deadLettered"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].status"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    printcolumn(name = "Consumers", type_ = "integer", json_path = ".status.consumers", priority = "1"),
    printcolumn(
        name = "Partitions",
        type_ = "integer",
        json_path = ".status.partitions.count",
        description = "partitions of the topic (empty for a plain stream)",
        priority = "1"
    ),
    printcolumn(
        name = "Server",
        type_ = "string",
        json_path = ".spec.redis.serverRef.name",
        description = "the RedisServer the policy uses (empty for an inline connection)",
        priority = "1"
    ),
    printcolumn(name = "Backlog", type_ = "integer", json_path = ".status.backlog", priority = "1"),
    printcolumn(
        name = "Lag-Age",
        type_ = "date",
        json_path = ".status.oldestUnreadTime",
        description = "age of the oldest entry the group has not read (none: nothing unread)",
        priority = "1"
    ),
    printcolumn(
        name = "Requeue-Copies-To",
        type_ = "string",
        json_path = ".status.requeueCopiesTo",
        description = "other groups of the stream, each of which also gets every requeued copy",
        priority = "1"
    ),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason",
        priority = "1"
    )
)]
#[x_kube(validation = Rule::new("!has(self.retry) || !has(self.retry.backoff) || duration(self.retry.backoff.max) >= duration(has(self.reclaim) && has(self.reclaim.minIdle) ? self.reclaim.minIdle : '5m')").message("spec.retry.backoff.max must be at least spec.reclaim.minIdle (the first retry's wait)").field_path(".retry.backoff.max"))]
#[x_kube(validation = Rule::new("self.deadLetter.stream != self.stream").message("spec.deadLetter.stream must differ from spec.stream: dead-lettered entries would be read again by the group").field_path(".deadLetter.stream"))]
#[x_kube(validation = Rule::new("has(self.partitions) || !has(self.ordering) || self.ordering == 'None'").message("spec.ordering PerKey needs spec.partitions: order per key is kept by giving each key one partition of a topic; set spec.partitions or remove spec.ordering").field_path(".ordering"))]
#[x_kube(validation = Rule::new("!has(self.partitions) || !(self.stream.contains('{') || self.stream.contains('}'))").message("spec.stream names a topic when spec.partitions is set and must not contain { or }: each partition is the stream {<topic>:<i>}, a hash tag of its own").field_path(".stream"))]
#[x_kube(validation = Rule::new("!has(self.partitions) || !(self.deadLetter.stream.startsWith('{' + self.stream + ':') && self.deadLetter.stream.matches('^[{].*:[0-9]+[}]$'))").message("spec.deadLetter.stream is one of the topic's partitions ({<topic>:<i>}): dead-lettered entries would be read again by the group; name a stream outside the topic").field_path(".deadLetter.stream"))]
#[x_kube(validation = Rule::new("has(self.partitions) == has(oldSelf.partitions)").message("spec.partitions cannot be added or removed: a topic's entries live in its partition streams, a plain stream's in the stream itself; create a new policy and move the producers to it").field_path(".partitions"))]
#[serde(rename_all = "camelCase")]
pub struct ConsumerGroupPolicySpec {
    /// The Redis or Valkey server (or Cluster) that holds the stream, and how to connect to it.
    pub redis: RedisSpec,
    /// The stream key; with `partitions`, the topic's name (its partitions are the streams `{<topic>:<i>}`, so it
    /// must not contain `{` or `}`). Immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.stream is immutable: create a new policy for another stream"))]
    #[schemars(length(min = 1, max = 1024))]
    pub stream: String,
    /// Makes `stream` a topic of this many partitions, the streams `{<stream>:0}` .. `{<stream>:<partitions-1>}`,
    /// each a hash tag of its own (a Cluster spreads them over its shards). The group, the settings, the passes and
    /// the probe apply to each partition; the dead-letter stream is one for the topic (on a Cluster, one per
    /// partition in its slot: `{<stream>:<i>}:<deadLetter.stream>`). Absent: a plain stream.
    /// Immutable: a topic's entries live in its partitions, so a new count would strand them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1024))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.partitions is immutable: entries are placed by key over the partitions, so another count would move keys and strand entries; create a new policy with the new count and move the producers to it"))]
    pub partitions: Option<u32>,
    /// `None` (default): any consumer may take any entry, and the passes requeue or reassign idle ones. `PerKey`
    /// (needs `partitions`): entries of one key are handled in order, so the passes never requeue or reassign a
    /// partition's entries (`reclaim.strategy` is then `DeadLetterOnly`); an entry over `retry.maxDeliveries` is
    /// still dead-lettered. Workers keep the order with the topic membership of the worker libraries.
    #[serde(default, skip_serializing_if = "Ordering::is_none")]
    pub ordering: Ordering,
    /// The consumer group name. Immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.group is immutable: create a new policy for another group"))]
    #[schemars(length(min = 1, max = 256))]
    pub group: String,
    /// Where a newly created group starts: `$` (new entries only), `0` (the whole stream) or an entry id
    /// (`<milliseconds>` or `<milliseconds>-<sequence>`, not ahead of the server's clock). Used only when the group is
    /// created; changing it later does not move an existing group.
    #[serde(default = "default_start_id")]
    #[schemars(regex(pattern = r"^(\$|0|[0-9]{1,20}(-[0-9]{1,20})?)$"))]
    pub start_id: String,
    /// When pending entries count as abandoned and what the operator does with them, and how often it looks.
    #[serde(default)]
    pub reclaim: ReclaimSpec,
    /// How many deliveries a message gets before it is dead-lettered.
    #[serde(default)]
    pub retry: RetrySpec,
    /// Where messages that reached `retry.maxDeliveries` go.
    pub dead_letter: DeadLetterSpec,
    /// Housekeeping of the group's consumers (optional).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumers: Option<ConsumersSpec>,
    /// What deleting the policy does in Redis: `Retain` (default) leaves the group and its data; `Delete` destroys
    /// the group (`XGROUP DESTROY`; the streams themselves are never deleted) when this policy created it, or when
    /// `adoptGroup` is true.
    #[serde(default)]
    pub deletion_policy: DeletionPolicy,
    /// `true`: a group that existed before this policy (made by hand, by another tool, by an earlier policy) is
    /// this policy's too, and `deletionPolicy: Delete` destroys it with its pending entries. Default `false`:
    /// `Delete` destroys only a group this policy created.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adopt_group: bool,
    /// A bound on what the group has not acknowledged yet, enforced on producers that publish through the
    /// bounded-publish script.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backlog: Option<BacklogSpec>,
    /// Trimming of entries every group of the stream has acknowledged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention: Option<RetentionSpec>,
    /// Pause the reclaim and dead-letter jobs; status keeps refreshing.
    #[serde(default)]
    pub suspend: bool,
    /// The stream's window of idempotent production (`XADD ... IDMP`, Redis 8.6+), applied with `XCFGSET` when the
    /// server's differs. Policies of one stream share it: the longest duration and the largest size among them apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotence: Option<IdempotenceSpec>,
}

impl ConsumerGroupPolicy {
    /// `(namespace, name)` of the `RedisServer` the policy names (its own namespace when the reference has none).
    pub fn server_ref(&self) -> Option<(String, String)> {
        let reference = self.spec.redis.server_ref.as_ref()?;
        let namespace = reference.namespace.clone().or_else(|| self.metadata.namespace.clone()).unwrap_or_default();
        Some((namespace, reference.name.clone()))
    }
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BacklogSpec {
    /// The most entries the group may have unacknowledged (not yet delivered + pending). A publish through the
    /// bounded-publish script that would exceed it is refused with `PELICAN_BACKLOG_FULL`.
    #[schemars(range(min = 1, max = 1000000000000_i64))]
    pub max_length: i64,
}

/// How long, and how many message ids per producer, the server remembers to refuse a publish it already has. Setting
/// it (`XCFGSET`) clears the server's record of producers and message ids, so Pelican sets it only when it differs.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct IdempotenceSpec {
    /// How long a published message id is remembered, in whole seconds from `1s` to `24h` (e.g. `10m`).
    #[schemars(regex(pattern = r"^([0-9]+(ms|s|m|h))+$"), length(max = 32))]
    pub duration: String,
    /// How many message ids are remembered per producer (1 to 10000); older ones are forgotten first.
    #[schemars(range(min = 1, max = 10000))]
    pub max_size: u32,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RetentionSpec {
    /// `None` (default): Pelican never trims the stream. `Acknowledged`: each pass trims the entries every group of
    /// the stream has acknowledged and that are older than `minAge`.
    #[serde(default)]
    pub mode: RetentionMode,
    /// Acknowledged entries are kept at least this long, as a replay window (`Acknowledged` only; default `0s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^([0-9]+(ms|s|m|h))+$"), length(max = 32))]
    pub min_age: Option<String>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum RetentionMode {
    /// The stream is never trimmed by Pelican.
    #[default]
    None,
    /// Each pass trims the entries every group of the stream has acknowledged and that are older than `minAge`.
    Acknowledged,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.serverRef) || has(self.url)").message("spec.redis needs serverRef (the name of a RedisServer your platform team set up) or url (the server, inline)"))]
#[x_kube(validation = Rule::new("!has(self.serverRef) || !(has(self.url) || has(self.usernameSecretRef) || has(self.passwordSecretRef) || has(self.tls) || has(self.sentinel) || self.mode != 'Standalone')").message("spec.redis.serverRef and the inline connection (url, mode, usernameSecretRef, passwordSecretRef, tls, sentinel) are exclusive: with serverRef the RedisServer holds them, so remove them from the policy"))]
#[x_kube(validation = Rule::new("self.mode != 'Cluster' || !has(self.url) || !self.url.matches('/0*[1-9][0-9]*$')").message("spec.redis.url selects a database other than 0, but a Redis Cluster has only database 0: remove the path or use /0"))]
#[x_kube(validation = Rule::new("self.mode == 'Sentinel' ? has(self.sentinel) : !has(self.sentinel)").message("spec.redis.sentinel goes with spec.redis.mode Sentinel: set both (the sentinel's address in url, the primary's name in sentinel.masterName) or neither"))]
#[x_kube(validation = Rule::new("!has(oldSelf.serverRef) || has(self.serverRef)").message("spec.redis.serverRef cannot be removed: a policy that names a RedisServer stays on it (the field-level rules cannot see a url that comes back in its place); create a new policy for an inline server"))]
#[x_kube(validation = Rule::new("!has(self.tls) || (has(self.url) && self.url.startsWith('rediss://'))").message("spec.redis.tls is set but spec.redis.url is redis://, which never uses TLS: use a rediss:// URL or remove spec.redis.tls"))]
pub struct RedisSpec {
    /// A `RedisServer` to use instead of an inline connection: its URL, credentials and TLS, read by the operator
    /// (the policy's namespace needs no access to its Secrets), if the server admits this namespace and the
    /// policy's keys. Exclusive with the inline fields. May replace `url` (moving a policy to a server
    /// reference); then immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.redis.serverRef is immutable: create a new policy for another server"))]
    pub server_ref: Option<ServerRef>,
    /// `redis://host:port/db` or `rediss://host:port/db`. Credentials go in Secrets, never in the URL. Immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.redis.url is immutable: create a new policy for another server"))]
    #[x_kube(validation = Rule::new("!self.matches('^rediss?://[^/]*@')").message("spec.redis.url must not contain credentials: put them in a Secret and use spec.redis.usernameSecretRef / passwordSecretRef"))]
    #[x_kube(validation = Rule::new("self.matches('^rediss?://[^/]*@') || self.matches('^rediss?://(\\\\[[0-9A-Fa-f:.]+\\\\]|[^\\\\s/:@?#\\\\[\\\\]]+)(:[0-9]{1,5})?(/[0-9]{0,9})?$')").message("spec.redis.url must be redis://host[:port][/database] or rediss://host[:port][/database]: a host name or address, an optional port, an optional database number (at most 9 digits), and nothing else (no query, no other path)"))]
    #[schemars(regex(pattern = r"^rediss?://[^\s]+$"), length(max = 2048))]
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub url: String,
    /// `Standalone` (default): one server, or the primary of a replicated setup. `Cluster`: `url` names any node of a
    /// Redis Cluster; the operator discovers the others and follows slot moves. `Sentinel`: `url` names a sentinel
    /// (usually the sentinels' Service) and `sentinel.masterName` the primary; the operator asks the sentinel for
    /// the primary at every reconcile and follows failovers.
    #[serde(default)]
    pub mode: RedisMode,
    /// The sentinels' settings (`mode: Sentinel` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sentinel: Option<SentinelSpec>,
    /// The ACL user name, from a Secret beside it (the policy's namespace, or the RedisServer's) (optional; `default` when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username_secret_ref: Option<SecretKeyRef>,
    /// The password, from a Secret beside it (the policy's namespace, or the RedisServer's) (optional).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_secret_ref: Option<SecretKeyRef>,
    /// TLS settings for `rediss://` URLs: the CA to trust and an optional client certificate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSpec>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RedisMode {
    #[default]
    Standalone,
    Cluster,
    Sentinel,
}

/// How to find the primary through Redis Sentinel. TLS (`rediss://`, `spec.redis.tls`) applies to the sentinels
/// and the data nodes alike; the data nodes use `spec.redis.usernameSecretRef` / `passwordSecretRef`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SentinelSpec {
    /// The name the sentinels monitor the primary under (`sentinel monitor <masterName> ...`). Immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("sentinel.masterName is immutable: create a new object (policy or RedisServer) for another primary"))]
    #[schemars(length(min = 1, max = 256))]
    pub master_name: String,
    /// The ACL user name the sentinels require (`sentinel sentinel-user`), from a Secret beside it (the policy's namespace, or the RedisServer's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username_secret_ref: Option<SecretKeyRef>,
    /// The password the sentinels require (`requirepass` of the sentinels), from a Secret beside it (the policy's namespace, or the RedisServer's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_secret_ref: Option<SecretKeyRef>,
}

/// A `RedisServer` by name.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
pub struct ServerRef {
    /// Name of the `RedisServer`.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Its namespace; the policy's own when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub namespace: Option<String>,
}

/// A key of a Secret in the policy's own namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
pub struct SecretKeyRef {
    /// Name of the Secret, in the namespace of the policy or RedisServer that names it.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Key within the Secret's data.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.certSecretRef) == has(self.keySecretRef)").message("tls.certSecretRef and tls.keySecretRef go together: a client certificate needs its key, and a key its certificate"))]
pub struct TlsSpec {
    /// PEM CA bundle to verify the server's certificate with (optional; the system roots when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretKeyRef>,
    /// PEM client certificate, for servers that require one (mutual TLS); goes with `keySecretRef`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_secret_ref: Option<SecretKeyRef>,
    /// PEM private key of the client certificate; goes with `certSecretRef`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_secret_ref: Option<SecretKeyRef>,
    /// Accept any server certificate (testing only: the operator records a Warning Event). Default false.
    #[serde(default)]
    pub insecure_skip_verify: bool,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ReclaimSpec {
    /// A pending entry idle at least this long is eligible for reclaim (>= 1s).
    #[serde(default = "default_min_idle")]
    #[schemars(regex(pattern = r"^([0-9]+(ms|s|m|h))+$"), length(max = 32))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1s')").message("spec.reclaim.minIdle must be at least 1s"))]
    pub min_idle: String,
    /// How often the reclaim / dead-letter pass runs (>= 1s).
    #[serde(default = "default_interval")]
    #[schemars(regex(pattern = r"^([0-9]+(ms|s|m|h))+$"), length(max = 32))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1s')").message("spec.reclaim.interval must be at least 1s"))]
    pub interval: String,
    /// Upper bound on entries handled in one pass.
    #[serde(default = "default_max_per_pass")]
    #[schemars(range(min = 1, max = 100000))]
    pub max_per_pass: i32,
    /// What happens to an idle entry under the retry cap: `Requeue` (default) appends a copy to the stream and
    /// acknowledges the original, so any consumer reads it again; `Reassign` hands it to the least loaded live
    /// consumer (`XCLAIM`); `DeadLetterOnly` leaves it to its consumer and only dead-letters entries past the cap.
    #[serde(default)]
    pub strategy: ReclaimStrategy,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReclaimStrategy {
    #[default]
    Requeue,
    Reassign,
    DeadLetterOnly,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RetrySpec {
    /// The most deliveries a message gets before it is dead-lettered (>= 1).
    #[serde(default = "default_max_deliveries")]
    #[schemars(range(min = 1, max = 1000000))]
    pub max_deliveries: i32,
    /// Retries spaced out: an entry delivered n times (requeued copies counting every delivery of the message) is
    /// reclaimed once idle `min(max, minIdle * factor^(n-1))`. Absent: `minIdle` for every delivery. For `Requeue`
    /// and `Reassign`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<BackoffSpec>,
}

/// Exponential spacing of retries.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BackoffSpec {
    /// How much longer each retry waits than the one before (1: no growth).
    #[schemars(range(min = 1, max = 10))]
    pub factor: i32,
    /// The longest wait, at least `spec.reclaim.minIdle`.
    #[schemars(regex(pattern = r"^([0-9]+(ms|s|m|h))+$"), length(max = 32))]
    pub max: String,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterSpec {
    /// The dead-letter stream key; must differ from `spec.stream`.
    #[schemars(length(min = 1, max = 1024))]
    pub stream: String,
    /// Approximate cap on the dead-letter stream length (`XADD MAXLEN ~`). Entries evicted by the cap are counted
    /// in `status.totals.deadLetterEvicted` and a Warning Event `DeadLettersEvicted`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000000000000_i64))]
    pub max_len: Option<i64>,
}

#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ConsumersSpec {
    /// Delete consumers idle this long (`XINFO CONSUMERS` `idle`: since their last attempt to read or claim, not
    /// `inactive`, their last successful one) that own no pending entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^([0-9]+(ms|s|m|h))+$"), length(max = 32))]
    #[x_kube(validation = Rule::new("duration(self) >= duration('1s')").message("spec.consumers.expireAfter must be at least 1s"))]
    pub expire_after: Option<String>,
    /// The Pods that run this group's consumers, in the policy's namespace: a consumer is matched to the Pod of the
    /// same name (the SDK's consumer name defaults to the Pod's). When a consumer's Pod is gone (deleted, evicted,
    /// its node lost), the next pass retries its pending entries without waiting `minIdle` (counted: a Pod may have
    /// died of its message), and the consumer is removed from the group once it holds nothing. Every consumer of the
    /// group is then expected to be named after such a Pod. Needs the operator to read Pods (the chart grants it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<LabelSelectorSpec>,
}

/// Whether a topic's entries of one key are handled in order (`spec.ordering`).
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Ordering {
    /// Any consumer may take any entry.
    #[default]
    None,
    /// The entries of one key are handled in order, one at a time.
    PerKey,
}

impl Ordering {
    fn is_none(&self) -> bool {
        *self == Ordering::None
    }

    /// As the topic's settings publish it (`ordering`).
    pub fn name(self) -> &'static str {
        match self {
            Ordering::None => "None",
            Ordering::PerKey => "PerKey",
        }
    }
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeletionPolicy {
    /// Deleting the policy leaves Redis untouched.
    #[default]
    Retain,
    /// Deleting the policy destroys the consumer group (never the streams).
    Delete,
}

fn default_start_id() -> String {
    "$".into()
}
fn default_min_idle() -> String {
    "5m".into()
}
fn default_interval() -> String {
    "1m".into()
}
fn default_max_per_pass() -> i32 {
    1000
}
fn default_max_deliveries() -> i32 {
    3
}

impl Default for ReclaimSpec {
    fn default() -> Self {
        Self {
            min_idle: default_min_idle(),
            interval: default_interval(),
            max_per_pass: default_max_per_pass(),
            strategy: ReclaimStrategy::default(),
        }
    }
}

impl Default for RetrySpec {
    fn default() -> Self {
        Self { max_deliveries: default_max_deliveries(), backoff: None }
    }
}

/// What Pelican observed on the server, refreshed every pass and at least every `spec.reclaim.interval`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ConsumerGroupPolicyStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Reconciling`, `Stalled` (kstatus), `Saturated` when `spec.backlog` is set, and `Consuming`
    /// (whether the consumers make progress; not part of `Ready`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// `mode: Sentinel`: the primary (`host:port`) the sentinels named at the last reconcile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary: Option<String>,
    /// `spec.consumers.pods`: consumers whose Pod is gone, as the last pass saw them (at most 10 named; their
    /// entries are retried and they are removed once they hold nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumers_without_pod: Option<Vec<ConsumerName>>,
    /// Idempotent production on the stream (`XINFO STREAM`, Redis 8.6+): the window and what the server tracks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotence: Option<IdempotenceStatus>,
    /// The Pelican install that wrote this status, named by its leader Lease (`<namespace>/<name>`). Another name
    /// here after this install wrote it means two installs serve the policy (Warning `AnotherPelican`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operator: Option<String>,
    /// The server's flavor and version, e.g. `redis 7.0.15` or `valkey 9.1.2`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_version: Option<String>,
    /// The newer stream features the server has, detected per command (`COMMAND INFO`, `COMMAND DOCS`), not by
    /// version: `XACKDEL`, `XDELEX`, `XNACK`, `XTRIM ACKED`, `XREADGROUP CLAIM`, `XADD IDMP`. Empty on servers
    /// before Redis 8.2, and when the operator's ACL user may not run `COMMAND`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub server_features: Vec<ServerFeature>,
    /// Entries in the stream (`XLEN`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_length: Option<i64>,
    /// Entries not yet delivered to the group; absent when the server cannot tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag: Option<i64>,
    /// Entries delivered to a consumer of the group and not acknowledged yet (the PEL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<i64>,
    /// Time of the oldest entry the group has not read yet (the first after its last delivered id), from its id;
    /// absent when nothing is unread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "date-time"))]
    pub oldest_unread_time: Option<String>,
    /// Age in seconds of the oldest entry the group has not read yet, when the status was written; 0 when nothing is
    /// unread. Written with other changes, not as it grows: `LAG-AGE` (from `oldestUnreadTime`) and
    /// `pelican_group_lag_seconds` are live.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag_seconds: Option<i64>,
    /// Entries per second over the last window of samples (see the `Consuming` condition), from the server's own
    /// counters; absent until two samples are taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rates: Option<Rates>,
    /// Seconds until the backlog is drained at the rate it shrank over the window; 0 when there is no backlog,
    /// absent while it does not shrink.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_seconds: Option<i64>,
    /// Id of the oldest pending entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_pending_id: Option<String>,
    /// Time of the oldest pending entry, from its id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "date-time"))]
    pub oldest_pending_time: Option<String>,
    /// Seconds since the oldest pending entry was last delivered (refreshed with other changes, not on its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_pending_idle_seconds: Option<i64>,
    /// Consumers of the group, the operator's own excluded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumers: Option<i64>,
    /// Entries in the dead-letter stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter_length: Option<i64>,
    /// The operator's counters, kept in Redis so they survive restarts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub totals: Option<Totals>,
    /// Messages consumers ended as terminal (acknowledged without success), by reason code: the 20 largest counts,
    /// and the rest summed as `Other`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["reason"]))]
    pub terminal_acks: Vec<TerminalAckCount>,
    /// Entries the group has not acknowledged: lag + pending; when the server cannot tell the lag, the stream's
    /// length + pending (an upper bound, the number the bounded publish script refuses with).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backlog: Option<i64>,
    /// With `strategy: Requeue`, the stream's other groups (comma-separated): a requeued copy is a new entry of the
    /// stream, so each of them reads it too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requeue_copies_to: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention: Option<RetentionStatus>,
    /// With `spec.partitions`: the topic's partitions at a glance (the counts above are the topic's sums).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partitions: Option<PartitionsStatus>,
    /// When the last reclaim / dead-letter pass ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "date-time"))]
    pub last_pass_time: Option<String>,
}

/// A topic's partitions, summed up (no list per partition: a topic has up to 1024).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PartitionsStatus {
    /// Partitions of the topic (`spec.partitions`).
    pub count: u32,
    /// Partitions whose stream has the group.
    pub with_group: u32,
    /// On a Cluster: the primary (`host:port`) serving each partition's slot -> how many partitions it serves.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub shards: BTreeMap<String, u32>,
    /// Live members of the topic's group (the workers sharing its partitions), as the reconcile's sweep of expired
    /// members found them.
    #[serde(default)]
    pub members: u32,
    /// The partition with the largest backlog (lag + pending, as `status.backlog`): a hot key's partition, and what
    /// `spec.backlog.maxLength` (a bound per partition) refuses at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub largest_backlog: Option<PartitionBacklog>,
}

/// One partition's backlog.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PartitionBacklog {
    /// The partition's index: its stream is `{<topic>:<partition>}`.
    pub partition: u32,
    /// Its lag (or, when the server cannot tell it, its length) plus its pending entries.
    pub backlog: i64,
}

/// The stream's idempotent production, as the server reports it.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct IdempotenceStatus {
    /// How long a message id is remembered, in seconds (`idmp-duration`).
    pub duration_seconds: i64,
    /// Message ids remembered per producer (`idmp-maxsize`).
    pub max_size: i64,
    /// Producers with message ids remembered now (`pids-tracked`).
    pub producers: i64,
    /// Message ids remembered now (`iids-tracked`).
    pub message_ids: i64,
    /// Idempotent publishes that added an entry (`iids-added`, since the stream was created).
    pub added: i64,
    /// Publishes refused as duplicates, each answered with the first entry's id (`iids-duplicates`).
    pub duplicates: i64,
}

/// A consumer of the group, by the name its worker reads with.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(transparent)]
pub struct ConsumerName(pub String);

/// A newer stream feature a server has, e.g. `XTRIM ACKED` or `XACKDEL`.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(transparent)]
pub struct ServerFeature(pub String);

/// Entries per second over the window, from `entries-added` (the stream), `entries-read` (the group) and the PEL.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Rates {
    /// Entries added to the stream (by anyone, requeued copies included).
    pub added: f64,
    /// Entries delivered to the group's consumers for the first time; absent when the server cannot tell (the
    /// group's `entries-read` is unknown and so is its lag).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read: Option<f64>,
    /// Entries the consumers acknowledged (read, minus what the PEL grew by, minus what the operator itself
    /// acknowledged: requeued, dead-lettered, payload gone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acknowledged: Option<f64>,
}

/// The operator's own counters, mirrored from the `{T}:pelican:<stream>:<group>:totals` hash.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Totals {
    /// Idle entries copied to the tail of the stream and acknowledged (`strategy: Requeue`).
    pub requeued: i64,
    /// Idle entries handed to another consumer (`strategy: Reassign`).
    pub reassigned: i64,
    /// Messages moved to the dead-letter stream after `retry.maxDeliveries` deliveries.
    pub dead_lettered: i64,
    /// Pending entries whose payload was gone (deleted or trimmed), acknowledged and dropped.
    pub payload_deleted: i64,
    /// Consumers deleted by `consumers.expireAfter`.
    pub consumers_expired: i64,
    /// Dead-letter entries dropped by `spec.deadLetter.maxLen`.
    #[serde(default)]
    pub dead_letter_evicted: i64,
    /// Publishes refused because this group's backlog was full (the `{T}:pelican:<stream>:rejected` hash).
    #[serde(default)]
    pub publish_rejected: i64,
    /// Entries this policy's passes trimmed from the stream (`spec.retention`).
    #[serde(default)]
    pub trimmed: i64,
}

/// What `spec.retention` did on the last pass.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct RetentionStatus {
    /// The retention that applies to the stream: the most conservative among the policies of the stream.
    pub effective: String,
    /// Who keeps the stream from shrinking further: a group and its oldest pending or last read entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned_by: Option<String>,
}

/// Messages ended as terminal with one reason code, from `{T}:pelican:<stream>:<group>:terminal`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct TerminalAckCount {
    /// The reason code the consumer gave, e.g. `RecordNotFound`.
    pub reason: String,
    /// Messages ended with it.
    pub count: i64,
}

impl ConsumerGroupPolicy {
    /// The condition of the given type, if the status has one.
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        self.status.as_ref()?.conditions.iter().find(|c| c.type_ == type_)
    }
}
