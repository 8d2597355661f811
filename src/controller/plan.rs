//! Phase 3a, plan: what converging a policy means, decided without IO from what the spec says, what the other
//! policies of the stream say and what the server showed. [`super::act`] gathers those facts, runs the plan and
//! publishes what it announces; everything here is tested with plain `#[test]`s.

use std::sync::Arc;
use std::time::Duration;

use kube::runtime::events::EventType;

use super::validate::{self, Schedule, Window};
use crate::api::{ConsumerGroupPolicy, IdempotenceStatus};
use crate::jobs::PassSettings;
use crate::keys;
use crate::redis::GroupSetup;

/// An Event (and log line) a step of the plan announces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Announcement {
    pub type_: EventType,
    pub reason: &'static str,
    pub note: String,
}

/// A status that shows server numbers means the policy saw its group before, whatever its condition is now.
pub fn seen_before(policy: &ConsumerGroupPolicy) -> bool {
    policy.status.as_ref().is_some_and(|s| s.server_version.is_some())
}

/// Whether the 0.1 counters are carried over now: from the second reconcile on, never the first (policies applied
/// together reach the watch one by one, and the first reconcile of one may run before its neighbours are known),
/// and never when another policy shares the 0.1 key names.
pub fn carry_over(policy: &ConsumerGroupPolicy, others: &[Arc<ConsumerGroupPolicy>]) -> bool {
    seen_before(policy) && !validate::shares_legacy_counters(policy, others)
}

/// What setting the group up announces: counters carried over, and a group created. A group created for a policy
/// that saw it before was lost (recreating it at `startId` may skip or replay messages): a Warning every time.
pub fn setup_announcements(policy: &ConsumerGroupPolicy, setup: &GroupSetup) -> Vec<Announcement> {
    let (stream, group, start) = (&policy.spec.stream, &policy.spec.group, &policy.spec.start_id);
    let on = match policy.spec.partitions {
        Some(count) => format!("the {count} partitions of topic {stream:?}"),
        None => format!("stream {stream:?}"),
    };
    let mut said = Vec::new();
    if setup.carried_over > 0 {
        let [totals, terminal] = keys::legacy_keys(stream, group);
        let note = format!(
            "carried {} counter fields over from {totals:?} and {terminal:?} to the keys that name the stream",
            setup.carried_over
        );
        said.push(Announcement { type_: EventType::Normal, reason: "CountersCarriedOver", note });
    }
    if setup.created {
        said.push(if seen_before(policy) {
            let note = format!("group {group:?} on {on} was missing and has been recreated at {start:?}");
            Announcement { type_: EventType::Warning, reason: "GroupRecreated", note }
        } else {
            let note = format!("created group {group:?} on {on} at {start:?}");
            Announcement { type_: EventType::Normal, reason: "GroupCreated", note }
        });
    }
    said
}

/// The streams the policy's group lives on: its stream, or each partition of its topic (SPEC 22).
pub fn streams(policy: &ConsumerGroupPolicy) -> Vec<String> {
    match policy.spec.partitions {
        Some(count) => (0..count).map(|i| keys::partition_stream(&policy.spec.stream, i)).collect(),
        None => vec![policy.spec.stream.clone()],
    }
}

/// The dead-letter stream of one of the policy's streams: `spec.deadLetter.stream`, one for a whole topic; on a
/// Cluster, a partition's own `{<topic>:<i>}:<deadLetter.stream>`, since a pass moves an entry to its dead-letter
/// stream in one script, which a Cluster runs only on keys of one slot.
pub fn dead_letter_of(policy: &ConsumerGroupPolicy, stream: &str, cluster: bool) -> String {
    match policy.spec.partitions {
        Some(_) if cluster => format!("{stream}:{}", policy.spec.dead_letter.stream),
        _ => policy.spec.dead_letter.stream.clone(),
    }
}

/// What the stream's window of idempotent production (`spec.idempotence`) comes to on the server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Idempotence {
    /// No policy of the stream declares a window: the server's stays as it is.
    Undeclared,
    /// The server has no `XADD ... IDMP` (Redis before 8.6, Valkey up to 9.1).
    Unsupported,
    /// The server's window is the declared one.
    Applied(Window),
    /// The server's window differs (or it does not say): `XCFGSET`, which clears its record of producers and
    /// message ids.
    Set(Window),
    /// `XCFGSET` failed (an ACL without `+xcfgset`, say): the server's message.
    Refused(Window, String),
}

/// What to do about the window: `effective` is what the policies of the stream declare
/// ([`validate::effective_idempotence`]), `server` what `XINFO STREAM` showed.
pub fn idempotence(effective: Option<Window>, server: Option<&IdempotenceStatus>, has_idmp: bool) -> Idempotence {
    match effective {
        None => Idempotence::Undeclared,
        Some(_) if !has_idmp => Idempotence::Unsupported,
        Some(window) => match server {
            Some(now) if (now.duration_seconds, now.max_size) == (window.seconds, window.max_size) => {
                Idempotence::Applied(window)
            }
            _ => Idempotence::Set(window),
        },
    }
}

/// What setting the window announces.
pub fn idempotence_announcement(stream: &str, window: Window, before: Option<&IdempotenceStatus>) -> Announcement {
    let was = before.map_or_else(String::new, |b| {
        format!(" (was {} s, {} per producer; {} message ids forgotten)", b.duration_seconds, b.max_size, b.message_ids)
    });
    let note = format!(
        "set the idempotence window of stream {stream:?} to {} s and {} message ids per producer{was}: XCFGSET clears \
         the server's record of producers and message ids, so a publish retried across this change can duplicate",
        window.seconds, window.max_size
    );
    Announcement { type_: EventType::Normal, reason: "IdempotenceWindowSet", note }
}

/// The window set on `set` of a topic's `count` partitions, said once for the topic.
pub fn topic_idempotence_announcement(topic: &str, count: u32, set: usize, window: Window) -> Announcement {
    let note = format!(
        "set the idempotence window of {set} of the {count} partitions of topic {topic:?} to {} s and {} message ids \
         per producer: XCFGSET clears the server's record of producers and message ids, so a publish retried across \
         this change can duplicate",
        window.seconds, window.max_size
    );
    Announcement { type_: EventType::Normal, reason: "IdempotenceWindowSet", note }
}

/// The work of the policy's jobs; `None` in [`Jobs::work`] stops them (suspended).
#[derive(Clone, Debug, PartialEq)]
pub struct Jobs {
    pub work: Option<Work>,
    /// The stream's effective retention in words, for status, when this policy or a neighbour sets one.
    pub retention_note: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Work {
    pub interval: Duration,
    pub pass: PassSettings,
    pub expire_after: Option<Duration>,
    /// `minAge` when the stream's effective retention is `Acknowledged`; `None`: never trim.
    pub retention: Option<Duration>,
}

/// The jobs the runner should run for the policy, with the most conservative retention of its stream.
pub fn jobs(policy: &ConsumerGroupPolicy, schedule: &Schedule, others: &[Arc<ConsumerGroupPolicy>]) -> Jobs {
    let (retention, set_by) = validate::effective_retention(policy, schedule.retention, others);
    let retention_note = (policy.spec.retention.is_some() || set_by.is_some()).then(|| {
        let mode = match retention {
            Some(min_age) => format!("Acknowledged, minAge {}", humantime::format_duration(min_age)),
            None => "None".to_string(),
        };
        match set_by {
            Some(owner) => format!("{mode} (the most conservative on the stream, from ConsumerGroupPolicy {owner})"),
            None => mode,
        }
    });
    let work = (!policy.spec.suspend).then(|| Work {
        interval: schedule.interval,
        pass: schedule.pass.clone(),
        expire_after: schedule.expire_after,
        retention,
    });
    Jobs { work, retention_note }
}

/// How the group's field of the bounds hash must change: `Some(Some(max))` write it, `Some(None)` remove it, `None`
/// leave it. Written only when it differs from the spec (set, changed, removed, or changed out of band), never on
/// every reconcile.
pub fn bound_change(policy: &ConsumerGroupPolicy, stored: Option<&str>) -> Option<Option<i64>> {
    let bound = policy.spec.backlog.as_ref().map(|b| b.max_length);
    (stored != bound.map(|max| max.to_string()).as_deref()).then_some(bound)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ConsumerGroupPolicyStatus;
    use crate::redis::ServerInfo;

    fn policy(extra: serde_json::Value) -> ConsumerGroupPolicy {
        let mut spec = serde_json::json!({
            "redis": {"url": "redis://r:6379/0"}, "stream": "orders", "group": "billing", "startId": "0",
            "deadLetter": {"stream": "orders:dlq"},
        });
        spec.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let mut p = ConsumerGroupPolicy::new("p", serde_json::from_value(spec).unwrap());
        p.metadata.namespace = Some("apps".into());
        p.metadata.uid = Some("uid-p".into());
        p
    }

    fn seen(mut p: ConsumerGroupPolicy) -> ConsumerGroupPolicy {
        p.status =
            Some(ConsumerGroupPolicyStatus { server_version: Some("redis 7.0.15".into()), ..Default::default() });
        p
    }

    fn setup(created: bool, carried_over: u64) -> GroupSetup {
        GroupSetup { server: ServerInfo { flavor: "redis", version: "7.0.15".into() }, created, carried_over }
    }

    #[test]
    fn a_group_created_first_is_normal_and_recreated_later_is_a_warning() {
        let first = setup_announcements(&policy(serde_json::json!({})), &setup(true, 0));
        assert_eq!((first.len(), first[0].type_, first[0].reason), (1, EventType::Normal, "GroupCreated"));
        assert_eq!(first[0].note, "created group \"billing\" on stream \"orders\" at \"0\"");
        let again = setup_announcements(&seen(policy(serde_json::json!({}))), &setup(true, 0));
        assert_eq!((again[0].type_, again[0].reason), (EventType::Warning, "GroupRecreated"));
        assert!(setup_announcements(&seen(policy(serde_json::json!({}))), &setup(false, 0)).is_empty());
        let carried = setup_announcements(&seen(policy(serde_json::json!({}))), &setup(false, 3));
        assert_eq!(carried[0].reason, "CountersCarriedOver");
        assert!(carried[0].note.starts_with("carried 3 counter fields over from"), "{}", carried[0].note);
    }

    #[test]
    fn counters_are_carried_over_from_the_second_reconcile_and_never_when_shared() {
        let p = policy(serde_json::json!({"stream": "{o}:in"}));
        assert!(!carry_over(&p, &[]), "the first reconcile never carries over");
        let p = seen(p);
        assert!(carry_over(&p, &[]));
        // Another policy of the same group on another stream of the same hash tag shares the 0.1 names.
        let mut other = policy(serde_json::json!({"stream": "{o}:out", "deadLetter": {"stream": "{o}:dlq"}}));
        other.metadata.uid = Some("uid-other".into());
        assert!(!carry_over(&p, &[Arc::new(other)]));
    }

    #[test]
    fn suspended_stops_the_jobs_and_retention_is_said_in_words() {
        let p = policy(serde_json::json!({"suspend": true}));
        let schedule = Schedule::from_spec(&p.spec).unwrap();
        let planned = jobs(&p, &schedule, &[]);
        assert_eq!((planned.work, planned.retention_note), (None, None));
        let p = policy(serde_json::json!({"retention": {"mode": "Acknowledged", "minAge": "90s"}}));
        let schedule = Schedule::from_spec(&p.spec).unwrap();
        let planned = jobs(&p, &schedule, &[]);
        assert_eq!(planned.work.unwrap().retention, Some(Duration::from_secs(90)));
        assert_eq!(planned.retention_note.as_deref(), Some("Acknowledged, minAge 1m 30s"));
    }

    #[test]
    fn the_bound_is_written_only_when_it_differs() {
        let bounded = policy(serde_json::json!({"backlog": {"maxLength": 100}}));
        assert_eq!(bound_change(&bounded, Some("100")), None);
        assert_eq!(bound_change(&bounded, None), Some(Some(100)));
        assert_eq!(bound_change(&bounded, Some("1000000")), Some(Some(100)), "raised out of band: put back");
        let unbounded = policy(serde_json::json!({}));
        assert_eq!(bound_change(&unbounded, Some("100")), Some(None));
        assert_eq!(bound_change(&unbounded, None), None);
    }

    #[test]
    fn the_window_is_set_only_when_the_server_has_another() {
        let window = Window { seconds: 600, max_size: 1000 };
        let server =
            |seconds, max_size| IdempotenceStatus { duration_seconds: seconds, max_size, ..Default::default() };
        assert_eq!(idempotence(None, Some(&server(100, 100)), true), Idempotence::Undeclared);
        assert_eq!(idempotence(Some(window), None, false), Idempotence::Unsupported);
        assert_eq!(idempotence(Some(window), Some(&server(600, 1000)), true), Idempotence::Applied(window));
        assert_eq!(idempotence(Some(window), Some(&server(600, 100)), true), Idempotence::Set(window));
        assert_eq!(idempotence(Some(window), None, true), Idempotence::Set(window));
    }

    #[test]
    fn a_topic_has_a_stream_per_partition_and_on_a_cluster_a_dead_letter_stream_per_partition() {
        let plain = policy(serde_json::json!({}));
        assert_eq!(streams(&plain), ["orders"]);
        assert_eq!(dead_letter_of(&plain, "orders", true), "orders:dlq");
        let topic = policy(serde_json::json!({"partitions": 3}));
        assert_eq!(streams(&topic), ["{orders:0}", "{orders:1}", "{orders:2}"]);
        assert_eq!(dead_letter_of(&topic, "{orders:1}", false), "orders:dlq", "one for the topic");
        let own = dead_letter_of(&topic, "{orders:1}", true);
        assert_eq!(own, "{orders:1}:orders:dlq");
        assert_eq!(keys::slot(&own), keys::slot("{orders:1}"));
    }
}
