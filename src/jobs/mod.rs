//! The jobs Redis never runs by itself: the reclaim / dead-letter pass, consumer expiry and
//! the trim of what every group acknowledged.

pub mod redrive;
pub mod seek;

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;
use std::ops::Bound::{Excluded, Unbounded};
use std::sync::LazyLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use redis::Script;

use crate::api::ReclaimStrategy;
use crate::keys::{
    ERROR_TEXT_MAX, OPERATOR_CONSUMER, WorkerSettings, consumers_key, errors_key, handovers_key, terminal_key,
    totals_key,
};
use crate::redis::{Conn, GroupKeys, reply};
use crate::telemetry::traces::{self, Action, Move, Place};
use crate::{Error, Result};

static RECLAIM: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/reclaim.lua")));
static EXPIRE_CONSUMERS: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/expire_consumers.lua")));
static TRIM_ACKNOWLEDGED: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/trim_acknowledged.lua")));

/// PEL entries one script call looks at: small enough to keep each call short on the server (a few milliseconds
/// when every one of them is moved), large enough to amortise the round trip.
pub const SCAN: usize = 256;

/// Bytes of entry data one script call may copy before it stops and leaves the rest of its page to the next call:
/// a script blocks the whole server, and 256 entries of 2 MB each would hold it for half a gigabyte.
/// About 4 ms of copying on this machine's servers; one entry larger than this still goes alone.
pub const BYTE_BUDGET: usize = 4 << 20;

/// The most application fields (names and values, counted separately) an entry may have for the script to copy
/// it: Lua's `unpack` in Redis stops near 8,000 values. Larger entries stay pending and are reported.
pub const MAX_FIELDS: usize = 7_900;

/// What one pass is allowed to do.
#[derive(Clone, Debug, PartialEq)]
pub struct PassSettings {
    pub min_idle: Duration,
    pub max_per_pass: usize,
    pub max_deliveries: u32,
    pub strategy: ReclaimStrategy,
    pub dead_letter_max_len: Option<u64>,
    /// `retry.backoff`: the idle threshold grows by `factor` per delivery, up to `max`.
    pub backoff: Option<Backoff>,
    /// `Reassign`: an entry handed over is not handed over again sooner ([`crate::keys::handover_grace`] in the operator).
    pub handover_grace: Duration,
    /// A pass ends after the script call during which this much time went by, its cursor kept for the next pass
    /// ([`crate::runner::PASS_SLICE`] in the operator): a server's pass permits change hands at least this often.
    pub slice: Duration,
}

impl PassSettings {
    /// What workers read of these settings ([`crate::keys::settings_key`]): `retryAfterMs` is an idle time every
    /// threshold of the backoff allows, so an entry given back with it is taken by the next pass.
    pub fn worker_settings(&self) -> WorkerSettings {
        let min_idle = self.min_idle.as_millis() as u64;
        let longest = self.backoff.map_or(0, |b| b.max.as_millis() as u64);
        WorkerSettings {
            min_idle_ms: min_idle,
            retry_after_ms: min_idle.max(longest),
            max_deliveries: self.max_deliveries,
            contract_version: Some(crate::keys::CONTRACT_VERSION),
        }
    }
}

/// Exponential spacing of retries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub factor: u32,
    pub max: Duration,
}

/// What one pass did, summed over its batches.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassReport {
    /// PEL entries looked at by the scan.
    pub scanned: usize,
    /// Of those, idle long enough to be taken by their own delivery count (backoff may still find a requeued copy
    /// not due, from the deliveries it carries).
    pub idle: usize,
    pub requeued: u64,
    pub reassigned: u64,
    pub dead_lettered: u64,
    pub payload_deleted: u64,
    /// Idle, but not due yet under backoff, or left alone by the strategy.
    pub skipped: u64,
    /// Too many fields to be moved by a script; left pending.
    pub too_large: u64,
    /// Older dead letters dropped by `deadLetter.maxLen` to make room.
    pub dead_letter_evicted: u64,
    /// `Reassign` needed the group's consumers listed and found this many, more than [`CONSUMERS_LISTED_MAX`]: it
    /// requeued instead (0: it did not).
    pub consumers_unlisted: u64,
    /// The pass stopped early because this replica may no longer write.
    pub interrupted: bool,
}

impl PassReport {
    pub fn moved(&self) -> u64 {
        self.requeued + self.reassigned + self.dead_lettered + self.payload_deleted
    }

    /// One line for an Event: "dead-lettered 12, requeued 30".
    pub fn summary(&self) -> String {
        [
            ("dead-lettered", self.dead_lettered),
            ("requeued", self.requeued),
            ("reassigned", self.reassigned),
            ("dropped with payload deleted", self.payload_deleted),
            ("left pending as too large to move", self.too_large),
            ("evicted from the dead-letter stream by maxLen", self.dead_letter_evicted),
        ]
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(what, n)| format!("{what} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
    }

    /// Adds another pass's (or batch's) counts to these.
    pub fn merge(&mut self, batch: &PassReport) {
        self.scanned += batch.scanned;
        self.idle += batch.idle;
        self.requeued += batch.requeued;
        self.reassigned += batch.reassigned;
        self.dead_lettered += batch.dead_lettered;
        self.payload_deleted += batch.payload_deleted;
        self.skipped += batch.skipped;
        self.too_large += batch.too_large;
        self.dead_letter_evicted += batch.dead_letter_evicted;
        self.consumers_unlisted = self.consumers_unlisted.max(batch.consumers_unlisted);
    }
}

/// What all the cursors of a process may remember of waiting copies together: 400,000 entries, about 20 MB (an
/// entry costs about 49 bytes). Forty policies waiting out an outage under backoff would otherwise keep 100,000
/// each (196 MB, most of the chart's 256 Mi): past this bound a cursor remembers no more, and the copies it does
/// not remember are read when the scan meets them and found not due there (more reading, the same outcome).
pub static REMEMBERED: Remembered = Remembered::new(400_000);

/// A count of remembered copies shared by cursors, with its bound.
#[derive(Debug)]
pub struct Remembered {
    used: AtomicUsize,
    max: usize,
}

impl Remembered {
    pub const fn new(max: usize) -> Remembered {
        Remembered { used: AtomicUsize::new(0), max }
    }

    /// Copies remembered now, by every cursor on this count.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    fn take_one(&self) -> bool {
        self.used.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| (n < self.max).then_some(n + 1)).is_ok()
    }

    fn give_back(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::Relaxed);
    }
}

/// Where a sweep of the PEL is, kept by the caller from one pass to the next.
#[derive(Debug)]
pub struct Cursor {
    /// The last entry id looked at; `None` at the start of a sweep.
    pub position: Option<String>,
    /// With backoff: requeued copies found not due, by id, with the deliveries each carries from before it was
    /// requeued (the scan sees only a copy's own count). Sent with the call whose page holds them, so the script
    /// leaves them alone without reading them until they are due. Bounded: cleared when it grows past
    /// [`Cursor::EARLIER_MAX`], and by what `remembered` has left for all cursors together.
    earlier: BTreeMap<StreamOrder, i64>,
    remembered: &'static Remembered,
    /// `spec.consumers.pods`: the consumers whose Pod is gone, as the sweep's start found them (at most
    /// [`GONE_MAX`]): their entries are taken whatever their idle time, and nothing is handed to them.
    pub gone: Vec<String>,
    /// When `gone` was listed. An entry such a consumer read after that (a StatefulSet Pod recreated under the same
    /// name during the sweep) is its new Pod's, and is not taken; `None`: listed now.
    pub gone_listed_at: Option<std::time::Instant>,
}

/// The most consumers without a Pod one sweep retries for; the next sweeps take the rest.
pub const GONE_MAX: usize = 100;

impl Default for Cursor {
    fn default() -> Cursor {
        Cursor::sharing(&REMEMBERED)
    }
}

impl Drop for Cursor {
    fn drop(&mut self) {
        self.remembered.give_back(self.earlier.len());
    }
}

/// An entry id as the stream orders it (`ms-seq`, numerically).
type StreamOrder = (u64, u64);

fn order(id: &str) -> StreamOrder {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
}

impl Cursor {
    const EARLIER_MAX: usize = 100_000;

    /// A cursor at the start, whose remembered copies count against `remembered`.
    pub fn sharing(remembered: &'static Remembered) -> Cursor {
        Cursor { position: None, earlier: BTreeMap::new(), remembered, gone: Vec::new(), gone_listed_at: None }
    }

    /// At the start of a sweep (the last pass reached the end of the PEL, or none ran yet).
    pub fn at_start(&self) -> bool {
        self.position.is_none()
    }

    /// The copies known to wait that the next page may hold: the first `limit` after the position.
    fn known(&self, limit: usize) -> Vec<(String, i64)> {
        let after = self.position.as_deref().map(order);
        let range = match after {
            Some(after) => self.earlier.range((Excluded(after), Unbounded)),
            None => self.earlier.range(..),
        };
        range.take(limit).map(|((ms, seq), earlier)| (format!("{ms}-{seq}"), *earlier)).collect()
    }

    /// Moves past a call's page, given the copies it was sent (`known`): forgets those the call read, and those
    /// its page should have held but did not (they left the PEL); learns the copies it found waiting.
    fn advance(&mut self, known: &[(String, i64)], call: Call) {
        let end = call.position.as_deref().map(order);
        for ((id, _), fate) in known.iter().zip(call.known.bytes()) {
            let id = order(id);
            let covered = call.reached_end || end.is_some_and(|end| id <= end);
            if (fate == b't' || (fate == b'-' && covered)) && self.earlier.remove(&id).is_some() {
                self.remembered.give_back(1);
            }
        }
        if self.earlier.len() + call.waiting.len() > Cursor::EARLIER_MAX {
            self.remembered.give_back(self.earlier.len());
            self.earlier.clear();
        }
        for (id, earlier) in &call.waiting {
            match self.earlier.entry(order(id)) {
                Entry::Occupied(mut known) => *known.get_mut() = *earlier,
                Entry::Vacant(slot) if self.remembered.take_one() => _ = slot.insert(*earlier),
                Entry::Vacant(_) => break,
            }
        }
        if call.reached_end {
            self.position = None;
        } else if call.position.is_some() {
            self.position = call.position;
        }
    }
}

/// One reclaim / dead-letter pass: script calls, each scanning the next page of the PEL from `cursor` (kept by the
/// caller across passes) and handling what is idle in it, on the server, in the same atomic call. At most
/// `max_per_pass` entries are looked at, so a pass costs the same on a PEL of a thousand or a million entries.
/// `cursor.position` becomes `None` when the scan reached the end of the PEL; the next pass starts over.
///
/// `may_write` is asked before every script call: when it says no (this replica lost its leadership), the pass
/// stops there, with `interrupted` set and the cursor where it was.
pub async fn reclaim_pass(
    conn: &mut Conn,
    server: &str,
    keys: &GroupKeys<'_>,
    settings: &PassSettings,
    cursor: &mut Cursor,
    may_write: &(dyn Fn() -> bool + Sync),
) -> Result<PassReport> {
    let mut report = PassReport::default();
    let started = std::time::Instant::now();
    while report.scanned < settings.max_per_pass && started.elapsed() < settings.slice {
        if !may_write() {
            report.interrupted = true;
            return Ok(report);
        }
        let limit = (settings.max_per_pass - report.scanned).min(SCAN);
        let known = cursor.known(limit);
        let gone_age = cursor.gone_listed_at.map_or(Duration::ZERO, |at| at.elapsed());
        let page = Page { after: cursor.position.as_deref(), limit, gone: &cursor.gone, gone_age, known: &known };
        let call = reclaim_call(conn, server, keys, settings, page).await?;
        report.merge(&call.report);
        let reached_end = call.reached_end;
        cursor.advance(&known, call);
        if reached_end {
            break;
        }
    }
    Ok(report)
}

/// What one script call did, and where its scan stopped.
struct Call {
    report: PassReport,
    /// The last PEL entry looked at; `None` when the call looked at none.
    position: Option<String>,
    reached_end: bool,
    /// What became of each copy the call was sent: `w` still waits, `t` read, `-` not in the page looked at.
    known: String,
    /// Requeued copies read and found not due yet, with the deliveries each carries from before.
    waiting: Vec<(String, i64)>,
}

/// What one script call looks at: at most `limit` PEL entries after `after` (from the PEL's start when `None`), with
/// the consumers whose Pod is gone and the copies known to carry earlier deliveries.
struct Page<'a> {
    after: Option<&'a str>,
    limit: usize,
    gone: &'a [String],
    /// How long ago `gone` was listed.
    gone_age: Duration,
    known: &'a [(String, i64)],
}

/// One script call, over one [`Page`].
async fn reclaim_call(
    conn: &mut Conn,
    server: &str,
    keys: &GroupKeys<'_>,
    settings: &PassSettings,
    page: Page<'_>,
) -> Result<Call> {
    let Page { after, limit, gone, gone_age, known } = page;
    let strategy = match settings.strategy {
        ReclaimStrategy::Requeue => "Requeue",
        ReclaimStrategy::Reassign => "Reassign",
        ReclaimStrategy::DeadLetterOnly => "DeadLetterOnly",
    };
    // invoke_async runs EVALSHA and loads the script again on NOSCRIPT (after a restart or failover).
    let sent = std::time::SystemTime::now();
    let reply: Vec<redis::Value> = RECLAIM
        .key(keys.stream)
        .key(keys.dead_letter)
        .key(totals_key(keys.stream, keys.group))
        .key(terminal_key(keys.stream, keys.group))
        .key(errors_key(keys.stream, keys.group))
        .key(handovers_key(keys.stream, keys.group))
        .key(consumers_key(keys.stream, keys.group))
        .arg(keys.group)
        .arg(settings.min_idle.as_millis() as u64)
        .arg(settings.max_deliveries)
        .arg(strategy)
        .arg(settings.dead_letter_max_len.unwrap_or(0))
        .arg(OPERATOR_CONSUMER)
        .arg(MAX_FIELDS)
        .arg(BYTE_BUDGET)
        .arg(settings.backoff.map_or(1, |b| b.factor))
        .arg(settings.backoff.map_or(0, |b| b.max.as_millis() as u64))
        .arg(ERROR_TEXT_MAX)
        .arg(after.map_or_else(|| "-".to_string(), |id| format!("({id}")))
        .arg(limit)
        .arg(settings.handover_grace.as_millis() as u64)
        .arg(gone_age.as_millis() as u64)
        .arg(CONSUMERS_LISTED_MAX)
        .arg(if traces::on() { "1" } else { "0" })
        .arg(gone.len())
        .arg(gone)
        .arg(known)
        .invoke_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))?;
    let number = |value: &redis::Value| match value {
        redis::Value::Int(n) => (*n).max(0),
        _ => 0,
    };
    let count = |i: usize| reply.get(i).map_or(0, number) as u64;
    let text = |i: usize| match reply.get(i) {
        Some(redis::Value::BulkString(bytes)) => String::from_utf8_lossy(bytes).into_owned(),
        _ => String::new(),
    };
    let position = Some(text(9)).filter(|id| !id.is_empty());
    if let Some(redis::Value::Array(moves)) = reply.get(13) {
        let place = Place { stream: keys.stream, group: Some(keys.group), redrive: None };
        traces::record(&place, &parse_moves(moves), sent);
    }
    // After the fourteen values: (id, earlier deliveries) of each requeued copy read and found not due yet.
    let waiting = reply
        .get(14..)
        .unwrap_or_default()
        .chunks_exact(2)
        .filter_map(|pair| match &pair[0] {
            redis::Value::BulkString(id) => Some((String::from_utf8_lossy(id).into_owned(), number(&pair[1]))),
            _ => None,
        })
        .collect();
    let report = PassReport {
        requeued: count(0),
        reassigned: count(1),
        dead_lettered: count(2),
        payload_deleted: count(3),
        skipped: count(4),
        too_large: count(5),
        scanned: count(6) as usize,
        dead_letter_evicted: count(7),
        idle: count(8) as usize,
        consumers_unlisted: count(12),
        interrupted: false,
    };
    Ok(Call { report, position, reached_end: count(10) == 1, known: text(11), waiting })
}

/// The reclaim script's moves (`{what, id, to, traceparent, tracestate, reason, deliveries}` each).
fn parse_moves(moves: &[redis::Value]) -> Vec<Move> {
    moves
        .iter()
        .filter_map(|m| {
            let (what, id, to, traceparent, tracestate, reason, deliveries): (
                String,
                String,
                String,
                String,
                String,
                String,
                u64,
            ) = redis::from_redis_value(m.clone()).ok()?;
            Some(Move { action: Action::from_script(&what)?, id, to, traceparent, tracestate, reason, deliveries })
        })
        .collect()
}

/// The most consumers Pelican lists in one call. Redis lists a group's consumers only all at once (`XINFO
/// CONSUMERS`), holding the server for as long as there are (300,000 took 97-151 ms on Redis 7.0, 190-456 ms on
/// Valkey 9.1; inside a script, where each is made a Lua table, several times that): past this number, nothing that
/// needs the list runs (consumer expiry, `spec.consumers.pods`; `Reassign` requeues instead) and the policy says so.
/// A thousand are listed in about a millisecond.
pub const CONSUMERS_LISTED_MAX: u64 = 1_000;

/// The group's consumers, from one `XINFO CONSUMERS` once `XINFO GROUPS` (which costs what the stream's groups
/// cost, not its consumers) told there are at most [`CONSUMERS_LISTED_MAX`]; `what` names the job that needs them,
/// for the error past that.
async fn listed_consumers(
    conn: &mut Conn,
    server: &str,
    keys: &GroupKeys<'_>,
    what: &'static str,
) -> Result<Vec<reply::Fields>> {
    let groups: Vec<redis::Value> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(keys.stream)
        .query_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))?;
    let count = groups
        .into_iter()
        .filter_map(reply::fields)
        .find(|g| reply::get::<String>(g, "name").as_deref() == Some(keys.group))
        .and_then(|g| reply::get::<u64>(&g, "consumers"))
        .unwrap_or(0);
    if count > CONSUMERS_LISTED_MAX {
        return Err(Error::TooManyConsumers {
            server: server.into(),
            stream: keys.stream.into(),
            group: keys.group.into(),
            count,
            max: CONSUMERS_LISTED_MAX,
            what,
        });
    }
    let listed: Vec<redis::Value> = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg(keys.stream)
        .arg(keys.group)
        .query_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))?;
    Ok(listed.into_iter().filter_map(reply::fields).collect())
}

/// The consumers of the group (the operator's own left out), when there are at most [`CONSUMERS_LISTED_MAX`].
pub async fn consumers(conn: &mut Conn, server: &str, keys: &GroupKeys<'_>) -> Result<Vec<String>> {
    let listed =
        listed_consumers(conn, server, keys, "spec.consumers.pods (taking a gone Pod's entries at once)").await?;
    let names = listed.iter().filter_map(|c| reply::get::<String>(c, "name"));
    Ok(names.filter(|name| name != OPERATOR_CONSUMER).collect())
}

/// Removes the named consumers that own no pending entry (`expire_consumers.lua`, which checks each again);
/// returns how many. At most [`GONE_MAX`] names.
pub async fn remove_consumers(conn: &mut Conn, server: &str, keys: &GroupKeys<'_>, names: &[String]) -> Result<u64> {
    EXPIRE_CONSUMERS
        .key(keys.stream)
        .key(totals_key(keys.stream, keys.group))
        .arg(keys.group)
        .arg(names)
        .invoke_async::<u64>(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))
}

/// Most consumers one call of `expire_consumers.lua` deletes, and one pass: a group that gained hundreds of
/// thousands of consumers (workers naming themselves per Pod start) is cleared over several passes, each call short.
const EXPIRE_BATCH: usize = 100;
const EXPIRE_PER_PASS: usize = 1000;

/// Deletes consumers idle for `expire_after` that own no pending entry; returns how many. The candidates come
/// from one `XINFO CONSUMERS` while there are at most [`CONSUMERS_LISTED_MAX`] consumers; the script checks each
/// again and deletes it, [`EXPIRE_BATCH`] a call, [`EXPIRE_PER_PASS`] a pass.
pub async fn expire_consumers(
    conn: &mut Conn,
    server: &str,
    keys: &GroupKeys<'_>,
    expire_after: Duration,
) -> Result<u64> {
    let listed = listed_consumers(conn, server, keys, "spec.consumers.expireAfter").await?;
    let idle_ms = expire_after.as_millis() as i64;
    let candidates: Vec<String> = listed
        .into_iter()
        .filter(|c| {
            reply::get::<i64>(c, "pending") == Some(0)
                && reply::get::<i64>(c, "idle").is_some_and(|idle| idle >= idle_ms)
        })
        .filter_map(|c| reply::get::<String>(&c, "name"))
        .take(EXPIRE_PER_PASS)
        .collect();
    let mut deleted = 0;
    for batch in candidates.chunks(EXPIRE_BATCH) {
        deleted += EXPIRE_CONSUMERS
            .key(keys.stream)
            .key(totals_key(keys.stream, keys.group))
            .arg(keys.group)
            .arg(batch)
            .invoke_async::<u64>(conn)
            .await
            .map_err(|e| Error::from_redis(server, e))?;
    }
    Ok(deleted)
}

/// What one retention trim did, and who stopped it from doing more.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trim {
    pub trimmed: u64,
    /// The group whose oldest pending entry, or whose read position, the trim stopped at; `None` when only
    /// `minAge` (or an empty stream, or one without groups) stopped it.
    pub pinned_by: Option<Pin>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pin {
    pub group: String,
    /// `true`: the group's oldest pending entry; `false`: the first entry the group has not read.
    pub pending: bool,
    pub id: String,
}

impl std::fmt::Display for Pin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.pending {
            write!(f, "group {} (oldest pending {})", self.group, self.id)
        } else {
            write!(f, "group {} (not read from {} on)", self.group, self.id)
        }
    }
}

/// Most entries one call of `trim_acknowledged.lua` frees: about a millisecond and a half of the server's time.
const TRIM_PER_CALL: u64 = 10_000;
/// A trim goes on, a call at a time, for at most this long; the next sweep's trim frees the rest.
const TRIM_SLICE: Duration = Duration::from_secs(1);

/// Trims, on the server, the entries every group of the stream acknowledged that are older than `min_age`, with
/// the safe-point method that works on Redis 7.0 and every Valkey (the script's header says how), each call atomic
/// and freeing at most [`TRIM_PER_CALL`] entries, calls following each other for at most [`TRIM_SLICE`];
/// `acked`: the server has `XTRIM ... ACKED` and checks every group itself too.
pub async fn trim_acknowledged(
    conn: &mut Conn,
    server: &str,
    keys: &GroupKeys<'_>,
    min_age: Duration,
    acked: bool,
) -> Result<Trim> {
    let started = std::time::Instant::now();
    let mut total = 0;
    loop {
        let (trimmed, group, why, id, more): (u64, String, String, String, u8) = TRIM_ACKNOWLEDGED
            .key(keys.stream)
            .key(totals_key(keys.stream, keys.group))
            .arg(min_age.as_millis() as u64)
            .arg(if acked { "1" } else { "0" })
            .arg(TRIM_PER_CALL)
            .invoke_async(conn)
            .await
            .map_err(|e| Error::from_redis(server, e))?;
        total += trimmed;
        if more == 0 || started.elapsed() >= TRIM_SLICE {
            let pinned_by = (!group.is_empty()).then(|| Pin { group, pending: why == "pending", id });
            return Ok(Trim { trimmed: total, pinned_by });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_names_only_what_happened() {
        let report = PassReport { dead_lettered: 12, requeued: 30, ..Default::default() };
        assert_eq!(report.summary(), "dead-lettered 12, requeued 30");
        assert_eq!(report.moved(), 42);
        assert_eq!(PassReport::default().summary(), "");
    }

    fn call(position: Option<&str>, reached_end: bool, known: &str, waiting: &[(&str, i64)]) -> Call {
        Call {
            report: PassReport::default(),
            position: position.map(String::from),
            reached_end,
            known: known.into(),
            waiting: waiting.iter().map(|(id, n)| (id.to_string(), *n)).collect(),
        }
    }

    fn ids(known: &[(String, i64)]) -> Vec<&str> {
        known.iter().map(|(id, _)| id.as_str()).collect()
    }

    #[test]
    fn the_cursor_sends_the_waiting_copies_after_its_position_in_stream_order() {
        let mut cursor = Cursor::default();
        // "10-0" sorts before "9-0" as text, after it as a stream id.
        cursor.advance(&[], call(Some("20-0"), false, "", &[("9-0", 2), ("10-0", 3), ("10-1", 1)]));
        assert_eq!(cursor.position.as_deref(), Some("20-0"));
        assert!(cursor.known(10).is_empty(), "nothing known after 20-0");
        cursor.position = None;
        assert_eq!(cursor.known(2), [("9-0".to_string(), 2), ("10-0".to_string(), 3)]);
        cursor.position = Some("9-0".into());
        assert_eq!(ids(&cursor.known(10)), ["10-0", "10-1"]);
    }

    #[test]
    fn a_page_keeps_the_copies_still_waiting_and_forgets_the_rest() {
        let mut cursor = Cursor::default();
        cursor.advance(&[], call(Some("9-0"), false, "", &[("2-0", 2), ("4-0", 2), ("7-0", 1)]));
        // The next sweep's first page ends at 5-0: 2-0 was read (and moved), 4-0 still waits, 7-0 is past the page.
        cursor.position = None;
        let known = cursor.known(256);
        assert_eq!(ids(&known), ["2-0", "4-0", "7-0"]);
        cursor.advance(&known, call(Some("5-0"), false, "tw-", &[]));
        assert_eq!(ids(&cursor.known(10)), ["7-0"], "after 5-0");
        // The last page: 7-0 was not in it (a consumer acknowledged it), so it is forgotten; the sweep starts over.
        let known = cursor.known(10);
        cursor.advance(&known, call(None, true, "-", &[]));
        assert!(cursor.at_start());
        assert_eq!(ids(&cursor.known(10)), ["4-0"]);
    }

    #[test]
    fn cursors_together_remember_no_more_than_their_shared_bound() {
        static SHARED: Remembered = Remembered::new(5);
        let waiting = |ids: &[&'static str]| ids.iter().map(|id| (*id, 2)).collect::<Vec<_>>();
        let mut first = Cursor::sharing(&SHARED);
        first.advance(&[], call(Some("9-0"), false, "", &waiting(&["1-0", "2-0", "3-0"])));
        let mut second = Cursor::sharing(&SHARED);
        second.advance(&[], call(Some("9-0"), false, "", &waiting(&["4-0", "5-0", "6-0", "7-0"])));
        assert_eq!(SHARED.used(), 5);
        second.position = None;
        assert_eq!(ids(&second.known(10)), ["4-0", "5-0"], "the second remembers what was left, in stream order");
        // A copy read leaves the cursor and frees its place; a cursor dropped frees all of its.
        first.position = None;
        let known = first.known(10);
        first.advance(&known, call(Some("1-0"), false, "t", &[]));
        assert_eq!(SHARED.used(), 4);
        drop(first);
        assert_eq!(SHARED.used(), 2);
        second.advance(&[], call(Some("9-0"), false, "", &waiting(&["8-0"])));
        assert_eq!(SHARED.used(), 3);
    }
}
