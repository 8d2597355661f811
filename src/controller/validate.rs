//! Phase 2, validate: what the spec and the other policies allow, before anything is written. Pure: no IO, so
//! every rule is a plain unit test.

use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;

use crate::api::{
    ConsumerGroupPolicy, ConsumerGroupPolicySpec, IdempotenceSpec, Ordering, ReclaimStrategy, RetentionMode,
    parse_duration,
};
use crate::jobs::{Backoff, PassSettings};
use crate::keys;
use crate::redis::server_identity;
use crate::{Error, Result};

/// The spec's durations, parsed.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    pub interval: Duration,
    pub pass: PassSettings,
    pub expire_after: Option<Duration>,
    /// This policy's own `spec.retention`: `minAge` when `Acknowledged`.
    pub retention: Option<Duration>,
    /// This policy's own `spec.idempotence`.
    pub idempotence: Option<Window>,
}

/// A stream's window of idempotent production, as `XCFGSET` takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub seconds: i64,
    pub max_size: i64,
}

impl Window {
    /// The server's range for `IDMP-DURATION`, in seconds.
    const SECONDS: std::ops::RangeInclusive<i64> = 1..=86_400;

    fn from_spec(spec: &IdempotenceSpec) -> Result<Window> {
        let duration = parse_duration(&spec.duration)
            .map_err(|e| Error::InvalidSpec(format!("spec.idempotence.duration: {e}")))?;
        let seconds = duration.as_secs() as i64;
        if duration.subsec_nanos() != 0 || !Window::SECONDS.contains(&seconds) {
            return Err(Error::InvalidSpec(format!(
                "spec.idempotence.duration: {:?} is not whole seconds from 1s to 24h (the server's range for \
                 IDMP-DURATION); use e.g. 10m",
                spec.duration
            )));
        }
        Ok(Window { seconds, max_size: i64::from(spec.max_size.clamp(1, 10_000)) })
    }
}

impl Schedule {
    pub fn from_spec(spec: &ConsumerGroupPolicySpec) -> Result<Schedule> {
        let duration =
            |field: &str, text: &str| parse_duration(text).map_err(|e| Error::InvalidSpec(format!("{field}: {e}")));
        let expire_after = spec.consumers.as_ref().and_then(|c| c.expire_after.as_deref());
        let min_idle = duration("spec.reclaim.minIdle", &spec.reclaim.min_idle)?;
        Ok(Schedule {
            interval: duration("spec.reclaim.interval", &spec.reclaim.interval)?,
            pass: PassSettings {
                min_idle,
                max_per_pass: spec.reclaim.max_per_pass.max(1) as usize,
                max_deliveries: spec.retry.max_deliveries.max(1) as u32,
                // Order per key (SPEC 22): an entry taken from its partition and put back elsewhere or later
                // would overtake, or be overtaken by, the key's next entries; only the cap still applies.
                strategy: match spec.ordering {
                    Ordering::PerKey => ReclaimStrategy::DeadLetterOnly,
                    Ordering::None => spec.reclaim.strategy,
                },
                dead_letter_max_len: spec.dead_letter.max_len.map(|n| n.max(1) as u64),
                backoff: spec
                    .retry
                    .backoff
                    .as_ref()
                    .map(|b| -> Result<Backoff> {
                        Ok(Backoff {
                            factor: b.factor.clamp(1, 10) as u32,
                            max: duration("spec.retry.backoff.max", &b.max)?,
                        })
                    })
                    .transpose()?,
                handover_grace: keys::handover_grace(min_idle),
                slice: crate::runner::PASS_SLICE,
            },
            expire_after: expire_after.map(|text| duration("spec.consumers.expireAfter", text)).transpose()?,
            retention: match &spec.retention {
                Some(r) if r.mode == RetentionMode::Acknowledged => Some(
                    r.min_age.as_deref().map(|t| duration("spec.retention.minAge", t)).transpose()?.unwrap_or_default(),
                ),
                _ => None,
            },
            idempotence: spec.idempotence.as_ref().map(Window::from_spec).transpose()?,
        })
    }
}

/// Everything that must hold before the policy may touch Redis: its schedule parses, no older policy owns its
/// group or its key names, and on a Cluster (`cluster`, from the resolved connection) all its keys share the
/// stream's slot.
pub fn validate(policy: &ConsumerGroupPolicy, others: &[Arc<ConsumerGroupPolicy>], cluster: bool) -> Result<Schedule> {
    let schedule = Schedule::from_spec(&policy.spec)?;
    if let Some(conflict) = conflict(policy, others) {
        return Err(Error::ResourceConflict(conflict.to_string()));
    }
    if cluster {
        same_slot(&policy.spec)?;
    }
    Ok(schedule)
}

/// In a cluster the scripts touch the stream, the dead-letter stream and the counters at once, so every key any
/// script touches must live in the stream's hash slot.
pub fn same_slot(spec: &ConsumerGroupPolicySpec) -> Result<()> {
    let stream_slot = keys::slot(&spec.stream);
    if !keys::has_same_slot_keys(&spec.stream) {
        let renamed = spec.stream.replace(['{', '}'], "");
        return Err(Error::CrossSlot(format!(
            "spec.stream {:?} has a '}}' but no hash tag, so Redis hashes the whole name and no key of Pelican's \
             counters can be built in its slot (slot {stream_slot}); give the stream a hash tag, e.g. \
             \"{{{renamed}}}:events\", or a name without braces",
            spec.stream
        )));
    }
    let dead_letter_slot = keys::slot(&spec.dead_letter.stream);
    // A topic's partitions each have a hash tag of their own and, on a Cluster, a dead-letter stream in it.
    if stream_slot == dead_letter_slot || spec.partitions.is_some() {
        return Ok(());
    }
    let tag = keys::hash_tag(&spec.stream);
    Err(Error::CrossSlot(format!(
        "spec.stream {:?} (slot {stream_slot}) and spec.deadLetter.stream {:?} (slot {dead_letter_slot}) are in different \
         cluster slots; give both the same hash tag, e.g. stream \"{{{tag}}}:events\" and deadLetter.stream \"{{{tag}}}:dlq\" \
         (Pelican's counters follow the stream's tag)",
        spec.stream, spec.dead_letter.stream
    )))
}

/// Why a policy cannot own what it claims: an older policy on the same server claims the same (stream, group), or
/// a different pair whose counter keys have the same names.
#[derive(Debug, PartialEq, Eq)]
pub enum Conflict {
    SameGroup { stream: String, group: String, owner: String },
    SameKeys { key: String, owner: String, stream: String, group: String },
}

impl std::fmt::Display for Conflict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Conflict::SameGroup { stream, group, owner } => write!(
                f,
                "stream {stream:?} group {group:?} on this server is already managed by ConsumerGroupPolicy {owner}"
            ),
            Conflict::SameKeys { key, owner, stream, group } => write!(
                f,
                "the counter key {key:?} of this policy is also the key of ConsumerGroupPolicy {owner} (stream \
                 {stream:?}, group {group:?}): names are joined with ':', so rename the group or the stream so that \
                 the two differ"
            ),
        }
    }
}

/// The older of two policies claiming one group or one key name wins.
///
/// Runs on every reconcile against every policy, so it allocates nothing for policies that cannot conflict: with
/// 10,000 policies a reconcile every `interval` each, an allocating scan (and a sort by an allocated rank) kept the
/// operator's two cores busy with this check alone.
pub fn conflict(policy: &ConsumerGroupPolicy, others: &[Arc<ConsumerGroupPolicy>]) -> Option<Conflict> {
    let (stream, group) = (&policy.spec.stream, &policy.spec.group);
    let owner = others
        .iter()
        .map(Arc::as_ref)
        .filter(|other| {
            other.metadata.uid != policy.metadata.uid
                && other.metadata.deletion_timestamp.is_none()
                && same_server(other, policy)
                && same_counter_keys(&other.spec, &policy.spec)
                && rank(other) < rank(policy)
        })
        .min_by(|a, b| rank(a).cmp(&rank(b)))?;
    let name = format!("{}/{}", owner.namespace().unwrap_or_default(), owner.name_any());
    let (other_stream, other_group) = (&owner.spec.stream, &owner.spec.group);
    if other_stream == stream && other_group == group {
        Some(Conflict::SameGroup { stream: stream.clone(), group: group.clone(), owner: name })
    } else {
        Some(Conflict::SameKeys {
            key: keys::terminal_key(stream, group),
            owner: name,
            stream: other_stream.clone(),
            group: other_group.clone(),
        })
    }
}

/// Whether two policies name one server, however their URLs are spelled.
fn same_server(a: &ConsumerGroupPolicy, b: &ConsumerGroupPolicy) -> bool {
    (a.spec.redis.url == b.spec.redis.url
        && a.spec.redis.server_ref.is_none()
        && b.spec.redis.server_ref.is_none()
        && a.spec.redis.sentinel == b.spec.redis.sentinel)
        || server_identity(a) == server_identity(b)
}

/// Who is older: creation time, then namespace and name.
fn rank(p: &ConsumerGroupPolicy) -> (Option<k8s_openapi::jiff::Timestamp>, Option<&str>, Option<&str>) {
    (p.metadata.creation_timestamp.as_ref().map(|t| t.0), p.metadata.namespace.as_deref(), p.metadata.name.as_deref())
}

/// Whether two (stream, group) pairs have the same counter key names, `{T}:pelican:<stream>:<group>:...`, compared
/// without building them.
fn same_counter_keys(a: &ConsumerGroupPolicySpec, b: &ConsumerGroupPolicySpec) -> bool {
    fn joined(s: &ConsumerGroupPolicySpec) -> impl Iterator<Item = u8> + '_ {
        s.stream.bytes().chain(std::iter::once(b':')).chain(s.group.bytes())
    }
    a.stream.len() + a.group.len() == b.stream.len() + b.group.len()
        && joined(a).eq(joined(b))
        && keys::hash_tag(&a.stream) == keys::hash_tag(&b.stream)
}

/// The other live policies of the policy's server and stream (one per group).
fn stream_neighbours<'a>(
    policy: &'a ConsumerGroupPolicy,
    others: &'a [Arc<ConsumerGroupPolicy>],
) -> impl Iterator<Item = &'a ConsumerGroupPolicy> {
    others.iter().map(Arc::as_ref).filter(move |other| {
        other.metadata.uid != policy.metadata.uid
            && other.metadata.deletion_timestamp.is_none()
            && same_server(other, policy)
            && other.spec.stream == policy.spec.stream
    })
}

/// The retention that applies to the policy's stream: the most conservative among the live policies of the same
/// server and stream: `None` when any of them says `None`, else the longest `minAge`. With it,
/// the policy that set it when that is not this one.
pub fn effective_retention(
    policy: &ConsumerGroupPolicy,
    own: Option<Duration>,
    others: &[Arc<ConsumerGroupPolicy>],
) -> (Option<Duration>, Option<String>) {
    let mut effective = (own, None);
    for other in stream_neighbours(policy, others) {
        // A policy whose durations do not parse is Stalled and trims nothing; it holds nobody back either.
        let Ok(theirs) = Schedule::from_spec(&other.spec).map(|s| s.retention) else { continue };
        let stricter = match (effective.0, theirs) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(mine), Some(theirs)) => theirs > mine,
        };
        if stricter {
            effective = (theirs, Some(format!("{}/{}", other.namespace().unwrap_or_default(), other.name_any())));
        }
    }
    effective
}

/// The window of idempotent production that applies to the policy's stream: over the live policies of the same
/// server and stream that declare one, the longest duration and the largest size (each may come from another
/// policy), so every policy of the stream converges on the same window and `XCFGSET`, which clears the server's
/// record, runs once rather than back and forth.
pub fn effective_idempotence(
    policy: &ConsumerGroupPolicy,
    own: Option<Window>,
    others: &[Arc<ConsumerGroupPolicy>],
) -> Option<Window> {
    let mut effective = own;
    for other in stream_neighbours(policy, others) {
        let Some(Ok(theirs)) = other.spec.idempotence.as_ref().map(Window::from_spec) else { continue };
        effective = Some(match effective {
            None => theirs,
            Some(mine) => {
                Window { seconds: mine.seconds.max(theirs.seconds), max_size: mine.max_size.max(theirs.max_size) }
            }
        });
    }
    effective
}

/// Whether another policy on the same server has a stream of the same hash tag and the same group name: the 0.1
/// counter keys (`{T}:pelican:<group>:...`) were shared by such policies, so their counts belong to no one of
/// them alone and are not carried over.
pub fn shares_legacy_counters(policy: &ConsumerGroupPolicy, others: &[Arc<ConsumerGroupPolicy>]) -> bool {
    // `{T}:pelican:<group>:...`: the same names exactly when the group and the hash tag are the same.
    others.iter().map(Arc::as_ref).any(|other| {
        other.metadata.uid != policy.metadata.uid
            && other.spec.group == policy.spec.group
            && same_server(other, policy)
            && other.spec.stream != policy.spec.stream
            && keys::hash_tag(&other.spec.stream) == keys::hash_tag(&policy.spec.stream)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;

    fn policy(name: &str, created: i64, stream: &str, group: &str) -> Arc<ConsumerGroupPolicy> {
        let spec = serde_json::from_value(serde_json::json!({
            "redis": {"url": "redis://r:6379/0"},
            "stream": stream, "group": group,
            "deadLetter": {"stream": format!("{stream}:dlq")},
        }))
        .unwrap();
        let mut p = ConsumerGroupPolicy::new(name, spec);
        p.metadata.namespace = Some("apps".into());
        p.metadata.uid = Some(name.into());
        p.metadata.creation_timestamp = Some(Time(Timestamp::from_second(created).unwrap()));
        Arc::new(p)
    }

    #[test]
    fn the_older_policy_owns_the_group() {
        let (old, new) = (policy("old", 1, "s", "g"), policy("new", 2, "s", "g"));
        let others = [old.clone(), new.clone()];
        assert_eq!(conflict(&old, &others), None);
        let message = conflict(&new, &others).unwrap().to_string();
        assert!(message.contains("apps/old"), "{message}");
    }

    #[test]
    fn key_names_joined_with_a_colon_collide() {
        let (old, new) = (policy("old", 1, "{x}a", "b:c"), policy("new", 2, "{x}a:b", "c"));
        let others = [old.clone(), new.clone()];
        let conflict = conflict(&new, &others).unwrap();
        assert!(matches!(conflict, Conflict::SameKeys { .. }), "{conflict:?}");
        assert!(conflict.to_string().contains("{x}:pelican:{x}a:b:c:terminal"), "{conflict}");
    }

    #[test]
    fn streams_sharing_a_tag_do_not_conflict_but_share_legacy_counters() {
        let (a, b) = (policy("a", 1, "{orders}:events", "billing"), policy("b", 2, "{orders}:refunds", "billing"));
        let others = [a.clone(), b.clone()];
        assert_eq!(conflict(&b, &others), None);
        assert!(shares_legacy_counters(&a, &others));
        assert!(!shares_legacy_counters(&a, std::slice::from_ref(&a)));
    }

    fn with_retention(p: Arc<ConsumerGroupPolicy>, retention: serde_json::Value) -> Arc<ConsumerGroupPolicy> {
        let mut p = Arc::unwrap_or_clone(p);
        p.spec.retention = Some(serde_json::from_value(retention).unwrap());
        Arc::new(p)
    }

    fn with_idempotence(p: Arc<ConsumerGroupPolicy>, idempotence: serde_json::Value) -> Arc<ConsumerGroupPolicy> {
        let mut p = (*p).clone();
        p.spec.idempotence = Some(serde_json::from_value(idempotence).unwrap());
        Arc::new(p)
    }

    #[test]
    fn the_widest_idempotence_window_of_a_stream_wins_field_by_field() {
        let own = |p: &ConsumerGroupPolicy| Schedule::from_spec(&p.spec).unwrap().idempotence;
        let a = with_idempotence(policy("a", 1, "s", "g1"), serde_json::json!({"duration": "10m", "maxSize": 100}));
        let b = with_idempotence(policy("b", 2, "s", "g2"), serde_json::json!({"duration": "1m", "maxSize": 5000}));
        let elsewhere =
            with_idempotence(policy("c", 3, "t", "g"), serde_json::json!({"duration": "24h", "maxSize": 1}));
        let plain = policy("d", 4, "s", "g4");
        let all = [a.clone(), b.clone(), elsewhere, plain.clone()];
        let widest = Some(Window { seconds: 600, max_size: 5000 });
        assert_eq!(effective_idempotence(&a, own(&a), &all), widest);
        assert_eq!(effective_idempotence(&b, own(&b), &all), widest);
        // A policy of the stream that declares nothing applies the stream's window too.
        assert_eq!(effective_idempotence(&plain, own(&plain), &all), widest);
        assert_eq!(effective_idempotence(&plain, None, std::slice::from_ref(&plain)), None);
    }

    #[test]
    fn an_idempotence_duration_the_server_cannot_take_is_refused() {
        for duration in ["1500ms", "0s", "25h"] {
            let p =
                with_idempotence(policy("a", 1, "s", "g"), serde_json::json!({"duration": duration, "maxSize": 10}));
            let error = Schedule::from_spec(&p.spec).unwrap_err().to_string();
            assert!(error.contains("spec.idempotence.duration") && error.contains("from 1s to 24h"), "{error}");
        }
    }

    #[test]
    fn the_most_conservative_retention_of_a_stream_wins() {
        let own = |p: &ConsumerGroupPolicy| Schedule::from_spec(&p.spec).unwrap().retention;
        let a = with_retention(policy("a", 1, "s", "g1"), serde_json::json!({"mode": "Acknowledged", "minAge": "1m"}));
        let b = with_retention(policy("b", 2, "s", "g2"), serde_json::json!({"mode": "Acknowledged", "minAge": "10m"}));
        let c = policy("c", 3, "s", "g3");
        let elsewhere = policy("d", 4, "other", "g");
        let only_a = [a.clone(), elsewhere.clone()];
        assert_eq!(effective_retention(&a, own(&a), &only_a), (Some(Duration::from_secs(60)), None));
        let a_b = [a.clone(), b.clone()];
        assert_eq!(effective_retention(&a, own(&a), &a_b), (Some(Duration::from_secs(600)), Some("apps/b".into())));
        assert_eq!(effective_retention(&b, own(&b), &a_b), (Some(Duration::from_secs(600)), None));
        let all = [a.clone(), b.clone(), c.clone()];
        assert_eq!(effective_retention(&a, own(&a), &all), (None, Some("apps/c".into())));
        assert_eq!(effective_retention(&c, own(&c), &all), (None, None));
    }

    #[test]
    fn cluster_keys_must_share_the_streams_slot() {
        let mut p = Arc::unwrap_or_clone(policy("p", 1, "a}b", "g"));
        assert_eq!(same_slot(&p.spec).unwrap_err().reason(), "CrossSlot");
        p.spec.stream = "{orders}:events".into();
        p.spec.dead_letter.stream = "{orders}:dlq".into();
        assert!(same_slot(&p.spec).is_ok());
        p.spec.dead_letter.stream = "orders-dlq".into();
        assert!(same_slot(&p.spec).unwrap_err().to_string().contains("{orders}:dlq"));
        p.spec.stream = "orders".into();
        p.spec.partitions = Some(8);
        assert!(same_slot(&p.spec).is_ok(), "each partition has a dead-letter stream in its own slot");
    }

    #[test]
    fn ordering_per_key_runs_the_passes_as_dead_letter_only() {
        let mut p = Arc::unwrap_or_clone(policy("p", 1, "orders", "g"));
        p.spec.partitions = Some(4);
        p.spec.reclaim.strategy = ReclaimStrategy::Reassign;
        assert_eq!(Schedule::from_spec(&p.spec).unwrap().pass.strategy, ReclaimStrategy::Reassign);
        p.spec.ordering = Ordering::PerKey;
        assert_eq!(Schedule::from_spec(&p.spec).unwrap().pass.strategy, ReclaimStrategy::DeadLetterOnly);
    }
}
