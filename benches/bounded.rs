//! Bounded streams, side by side in one run on the same server:
//!
//! 1. the bounded-publish script with one bounded group (a bound high enough never to refuse, so every call does the
//!    full check) against plain `XADD` of the same entry, a script that only runs the `XADD` and one that reads
//!    `XINFO GROUPS` first (the least an exact bound costs: the lag is told by nothing else): one client, one
//!    call at a time, the four taking turns every 20 calls (a round trip on a shared two-core machine drifts by a
//!    third over seconds; turns this short give each path the same drift); then 16 clients with 100 entries in
//!    flight each, pipelining 100 calls, and the batch script with batches of 100 (one call, one check), taking
//!    turns every 2,000 entries per client;
//! 2. the retention trim of 100,000 acknowledged entries from a 1,000,000-entry stream against a bare
//!    `XTRIM MINID` of the same entries (what a person would run knowing the safe point);
//! 3. on Redis 8.6 (a server of the bed's `PELICAN_REDIS86_SERVER` started for the run): the idempotent bounded
//!    publish (`IDMP <producer> <message>` before the fields) against the bounded publish without it, plain
//!    `XADD ... IDMP` and plain `XADD`, each client its own producer id per path and a new message id per publish,
//!    in the same turns.
//!
//!   scripts/testenv up && cargo bench --bench bounded [-- <publishes per client>]
//!
//! Ends with `SUMMARY bounded-1x1` (reference: plain XADD) and `SUMMARY bounded-16x100` (reference: XADD in a
//! script; Pelican: the batch script) lines, Redis 7.0 first, then Valkey 9.1, then `SUMMARY idempotent-*`
//! (reference: the bounded publish without IDMP) on Redis 8.6.

use std::time::{Duration, Instant};

use pelican::jobs;
use pelican::keys::{bounds_key, rejected_key};
use pelican::redis::{Conn, GroupKeys, Pools, Target};
use pelican::worker::{BOUNDED_PUBLISH, BOUNDED_PUBLISH_BATCH};
use support::{bed_var, fill_stream};

mod support;

const STREAM: &str = "{bench}:orders";
const GROUP: &str = "billing";

/// The least any script can cost: a script that only runs the XADD. The gap between plain XADD and this is the
/// price of running Lua at all; the gap between this and the bounded script is the price of the check.
static XADD_ONLY: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new("return redis.call('XADD', KEYS[1], '*', unpack(ARGV))"));
/// The least an exact bound can cost: the one read that tells a group's lag, then the XADD, with no check between.
static XINFO_XADD: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new("redis.call('XINFO', 'GROUPS', KEYS[1]) return redis.call('XADD', KEYS[1], '*', unpack(ARGV))")
});

#[derive(Clone, Copy, PartialEq)]
enum Publish {
    Plain,
    ScriptedXadd,
    XinfoXadd,
    Bounded,
    /// The batch script: every call carries the whole pipeline's entries.
    Batch,
    /// `XADD ... IDMP <producer> <message>` (Redis 8.6).
    PlainIdmp,
    /// The bounded-publish script with `IDMP <producer> <message>` before the fields.
    BoundedIdmp,
}

/// One publish of client `client` added to a pipeline.
fn add(pipe: &mut redis::Pipeline, how: Publish, client: usize, n: usize) {
    let body = "x".repeat(100);
    match how {
        Publish::PlainIdmp => {
            pipe.cmd("XADD").arg(STREAM).arg("IDMP").arg(format!("plain-{client}")).arg(n).arg("*");
            pipe.arg("n").arg(n).arg("body").arg(body).ignore();
        }
        Publish::BoundedIdmp => {
            pipe.cmd("EVALSHA").arg(BOUNDED_PUBLISH.get_hash()).arg(3).arg(STREAM).arg(bounds_key(STREAM));
            pipe.arg(rejected_key(STREAM)).arg("IDMP").arg(format!("bounded-{client}")).arg(n);
            pipe.arg("n").arg(n).arg("body").arg(body).ignore();
        }
        Publish::Batch => unreachable!("a batch is one call: see add_batch"),
        Publish::Plain => {
            pipe.cmd("XADD").arg(STREAM).arg("*").arg("n").arg(n).arg("body").arg(body).ignore();
        }
        Publish::ScriptedXadd | Publish::XinfoXadd => {
            let hash = if how == Publish::XinfoXadd { XINFO_XADD.get_hash() } else { XADD_ONLY.get_hash() };
            pipe.cmd("EVALSHA").arg(hash).arg(1).arg(STREAM).arg("n").arg(n).arg("body").arg(body);
            pipe.ignore();
        }
        Publish::Bounded => {
            // What any client sends: EVALSHA with the documented KEYS and the entry's fields as ARGV.
            pipe.cmd("EVALSHA").arg(BOUNDED_PUBLISH.get_hash()).arg(3).arg(STREAM).arg(bounds_key(STREAM));
            pipe.arg(rejected_key(STREAM)).arg("n").arg(n).arg("body").arg(body).ignore();
        }
    }
}

/// One call of the batch script with the entries `ns`, as any client sends it: the count, then each entry's
/// argument count and fields.
fn add_batch(pipe: &mut redis::Pipeline, ns: std::ops::Range<usize>) {
    let body = "x".repeat(100);
    pipe.cmd("EVALSHA").arg(BOUNDED_PUBLISH_BATCH.get_hash()).arg(3).arg(STREAM).arg(bounds_key(STREAM));
    pipe.arg(rejected_key(STREAM)).arg(ns.len());
    for n in ns {
        pipe.arg(4).arg("n").arg(n).arg("body").arg(&body);
    }
    pipe.ignore();
}

/// A fresh stream with one group, bounded far above what the run publishes; the script cached on the server.
async fn reset(conn: &mut Conn) {
    let _: () = redis::cmd("DEL")
        .arg(STREAM)
        .arg(bounds_key(STREAM))
        .arg(rejected_key(STREAM))
        .query_async(conn)
        .await
        .unwrap();
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(STREAM)
        .arg(GROUP)
        .arg("$")
        .arg("MKSTREAM")
        .query_async(conn)
        .await
        .unwrap();
    let _: () = redis::cmd("HSET").arg(bounds_key(STREAM)).arg(GROUP).arg(1u64 << 40).query_async(conn).await.unwrap();
    BOUNDED_PUBLISH.load_async(conn).await.unwrap();
    BOUNDED_PUBLISH_BATCH.load_async(conn).await.unwrap();
    XADD_ONLY.load_async(conn).await.unwrap();
    XINFO_XADD.load_async(conn).await.unwrap();
}

/// Publishes per second of each of `paths`: `clients` connections, each sending `per_client` publishes per path in
/// pipelines of `depth` (one batch call of `depth` entries for [`Publish::Batch`]). The paths take turns every `turn`
/// publishes per client: a round trip on a shared two-core machine drifts by a third over seconds, and turns this
/// short give each path the same drift.
async fn in_turns(
    url: &str,
    paths: &[Publish],
    clients: usize,
    per_client: usize,
    depth: usize,
    turn: usize,
) -> Vec<f64> {
    let pools = Pools::default();
    let mut conn = pools.get(&Target::new(url)).await.unwrap();
    reset(&mut conn).await;
    let mut conns = Vec::new();
    for _ in 0..clients {
        // Separate connections: Pools shares one per server, which would serialise the clients.
        let client = redis::Client::open(url).unwrap();
        conns.push(client.get_multiplexed_async_connection().await.unwrap());
    }
    let mut seconds = vec![0.0; paths.len()];
    for first in (0..per_client).step_by(turn) {
        let last = (first + turn).min(per_client);
        for (path, &how) in paths.iter().enumerate() {
            let start = Instant::now();
            let tasks = conns.iter().cloned().enumerate().map(|(client, mut conn)| async move {
                for from in (first..last).step_by(depth) {
                    let mut pipe = redis::pipe();
                    let ns = from..(from + depth).min(last);
                    if how == Publish::Batch {
                        add_batch(&mut pipe, ns);
                    } else {
                        ns.for_each(|n| add(&mut pipe, how, client, n));
                    }
                    let () = pipe.query_async(&mut conn).await.unwrap();
                }
            });
            futures::future::join_all(tasks).await;
            seconds[path] += start.elapsed().as_secs_f64();
        }
    }
    let published: usize = redis::cmd("XLEN").arg(STREAM).query_async(&mut conn).await.unwrap();
    assert_eq!(published, paths.len() * clients * per_client, "every publish was accepted");
    seconds.iter().map(|s| (clients * per_client) as f64 / s).collect()
}

/// Seconds to trim the first `trim` of `size` entries, with the retention script or a bare XTRIM MINID.
async fn trim_time(conn: &mut Conn, size: usize, trim: usize, scripted: bool) -> (f64, u64) {
    fill_stream(conn, STREAM, GROUP, size, 100).await;
    let range: redis::streams::StreamRangeReply =
        redis::cmd("XRANGE").arg(STREAM).arg("-").arg("+").arg("COUNT").arg(trim + 1).query_async(conn).await.unwrap();
    let (last_read, first_kept) = (&range.ids[trim - 1].id, &range.ids[trim].id);
    // The group has read and acknowledged the first `trim` entries: nothing pending, read up to `last_read`.
    let _: () =
        redis::cmd("XGROUP").arg("SETID").arg(STREAM).arg(GROUP).arg(last_read).query_async(conn).await.unwrap();
    let start = Instant::now();
    let trimmed = if scripted {
        let keys = GroupKeys { stream: STREAM, group: GROUP, dead_letter: "{bench}:dlq" };
        jobs::trim_acknowledged(conn, "bench", &keys, Duration::ZERO, false).await.unwrap().trimmed
    } else {
        redis::cmd("XTRIM").arg(STREAM).arg("MINID").arg(first_kept).query_async(conn).await.unwrap()
    };
    (start.elapsed().as_secs_f64(), trimmed)
}

/// One `SUMMARY` line, for scripts.
fn summary(path: &str, pelican: f64, reference: f64) -> String {
    format!("SUMMARY {path} pelican={pelican:.0}/s reference={reference:.0}/s ratio={:.2}", pelican / reference)
}

#[tokio::main]
async fn main() {
    let per_client: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(20_000);
    let (mut one_by_one, mut sixteen) = (Vec::new(), Vec::new());
    for var in ["PELICAN_REDIS_URL", "PELICAN_VALKEY_URL"] {
        let url = bed_var(var);
        let pools = Pools::default();
        let mut conn = pools.get(&Target::new(&url)).await.unwrap();
        let info: String = redis::cmd("INFO").arg("server").query_async(&mut conn).await.unwrap();
        let server = pelican::redis::ServerInfo::parse(&info);
        println!("\n{server} at {url}: publishes/s, 100-byte body, one bounded group");
        println!(
            "{:<34} {:>11} {:>17} {:>20} {:>16} {:>15}",
            "clients x entries in flight",
            "plain XADD",
            "XADD in a script",
            "XINFO+XADD, script",
            "bounded, 1/call",
            "bounded, batch"
        );
        // One call at a time: bound by the round trip, so the paths take turns.
        let paths = [Publish::Plain, Publish::ScriptedXadd, Publish::XinfoXadd, Publish::Bounded];
        let [plain, scripted, xinfo, bounded] = in_turns(&url, &paths, 1, per_client, 1, 20).await[..] else {
            unreachable!()
        };
        println!(
            "{:<34} {plain:>11.0} {scripted:>17.0} {xinfo:>20.0} {bounded:>16.0} {:>15}",
            "1 x 1 (turns of 20 calls)", "-"
        );
        one_by_one.push(summary("bounded-1x1", bounded, plain));
        let paths = [Publish::Plain, Publish::ScriptedXadd, Publish::Bounded, Publish::Batch];
        let [plain, scripted, bounded, batch] = in_turns(&url, &paths, 16, per_client, 100, 2_000).await[..] else {
            unreachable!()
        };
        println!(
            "{:<34} {plain:>11.0} {scripted:>17.0} {:>20} {bounded:>16.0} {batch:>15.0}",
            "16 x 100 (pipelined; batch of 100)", "-"
        );
        sixteen.push(summary("bounded-16x100", batch, scripted));
        let (size, trim) = (1_000_000, 100_000);
        let (bare, bare_trimmed) = trim_time(&mut conn, size, trim, false).await;
        let (scripted, scripted_trimmed) = trim_time(&mut conn, size, trim, true).await;
        assert_eq!((bare_trimmed, scripted_trimmed), (trim as u64, trim as u64));
        println!("trim {trim} acknowledged entries of a {size}-entry stream:");
        println!("{:<34} {:>11.1} ms", "bare XTRIM MINID (safe point known)", bare * 1000.0);
        println!("{:<34} {:>11.1} ms", "retention script (finds it)", scripted * 1000.0);
        let _: () = redis::cmd("DEL").arg(STREAM).query_async(&mut conn).await.unwrap();
    }
    let idempotent = idempotent_publish(per_client).await;
    println!();
    for line in one_by_one.iter().chain(&sixteen).chain(&idempotent) {
        println!("{line}");
    }
}

/// Part 3: a Redis 8.6 of the bed, started for the run on a free port and stopped after it.
async fn idempotent_publish(per_client: usize) -> Vec<String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut server = std::process::Command::new(bed_var("PELICAN_REDIS86_SERVER"))
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("start Redis 8.6");
    let url = format!("redis://127.0.0.1:{port}/0");
    let client = redis::Client::open(&url[..]).unwrap();
    let started = Instant::now();
    while client.get_multiplexed_async_connection().await.is_err() {
        assert!(started.elapsed() < Duration::from_secs(10), "Redis 8.6 did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("\nredis 8.6 at {url}: publishes/s, 100-byte body, one bounded group, a new message id per publish");
    println!(
        "{:<34} {:>11} {:>17} {:>16} {:>20}",
        "clients x entries in flight", "plain XADD", "XADD ... IDMP", "bounded", "bounded, IDMP"
    );
    let paths = [Publish::Plain, Publish::PlainIdmp, Publish::Bounded, Publish::BoundedIdmp];
    let mut lines = Vec::new();
    for (clients, depth, turn, label) in
        [(1, 1, 20, "1 x 1 (turns of 20 calls)"), (16, 100, 2_000, "16 x 100 (pipelined)")]
    {
        let [plain, idmp, bounded, bounded_idmp] = in_turns(&url, &paths, clients, per_client, depth, turn).await[..]
        else {
            unreachable!()
        };
        println!("{label:<34} {plain:>11.0} {idmp:>17.0} {bounded:>16.0} {bounded_idmp:>20.0}");
        // What IDMP costs the bounded publish, beside what it costs a plain XADD.
        lines.push(summary(&format!("idempotent-{clients}x{depth}"), bounded_idmp, bounded));
    }
    let _ = server.kill();
    let _ = server.wait();
    lines
}
