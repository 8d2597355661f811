//! The move of a `GroupSeek`: calls of `scripts/seek.lua`, each a bounded step (counting entries, walking a shift,
//! a batch of pending entries) from where the last one ended, until the last refuses, plans, or moves the group,
//! atomically and once per seek name.

use std::sync::LazyLock;

use redis::Script;
use serde::Deserialize;

use crate::api::{GroupPosition, PendingHandling};
use crate::keys::{ERROR_TEXT_MAX, OPERATOR_CONSUMER, errors_key, redrive_lock_key, seeks_key, totals_key};
use crate::redis::{Conn, GroupKeys};
use crate::{Error, Result};

static SEEK: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/seek.lua")));

/// Where the group goes, as the script takes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// The first entry at or after this time (milliseconds since the epoch).
    Time(i64),
    /// This entry, or the first after it.
    Id(String),
    Earliest,
    Latest,
    /// Entries from the group's position: negative back, positive forward.
    Shift(i64),
}

impl Target {
    fn args(&self) -> (&'static str, String) {
        match self {
            Target::Time(ms) => ("time", ms.to_string()),
            Target::Id(id) => ("id", id.clone()),
            Target::Earliest => ("earliest", String::new()),
            Target::Latest => ("latest", String::new()),
            Target::Shift(n) => ("shift", n.to_string()),
        }
    }
}

/// One seek.
#[derive(Clone, Debug)]
pub struct Seek {
    /// The `GroupSeek`'s `<namespace>/<name>`: the server records its progress and result under it, so that the
    /// same manifest applied again (a new object of the same name) never moves the group again.
    pub name: String,
    /// The `GroupSeek`'s uid: which object the record is of.
    pub uid: String,
    pub target: Target,
    pub pending: PendingHandling,
    /// Refuse while a consumer was active this recently (0: no check).
    pub idle_ms: u64,
    pub dry_run: bool,
    pub dead_letter_max_len: Option<u64>,
}

/// The plan, or what was done.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Moved {
    pub from: GroupPosition,
    pub to: GroupPosition,
    pub redelivered: i64,
    pub skipped: i64,
    pub pending_handled: i64,
    pub oldest_available: Option<String>,
}

/// What the script said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Done(Moved),
    /// Another object of the same name moved the group before (its uid): what it did; nothing moved now.
    Finished {
        moved: Moved,
        uid: String,
    },
    /// Nothing moved: the reason (a condition reason) and why.
    Refused {
        reason: String,
        message: String,
    },
}

/// The script's record: Lua's `false` (a nil the server sent) stands for "unknown".
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Record {
    from: RecordPosition,
    to: RecordPosition,
    redelivered: i64,
    skipped: i64,
    pending_handled: i64,
    #[serde(default)]
    oldest_available: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RecordPosition {
    id: String,
    #[serde(default)]
    entries_read: serde_json::Value,
    #[serde(default)]
    lag: serde_json::Value,
}

impl From<RecordPosition> for GroupPosition {
    fn from(p: RecordPosition) -> GroupPosition {
        GroupPosition { id: p.id, entries_read: p.entries_read.as_i64(), lag: p.lag.as_i64() }
    }
}

/// One call's answer: another step to take, or the end.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    Again,
    End(Outcome),
}

/// The script's answer. A record this operator cannot read means the seek ran (its name is recorded) under a
/// format not this version's, or the field was written by hand: never run again, and not the spec's fault.
fn parse(server: &str, seeks: &str, name: &str, reply: Vec<String>) -> Result<Step> {
    let read = |record: &str| -> Result<Moved> {
        let record: Record = serde_json::from_str(record).map_err(|e| unreadable(server, seeks, name, record, e))?;
        Ok(Moved {
            from: record.from.into(),
            to: record.to.into(),
            redelivered: record.redelivered,
            skipped: record.skipped,
            pending_handled: record.pending_handled,
            oldest_available: record.oldest_available,
        })
    };
    match reply.as_slice() {
        [step] if step == "step" => Ok(Step::Again),
        [done, record] if done == "done" => Ok(Step::End(Outcome::Done(read(record)?))),
        [finished, record, uid] if finished == "finished" => {
            Ok(Step::End(Outcome::Finished { moved: read(record)?, uid: uid.clone() }))
        }
        [unreadable_, record] if unreadable_ == "unreadable" => {
            Err(unreadable(server, seeks, name, record, "not a record of a seek"))
        }
        [refused, reason, message] if refused == "refused" => {
            Ok(Step::End(Outcome::Refused { reason: reason.clone(), message: message.clone() }))
        }
        other => Err(Error::UnexpectedReply {
            server: server.to_string(),
            detail: format!("the seek script answered {other:?}; nothing is known to have moved"),
        }),
    }
}

fn unreadable(server: &str, seeks: &str, name: &str, record: &str, why: impl std::fmt::Display) -> Error {
    Error::UnexpectedReply {
        server: server.to_string(),
        detail: format!(
            "the record of this seek (field {name} of {seeks}) is not one this version of Pelican writes ({why}): \
             {record}; a seek whose name is recorded never runs again: read the group's position with XINFO \
             GROUPS, and create a GroupSeek of another name to move it"
        ),
    }
}

/// Runs the seek on the server, a bounded call at a time: refused, planned (`dry_run`) or done, once per name.
/// `go_on` is asked before every call after the first: false stops with [`Error::Deferred`], and the next run
/// resumes from the cursor the last call recorded on the server.
pub async fn run(
    conn: &mut Conn,
    server: &str,
    keys: &GroupKeys<'_>,
    seek: &Seek,
    go_on: impl Fn() -> bool,
) -> Result<Outcome> {
    let (kind, value) = seek.target.args();
    let seeks = seeks_key(keys.stream, keys.group);
    let mut invocation = SEEK.prepare_invoke();
    invocation
        .key(keys.stream)
        .key(keys.dead_letter)
        .key(totals_key(keys.stream, keys.group))
        .key(&seeks)
        .key(redrive_lock_key(keys.dead_letter))
        .key(errors_key(keys.stream, keys.group))
        .arg(keys.group)
        .arg(&seek.uid)
        .arg(&seek.name)
        .arg(kind)
        .arg(value)
        .arg(seek.pending.name())
        .arg(seek.idle_ms)
        .arg(OPERATOR_CONSUMER)
        .arg(if seek.dry_run { "1" } else { "0" })
        .arg(seek.dead_letter_max_len.unwrap_or(0))
        .arg(ERROR_TEXT_MAX)
        .arg(crate::jobs::CONSUMERS_LISTED_MAX);
    loop {
        let reply: Vec<String> = invocation.invoke_async(conn).await.map_err(|e| Error::from_redis(server, e))?;
        match parse(server, &seeks, &seek.name, reply)? {
            Step::End(outcome) => return Ok(outcome),
            Step::Again if go_on() => {}
            Step::Again => {
                return Err(Error::Deferred(format!("seek {} stopped between two steps; it resumes", seek.name)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_reply(reply: Vec<&str>) -> Result<Step> {
        parse("redis://r:6379/0", "{o}:pelican:o:g:seeks", "apps/back", reply.into_iter().map(String::from).collect())
    }

    #[test]
    fn the_record_reads_unknown_counts_as_absent() {
        let record = r#"{"from":{"id":"5-0","entriesRead":false,"lag":false},"to":{"id":"0-0","entriesRead":0,"lag":9},
            "redelivered":9,"skipped":0,"pendingHandled":2,"oldestAvailable":"1-0","dryRun":false}"#;
        let Step::End(Outcome::Done(moved)) = parse_reply(vec!["done", record]).unwrap() else { panic!() };
        assert_eq!(moved.from, GroupPosition { id: "5-0".into(), entries_read: None, lag: None });
        assert_eq!(moved.to, GroupPosition { id: "0-0".into(), entries_read: Some(0), lag: Some(9) });
        assert_eq!((moved.redelivered, moved.pending_handled, moved.oldest_available.as_deref()), (9, 2, Some("1-0")));
        let Step::End(Outcome::Finished { moved: before, uid }) = parse_reply(vec!["finished", record, "u-0"]).unwrap()
        else {
            panic!()
        };
        assert_eq!((before, uid.as_str()), (moved, "u-0"));
        let refused = parse_reply(vec!["refused", "ConsumersActive", "c1 (2s ago)"]).unwrap();
        let said = Outcome::Refused { reason: "ConsumersActive".into(), message: "c1 (2s ago)".into() };
        assert_eq!(refused, Step::End(said));
        assert_eq!(parse_reply(vec!["step"]).unwrap(), Step::Again);
        assert!(parse_reply(vec!["what"]).is_err());
    }

    #[test]
    fn a_record_of_another_format_is_an_unexpected_reply_that_names_its_key_not_a_spec_error() {
        for reply in [vec!["done", r#"{"moved":12}"#], vec!["unreadable", r#"{"moved":12}"#]] {
            let error = parse_reply(reply).unwrap_err();
            assert_eq!(error.reason(), "UnexpectedReply");
            assert!(error.is_stalled(), "a record does not change by retrying");
            let said = error.to_string();
            assert!(said.contains("field apps/back of {o}:pelican:o:g:seeks") && said.contains("never runs again"));
        }
        assert_eq!(parse_reply(vec!["what"]).unwrap_err().reason(), "UnexpectedReply");
    }
}
