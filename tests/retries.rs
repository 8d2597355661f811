//! Retries with backoff and the last error, through the operator against the real API server and real Redis 7.0 /
//! Valkey 9.1: the spacing a consumer sees between deliveries of one message, the error that travels with it into
//! the dead letter, and the errors hash left empty.

#[macro_use]
mod common;

use std::time::{Duration, Instant};

use common::*;
use pelican::keys::errors_key;
use pelican::worker::{Message, Outcome, Worker, WorkerConfig};

on_both_servers!(
    retries_back_off_one_two_four_eight_seconds_then_dead_letter,
    the_dead_letter_carries_the_last_of_three_errors_recorded_by_the_sdk,
    sdk_workers_with_default_settings_keep_the_cap_and_the_spacing_requeue,
    sdk_workers_with_default_settings_keep_the_cap_and_the_spacing_reassign,
);

fn sdk_workers_with_default_settings_keep_the_cap_and_the_spacing_requeue(flavor: Flavor) {
    sdk_workers_keep_the_cap_and_the_spacing(flavor, "Requeue", &["w1"]);
}

fn sdk_workers_with_default_settings_keep_the_cap_and_the_spacing_reassign(flavor: Flavor) {
    sdk_workers_keep_the_cap_and_the_spacing(flavor, "Reassign", &["w1", "w2"]);
}

/// Defect: the SDK re-read its own PEL every `pel_check_interval` (30 s by default), each read a delivery that reset
/// the entry's idle time, so with `minIdle` past 30 s a message that always failed was retried every 30 s for as
/// long as the worker ran, never dead-lettered. The defaults scaled only in time (`minIdle: 45s`, the SDK's own
/// `WorkerConfig::new`, `maxDeliveries: 3`): the handler sees the poison message 3 times, at least 45 s apart, then
/// it is dead-lettered. A stream of other messages, handled fine, keeps the workers live (for `Reassign`).
fn sdk_workers_keep_the_cap_and_the_spacing(flavor: Flavor, strategy: &str, consumers: &[&str]) {
    let server = Server::start(flavor);
    let extra = "  retry:\n    maxDeliveries: 3\n";
    let manifest = policy("poison", &server.url(), "tasks", "workers", extra)
        .replace("    interval: 1s\n", &format!("    interval: 5s\n    minIdle: 45s\n    strategy: {strategy}\n"));
    let (_ns, _operator) = ready_policy("sdk-cap", &manifest, "poison");
    let mut conn = server.conn();
    let _: String = redis::cmd("XADD").arg("tasks").arg("*").arg("kind").arg("poison").query(&mut conn).unwrap();
    let calls = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(String, Instant)>::new()));
    let dead = runtime().block_on(async {
        let client = redis::Client::open(server.url()).unwrap();
        let stop = std::sync::Arc::new(tokio::sync::Notify::new());
        let mut workers = Vec::new();
        for consumer in consumers {
            let worker = Worker::connect(&client, WorkerConfig::new("tasks", "workers", *consumer)).await.unwrap();
            let (calls, stop) = (calls.clone(), stop.clone());
            let handler = move |message: Message| {
                let calls = calls.clone();
                async move {
                    if message.field_str("kind") != Some("poison") {
                        return Ok(Outcome::Done);
                    }
                    calls.lock().unwrap().push((message.id.clone(), Instant::now()));
                    Err("poison".into())
                }
            };
            workers.push(tokio::spawn(worker.run(handler, async move { stop.notified().await })));
        }
        let mut filler = redis::Client::open(server.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
        let started = Instant::now();
        let dead = loop {
            let _: String = redis::cmd("XADD")
                .arg("tasks")
                .arg("*")
                .arg("kind")
                .arg("filler")
                .query_async(&mut filler)
                .await
                .unwrap();
            let dead: Vec<RawEntryOwned> =
                redis::cmd("XRANGE").arg("tasks:dlq").arg("-").arg("+").query_async(&mut filler).await.unwrap();
            if !dead.is_empty() || started.elapsed() > Duration::from_secs(300) {
                break dead;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        // A while longer: no delivery after the dead letter.
        tokio::time::sleep(Duration::from_secs(6)).await;
        stop.notify_waiters();
        for worker in workers {
            worker.await.unwrap().unwrap();
        }
        dead
    });
    let calls = calls.lock().unwrap().clone();
    let gaps: Vec<f64> = calls.windows(2).map(|w| (w[1].1 - w[0].1).as_secs_f64()).collect();
    println!("{flavor:?} {strategy}: {} deliveries, {gaps:.1?} s apart; {} dead letter(s)", calls.len(), dead.len());
    assert_eq!(dead.len(), 1, "dead-lettered once within 300 s; deliveries {gaps:?}");
    let deliveries = dead[0].1.iter().position(|v| v == "pelican-deliveries").map(|i| dead[0].1[i + 1].clone());
    assert_eq!(deliveries.as_deref(), Some("3"), "{:?}", dead[0]);
    assert_eq!(calls.len(), 3, "the handler saw the message {} times: {gaps:?}", calls.len());
    // Due at 45 s idle; a delivery is a little after the server made it, so allow the reads' own latency.
    assert!(gaps.iter().all(|g| *g >= 44.5), "deliveries {gaps:?} s apart, minIdle is 45s");
}

/// An XRANGE entry: id and its flat fields as text.
type RawEntryOwned = (String, Vec<String>);

/// With `minIdle: 1s, factor: 2, max: 8s, maxDeliveries: 5`, a consumer that reads `>` and never acknowledges
/// sees the message's deliveries 1, 2, 4 and 8 s apart (each within one `interval` of that), then one dead letter
/// carrying the error it recorded last, in the plain-Redis way any language would (`HSET ...:errors <id> <text>`).
fn retries_back_off_one_two_four_eight_seconds_then_dead_letter(flavor: Flavor) {
    let server = Server::start(flavor);
    let extra = "  retry:\n    maxDeliveries: 5\n    backoff: {factor: 2, max: 8s}\n";
    let manifest = policy("spaced", &server.url(), "jobs", "workers", extra)
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n");
    let (_ns, _operator) = ready_policy("backoff", &manifest, "spaced");
    let mut conn = server.conn();
    let _: String = redis::cmd("XADD").arg("jobs").arg("*").arg("n").arg(1).query(&mut conn).unwrap();
    let errors = errors_key("jobs", "workers");
    let start = Instant::now();
    let mut received = Vec::new();
    while received.len() < 5 && start.elapsed() < Duration::from_secs(60) {
        let reply: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("workers")
            .arg("c1")
            .arg("COUNT")
            .arg(10)
            .arg("BLOCK")
            .arg(200)
            .arg("STREAMS")
            .arg("jobs")
            .arg(">")
            .query(&mut conn)
            .unwrap();
        for entry in reply.keys.iter().flat_map(|k| &k.ids) {
            received.push(start.elapsed());
            let text = format!("downstream unavailable (attempt {})", received.len());
            let _: i64 = redis::cmd("HSET").arg(&errors).arg(&entry.id).arg(text).query(&mut conn).unwrap();
        }
    }
    assert_eq!(received.len(), 5, "five deliveries: {received:?}");
    let gaps: Vec<f64> = received.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).collect();
    println!("{flavor:?}: deliveries {:.2?} s apart (expected 1, 2, 4, 8)", gaps);
    for (gap, expected) in gaps.iter().zip([1.0, 2.0, 4.0, 8.0]) {
        // Due at `expected` seconds idle; taken by the first pass after that (interval 1s), plus a pass's own time.
        assert!(*gap >= expected - 0.05 && *gap <= expected + 1.6, "gaps {gaps:?}: {gap} is not about {expected}");
    }
    let dead = wait_for("one dead letter", Duration::from_secs(20), || {
        let entries = xrange(&mut conn, "jobs:dlq");
        if entries.len() == 1 { Ok(entries) } else { Err(format!("{} dead letters", entries.len())) }
    });
    let last_error = field(&dead[0], "pelican-last-error").map(|v| String::from_utf8_lossy(v).into_owned());
    assert_eq!(last_error.as_deref(), Some("downstream unavailable (attempt 5)"));
    assert_eq!(field(&dead[0], "pelican-deliveries"), Some(b"5".as_slice()));
    std::thread::sleep(Duration::from_secs(9));
    assert_eq!(xrange(&mut conn, "jobs:dlq").len(), 1, "dead-lettered once");
    let left: i64 = redis::cmd("HLEN").arg(&errors).query(&mut conn).unwrap();
    assert_eq!(left, 0, "the errors hash holds nothing once the message left the PEL");
}

/// The SDK records each failure's text; the third of three different errors is the dead letter's
/// `pelican-last-error`, and the errors hash is empty afterwards.
fn the_dead_letter_carries_the_last_of_three_errors_recorded_by_the_sdk(flavor: Flavor) {
    let server = Server::start(flavor);
    let extra = "  retry:\n    maxDeliveries: 3\n";
    let manifest = policy("three", &server.url(), "files", "converters", extra)
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n");
    let (ns, _operator) = ready_policy("last-error", &manifest, "three");
    let mut conn = server.conn();
    let _: String = redis::cmd("XADD").arg("files").arg("*").arg("path").arg("a.pdf").query(&mut conn).unwrap();
    // A message that is ACKed after failing once: its field goes with the ACK.
    let _: String = redis::cmd("XADD").arg("files").arg("*").arg("path").arg("ok.pdf").query(&mut conn).unwrap();
    let config = WorkerConfig { block: Duration::from_millis(100), ..WorkerConfig::new("files", "converters", "w1") };
    let handler = |message: Message| async move {
        let attempt = message.field_str("pelican-deliveries").map_or(1, |n| n.parse::<u32>().unwrap() + 1);
        let path = message.field_str("path").unwrap_or_default().to_string();
        match (path.as_str(), attempt) {
            ("ok.pdf", 2) => Ok(Outcome::Done),
            (_, 1) => Err("converter: connection refused".into()),
            (_, 2) => Err("converter: timeout after 30s".into()),
            _ => Err(format!("converter: {path} is not a PDF (attempt {attempt})").into()),
        }
    };
    runtime().block_on(async {
        let client = redis::Client::open(server.url()).unwrap();
        let worker = Worker::connect(&client, config).await.unwrap();
        worker.run(handler, tokio::time::sleep(Duration::from_secs(8))).await.unwrap()
    });
    let dead = wait_for("the dead letter", Duration::from_secs(20), || {
        let entries = xrange(&mut conn, "files:dlq");
        if entries.len() == 1 { Ok(entries) } else { Err(format!("{} dead letters", entries.len())) }
    });
    let last_error = field(&dead[0], "pelican-last-error").map(|v| String::from_utf8_lossy(v).into_owned());
    assert_eq!(last_error.as_deref(), Some("converter: a.pdf is not a PDF (attempt 3)"));
    let left: i64 = redis::cmd("HLEN").arg(errors_key("files", "converters")).query(&mut conn).unwrap();
    assert_eq!(left, 0, "the errors hash is empty: the dead letter took one field, the ACK the other");
    // `kubectl pelican dlq` shows it.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kubectl-pelican"))
        .args(["dlq", "three", "-n", &ns, "-o", "json"])
        .env("KUBECONFIG", bed().kubeconfig())
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["entries"][0]["lastError"], "converter: a.pdf is not a PDF (attempt 3)", "{report}");
    let table = std::process::Command::new(env!("CARGO_BIN_EXE_kubectl-pelican"))
        .args(["dlq", "three", "-n", &ns])
        .env("KUBECONFIG", bed().kubeconfig())
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("LAST-ERROR") && table.contains("converter: a.pdf is not a PDF (attempt …"), "{table}");
    println!("$ kubectl pelican dlq three\n{table}");
}
