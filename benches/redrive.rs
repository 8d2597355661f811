//! Dead-letter redrive, side by side in one run on each server of the bed: Pelican's steps (one script
//! call that reads a batch, moves it and records the progress) against what a competent engineer would
//! write by hand: XRANGE a page, then one MULTI/EXEC pipeline of XADD + XDEL per entry (atomic per batch, but no
//! record of progress, so a crash between the read and the EXEC is safe only because the batch is re-read).
//! Both move 100,000 dead letters (100-byte body plus Pelican's metadata) with batches of 128, no rate limit.
//!
//!   scripts/testenv up && cargo bench --bench redrive [-- <entries>]
//!
//! Ends with one `SUMMARY redrive` line per server (reference: the hand-written loop), Redis 7.0 first.

use std::time::Instant;

use pelican::jobs::redrive::{Destination, Plan, Progress, read_progress, snapshot, step};
use pelican::keys::{redrive_key, redrive_lock_key};
use pelican::redis::{Conn, Pools, Target};
use redis::streams::StreamRangeReply;
use support::bed_var;

mod support;

const DLQ: &str = "{bench}:dlq";
const SOURCE: &str = "{bench}:events";
const BATCH: usize = 128;

async fn fill(conn: &mut Conn, count: usize) {
    let _: () =
        redis::cmd("DEL").arg(DLQ).arg(SOURCE).arg(redrive_key(DLQ, "bench", "r")).query_async(conn).await.unwrap();
    let body = "x".repeat(100);
    for start in (0..count).step_by(1000) {
        let mut pipe = redis::pipe();
        for n in start..(start + 1000).min(count) {
            pipe.cmd("XADD").arg(DLQ).arg("*").arg("n").arg(n).arg("body").arg(&body);
            for (k, v) in [
                ("pelican-source-stream", SOURCE),
                ("pelican-source-id", "1-1"),
                ("pelican-origin-id", "1-1"),
                ("pelican-group", "workers"),
                ("pelican-consumer", "worker-1"),
                ("pelican-deliveries", "3"),
                ("pelican-reason", "MaxDeliveriesExceeded"),
                ("pelican-dead-lettered-at", "1"),
            ] {
                pipe.arg(k).arg(v);
            }
            pipe.ignore();
        }
        let _: () = pipe.query_async(conn).await.unwrap();
    }
}

async fn pelican_redrive(conn: &mut Conn, server: &str) -> usize {
    let plan = Plan {
        dead_letter: DLQ.into(),
        progress_key: redrive_key(DLQ, "bench", "r"),
        lock_key: redrive_lock_key(DLQ),
        full_name: "bench/r".into(),
        uid: "bench-uid".into(),
        name: "r".into(),
        target: Destination::Source { fallback: SOURCE.into() },
        reasons: Vec::new(),
        from: None,
        to: None,
        max_messages: None,
        cluster: false,
        keys: None,
    };
    let until = snapshot(conn, server, &plan).await.unwrap().until_id.unwrap();
    let mut progress = Progress::default();
    let mut destinations = Vec::new();
    loop {
        let done = step(conn, server, &plan, &until, &progress, BATCH as u64, &mut destinations).await.unwrap();
        progress.moved += done.moved;
        progress.last_id = done.last_id;
        if done.finished {
            break;
        }
    }
    assert_eq!(read_progress(conn, server, &plan.progress_key).await.unwrap().moved, progress.moved);
    progress.moved as usize
}

async fn client_loop(conn: &mut Conn) -> usize {
    let mut moved = 0;
    loop {
        let page: StreamRangeReply =
            redis::cmd("XRANGE").arg(DLQ).arg("-").arg("+").arg("COUNT").arg(BATCH).query_async(conn).await.unwrap();
        if page.ids.is_empty() {
            return moved;
        }
        let mut pipe = redis::pipe();
        pipe.atomic();
        for entry in &page.ids {
            let cmd = pipe.cmd("XADD").arg(SOURCE).arg("*");
            for (k, v) in &entry.map {
                if let (false, redis::Value::BulkString(bytes)) = (k.starts_with("pelican-"), v) {
                    cmd.arg(k).arg(bytes);
                }
            }
            cmd.arg("pelican-redriven-from").arg(&entry.id).ignore();
            pipe.cmd("XDEL").arg(DLQ).arg(&entry.id).ignore();
        }
        let _: () = pipe.query_async(conn).await.unwrap();
        moved += page.ids.len();
    }
}

#[tokio::main]
async fn main() {
    let count: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(100_000);
    println!("redrive of {count} dead letters, batches of {BATCH}, no rate limit");
    println!("{:<12} {:>26} {:>26}", "server", "Pelican (entries/s)", "XRANGE+MULTI (entries/s)");
    let mut summaries = Vec::new();
    for (label, var) in [("redis 7.0", "PELICAN_REDIS_URL"), ("valkey 9.1", "PELICAN_VALKEY_URL")] {
        let url = bed_var(var);
        let pools = Pools::default();
        let target = Target::new(&url);
        let mut conn = pools.get(&target).await.unwrap();
        fill(&mut conn, count).await;
        let start = Instant::now();
        let moved = pelican_redrive(&mut conn, &target.server()).await;
        let ours = moved as f64 / start.elapsed().as_secs_f64();
        assert_eq!(moved, count);
        fill(&mut conn, count).await;
        let start = Instant::now();
        let moved = client_loop(&mut conn).await;
        let theirs = moved as f64 / start.elapsed().as_secs_f64();
        assert_eq!(moved, count);
        println!("{label:<12} {ours:>26.0} {theirs:>26.0}");
        summaries
            .push(format!("SUMMARY redrive pelican={ours:.0}/s reference={theirs:.0}/s ratio={:.2}", ours / theirs));
    }
    println!();
    for line in summaries {
        println!("{line}");
    }
}
