//! The move of a `GroupSeek`: one call of `scripts/seek.lua`, which refuses, plans, or moves the group and handles
//! the entries pending at that moment, atomically and once per seek.

use std::sync::LazyLock;

use redis::Script;
use serde::Deserialize;

use crate::api::{GroupPosition, PendingHandling};
use crate::keys::{OPERATOR_CONSUMER, redrive_lock_key, seeks_key, totals_key};
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
    /// The `GroupSeek`'s uid: the server records the result under it.
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

/// The script's answer. A record this operator cannot read means the seek ran (its uid is recorded) under a
/// format not this version's, or the field was written by hand: never run again, and not the spec's fault.
fn parse(server: &str, seeks: &str, uid: &str, reply: Vec<String>) -> Result<Outcome> {
    match reply.as_slice() {
        [done, record] if done == "done" => {
            let record: Record = serde_json::from_str(record).map_err(|e| Error::UnexpectedReply {
                server: server.to_string(),
                detail: format!(
                    "the record of this seek (field {uid} of {seeks}) is not one this version of Pelican writes \
                     ({e}): {record}; a seek whose uid is recorded never runs again: read the group's position \
                     with XINFO GROUPS, and create a new GroupSeek to move it"
                ),
            })?;
            Ok(Outcome::Done(Moved {
                from: record.from.into(),
                to: record.to.into(),
                redelivered: record.redelivered,
                skipped: record.skipped,
                pending_handled: record.pending_handled,
                oldest_available: record.oldest_available,
            }))
        }
        [refused, reason, message] if refused == "refused" => {
            Ok(Outcome::Refused { reason: reason.clone(), message: message.clone() })
        }
        other => Err(Error::UnexpectedReply {
            server: server.to_string(),
            detail: format!("the seek script answered {other:?}; nothing is known to have moved"),
        }),
    }
}

/// Runs the seek on the server: refused, planned (`dry_run`) or done, once per uid.
pub async fn run(conn: &mut Conn, server: &str, keys: &GroupKeys<'_>, seek: &Seek) -> Result<Outcome> {
    let (kind, value) = seek.target.args();
    let seeks = seeks_key(keys.stream, keys.group);
    let reply: Vec<String> = SEEK
        .key(keys.stream)
        .key(keys.dead_letter)
        .key(totals_key(keys.stream, keys.group))
        .key(&seeks)
        .key(redrive_lock_key(keys.dead_letter))
        .arg(keys.group)
        .arg(&seek.uid)
        .arg(kind)
        .arg(value)
        .arg(seek.pending.name())
        .arg(seek.idle_ms)
        .arg(OPERATOR_CONSUMER)
        .arg(if seek.dry_run { "1" } else { "0" })
        .arg(seek.dead_letter_max_len.unwrap_or(0))
        .invoke_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))?;
    parse(server, &seeks, &seek.uid, reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_reads_unknown_counts_as_absent() {
        let record = r#"{"from":{"id":"5-0","entriesRead":false,"lag":false},"to":{"id":"0-0","entriesRead":0,"lag":9},
            "redelivered":9,"skipped":0,"pendingHandled":2,"oldestAvailable":"1-0","dryRun":false}"#;
        let parse = |reply| parse("redis://r:6379/0", "{o}:pelican:o:g:seeks", "u-1", reply);
        let Outcome::Done(moved) = parse(vec!["done".into(), record.into()]).unwrap() else { panic!() };
        assert_eq!(moved.from, GroupPosition { id: "5-0".into(), entries_read: None, lag: None });
        assert_eq!(moved.to, GroupPosition { id: "0-0".into(), entries_read: Some(0), lag: Some(9) });
        assert_eq!((moved.redelivered, moved.pending_handled, moved.oldest_available.as_deref()), (9, 2, Some("1-0")));
        let refused = parse(vec!["refused".into(), "ConsumersActive".into(), "c1 (2s ago)".into()]).unwrap();
        assert_eq!(refused, Outcome::Refused { reason: "ConsumersActive".into(), message: "c1 (2s ago)".into() });
        assert!(parse(vec!["what".into()]).is_err());
    }

    #[test]
    fn a_record_of_another_format_is_an_unexpected_reply_that_names_its_key_not_a_spec_error() {
        let parse = |reply| parse("redis://r:6379/0", "{o}:pelican:o:g:seeks", "u-1", reply);
        let error = parse(vec!["done".into(), r#"{"moved":12}"#.into()]).unwrap_err();
        assert_eq!(error.reason(), "UnexpectedReply");
        assert!(error.is_stalled(), "a record does not change by retrying");
        let said = error.to_string();
        assert!(said.contains("field u-1 of {o}:pelican:o:g:seeks") && said.contains("never runs again"), "{said}");
        assert_eq!(parse(vec!["what".into()]).unwrap_err().reason(), "UnexpectedReply");
    }
}
