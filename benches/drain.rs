//! The job runner, with the operator running as a process against the bed:
//!
//! 1. Drain: N idle entries (default 1,000,000) past the retry cap under one policy with the default `interval`
//!    (1m) and `maxPerPass` (1000), from `kubectl apply` to the last one dead-lettered, next to the time the
//!    reclaim benchmark's rate predicts for N (one pass over 50,000 entries, measured in the same run, same server).
//! 2. Fairness: 100 small policies (interval 1s) on the same server; the delay from a pass being due to its start
//!    (`pelican_pass_delay_seconds` from /metrics), without and then with the big policy draining beside them.
//!
//!   scripts/testenv up && cargo bench --bench drain [-- <entries>]
//!
//! Ends with a `SUMMARY drain` line (reference: the rate one 50,000-entry pass predicts).

#[path = "../tests/common/mod.rs"]
#[allow(unused_macros)]
mod common;
mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::*;
use pelican::api::ReclaimStrategy;
use pelican::jobs::{self, Cursor, PassSettings};
use pelican::redis::{GroupKeys, Pools, Target};
use support::{deliver_all, fill_stream};

const SMALL: usize = 100;

/// `le` -> cumulative count of the pass delay histogram.
fn delay_buckets(operator: &Operator) -> BTreeMap<String, f64> {
    operator
        .metrics()
        .lines()
        .filter_map(|l| l.strip_prefix("pelican_pass_delay_seconds_bucket{le=\""))
        .filter_map(|l| {
            let (le, rest) = l.split_once("\"}")?;
            Some((le.to_string(), rest.trim().parse().ok()?))
        })
        .collect()
}

/// Quantile `q` of the passes observed between two scrapes, as the upper bound of the bucket it falls in.
fn quantile(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>, q: f64) -> (f64, String) {
    let mut buckets: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, n)| (le.parse::<f64>().unwrap_or(f64::INFINITY), n - before.get(le).copied().unwrap_or(0.0)))
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last().map_or(0.0, |b| b.1);
    let bound = buckets.iter().find(|(_, n)| *n >= q * total).map_or(f64::INFINITY, |b| b.0);
    (total, if bound.is_finite() { format!("<= {:.0} ms", bound * 1000.0) } else { "> 65 s".into() })
}

fn main() {
    let entries: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(1_000_000);
    let server = Server::start(Flavor::Redis);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();

    // The reclaim benchmark's rate on this server: one pass over 50,000 idle entries past the cap.
    let rate = runtime.block_on(async {
        let mut conn = Pools::default().get(&Target::new(server.url())).await.unwrap();
        fill_stream(&mut conn, "{probe}:in", "g", 50_000, 100).await;
        deliver_all(&mut conn, "{probe}:in", "g", 50_000).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let keys = GroupKeys { stream: "{probe}:in", group: "g", dead_letter: "{probe}:dlq" };
        let settings = PassSettings {
            min_idle: Duration::from_millis(50),
            max_per_pass: 50_000,
            max_deliveries: 1,
            strategy: ReclaimStrategy::Requeue,
            dead_letter_max_len: None,
            backoff: None,
        };
        let start = Instant::now();
        let report =
            jobs::reclaim_pass(&mut conn, "bench", &keys, &settings, &mut Cursor::default(), &|| true).await.unwrap();
        assert_eq!(report.dead_lettered, 50_000);
        50_000.0 / start.elapsed().as_secs_f64()
    });

    let ns = namespace("drain");
    let operator = Operator::start(&ns);
    let smalls: Vec<String> = (0..SMALL)
        .map(|i| {
            policy(&format!("small-{i}"), &server.url(), &format!("small-{i}"), "g", "")
                .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n")
        })
        .collect();
    assert!(kubectl_apply(&ns, &smalls.join("---\n")).0);
    wait_all_ready(&ns, SMALL, Duration::from_secs(120));
    std::thread::sleep(Duration::from_secs(3));
    let window = Duration::from_secs(20);
    let quiet_before = delay_buckets(&operator);
    std::thread::sleep(window);
    let quiet_after = delay_buckets(&operator);

    runtime.block_on(async {
        let mut conn = Pools::default().get(&Target::new(server.url())).await.unwrap();
        fill_stream(&mut conn, "big", "g", entries, 100).await;
        deliver_all(&mut conn, "big", "g", entries).await;
    });
    std::thread::sleep(Duration::from_secs(2)); // every entry idle past minIdle 1s
    // The defaults for interval (1m) and maxPerPass (1000); maxDeliveries 1 puts every entry past the cap.
    let big = policy("big", &server.url(), "big", "g", "  retry:\n    maxDeliveries: 1\n")
        .replace("    interval: 1s\n", "    minIdle: 1s\n");
    let mut conn = server.conn();
    let busy_before = delay_buckets(&operator);
    let started = Instant::now();
    assert!(kubectl_apply(&ns, &big).0);
    wait_for("every entry dead-lettered", Duration::from_secs(1800), || {
        let dead: usize = redis::cmd("XLEN").arg("big:dlq").query(&mut conn).unwrap();
        if dead >= entries { Ok(()) } else { Err(format!("{dead} of {entries}")) }
    });
    let drained = started.elapsed();
    let busy_after = delay_buckets(&operator);
    let pending: (usize, redis::Value, redis::Value, redis::Value) =
        redis::cmd("XPENDING").arg("big").arg("g").query(&mut conn).unwrap();
    assert_eq!(pending.0, 0, "the PEL is empty");

    let predicted = entries as f64 / rate;
    println!("drain of {entries} idle entries past the cap, interval 1m, maxPerPass 1000 ({:?})", server.flavor);
    println!("{:<44} {:>10} {:>14}", "", "seconds", "entries/s");
    println!(
        "{:<44} {:>10.1} {:>14.0}",
        "operator (apply -> last dead-lettered)",
        drained.as_secs_f64(),
        entries as f64 / drained.as_secs_f64()
    );
    println!("{:<44} {:>10.1} {:>14.0}", "predicted by one 50,000-entry pass", predicted, rate);
    println!(
        "{:<44} {:>10.1} {:>14.0}",
        "before the runner: maxPerPass per interval",
        entries as f64 / 1000.0 * 60.0,
        1000.0 / 60.0
    );
    println!();
    println!("pass delay of {SMALL} small policies (interval 1s), due -> start");
    println!("{:<44} {:>8} {:>14} {:>14}", "", "passes", "p50", "p99");
    for (what, before, after) in
        [("alone (20 s)", &quiet_before, &quiet_after), ("beside the draining policy", &busy_before, &busy_after)]
    {
        let (n, p50) = quantile(before, after, 0.50);
        let (_, p99) = quantile(before, after, 0.99);
        println!("{what:<44} {n:>8.0} {p50:>14} {p99:>14}");
    }
    println!();
    println!(
        "SUMMARY drain pelican={:.0}/s reference={rate:.0}/s ratio={:.2}",
        entries as f64 / drained.as_secs_f64(),
        predicted / drained.as_secs_f64()
    );
}
