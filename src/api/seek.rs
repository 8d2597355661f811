//! The `GroupSeek` resource: moves a policy's group back to replay entries, or forward to skip them, once, with a
//! plan in the status (the way `kafka-consumer-groups --reset-offsets`, Pub/Sub's seek and Knative's `ResetOffset`
//! model it).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::PolicyRef;

/// Entry ids as `XGROUP SETID` takes them: `<milliseconds>` or `<milliseconds>-<sequence>`.
const ENTRY_ID_PATTERN: &str = r"^[0-9]{1,20}(-[0-9]{1,20})?$";

/// Moves the group of one `ConsumerGroupPolicy` to a time, an id, its earliest or latest entry, or by a number of
/// entries, once; the entries pending at that moment are kept, acknowledged or dead-lettered. On a topic, the group
/// of every partition moves to the time or position, or by the shift (each partition by that many of its entries).
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "pelican.io",
    version = "v1alpha1",
    kind = "GroupSeek",
    namespaced,
    shortname = "seek",
    category = "pelican",
    status = "GroupSeekStatus",
    doc = "Moves the group of a ConsumerGroupPolicy back (replay) or forward (skip), once, atomically on the server, with the plan in the status.",
    printcolumn(name = "Policy", type_ = "string", json_path = ".spec.policyRef.name"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Redelivered", type_ = "integer", json_path = ".status.redelivered"),
    printcolumn(name = "Skipped", type_ = "integer", json_path = ".status.skipped"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    printcolumn(name = "Dry-Run", type_ = "boolean", json_path = ".spec.dryRun", priority = "1"),
    printcolumn(name = "Pending-Handled", type_ = "integer", json_path = ".status.pendingHandled", priority = "1"),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Failed\")].reason",
        priority = "1"
    )
)]
#[x_kube(validation = Rule::new("self == oldSelf").message("a GroupSeek cannot be changed once it exists: create a new one"))]
#[serde(rename_all = "camelCase")]
pub struct GroupSeekSpec {
    /// The `ConsumerGroupPolicy` in the same namespace whose group moves; the server, the stream and the group
    /// come from it (its `RedisServer`'s tenancy applies).
    pub policy_ref: PolicyRef,
    /// Where the group goes: exactly one of `time`, `id`, `position`, `shift`.
    pub to: SeekTarget,
    /// What happens to the entries pending (delivered, not acknowledged) at the move: `Keep` (default) leaves them
    /// with their consumers; `Acknowledge` acknowledges them; `DeadLetter` moves each to the dead-letter stream
    /// (reason `Seek`) and acknowledges it.
    #[serde(default)]
    pub pending: PendingHandling,
    /// Refuse while a consumer of the group (not Pelican's own) was active this recently (`XINFO CONSUMERS` idle);
    /// `0s` moves the group under running consumers.
    #[serde(default = "default_idle")]
    #[schemars(regex(pattern = r"^([0-9]+(ms|s|m|h))+$"))]
    pub consumers_idle_for: String,
    /// Write the plan into the status and move nothing.
    #[serde(default)]
    pub dry_run: bool,
}

/// The new position. Moving back replays entries (they are read again); moving forward skips them.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("[has(self.time), has(self.id), has(self.position), has(self.shift)].filter(x, x).size() == 1").message("spec.to needs exactly one of time, id, position, shift"))]
pub struct SeekTarget {
    /// The group reads next the first entry at or after this time (RFC 3339), by the time in entry ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "date-time"))]
    pub time: Option<String>,
    /// The group reads next this entry, or the first after it when the stream does not hold it (not on a topic:
    /// each partition has ids of its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = ENTRY_ID_PATTERN), length(max = 41))]
    pub id: Option<String>,
    /// `Earliest`: the stream's first entry (as far back as the stream holds); `Latest`: after its last entry
    /// (skip everything there is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "SeekPosition")]
    pub position: Option<SeekPosition>,
    /// Entries to move by from the group's position: negative replays that many, positive skips that many (at
    /// most to the end); on a topic, that many of each partition's entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self != 0").message("spec.to.shift must not be 0"))]
    pub shift: Option<i64>,
}

#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeekPosition {
    Earliest,
    Latest,
}

/// The entries pending at the move.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PendingHandling {
    /// `Keep`: they stay with their consumers (and the policy's retries), whatever the new position.
    #[default]
    Keep,
    /// `Acknowledge`: they are acknowledged (with a replay they are read again anyway; with a skip they are dropped).
    Acknowledge,
    /// `DeadLetter`: each goes to the dead-letter stream with reason `Seek`, then is acknowledged.
    DeadLetter,
}

impl PendingHandling {
    pub fn name(self) -> &'static str {
        match self {
            PendingHandling::Keep => "Keep",
            PendingHandling::Acknowledge => "Acknowledge",
            PendingHandling::DeadLetter => "DeadLetter",
        }
    }
}

fn default_idle() -> String {
    "30s".into()
}

/// Where a seek is in its life: one attempt, which cannot half-happen.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SeekPhase {
    /// `Pending`: not run yet (waiting for its policy to exist and be reconciled, or for its server).
    #[default]
    Pending,
    /// `Succeeded`: moved (or, with `dryRun`, planned); terminal.
    Succeeded,
    /// `Failed`: refused, nothing moved; terminal (the `Failed` condition says why).
    Failed,
}

impl SeekPhase {
    pub fn is_finished(self) -> bool {
        matches!(self, SeekPhase::Succeeded | SeekPhase::Failed)
    }
}

/// The group's position: its last delivered id, how many entries it has read, and its lag.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct GroupPosition {
    /// `last-delivered-id`: the group reads next the first entry after it.
    pub id: String,
    /// `entries-read` (absent when the server could not tell).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entries_read: Option<i64>,
    /// Entries after the position (absent when the server could not tell).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag: Option<i64>,
}

/// The plan (a dry run) or what was done.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GroupSeekStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Pending`, `Succeeded` or `Failed` (both terminal: a finished seek never runs again).
    #[serde(default)]
    pub phase: SeekPhase,
    /// The group before the move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<GroupPosition>,
    /// The group after the move (or, with `dryRun`, as it would be).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<GroupPosition>,
    /// Entries the group reads again (moving back).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redelivered: Option<i64>,
    /// Entries the group will never read (moving forward).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped: Option<i64>,
    /// Pending entries acknowledged or dead-lettered (`spec.pending`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_handled: Option<i64>,
    /// The stream's first entry: how far back a replay can go (`spec.retention.minAge` of the policies on the
    /// stream is the replay window).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_available: Option<String>,
    /// A topic's seek: each partition's move, in partition order (`from` and `to` are absent, and the counts
    /// above are the partitions' sums).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["partition"]))]
    pub partitions: Vec<PartitionSeek>,
    /// When the seek ran on the server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "date-time"))]
    pub start_time: Option<String>,
    /// When it finished (or was refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "date-time"))]
    pub completion_time: Option<String>,
    /// `Complete` and `Failed` (as Jobs), `Reconciling` while pending and `Stalled` when failed (kstatus).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// One partition of a topic, moved (or, with `dryRun`, as it would be).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PartitionSeek {
    /// The partition's index: its stream is `{<topic>:<partition>}`.
    pub partition: u32,
    /// Its group before the move.
    pub from: GroupPosition,
    /// Its group after the move.
    pub to: GroupPosition,
    /// Entries of the partition the group reads again.
    pub redelivered: i64,
    /// Entries of the partition the group will never read.
    pub skipped: i64,
    /// Its pending entries acknowledged or dead-lettered.
    pub pending_handled: i64,
    /// The partition's first entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_available: Option<String>,
}
