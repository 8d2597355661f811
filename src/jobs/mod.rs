//! The jobs Redis never runs by itself: the reclaim / dead-letter pass, consumer expiry and
//! the trim of what every group acknowledged.

pub mod redrive;

use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;

use crate::api::ReclaimStrategy;
use crate::keys::{ERROR_TEXT_MAX, OPERATOR_CONSUMER, errors_key, terminal_key, totals_key};
use crate::redis::{Conn, GroupKeys};
use crate::{Error, Result};

static RECLAIM: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/reclaim.lua")));
static EXPIRE_CONSUMERS: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/expire_consumers.lua")));
static TRIM_ACKNOWLEDGED: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/trim_acknowledged.lua")));

/// Ids handed to one script call: small enough to keep each call short on the server, large enough to amortise
/// the round trip.
pub const BATCH: usize = 128;

/// Bytes of entry data one script call may copy before it stops and leaves the rest of its ids to the next call:
/// a script blocks the whole server, and 128 entries of 2 MB each would hold it for a quarter of a gigabyte.
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
}

/// Exponential spacing of retries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub factor: u32,
    pub max: Duration,
}

impl PassSettings {
    /// How long an entry delivered `deliveries` times must be idle before the pass takes it:
    /// `min(max, minIdle * factor^(deliveries-1))`, or `minIdle` without backoff. The reclaim script computes the
    /// same from the message's whole count (a requeued copy's earlier deliveries included).
    pub fn threshold(&self, deliveries: i64) -> Duration {
        let Some(backoff) = self.backoff else { return self.min_idle };
        let exponent = deliveries.clamp(1, 64) as u32 - 1;
        let growth = (backoff.factor as u128).saturating_pow(exponent);
        let millis = (self.min_idle.as_millis()).saturating_mul(growth);
        Duration::from_millis(millis.min(backoff.max.as_millis()) as u64).max(self.min_idle)
    }
}

/// What one pass did, summed over its batches.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassReport {
    /// PEL entries looked at by the scan.
    pub scanned: usize,
    /// Of those, idle long enough to be handed to the script.
    pub idle: usize,
    pub requeued: u64,
    pub reassigned: u64,
    pub dead_lettered: u64,
    pub payload_deleted: u64,
    /// Idle at scan time but touched by a consumer since, or left alone by the strategy.
    pub skipped: u64,
    /// Too many fields to be moved by a script; left pending.
    pub too_large: u64,
    /// Older dead letters dropped by `deadLetter.maxLen` to make room.
    pub dead_letter_evicted: u64,
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
    }
}

/// Where a sweep of the PEL is, kept by the caller from one pass to the next.
#[derive(Clone, Debug, Default)]
pub struct Cursor {
    /// The last entry id looked at; `None` at the start of a sweep.
    pub position: Option<String>,
    /// With backoff: the deliveries a requeued copy carries from before it was requeued, learned from the script
    /// when it found the copy not due yet, so that later scans leave the copy alone until its own threshold (the
    /// scan sees only the copy's own count). Bounded: cleared when it grows past [`Cursor::EARLIER_MAX`].
    earlier: HashMap<String, i64>,
}

impl Cursor {
    const EARLIER_MAX: usize = 100_000;

    /// At the start of a sweep (the last pass reached the end of the PEL, or none ran yet).
    pub fn at_start(&self) -> bool {
        self.position.is_none()
    }
}

/// One reclaim / dead-letter pass. Pages through the PEL from `cursor` (kept by the caller across passes) with
/// plain extended XPENDING, never the IDLE filter, which scans the whole PEL on the server. At most
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
    let mut waiting = Vec::new();
    let mut batch = Vec::with_capacity(BATCH);
    while report.scanned < settings.max_per_pass {
        let want = (settings.max_per_pass - report.scanned).min(BATCH * 2);
        let start = cursor.position.as_ref().map_or_else(|| "-".to_string(), |id| format!("({id}"));
        let page: Vec<(String, String, i64, i64)> = redis::cmd("XPENDING")
            .arg(keys.stream)
            .arg(keys.group)
            .arg(&start)
            .arg("+")
            .arg(want)
            .query_async(conn)
            .await
            .map_err(|e| Error::from_redis(server, e))?;
        report.scanned += page.len();
        let reached_end = page.len() < want;
        cursor.position = page.last().map(|(id, ..)| id.clone()).or(cursor.position.take());
        for (id, _, idle_ms, deliveries) in page {
            // The entry's own count, plus what a requeued copy carries when an earlier pass learned it: a lower bound
            // of its threshold, and the script (which reads the copy's fields) has the last word.
            let earlier = cursor.earlier.get(&id).copied().unwrap_or(0);
            if idle_ms >= settings.threshold(deliveries + earlier).as_millis() as i64 {
                report.idle += 1;
                batch.push(id);
                if batch.len() == BATCH {
                    if !may_write() {
                        report.interrupted = true;
                        return Ok(report);
                    }
                    report.merge(&reclaim_batch(conn, server, keys, settings, &batch, &mut waiting).await?);
                    batch.clear();
                }
            }
        }
        if reached_end {
            cursor.position = None;
            break;
        }
    }
    if !batch.is_empty() {
        if !may_write() {
            report.interrupted = true;
            return Ok(report);
        }
        report.merge(&reclaim_batch(conn, server, keys, settings, &batch, &mut waiting).await?);
    }
    if cursor.earlier.len() + waiting.len() > Cursor::EARLIER_MAX {
        cursor.earlier.clear();
    }
    cursor.earlier.extend(waiting);
    Ok(report)
}

/// Hands `ids` to the reclaim script, which re-checks each one on the server before it moves anything. The script
/// stops at its byte budget; the ids it did not reach go in the next call. Requeued copies it found not due yet
/// are added to `waiting` with the deliveries they carry from before.
pub async fn reclaim_batch(
    conn: &mut Conn,
    server: &str,
    keys: &GroupKeys<'_>,
    settings: &PassSettings,
    ids: &[String],
    waiting: &mut Vec<(String, i64)>,
) -> Result<PassReport> {
    let mut report = PassReport::default();
    let mut rest = ids;
    while !rest.is_empty() {
        let (call, handled) = reclaim_call(conn, server, keys, settings, rest, waiting).await?;
        report.merge(&call);
        rest = &rest[handled.clamp(1, rest.len())..];
    }
    Ok(report)
}

/// One script call: what it did, and how many of `ids` it looked at.
async fn reclaim_call(
    conn: &mut Conn,
    server: &str,
    keys: &GroupKeys<'_>,
    settings: &PassSettings,
    ids: &[String],
    waiting: &mut Vec<(String, i64)>,
) -> Result<(PassReport, usize)> {
    let strategy = match settings.strategy {
        ReclaimStrategy::Requeue => "Requeue",
        ReclaimStrategy::Reassign => "Reassign",
        ReclaimStrategy::DeadLetterOnly => "DeadLetterOnly",
    };
    // invoke_async runs EVALSHA and loads the script again on NOSCRIPT (after a restart or failover).
    let reply: Vec<redis::Value> = RECLAIM
        .key(keys.stream)
        .key(keys.dead_letter)
        .key(totals_key(keys.stream, keys.group))
        .key(terminal_key(keys.stream, keys.group))
        .key(errors_key(keys.stream, keys.group))
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
        .arg(ids)
        .invoke_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))?;
    let number = |value: &redis::Value| match value {
        redis::Value::Int(n) => *n,
        _ => 0,
    };
    let count = |i: usize| reply.get(i).map_or(0, number) as u64;
    // After the eight counts: (id, earlier deliveries) of each requeued copy not due yet.
    for pair in reply.get(8..).unwrap_or_default().chunks_exact(2) {
        if let redis::Value::BulkString(id) = &pair[0] {
            waiting.push((String::from_utf8_lossy(id).into_owned(), number(&pair[1])));
        }
    }
    let report = PassReport {
        requeued: count(0),
        reassigned: count(1),
        dead_lettered: count(2),
        payload_deleted: count(3),
        skipped: count(4),
        too_large: count(5),
        dead_letter_evicted: count(7),
        ..PassReport::default()
    };
    Ok((report, count(6) as usize))
}

/// Deletes consumers inactive for `expire_after` that own no pending entry; returns how many.
pub async fn expire_consumers(
    conn: &mut Conn,
    server: &str,
    keys: &GroupKeys<'_>,
    expire_after: Duration,
) -> Result<u64> {
    EXPIRE_CONSUMERS
        .key(keys.stream)
        .key(totals_key(keys.stream, keys.group))
        .arg(keys.group)
        .arg(expire_after.as_millis() as u64)
        .invoke_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))
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

/// Trims, atomically on the server, the entries every group of the stream acknowledged that are older than
/// `min_age`, with the safe-point method that works on Redis 7.0 and every Valkey (the script's header says how).
pub async fn trim_acknowledged(conn: &mut Conn, server: &str, keys: &GroupKeys<'_>, min_age: Duration) -> Result<Trim> {
    let (trimmed, group, why, id): (u64, String, String, String) = TRIM_ACKNOWLEDGED
        .key(keys.stream)
        .key(totals_key(keys.stream, keys.group))
        .arg(min_age.as_millis() as u64)
        .invoke_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))?;
    let pinned_by = (!group.is_empty()).then(|| Pin { group, pending: why == "pending", id });
    Ok(Trim { trimmed, pinned_by })
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

    fn settings(backoff: Option<Backoff>) -> PassSettings {
        PassSettings {
            min_idle: Duration::from_secs(1),
            max_per_pass: 1000,
            max_deliveries: 5,
            strategy: ReclaimStrategy::Requeue,
            dead_letter_max_len: None,
            backoff,
        }
    }

    #[test]
    fn the_threshold_grows_by_the_factor_per_delivery_up_to_max() {
        let s = settings(Some(Backoff { factor: 2, max: Duration::from_secs(8) }));
        let waits: Vec<u64> = (1..=6).map(|n| s.threshold(n).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 8, 8]);
        // A count the server cannot have (0) reads as the first delivery; a huge one does not overflow.
        assert_eq!(s.threshold(0), Duration::from_secs(1));
        assert_eq!(s.threshold(1_000_000), Duration::from_secs(8));
    }

    #[test]
    fn without_backoff_or_with_factor_one_every_wait_is_min_idle() {
        assert_eq!(settings(None).threshold(7), Duration::from_secs(1));
        let flat = settings(Some(Backoff { factor: 1, max: Duration::from_secs(60) }));
        assert_eq!(flat.threshold(7), Duration::from_secs(1));
    }
}
