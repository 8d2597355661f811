//! Conditions in the `metav1.Condition` shape, for every kind Pelican writes: one rule for the transition time.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

/// What a condition says now.
pub struct Said<'a> {
    pub type_: &'a str,
    pub status: &'a str,
    pub reason: &'a str,
    pub message: String,
}

/// The condition `said` describes, observed at `generation`. Its transition time moves (to `now`) only when its
/// status flips against `previous`, as the Condition contract says; a new reason or message alone keeps it.
pub fn condition(previous: &[Condition], said: Said<'_>, generation: Option<i64>, now: Timestamp) -> Condition {
    let last_transition_time = match previous.iter().find(|c| c.type_ == said.type_) {
        Some(old) if old.status == said.status => old.last_transition_time.clone(),
        _ => Time(now),
    };
    Condition {
        type_: said.type_.into(),
        status: said.status.into(),
        reason: said.reason.into(),
        message: said.message,
        observed_generation: generation,
        last_transition_time,
    }
}

/// What a long-lived object (a policy, a server) is now, for [`verdict_conditions`].
pub enum Verdict<'a> {
    Ready(String),
    /// `stalled`: only a person can fix it; otherwise it is retried.
    Failed {
        reason: &'a str,
        message: String,
        stalled: bool,
    },
}

/// `Ready`, `Reconciling` and `Stalled` from one verdict, in the shape kstatus (Flux, kpt) and Argo CD read: ready
/// -> Ready True `Reconciled`; a failure only a person can fix -> Stalled True; a failure retried -> Reconciling
/// True, its message `retrying: ...`. The failure's reason is on all three.
pub fn verdict_conditions(
    previous: &[Condition],
    verdict: Verdict<'_>,
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    use crate::api::{READY, RECONCILED, RECONCILING, STALLED};
    let (ready, reconciling, stalled) = match verdict {
        Verdict::Ready(message) => {
            (("True", RECONCILED, message), ("False", RECONCILED, String::new()), ("False", RECONCILED, String::new()))
        }
        Verdict::Failed { reason, message, stalled: true } => {
            (("False", reason, message.clone()), ("False", reason, String::new()), ("True", reason, message))
        }
        Verdict::Failed { reason, message, stalled: false } => (
            ("False", reason, message.clone()),
            ("True", reason, format!("retrying: {message}")),
            ("False", reason, String::new()),
        ),
    };
    [(READY, ready), (RECONCILING, reconciling), (STALLED, stalled)]
        .into_iter()
        .map(|(type_, (status, reason, message))| {
            condition(previous, Said { type_, status, reason, message }, generation, now)
        })
        .collect()
}

/// Where a one-off job (a redrive, a seek) stands, for [`job_conditions`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobState {
    InProgress,
    Succeeded,
    Failed,
    /// Neither in progress nor finished (a suspended redrive).
    Idle,
}

/// `Complete` / `Failed` as a Job has them, and `Reconciling` / `Stalled` for kstatus (Flux, kpt): in progress ->
/// reconciling; failed -> stalled; succeeded or idle -> current. The condition that is True carries the message.
pub fn job_conditions(
    previous: &[Condition],
    state: JobState,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: Timestamp,
) -> Vec<Condition> {
    [
        ("Complete", state == JobState::Succeeded),
        ("Failed", state == JobState::Failed),
        ("Reconciling", state == JobState::InProgress),
        ("Stalled", state == JobState::Failed),
    ]
    .into_iter()
    .map(|(type_, yes)| {
        let status = if yes { "True" } else { "False" };
        let message = if yes { message.to_string() } else { String::new() };
        condition(previous, Said { type_, status, reason, message }, generation, now)
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn said<'a>(status: &'a str, reason: &'a str) -> Said<'a> {
        Said { type_: "Ready", status, reason, message: format!("{reason} now") }
    }

    #[test]
    fn the_transition_time_moves_only_when_the_status_flips() {
        let (t0, t1, t2) =
            (Timestamp::UNIX_EPOCH, Timestamp::from_second(10).unwrap(), Timestamp::from_second(20).unwrap());
        let first = condition(&[], said("False", "RedisUnavailable"), Some(1), t0);
        assert_eq!(first.last_transition_time, Time(t0));
        let other_reason = condition(std::slice::from_ref(&first), said("False", "AuthenticationFailed"), Some(2), t1);
        assert_eq!(other_reason.last_transition_time, Time(t0), "a new reason is no transition");
        assert_eq!((other_reason.reason.as_str(), other_reason.observed_generation), ("AuthenticationFailed", Some(2)));
        let flipped = condition(std::slice::from_ref(&other_reason), said("True", "Reconciled"), Some(2), t2);
        assert_eq!(flipped.last_transition_time, Time(t2));
        assert_eq!(flipped.message, "Reconciled now");
    }

    #[test]
    fn other_types_do_not_count() {
        let stalled =
            Condition { type_: "Stalled".into(), ..condition(&[], said("False", "x"), None, Timestamp::UNIX_EPOCH) };
        let ready = condition(&[stalled], said("False", "y"), None, Timestamp::from_second(5).unwrap());
        assert_eq!(ready.last_transition_time, Time(Timestamp::from_second(5).unwrap()));
    }
}
