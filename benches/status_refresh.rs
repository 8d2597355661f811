//! Status refresh cost against PEL size: the probe must cost the same with 1k and 200k pending entries.
//! Prints one row per server and PEL size, next to a PING round trip on the same connection.
//!
//!   scripts/testenv up && cargo bench --bench status_refresh [-- 1000 200000 1000000]

use std::time::{Duration, Instant};

use pelican::redis::{GroupKeys, Pools, Target, probe_group};
use support::{bed_var, deliver_all, fill_stream};

mod support;

const SAMPLES: usize = 300;

fn summary(mut samples: Vec<Duration>) -> String {
    samples.sort();
    let mean = samples.iter().sum::<Duration>() / samples.len() as u32;
    let p = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    format!(
        "{:>8.1} {:>8.1} {:>8.1}",
        mean.as_secs_f64() * 1e6,
        p(0.5).as_secs_f64() * 1e6,
        p(0.99).as_secs_f64() * 1e6
    )
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let sizes: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let sizes = if sizes.is_empty() { vec![1_000, 200_000] } else { sizes };
    let pools = Pools::default();
    println!("status refresh (one probe = 1 pipelined round trip), {SAMPLES} samples, microseconds");
    println!(
        "{:<14} {:>9} {:>10} {:>8} {:>8} {:>8}   {:>8} {:>8} {:>8}",
        "server", "pending", "", "mean", "p50", "p99", "mean", "p50", "p99"
    );
    println!("{:<14} {:>9} {:>10} {:>26}   {:>26}", "", "", "", "--- probe ---", "--- PING baseline ---");
    for (label, var) in [("redis", "PELICAN_REDIS_URL"), ("valkey", "PELICAN_VALKEY_URL")] {
        let target = Target::new(bed_var(var));
        let mut conn = pools.get(&target).await.unwrap();
        let info: String = redis::cmd("INFO").arg("server").query_async(&mut conn).await.unwrap();
        let server = pelican::redis::ServerInfo::parse(&info).to_string();
        for &size in &sizes {
            let stream = format!("bench:refresh:{size}");
            fill_stream(&mut conn, &stream, "g", size, 0).await;
            deliver_all(&mut conn, &stream, "g", size).await;
            let keys = GroupKeys { stream: &stream, group: "g", dead_letter: "bench:refresh:dlq" };
            let facts = probe_group(&mut conn, label, &keys, None).await.unwrap();
            assert_eq!(facts.pending, size as i64, "the PEL was not filled");
            let (mut probes, mut pings) = (Vec::with_capacity(SAMPLES), Vec::with_capacity(SAMPLES));
            for _ in 0..SAMPLES {
                let start = Instant::now();
                probe_group(&mut conn, label, &keys, None).await.unwrap();
                probes.push(start.elapsed());
                let start = Instant::now();
                let _: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
                pings.push(start.elapsed());
            }
            println!("{:<14} {:>9} {:>10} {}   {}", server, size, "", summary(probes), summary(pings));
            let _: () = redis::cmd("DEL").arg(&stream).query_async(&mut conn).await.unwrap();
        }
    }
}
