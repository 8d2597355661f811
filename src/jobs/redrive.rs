//! Dead-letter redrive, the data-plane half: the snapshot of what to move, and steps that move a
//! batch and record the progress in one script (`scripts/redrive.lua`). The controller half (phases, status,
//! one redrive per dead-letter stream) is in [`crate::redrive`].

use std::collections::{BTreeSet, HashMap};
use std::sync::LazyLock;

use redis::Script;
use redis::streams::{StreamId, StreamRangeReply};

use super::{BYTE_BUDGET, MAX_FIELDS};
use crate::keys::slot;
use crate::redis::Conn;
use crate::redis::pager::Pager;
use crate::telemetry::traces::{self, Action, Move, Place};
use crate::tenancy::KeyRules;
use crate::{Error, Result};

static REDRIVE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/redrive.lua")));
static REDRIVE_LOCK: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/redrive_lock.lua")));

/// The most dead-letter entries one `XRANGE` of the snapshot reads ([`Pager`] reads fewer of large entries).
const PAGE: usize = 256;

/// The field the reclaim script writes with the stream an entry was dead-lettered from.
const SOURCE_FIELD: &str = "pelican-source-stream";
/// The most destination streams a `Source` redrive keeps checked (and sends as KEYS with each call).
const MAX_DESTINATIONS: usize = 64;
const REASON_FIELD: &str = "pelican-reason";

/// Everything a redrive's moves depend on; fixed for its whole life.
#[derive(Clone, Debug)]
pub struct Plan {
    pub dead_letter: String,
    /// `{T}:pelican:<dead-letter>:redrive:<namespace>/<name>`.
    pub progress_key: String,
    /// `{T}:pelican:<dead-letter>:redrive-lock`: who moves entries out of the dead-letter stream now.
    pub lock_key: String,
    /// `namespace/name`, as the lock names its owner.
    pub full_name: String,
    pub uid: String,
    pub name: String,
    pub target: Destination,
    /// Only entries with one of these `pelican-reason` values (all when empty).
    pub reasons: Vec<String>,
    pub from: Option<String>,
    pub to: Option<String>,
    pub max_messages: Option<u64>,
    /// Keys of one script must share a slot on a Redis Cluster.
    pub cluster: bool,
    /// The keys the policy's `RedisServer` admits for its namespace (none for an inline connection): every
    /// destination must match them.
    pub keys: Option<KeyRules>,
}

/// Where the entries go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Destination {
    /// Each entry back to its `pelican-source-stream`; entries without one go to `fallback` (the policy's stream).
    Source {
        fallback: String,
    },
    Stream(String),
}

/// What the redrive will move, counted before the first move.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// The last dead-letter id to look at; `None` when there is nothing in range.
    pub until_id: Option<String>,
    pub to_move: u64,
}

/// The record on the server, as the script left it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub uid: Option<String>,
    pub last_id: Option<String>,
    pub moved: u64,
    /// Left in place: outside the filter, or too large to copy.
    pub skipped: u64,
    /// Of those, too large to copy.
    pub too_large: u64,
    /// Milliseconds since the epoch when the last step ended the redrive.
    pub finished_at: Option<u64>,
}

impl Plan {
    fn matches(&self, entry: &StreamId) -> bool {
        self.reasons.is_empty() || text(entry, REASON_FIELD).is_some_and(|reason| self.reasons.contains(&reason))
    }

    fn destination(&self, entry: &StreamId) -> String {
        match &self.target {
            Destination::Stream(stream) => stream.clone(),
            Destination::Source { fallback } => text(entry, SOURCE_FIELD).unwrap_or_else(|| fallback.clone()),
        }
    }

    /// A destination the script could not (or, by its server's tenancy, may not) write to, as the error that
    /// fails the redrive.
    fn check_destination(&self, stream: &str) -> Result<()> {
        if let Some(keys) = &self.keys {
            let field = match self.target {
                Destination::Stream(_) => "spec.target",
                Destination::Source { .. } => "the pelican-source-stream of a dead letter",
            };
            keys.check(field, stream)?;
        }
        if stream == self.dead_letter {
            return Err(Error::InvalidSpec(format!(
                "the redrive's target is the dead-letter stream {stream:?} itself: set spec.target to another stream"
            )));
        }
        if self.cluster && slot(stream) != slot(&self.dead_letter) {
            return Err(Error::CrossSlot(format!(
                "dead letters would go to {stream:?}, which is in another Redis Cluster slot than the dead-letter \
                 stream {:?}: a move is one script, so both must share a hash tag (e.g. {{orders}}:events and \
                 {{orders}}:dlq)",
                self.dead_letter
            )));
        }
        Ok(())
    }
}

fn text(entry: &StreamId, field: &str) -> Option<String> {
    entry.get::<String>(field)
}

/// Reads `[start, end]` of the dead-letter stream, one page.
async fn page(
    conn: &mut Conn,
    server: &str,
    stream: &str,
    start: &str,
    end: &str,
    count: usize,
) -> Result<Vec<StreamId>> {
    let reply: StreamRangeReply = redis::cmd("XRANGE")
        .arg(stream)
        .arg(start)
        .arg(end)
        .arg("COUNT")
        .arg(count)
        .query_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))?;
    Ok(reply.ids)
}

/// Counts what the redrive will move: the matching entries from `filter.from` to the stream's last id now (or
/// `filter.to`, when earlier), at most `maxMessages`, and checks that every one of them can go where it should.
/// Without a filter, and with nothing to check per entry, that is the stream's length: no scan.
pub async fn snapshot(conn: &mut Conn, server: &str, plan: &Plan) -> Result<Snapshot> {
    let whole_stream = plan.reasons.is_empty() && plan.from.is_none() && plan.to.is_none();
    // Each entry's source stream must share the dead-letter stream's slot on a Cluster, and match the server's key
    // patterns under tenancy: then read them all.
    let per_entry_checks = matches!(plan.target, Destination::Source { .. }) && (plan.cluster || plan.keys.is_some());
    if whole_stream && !per_entry_checks {
        if let Destination::Stream(stream) = &plan.target {
            plan.check_destination(stream)?;
        }
        // XINFO STREAM: the length and the last entry at one instant, in one command.
        let (length, last) = length_and_last(conn, server, &plan.dead_letter).await?;
        let to_move = plan.max_messages.map_or(length, |max| max.min(length));
        return Ok(Snapshot { until_id: last, to_move });
    }
    let last: StreamRangeReply = redis::cmd("XREVRANGE")
        .arg(&plan.dead_letter)
        .arg(plan.to.as_deref().unwrap_or("+"))
        .arg(plan.from.as_deref().unwrap_or("-"))
        .arg("COUNT")
        .arg(1)
        .query_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))?;
    let Some(until_id) = last.ids.into_iter().next().map(|e| e.id) else {
        return Ok(Snapshot { until_id: None, to_move: 0 });
    };
    let mut start = plan.from.clone().unwrap_or_else(|| "-".into());
    let mut to_move = 0;
    let mut checked = BTreeSet::new();
    let mut pager = Pager::new(PAGE);
    'scan: loop {
        let count = pager.count();
        let entries = page(conn, server, &plan.dead_letter, &start, &until_id, count).await?;
        pager.saw(&entries);
        let done = entries.len() < count;
        for entry in &entries {
            if plan.matches(entry) {
                let destination = plan.destination(entry);
                if !checked.contains(&destination) {
                    plan.check_destination(&destination)?;
                    checked.insert(destination);
                }
                to_move += 1;
                if plan.max_messages.is_some_and(|max| to_move >= max) {
                    break 'scan;
                }
            }
        }
        match entries.last() {
            Some(entry) if !done => start = format!("({}", entry.id),
            _ => break,
        }
    }
    Ok(Snapshot { until_id: Some(until_id), to_move })
}

/// The stream's length and its last entry's id (`None` for an empty or missing stream).
async fn length_and_last(conn: &mut Conn, server: &str, stream: &str) -> Result<(u64, Option<String>)> {
    let info: redis::RedisResult<HashMap<String, redis::Value>> =
        redis::cmd("XINFO").arg("STREAM").arg(stream).query_async(conn).await;
    let info = match info {
        Ok(info) => info,
        // A dead-letter stream nothing was ever dead-lettered to.
        Err(e) if e.code() == Some("ERR") && e.detail().is_some_and(|d| d.starts_with("no such key")) => {
            return Ok((0, None));
        }
        Err(e) => return Err(Error::from_redis(server, e)),
    };
    let length = match info.get("length") {
        Some(redis::Value::Int(n)) => (*n).max(0) as u64,
        _ => 0,
    };
    let last = match info.get("last-entry") {
        Some(redis::Value::Array(entry)) => match entry.first() {
            Some(redis::Value::BulkString(id)) => Some(String::from_utf8_lossy(id).into_owned()),
            _ => None,
        },
        _ => None,
    };
    Ok((length, last))
}

pub async fn read_progress(conn: &mut Conn, server: &str, key: &str) -> Result<Progress> {
    let fields: HashMap<String, String> =
        redis::cmd("HGETALL").arg(key).query_async(conn).await.map_err(|e| Error::from_redis(server, e))?;
    let number = |name: &str| fields.get(name).and_then(|v| v.parse().ok());
    Ok(Progress {
        uid: fields.get("uid").cloned(),
        last_id: fields.get("lastId").cloned(),
        moved: number("moved").unwrap_or(0),
        skipped: number("skipped").unwrap_or(0),
        too_large: number("tooLarge").unwrap_or(0),
        finished_at: number("finishedAt"),
    })
}

/// One partition's range of a topic's redrive (SPEC 22), kept in its record before its first move.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Range {
    /// The last dead-letter id to look at (`0-0` when nothing is in range).
    pub until_id: String,
    pub to_move: u64,
}

/// The range this redrive (`uid`) recorded in its record, if it did.
pub async fn read_range(conn: &mut Conn, server: &str, key: &str, uid: &str) -> Result<Option<Range>> {
    let (owner, until_id, to_move): (Option<String>, Option<String>, Option<u64>) = redis::cmd("HMGET")
        .arg(key)
        .arg("uid")
        .arg("untilId")
        .arg("toMove")
        .query_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))?;
    Ok(match (owner, until_id, to_move) {
        (Some(owner), Some(until_id), Some(to_move)) if owner == uid => Some(Range { until_id, to_move }),
        _ => None,
    })
}

/// Records the range in the record (owned by `uid` from then on), before the first move of it.
pub async fn record_range(conn: &mut Conn, server: &str, key: &str, uid: &str, range: &Range) -> Result<()> {
    redis::cmd("HSET")
        .arg(key)
        .arg("uid")
        .arg(uid)
        .arg("untilId")
        .arg(&range.until_id)
        .arg("toMove")
        .arg(range.to_move)
        .query_async::<()>(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))
}

/// Removes the record of a redrive that never finished (its object was deleted and created again under the same
/// name), so the new one starts from its own snapshot.
pub async fn forget_progress(conn: &mut Conn, server: &str, key: &str) -> Result<()> {
    redis::cmd("DEL").arg(key).query_async::<()>(conn).await.map_err(|e| Error::from_redis(server, e))
}

/// The redrive that owns a dead-letter stream: its uid and `namespace/name`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LockOwner {
    pub uid: String,
    pub name: String,
}

/// Takes the dead-letter stream's lock for this redrive, when nobody holds it, it holds it already, or its holder
/// is `gone` (the caller checked that redrive no longer runs). Returns who holds it after the call.
pub async fn claim(conn: &mut Conn, server: &str, plan: &Plan, gone: Option<&str>) -> Result<LockOwner> {
    let me = LockOwner { uid: plan.uid.clone(), name: plan.full_name.clone() };
    lock(conn, server, &plan.lock_key, "claim", &me, gone.unwrap_or_default()).await
}

/// Lets go of the lock, when this redrive holds it (it failed, or its object is gone).
pub async fn release(conn: &mut Conn, server: &str, plan: &Plan) -> Result<()> {
    let me = LockOwner { uid: plan.uid.clone(), name: plan.full_name.clone() };
    release_of(conn, server, &plan.lock_key, &me).await
}

/// Lets go of the lock of `owner` (a redrive the caller found gone), when it still holds it.
pub async fn release_of(conn: &mut Conn, server: &str, lock_key: &str, owner: &LockOwner) -> Result<()> {
    lock(conn, server, lock_key, "release", owner, "").await.map(|_| ())
}

/// Who holds the lock `lock_key` now, if anyone.
pub async fn holder(conn: &mut Conn, server: &str, lock_key: &str) -> Result<Option<LockOwner>> {
    let (uid, name): (Option<String>, Option<String>) = redis::cmd("HMGET")
        .arg(lock_key)
        .arg("uid")
        .arg("name")
        .query_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))?;
    Ok(uid.map(|uid| LockOwner { uid, name: name.unwrap_or_default() }))
}

async fn lock(conn: &mut Conn, server: &str, key: &str, op: &str, who: &LockOwner, gone: &str) -> Result<LockOwner> {
    let (uid, name): (String, String) = REDRIVE_LOCK
        .key(key)
        .arg(op)
        .arg(&who.uid)
        .arg(&who.name)
        .arg(gone)
        .invoke_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))?;
    Ok(LockOwner { uid, name })
}

/// What one step did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    pub moved: u64,
    /// Left in place: outside the filter, or too large to copy.
    pub skipped: u64,
    /// Of those, too large to copy.
    pub too_large: u64,
    /// The last id covered; `None` when the step covered none.
    pub last_id: Option<String>,
    /// This step ended the redrive: the range is exhausted or `maxMessages` reached.
    pub finished: bool,
}

/// Moves at most `budget` matching entries after `progress.last_id` (up to `until_id`) and records the progress,
/// reading and moving on the server in one script call. `destinations` are the streams checked so far (the
/// caller keeps them from one step to the next): a dead letter bound for another stream stops the call, and the
/// stream is checked ([`Plan::check_destination`]) and added before the next call. A step that finds nothing left
/// records that the redrive finished.
pub async fn step(
    conn: &mut Conn,
    server: &str,
    plan: &Plan,
    until_id: &str,
    progress: &Progress,
    budget: u64,
    destinations: &mut Vec<String>,
) -> Result<Step> {
    if destinations.is_empty()
        && let Destination::Stream(stream) = &plan.target
    {
        plan.check_destination(stream)?;
        destinations.push(stream.clone());
    }
    let allowed = plan.max_messages.map_or(u64::MAX, |max| max.saturating_sub(progress.moved));
    // `maxMessages` moved: a call with no budget records the end where the last step stopped.
    let mut budget = if allowed == 0 { 0 } else { budget.clamp(1, allowed) };
    let mut done = Step { last_id: progress.last_id.clone(), ..Step::default() };
    loop {
        let start = match (&done.last_id, &plan.from) {
            (Some(last), _) => format!("({last}"),
            (None, Some(from)) => from.clone(),
            (None, None) => "-".into(),
        };
        let call = call(conn, server, plan, destinations, &start, until_id, budget).await?;
        done.moved += call.moved;
        done.skipped += call.skipped;
        done.too_large += call.too_large;
        done.finished = call.finished;
        if call.last_id.is_some() {
            done.last_id = call.last_id;
        }
        budget -= call.moved.min(budget);
        match call.need {
            Some(stream) if budget > 0 => {
                let stream = String::from_utf8(stream).map_err(|e| {
                    let after =
                        done.last_id.as_deref().map_or("at the start of the range".into(), |id| format!("after {id}"));
                    Error::InvalidSpec(format!(
                        "the dead letter {after} names a {SOURCE_FIELD} that is not UTF-8 ({:?}): no stream key \
                         Pelican can check against the server's key patterns; delete or fix that entry, or redrive it \
                         with spec.target.stream",
                        String::from_utf8_lossy(e.as_bytes())
                    ))
                })?;
                plan.check_destination(&stream)?;
                // The checked streams are sent as KEYS with every call: keep the most recent ones only (one dropped
                // is checked again when an entry needs it).
                if destinations.len() >= MAX_DESTINATIONS {
                    destinations.remove(0);
                }
                destinations.push(stream);
            }
            _ => return Ok(done),
        }
    }
}

/// One script call: what it did, and the destination it stopped before, if any.
struct Call {
    moved: u64,
    skipped: u64,
    too_large: u64,
    last_id: Option<String>,
    finished: bool,
    need: Option<Vec<u8>>,
}

async fn call(
    conn: &mut Conn,
    server: &str,
    plan: &Plan,
    destinations: &[String],
    start: &str,
    until_id: &str,
    budget: u64,
) -> Result<Call> {
    let mut invocation = REDRIVE.key(&plan.dead_letter);
    invocation.key(&plan.progress_key).key(&plan.lock_key);
    for destination in destinations {
        invocation.key(destination);
    }
    let (mode, fallback) = match &plan.target {
        Destination::Stream(_) => ("stream", ""),
        Destination::Source { fallback } => ("source", fallback.as_str()),
    };
    invocation
        .arg(&plan.uid)
        .arg(&plan.name)
        .arg(start)
        .arg(until_id)
        .arg(budget)
        .arg(MAX_FIELDS)
        .arg(BYTE_BUDGET)
        .arg(mode)
        .arg(fallback)
        .arg(if traces::on() { "1" } else { "0" })
        .arg(&plan.reasons);
    type Moves = Vec<(String, String, String, String, String, String, String)>;
    let sent = std::time::SystemTime::now();
    let (moved, too_large, left, finished, last_id, need, moves): (u64, u64, u64, u8, String, Vec<u8>, Moves) =
        invocation.invoke_async(conn).await.map_err(|e| Error::from_redis(server, e))?;
    for (id, to, stream, traceparent, tracestate, reason, deliveries) in moves {
        let deliveries = deliveries.parse().unwrap_or(0);
        let one = Move { action: Action::Redriven, id, to, traceparent, tracestate, reason, deliveries };
        let place = Place { stream: &stream, group: None, redrive: Some(&plan.full_name) };
        traces::record(&place, std::slice::from_ref(&one), sent);
    }
    Ok(Call {
        moved,
        skipped: left + too_large,
        too_large,
        last_id: Some(last_id).filter(|id| !id.is_empty()),
        finished: finished == 1,
        need: Some(need).filter(|stream| !stream.is_empty()),
    })
}
