//! 1,000 policies spread over 3 servers: the connections they use (CLIENT LIST on each server) and the operator's
//! steady-state RSS and CPU, next to the same operator with no policy at all as the baseline.
//!
//!   scripts/testenv up && cargo bench --bench many_policies [-- <policies>]

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

fn connections(server: &Server) -> usize {
    let list: String = redis::cmd("CLIENT").arg("LIST").query(&mut server.conn()).unwrap();
    list.lines().filter(|l| !l.contains("cmd=client")).count()
}

fn main() {
    let count: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(1000);
    let servers = [Server::start(Flavor::Redis), Server::start(Flavor::Redis), Server::start(Flavor::Valkey)];
    // One full interval, so every policy is refreshed (and its pass run) once inside the window.
    let window = Duration::from_secs(65);

    let idle_ns = namespace("idle");
    let idle = Operator::start(&idle_ns);
    std::thread::sleep(Duration::from_secs(2));
    let (idle_rss, idle_cpu) = steady(&idle, window);
    drop(idle);

    let ns = namespace("many");
    let operator = Operator::start(&ns);
    let manifests: Vec<String> = (0..count)
        .map(|i| {
            let stream = format!("s{i}");
            // The default interval: each policy is refreshed, and its jobs run, once a minute.
            policy(&format!("p{i}"), &servers[i % 3].url(), &stream, "g", "").replace("    interval: 1s\n", "")
        })
        .collect();
    let started = Instant::now();
    for chunk in manifests.chunks(250) {
        assert!(kubectl_apply(&ns, &chunk.join("---\n")).0);
    }
    wait_all_ready(&ns, count, Duration::from_secs(300));
    let all_ready = started.elapsed();
    let (rss, cpu) = steady(&operator, window);
    let per_server: Vec<usize> = servers.iter().map(connections).collect();

    println!("{count} policies over 3 servers (redis 7.0, redis 7.0, valkey 9.1), interval 1m");
    println!("applied to all Ready: {:.1} s", all_ready.as_secs_f64());
    println!("connections per server (CLIENT LIST): {per_server:?}");
    println!("{:<28} {:>10} {:>12}", "", "RSS (MiB)", "CPU (%)");
    println!("{:<28} {:>10.1} {:>12.2}", "operator, no policy", idle_rss, idle_cpu);
    println!("{:<28} {:>10.1} {:>12.2}", format!("operator, {count} policies"), rss, cpu);
    assert!(per_server.iter().all(|c| *c <= 2), "policies must share connections: {per_server:?}");
}
