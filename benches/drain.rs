//! The job runner, with the operator running as a process against the bed:
//!
//! 1. Drain: N idle entries (default 1,000,000) past the retry cap under one policy with the default `interval`
//!    (1m) and `maxPerPass` (1000), from `kubectl apply` to the last one dead-lettered, next to the time the
//!    reclaim benchmark's rate predicts for N (one pass over 50,000 entries, the median of six: three just before
//!    and three just after the drain, same server),
//!    on Redis 7.0 and then on Valkey 9.1.
//! 2. Fairness: 100 small policies (interval 1s) on the same server; the delay from a pass being due to its start
//!    (`pelican_pass_delay_seconds` from /metrics), without and then with the big policy draining beside them.
//!
//!   scripts/testenv up && cargo bench --bench drain [-- <entries>]
//!
//! Ends with one `SUMMARY drain` line per server (reference: the rate one 50,000-entry pass predicts), Redis 7.0
//! first.

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

fn median(mut rates: Vec<f64>) -> f64 {
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

fn one_pass(runtime: &tokio::runtime::Runtime, server: &Server) -> f64 {
    runtime.block_on(async {
        let mut conn = Pools::default().get(&Target::new(server.url())).await.unwrap();
        let _: () = redis::cmd("DEL").arg("{probe}:in").arg("{probe}:dlq").query_async(&mut conn).await.unwrap();
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
            handover_grace: Duration::ZERO,
            slice: Duration::MAX,
        };
        let start = Instant::now();
        let report =
            jobs::reclaim_pass(&mut conn, "bench", &keys, &settings, &mut Cursor::default(), &|| true).await.unwrap();
        assert_eq!(report.dead_lettered, 50_000);
        50_000.0 / start.elapsed().as_secs_f64()
    })
}

/// From `kubectl apply` of a policy with the defaults for interval (1m) and maxPerPass (1000) over `entries` idle
/// entries past the cap (maxDeliveries 1) to the last one dead-lettered.
fn drain(runtime: &tokio::runtime::Runtime, ns: &str, server: &Server, name: &str, entries: usize) -> Duration {
    runtime.block_on(async {
        let mut conn = Pools::default().get(&Target::new(server.url())).await.unwrap();
        fill_stream(&mut conn, "big", "g", entries, 100).await;
        deliver_all(&mut conn, "big", "g", entries).await;
    });
    std::thread::sleep(Duration::from_secs(2)); // every entry idle past minIdle 1s
    let big = policy(name, &server.url(), "big", "g", "  retry:\n    maxDeliveries: 1\n")
        .replace("    interval: 1s\n", "    minIdle: 1s\n");
    let mut conn = server.conn();
    let started = Instant::now();
    assert!(kubectl_apply(ns, &big).0);
    let mut first = None;
    wait_for("every entry dead-lettered", Duration::from_secs(1800), || {
        let dead: usize = redis::cmd("XLEN").arg("big:dlq").query(&mut conn).unwrap();
        if dead > 0 && first.is_none() {
            first = Some(started.elapsed());
        }
        if dead >= entries { Ok(()) } else { Err(format!("{dead} of {entries}")) }
    });
    let drained = started.elapsed();
    eprintln!("{name}: first dead letter {:.2} s after the apply", first.unwrap_or_default().as_secs_f64());
    let pending: (usize, redis::Value, redis::Value, redis::Value) =
        redis::cmd("XPENDING").arg("big").arg("g").query(&mut conn).unwrap();
    assert_eq!(pending.0, 0, "the PEL is empty");
    drained
}

fn main() {
    let entries: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(1_000_000);
    let servers = [Server::start(Flavor::Redis), Server::start(Flavor::Valkey)];
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let ns = namespace("drain");
    let operator = Operator::start(&ns);
    // The fairness measure: 100 small policies on the Redis server, alone and then beside its drain.
    let smalls: Vec<String> = (0..SMALL)
        .map(|i| {
            policy(&format!("small-{i}"), &servers[0].url(), &format!("small-{i}"), "g", "")
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

    println!("drain of {entries} idle entries past the cap, interval 1m, maxPerPass 1000");
    println!("{:<12} {:<44} {:>10} {:>14}", "server", "", "seconds", "entries/s");
    let (mut busy_before, mut busy_after) = (BTreeMap::new(), BTreeMap::new());
    let mut summaries = Vec::new();
    for (server, name) in servers.iter().zip(["big-redis", "big-valkey"]) {
        // What the drain's rate is measured against: one pass over 50,000 idle entries past the cap, three times
        // just before the drain and three times just after (this machine's speed drifts by a third over a minute),
        // the median of the six.
        let mut rates: Vec<f64> = (0..3).map(|_| one_pass(&runtime, server)).collect();
        let before = delay_buckets(&operator);
        let drained = drain(&runtime, &ns, server, name, entries);
        rates.extend((0..3).map(|_| one_pass(&runtime, server)));
        let rate = median(rates);
        if server.flavor == Flavor::Redis {
            (busy_before, busy_after) = (before, delay_buckets(&operator));
        }
        let predicted = entries as f64 / rate;
        let flavor = format!("{:?}", server.flavor);
        let ours = entries as f64 / drained.as_secs_f64();
        let line = "operator (apply -> last dead-lettered)";
        println!("{flavor:<12} {line:<44} {:>10.1} {ours:>14.0}", drained.as_secs_f64());
        println!(
            "{flavor:<12} {:<44} {predicted:>10.1} {rate:>14.0}",
            "predicted by one 50,000-entry pass (median of 6)"
        );
        summaries.push(format!(
            "SUMMARY drain pelican={ours:.0}/s reference={rate:.0}/s ratio={:.2}",
            predicted / drained.as_secs_f64()
        ));
    }
    println!(
        "{:<12} {:<44} {:>10.1} {:>14.0}",
        "",
        "before the runner: maxPerPass per interval",
        entries as f64 / 1000.0 * 60.0,
        1000.0 / 60.0
    );
    println!();
    println!("pass delay of {SMALL} small policies (interval 1s), due -> start");
    println!("{:<44} {:>8} {:>14} {:>14}", "", "passes", "p50", "p99");
    for (what, before, after) in [
        ("alone (20 s)", &quiet_before, &quiet_after),
        ("beside the draining policy (Redis)", &busy_before, &busy_after),
    ] {
        let (n, p50) = quantile(before, after, 0.50);
        let (_, p99) = quantile(before, after, 0.99);
        println!("{what:<44} {n:>8.0} {p50:>14} {p99:>14}");
    }
    println!();
    for line in summaries {
        println!("{line}");
    }
}
