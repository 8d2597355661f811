//! N policies (default 1,000) spread over 3 servers: the time from applying them to all Ready, the connections
//! they use (CLIENT LIST on each server), the operator's steady RSS and CPU and the API requests per second it
//! causes while nothing changes (`apiserver_request_total` of the API server itself), next to the same operator
//! with no policy at all as the baseline; then the p99 delay from a pass being due to its start.
//! With `PELICAN_BIN=<older pelican>` the same figures for another build. With `-- <N> shards` the policies carry
//! the label `sharding.pelican.io/key` (a or b) and two operators each reconcile one half.
//!
//! Last, `/metrics` itself: its series and bytes with every series per policy (`--metrics-detail full`, the default)
//! and, after a restart, with `--metrics-detail essential` (per policy what the alerts and dashboard read).
//!
//! With `-- <N> takeover [broken]`: a new leader's time to the first pass at N policies (beside 2,000 broken ones).
//! With `-- <N> unread`: each policy's stream holds an entry its group has not read (so every refresh also reads the
//! oldest unread entry); the figures include the Redis commands per policy per interval.
//!
//!   scripts/testenv up && cargo bench --bench many_policies [-- <policies> [shards | server | takeover [broken]]]

#[path = "../tests/common/mod.rs"]
#[allow(unused_macros)]
mod common;

use std::time::{Duration, Instant};

use common::*;

/// (resident set in MiB, CPU seconds used so far) of a process, from /proc.
fn usage(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss_kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .unwrap()
        .trim()
        .trim_end_matches(" kB")
        .trim()
        .parse()
        .unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    (rss_kib / 1024.0, ticks / 100.0)
}

/// RSS at the end and CPU share over a steady window.
fn steady(operator: &Operator, window: Duration) -> (f64, f64) {
    let (_, cpu_before) = usage(operator.pid());
    std::thread::sleep(window);
    let (rss, cpu_after) = usage(operator.pid());
    (rss, 100.0 * (cpu_after - cpu_before) / window.as_secs_f64())
}

/// `total_commands_processed` of a server so far (`INFO stats`, the INFO itself included).
fn commands_processed(server: &Server) -> u64 {
    let info: String = redis::cmd("INFO").arg("stats").query(&mut server.conn()).unwrap();
    info.lines().find_map(|l| l.strip_prefix("total_commands_processed:")).unwrap().trim().parse().unwrap()
}

fn connections(server: &Server) -> usize {
    let list: String = redis::cmd("CLIENT").arg("LIST").query(&mut server.conn()).unwrap();
    list.lines().filter(|l| !l.contains("cmd=client")).count()
}

/// Requests the API server has answered so far, summed over every series of `apiserver_request_total`, and the
/// status writes among them.
fn api_requests() -> (f64, f64) {
    let metrics = kubectl_ok(&["get", "--raw", "/metrics"]);
    let series = metrics.lines().filter(|l| l.starts_with("apiserver_request_total{"));
    let value = |l: &str| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    let (mut all, mut status) = (0.0, 0.0);
    for line in series {
        all += value(line);
        if line.contains("resource=\"consumergrouppolicies\"") && line.contains("subresource=\"status\"") {
            status += value(line);
        }
    }
    (all, status)
}

/// API requests per second (all, status writes) over `window`, less the scrapes of this function itself.
fn api_rate(window: Duration) -> (f64, f64) {
    let (all_before, status_before) = api_requests();
    std::thread::sleep(window);
    let (all_after, status_after) = api_requests();
    let secs = window.as_secs_f64();
    ((all_after - all_before - 1.0) / secs, (status_after - status_before) / secs)
}

/// p99 of `pelican_pass_delay_seconds` over the operator's life, as the upper bound of its bucket.
fn pass_delay_p99(operator: &Operator) -> String {
    let buckets: Vec<(f64, f64)> = operator
        .metrics()
        .lines()
        .filter_map(|l| l.strip_prefix("pelican_pass_delay_seconds_bucket{le=\""))
        .filter_map(|l| {
            let (le, rest) = l.split_once("\"}")?;
            Some((le.parse().unwrap_or(f64::INFINITY), rest.trim().parse().ok()?))
        })
        .collect();
    let total = buckets.last().map_or(0.0, |b| b.1);
    match buckets.iter().find(|(_, n)| *n >= 0.99 * total) {
        Some((le, _)) if le.is_finite() => format!("<= {:.0} ms ({total:.0} passes)", le * 1000.0),
        _ => format!("> 65 s ({total:.0} passes)"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let count: usize = args.iter().find_map(|a| a.parse().ok()).unwrap_or(1000);
    let sharded = args.iter().any(|a| a == "shards");
    if sharded {
        return shards(count);
    }
    if args.iter().any(|a| a == "server") {
        return one_server(count);
    }
    if args.iter().any(|a| a == "takeover") {
        return takeover(count, args.iter().any(|a| a == "broken"));
    }
    let servers = [Server::start(Flavor::Redis), Server::start(Flavor::Redis), Server::start(Flavor::Valkey)];
    // One full interval, so every policy is refreshed (and its pass run) once inside the window.
    let window = Duration::from_secs(65);

    let idle_ns = namespace("idle");
    let idle = Operator::start(&idle_ns);
    std::thread::sleep(Duration::from_secs(2));
    let (idle_rss, idle_cpu) = steady(&idle, window);
    let (idle_api, idle_status) = api_rate(Duration::from_secs(30));
    drop(idle);

    if args.iter().any(|a| a == "unread") {
        let mut conns: Vec<redis::Connection> = servers.iter().map(Server::conn).collect();
        for i in 0..count {
            let conn = &mut conns[i % servers.len()];
            let _: String = redis::cmd("XADD").arg(format!("s{i}")).arg("*").arg("n").arg(1).query(conn).unwrap();
        }
    }
    let ns = namespace("many");
    let operator = Operator::start(&ns);
    let all_ready = apply_policies(&ns, &servers, count, |_| None);
    let commands_before: u64 = servers.iter().map(commands_processed).sum();
    let (rss, cpu) = steady(&operator, window);
    let commands = servers.iter().map(commands_processed).sum::<u64>() - commands_before;
    let per_interval = commands as f64 / count as f64 * 60.0 / window.as_secs_f64();
    let (api, status) = api_rate(window);
    let per_server: Vec<usize> = servers.iter().map(connections).collect();

    println!("{count} policies over 3 servers (redis 7.0, redis 7.0, valkey 9.1), interval 1m");
    println!("applied to all Ready: {:.1} s", all_ready.as_secs_f64());
    println!("connections per server (CLIENT LIST): {per_server:?}");
    println!("pass delay p99 (due -> start): {}", pass_delay_p99(&operator));
    println!("Redis commands per policy per interval (1m), steady: {per_interval:.2}");
    println!("{:<28} {:>10} {:>12} {:>14} {:>16}", "", "RSS (MiB)", "CPU (%)", "API req/s", "status writes/s");
    println!(
        "{:<28} {:>10.1} {:>12.2} {:>14.1} {:>16.1}",
        "operator, no policy", idle_rss, idle_cpu, idle_api, idle_status
    );
    println!(
        "{:<28} {:>10.1} {:>12.2} {:>14.1} {:>16.1}",
        format!("operator, {count} policies"),
        rss,
        cpu,
        api,
        status
    );
    assert!(per_server.iter().all(|c| *c <= 2), "policies must share connections: {per_server:?}");

    // /metrics with every series per policy, then with the essential ones (the operator restarted with the flag,
    // every policy reported again).
    let full = exposition(&operator);
    drop(operator);
    let operator = Operator::start_with(&ns, &["--metrics-detail", "essential"]);
    let reported = wait_for("every policy on /metrics again", Duration::from_secs(1800), || {
        let text = operator.metrics();
        let ready = text.lines().filter(|l| l.starts_with("pelican_policy_ready{")).count();
        if ready == count { Ok(exposition(&operator)) } else { Err(format!("{ready} of {count}")) }
    });
    println!("{:<28} {:>10} {:>18} {:>12}", "/metrics", "series", "series per policy", "bytes");
    for (detail, (series, bytes)) in [("--metrics-detail full", full), ("--metrics-detail essential", reported)] {
        let per_policy = series as f64 / count as f64;
        println!("{detail:<28} {series:>10} {per_policy:>18.1} {bytes:>12}");
    }
}

/// Series and bytes of one scrape of `/metrics`.
fn exposition(operator: &Operator) -> (usize, usize) {
    let text = operator.metrics();
    (text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()).count(), text.len())
}

/// Two operators, each reconciling the policies of its shard (label `sharding.pelican.io/key`), with its own Lease.
fn shards(count: usize) {
    let servers = [Server::start(Flavor::Redis), Server::start(Flavor::Redis), Server::start(Flavor::Valkey)];
    let window = Duration::from_secs(65);
    let ns = namespace("shards");
    let operators: Vec<Operator> = ["a", "b"]
        .iter()
        .map(|shard| {
            let selector = format!("--watch-label-selector=sharding.pelican.io/key={shard}");
            let lease = format!("--leader-election-lease=pelican-leader-{shard}");
            Operator::start_with(&ns, &[&selector, "--leader-elect", "--leader-election-namespace", &ns, &lease])
        })
        .collect();
    let all_ready = apply_policies(&ns, &servers, count, |i| Some(if i % 2 == 0 { "a" } else { "b" }));
    let usage: Vec<(f64, f64)> = operators.iter().map(|o| usage(o.pid())).collect();
    std::thread::sleep(window);
    println!(
        "{count} policies in 2 shards over 3 servers, interval 1m; applied to all Ready: {:.1} s",
        all_ready.as_secs_f64()
    );
    println!("{:<10} {:>10} {:>10} {:>12} {:>14}", "shard", "policies", "RSS (MiB)", "CPU (%)", "reconciles");
    for ((shard, operator), (_, cpu_before)) in ["a", "b"].iter().zip(&operators).zip(usage) {
        let (rss, cpu_after) = usage_now(operator);
        let reconciles: f64 = operator
            .metrics()
            .lines()
            .filter(|l| l.starts_with("controller_runtime_reconcile_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        let owned = operator.logs().matches("acquired the leader lease").count();
        assert_eq!(owned, 1, "each shard leads its own Lease");
        println!(
            "{shard:<10} {:>10} {rss:>10.1} {:>12.2} {reconciles:>14.0}",
            count / 2,
            100.0 * (cpu_after - cpu_before) / window.as_secs_f64()
        );
    }
}

/// The same policies on one server, inline and then through one `RedisServer` (in the policies' namespace, which a
/// server without tenants admits), each with an operator of its own: time to all Ready, steady RSS and CPU,
/// connections on the server.
fn one_server(count: usize) {
    let server = Server::start(Flavor::Redis);
    let window = Duration::from_secs(65);
    let mut rows = Vec::new();
    for by_reference in [false, true] {
        let ns = namespace(if by_reference { "by-ref" } else { "inline" });
        let operator = Operator::start(&ns);
        if by_reference {
            let rs = format!(
                "apiVersion: pelican.io/v1alpha1\nkind: RedisServer\nmetadata:\n  name: shared\nspec:\n  url: {}\n",
                server.url()
            );
            assert!(kubectl_apply(&ns, &rs).0);
        }
        let start = Instant::now();
        let manifests: Vec<String> = (0..count)
            .map(|i| {
                let manifest = policy(&format!("p{i}"), &server.url(), &format!("s{i}"), "g", "")
                    .replace("    interval: 1s\n", "");
                match by_reference {
                    true => {
                        manifest.replace(&format!("    url: {}\n", server.url()), "    serverRef: {name: shared}\n")
                    }
                    false => manifest,
                }
            })
            .collect();
        for chunk in manifests.chunks(500) {
            let (ok, out) = kubectl_apply(&ns, &chunk.join("---\n"));
            assert!(ok, "{out}");
        }
        wait_all_ready(&ns, count, Duration::from_secs(3600));
        let all_ready = start.elapsed();
        let (rss, cpu) = steady(&operator, window);
        let label = if by_reference { "one RedisServer" } else { "inline URL" };
        rows.push((label, all_ready.as_secs_f64(), rss, cpu, connections(&server)));
        drop(operator);
    }
    println!("{count} policies on one server (redis 7.0), interval 1m");
    println!("{:<18} {:>16} {:>10} {:>10} {:>13}", "", "all Ready (s)", "RSS (MiB)", "CPU (%)", "connections");
    for (label, ready, rss, cpu, conns) in rows {
        println!("{label:<18} {ready:>16.1} {rss:>10.1} {cpu:>10.2} {conns:>13}");
    }
}

/// A takeover at `count` policies on one server (and with `broken`, beside 2,000 policies on servers that are gone):
/// all Ready under a first operator, which is killed; a poison entry is left waiting on 100 sampled policies; a new
/// operator starts. Prints p50 / p90 / max of the time from its start to each sample's entry dead-lettered: the
/// time to the first pass of a new leader.
fn takeover(count: usize, broken: bool) {
    let server = Server::start(Flavor::Redis);
    let ns = namespace("takeover");
    let healthy = |i: usize| {
        policy(&format!("p{i}"), &server.url(), &format!("s{i}"), "g", "  retry:\n    maxDeliveries: 1\n")
            .replace("    interval: 1s\n", "    minIdle: 1s\n")
    };
    let mut manifests: Vec<String> = (0..count).map(healthy).collect();
    if broken {
        let gone: Vec<u16> = (0..100).map(|_| free_port()).collect();
        manifests.extend((0..2000).map(|i| {
            let url = format!("redis://127.0.0.1:{}/0", gone[i % gone.len()]);
            policy(&format!("gone{i}"), &url, &format!("s{i}"), "g", "")
        }));
    }
    let mut first = Operator::start(&ns);
    for chunk in manifests.chunks(250) {
        assert!(kubectl_apply(&ns, &chunk.join("---\n")).0);
    }
    let path = "jsonpath={.items[*].status.conditions[?(@.type==\"Ready\")].reason}";
    wait_for("every policy reconciled once", Duration::from_secs(3600), || {
        let reasons = kubectl_ok(&["get", "cgp", "-n", &ns, "-o", path]);
        let seen = reasons.split_whitespace().count();
        if seen == manifests.len() { Ok(()) } else { Err(format!("{seen} of {}", manifests.len())) }
    });
    first.kill9();
    let samples: Vec<usize> = (0..100).map(|k| k * count / 100).collect();
    let mut conn = server.conn();
    for &i in &samples {
        let _: String = redis::cmd("XADD").arg(format!("s{i}")).arg("*").arg("n").arg(1).query(&mut conn).unwrap();
        assert_eq!(read_new(&mut conn, &format!("s{i}"), "g", "w", 10).len(), 1);
    }
    let started = Instant::now();
    let _second = Operator::start(&ns);
    let mut waiting: Vec<usize> = samples.clone();
    let mut took: Vec<Duration> = Vec::new();
    while !waiting.is_empty() {
        assert!(started.elapsed() < Duration::from_secs(600), "{} samples not dead-lettered in 10 min", waiting.len());
        waiting.retain(|i| {
            let len: usize = redis::cmd("XLEN").arg(format!("s{i}:dlq")).query(&mut conn).unwrap();
            if len == 1 {
                took.push(started.elapsed());
            }
            len == 0
        });
        std::thread::sleep(Duration::from_millis(100));
    }
    took.sort();
    let at = |q: f64| took[((took.len() - 1) as f64 * q) as usize].as_secs_f64();
    let beside = if broken { " beside 2,000 on servers that are gone" } else { "" };
    println!("takeover of {count} policies on one server{beside}: a waiting poison entry on 100 sampled policies");
    println!(
        "time from the new operator's start to dead-lettered: p50 {:.1} s, p90 {:.1} s, max {:.1} s",
        at(0.5),
        at(0.9),
        at(1.0)
    );
}

fn usage_now(operator: &Operator) -> (f64, f64) {
    usage(operator.pid())
}

/// Applies `count` policies spread over `servers` with the default interval (each refreshed and its jobs run once a
/// minute), `shard(i)` as their `sharding.pelican.io/key` label, and waits until all are Ready: how long it took.
fn apply_policies(
    ns: &str,
    servers: &[Server],
    count: usize,
    shard: impl Fn(usize) -> Option<&'static str>,
) -> Duration {
    let manifests: Vec<String> = (0..count)
        .map(|i| {
            let manifest = policy(&format!("p{i}"), &servers[i % servers.len()].url(), &format!("s{i}"), "g", "")
                .replace("    interval: 1s\n", "");
            match shard(i) {
                Some(key) => manifest.replacen(
                    "metadata:\n",
                    &format!("metadata:\n  labels:\n    sharding.pelican.io/key: {key}\n"),
                    1,
                ),
                None => manifest,
            }
        })
        .collect();
    let started = Instant::now();
    for chunk in manifests.chunks(250) {
        assert!(kubectl_apply(ns, &chunk.join("---\n")).0);
    }
    wait_all_ready(ns, count, Duration::from_secs((count as u64 / 5).max(300)));
    started.elapsed()
}
