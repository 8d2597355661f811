//! Phase 4, report: status (server-side apply, only when a value a person acts on changed), conditions, one Event
//! per change of the Ready reason, and the policy's metric series.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use tracing::{info, warn};

use super::act::Observation;
use super::plan::Idempotence;
use super::progress::{self, Sample};
use super::status::{self, Outcome, READY};
use super::{Context, publish};
use crate::Result;
use crate::api::{CONSUMING, ConsumerGroupPolicy, ConsumerGroupPolicyStatus, IDEMPOTENT, RetentionStatus};
use crate::context::policy_id;
use crate::redis::Backlog;
use crate::telemetry::PolicySnapshot;

/// Turns what the reconcile saw (or the error that stopped it) into status, Events and metrics.
pub async fn report(policy: &ConsumerGroupPolicy, ctx: &Context, result: &Result<Observation>) -> Result<()> {
    let previous = policy.status.clone().unwrap_or_default();
    let now = Timestamp::now();
    let jobs = ctx.runner.state(&policy_id(policy));
    let generation = policy.metadata.generation;
    let mut consuming = previous.conditions.iter().find(|c| c.type_ == CONSUMING).cloned();
    let mut idempotent = previous.conditions.iter().find(|c| c.type_ == IDEMPOTENT).cloned();
    let (status, outcome, age) = match result {
        Ok(seen) => {
            let message = format!("group {:?} on stream {:?} is ready", policy.spec.group, policy.spec.stream);
            ctx.shared.readings.record(&policy_id(policy), Backlog::of(&seen.facts));
            let mut status = status::observed(&previous, &seen.server, &seen.facts);
            status.primary = seen.primary.clone();
            status.partitions = seen.partitions.clone();
            status.server_features =
                seen.features.found.iter().map(|f| crate::api::ServerFeature(f.to_string())).collect();
            status.requeue_copies_to = status::requeue_copies_to(&policy.spec, &seen.facts);
            // Shown where the stream uses it (a window declared, or idempotent publishes seen): on Redis 8.6 every
            // stream reports the server's default window.
            let declared = seen.idempotence != Idempotence::Undeclared;
            status.idempotence = seen.facts.idempotence.clone().filter(|i| declared || i.added > 0 || i.duplicates > 0);
            let version = seen.server.to_string();
            idempotent = status::idempotent(&previous.conditions, &seen.idempotence, &version, generation, now);
            status.consumers_without_pod = (!jobs.without_pod.is_empty())
                .then(|| jobs.without_pod.iter().map(|name| crate::api::ConsumerName(name.clone())).collect());
            if let Some(at) = jobs.last_pass.and_then(|t| Timestamp::from_second(t.as_second()).ok()) {
                status.last_pass_time = Some(at.to_string());
            }
            status.retention = seen.retention.clone().map(|effective| RetentionStatus {
                effective,
                pinned_by: jobs.trim.as_ref().and_then(|t| t.pinned_by.as_ref()).map(|pin| pin.to_string()),
            });
            let window = {
                let mut windows = ctx.progress.lock().expect("progress lock");
                let window = windows.entry(ObjectRef::from_obj(policy)).or_default();
                window.push(Sample::of(&seen.facts), seen.interval.as_millis() as i64 * 9 / 10);
                window.unread = seen.facts.unread.clone();
                window.clone()
            };
            status.rates = window.rates();
            status.drain_seconds = window.drain_seconds();
            consuming = Some(progress::consuming(&previous.conditions, &window, generation, now));
            let outcome = match jobs.failures.first_key_value() {
                Some((job, failure)) => Outcome::JobFailed(*job, failure),
                None => Outcome::Ready { message },
            };
            (status, outcome, status::oldest_pending_age_seconds(&seen.facts))
        }
        Err(error) => (previous.clone(), Outcome::Failed(error, status::failure_message(policy, error)), None),
    };
    let mut conditions = status::conditions(&previous.conditions, &outcome, generation, now);
    let max_length = policy.spec.backlog.as_ref().map(|b| b.max_length);
    conditions.extend(status::saturated(&previous.conditions, &status, max_length, generation, now));
    conditions.extend(consuming);
    conditions.extend(idempotent);
    let operator = Some(ctx.install.clone());
    let status = ConsumerGroupPolicyStatus { observed_generation: generation, conditions, operator, ..status };
    announce_another_install(policy, ctx, &previous).await;
    let insecure = policy
        .spec
        .redis
        .tls
        .as_ref()
        .is_some_and(|t| t.insecure_skip_verify)
        .then_some("spec.redis.tls.insecureSkipVerify");
    let conditions = (&previous.conditions[..], &status.conditions[..]);
    let object = kube::Resource::object_ref(policy, &());
    ctx.shared.announce_ready(&object, "Reconcile", conditions, insecure).await;
    announce_consuming(policy, ctx, &previous, &status).await;
    announce_saturation(policy, ctx, &previous, &status).await;
    announce_failover(policy, ctx, &previous, &status).await;
    announce_requeue_copies(policy, ctx, &previous, &status).await;
    let snapshot = PolicySnapshot {
        stream: policy.spec.stream.clone(),
        group: policy.spec.group.clone(),
        ready: matches!(outcome, Outcome::Ready { .. }),
        status: status.clone(),
        oldest_pending_age_seconds: age,
        backlog_max_length: max_length,
    };
    ctx.shared.metrics.observe_policy((policy.namespace().unwrap_or_default(), policy.name_any()), snapshot);
    if status::worth_writing(policy.status.as_ref(), &status) {
        ctx.shared.apply_status(policy, &status).await?;
    }
    ctx.wrote.lock().expect("wrote lock").insert(ObjectRef::from_obj(policy), policy.resource_version());
    Ok(())
}

/// Warning `AnotherPelican` (and a log line) when the status this install wrote was written since by another one:
/// two installs (each with its own Lease, in another namespace or under another name) serve the policy.
async fn announce_another_install(policy: &ConsumerGroupPolicy, ctx: &Context, previous: &ConsumerGroupPolicyStatus) {
    let last_read = ctx.wrote.lock().expect("wrote lock").get(&ObjectRef::from_obj(policy)).cloned();
    let Some(other) = written_since(previous, &ctx.install, &policy.resource_version(), last_read.as_ref()) else {
        return;
    };
    let note = format!(
        "another Pelican install (leader Lease {other}) wrote this policy's status after this one ({}) did: both \
         serve it, each running its passes and writing its status. Uninstall one, or split the policies between them \
         (watchNamespace, or sharding's watchLabelSelector); a second install in another namespace is a second writer",
        ctx.install
    );
    warn!(namespace = policy.namespace().unwrap_or_default(), name = policy.name_any(), other, "{note}");
    publish(ctx, policy, EventType::Warning, "AnotherPelican", note).await;
}

/// The other install that wrote the status `previous` (of the policy's version `version`) after this one (`install`)
/// wrote it, whose last look read version `last_read` (`None`: it never wrote this policy's status).
///
/// Nothing at the first look after a start or at a status an install removed since left: a hand-over. Nothing
/// either when the version is the one this install's last look read: the watch has not brought this install's own
/// write yet (a look can start before the write's event arrives), so the status is the one that write replaced.
fn written_since<'a>(
    previous: &'a ConsumerGroupPolicyStatus,
    install: &str,
    version: &Option<String>,
    last_read: Option<&Option<String>>,
) -> Option<&'a str> {
    let other = previous.operator.as_deref().filter(|other| *other != install)?;
    (last_read? != version).then_some(other)
}

/// Whether reporting `error` would change nothing: the Ready condition already says it, for this generation.
pub fn unchanged_failure(policy: &ConsumerGroupPolicy, error: &crate::Error) -> bool {
    let Some(status) = &policy.status else { return false };
    status.observed_generation == policy.metadata.generation
        && status.conditions.iter().any(|c| {
            c.type_ == READY
                && c.status == "False"
                && c.reason == error.reason()
                && c.message == status::failure_message(policy, error)
        })
}

/// One Event per change of the `Consuming` verdict: Normal `Progressing` when consumers move again, a Warning
/// named by the reason when they stop, vanish or fall behind. Nothing when a first verdict says all is well, or
/// while there is none yet.
async fn announce_consuming(
    policy: &ConsumerGroupPolicy,
    ctx: &Context,
    previous: &ConsumerGroupPolicyStatus,
    next: &ConsumerGroupPolicyStatus,
) {
    fn verdict(s: &ConsumerGroupPolicyStatus) -> Option<&Condition> {
        s.conditions.iter().find(|c| c.type_ == CONSUMING && c.status != "Unknown")
    }
    let Some(condition) = verdict(next) else {
        return;
    };
    let reason = condition.reason.clone();
    let before = verdict(previous).map(|c| &c.reason);
    if before == Some(&reason) || (before.is_none() && condition.status == "True") {
        return;
    }
    let note = format!("group {:?}: {}", policy.spec.group, condition.message);
    if condition.status == "True" {
        info!(reason, "{note}");
        publish(ctx, policy, EventType::Normal, &reason, note).await;
    } else {
        warn!(reason, "{note}");
        publish(ctx, policy, EventType::Warning, &reason, note).await;
    }
}

/// `BacklogFull` (Warning) when `Saturated` becomes True, `BacklogCleared` when it stops being True.
async fn announce_saturation(
    policy: &ConsumerGroupPolicy,
    ctx: &Context,
    previous: &ConsumerGroupPolicyStatus,
    next: &ConsumerGroupPolicyStatus,
) {
    let full =
        |s: &ConsumerGroupPolicyStatus| s.conditions.iter().any(|c| c.type_ == status::SATURATED && c.status == "True");
    let message = || {
        next.conditions
            .iter()
            .find(|c| c.type_ == status::SATURATED)
            .map(|c| c.message.clone())
            .unwrap_or_else(|| "spec.backlog was removed: the stream is unbounded for this group".to_string())
    };
    match (full(previous), full(next)) {
        (false, true) => {
            let note = message();
            warn!("{note}");
            publish(ctx, policy, EventType::Warning, "BacklogFull", note).await;
        }
        (true, false) => {
            let note = message();
            info!("{note}");
            publish(ctx, policy, EventType::Normal, "BacklogCleared", note).await;
        }
        _ => {}
    }
}

/// `PrimaryChanged` (Warning) when the sentinel names another primary than at the last reconcile: a failover
/// happened, and writes the old primary acknowledged but had not replicated may be gone.
async fn announce_failover(
    policy: &ConsumerGroupPolicy,
    ctx: &Context,
    previous: &ConsumerGroupPolicyStatus,
    next: &ConsumerGroupPolicyStatus,
) {
    let (Some(before), Some(after)) = (&previous.primary, &next.primary) else {
        return;
    };
    if before == after {
        return;
    }
    let master = policy.spec.redis.sentinel.as_ref().map_or("", |s| s.master_name.as_str());
    let note = format!(
        "the sentinels now name {after} as the primary of {master:?} (was {before}): the jobs and the status follow it"
    );
    warn!("{note}");
    publish(ctx, policy, EventType::Warning, "PrimaryChanged", note).await;
}

/// `RequeueCopies` (Warning) when the policy starts requeueing into a stream other groups read (or the set of them
/// changes): each requeued copy is a new entry, so every one of them gets it too.
async fn announce_requeue_copies(
    policy: &ConsumerGroupPolicy,
    ctx: &Context,
    previous: &ConsumerGroupPolicyStatus,
    next: &ConsumerGroupPolicyStatus,
) {
    let Some(others) = &next.requeue_copies_to else {
        return;
    };
    if previous.requeue_copies_to.as_ref() == Some(others) {
        return;
    }
    let note = format!(
        "strategy Requeue on stream {:?}, which the groups {others} also read: each message this policy requeues is \
         added to the stream again, so they get it a second time; use strategy Reassign, or a stream per group",
        policy.spec.stream
    );
    warn!("{note}");
    publish(ctx, policy, EventType::Warning, "RequeueCopies", note).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written_by(install: &str) -> ConsumerGroupPolicyStatus {
        ConsumerGroupPolicyStatus { operator: Some(install.into()), ..Default::default() }
    }

    /// The CI failure of stop 77: a shard's second look began before the watch brought its own first write, so it
    /// read the status it had just replaced (the unsharded install's) and said `AnotherPelican`.
    #[test]
    fn the_status_this_install_replaced_read_again_is_not_another_writer() {
        let theirs = written_by("system/pelican-leader");
        let v = |rv: &str| Some(rv.to_string());
        // The first look after a start: a hand-over.
        assert_eq!(written_since(&theirs, "system/pelican-leader-a", &v("10"), None), None);
        // The look read version 10 and wrote over it; the next one reads 10 again, before the watch caught up.
        assert_eq!(written_since(&theirs, "system/pelican-leader-a", &v("10"), Some(&v("10"))), None);
        // Its own write arrived: its own name.
        let ours = written_by("system/pelican-leader-a");
        assert_eq!(written_since(&ours, "system/pelican-leader-a", &v("11"), Some(&v("10"))), None);
        // Another version naming the other install: written since.
        assert_eq!(
            written_since(&theirs, "system/pelican-leader-a", &v("12"), Some(&v("11"))),
            Some("system/pelican-leader")
        );
        // A status an install removed since: nothing to say.
        let removed = ConsumerGroupPolicyStatus::default();
        assert_eq!(written_since(&removed, "system/pelican-leader-a", &v("13"), Some(&v("11"))), None);
    }
}
