//! What a `GroupSeek` costs the server it shares with every team: the longest single call, on Redis 7.0, over streams
//! of 1,000,000 and 10,000,000 entries (100-byte bodies), for the seeks that must walk: a replay by id to the middle
//! of the stream, a shift forward by half of it, and `pending: DeadLetter` of a 300,000-entry PEL. Side by side in
//! the same run:
//! - `page`: one `XRANGE ... COUNT 4096`, what any client counting the stream a page at a time costs the server;
//! - `one call`: the same walk in one script call (`EVAL` of an `XRANGE` loop to the end, what the seek did
//!   before it carried a cursor across calls).
//!
//! Each server command's duration is the server's own (`SLOWLOG` with a threshold of 0), not the round trip.
//!
//!   scripts/testenv up && cargo bench --bench seek [-- <entries> ...]   (default: 1000000 10000000)
//!
//! Ends with one `SUMMARY seek` line per size: the longest seek call against a page and against one call.

use std::time::Instant;

use pelican::api::PendingHandling;
use pelican::jobs::seek::{self, Outcome, Seek, Target};
use pelican::redis::{Conn, GroupKeys, Pools, Target as ServerTarget};
use support::{bed_var, deliver_all, fill_stream};

mod support;

const STREAM: &str = "{seek}:s";
const GROUP: &str = "g";

/// The server's slow log, emptied and set to keep every command.
async fn reset_slowlog(conn: &mut Conn) {
    let _: () = redis::cmd("CONFIG").arg("SET").arg("slowlog-log-slower-than").arg(0).query_async(conn).await.unwrap();
    let _: () = redis::cmd("CONFIG").arg("SET").arg("slowlog-max-len").arg(1_000_000).query_async(conn).await.unwrap();
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query_async(conn).await.unwrap();
}

/// The longest command whose name starts with `prefix` since the last reset (µs), and how many there were.
async fn longest(conn: &mut Conn, prefix: &str) -> (i64, usize) {
    let entries: Vec<Vec<redis::Value>> = redis::cmd("SLOWLOG").arg("GET").arg(-1).query_async(conn).await.unwrap();
    let durations: Vec<i64> = entries
        .iter()
        .filter(|entry| match &entry[3] {
            redis::Value::Array(command) => {
                matches!(&command[0], redis::Value::BulkString(name) if name.starts_with(prefix.as_bytes()))
            }
            _ => false,
        })
        .map(|entry| redis::from_redis_value::<i64>(entry[2].clone()).unwrap())
        .collect();
    (durations.iter().copied().max().unwrap_or(0), durations.len())
}

async fn run_seek(conn: &mut Conn, name: &str, target: Target, pending: PendingHandling) -> (i64, usize, f64) {
    let keys = GroupKeys { stream: STREAM, group: GROUP, dead_letter: "{seek}:dlq" };
    let plan = Seek {
        name: format!("bench/{name}"),
        uid: format!("uid-{name}"),
        target,
        pending,
        idle_ms: 0,
        dry_run: pending == PendingHandling::Keep,
        dead_letter_max_len: None,
    };
    reset_slowlog(conn).await;
    let start = Instant::now();
    let outcome = seek::run(conn, "bench", &keys, &plan, || true).await.unwrap();
    let elapsed = start.elapsed().as_secs_f64();
    assert!(matches!(outcome, Outcome::Done(_)), "{outcome:?}");
    let (longest, calls) = longest(conn, "EVAL").await;
    (longest, calls, elapsed)
}

/// The middle entry's id.
async fn middle(conn: &mut Conn, entries: usize) -> String {
    let mut from = "-".to_string();
    let mut left = entries / 2;
    loop {
        let page: Vec<(String, Vec<Vec<u8>>)> = redis::cmd("XRANGE")
            .arg(STREAM)
            .arg(&from)
            .arg("+")
            .arg("COUNT")
            .arg(left.min(10_000))
            .query_async(conn)
            .await
            .unwrap();
        left -= page.len();
        let last = page.last().unwrap().0.clone();
        if left == 0 {
            return last;
        }
        from = format!("({last}");
    }
}

#[tokio::main]
async fn main() {
    let sizes: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let sizes = if sizes.is_empty() { vec![1_000_000, 10_000_000] } else { sizes };
    let target = ServerTarget::new(format!("{}/0", bed_var("PELICAN_REDIS_URL")));
    let mut conn = Pools::default().get(&target).await.unwrap();
    let mut summaries = Vec::new();
    println!("{:<40} {:>14} {:>8} {:>10}", "seek (Redis 7.0)", "longest call", "calls", "wall");
    for entries in sizes {
        fill_stream(&mut conn, STREAM, GROUP, entries, 100).await;
        let _: () = redis::cmd("DEL").arg("{seek}:pelican:{seek}:s:g:seeks").query_async(&mut conn).await.unwrap();
        let mid = middle(&mut conn, entries).await;
        let mut ours = 0;
        for (what, name, target, pending) in [
            ("replay to the middle (dry run)", "replay", Target::Id(mid.clone()), PendingHandling::Keep),
            ("shift forward by half (dry run)", "shift", Target::Shift(entries as i64 / 2), PendingHandling::Keep),
        ] {
            let (micros, calls, wall) = run_seek(&mut conn, &format!("{name}-{entries}"), target, pending).await;
            println!("{:<40} {:>11} µs {calls:>8} {wall:>8.2} s", format!("{entries}: {what}"), micros);
            ours = ours.max(micros);
        }
        // 300,000 pending entries dead-lettered, the group moved to Latest.
        deliver_all(&mut conn, STREAM, GROUP, 300_000).await;
        let (micros, calls, wall) =
            run_seek(&mut conn, &format!("dead-{entries}"), Target::Latest, PendingHandling::DeadLetter).await;
        println!("{:<40} {:>11} µs {calls:>8} {wall:>8.2} s", format!("{entries}: DeadLetter 300,000 pending"), micros);
        ours = ours.max(micros);

        // The references: one page, and the walk to the end in one script call.
        reset_slowlog(&mut conn).await;
        let _: redis::Value = redis::cmd("XRANGE")
            .arg(STREAM)
            .arg(&mid)
            .arg("+")
            .arg("COUNT")
            .arg(4096)
            .query_async(&mut conn)
            .await
            .unwrap();
        let (page, _) = longest(&mut conn, "XRANGE").await;
        let walk = "local n, from = 0, ARGV[1] \
                    while true do \
                      local page = redis.call('XRANGE', KEYS[1], from, '+', 'COUNT', 1000) \
                      n = n + #page \
                      if #page < 1000 then return n end \
                      from = '(' .. page[#page][1] \
                    end";
        reset_slowlog(&mut conn).await;
        let counted: usize = redis::cmd("EVAL")
            .arg(walk)
            .arg(1)
            .arg(STREAM)
            .arg(format!("({mid}"))
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(counted, entries - entries / 2);
        let (one_call, _) = longest(&mut conn, "EVAL").await;
        println!("{:<40} {:>11} µs", format!("{entries}: reference: one XRANGE page of 4096"), page);
        println!("{:<40} {:>11} µs", format!("{entries}: reference: the walk in one call"), one_call);
        summaries.push(format!(
            "SUMMARY seek entries={entries} longest_call_us={ours} page_us={page} one_call_us={one_call} \
             ratio_to_one_call={:.4}",
            ours as f64 / one_call as f64
        ));
    }
    let _: () = redis::cmd("DEL").arg(STREAM).arg("{seek}:dlq").query_async(&mut conn).await.unwrap();
    println!();
    for line in summaries {
        println!("{line}");
    }
}
