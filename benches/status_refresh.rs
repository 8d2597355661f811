//! Status refresh cost against PEL size: the probe must cost the same with 1k and 200k pending entries
//! (SPEC section 8). Prints one row per server and PEL size, next to a PING round trip on the same connection.
//!
//!   scripts/testenv up && cargo bench --bench status_refresh [-- 1000 200000 1000000]

use std::time::{Duration, Instant};

use pelican::redis::{Conn, GroupKeys, Pools, Target, probe_group};

const SAMPLES: usize = 300;

fn bed_var(name: &str) -> String {
    let dir = std::env::var("PELICAN_TESTENV").unwrap_or_else(|_| "/tmp/pelican-testenv".into());
    let env = std::fs::read_to_string(format!("{dir}/env")).expect("the test bed is not up: run scripts/testenv up");
    env.lines()
        .find_map(|l| l.strip_prefix(&format!("export {name}=")))
        .map(str::to_string)
        .unwrap_or_else(|| panic!("{name} missing from the bed env"))
}

/// A stream of `size` entries, all delivered to one consumer and none acknowledged.
async fn fill(conn: &mut Conn, stream: &str, size: usize) {
    let _: () = redis::cmd("DEL").arg(stream).query_async(conn).await.unwrap();
    for start in (0..size).step_by(1000) {
        let mut pipe = redis::pipe();
        for i in start..(start + 1000).min(size) {
            pipe.cmd("XADD").arg(stream).arg("*").arg("n").arg(i).ignore();
        }
        let _: () = pipe.query_async(conn).await.unwrap();
    }
    let _: () = redis::cmd("XGROUP").arg("CREATE").arg(stream).arg("g").arg("0").query_async(conn).await.unwrap();
    let mut delivered = 0;
    while delivered < size {
        let reply: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("g")
            .arg("worker")
            .arg("COUNT")
            .arg(10_000)
            .arg("STREAMS")
            .arg(stream)
            .arg(">")
            .query_async(conn)
            .await
            .unwrap();
        delivered += reply.keys.first().map_or(0, |k| k.ids.len());
    }
}

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
            fill(&mut conn, &stream, size).await;
            let keys = GroupKeys { stream: &stream, group: "g", dead_letter: "bench:refresh:dlq" };
            let facts = probe_group(&mut conn, label, &keys).await.unwrap();
            assert_eq!(facts.pending, size as i64, "the PEL was not filled");
            let (mut probes, mut pings) = (Vec::with_capacity(SAMPLES), Vec::with_capacity(SAMPLES));
            for _ in 0..SAMPLES {
                let start = Instant::now();
                probe_group(&mut conn, label, &keys).await.unwrap();
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
