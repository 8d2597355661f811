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
use crate::tenancy::KeyRules;
use crate::{Error, Result};

static REDRIVE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/redrive.lua")));
static REDRIVE_LOCK: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/redrive_lock.lua")));

/// Dead-letter entries read per `XRANGE`.
const PAGE: usize = 256;

/// The field the reclaim script writes with the stream an entry was dead-lettered from.
const SOURCE_FIELD: &str = "pelican-source-stream";
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
    pub skipped: u64,
    pub missing: u64,
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
    'scan: loop {
        let entries = page(conn, server, &plan.dead_letter, &start, &until_id, PAGE).await?;
        let done = entries.len() < PAGE;
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
        missing: number("missing").unwrap_or(0),
        finished_at: number("finishedAt"),
    })
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
    lock(conn, server, plan, "claim", gone.unwrap_or_default()).await
}

/// Lets go of the lock, when this redrive holds it (it failed).
pub async fn release(conn: &mut Conn, server: &str, plan: &Plan) -> Result<()> {
    lock(conn, server, plan, "release", "").await.map(|_| ())
}

async fn lock(conn: &mut Conn, server: &str, plan: &Plan, op: &str, gone: &str) -> Result<LockOwner> {
    let (uid, name): (String, String) = REDRIVE_LOCK
        .key(&plan.lock_key)
        .arg(op)
        .arg(&plan.uid)
        .arg(&plan.full_name)
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
    pub missing: u64,
    /// Left in place: outside the filter, or too large to copy.
    pub skipped: u64,
    pub last_id: Option<String>,
    /// This step ended the redrive: the range is exhausted or `maxMessages` reached.
    pub finished: bool,
}

/// Moves at most `budget` matching entries after `progress.last_id` (up to `until_id`) and records the progress,
/// in one script call. A step that finds nothing left still records that the redrive finished.
pub async fn step(
    conn: &mut Conn,
    server: &str,
    plan: &Plan,
    until_id: &str,
    progress: &Progress,
    budget: u64,
) -> Result<Step> {
    let start = match (&progress.last_id, &plan.from) {
        (Some(last), _) => format!("({last}"),
        (None, Some(from)) => from.clone(),
        (None, None) => "-".into(),
    };
    let allowed = plan.max_messages.map_or(u64::MAX, |max| max.saturating_sub(progress.moved));
    if allowed == 0 {
        // `maxMessages` moved: record the end where the last step stopped.
        let checkpoint = progress.last_id.clone().unwrap_or_else(|| until_id.to_string());
        let done = call(conn, server, plan, &[], &[], &checkpoint, 0, true).await?;
        return Ok(Step { last_id: Some(checkpoint), finished: true, ..done });
    }
    let budget = budget.clamp(1, allowed);
    // Without a filter every entry read is moved: read just the batch.
    let count = if plan.reasons.is_empty() { budget as usize } else { PAGE };
    // Entries past the checkpoint (none when the last step covered `until_id` itself).
    let entries = if progress.last_id.as_deref() == Some(until_id) {
        Vec::new()
    } else {
        page(conn, server, &plan.dead_letter, &start, until_id, count).await?
    };
    // `left_before`: entries left in place since the previous id taken, sent with the next one so that a batch that
    // fails half way records exactly what it covered.
    let (mut ids, mut targets, mut left, mut left_before, mut bytes) =
        (Vec::new(), Vec::<String>::new(), 0u64, 0u64, 0usize);
    let mut last_id = progress.last_id.clone();
    let mut stopped_early = false;
    for entry in &entries {
        if ids.len() as u64 >= budget {
            stopped_early = true;
            break;
        }
        if plan.matches(entry) {
            let size: usize = entry.map.iter().map(|(k, v)| k.len() + value_len(v)).sum();
            if !ids.is_empty() && bytes + size > BYTE_BUDGET {
                stopped_early = true;
                break;
            }
            bytes += size;
            let destination = plan.destination(entry);
            let index = match targets.iter().position(|t| *t == destination) {
                Some(i) => i,
                None => {
                    // The snapshot checked every destination of the range; one added to the range since (only
                    // XADD with an explicit id can do that) is checked here, once per step.
                    plan.check_destination(&destination)?;
                    targets.push(destination);
                    targets.len() - 1
                }
            };
            ids.push((entry.id.clone(), index + 4, std::mem::take(&mut left_before)));
        } else {
            left += 1;
            left_before += 1;
        }
        last_id = Some(entry.id.clone());
    }
    // The range is done when this page was its last and every entry of it was taken or left. Reaching
    // `maxMessages` is recorded by the next step, once the script said how many of these were really moved.
    let finished = !stopped_early && entries.len() < count;
    let checkpoint = last_id.unwrap_or_else(|| until_id.to_string());
    let mut done = call(conn, server, plan, &targets, &ids, &checkpoint, left, finished).await?;
    done.last_id = Some(checkpoint);
    done.finished = finished;
    Ok(done)
}

fn value_len(value: &redis::Value) -> usize {
    match value {
        redis::Value::BulkString(bytes) => bytes.len(),
        _ => 0,
    }
}

#[allow(clippy::too_many_arguments)]
async fn call(
    conn: &mut Conn,
    server: &str,
    plan: &Plan,
    targets: &[String],
    ids: &[(String, usize, u64)],
    last_id: &str,
    left: u64,
    finished: bool,
) -> Result<Step> {
    let mut invocation = REDRIVE.key(&plan.dead_letter);
    invocation.key(&plan.progress_key).key(&plan.lock_key);
    for target in targets {
        invocation.key(target);
    }
    invocation
        .arg(&plan.uid)
        .arg(&plan.name)
        .arg(last_id)
        .arg(left)
        .arg(if finished { "1" } else { "0" })
        .arg(MAX_FIELDS);
    for (id, index, left_before) in ids {
        invocation.arg(id).arg(*index).arg(*left_before);
    }
    let (moved, missing, too_large): (u64, u64, u64) =
        invocation.invoke_async(conn).await.map_err(|e| Error::from_redis(server, e))?;
    Ok(Step { moved, missing, skipped: left + too_large, ..Step::default() })
}
