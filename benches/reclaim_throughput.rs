//! Dead-letter / requeue throughput, printed side by side in one run on the same server (each the median of three
//! rounds taken in turn):
//! Pelican's scripted pass, the naive loop a user writes by hand (one XCLAIM of the idle ids per pass, then XPENDING + XADD +
//! XACK round trips per message), and `redis-benchmark` XADD as the server's ceiling. Then the cost of a pass that finds
//! nothing idle on a small and on a huge PEL, which must be the same (bounded by maxPerPass). Last, `retry.backoff`:
//! a PEL of 100,000 entries of which 1 % are due, one pass without backoff and passes with it, on the same PEL.
//!
//!   scripts/testenv up && cargo bench --bench reclaim_throughput [-- <entries> <big-pel>]
//!
//! Ends with one `SUMMARY dead-letter` line per server (reference: redis-benchmark XADD), Redis 7.0 first.

use std::process::Command;
use std::time::{Duration, Instant};

use pelican::api::ReclaimStrategy;
use pelican::jobs::{self, Backoff, Cursor, PassSettings};
use pelican::redis::{Conn, GroupKeys, Pools, Target};
use support::{bed_var, deliver_all, fill_stream};

mod support;

const STREAM: &str = "{bench}:in";
const DLQ: &str = "{bench}:dlq";
const GROUP: &str = "g";
const IDLE: Duration = Duration::from_millis(50);

/// A fresh stream of `size` entries (about 120 bytes each), all delivered and idle, and no counters.
async fn fill_pel(conn: &mut Conn, size: usize) {
    let _: () = redis::cmd("DEL")
        .arg(DLQ)
        .arg(pelican::keys::totals_key(STREAM, GROUP))
        .arg(pelican::keys::terminal_key(STREAM, GROUP))
        .query_async(conn)
        .await
        .unwrap();
    fill_stream(conn, STREAM, GROUP, size, 100).await;
    deliver_all(conn, STREAM, GROUP, size).await;
    tokio::time::sleep(IDLE * 2).await;
}

async fn pelican_pass(conn: &mut Conn, size: usize, strategy: ReclaimStrategy, max_deliveries: u32) -> f64 {
    fill_pel(conn, size).await;
    let keys = GroupKeys { stream: STREAM, group: GROUP, dead_letter: DLQ };
    let settings = PassSettings {
        min_idle: IDLE,
        max_per_pass: size,
        max_deliveries,
        strategy,
        dead_letter_max_len: None,
        backoff: None,
        handover_grace: Duration::ZERO,
        slice: Duration::MAX,
    };
    let start = Instant::now();
    let report = jobs::reclaim_pass(conn, "bench", &keys, &settings, &mut Cursor::default(), &|| true).await.unwrap();
    let elapsed = start.elapsed();
    assert_eq!(report.moved() as usize, size, "{report:?}");
    size as f64 / elapsed.as_secs_f64()
}

/// Seed 001's scheduler: claim the idle entries, then per message XPENDING (delivery count), XADD, XACK.
async fn naive_loop(conn: &mut Conn, size: usize) -> f64 {
    fill_pel(conn, size).await;
    let start = Instant::now();
    let pending: Vec<(String, String, i64, i64)> = redis::cmd("XPENDING")
        .arg(STREAM)
        .arg(GROUP)
        .arg("IDLE")
        .arg(IDLE.as_millis() as u64)
        .arg("-")
        .arg("+")
        .arg(size)
        .query_async(conn)
        .await
        .unwrap();
    // Seed 001's scheduler claims what it found once per pass, then makes three round trips per message.
    let ids: Vec<&String> = pending.iter().map(|(id, ..)| id).collect();
    let mut claimed: Vec<(String, Vec<(String, String)>)> = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(1000) {
        let page: Vec<(String, Vec<(String, String)>)> = redis::cmd("XCLAIM")
            .arg(STREAM)
            .arg(GROUP)
            .arg("scheduler")
            .arg(IDLE.as_millis() as u64)
            .arg(chunk)
            .query_async(conn)
            .await
            .unwrap();
        claimed.extend(page);
    }
    for (id, fields) in &claimed {
        let info: Vec<(String, String, i64, i64)> =
            redis::cmd("XPENDING").arg(STREAM).arg(GROUP).arg(id).arg(id).arg(1).query_async(conn).await.unwrap();
        let mut add = redis::cmd("XADD");
        add.arg(DLQ).arg("*");
        for (k, v) in fields {
            add.arg(k).arg(v);
        }
        add.arg("stream").arg(STREAM).arg("id").arg(id).arg("deliveries").arg(info[0].3);
        let _: String = add.query_async(conn).await.unwrap();
        let _: i64 = redis::cmd("XACK").arg(STREAM).arg(GROUP).arg(id).query_async(conn).await.unwrap();
    }
    assert_eq!(pending.len(), size);
    size as f64 / start.elapsed().as_secs_f64()
}

/// `redis-benchmark` XADD with its defaults (50 clients, no pipelining): requests per second.
fn redis_benchmark_xadd(port: &str) -> f64 {
    let body = "x".repeat(100);
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", port, "-n", "200000", "-q", "XADD", "{bench}:rb", "*", "n", "1", "body", &body])
        .output()
        .expect("redis-benchmark (Debian's redis-tools) must be installed: scripts/testenv up installs it");
    let text = String::from_utf8_lossy(&out.stdout);
    // "XADD {bench}:rb * n 1 body xxx: 98716.68 requests per second, p50=0.263 msec"
    let rps = text
        .rsplit("requests per second")
        .nth(1)
        .and_then(|s| s.rsplit(':').next())
        .and_then(|s| s.trim().parse().ok());
    rps.unwrap_or_else(|| panic!("could not read redis-benchmark output: {text}"))
}

/// One pass over a PEL where nothing is idle: it looks at maxPerPass entries and stops.
async fn idle_scan(conn: &mut Conn, pel: usize) -> Duration {
    fill_pel(conn, pel).await;
    let keys = GroupKeys { stream: STREAM, group: GROUP, dead_letter: DLQ };
    let settings = PassSettings {
        min_idle: Duration::from_secs(3600),
        max_per_pass: 1000,
        max_deliveries: 3,
        strategy: ReclaimStrategy::Requeue,
        dead_letter_max_len: None,
        backoff: None,
        handover_grace: Duration::ZERO,
        slice: Duration::MAX,
    };
    let mut best = Duration::MAX;
    let mut cursor = Cursor::default();
    for _ in 0..20 {
        let start = Instant::now();
        let report = jobs::reclaim_pass(conn, "bench", &keys, &settings, &mut cursor, &|| true).await.unwrap();
        best = best.min(start.elapsed());
        assert_eq!(report.scanned, 1000.min(pel));
        cursor = Cursor::default();
    }
    best
}

/// A PEL of `size` entries, 1 % due: originals delivered once and idle about 30 s, and requeued copies (carrying
/// two earlier deliveries, so delivered 3 times in all) delivered once and idle about 8 s. Without backoff
/// (`minIdle` 20 s) only the originals are due; with `minIdle` 5 s, factor 2, the copies' threshold is 20 s, so the
/// same ones are due, but the scan (which sees a copy's own count, 1) cannot tell until the script has read the copy
/// once. The margins are seconds wide, so the time the fill and the pass take does not change what is due.
async fn backoff_pel(conn: &mut Conn, size: usize) {
    let due = size / 100;
    let _: () = redis::cmd("DEL")
        .arg(DLQ)
        .arg(pelican::keys::totals_key(STREAM, GROUP))
        .arg(pelican::keys::errors_key(STREAM, GROUP))
        .query_async(conn)
        .await
        .unwrap();
    fill_stream(conn, STREAM, GROUP, due, 100).await;
    deliver_all(conn, STREAM, GROUP, due).await;
    tokio::time::sleep(Duration::from_secs(22)).await;
    let body = "x".repeat(100);
    for start in (0..size - due).step_by(1000) {
        let mut pipe = redis::pipe();
        for n in start..(start + 1000).min(size - due) {
            pipe.cmd("XADD").arg(STREAM).arg("*").arg("n").arg(n).arg("body").arg(&body);
            pipe.arg("pelican-origin-id").arg("1-1").arg("pelican-deliveries").arg(2).ignore();
        }
        let _: () = pipe.query_async(conn).await.unwrap();
    }
    deliver_all(conn, STREAM, GROUP, size - due).await;
    tokio::time::sleep(Duration::from_secs(7)).await;
}

/// Milliseconds of passes over a [`backoff_pel`]: without backoff; with it, the first pass and the next (a new sweep
/// from the start of the PEL, the copies' earlier deliveries known), and what each moved.
async fn backoff_passes(conn: &mut Conn, size: usize) -> (f64, f64, f64, u64, u64, u64) {
    let keys = GroupKeys { stream: STREAM, group: GROUP, dead_letter: DLQ };
    let plain = PassSettings {
        min_idle: Duration::from_secs(20),
        max_per_pass: size,
        max_deliveries: 10,
        strategy: ReclaimStrategy::Requeue,
        dead_letter_max_len: None,
        backoff: None,
        handover_grace: Duration::ZERO,
        slice: Duration::MAX,
    };
    let backoff = PassSettings {
        min_idle: Duration::from_secs(5),
        backoff: Some(Backoff { factor: 2, max: Duration::from_secs(60) }),
        ..plain.clone()
    };
    let timed = async |conn: &mut Conn, settings: &PassSettings, cursor: &mut Cursor| {
        let start = Instant::now();
        let report = jobs::reclaim_pass(conn, "bench", &keys, settings, cursor, &|| true).await.unwrap();
        (start.elapsed().as_secs_f64() * 1e3, report.requeued)
    };
    backoff_pel(conn, size).await;
    let (without, moved_without) = timed(conn, &plain, &mut Cursor::default()).await;
    backoff_pel(conn, size).await;
    let mut cursor = Cursor::default();
    let (first, moved_first) = timed(conn, &backoff, &mut cursor).await;
    cursor.position = None;
    let (next, moved_next) = timed(conn, &backoff, &mut cursor).await;
    (without, first, next, moved_without, moved_first, moved_next)
}

fn median(mut rates: Vec<f64>) -> f64 {
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let size = args.first().copied().unwrap_or(50_000);
    let big = args.get(1).copied().unwrap_or(1_000_000);
    let naive_size = (size / 10).max(1000);
    let pools = Pools::default();
    println!("reclaim throughput, entries per second ({size} entries a run, naive loop on {naive_size}; median of 3)");
    println!(
        "{:<14} {:>12} {:>12} {:>12} {:>10} {:>14} {:>9} {:>9}",
        "server", "dead-letter", "requeue", "naive loop", "vs naive", "redis-bench", "dl/ceil", "rq/ceil"
    );
    let mut scans = Vec::new();
    let mut summaries = Vec::new();
    for var in ["PELICAN_REDIS_URL", "PELICAN_VALKEY_URL"] {
        let url = bed_var(var);
        let port = url.rsplit(':').next().unwrap().to_string();
        let mut conn = pools.get(&Target::new(url)).await.unwrap();
        let info: String = redis::cmd("INFO").arg("server").query_async(&mut conn).await.unwrap();
        let server = pelican::redis::ServerInfo::parse(&info).to_string();
        // Three rounds in turn, the median of each: one run of each is at the mercy of this machine's neighbours.
        let (mut dead_letter, mut requeue, mut naive) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..3 {
            dead_letter.push(pelican_pass(&mut conn, size, ReclaimStrategy::Requeue, 1).await);
            requeue.push(pelican_pass(&mut conn, size, ReclaimStrategy::Requeue, 1_000).await);
            naive.push(naive_loop(&mut conn, naive_size).await);
        }
        let (dead_letter, requeue, naive) = (median(dead_letter), median(requeue), median(naive));
        let ceiling = redis_benchmark_xadd(&port);
        println!(
            "{:<14} {:>12.0} {:>12.0} {:>12.0} {:>9.1}x {:>14.0} {:>8.0}% {:>8.0}%",
            server,
            dead_letter,
            requeue,
            naive,
            dead_letter / naive,
            ceiling,
            100.0 * dead_letter / ceiling,
            100.0 * requeue / ceiling
        );
        summaries.push(format!(
            "SUMMARY dead-letter pelican={dead_letter:.0}/s reference={ceiling:.0}/s ratio={:.2}",
            dead_letter / ceiling
        ));
        let small = idle_scan(&mut conn, 1_000).await;
        let huge = idle_scan(&mut conn, big).await;
        let backoff = backoff_passes(&mut conn, 100_000).await;
        scans.push((server, small, huge, backoff));
        let _: () = redis::cmd("DEL").arg(STREAM).arg(DLQ).arg("{bench}:rb").query_async(&mut conn).await.unwrap();
    }
    println!();
    println!("one pass with nothing idle, maxPerPass 1000 (best of 20), milliseconds");
    println!("{:<14} {:>12} {:>12}", "server", "PEL 1k", format!("PEL {}", big));
    for (server, small, huge, _) in &scans {
        println!("{:<14} {:>12.2} {:>12.2}", server, small.as_secs_f64() * 1e3, huge.as_secs_f64() * 1e3);
    }
    println!();
    println!("one pass over 100,000 pending entries, 1 % due (maxPerPass 100,000), milliseconds");
    println!("{:<14} {:>16} {:>20} {:>20}", "server", "no backoff", "backoff, 1st pass", "backoff, next pass");
    for (server, _, _, (without, first, next, moved_without, moved_first, moved_next)) in &scans {
        println!(
            "{server:<14} {without:>16.1} {first:>20.1} {next:>20.1}   (moved {moved_without} / {moved_first} / {moved_next})"
        );
    }
    println!();
    for line in summaries {
        println!("{line}");
    }
}
