//! Consumer group administration and the O(1) status probe
//!.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::LazyLock;
use std::time::Duration;

use redis::{Script, Value, pipe};

use super::Conn;
use super::reply::{self, Fields};
use crate::keys::{
    WorkerSettings, bounds_key, creator_key, idempotence_key, legacy_keys, owner_key, rejected_key, settings_key,
    terminal_key, totals_key,
};
use crate::{Error, Result};

static CARRY_OVER_COUNTERS: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/carry_over_counters.lua")));
static IDEMPOTENCE_WINDOW: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/idempotence_window.lua")));
static DESTROY_GROUP: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/destroy_group.lua")));
static CLAIM_GROUP: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/claim_group.lua")));
static PUBLISH_SETTINGS: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/publish_settings.lua")));

/// Which server answers, from `INFO server`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerInfo {
    /// `redis` or `valkey`.
    pub flavor: &'static str,
    pub version: String,
}

impl ServerInfo {
    pub fn parse(info: &str) -> ServerInfo {
        let field = |name: &str| {
            info.lines().find_map(|line| line.trim().strip_prefix(name)?.strip_prefix(':').map(str::to_string))
        };
        match field("valkey_version") {
            Some(version) => ServerInfo { flavor: "valkey", version },
            None => ServerInfo { flavor: "redis", version: field("redis_version").unwrap_or_default() },
        }
    }

    fn major_minor(&self) -> (u32, u32) {
        let mut parts = self.version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
    }

    /// Redis >= 7.0 (XAUTOCLAIM JUSTID, XINFO lag) and Valkey >= 7.2.
    pub fn is_supported(&self) -> bool {
        match self.flavor {
            "valkey" => self.major_minor() >= (7, 2),
            _ => self.major_minor() >= (7, 0),
        }
    }
}

impl fmt::Display for ServerInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.flavor, self.version)
    }
}

/// The keys one policy touches.
#[derive(Clone, Debug)]
pub struct GroupKeys<'a> {
    pub stream: &'a str,
    pub group: &'a str,
    pub dead_letter: &'a str,
}

/// What `ensure_group` found and did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSetup {
    pub server: ServerInfo,
    /// The group did not exist and was created now.
    pub created: bool,
    /// Counter fields carried over from the 0.1 keys.
    pub carried_over: u64,
}

/// Checks the server and the key types before any write, carries the 0.1 counters over when `carry_over` says no
/// other policy could own them, then creates the group if it is missing
/// (`XGROUP CREATE <stream> <group> <startId> MKSTREAM`) and records `creator` (the policy's uid) as the one who made
/// it ([`creator_key`]).
pub async fn ensure_group(
    conn: &mut Conn,
    server: &str,
    keys: &GroupKeys<'_>,
    start_id: &str,
    carry_over: bool,
    creator: &str,
) -> Result<GroupSetup> {
    let totals = totals_key(keys.stream, keys.group);
    let terminal = terminal_key(keys.stream, keys.group);
    let [legacy_totals, legacy_terminal] = legacy_keys(keys.stream, keys.group);
    type Types = (String, String, String, String, String, String, String);
    let (info, stream_type, dead_letter_type, totals_type, terminal_type, legacy_totals_type, legacy_terminal_type): Types =
        pipe()
            .cmd("INFO")
            .arg("server")
            .cmd("TYPE")
            .arg(keys.stream)
            .cmd("TYPE")
            .arg(keys.dead_letter)
            .cmd("TYPE")
            .arg(&totals)
            .cmd("TYPE")
            .arg(&terminal)
            .cmd("TYPE")
            .arg(&legacy_totals)
            .cmd("TYPE")
            .arg(&legacy_terminal)
            .query_async(conn)
            .await
            .map_err(|e| Error::from_redis(server, e))?;
    let info = ServerInfo::parse(&info);
    if !info.is_supported() {
        return Err(Error::UnsupportedServerVersion { server: server.into(), version: info.to_string() });
    }
    expect_type(keys.stream, &stream_type, "stream")?;
    expect_type(keys.dead_letter, &dead_letter_type, "stream")?;
    expect_type(&totals, &totals_type, "hash")?;
    expect_type(&terminal, &terminal_type, "hash")?;

    let legacy_present = [&legacy_totals_type, &legacy_terminal_type].iter().any(|t| *t == "hash");
    let carried_over = if carry_over && legacy_present {
        CARRY_OVER_COUNTERS
            .key(&legacy_totals)
            .key(&totals)
            .key(&legacy_terminal)
            .key(&terminal)
            .invoke_async(conn)
            .await
            .map_err(|e| Error::from_redis(server, e))?
    } else {
        0
    };
    let exists =
        stream_type == "stream" && group_names(conn, server, keys.stream).await?.iter().any(|g| g == keys.group);
    if exists {
        return Ok(GroupSetup { server: info, created: false, carried_over });
    }
    if start_id != "$" && start_id != "0" {
        let (seconds, micros): (u64, u64) =
            redis::cmd("TIME").query_async(conn).await.map_err(|e| Error::from_redis(server, e))?;
        check_start_id(start_id, seconds * 1000 + micros / 1000)?;
    }
    let created: redis::RedisResult<()> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(keys.stream)
        .arg(keys.group)
        .arg(start_id)
        .arg("MKSTREAM")
        .query_async(conn)
        .await;
    match created {
        Ok(()) => {
            // After the create: an operator stopped in between leaves a group with no creator, which a `Delete`
            // policy then retains (the safe side).
            redis::cmd("SET")
                .arg(creator_key(keys.stream, keys.group))
                .arg(creator)
                .query_async::<()>(conn)
                .await
                .map_err(|e| Error::from_redis(server, e))?;
            Ok(GroupSetup { server: info, created: true, carried_over })
        }
        // Another writer created it between our check and our create: it exists, which is all we want.
        Err(e) if e.code() == Some("BUSYGROUP") => Ok(GroupSetup { server: info, created: false, carried_over }),
        // Keys and types were checked above: a plain ERR here is about the id (out of the range of stream ids).
        Err(e) if e.code() == Some("ERR") => Err(Error::InvalidStartId {
            start_id: start_id.to_string(),
            why: format!("{server} refused it ({}); use $, 0 or an id of the stream", e.detail().unwrap_or_default()),
        }),
        Err(e) => Err(Error::from_redis(server, e)),
    }
}

/// A group created at an id ahead of the server's clock receives nothing until the clock gets there: entries added
/// meanwhile get smaller ids and are skipped. Refused before the group exists.
fn check_start_id(start_id: &str, server_time_ms: u64) -> Result<()> {
    let millis = start_id.split('-').next().and_then(|ms| ms.parse::<u64>().ok());
    match millis {
        Some(ms) if ms > server_time_ms => Err(Error::InvalidStartId {
            start_id: start_id.to_string(),
            why: format!(
                "it lies {} ahead of the server's clock, so the group would skip every entry added until then; use $, \
                 0 or an id the stream already has",
                humanize_ms(ms - server_time_ms)
            ),
        }),
        _ => Ok(()),
    }
}

fn humanize_ms(ms: u64) -> String {
    match ms / 1000 {
        s if s < 120 => format!("{s} s"),
        s if s < 7200 => format!("{} min", s / 60),
        s if s < 172_800 => format!("{} h", s / 3600),
        s => format!("{} days", s / 86_400),
    }
}

fn expect_type(key: &str, actual: &str, expected: &str) -> Result<()> {
    if actual == "none" || actual == expected { Ok(()) } else { Err(Error::wrong_key_type(key, actual, expected)) }
}

async fn group_names(conn: &mut Conn, server: &str, stream: &str) -> Result<Vec<String>> {
    let groups: Vec<Value> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))?;
    Ok(groups.into_iter().filter_map(reply::fields).filter_map(|g| reply::get::<String>(&g, "name")).collect())
}

/// Pending entries acknowledged, and consumers deleted, per call of `destroy_group.lua` before the group goes.
const DESTROY_BATCH: usize = 1000;

/// `XGROUP DESTROY` of the group of a deleted policy with `deletionPolicy: Delete` (`uid`), when that policy created
/// the group or `adopt`s it (`scripts/destroy_group.lua`), taken apart a bounded step per call first. The streams
/// themselves are never deleted.
pub async fn destroy_group(
    conn: &mut Conn,
    server: &str,
    stream: &str,
    group: &str,
    uid: &str,
    adopt: bool,
) -> Result<Destroyed> {
    let mut call = DESTROY_GROUP.prepare_invoke();
    call.key(stream)
        .key(creator_key(stream, group))
        .key(settings_key(stream, group))
        .arg(group)
        .arg(uid)
        .arg(if adopt { "1" } else { "0" })
        .arg(DESTROY_BATCH);
    let reply = loop {
        let reply: Vec<String> = call.invoke_async(conn).await.map_err(|e| Error::from_redis(server, e))?;
        if reply.first().map(String::as_str) != Some("step") {
            break reply;
        }
    };
    match reply.as_slice() {
        [done] if done == "destroyed" => Ok(Destroyed::Destroyed),
        [absent] if absent == "absent" => Ok(Destroyed::Absent),
        [retained, creator] if retained == "retained" => Ok(Destroyed::Retained { creator: creator.clone() }),
        other => Err(Error::UnexpectedReply {
            server: server.to_string(),
            detail: format!("the group-destroy script answered {other:?}"),
        }),
    }
}

/// What `destroy_group` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Destroyed {
    Destroyed,
    /// No such stream or group.
    Absent,
    /// Not made by this policy, which does not adopt it: left as it is. `creator` is the uid of the policy that
    /// made it, or empty when none did.
    Retained {
        creator: String,
    },
}

/// Sets the group's field of the stream's bounds hash to `backlog.maxLength`: `HSET` when the policy
/// bounds the group, `HDEL` when it does not (any more). Producers see the change with their next publish.
pub async fn set_bound(conn: &mut Conn, server: &str, stream: &str, group: &str, max: Option<i64>) -> Result<()> {
    let key = bounds_key(stream);
    let mut cmd = match max {
        Some(_) => redis::cmd("HSET"),
        None => redis::cmd("HDEL"),
    };
    cmd.arg(&key).arg(group);
    if let Some(max) = max {
        cmd.arg(max);
    }
    cmd.query_async::<()>(conn).await.map_err(|e| Error::from_redis(server, e))
}

/// How long a policy's declared window of idempotent production counts without being said again: a deleted policy
/// whose cleanup never reached the server stops widening the window after this.
const IDEMPOTENCE_DECLARATION_LASTS: Duration = Duration::from_secs(30 * 60);
/// The most declarations of one stream read (one per policy of the stream).
const IDEMPOTENCE_DECLARATIONS_READ: u64 = 100;

/// Says the policy's (`uid`) window of idempotent production to the server and answers the window in force there,
/// over every policy of the stream however it names the server, with whether this call set it (`XCFGSET`, Redis
/// 8.6+, which clears the server's record of producers and message ids: run only when the stream's window differs;
/// `scripts/idempotence_window.lua`).
pub async fn agree_idempotence(
    conn: &mut Conn,
    server: &str,
    stream: &str,
    uid: &str,
    seconds: i64,
    max_size: i64,
) -> Result<(i64, i64, bool)> {
    let (seconds, max_size, set): (i64, i64, u8) = IDEMPOTENCE_WINDOW
        .key(stream)
        .key(idempotence_key(stream))
        .arg(uid)
        .arg(seconds)
        .arg(max_size)
        .arg(IDEMPOTENCE_DECLARATION_LASTS.as_millis() as u64)
        .arg(IDEMPOTENCE_DECLARATIONS_READ)
        .invoke_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))?;
    Ok((seconds, max_size, set == 1))
}

/// Withdraws a deleted policy's declared window (see [`agree_idempotence`]); the window in force stays.
pub async fn withdraw_idempotence(conn: &mut Conn, server: &str, stream: &str, uid: &str) -> Result<()> {
    redis::cmd("HDEL")
        .arg(idempotence_key(stream))
        .arg(uid)
        .query_async::<()>(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))
}

/// How long a lowered `minIdle` waits before the passes apply it: workers re-read the settings at every lease tick,
/// at least every 10 s (contract/README.md), so by then every worker leases at the new pace, with room to spare for
/// a busy machine.
pub const MIN_IDLE_HOLD: Duration = Duration::from_secs(60);

/// The `minIdle` the passes may apply now, from [`publish_settings`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PassMinIdle {
    pub min_idle: Duration,
    /// How long until the published value applies (zero: it does now); the policy is looked at again by then.
    pub held_for: Duration,
}

/// What a topic's own settings key carries besides a stream's settings (SPEC 22): its partition count and ordering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TopicSettings {
    pub partitions: u32,
    pub ordering: crate::api::Ordering,
    /// The retries' spacing a `PerKey` worker keeps in place: `minIdleMs * factor^(n-1)`, at most `max_ms` (factor 1
    /// and no most without a backoff).
    pub backoff_factor: u32,
    pub backoff_max_ms: u64,
}

/// Who runs a group's jobs, as [`claim_group`] found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// This install: the claim taken or renewed for its lifetime.
    Ours,
    /// Another install (its id), whose claim lapses in `left` unless it renews it.
    Theirs { owner: String, left: Duration },
    /// Nobody (a passive install only looks).
    Nobody,
}

/// Claims the group for the install `me` for `lifetime`, or with `passive` only looks who holds it
/// ([`owner_key`], `scripts/claim_group.lua`).
pub async fn claim_group(
    conn: &mut Conn,
    server: &str,
    (stream, group): (&str, &str),
    me: &str,
    lifetime: Duration,
    passive: bool,
) -> Result<Claim> {
    let reply: Vec<Value> = CLAIM_GROUP
        .key(owner_key(stream, group))
        .arg(me)
        .arg(lifetime.as_millis() as u64)
        .arg(if passive { "look" } else { "claim" })
        .invoke_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))?;
    let int = |v: &Value| redis::from_redis_value_ref::<i64>(v).ok();
    match reply.as_slice() {
        [held, _] if int(held) == Some(1) => Ok(Claim::Ours),
        [_, owner, left] => {
            let owner: String = redis::from_redis_value_ref(owner).unwrap_or_default();
            let left = Duration::from_millis(int(left).unwrap_or(0).max(0) as u64);
            Ok(if owner.is_empty() { Claim::Nobody } else { Claim::Theirs { owner, left } })
        }
        _ => Err(Error::UnexpectedReply { server: server.into(), detail: format!("claim_group.lua: {reply:?}") }),
    }
}

/// Publishes the group's settings for workers ([`settings_key`]) when they changed, and answers the `minIdle` the
/// passes may apply: a lowered one only [`MIN_IDLE_HOLD`] after it was published (`scripts/publish_settings.lua`).
/// `topic`: `stream` is a topic's name, and its settings key also says how many partitions and which ordering.
pub async fn publish_settings(
    conn: &mut Conn,
    server: &str,
    stream: &str,
    group: &str,
    settings: WorkerSettings,
    topic: Option<TopicSettings>,
) -> Result<PassMinIdle> {
    let mut call = PUBLISH_SETTINGS.prepare_invoke();
    call.key(settings_key(stream, group))
        .arg(settings.min_idle_ms)
        .arg(settings.retry_after_ms)
        .arg(settings.max_deliveries)
        .arg(settings.contract_version.unwrap_or(crate::keys::CONTRACT_VERSION))
        .arg(MIN_IDLE_HOLD.as_millis() as u64);
    if let Some(topic) = topic {
        call.arg(topic.partitions).arg(topic.ordering.name()).arg(topic.backoff_factor).arg(topic.backoff_max_ms);
    }
    let (min_idle, held_for): (u64, u64) = call.invoke_async(conn).await.map_err(|e| Error::from_redis(server, e))?;
    Ok(PassMinIdle { min_idle: Duration::from_millis(min_idle), held_for: Duration::from_millis(held_for) })
}

/// Describes the topic for its producers, whatever the group: `partitions` and `contractVersion` in
/// `{T}:pelican:T:topic` (contract/README.md, "The partition of a key"). Every policy of the topic writes the same.
pub async fn describe_topic(conn: &mut Conn, server: &str, topic: &str, partitions: u32) -> Result<()> {
    redis::cmd("HSET")
        .arg(crate::keys::topic_key(topic))
        .arg("partitions")
        .arg(partitions)
        .arg("contractVersion")
        .arg(crate::keys::TOPIC_CONTRACT_VERSION)
        .query_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))
}

/// The primary (`host:port`) serving each slot range of a Cluster, as `(first slot, last slot, primary)`, from
/// one `CLUSTER SLOTS`: where a topic's partitions live.
pub async fn slot_primaries(conn: &mut Conn, server: &str) -> Result<Vec<(u16, u16, String)>> {
    let ranges: Vec<Value> =
        redis::cmd("CLUSTER").arg("SLOTS").query_async(conn).await.map_err(|e| Error::from_redis(server, e))?;
    let primary = |range: &Value| -> Option<(u16, u16, String)> {
        let Value::Array(parts) = range else { return None };
        let [first, last, Value::Array(node), ..] = parts.as_slice() else { return None };
        let [host, port, ..] = node.as_slice() else { return None };
        let host: String = redis::from_redis_value_ref(host).ok()?;
        let port: u16 = redis::from_redis_value_ref(port).ok()?;
        Some((
            redis::from_redis_value_ref(first).ok()?,
            redis::from_redis_value_ref(last).ok()?,
            format!("{host}:{port}"),
        ))
    };
    Ok(ranges.iter().filter_map(primary).collect())
}

/// The oldest entry of the group's PEL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OldestPending {
    pub id: String,
    pub consumer: String,
    pub idle_ms: i64,
    pub deliveries: i64,
}

impl OldestPending {
    /// Milliseconds part of the entry id, when the id is time based (`<ms>-<seq>`).
    pub fn id_millis(&self) -> Option<i64> {
        id_millis(&self.id)
    }
}

/// Everything the status shows, read in one round trip whose cost does not depend on the PEL size (and one
/// `XRANGE ... COUNT 1` for the oldest unread entry while the group has something to read).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupFacts {
    /// The stream has the group (`XINFO GROUPS`).
    pub has_group: bool,
    pub stream_length: i64,
    pub lag: Option<i64>,
    pub pending: i64,
    pub oldest_pending: Option<OldestPending>,
    /// Consumers of the group, the operator's own consumer excluded.
    pub consumers: i64,
    pub dead_letter_length: i64,
    pub totals: BTreeMap<String, i64>,
    pub terminal: BTreeMap<String, i64>,
    /// Publishes refused for this group by the bounded-publish script.
    pub publish_rejected: i64,
    /// The group's field of the stream's bounds hash, as stored.
    pub bound: Option<String>,
    /// The stream's other groups, by name.
    pub other_groups: Vec<String>,
    pub server_time_ms: i64,
    /// Entries ever added to the stream (`XINFO STREAM` `entries-added`).
    pub entries_added: Option<i64>,
    /// Idempotent production on the stream (`XINFO STREAM`, servers with `XADD ... IDMP`).
    pub idempotence: Option<crate::api::IdempotenceStatus>,
    /// Entries the group has read (`XINFO GROUPS` `entries-read`); absent when the server cannot tell.
    pub entries_read: Option<i64>,
    /// Milliseconds part of the id of the oldest entry the group has not read yet (the first entry after its
    /// `last-delivered-id`); absent when nothing is unread.
    pub oldest_unread_ms: Option<i64>,
    /// What `oldest_unread_ms` was read at, for the next probe (`None` when nothing was unread).
    pub unread: Option<Unread>,
}

/// The oldest unread entry and what it depends on: the group's position and the stream's `entries-added`, length
/// and `max-deleted-entry-id`. While none of them changes (a group that reads nothing, a stream nobody writes), the
/// next probe knows the answer without the `XRANGE`: only reading, seeking, adding, deleting or trimming can change
/// which entry comes first after the position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unread {
    position: String,
    added: Option<i64>,
    length: i64,
    deleted: Option<String>,
    oldest_ms: Option<i64>,
}

impl GroupFacts {
    /// Age in seconds of the oldest entry the group has not read: server time minus the time in its id; 0 when
    /// nothing is unread (or the id lies ahead of the server's clock).
    pub fn lag_seconds(&self) -> i64 {
        self.oldest_unread_ms.map_or(0, |ms| (self.server_time_ms - ms).max(0) / 1000)
    }
}

/// Milliseconds part of a stream id (`<ms>-<seq>`, or `<ms>` alone).
pub fn id_millis(id: &str) -> Option<i64> {
    id.split_once('-').map_or(id, |(ms, _)| ms).parse().ok()
}

/// The time (milliseconds part of the id) of the first entry after `last_delivered`: the oldest entry a group at
/// that position has not read. One `XRANGE (<id> + COUNT 1`, skipped when the lag says nothing is unread; an entry
/// deleted or trimmed is not there, so the next one counts.
pub async fn oldest_unread_ms(
    conn: &mut Conn,
    server: &str,
    stream: &str,
    last_delivered: Option<&str>,
    lag: Option<i64>,
) -> Result<Option<i64>> {
    if lag == Some(0) {
        return Ok(None);
    }
    let after = format!("({}", last_delivered.unwrap_or("0-0"));
    let next: Vec<(String, Value)> = redis::cmd("XRANGE")
        .arg(stream)
        .arg(after)
        .arg("+")
        .arg("COUNT")
        .arg(1)
        .query_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))?;
    Ok(next.first().and_then(|(id, _)| id_millis(id)))
}

/// XINFO STREAM, XINFO GROUPS, XPENDING - + 1, XLEN, HGETALL x2, HGET x2, TIME.
type ProbeReply = (
    Value,
    Vec<Value>,
    Vec<Value>,
    i64,
    BTreeMap<String, String>,
    BTreeMap<String, String>,
    Option<String>,
    Option<String>,
    (String, String),
);

/// Counter hashes as numbers. Any client can write a field; one that holds no integer is no count and is left out
/// (the scripts start it again from their next count), rather than failing the whole probe.
fn counts(hash: BTreeMap<String, String>) -> BTreeMap<String, i64> {
    hash.into_iter().filter_map(|(field, value)| Some((field, value.parse().ok()?))).collect()
}

/// The `idmp-*`, `pids-*` and `iids-*` fields of `XINFO STREAM`: all of them, or none (a server without `IDMP`).
fn idempotence(stream_info: &Fields) -> Option<crate::api::IdempotenceStatus> {
    let field = |name: &str| reply::get::<i64>(stream_info, name);
    Some(crate::api::IdempotenceStatus {
        duration_seconds: field("idmp-duration")?,
        max_size: field("idmp-maxsize")?,
        producers: field("pids-tracked")?,
        message_ids: field("iids-tracked")?,
        added: field("iids-added")?,
        duplicates: field("iids-duplicates")?,
    })
}

/// `previous`: what the last probe of this group found unread ([`GroupFacts::unread`]), to skip the `XRANGE` when
/// nothing it depends on changed.
pub async fn probe_group(
    conn: &mut Conn,
    server: &str,
    keys: &GroupKeys<'_>,
    previous: Option<&Unread>,
) -> Result<GroupFacts> {
    let (stream_info, groups, oldest, dead_letter_length, totals, terminal, rejected, bound, time): ProbeReply = pipe()
        .cmd("XINFO")
        .arg("STREAM")
        .arg(keys.stream)
        .cmd("XINFO")
        .arg("GROUPS")
        .arg(keys.stream)
        .cmd("XPENDING")
        .arg(keys.stream)
        .arg(keys.group)
        .arg("-")
        .arg("+")
        .arg(1)
        .cmd("XLEN")
        .arg(keys.dead_letter)
        .cmd("HGETALL")
        .arg(totals_key(keys.stream, keys.group))
        .cmd("HGETALL")
        .arg(terminal_key(keys.stream, keys.group))
        .cmd("HGET")
        .arg(rejected_key(keys.stream))
        .arg(keys.group)
        .cmd("HGET")
        .arg(bounds_key(keys.stream))
        .arg(keys.group)
        .cmd("TIME")
        .query_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))?;

    let stream_info = reply::fields(stream_info).unwrap_or_default();
    let (mut group, mut other_groups, mut has_group) = (Fields::default(), Vec::new(), false);
    for fields in groups.into_iter().filter_map(reply::fields) {
        match reply::get::<String>(&fields, "name") {
            Some(name) if name == keys.group => (group, has_group) = (fields, true),
            Some(name) => other_groups.push(name),
            None => {}
        }
    }
    let oldest_pending = oldest.into_iter().next().and_then(|entry| {
        let (id, consumer, idle_ms, deliveries): (String, String, i64, i64) = redis::from_redis_value(entry).ok()?;
        Some(OldestPending { id, consumer, idle_ms, deliveries })
    });
    let (seconds, micros) = time;
    let server_time_ms = seconds.parse::<i64>().unwrap_or(0) * 1000 + micros.parse::<i64>().unwrap_or(0) / 1000;
    let lag = reply::get(&group, "lag");
    let stream_length = reply::get(&stream_info, "length").unwrap_or(0);
    let unread = match reply::get::<String>(&group, "last-delivered-id") {
        Some(position) if lag != Some(0) => {
            let mut now = Unread {
                position,
                added: reply::get(&stream_info, "entries-added"),
                length: stream_length,
                deleted: reply::get(&stream_info, "max-deleted-entry-id"),
                oldest_ms: None,
            };
            now.oldest_ms = match previous {
                Some(before) if Unread { oldest_ms: None, ..before.clone() } == now => before.oldest_ms,
                _ => oldest_unread_ms(conn, server, keys.stream, Some(&now.position), lag).await?,
            };
            Some(now)
        }
        _ => None,
    };
    let oldest_unread_ms = unread.as_ref().and_then(|u| u.oldest_ms);

    Ok(GroupFacts {
        has_group,
        stream_length,
        lag,
        pending: reply::get(&group, "pending").unwrap_or(0),
        oldest_pending,
        // From XINFO GROUPS: listing the consumers only to count them cost the server as much as there are.
        consumers: reply::get(&group, "consumers").unwrap_or(0),
        dead_letter_length,
        totals: counts(totals),
        terminal: counts(terminal),
        publish_rejected: rejected.and_then(|n| n.parse().ok()).unwrap_or(0),
        bound,
        other_groups,
        server_time_ms,
        entries_added: reply::get(&stream_info, "entries-added"),
        idempotence: idempotence(&stream_info),
        entries_read: reply::get(&group, "entries-read"),
        oldest_unread_ms,
        unread,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_id_ahead_of_the_server_clock_is_refused() {
        let now = 1_764_421_200_000;
        assert!(check_start_id("1764421200000-5", now).is_ok());
        assert!(check_start_id("17", now).is_ok());
        let error = check_start_id("1864421200000-0", now).unwrap_err();
        assert_eq!(error.reason(), "InvalidStartId");
        assert!(error.to_string().contains("1157 days ahead"), "{error}");
    }

    #[test]
    fn recognises_valkey_by_its_own_version_field() {
        let info = "# Server\r\nredis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:9.1.2\r\n";
        let server = ServerInfo::parse(info);
        assert_eq!(server.to_string(), "valkey 9.1.2");
        assert!(server.is_supported());
    }

    #[test]
    fn redis_before_7_is_unsupported() {
        assert!(!ServerInfo::parse("redis_version:6.2.14\r\n").is_supported());
        assert!(ServerInfo::parse("redis_version:7.0.15\r\n").is_supported());
    }

    #[test]
    fn oldest_pending_time_comes_from_the_id() {
        let entry = OldestPending { id: "1764421200000-3".into(), consumer: "c".into(), idle_ms: 0, deliveries: 1 };
        assert_eq!(entry.id_millis(), Some(1_764_421_200_000));
    }
}
