//! Pure status building: "what Redis reports + what happened" -> the status to write.
//! No IO here, so every rule is a plain unit test.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;

use super::plan::Idempotence;
use crate::Error;
use crate::api::{
    ConsumerGroupPolicy, ConsumerGroupPolicySpec, ConsumerGroupPolicyStatus, ReclaimStrategy, TerminalAckCount, Totals,
};
use crate::context::conditions::{Said, Verdict, condition, verdict_conditions};
use crate::redis::{Backlog, GroupFacts, ServerInfo};
use crate::runner::{JobFailure, JobKind};

pub use crate::api::{IDEMPOTENT, READY, SATURATED};

/// How the last reconcile ended, as far as conditions are concerned.
pub enum Outcome<'a> {
    Ready {
        message: String,
    },
    /// The error, and its message as the policy's conditions say it ([`failure_message`]).
    Failed(&'a Error, String),
    /// The group is set up, but a job of the runner fails: its reason and message, and the runner goes on.
    JobFailed(JobKind, &'a JobFailure),
}

/// Status numbers from the probe. Counters missing in Redis (a reset, or nothing counted yet) read as 0.
pub fn observed(
    previous: &ConsumerGroupPolicyStatus,
    server: &ServerInfo,
    facts: &GroupFacts,
) -> ConsumerGroupPolicyStatus {
    let total = |name: &str| facts.totals.get(name).copied().unwrap_or(0);
    let oldest_millis = facts.oldest_pending.as_ref().and_then(|o| o.id_millis());
    // Redis 7.0 overstates the lag after a trim or XDEL; entries not yet delivered can never outnumber the stream.
    let lag = facts.lag.map(|lag| lag.min(facts.stream_length));
    let backlog = Backlog::of(facts);
    ConsumerGroupPolicyStatus {
        server_version: Some(server.to_string()),
        stream_length: Some(facts.stream_length),
        lag,
        pending: Some(facts.pending),
        // The bounded publish script's number: when the server cannot tell the lag, every entry of the stream
        // counts as unread (an upper bound), so status and producers never disagree about being full.
        backlog: Some(backlog.total()),
        oldest_pending_id: facts.oldest_pending.as_ref().map(|o| o.id.clone()),
        oldest_pending_time: oldest_millis.and_then(format_millis),
        // An entry NACKed on Redis 8.8 (`XNACK`) is pending with consumer "" and idle -1 until read again: idle 0.
        oldest_pending_idle_seconds: facts.oldest_pending.as_ref().map(|o| o.idle_ms.max(0) / 1000),
        oldest_unread_time: facts.oldest_unread_ms.and_then(format_millis),
        lag_seconds: Some(facts.lag_seconds()),
        consumers: Some(facts.consumers),
        dead_letter_length: Some(facts.dead_letter_length),
        totals: Some(Totals {
            requeued: total("requeued"),
            reassigned: total("reassigned"),
            dead_lettered: total("deadLettered"),
            payload_deleted: total("payloadDeleted"),
            consumers_expired: total("consumersExpired"),
            dead_letter_evicted: total("deadLetterEvicted"),
            publish_rejected: facts.publish_rejected,
            trimmed: total("trimmed"),
        }),
        terminal_acks: top_reasons(&facts.terminal),
        ..previous.clone()
    }
}

/// The most reason codes `status.terminalAcks` (and the metric's series) list; the rest are summed as `Other`.
/// Reasons are data any client writes: without a cap, thousands of them make the status too large to write, and
/// the policy's numbers and Ready freeze.
pub const TERMINAL_REASONS_SHOWN: usize = 20;
/// The reason the codes past [`TERMINAL_REASONS_SHOWN`] are counted under.
pub const OTHER_REASONS: &str = "Other";

/// The [`TERMINAL_REASONS_SHOWN`] largest counts (ties by name), and `Other` for the rest (with any `Other` the
/// hash holds itself), sorted by reason.
fn top_reasons(terminal: &std::collections::BTreeMap<String, i64>) -> Vec<TerminalAckCount> {
    let mut counts: Vec<(&String, i64)> =
        terminal.iter().filter(|(reason, _)| *reason != OTHER_REASONS).map(|(r, c)| (r, *c)).collect();
    counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
    let rest = counts.split_off(counts.len().min(TERMINAL_REASONS_SHOWN));
    let other = terminal.get(OTHER_REASONS).copied().unwrap_or(0) + rest.iter().map(|(_, c)| c).sum::<i64>();
    let mut shown: Vec<TerminalAckCount> =
        counts.into_iter().map(|(reason, count)| TerminalAckCount { reason: reason.clone(), count }).collect();
    if other > 0 || terminal.contains_key(OTHER_REASONS) {
        shown.push(TerminalAckCount { reason: OTHER_REASONS.into(), count: other });
    }
    shown.sort_by(|a, b| a.reason.cmp(&b.reason));
    shown
}

/// With `strategy: Requeue`, the stream's other groups, sorted and comma-separated: each of them also reads every
/// requeued copy.
pub fn requeue_copies_to(spec: &ConsumerGroupPolicySpec, facts: &GroupFacts) -> Option<String> {
    if spec.reclaim.strategy != ReclaimStrategy::Requeue || facts.other_groups.is_empty() {
        return None;
    }
    let mut others = facts.other_groups.clone();
    others.sort();
    Some(others.join(","))
}

/// Whether `next` differs from what the API holds in a value a person acts on: counts,
/// conditions, the oldest pending and unread entries, the generation. The ages (the oldest pending entry's idle
/// time, the lag in seconds), the rates, the drain time and the time of the last pass change with every look and are
/// written along with such a change, never on their own: each write would cost the API server a request per policy
/// per interval for nothing a person acts on (10,000 groups with an unread entry wrote 165 statuses a second when
/// the lag in seconds was written as it grew). The times they derive from (`oldestPendingTime`, `oldestUnreadTime`)
/// do not change with the clock, and `kubectl get` shows their age.
pub fn worth_writing(current: Option<&ConsumerGroupPolicyStatus>, next: &ConsumerGroupPolicyStatus) -> bool {
    let Some(current) = current else {
        return true;
    };
    // The first pass is news (has any pass run?); its time moving on is not.
    let timeless = |s: &ConsumerGroupPolicyStatus| ConsumerGroupPolicyStatus {
        oldest_pending_idle_seconds: None,
        last_pass_time: s.last_pass_time.as_ref().map(|_| String::new()),
        lag_seconds: None,
        rates: None,
        drain_seconds: None,
        ..s.clone()
    };
    timeless(current) != timeless(next)
}

/// The `Saturated` condition when the policy bounds its backlog: True while the backlog is at the bound, judged on
/// the number the bounded publish script uses (the stream's length for the lag when the server cannot tell it).
/// A backlog never read yet keeps the last known state. No condition without a bound.
pub fn saturated(
    previous: &[Condition],
    status: &ConsumerGroupPolicyStatus,
    max_length: Option<i64>,
    generation: Option<i64>,
    now: Timestamp,
) -> Option<Condition> {
    let max = max_length?;
    let old = previous.iter().find(|c| c.type_ == SATURATED);
    // On a topic the bound is each partition's: the fullest one says whether any producer is refused.
    let (of, value) = match &status.partitions {
        Some(topic) => match &topic.largest_backlog {
            Some(fullest) => (format!("partition {}'s ", fullest.partition), Some(fullest.backlog)),
            None => (String::new(), None),
        },
        None => (String::new(), status.backlog),
    };
    let backlog = |b: i64| match status.lag {
        Some(_) => format!("{of}backlog {b}"),
        None => format!(
            "{of}backlog {b} (an upper bound: the server cannot tell the lag until the group reads the stream's last \
             entry)"
        ),
    };
    let (status, reason, message) = match value {
        Some(b) if b >= max && !of.is_empty() => (
            "True",
            "BacklogFull",
            format!(
                "{} is at spec.backlog.maxLength {max} (a bound per partition): bounded publishes to it are refused",
                backlog(b)
            ),
        ),
        Some(b) if b >= max => (
            "True",
            "BacklogFull",
            format!("{} is at spec.backlog.maxLength {max}: bounded publishes are refused", backlog(b)),
        ),
        Some(b) => ("False", "BacklogBelowBound", format!("{} is below spec.backlog.maxLength {max}", backlog(b))),
        None => match old {
            Some(old) => return Some(Condition { observed_generation: generation, ..old.clone() }),
            None => {
                ("Unknown", "BacklogUnknown", "the group's backlog has not been read from the server yet".to_string())
            }
        },
    };
    Some(condition(previous, Said { type_: SATURATED, status, reason, message }, generation, now))
}

/// The `Idempotent` condition when a policy of the stream declares `spec.idempotence`: True when the server's window
/// is the declared one, False when the server has no `XADD ... IDMP` or refused `XCFGSET`. None otherwise.
pub fn idempotent(
    previous: &[Condition],
    verdict: &Idempotence,
    version: &str,
    generation: Option<i64>,
    now: Timestamp,
) -> Option<Condition> {
    let (status, reason, message) = match verdict {
        Idempotence::Undeclared => return None,
        Idempotence::Applied(w) | Idempotence::Set(w) => (
            "True",
            "WindowApplied",
            format!("the server remembers each producer's last {} message ids for {} s", w.max_size, w.seconds),
        ),
        Idempotence::Unsupported => (
            "False",
            "ServerWithoutIdmp",
            format!(
                "{version} has no XADD ... IDMP (Redis 8.6 or later): spec.idempotence is not applied and a retried \
                 publish can duplicate; everything else of the policy works"
            ),
        ),
        Idempotence::Refused(w, error) => (
            "False",
            "WindowNotSet",
            format!(
                "XCFGSET of {} s and {} message ids per producer failed: {error} (the operator's ACL user needs \
                 +xcfgset on Redis 8.6)",
                w.seconds, w.max_size
            ),
        ),
    };
    Some(condition(previous, Said { type_: IDEMPOTENT, status, reason, message }, generation, now))
}

/// Age in seconds of the oldest pending entry: server time minus the millisecond part of its id.
pub fn oldest_pending_age_seconds(facts: &GroupFacts) -> Option<i64> {
    let millis = facts.oldest_pending.as_ref()?.id_millis()?;
    Some((facts.server_time_ms - millis).max(0) / 1000)
}

fn format_millis(millis: i64) -> Option<String> {
    Timestamp::from_second(millis.div_euclid(1000)).ok().map(|t| t.to_string())
}

/// A failure's message as the policy's conditions say it. The connection errors name the inline fields
/// (`spec.redis.tls`, `spec.redis.url`, ...); a policy that names a `RedisServer` has none: there they are that
/// server's fields (`RedisServer platform/shared: spec.tls`), where whoever fixes them must look.
pub fn failure_message(policy: &ConsumerGroupPolicy, error: &Error) -> String {
    let message = error.to_string();
    let Some((namespace, name)) = policy.server_ref() else { return message };
    let theirs = format!("RedisServer {namespace}/{name}: spec.");
    let mut parts = message.split("spec.redis.");
    let mut said = parts.next().unwrap_or_default().to_string();
    for part in parts {
        said += if part.starts_with("serverRef") { "spec.redis." } else { &theirs };
        said += part;
    }
    said
}

/// Ready / Reconciling / Stalled in the shape kstatus (Flux, kpt) and Argo CD read:
/// success -> Ready=True; terminal error -> Stalled=True; transient error -> Reconciling=True (retrying).
pub fn conditions(
    previous: &[Condition],
    outcome: &Outcome,
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    let verdict = match outcome {
        Outcome::Ready { message } => Verdict::Ready(message.clone()),
        Outcome::Failed(error, message) => {
            Verdict::Failed { reason: error.reason(), message: message.clone(), stalled: error.is_stalled() }
        }
        Outcome::JobFailed(job, failure) => Verdict::Failed {
            reason: failure.reason,
            message: format!("the {} job failed: {}", job.name(), failure.message),
            stalled: failure.stalled,
        },
    };
    verdict_conditions(previous, verdict, generation, now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{RECONCILING, STALLED};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    #[test]
    fn status_is_not_rewritten_because_time_passed() {
        let before = ConsumerGroupPolicyStatus {
            pending: Some(4),
            oldest_pending_idle_seconds: Some(10),
            last_pass_time: Some("2026-11-29T13:05:10Z".into()),
            ..Default::default()
        };
        let later = ConsumerGroupPolicyStatus {
            oldest_pending_idle_seconds: Some(70),
            last_pass_time: Some("2026-11-29T13:06:10Z".into()),
            ..before.clone()
        };
        assert!(!worth_writing(Some(&before), &later));
        let moved = ConsumerGroupPolicyStatus { pending: Some(3), ..later.clone() };
        assert!(worth_writing(Some(&before), &moved));
        assert!(worth_writing(None, &later));
        // Nor the lag in seconds, nor the rates: they change with every look.
        let lagging = |s: i64| ConsumerGroupPolicyStatus { lag_seconds: Some(s), ..before.clone() };
        assert!(!worth_writing(Some(&lagging(60)), &lagging(120)));
        let rated = ConsumerGroupPolicyStatus { rates: Some(crate::api::Rates::default()), ..lagging(5) };
        assert!(!worth_writing(Some(&lagging(5)), &rated), "rates alone are not written");
    }

    /// Defect (CI): a status written before the first pass (a job failing at once, say) never showed a pass time,
    /// since the time was not worth a write and nothing else changed after.
    #[test]
    fn the_first_pass_is_written_though_its_time_alone_is_not() {
        let before = ConsumerGroupPolicyStatus { pending: Some(0), ..Default::default() };
        let passed =
            ConsumerGroupPolicyStatus { last_pass_time: Some("2026-12-06T21:18:23Z".into()), ..before.clone() };
        assert!(worth_writing(Some(&before), &passed));
    }
    use crate::redis::OldestPending;

    fn facts() -> GroupFacts {
        GroupFacts {
            has_group: true,
            stream_length: 10,
            lag: None,
            pending: 4,
            oldest_pending: Some(OldestPending {
                id: "1764421200000-0".into(),
                consumer: "c1".into(),
                idle_ms: 310_500,
                deliveries: 2,
            }),
            consumers: 2,
            dead_letter_length: 1,
            totals: [("deadLettered".to_string(), 1)].into(),
            terminal: [("RecordNotFound".to_string(), 40)].into(),
            publish_rejected: 0,
            bound: None,
            other_groups: vec!["search".into(), "audit".into()],
            server_time_ms: 1_764_421_200_000 + 90_000,
            entries_added: Some(40),
            idempotence: None,
            entries_read: None,
            oldest_unread_ms: Some(1_764_421_200_000 + 30_500),
            unread: None,
        }
    }

    #[test]
    fn requeue_names_the_other_groups_that_get_copies() {
        let mut spec: ConsumerGroupPolicySpec = serde_json::from_value(serde_json::json!({
            "redis": {"url": "redis://r:6379/0"}, "stream": "s", "group": "g", "deadLetter": {"stream": "d"},
        }))
        .unwrap();
        assert_eq!(requeue_copies_to(&spec, &facts()).as_deref(), Some("audit,search"));
        assert_eq!(requeue_copies_to(&spec, &GroupFacts { other_groups: vec![], ..facts() }), None);
        spec.reclaim.strategy = ReclaimStrategy::Reassign;
        assert_eq!(requeue_copies_to(&spec, &facts()), None);
    }

    fn valkey() -> ServerInfo {
        ServerInfo { flavor: "valkey", version: "9.1.2".into() }
    }

    #[test]
    fn status_mirrors_the_probe() {
        let status = observed(&ConsumerGroupPolicyStatus::default(), &valkey(), &facts());
        assert_eq!(status.server_version.as_deref(), Some("valkey 9.1.2"));
        assert_eq!(status.pending, Some(4));
        assert_eq!(status.oldest_pending_time.as_deref(), Some("2025-11-29T13:00:00Z"));
        assert_eq!(status.oldest_pending_idle_seconds, Some(310));
        assert_eq!(status.totals.unwrap().dead_lettered, 1);
        assert_eq!(status.terminal_acks, vec![TerminalAckCount { reason: "RecordNotFound".into(), count: 40 }]);
        assert_eq!(oldest_pending_age_seconds(&facts()), Some(90));
        assert_eq!(status.oldest_unread_time.as_deref(), Some("2025-11-29T13:00:30Z"));
        assert_eq!(status.lag_seconds, Some(59));
        let caught_up = GroupFacts { oldest_unread_ms: None, ..facts() };
        let status = observed(&ConsumerGroupPolicyStatus::default(), &valkey(), &caught_up);
        assert_eq!((status.oldest_unread_time, status.lag_seconds), (None, Some(0)));
    }

    /// `XPENDING` after `XNACK` (Redis 8.8, as its documentation gives it): the entry has consumer `""` and idle
    /// `-1`. No negative age, no error.
    #[test]
    fn a_nacked_entry_reads_as_idle_zero_with_no_consumer() {
        let reply = redis::Value::Array(vec![redis::Value::Array(vec![
            redis::Value::BulkString(b"1764421200000-0".to_vec()),
            redis::Value::BulkString(b"".to_vec()),
            redis::Value::Int(-1),
            redis::Value::Int(3),
        ])]);
        let entries: Vec<(String, String, i64, i64)> = redis::from_redis_value(reply).unwrap();
        let (id, consumer, idle_ms, deliveries) = entries[0].clone();
        let nacked =
            GroupFacts { oldest_pending: Some(OldestPending { id, consumer, idle_ms, deliveries }), ..facts() };
        let status = observed(&ConsumerGroupPolicyStatus::default(), &valkey(), &nacked);
        assert_eq!(status.oldest_pending_idle_seconds, Some(0));
        assert_eq!(oldest_pending_age_seconds(&nacked), Some(90));
    }

    #[test]
    fn past_twenty_reasons_the_smallest_are_summed_as_other() {
        let mut terminal: std::collections::BTreeMap<String, i64> =
            (0..5000).map(|i| (format!("Reason{i:04}"), 1)).collect();
        terminal.insert("RecordNotFound".into(), 900);
        terminal.insert("Other".into(), 7);
        let shown = top_reasons(&terminal);
        assert_eq!(shown.len(), TERMINAL_REASONS_SHOWN + 1);
        assert!(shown.contains(&TerminalAckCount { reason: "RecordNotFound".into(), count: 900 }));
        // 19 of the 5,000 ones are shown (the first by name); the other 4,981 and the hash's own 7 are Other.
        assert!(shown.contains(&TerminalAckCount { reason: "Other".into(), count: 4981 + 7 }), "{shown:?}");
        assert!(shown.contains(&TerminalAckCount { reason: "Reason0018".into(), count: 1 }));
        assert!(!shown.iter().any(|t| t.reason == "Reason0019"));
        let few: std::collections::BTreeMap<String, i64> = [("A".to_string(), 1), ("B".to_string(), 2)].into();
        let names: Vec<_> = top_reasons(&few).into_iter().map(|t| t.reason).collect();
        assert_eq!(names, ["A", "B"], "no Other when nothing is left out");
    }

    #[test]
    fn lag_the_server_cannot_tell_is_omitted_not_zero() {
        let status = observed(&ConsumerGroupPolicyStatus::default(), &valkey(), &facts());
        assert_eq!(status.lag, None);
        let json = serde_json::to_value(&status).unwrap();
        assert!(json.get("lag").is_none(), "{json}");
    }

    #[test]
    fn lag_never_exceeds_the_stream_length() {
        let trimmed = GroupFacts { lag: Some(5_000), stream_length: 1_000, ..facts() };
        let status = observed(&ConsumerGroupPolicyStatus::default(), &valkey(), &trimmed);
        assert_eq!(status.lag, Some(1_000));
    }

    #[test]
    fn empty_pel_has_no_oldest_entry() {
        let mut empty = facts();
        empty.pending = 0;
        empty.oldest_pending = None;
        let status = observed(&ConsumerGroupPolicyStatus::default(), &valkey(), &empty);
        assert_eq!((status.oldest_pending_id, status.oldest_pending_time), (None, None));
    }

    #[test]
    fn saturated_follows_the_backlog_and_keeps_its_transition_time() {
        let t0 = Timestamp::UNIX_EPOCH;
        let t1 = Timestamp::from_second(100).unwrap();
        let with = |backlog: Option<i64>| ConsumerGroupPolicyStatus { backlog, lag: Some(0), ..Default::default() };
        assert_eq!(saturated(&[], &with(Some(5)), None, Some(1), t0), None);
        let full = saturated(&[], &with(Some(10_000)), Some(10_000), Some(1), t0).unwrap();
        assert_eq!((full.status.as_str(), full.reason.as_str()), ("True", "BacklogFull"));
        let still = saturated(std::slice::from_ref(&full), &with(Some(10_001)), Some(10_000), Some(1), t1).unwrap();
        assert_eq!(still.last_transition_time, Time(t0));
        let unknown = saturated(std::slice::from_ref(&full), &with(None), Some(10_000), Some(2), t1).unwrap();
        assert_eq!((unknown.status.as_str(), unknown.observed_generation), ("True", Some(2)));
        let cleared = saturated(std::slice::from_ref(&full), &with(Some(9_999)), Some(10_000), Some(2), t1).unwrap();
        assert_eq!((cleared.status.as_str(), cleared.last_transition_time.clone()), ("False", Time(t1)));
    }

    #[test]
    fn backlog_is_lag_plus_pending_or_the_stream_without_lag() {
        // As the bounded publish script counts: the whole stream is unread when the lag is unknown.
        let status = observed(&ConsumerGroupPolicyStatus::default(), &valkey(), &facts());
        assert_eq!((status.lag, status.backlog), (None, Some(facts().stream_length + facts().pending)));
        let full = saturated(&[], &status, Some(status.backlog.unwrap()), Some(1), Timestamp::UNIX_EPOCH).unwrap();
        assert_eq!((full.status.as_str(), full.reason.as_str()), ("True", "BacklogFull"));
        assert!(full.message.contains("upper bound"), "{}", full.message);
        let known = GroupFacts { lag: Some(6), ..facts() };
        assert_eq!(observed(&ConsumerGroupPolicyStatus::default(), &valkey(), &known).backlog, Some(10));
    }

    /// Issue 66's audit: a policy naming a RedisServer was told to check `spec.redis.tls`, which it does not have.
    #[test]
    fn a_policy_on_a_redis_server_is_sent_to_the_servers_fields() {
        let policy = |redis: &str| {
            let yaml = format!("{{stream: s, group: g, deadLetter: {{stream: d}}, redis: {redis}}}");
            ConsumerGroupPolicy::new("p", serde_yaml::from_str(&yaml).unwrap())
        };
        let on_server = policy("{serverRef: {name: shared, namespace: platform}}");
        let tls = Error::TlsFailed { server: "rediss://r:6379".into(), detail: "unknown CA".into() };
        let said = failure_message(&on_server, &tls);
        assert!(said.contains("check RedisServer platform/shared: spec.tls and its Secrets"), "{said}");
        assert!(!said.contains("spec.redis"), "{said}");
        // Its own field stays its own.
        let missing = Error::ServerNotFound { namespace: "platform".into(), name: "shared".into() };
        assert!(failure_message(&on_server, &missing).contains("fix spec.redis.serverRef"));
        // An inline policy's fields are its own.
        let inline = policy("{url: \"rediss://r:6379/0\"}");
        assert_eq!(failure_message(&inline, &tls), tls.to_string());
    }

    #[test]
    fn terminal_error_is_stalled_not_reconciling() {
        let error = Error::SecretNotFound { namespace: "apps".into(), name: "auth".into(), key: "password".into() };
        let conds = conditions(&[], &Outcome::Failed(&error, error.to_string()), Some(2), Timestamp::UNIX_EPOCH);
        let get = |t: &str| conds.iter().find(|c| c.type_ == t).unwrap();
        assert_eq!((get(READY).status.as_str(), get(READY).reason.as_str()), ("False", "SecretNotFound"));
        assert_eq!(get(STALLED).status, "True");
        assert_eq!(get(RECONCILING).status, "False");
        assert!(conds.iter().all(|c| c.observed_generation == Some(2)));
    }

    #[test]
    fn transient_error_is_reconciling() {
        let error = Error::InvalidSpec("x".into());
        assert!(error.is_stalled());
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let error = Error::from_redis("127.0.0.1:1", redis::RedisError::from(io));
        assert_eq!(error.reason(), "RedisUnavailable");
        let conds = conditions(&[], &Outcome::Failed(&error, error.to_string()), Some(1), Timestamp::UNIX_EPOCH);
        assert_eq!(conds.iter().find(|c| c.type_ == RECONCILING).unwrap().status, "True");
        assert_eq!(conds.iter().find(|c| c.type_ == STALLED).unwrap().status, "False");
    }

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let ready = Outcome::Ready { message: "ok".into() };
        let first = conditions(&[], &ready, Some(1), Timestamp::UNIX_EPOCH);
        let later = Timestamp::from_second(1_000).unwrap();
        let same = conditions(&first, &ready, Some(2), later);
        assert_eq!(same[0].last_transition_time, Time(Timestamp::UNIX_EPOCH));
        let error = Error::InvalidSpec("x".into());
        let flipped = conditions(&same, &Outcome::Failed(&error, error.to_string()), Some(2), later);
        assert_eq!(flipped[0].last_transition_time, Time(later));
    }
}
