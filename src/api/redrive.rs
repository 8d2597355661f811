//! The `DeadLetterRedrive` resource: a one-off move of dead letters back to where they came from,
//! as an object with phases (the way `Job` and Strimzi's `KafkaRebalance` model one-off work).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Entry ids as `XRANGE` takes them: `<milliseconds>` or `<milliseconds>-<sequence>`.
const ENTRY_ID_PATTERN: &str = r"^[0-9]{1,20}(-[0-9]{1,20})?$";
/// Each part of an id fits in 64 bits, as the server requires: 20 digits at most 18446744073709551615.
const ENTRY_ID_RANGE: &str = "self.split('-').all(p, size(p) < 20 || p <= '18446744073709551615')";

/// Moves the dead letters of one `ConsumerGroupPolicy` back to their source stream (or another stream), once.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "pelican.io",
    version = "v1alpha1",
    kind = "DeadLetterRedrive",
    namespaced,
    shortname = "dlr",
    category = "pelican",
    status = "DeadLetterRedriveStatus",
    doc = "Moves the dead letters of a ConsumerGroupPolicy back to their source stream (or another stream), once: atomically per message, resumable, at a bounded rate.",
    printcolumn(name = "Policy", type_ = "string", json_path = ".spec.policyRef.name"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Moved", type_ = "integer", json_path = ".status.moved"),
    printcolumn(name = "To-Move", type_ = "integer", json_path = ".status.toMove"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    printcolumn(name = "Target", type_ = "string", json_path = ".spec.target", priority = "1"),
    printcolumn(name = "Skipped", type_ = "integer", json_path = ".status.skipped", priority = "1"),
    printcolumn(
        name = "Reason",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Failed\")].reason",
        priority = "1"
    )
)]
#[x_kube(validation = Rule::new("has(self.filter) == has(oldSelf.filter) && has(self.maxMessages) == has(oldSelf.maxMessages)").message("spec.filter and spec.maxMessages cannot be added or removed once the redrive exists: create a new DeadLetterRedrive"))]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterRedriveSpec {
    /// The `ConsumerGroupPolicy` in the same namespace whose dead-letter stream is redriven; the connection, the
    /// dead-letter stream and the source stream come from it. Immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.policyRef is immutable: create a new DeadLetterRedrive"))]
    pub policy_ref: PolicyRef,
    /// `Source` (default): each entry goes back to the stream named by its `pelican-source-stream` field (the
    /// policy's stream when it has none). Any other value names the stream every entry goes to. Immutable.
    #[serde(default = "default_target")]
    #[schemars(length(min = 1, max = 1024))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.target is immutable: create a new DeadLetterRedrive"))]
    pub target: String,
    /// Which dead letters move (all when absent). Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.filter is immutable: create a new DeadLetterRedrive"))]
    pub filter: Option<RedriveFilter>,
    /// The most entries to move; the oldest matching entries go first. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000000000000_i64))]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.maxMessages is immutable: create a new DeadLetterRedrive"))]
    pub max_messages: Option<i64>,
    /// The most entries moved per second (no limit when absent). May be changed while the redrive runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000000))]
    pub rate_per_second: Option<i32>,
    /// Count what would move and move nothing. Immutable.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self == oldSelf").message("spec.dryRun is immutable: create a new DeadLetterRedrive"))]
    pub dry_run: bool,
    /// Pause the redrive where it is; setting it back to false resumes from `status.lastId`. A finished redrive
    /// never runs again.
    #[serde(default)]
    pub suspend: bool,
    /// Delete the object this many seconds after it finished, as Jobs do (kept when absent). The server keeps a
    /// record of the finished redrive, so a manifest applied again under the same name does not run it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 31536000))]
    pub ttl_seconds_after_finished: Option<i32>,
}

/// A `ConsumerGroupPolicy` in the redrive's namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct PolicyRef {
    /// Name of the `ConsumerGroupPolicy`.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// Which dead letters a redrive moves. Every condition given must hold.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RedriveFilter {
    /// Only entries whose `pelican-reason` is one of these (e.g. `MaxDeliveriesExceeded`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub reasons: Vec<ReasonCode>,
    /// Only entries with this dead-letter id or a later one (inclusive, as `XRANGE`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = ENTRY_ID_PATTERN), length(max = 41))]
    #[x_kube(validation = Rule::new(ENTRY_ID_RANGE).message("spec.filter.from must be a stream id `<ms>` or `<ms>-<seq>` whose parts are at most 18446744073709551615 (64 bits), e.g. 1764421200000-0"))]
    pub from: Option<String>,
    /// Only entries with this dead-letter id or an earlier one (inclusive, as `XRANGE`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = ENTRY_ID_PATTERN), length(max = 41))]
    #[x_kube(validation = Rule::new(ENTRY_ID_RANGE).message("spec.filter.to must be a stream id `<ms>` or `<ms>-<seq>` whose parts are at most 18446744073709551615 (64 bits), e.g. 1764421200000-0"))]
    pub to: Option<String>,
}

/// A dead letter's `pelican-reason` value, e.g. `MaxDeliveriesExceeded`.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(transparent)]
pub struct ReasonCode(#[schemars(length(min = 1, max = 128))] pub String);

/// Where a redrive is in its life.
#[derive(JsonSchema, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RedrivePhase {
    /// `Pending`: not started (waiting for its policy, its server, or another redrive of the same dead-letter
    /// stream; the `Reconciling` condition says which).
    #[default]
    Pending,
    /// `Running`: moving entries.
    Running,
    /// `Suspended`: paused by `spec.suspend`; resumes from `lastId`.
    Suspended,
    /// `Succeeded`: finished (or, with `dryRun`, counted); terminal.
    Succeeded,
    /// `Failed`: stopped on an error that retrying cannot fix; terminal (the `Failed` condition says why).
    Failed,
}

impl RedrivePhase {
    pub fn is_finished(self) -> bool {
        matches!(self, RedrivePhase::Succeeded | RedrivePhase::Failed)
    }
}

/// Progress of a redrive. The counts mirror a record the operator keeps on the server, updated in the same script
/// as each move, so they are exact across operator restarts.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetterRedriveStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Pending` (waiting for its policy, its server or another redrive of the same dead-letter stream),
    /// `Running`, `Suspended` (by `spec.suspend`; resumes from `lastId`), `Succeeded` or `Failed` (both terminal).
    #[serde(default)]
    pub phase: RedrivePhase,
    /// Entries to move, counted when the redrive started: the matching entries up to `untilId` (at most
    /// `maxMessages`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_move: Option<i64>,
    /// Entries moved so far.
    #[serde(default)]
    pub moved: i64,
    /// Entries in the range that stayed in the dead-letter stream: outside the filter, or too large for a script
    /// to copy.
    #[serde(default)]
    pub skipped: i64,
    /// Entries counted at the start that were gone when their turn came (deleted or evicted by someone else);
    /// counted when the redrive ends.
    #[serde(default)]
    pub missing: i64,
    /// The last dead-letter id looked at: a restarted operator resumes after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_id: Option<String>,
    /// The dead-letter stream's last id when the redrive started: entries dead-lettered later are not moved, so a
    /// message that fails again is not redriven in a loop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_id: Option<String>,
    /// A topic on a Redis Cluster, where each partition has a dead-letter stream of its own: the partition whose
    /// dead letters move now (one after the other; `untilId` and `lastId` are its own, the counts the topic's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<u32>,
    /// When the redrive started moving.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "date-time"))]
    pub start_time: Option<String>,
    /// When it finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "date-time"))]
    pub completion_time: Option<String>,
    /// `Complete` and `Failed` (as Jobs), `Reconciling` while pending or running and `Stalled` when failed
    /// (kstatus).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

fn default_target() -> String {
    SOURCE_TARGET.into()
}

/// The `spec.target` value that sends each entry back to its own source stream.
pub const SOURCE_TARGET: &str = "Source";
