//! Dead-letter / requeue throughput, printed side by side in one run on the same server:
//! Pelican's scripted pass, the naive loop a user writes by hand (one XCLAIM of the idle ids per pass, then XPENDING + XADD +
//! XACK round trips per message), and `redis-benchmark` XADD as the server's ceiling. Then the cost of a pass that finds
//! nothing idle on a small and on a huge PEL, which must be the same (bounded by maxPerPass).
//!
//!   scripts/testenv up && cargo bench --bench reclaim_throughput [-- <entries> <big-pel>]

use std::process::Command;
use std::time::{Duration, Instant};

use pelican::api::ReclaimStrategy;
use pelican::jobs::{self, PassSettings};
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
    };
    let start = Instant::now();
    let report = jobs::reclaim_pass(conn, "bench", &keys, &settings, &mut None, &|| true).await.unwrap();
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
    };
    let mut best = Duration::MAX;
    let mut cursor = None;
    for _ in 0..20 {
        let start = Instant::now();
        let report = jobs::reclaim_pass(conn, "bench", &keys, &settings, &mut cursor, &|| true).await.unwrap();
        best = best.min(start.elapsed());
        assert_eq!(report.scanned, 1000.min(pel));
        cursor = None;
    }
    best
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let size = args.first().copied().unwrap_or(50_000);
    let big = args.get(1).copied().unwrap_or(1_000_000);
    let naive_size = (size / 10).max(1000);
    let pools = Pools::default();
    println!("reclaim throughput, entries per second ({size} entries a run; naive loop on {naive_size})");
    println!(
        "{:<14} {:>12} {:>12} {:>12} {:>10} {:>14} {:>9} {:>9}",
        "server", "dead-letter", "requeue", "naive loop", "vs naive", "redis-bench", "dl/ceil", "rq/ceil"
    );
    let mut scans = Vec::new();
    for var in ["PELICAN_REDIS_URL", "PELICAN_VALKEY_URL"] {
        let url = bed_var(var);
        let port = url.rsplit(':').next().unwrap().to_string();
        let mut conn = pools.get(&Target::new(url)).await.unwrap();
        let info: String = redis::cmd("INFO").arg("server").query_async(&mut conn).await.unwrap();
        let server = pelican::redis::ServerInfo::parse(&info).to_string();
        let dead_letter = pelican_pass(&mut conn, size, ReclaimStrategy::Requeue, 1).await;
        let requeue = pelican_pass(&mut conn, size, ReclaimStrategy::Requeue, 1_000).await;
        let naive = naive_loop(&mut conn, naive_size).await;
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
        let small = idle_scan(&mut conn, 1_000).await;
        let huge = idle_scan(&mut conn, big).await;
        scans.push((server, small, huge));
        let _: () = redis::cmd("DEL").arg(STREAM).arg(DLQ).arg("{bench}:rb").query_async(&mut conn).await.unwrap();
    }
    println!();
    println!("one pass with nothing idle, maxPerPass 1000 (best of 20), milliseconds");
    println!("{:<14} {:>12} {:>12}", "server", "PEL 1k", format!("PEL {}", big));
    for (server, small, huge) in scans {
        println!("{:<14} {:>12.2} {:>12.2}", server, small.as_secs_f64() * 1e3, huge.as_secs_f64() * 1e3);
    }
}
