//! `DeadLetterRedrive` through the operator: a real API server, real Redis 7.0 and Valkey 9.1,
//! an operator killed with SIGKILL at random instants, and a consumer that finally processes what was redriven.

#[macro_use]
mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

on_both_servers!(
    ten_thousand_dead_letters_redriven_through_kill9_each_exactly_once,
    poison_dead_lettered_fixed_redriven_and_processed,
    filters_move_exactly_the_matching_entries,
);

/// Writes `count` dead letters the way the reclaim script does (application fields, then Pelican's metadata);
/// `reason(n)` picks each one's `pelican-reason`.
fn dead_letters(
    conn: &mut redis::Connection,
    dlq: &str,
    source: &str,
    count: u64,
    reason: impl Fn(u64) -> &'static str,
) {
    for start in (0..count).step_by(1000) {
        let mut pipe = redis::pipe();
        for n in start..(start + 1000).min(count) {
            pipe.add_command(dead_letter(dlq, source, n, reason(n))).ignore();
        }
        let _: () = pipe.query(conn).unwrap();
    }
}

/// [`dead_letters`] one command at a time, through a Cluster connection (whose pipelines are of another kind).
fn dead_letters_on_a_cluster(conn: &mut redis::cluster::ClusterConnection, dlq: &str, source: &str, count: u64) {
    for n in 0..count {
        let _: String = dead_letter(dlq, source, n, "MaxDeliveriesExceeded").query(conn).unwrap();
    }
}

/// The `XADD` of dead letter `n` of `source`.
fn dead_letter(dlq: &str, source: &str, n: u64, reason: &str) -> redis::Cmd {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(dlq)
        .arg("*")
        .arg("n")
        .arg(n)
        .arg("body")
        .arg(format!("message {n}"))
        .arg("pelican-source-stream")
        .arg(source)
        .arg("pelican-source-id")
        .arg(format!("1-{n}"))
        .arg("pelican-origin-id")
        .arg(format!("1-{n}"))
        .arg("pelican-group")
        .arg("workers")
        .arg("pelican-consumer")
        .arg("worker-1")
        .arg("pelican-deliveries")
        .arg(3)
        .arg("pelican-reason")
        .arg(reason)
        .arg("pelican-dead-lettered-at")
        .arg(1);
    cmd
}

fn redrive(name: &str, policy: &str, extra: &str) -> String {
    format!(
        "apiVersion: pelican.io/v1alpha1\nkind: DeadLetterRedrive\nmetadata:\n  name: {name}\nspec:\n  policyRef:\n    name: {policy}\n{extra}"
    )
}

fn get_redrive(namespace: &str, name: &str) -> Value {
    serde_json::from_str(&kubectl_ok(&["get", "dlr", name, "-n", namespace, "-o", "json"])).unwrap()
}

/// Waits for a phase; returns the object.
fn wait_phase(namespace: &str, name: &str, phase: &str, timeout: Duration) -> Value {
    wait_for(&format!("redrive {name} {phase}"), timeout, || {
        let object = get_redrive(namespace, name);
        match object["status"]["phase"].as_str() {
            Some(p) if p == phase => Ok(object),
            _ => Err(object["status"].to_string()),
        }
    })
}

/// Values of `n` in a stream, with how often each appears, counting only the entries `keep` accepts.
fn ns_in(conn: &mut impl redis::ConnectionLike, stream: &str, keep: impl Fn(&RawEntry) -> bool) -> HashMap<u64, usize> {
    let mut seen = HashMap::new();
    for entry in xrange(conn, stream).iter().filter(|e| keep(e)) {
        let n = String::from_utf8_lossy(field(entry, "n").expect("field n kept")).parse().unwrap();
        *seen.entry(n).or_default() += 1;
    }
    seen
}

/// A batch that fails half way (the second source stream cannot take another entry) records the moves before the
/// failure: when the redrive ends, `moved` counts every entry that moved, none twice.
#[test]
fn moves_before_a_failure_in_the_same_batch_are_recorded() {
    let server = Server::start(Flavor::Redis);
    let (ns, operator) = ready_policy("redrive-half", &policy("mail", &server.url(), "a", "workers", ""), "mail");
    let mut conn = server.conn();
    // Stream b's last id is the largest there is: XADD * into it fails.
    let max_id = "18446744073709551615-18446744073709551615";
    let _: String = redis::cmd("XADD").arg("b").arg(max_id).arg("full").arg(1).query(&mut conn).unwrap();
    dead_letters(&mut conn, "a:dlq", "a", 5, |_| "MaxDeliveriesExceeded");
    dead_letters(&mut conn, "a:dlq", "b", 5, |_| "MaxDeliveriesExceeded");
    assert!(kubectl_apply(&ns, &redrive("back", "mail", "")).0);
    wait_for("the entries for a to move", Duration::from_secs(30), || {
        let moved = ns_in(&mut conn, "a", redriven).len();
        if moved == 5 { Ok(()) } else { Err(format!("{moved} moved")) }
    });
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(xrange(&mut conn, "a:dlq").len(), 5, "the entries for b stay dead letters while b is full");

    let _: i64 = redis::cmd("DEL").arg("b").query(&mut conn).unwrap();
    let done = wait_phase(&ns, "back", "Succeeded", Duration::from_secs(60));
    assert_eq!(ns_in(&mut conn, "a", redriven), (0..5).map(|n| (n, 1)).collect());
    assert_eq!(ns_in(&mut conn, "b", redriven), (0..5).map(|n| (n, 1)).collect());
    assert!(xrange(&mut conn, "a:dlq").is_empty());
    let counted = (&done["status"]["moved"], &done["status"]["missing"], &done["status"]["skipped"]);
    assert_eq!(counted, (&Value::from(10), &Value::from(0), &Value::from(0)), "{}", done["status"]);
    let metrics = operator.metrics();
    assert!(metrics.contains("pelican_redrives_total{result=\"Complete\"} 1"), "{metrics}");
}

/// Defect: with `filter.reasons` matching little, one script call read runs of 256 until it found its budget of
/// matches or the range ended (600,000 non-matching dead letters: 2.3 s in one call, every other client waiting).
/// Each call now stops after a bounded read: no call of the redrive enters the server's slow log.
#[test]
fn a_filter_that_matches_little_never_holds_the_server() {
    let server = Server::start(Flavor::Redis);
    let (ns, _operator) =
        ready_policy("redrive-sparse", &policy("sparse", &server.url(), "sparse", "workers", ""), "sparse");
    let mut conn = server.conn();
    let count = 200_000;
    dead_letters(&mut conn, "sparse:dlq", "sparse", count, |n| {
        if n == count - 1 { "PayloadInvalid" } else { "MaxDeliveriesExceeded" }
    });
    let _: () = redis::cmd("CONFIG").arg("SET").arg("slowlog-log-slower-than").arg(250_000).query(&mut conn).unwrap();
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(&mut conn).unwrap();
    assert!(kubectl_apply(&ns, &redrive("sparse", "sparse", "  filter:\n    reasons: [PayloadInvalid]\n")).0);
    let done = wait_phase(&ns, "sparse", "Succeeded", Duration::from_secs(120));
    assert_eq!(done["status"]["moved"], 1, "{}", done["status"]);
    assert_eq!(ns_in(&mut conn, "sparse", redriven), HashMap::from([(count - 1, 1)]));
    let slow: Vec<redis::Value> = redis::cmd("SLOWLOG").arg("GET").query(&mut conn).unwrap();
    assert!(slow.is_empty(), "calls of 250 ms or more: {slow:?}");
}

/// Defect: a dead letter whose `pelican-source-stream` is not UTF-8 stalled a `Source` redrive for ever (a decode
/// error, retried at the same entry). It ends `Failed`, naming the entry before it and what to do.
#[test]
fn a_source_stream_that_is_not_utf8_ends_the_redrive_naming_the_entry() {
    let server = Server::start(Flavor::Redis);
    let (ns, _operator) =
        ready_policy("redrive-bytes", &policy("bytes", &server.url(), "bytes", "workers", ""), "bytes");
    let mut conn = server.conn();
    dead_letters(&mut conn, "bytes:dlq", "bytes", 2, |_| "MaxDeliveriesExceeded");
    let before = xrange(&mut conn, "bytes:dlq")[1].0.clone();
    let _: String = redis::cmd("XADD")
        .arg("bytes:dlq")
        .arg("*")
        .arg("n")
        .arg(2)
        .arg("pelican-source-stream")
        .arg(&b"\xff\xfeorders"[..])
        .arg("pelican-reason")
        .arg("MaxDeliveriesExceeded")
        .query(&mut conn)
        .unwrap();
    assert!(kubectl_apply(&ns, &redrive("bytes", "bytes", "")).0);
    let failed = wait_phase(&ns, "bytes", "Failed", Duration::from_secs(30));
    let conditions = failed["status"]["conditions"].as_array().unwrap();
    let message = conditions.iter().find(|c| c["type"] == "Failed").unwrap()["message"].as_str().unwrap();
    assert!(message.contains("not UTF-8") && message.contains("spec.target"), "{message}");
    assert!(message.contains(&format!("after {before}")), "{message}");
    assert_eq!(ns_in(&mut conn, "bytes", redriven).len(), 2, "the two entries before it moved");
}

fn redriven(entry: &RawEntry) -> bool {
    field(entry, "pelican-redriven-from").is_some()
}

fn ten_thousand_dead_letters_redriven_through_kill9_each_exactly_once(flavor: Flavor) {
    const COUNT: u64 = 10_000;
    let server = Server::start(flavor);
    let (ns, mut operator) =
        ready_policy("redrive-ledger", &policy("orders", &server.url(), "orders", "workers", ""), "orders");
    let mut conn = server.conn();
    dead_letters(&mut conn, "orders:dlq", "orders", COUNT, |_| "MaxDeliveriesExceeded");

    // 2,500 a second: four seconds of moving, with the operator killed at random instants in between.
    let manifest = redrive("after-fix", "orders", "  ratePerSecond: 2500\n");
    assert!(kubectl_apply(&ns, &manifest).0);
    let mut rng = Lcg(0x5eed_0013 + flavor as u64);
    let mut kills = 0;
    let mut moved_before = -1;
    loop {
        // Each restarted operator resumes (it moves more than the last one did: a start takes the Lease first);
        // it is killed again at a random instant while it moves.
        let phase = wait_for("the redrive moving or done", Duration::from_secs(60), || {
            let status = get_redrive(&ns, "after-fix")["status"].clone();
            let moved = status["moved"].as_i64().unwrap_or(0);
            match status["phase"].as_str() {
                Some("Succeeded") => Ok("Succeeded".to_string()),
                Some("Running") if moved > moved_before => {
                    moved_before = moved;
                    Ok("Running".to_string())
                }
                _ => Err(status.to_string()),
            }
        });
        if phase == "Succeeded" {
            break;
        }
        std::thread::sleep(Duration::from_millis(rng.next_in(50, 900)));
        operator.kill9();
        kills += 1;
        operator = Operator::start(&ns);
        assert!(kills < 30, "the redrive never finished: {}", get_redrive(&ns, "after-fix")["status"]);
    }
    let done = get_redrive(&ns, "after-fix");
    println!("{flavor:?}: {kills} kills during the redrive; status {}", done["status"]);
    assert!(kills >= 2, "the operator must die while moving (killed {kills} times)");

    // The ledger: every message once in the source stream as a redriven entry, or once in the dead-letter
    // stream; never both, never neither.
    let moved = ns_in(&mut conn, "orders", redriven);
    let left = ns_in(&mut conn, "orders:dlq", |_| true);
    for n in 0..COUNT {
        let (m, l) = (moved.get(&n).copied().unwrap_or(0), left.get(&n).copied().unwrap_or(0));
        assert_eq!(m + l, 1, "message {n}: {m} redriven copies, {l} dead letters");
    }
    assert_eq!(moved.len() as u64, COUNT, "everything was in range, so everything moved");
    assert_eq!(done["status"]["moved"], COUNT, "status counts every move exactly once");
    assert_eq!(done["status"]["toMove"], COUNT);
    // Each redriven entry: the application's fields, Pelican's metadata stripped, the two redrive fields.
    let entries = xrange(&mut conn, "orders");
    let sample = entries.iter().find(|e| redriven(e)).unwrap();
    let names: Vec<String> = sample.1.iter().map(|(k, _)| String::from_utf8_lossy(k).into_owned()).collect();
    assert_eq!(names, ["n", "body", "pelican-redriven-from", "pelican-redrive"]);
    assert_eq!(field(sample, "pelican-redrive"), Some(b"after-fix".as_slice()));

    // Terminal: a restart and a change of the finished object's spec (which does reach a reconcile: its new TTL
    // deletes it) move nothing, even with new dead letters waiting; nor does the manifest applied after the object
    // was deleted.
    dead_letters(&mut conn, "orders:dlq", "orders", 5, |_| "MaxDeliveriesExceeded");
    operator.kill9();
    let _operator = Operator::start(&ns);
    let changed = redrive("after-fix", "orders", "  ratePerSecond: 100\n  ttlSecondsAfterFinished: 2\n");
    assert!(kubectl_apply(&ns, &changed).0);
    wait_for("the changed, finished redrive reconciled (deleted by its new TTL)", Duration::from_secs(30), || {
        let out = kubectl(&["get", "dlr", "after-fix", "-n", &ns], None);
        if out.status.success() { Err("still there".to_string()) } else { Ok(()) }
    });
    assert_eq!(xrange(&mut conn, "orders:dlq").len(), 5, "a finished redrive moved entries again");
    assert!(kubectl_apply(&ns, &manifest).0);
    let again = wait_phase(&ns, "after-fix", "Succeeded", Duration::from_secs(30));
    let complete = again["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Complete").unwrap();
    assert_eq!(complete["reason"], "AlreadyFinished", "{again}");
    assert!(complete["message"].as_str().unwrap().contains("create one with a new name"), "{complete}");
    assert_eq!(ns_in(&mut conn, "orders", redriven).len() as u64, COUNT, "nothing moved twice");
    assert_eq!(xrange(&mut conn, "orders:dlq").len(), 5, "the new dead letters wait for a new redrive");
}

/// The whole story of the first field report and after: a poison message dead-lettered by the operator, the consumer fixed, the
/// message redriven and processed, nothing left pending or dead.
fn poison_dead_lettered_fixed_redriven_and_processed(flavor: Flavor) {
    let server = Server::start(flavor);
    let extra = "  retry:\n    maxDeliveries: 2\n";
    let manifest = policy("mail", &server.url(), "mail", "workers", extra)
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n");
    let (ns, _operator) = ready_policy("redrive-loop", &manifest, "mail");
    let mut conn = server.conn();
    for n in 0..10 {
        let _: String = redis::cmd("XADD").arg("mail").arg("*").arg("n").arg(n).query(&mut conn).unwrap();
    }
    // The broken consumer: message 7 makes it fail every time (never acknowledged).
    let mut processed = Vec::new();
    wait_for("message 7 dead-lettered", Duration::from_secs(60), || {
        for id in read_new(&mut conn, "mail", "workers", "worker-1", 100) {
            let entry = xrange(&mut conn, "mail").into_iter().find(|e| e.0 == id).unwrap();
            if field(&entry, "n") != Some(b"7".as_slice()) {
                let _: i64 = redis::cmd("XACK").arg("mail").arg("workers").arg(&id).query(&mut conn).unwrap();
                processed.push(String::from_utf8_lossy(field(&entry, "n").unwrap()).into_owned());
            }
        }
        let dead = xrange(&mut conn, "mail:dlq");
        if dead.len() == 1 { Ok(()) } else { Err(format!("{} dead letters", dead.len())) }
    });
    assert_eq!(processed.len(), 9);
    // The fix is deployed; the dead letter goes back.
    assert!(kubectl_apply(&ns, &redrive("after-fix", "mail", "")).0);
    let done = wait_phase(&ns, "after-fix", "Succeeded", Duration::from_secs(30));
    assert_eq!(done["status"]["moved"], 1);
    // The fixed consumer reads it as a new message with a fresh delivery count, and acknowledges it.
    let ids = read_new(&mut conn, "mail", "workers", "worker-2", 100);
    assert_eq!(ids.len(), 1, "the redriven message is delivered once");
    let entry = xrange(&mut conn, "mail").into_iter().find(|e| e.0 == ids[0]).unwrap();
    assert_eq!(field(&entry, "n"), Some(b"7".as_slice()));
    assert!(field(&entry, "pelican-redriven-from").is_some());
    assert_eq!(pel(&mut conn, "mail", "workers")[0].3, 1, "a fresh delivery count");
    let _: i64 = redis::cmd("XACK").arg("mail").arg("workers").arg(&ids[0]).query(&mut conn).unwrap();
    assert!(pel(&mut conn, "mail", "workers").is_empty());
    assert!(xrange(&mut conn, "mail:dlq").is_empty());
    std::thread::sleep(Duration::from_secs(3));
    assert!(xrange(&mut conn, "mail:dlq").is_empty(), "acknowledged: never dead-lettered again");
    let started = events(&ns, "Started");
    assert!(
        started.iter().any(|e| e["message"].as_str().unwrap_or_default().contains("moving 1 entries")),
        "{started:?}"
    );
    assert!(!events(&ns, "Succeeded").is_empty());
}

fn filters_move_exactly_the_matching_entries(flavor: Flavor) {
    let server = Server::start(flavor);
    let (ns, _operator) =
        ready_policy("redrive-filter", &policy("billing", &server.url(), "billing", "workers", ""), "billing");
    let mut conn = server.conn();
    // Even n: MaxDeliveriesExceeded; odd n: PayloadInvalid.
    dead_letters(&mut conn, "billing:dlq", "billing", 300, |n| {
        if n % 2 == 0 { "MaxDeliveriesExceeded" } else { "PayloadInvalid" }
    });
    let ids: Vec<String> = xrange(&mut conn, "billing:dlq").into_iter().map(|e| e.0).collect();

    // A dry run counts and moves nothing.
    let filter = format!(
        "  filter:\n    reasons: [MaxDeliveriesExceeded]\n    from: \"{}\"\n    to: \"{}\"\n",
        ids[50], ids[249]
    );
    assert!(kubectl_apply(&ns, &redrive("count", "billing", &format!("{filter}  dryRun: true\n"))).0);
    let counted = wait_phase(&ns, "count", "Succeeded", Duration::from_secs(30));
    assert_eq!(counted["status"]["toMove"], 100, "even n in 50..=249");
    assert_eq!(counted["status"]["moved"], 0);
    assert_eq!(xrange(&mut conn, "billing:dlq").len(), 300);

    // The real one, capped at 70.
    assert!(kubectl_apply(&ns, &redrive("some", "billing", &format!("{filter}  maxMessages: 70\n"))).0);
    let done = wait_phase(&ns, "some", "Succeeded", Duration::from_secs(30));
    assert_eq!(done["status"]["toMove"], 70);
    assert_eq!(done["status"]["moved"], 70);
    let moved = ns_in(&mut conn, "billing", redriven);
    let expected: Vec<u64> = (50..=249).filter(|n| n % 2 == 0).take(70).collect();
    let mut got: Vec<u64> = moved.keys().copied().collect();
    got.sort();
    assert_eq!(got, expected, "exactly the first 70 matching entries of the range");
    assert!(moved.values().all(|c| *c == 1));
    // Left in place: everything else, and the odd ones the filter skipped on the way are counted.
    assert_eq!(xrange(&mut conn, "billing:dlq").len(), 230);
    assert_eq!(done["status"]["skipped"], 69, "odd n between 50 and the 70th even one (188)");

    // A target that is the dead-letter stream itself fails, with a reason and nothing moved.
    assert!(kubectl_apply(&ns, &redrive("loop", "billing", "  target: \"billing:dlq\"\n")).0);
    let failed = wait_phase(&ns, "loop", "Failed", Duration::from_secs(30));
    let reason = failed["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Failed").unwrap();
    assert_eq!(reason["reason"], "InvalidSpec", "{failed}");
    assert_eq!(xrange(&mut conn, "billing:dlq").len(), 230);
}

/// The rate limit holds within 10%, measured from the ids the server gave the redriven entries.
#[test]
fn the_rate_limit_holds_within_ten_percent() {
    let server = Server::start(Flavor::Redis);
    let (ns, _operator) = ready_policy("redrive-rate", &policy("rate", &server.url(), "rate", "workers", ""), "rate");
    let mut conn = server.conn();
    dead_letters(&mut conn, "rate:dlq", "rate", 1500, |_| "MaxDeliveriesExceeded");
    let start = Instant::now();
    assert!(kubectl_apply(&ns, &redrive("slow", "rate", "  ratePerSecond: 500\n")).0);
    wait_phase(&ns, "slow", "Succeeded", Duration::from_secs(30));
    let millis: Vec<u64> = xrange(&mut conn, "rate")
        .iter()
        .filter(|e| redriven(e))
        .map(|e| e.0.split('-').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(millis.len(), 1500);
    let span = (millis[millis.len() - 1] - millis[0]) as f64 / 1000.0;
    let rate = (millis.len() - 1) as f64 / span;
    println!("1500 entries at ratePerSecond 500: {rate:.0}/s over {span:.2} s (whole run {:?})", start.elapsed());
    assert!((450.0..=550.0).contains(&rate), "rate {rate:.0}/s is not within 10% of 500/s");
}

/// One redrive per dead-letter stream: a second waits, says for whom, and starts when the first is done, with its
/// own snapshot. Suspend pauses and resumes where it was.
#[test]
fn one_redrive_at_a_time_per_dead_letter_stream_and_suspend_resumes() {
    let server = Server::start(Flavor::Valkey);
    let (ns, _operator) = ready_policy("redrive-queue", &policy("jobs", &server.url(), "jobs", "workers", ""), "jobs");
    let mut conn = server.conn();
    dead_letters(&mut conn, "jobs:dlq", "jobs", 600, |_| "MaxDeliveriesExceeded");
    assert!(kubectl_apply(&ns, &redrive("first", "jobs", "  ratePerSecond: 200\n")).0);
    wait_phase(&ns, "first", "Running", Duration::from_secs(30));
    assert!(kubectl_apply(&ns, &redrive("second", "jobs", "")).0);
    let waiting = wait_for("the second redrive to wait", Duration::from_secs(30), || {
        let object = get_redrive(&ns, "second");
        let conditions = object["status"]["conditions"].as_array().cloned().unwrap_or_default();
        match conditions.iter().find(|c| c["type"] == "Reconciling" && c["reason"] == "Waiting") {
            Some(c) => Ok(c["message"].as_str().unwrap().to_string()),
            None => Err(object["status"].to_string()),
        }
    });
    assert!(waiting.contains(&format!("{ns}/first")), "{waiting}");
    assert_eq!(get_redrive(&ns, "second")["status"]["phase"], "Pending");

    // Suspend the first mid-way: it stops moving, then resumes where it was.
    kubectl_ok(&["patch", "dlr", "first", "-n", &ns, "--type", "merge", "-p", r#"{"spec":{"suspend":true}}"#]);
    let suspended = wait_phase(&ns, "first", "Suspended", Duration::from_secs(30));
    let at = xrange(&mut conn, "jobs:dlq").len();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(xrange(&mut conn, "jobs:dlq").len(), at, "nothing moves while suspended");
    assert!(at > 0 && at < 600, "suspended mid-way: {at} left; {}", suspended["status"]);
    kubectl_ok(&["patch", "dlr", "first", "-n", &ns, "--type", "merge", "-p", r#"{"spec":{"suspend":false}}"#]);
    let first = wait_phase(&ns, "first", "Succeeded", Duration::from_secs(30));
    assert_eq!(first["status"]["moved"], 600);
    // The second one ran after it, on what was left then: nothing.
    let second = wait_phase(&ns, "second", "Succeeded", Duration::from_secs(30));
    assert_eq!(second["status"]["toMove"], 0, "{second}");
    assert_eq!(ns_in(&mut conn, "jobs", redriven).len(), 600);
    let out = kubectl_ok(&["get", "dlr", "-n", &ns]);
    println!("{out}");
    let rows = table_rows(&out);
    let first_row = rows.iter().find(|r| r["NAME"] == "first").unwrap();
    assert_eq!((first_row["POLICY"].as_str(), first_row["PHASE"].as_str()), ("jobs", "Succeeded"));
    assert_eq!((first_row["MOVED"].as_str(), first_row["TO-MOVE"].as_str()), ("600", "600"));
}

/// `ttlSecondsAfterFinished` deletes the object; the record on the server keeps the same manifest from running
/// again when it is applied anew (a GitOps tool would re-create it).
#[test]
fn ttl_deletes_the_object_and_the_manifest_applied_again_does_not_run() {
    let server = Server::start(Flavor::Redis);
    let (ns, _operator) = ready_policy("redrive-ttl", &policy("ttl", &server.url(), "ttl", "workers", ""), "ttl");
    let mut conn = server.conn();
    dead_letters(&mut conn, "ttl:dlq", "ttl", 10, |_| "MaxDeliveriesExceeded");
    let manifest = redrive("once", "ttl", "  ttlSecondsAfterFinished: 2\n");
    assert!(kubectl_apply(&ns, &manifest).0);
    wait_phase(&ns, "once", "Succeeded", Duration::from_secs(30));
    wait_for("the TTL to delete the redrive", Duration::from_secs(30), || {
        let out = kubectl(&["get", "dlr", "once", "-n", &ns], None);
        if out.status.success() { Err("still there".into()) } else { Ok(()) }
    });
    dead_letters(&mut conn, "ttl:dlq", "ttl", 10, |_| "MaxDeliveriesExceeded");
    assert!(kubectl_apply(&ns, &manifest).0);
    let again = wait_phase(&ns, "once", "Succeeded", Duration::from_secs(30));
    assert_eq!(again["status"]["moved"], 10, "the first run's count, from the record");
    assert_eq!(xrange(&mut conn, "ttl:dlq").len(), 10, "the second application moved nothing");
    assert!(!events(&ns, "Succeeded").is_empty());
}

/// One redrive per dead-letter stream also across an operator killed with SIGKILL: the restarted operator sees the
/// running redrive and five waiting ones at once, in no particular order, and only the running one moves entries;
/// the others start after it, one at a time, and find nothing left.
#[test]
fn one_redrive_at_a_time_across_an_operator_restart() {
    let server = Server::start(Flavor::Redis);
    let ns = namespace("redrive-restart");
    // Named so that the restarted operator lists (and reconciles) the waiting ones before the running one.
    let mut operator = Operator::start(&ns);
    assert!(kubectl_apply(&ns, &policy("jobs", &server.url(), "jobs", "workers", "")).0);
    wait_condition(&ns, "jobs", "Ready", "True", "Reconciled");
    let mut conn = server.conn();
    dead_letters(&mut conn, "jobs:dlq", "jobs", 300, |_| "MaxDeliveriesExceeded");
    assert!(kubectl_apply(&ns, &redrive("z-first", "jobs", "  ratePerSecond: 30\n")).0);
    wait_phase(&ns, "z-first", "Running", Duration::from_secs(30));
    let waiting: Vec<String> = (1..=5).map(|i| format!("next-{i}")).collect();
    for name in &waiting {
        assert!(kubectl_apply(&ns, &redrive(name, "jobs", "")).0);
    }
    for name in &waiting {
        wait_for(&format!("{name} Waiting"), Duration::from_secs(30), || {
            let object = get_redrive(&ns, name);
            let conditions = object["status"]["conditions"].as_array().cloned().unwrap_or_default();
            let waits = conditions.iter().any(|c| c["type"] == "Reconciling" && c["reason"] == "Waiting");
            if waits { Ok(()) } else { Err(object["status"].to_string()) }
        });
    }
    operator.kill9();
    drop(operator);
    let _operator = Operator::start(&ns);
    wait_phase(&ns, "z-first", "Succeeded", Duration::from_secs(60));
    for name in &waiting {
        let done = wait_phase(&ns, name, "Succeeded", Duration::from_secs(60));
        assert_eq!(done["status"]["moved"], 0, "{name} ran beside the first redrive: {}", done["status"]);
    }
    assert_eq!(get_redrive(&ns, "z-first")["status"]["moved"], 300);
    assert_eq!(ns_in(&mut conn, "jobs", redriven), (0..300).map(|n| (n, 1)).collect());
}

/// Defect: `kubectl delete dlr x && kubectl apply -f x.yaml` (here `kubectl replace --force`) while it ran left the old task writing status by name
/// onto the new object; the two deleted each other's progress record, `moved` undercounted and `missing`
/// overcounted. The old task stops when its object goes (its status writes carry the uid, and the script checks the
/// stream's lock), and the new object accounts exactly for what it moved.
#[test]
fn a_redrive_deleted_and_created_again_while_running_is_counted_once() {
    let server = Server::start(Flavor::Redis);
    let (ns, _operator) =
        ready_policy("redrive-again", &policy("again", &server.url(), "again", "workers", ""), "again");
    let mut conn = server.conn();
    dead_letters(&mut conn, "again:dlq", "again", 120, |_| "MaxDeliveriesExceeded");
    let manifest = redrive("again", "again", "  ratePerSecond: 4\n");
    assert!(kubectl_apply(&ns, &manifest).0);
    wait_for("the first object to move a few", Duration::from_secs(30), || {
        let moved = get_redrive(&ns, "again")["status"]["moved"].as_i64().unwrap_or(0);
        if moved >= 3 { Ok(()) } else { Err(format!("moved {moved}")) }
    });
    // Deleted and created again in one go, as `kubectl replace --force` does.
    let out = kubectl(&["replace", "--force", "-n", &ns, "-f", "-"], Some(&manifest));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The new object never shows what the old task did: a retry on a record it no longer owns, or a wait for a
    // redrive of its own name.
    let done = wait_for("the new object to succeed", Duration::from_secs(90), || {
        let object = get_redrive(&ns, "again");
        let text = object["status"].to_string();
        assert!(!text.contains("OWNED") && !text.contains("Waiting"), "the old task wrote onto the new object: {text}");
        if object["status"]["phase"] == "Succeeded" { Ok(object) } else { Err(text) }
    });
    let status = &done["status"];
    assert_eq!(status["missing"], 0, "{status}");
    assert_eq!(status["moved"], status["toMove"], "{status}");
    let moved_now = ns_in(&mut conn, "again", redriven);
    assert_eq!(moved_now, (0..120).map(|n| (n, 1)).collect(), "every dead letter moved once");
    assert!(xrange(&mut conn, "again:dlq").is_empty());
}

/// Defect (issue 48.8): a running redrive deleted left its lock on the stream, and every seek of that stream was
/// refused `SeekInProgress`, naming the deleted redrive, until another redrive ran to completion. The task releases
/// the lock when it finds its object gone, and a seek takes over a lock whose redrive no longer exists.
#[test]
fn a_deleted_redrive_leaves_no_lock_that_refuses_a_seek() {
    let server = Server::start(Flavor::Redis);
    let (ns, operator) = ready_policy("redrive-gone", &policy("gone", &server.url(), "gone", "workers", ""), "gone");
    let mut conn = server.conn();
    dead_letters(&mut conn, "gone:dlq", "gone", 100, |_| "MaxDeliveriesExceeded");
    let seek = |name: &str| {
        format!(
            "apiVersion: pelican.io/v1alpha1\nkind: GroupSeek\nmetadata:\n  name: {name}\nspec:\n  policyRef: {{name: \
             gone}}\n  to: {{position: Latest}}\n  consumersIdleFor: 0s\n  dryRun: true\n"
        )
    };
    let seek_phase = |name: &str| {
        assert!(kubectl_apply(&ns, &seek(name)).0);
        wait_for(&format!("seek {name} finished"), Duration::from_secs(30), || {
            let status: Value =
                serde_json::from_str(&kubectl_ok(&["get", "seek", name, "-n", &ns, "-o", "jsonpath={.status}"]))
                    .unwrap_or_default();
            match status["phase"].as_str() {
                Some("Succeeded" | "Failed") => Ok(status),
                other => Err(format!("{other:?}")),
            }
        })
    };
    let lock = "{gone:dlq}:pelican:gone:dlq:redrive-lock";

    // Deleted while it runs: the task lets go of the stream.
    assert!(kubectl_apply(&ns, &redrive("slow", "gone", "  ratePerSecond: 2\n")).0);
    wait_for("the redrive to move one", Duration::from_secs(30), || {
        let moved = get_redrive(&ns, "slow")["status"]["moved"].as_i64().unwrap_or(0);
        if moved >= 1 { Ok(()) } else { Err(format!("moved {moved}")) }
    });
    kubectl_ok(&["delete", "dlr", "slow", "-n", &ns]);
    let status = seek_phase("after-delete");
    assert_eq!(status["phase"], "Succeeded", "{status}");

    // Deleted while no operator runs (its task cannot let go): the seek takes over the lock of a redrive gone.
    assert!(kubectl_apply(&ns, &redrive("slower", "gone", "  ratePerSecond: 2\n")).0);
    wait_for("the second redrive to hold the stream", Duration::from_secs(30), || {
        let holder: Option<String> = redis::cmd("HGET").arg(lock).arg("name").query(&mut conn).unwrap();
        holder.filter(|h| h.ends_with("/slower")).ok_or_else(|| "no lock".to_string())
    });
    let mut operator = operator;
    operator.kill9();
    kubectl_ok(&["delete", "dlr", "slower", "-n", &ns]);
    let _operator = Operator::start(&ns);
    let status = seek_phase("after-restart");
    assert_eq!(status["phase"], "Succeeded", "{status}");
    let holder: Option<String> = redis::cmd("HGET").arg(lock).arg("name").query(&mut conn).unwrap();
    assert_eq!(holder, None, "the lock of the deleted redrive is gone");
}

/// On one server a topic has one dead-letter stream: each dead letter goes back to the partition it came from
/// (`pelican-source-stream`). On a Cluster each partition has its own, in its slot: a redrive counts every
/// partition's range, then moves one partition after the other, `maxMessages` carried across them.
#[test]
fn a_topics_dead_letters_go_back_to_their_partitions_on_one_server_and_on_a_cluster() {
    let server = Server::start(Flavor::Redis);
    let manifest = policy("t", &server.url(), "t", "workers", "  partitions: 2\n");
    let (ns, _operator) = ready_policy("redrive-topic", &manifest, "t");
    let mut conn = server.conn();
    dead_letters(&mut conn, "t:dlq", "{t:0}", 3, |_| "MaxDeliveriesExceeded");
    dead_letters(&mut conn, "t:dlq", "{t:1}", 2, |_| "MaxDeliveriesExceeded");
    let (ok, out) = kubectl_apply(&ns, &redrive("back", "t", ""));
    assert!(ok, "{out}");
    wait_phase(&ns, "back", "Succeeded", Duration::from_secs(30));
    assert_eq!(ns_in(&mut conn, "{t:0}", redriven).len(), 3, "partition 0's letters back in partition 0");
    assert_eq!(ns_in(&mut conn, "{t:1}", redriven).len(), 2);
    let exists: bool = redis::cmd("EXISTS").arg("t").query(&mut conn).unwrap();
    assert!(!exists, "nothing written to a stream named after the topic");

    let cluster = Cluster::start(Flavor::Redis);
    let manifest = policy("c", &cluster.url(), "c", "workers", "  partitions: 3\n").replacen(
        "  stream:",
        "    mode: Cluster\n  stream:",
        1,
    );
    let (applied, out) = kubectl_apply(&ns, &manifest);
    assert!(applied, "{out}");
    wait_condition(&ns, "c", "Ready", "True", "Reconciled");
    let mut conn = cluster.conn();
    let partition = |i: u32| pelican::keys::partition_stream("c", i);
    let letters = |i: u32| format!("{}:c:dlq", partition(i));
    for i in 0..3 {
        dead_letters_on_a_cluster(&mut conn, &letters(i), &partition(i), u64::from(i) + 1);
    }
    let (ok, out) = kubectl_apply(&ns, &redrive("count", "c", "  dryRun: true\n"));
    assert!(ok, "{out}");
    let planned = wait_phase(&ns, "count", "Succeeded", Duration::from_secs(30));
    assert_eq!(planned["status"]["toMove"], 6, "{}", planned["status"]);

    let (ok, out) = kubectl_apply(&ns, &redrive("some", "c", "  maxMessages: 4\n"));
    assert!(ok, "{out}");
    let some = wait_phase(&ns, "some", "Succeeded", Duration::from_secs(30));
    println!("a topic's redrive on a Cluster: {}", some["status"]);
    assert_eq!((some["status"]["toMove"].as_i64(), some["status"]["moved"].as_i64()), (Some(4), Some(4)));
    let back: Vec<usize> = (0..3).map(|i| ns_in(&mut conn, &partition(i), redriven).len()).collect();
    assert_eq!(back, [1, 2, 1], "each back in its own partition, partition by partition, 4 in all");
    let left: Vec<usize> = (0..3).map(|i| xrange(&mut conn, &letters(i)).len()).collect();
    assert_eq!(left, [0, 0, 2]);

    let (ok, out) = kubectl_apply(&ns, &redrive("rest", "c", ""));
    assert!(ok, "{out}");
    let rest = wait_phase(&ns, "rest", "Succeeded", Duration::from_secs(30));
    assert_eq!(rest["status"]["moved"], 2, "{}", rest["status"]);
    assert_eq!(ns_in(&mut conn, &partition(2), redriven).len(), 3);
}

/// A topic's redrive on a Cluster through kill -9s of the operator (SPEC 22): each restarted operator resumes the
/// partition it was in, from the ranges the records hold; every dead letter ends in its partition once, or stays.
#[test]
fn a_topics_redrive_on_a_cluster_resumes_through_kill9_each_letter_once() {
    const EACH: u64 = 800;
    let cluster = Cluster::start(Flavor::Redis);
    let manifest = policy("c", &cluster.url(), "c", "workers", "  partitions: 3\n").replacen(
        "  stream:",
        "    mode: Cluster\n  stream:",
        1,
    );
    let (ns, mut operator) = ready_policy("redrive-topic-kill", &manifest, "c");
    let mut conn = cluster.conn();
    let partition = |i: u32| pelican::keys::partition_stream("c", i);
    let letters = |i: u32| format!("{}:c:dlq", partition(i));
    for i in 0..3 {
        dead_letters_on_a_cluster(&mut conn, &letters(i), &partition(i), EACH);
    }
    // 300 a second: eight seconds of moving, the operator killed at random instants in between.
    assert!(kubectl_apply(&ns, &redrive("back", "c", "  ratePerSecond: 300\n")).0);
    let mut rng = Lcg(0x5eed_0022);
    let (mut kills, mut moved_before) = (0, -1);
    loop {
        let phase = wait_for("the redrive moving or done", Duration::from_secs(60), || {
            let status = get_redrive(&ns, "back")["status"].clone();
            let moved = status["moved"].as_i64().unwrap_or(0);
            match status["phase"].as_str() {
                Some("Succeeded") => Ok("Succeeded".to_string()),
                Some("Running") if moved > moved_before => {
                    moved_before = moved;
                    Ok("Running".to_string())
                }
                _ => Err(status.to_string()),
            }
        });
        if phase == "Succeeded" {
            break;
        }
        std::thread::sleep(Duration::from_millis(rng.next_in(50, 900)));
        operator.kill9();
        kills += 1;
        operator = Operator::start(&ns);
        assert!(kills < 30, "the redrive never finished: {}", get_redrive(&ns, "back")["status"]);
    }
    let done = get_redrive(&ns, "back");
    println!("a topic's redrive on a Cluster: {kills} kills; status {}", done["status"]);
    assert!(kills >= 2, "the operator must die while moving (killed {kills} times)");
    assert_eq!((done["status"]["toMove"].as_i64(), done["status"]["moved"].as_i64()), (Some(2400), Some(2400)));
    for i in 0..3 {
        let back = ns_in(&mut conn, &partition(i), redriven);
        assert_eq!(back.len() as u64, EACH, "partition {i}: every letter back");
        assert!(back.values().all(|&times| times == 1), "partition {i}: a letter moved twice");
        assert!(xrange(&mut conn, &letters(i)).is_empty(), "partition {i}: letters left");
    }
}
