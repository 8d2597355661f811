//! What Pelican costs a Redis server in memory (issue 66), on each server of the bed, Redis 7.0 first: per pending
//! entry, per consumer, per recorded error, per dead letter, per retry, and one policy's own keys. Every figure is
//! given twice: `MEMORY USAGE <key> SAMPLES 0` (the server's own estimate of the key, every node counted; for a PEL
//! an estimate from node counts) and the `used_memory` delta of `INFO memory` across the step (what the allocator
//! really gave), both divided by the count. The entries are what the operator's pass really writes:
//! `jobs::reclaim_pass` moves them, as in `tests/reclaim.rs`.
//!
//!   scripts/testenv up && cargo bench --bench capacity [-- <entries> <policies>]
//!
//! Defaults: 10,000 entries of `n` and a 100-byte `body`, 1,000 policies. It writes only `{cap...}` keys and
//! deletes them; the `used_memory` deltas want a server nobody else writes to meanwhile.

use std::time::{Duration, Instant};

use pelican::api::ReclaimStrategy;
use pelican::jobs::{self, Cursor, PassSettings};
use pelican::keys::{consumers_key, creator_key, errors_key, settings_key, terminal_key, totals_key};
use pelican::redis::{Conn, GroupKeys, Pools, ServerInfo, Target};
use support::{bed_var, deliver_all, fill_stream};

mod support;

const STREAM: &str = "{cap}:orders";
const DLQ: &str = "{cap}:orders:dead";
const GROUP: &str = "workers";
const BODY: usize = 100;
const IDLE: Duration = Duration::from_millis(50);
/// A consumer named as the SDK names it, after its Pod (a Deployment's: 30 characters).
const POD: &str = "orders-worker-5d8f7c9b6d";

/// `INFO memory` `used_memory`, once nothing waits to be freed in the background (Valkey frees large keys lazily).
async fn used_memory(conn: &mut Conn) -> i64 {
    loop {
        let info: String = redis::cmd("INFO").arg("memory").query_async(conn).await.unwrap();
        let field = |name: &str| {
            info.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().parse::<i64>().ok()).unwrap_or(0)
        };
        if field("lazyfree_pending_objects") == 0 {
            return field("used_memory");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `MEMORY USAGE <key> SAMPLES 0`: 0 when the key does not exist.
async fn memory_usage(conn: &mut Conn, key: &str) -> i64 {
    let usage: Option<i64> =
        redis::cmd("MEMORY").arg("USAGE").arg(key).arg("SAMPLES").arg(0).query_async(conn).await.unwrap();
    usage.unwrap_or(0)
}

async fn del(conn: &mut Conn, keys: &[String]) {
    for chunk in keys.chunks(1000) {
        let _: () = redis::cmd("DEL").arg(chunk).query_async(conn).await.unwrap();
    }
}

/// One figure: bytes per item by `MEMORY USAGE` and by `used_memory`.
struct Figure {
    what: String,
    usage: f64,
    used: f64,
}

fn figure(what: &str, usage: i64, used: i64, count: usize) -> Figure {
    Figure { what: what.to_string(), usage: usage as f64 / count as f64, used: used as f64 / count as f64 }
}

fn pass_settings(strategy: ReclaimStrategy, max_deliveries: u32, max_per_pass: usize) -> PassSettings {
    PassSettings {
        min_idle: IDLE,
        max_per_pass,
        max_deliveries,
        strategy,
        dead_letter_max_len: None,
        backoff: None,
        handover_grace: Duration::ZERO,
        slice: Duration::MAX,
    }
}

async fn pass(conn: &mut Conn, keys: &GroupKeys<'_>, settings: &PassSettings) -> jobs::PassReport {
    jobs::reclaim_pass(conn, "bench", keys, settings, &mut Cursor::default(), &|| true).await.unwrap()
}

fn the_keys() -> GroupKeys<'static> {
    GroupKeys { stream: STREAM, group: GROUP, dead_letter: DLQ }
}

/// A key of Pelican's for a stream's group, as `pelican::keys` names it.
type KeyOf = fn(&str, &str) -> String;

fn group_keys(stream: &str, group: &str) -> Vec<String> {
    [totals_key, terminal_key, errors_key, consumers_key, settings_key, creator_key]
        .iter()
        .map(|key| key(stream, group))
        .collect()
}

async fn clean(conn: &mut Conn) {
    let mut keys = group_keys(STREAM, GROUP);
    keys.extend([STREAM.to_string(), DLQ.to_string()]);
    del(conn, &keys).await;
}

/// The ids of the group's pending entries.
async fn pending_ids(conn: &mut Conn, count: usize) -> Vec<String> {
    let pending: Vec<(String, String, i64, i64)> =
        redis::cmd("XPENDING").arg(STREAM).arg(GROUP).arg("-").arg("+").arg(count).query_async(conn).await.unwrap();
    pending.into_iter().map(|(id, ..)| id).collect()
}

/// A stream of `entries`, every one delivered and left pending: the application's entries, a pending entry each, and
/// a retry each (a Requeue pass, which appends a copy at the tail and acknowledges the original).
async fn pending_and_retries(conn: &mut Conn, entries: usize) -> Vec<Figure> {
    clean(conn).await;
    let before = used_memory(conn).await;
    fill_stream(conn, STREAM, GROUP, entries, BODY).await;
    let (stream, filled) = (memory_usage(conn, STREAM).await, used_memory(conn).await);
    deliver_all(conn, STREAM, GROUP, entries).await;
    let (pel, delivered) = (memory_usage(conn, STREAM).await, used_memory(conn).await);
    tokio::time::sleep(IDLE * 2).await;
    let report = pass(conn, &the_keys(), &pass_settings(ReclaimStrategy::Requeue, 10, entries)).await;
    assert_eq!(report.requeued as usize, entries, "{report:?}");
    let (copies, requeued) = (memory_usage(conn, STREAM).await, used_memory(conn).await);
    let length: usize = redis::cmd("XLEN").arg(STREAM).query_async(conn).await.unwrap();
    assert_eq!(length, 2 * entries, "a retry appends a copy and leaves the original in the stream");
    clean(conn).await;
    vec![
        figure("stream entry (n + 100-byte body), the application's", stream, filled - before, entries),
        figure("pending entry (PEL), one consumer", pel - stream, delivered - filled, entries),
        // Against the stream before delivery: the PEL is empty again, the originals stay, the copies are added.
        figure("retry (Requeue): the copy at the tail", copies - stream, requeued - filled, entries),
    ]
}

/// `retries` retries made while the application adds entries: one new entry, then one pass that requeues one
/// entry, in turn, so that copies and new entries share the stream's nodes, and a copy's field names are stored with
/// it whenever its node began with the other shape. Per retry, the stream's growth less the new entries' own cost
/// (`entry`, measured on a stream of new entries alone), with every pending entry acknowledged at both ends.
async fn interleaved_retries(conn: &mut Conn, entries: usize, retries: usize, entry: &Figure) -> Figure {
    clean(conn).await;
    fill_stream(conn, STREAM, GROUP, entries, BODY).await;
    let (stream, filled) = (memory_usage(conn, STREAM).await, used_memory(conn).await);
    deliver_all(conn, STREAM, GROUP, entries).await;
    tokio::time::sleep(IDLE * 2).await;
    let body = "x".repeat(BODY);
    let settings = pass_settings(ReclaimStrategy::Requeue, 10, 1);
    for n in 0..retries {
        let _: String = redis::cmd("XADD")
            .arg(STREAM)
            .arg("*")
            .arg("n")
            .arg(n)
            .arg("body")
            .arg(&body)
            .query_async(conn)
            .await
            .unwrap();
        assert_eq!(pass(conn, &the_keys(), &settings).await.requeued, 1);
    }
    for ids in pending_ids(conn, entries).await.chunks(1000) {
        let _: () = redis::cmd("XACK").arg(STREAM).arg(GROUP).arg(ids).query_async(conn).await.unwrap();
    }
    let (grown, used) = (memory_usage(conn, STREAM).await, used_memory(conn).await);
    clean(conn).await;
    let less = |total: i64, per_entry: f64| total as f64 - per_entry * retries as f64;
    Figure {
        what: "retry, a new entry between each: the copy at the tail".into(),
        usage: less(grown - stream, entry.usage) / retries as f64,
        used: less(used - filled, entry.used) / retries as f64,
    }
}

/// A group of `count` consumers that own nothing, each with its worker's heartbeat (as the contract's lease.lua
/// writes it at every lease tick).
async fn consumers(conn: &mut Conn, count: usize) -> Vec<Figure> {
    clean(conn).await;
    fill_stream(conn, STREAM, GROUP, 1, BODY).await;
    let (stream, before) = (memory_usage(conn, STREAM).await, used_memory(conn).await);
    let names: Vec<String> = (0..count).map(|i| format!("{POD}-{i:05}")).collect();
    let mut pipe = redis::pipe();
    for name in &names {
        pipe.cmd("XGROUP").arg("CREATECONSUMER").arg(STREAM).arg(GROUP).arg(name).ignore();
    }
    let _: () = pipe.query_async(conn).await.unwrap();
    let (with_consumers, created) = (memory_usage(conn, STREAM).await, used_memory(conn).await);
    let (seconds, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    let now = seconds * 1000 + micros / 1000;
    let heartbeats = consumers_key(STREAM, GROUP);
    let mut pipe = redis::pipe();
    for name in &names {
        pipe.cmd("HSET").arg(&heartbeats).arg(name).arg(now).ignore();
    }
    let _: () = pipe.query_async(conn).await.unwrap();
    let (beats, beaten) = (memory_usage(conn, &heartbeats).await, used_memory(conn).await);
    clean(conn).await;
    vec![
        figure("consumer in the group (owning nothing)", with_consumers - stream, created - before, count),
        figure("its worker's heartbeat (a field of :consumers)", beats, beaten - created, count),
    ]
}

/// What the dead letters of `entries` cost.
struct Letters {
    /// Bytes of the error the last delivery recorded (0: none).
    error_len: usize,
    /// One entry in `every` recorded it: with 2, the dead letters alternate between two shapes (with and without
    /// `pelican-last-error`), and a stream stores field names once per node only for entries of the node's first
    /// entry's shape.
    every: usize,
    max_len: Option<u64>,
}

/// `entries` dead letters as `letters` says: the errors hash before the pass, the dead-letter stream after it (what
/// it keeps under `maxLen`).
async fn dead_letters(conn: &mut Conn, entries: usize, letters: Letters) -> (Figure, Figure) {
    let Letters { error_len, every, max_len } = letters;
    clean(conn).await;
    fill_stream(conn, STREAM, GROUP, entries, BODY).await;
    deliver_all(conn, STREAM, GROUP, entries).await;
    let before = used_memory(conn).await;
    let errors = errors_key(STREAM, GROUP);
    if error_len > 0 {
        let text = "e".repeat(error_len);
        for ids in pending_ids(conn, entries).await.chunks(1000) {
            let mut pipe = redis::pipe();
            for id in ids.iter().step_by(every) {
                pipe.cmd("HSET").arg(&errors).arg(id).arg(&text).ignore();
            }
            let _: () = pipe.query_async(conn).await.unwrap();
        }
    }
    let (recorded, written) = (memory_usage(conn, &errors).await, used_memory(conn).await);
    tokio::time::sleep(IDLE * 2).await;
    let settings = PassSettings { dead_letter_max_len: max_len, ..pass_settings(ReclaimStrategy::Requeue, 1, entries) };
    let report = pass(conn, &the_keys(), &settings).await;
    assert_eq!(report.dead_lettered as usize, entries, "{report:?}");
    assert_eq!(memory_usage(conn, &errors).await, 0, "a dead-lettered entry's error leaves the errors hash");
    let kept: usize = redis::cmd("XLEN").arg(DLQ).query_async(conn).await.unwrap();
    let letters = memory_usage(conn, DLQ).await;
    // What the dead-letter stream holds, by what deleting it frees.
    let held = used_memory(conn).await;
    del(conn, &[DLQ.to_string()]).await;
    let freed = held - used_memory(conn).await;
    clean(conn).await;
    let error = figure(
        &format!("recorded error of {error_len} bytes (errors hash)"),
        recorded,
        written - before,
        entries.div_ceil(every),
    );
    let what = match (error_len, every, max_len) {
        (0, _, None) => "dead letter, no error recorded".to_string(),
        (_, 1, None) => format!("dead letter with a {error_len}-byte pelican-last-error"),
        (_, _, None) => format!("dead letter, one in {every} with a {error_len}-byte error (mixed shapes)"),
        (_, _, Some(cap)) => format!("dead-letter stream under maxLen {cap}: {kept} kept, per entry"),
    };
    (error, figure(&what, letters, freed, kept))
}

/// `count` policies on streams of two entries each: what Pelican adds for each once it ran (the group and its
/// creator, the settings, two workers' heartbeats, one entry read and dead-lettered: the counters and the dead-letter
/// stream), one policy's keys by `MEMORY USAGE`, and the server CPU of an idle pass per policy.
async fn policies(conn: &mut Conn, count: usize) -> (Vec<Figure>, Figure, Duration, Duration) {
    let streams: Vec<String> = (0..count).map(|i| format!("{{cap-{i}}}:orders")).collect();
    let dead: Vec<String> = streams.iter().map(|s| format!("{s}:dead")).collect();
    let all_keys =
        || streams.iter().zip(&dead).flat_map(|(s, d)| [s.clone(), d.clone()].into_iter().chain(group_keys(s, GROUP)));
    del(conn, &all_keys().collect::<Vec<_>>()).await;
    let mut pipe = redis::pipe();
    for stream in &streams {
        pipe.cmd("XADD").arg(stream).arg("*").arg("n").arg(0).arg("body").arg("x".repeat(BODY)).ignore();
    }
    let _: () = pipe.query_async(conn).await.unwrap();
    let application = memory_usage(conn, &streams[0]).await;
    let before = used_memory(conn).await;
    let settings = pass_settings(ReclaimStrategy::Requeue, 1, 1000);
    let (seconds, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    let now = seconds * 1000 + micros / 1000;
    for (stream, dead) in streams.iter().zip(&dead) {
        let keys = GroupKeys { stream, group: GROUP, dead_letter: dead };
        pelican::redis::ensure_group(conn, "bench", &keys, "0", false, "policy-uid-0123456789abcdef01234567")
            .await
            .unwrap();
        pelican::redis::publish_settings(conn, "bench", stream, GROUP, settings.worker_settings(), None).await.unwrap();
        let mut pipe = redis::pipe();
        pipe.cmd("HSET")
            .arg(consumers_key(stream, GROUP))
            .arg(format!("{POD}-00001"))
            .arg(now)
            .arg(format!("{POD}-00002"))
            .arg(now)
            .ignore();
        pipe.cmd("XREADGROUP")
            .arg("GROUP")
            .arg(GROUP)
            .arg(format!("{POD}-00001"))
            .arg("COUNT")
            .arg(1)
            .arg("STREAMS")
            .arg(stream)
            .arg(">")
            .ignore();
        let _: () = pipe.query_async(conn).await.unwrap();
    }
    let with_group = memory_usage(conn, &streams[0]).await;
    tokio::time::sleep(IDLE * 2).await;
    for (stream, dead) in streams.iter().zip(&dead) {
        let keys = GroupKeys { stream, group: GROUP, dead_letter: dead };
        assert_eq!(pass(conn, &keys, &settings).await.dead_lettered, 1);
    }
    let after = used_memory(conn).await;
    let total =
        Figure { what: "one policy in all".into(), usage: f64::NAN, used: (after - before) as f64 / count as f64 };

    // An idle pass (nothing pending) of each policy: the server's CPU time and the wall time.
    let cpu = async |conn: &mut Conn| {
        let info: String = redis::cmd("INFO").arg("cpu").query_async(conn).await.unwrap();
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        Duration::from_secs_f64(field("used_cpu_sys") + field("used_cpu_user"))
    };
    let cpu_before = cpu(conn).await;
    let started = Instant::now();
    for (stream, dead) in streams.iter().zip(&dead) {
        let keys = GroupKeys { stream, group: GROUP, dead_letter: dead };
        assert_eq!(pass(conn, &keys, &settings).await.moved(), 0);
    }
    let wall = started.elapsed() / count as u32;
    let server_cpu = cpu(conn).await.saturating_sub(cpu_before) / count as u32;

    // Each key of one policy by MEMORY USAGE, and by what deleting that key of every policy frees.
    let mut keys = Vec::new();
    let group = async |conn: &mut Conn| {
        let mut pipe = redis::pipe();
        for stream in &streams {
            pipe.cmd("XGROUP").arg("DESTROY").arg(stream).arg(GROUP).ignore();
        }
        let _: () = pipe.query_async(conn).await.unwrap();
    };
    let held = used_memory(conn).await;
    group(conn).await;
    let freed = held - used_memory(conn).await;
    keys.push(Figure {
        what: "the group in the stream, one consumer".into(),
        usage: (with_group - application) as f64,
        used: freed as f64 / count as f64,
    });
    let kinds: [(&str, KeyOf); 5] = [
        (":creator", creator_key),
        (":settings", settings_key),
        (":consumers (heartbeats), two workers", consumers_key),
        (":totals", totals_key),
        (":terminal", terminal_key),
    ];
    for (what, key) in kinds {
        let usage = memory_usage(conn, &key(&streams[0], GROUP)).await;
        let held = used_memory(conn).await;
        del(conn, &streams.iter().map(|s| key(s, GROUP)).collect::<Vec<_>>()).await;
        let freed = held - used_memory(conn).await;
        keys.push(Figure { what: what.into(), usage: usage as f64, used: freed as f64 / count as f64 });
    }
    let usage = memory_usage(conn, &dead[0]).await;
    let held = used_memory(conn).await;
    del(conn, &dead).await;
    let freed = held - used_memory(conn).await;
    keys.push(Figure {
        what: "the dead-letter stream, one letter".into(),
        usage: usage as f64,
        used: freed as f64 / count as f64,
    });
    del(conn, &all_keys().collect::<Vec<_>>()).await;
    (keys, total, server_cpu, wall)
}

/// Everything one server gives: the per-item figures, one policy's keys, its total, an idle pass's CPU and wall time.
struct Measured {
    server: String,
    items: Vec<Figure>,
    keys: Vec<Figure>,
    total: Figure,
    pass_cpu: Duration,
    pass_wall: Duration,
}

async fn measure(conn: &mut Conn, entries: usize, policy_count: usize) -> Measured {
    let info: String = redis::cmd("INFO").arg("server").query_async(conn).await.unwrap();
    let server = ServerInfo::parse(&info).to_string();
    // Loads the scripts first, so that the script cache is not counted in the first step.
    fill_stream(conn, STREAM, GROUP, 1, BODY).await;
    pass(conn, &the_keys(), &pass_settings(ReclaimStrategy::Requeue, 1, 1)).await;
    let mut items = pending_and_retries(conn, entries).await;
    let interleaved = interleaved_retries(conn, entries, 1000.min(entries), &items[0]).await;
    items.push(interleaved);
    items.extend(consumers(conn, 1000).await);
    let mut errors = Vec::new();
    let mut letters = Vec::new();
    for (error_len, every, max_len) in
        [(0, 1, None), (100, 1, None), (1000, 1, None), (100, 2, None), (0, 1, Some(1000))]
    {
        let (error, letter) = dead_letters(conn, entries, Letters { error_len, every, max_len }).await;
        if error_len > 0 && every == 1 {
            errors.push(error);
        }
        letters.push(letter);
    }
    items.extend(errors);
    items.extend(letters);
    let (keys, total, pass_cpu, pass_wall) = policies(conn, policy_count).await;
    Measured { server, items, keys, total, pass_cpu, pass_wall }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let entries = args.first().copied().unwrap_or(10_000);
    let policy_count = args.get(1).copied().unwrap_or(1_000);
    let pools = Pools::default();
    let mut measured = Vec::new();
    for var in ["PELICAN_REDIS_URL", "PELICAN_VALKEY_URL"] {
        let mut conn = pools.get(&Target::new(bed_var(var))).await.unwrap();
        measured.push(measure(&mut conn, entries, policy_count).await);
    }
    let cell = |x: f64| if x.is_nan() { "-".to_string() } else { format!("{x:.0}") };
    let header = |title: &str| {
        print!("{title:<62}");
        for m in &measured {
            print!(" {:>22}", m.server);
        }
        println!();
        print!("{:<62}", "");
        for _ in &measured {
            print!(" {:>10} {:>11}", "usage", "used_memory");
        }
        println!();
    };
    let row = |what: &str, figures: Vec<&Figure>| {
        print!("{what:<62}");
        for f in figures {
            print!(" {:>10} {:>11}", cell(f.usage), cell(f.used));
        }
        println!();
    };
    println!(
        "bytes per item, {entries} entries of a {BODY}-byte body (usage: MEMORY USAGE SAMPLES 0; used_memory: INFO delta)"
    );
    header("");
    for (i, f) in measured[0].items.iter().enumerate() {
        row(&f.what, measured.iter().map(|m| &m.items[i]).collect());
    }
    println!();
    println!("one policy's own keys, bytes ({policy_count} policies, each two workers and one dead letter)");
    header("");
    for (i, f) in measured[0].keys.iter().enumerate() {
        row(&f.what, measured.iter().map(|m| &m.keys[i]).collect());
    }
    row(&measured[0].total.what, measured.iter().map(|m| &m.total).collect());
    println!();
    print!("{:<62}", "an idle pass per policy: server CPU / wall, microseconds");
    for m in &measured {
        print!(" {:>10} {:>11}", m.pass_cpu.as_micros(), m.pass_wall.as_micros());
    }
    println!();
}
