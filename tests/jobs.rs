//! The reclaim and dead-letter jobs through the operator: `kubectl apply`, a real API server, real Redis 7.0 and
//! Valkey 9.1, consumers that fail, and an operator that is killed with SIGKILL.

#[macro_use]
mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use common::*;

on_both_servers!(
    seed_001_failed_messages_are_redelivered_then_dead_lettered_once,
    seed_000_deleted_payloads_leave_the_pel_as_payload_deleted,
    suspend_stops_the_jobs_but_not_the_status,
    operator_killed_again_and_again_loses_and_duplicates_nothing,
    two_operators_at_once_lose_and_duplicate_nothing,
    server_restarted_mid_pass_loses_and_duplicates_nothing,
    operator_killed_during_passes_with_backoff_loses_and_duplicates_nothing,
);

#[test]
fn a_policy_deleted_while_its_reconcile_is_in_flight_runs_no_job_afterwards() {
    let server = Server::start(Flavor::Redis);
    let (ns, operator) = ready_policy("deleted-in-flight", &jobs_policy("q", &server, "q", ""), "q");
    assert!(operator.metrics().contains(&format!("namespace=\"{ns}\",policy=\"q\"")), "{}", operator.metrics());

    // The server stops answering; a change of spec starts a reconcile that waits on it; the policy (without a
    // finalizer) is deleted meanwhile; then the server answers again and that reconcile finishes.
    let mut conn = server.conn();
    let _: () = redis::cmd("CLIENT").arg("PAUSE").arg(4000).arg("ALL").query(&mut conn).unwrap();
    patch_policy(&ns, "q", "merge", r#"{"spec":{"reclaim":{"interval":"2s"}}}"#);
    thread::sleep(Duration::from_millis(500));
    kubectl_ok(&["delete", "cgp", "q", "-n", &ns, "--wait=false"]);
    thread::sleep(Duration::from_secs(6));

    // A message read and left unacknowledged well past minIdle: no job may touch it any more.
    produce(&mut conn, "q", 1);
    poll(&mut conn, "q", "worker").unwrap();
    thread::sleep(Duration::from_secs(5));
    let pending = pel(&mut conn, "q", "workers");
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!(pending[0].3, 1, "the entry of a deleted policy was requeued: {pending:?}");
    let length: u64 = redis::cmd("XLEN").arg("q").query(&mut conn).unwrap();
    assert_eq!(length, 1, "a deleted policy's job added a copy to the stream");
    let metrics = operator.metrics();
    assert!(!metrics.contains(&format!("namespace=\"{ns}\",policy=\"q\"")), "series of a deleted policy:\n{metrics}");
}

/// Defect: reason codes are data any client writes (the terminal-ACK contract is plain `HINCRBY`); with tens of
/// thousands of them every status write failed ("request is too large") and Ready and the numbers froze. Status and
/// metrics list the 20 largest and `Other`, and the status keeps following the stream.
#[test]
fn thousands_of_terminal_reasons_show_as_twenty_and_other() {
    let server = Server::start(Flavor::Redis);
    let (ns, operator) = ready_policy("reasons", &jobs_policy("r", &server, "r", ""), "r");
    let mut conn = server.conn();
    let mut hset = redis::cmd("HSET");
    hset.arg(pelican::keys::terminal_key("r", "workers"));
    for i in 0..50_000 {
        hset.arg(format!("UpstreamRefusedTheRecordBecause{i:06}")).arg(1);
    }
    let _: i64 = hset.arg("RecordNotFound").arg(40).query(&mut conn).unwrap();
    produce(&mut conn, "r", 7);
    let policy = wait_for("the status to show the 7 entries", Duration::from_secs(30), || {
        let p = get_policy(&ns, "r");
        if p["status"]["streamLength"] == 7 { Ok(p) } else { Err(p["status"]["streamLength"].to_string()) }
    });
    let acks = policy["status"]["terminalAcks"].as_array().unwrap();
    assert_eq!(acks.len(), 21, "{acks:?}");
    assert!(acks.contains(&serde_json::json!({"reason": "RecordNotFound", "count": 40})), "{acks:?}");
    assert!(acks.contains(&serde_json::json!({"reason": "Other", "count": 50_000 - 19})), "{acks:?}");
    let metrics = operator.metrics();
    let series = metrics.lines().filter(|l| l.starts_with("pelican_terminal_acks_total{")).count();
    assert_eq!(series, 21, "{metrics}");
}

fn jobs_policy(name: &str, server: &Server, stream: &str, extra: &str) -> String {
    policy(name, &server.url(), stream, "workers", extra)
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n    maxPerPass: 100000\n")
}

fn produce(conn: &mut redis::Connection, stream: &str, count: u64) {
    for start in (0..count).step_by(1000) {
        let mut pipe = redis::pipe();
        for n in start..(start + 1000).min(count) {
            pipe.cmd("XADD").arg(stream).arg("*").arg("n").arg(n).arg("body").arg(format!("message {n}")).ignore();
        }
        let _: () = pipe.query(conn).unwrap();
    }
}

/// One consumer poll: XREADGROUP `>`, returning (id, n).
fn poll(conn: &mut redis::Connection, stream: &str, consumer: &str) -> redis::RedisResult<Vec<(String, Option<u64>)>> {
    type Reply = Option<Vec<(String, Vec<(String, Vec<Vec<u8>>)>)>>;
    let reply: Reply = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("workers")
        .arg(consumer)
        .arg("COUNT")
        .arg(5000)
        .arg("BLOCK")
        .arg(100)
        .arg("STREAMS")
        .arg(stream)
        .arg(">")
        .query(conn)?;
    Ok(reply.into_iter().flatten().flat_map(|(_, entries)| entries_n(entries)).collect())
}

/// Values of field `n` in the dead-letter stream, with how often each appears.
fn dead_lettered(conn: &mut redis::Connection, dlq: &str) -> HashMap<u64, usize> {
    let raw: Vec<(String, Vec<Vec<u8>>)> = redis::cmd("XRANGE").arg(dlq).arg("-").arg("+").query(conn).unwrap();
    let mut seen = HashMap::new();
    for (_, n) in entries_n(raw) {
        *seen.entry(n.expect("every dead-lettered entry keeps its fields")).or_default() += 1;
    }
    seen
}

fn seed_001_failed_messages_are_redelivered_then_dead_lettered_once(flavor: Flavor) {
    let server = Server::start(flavor);
    let (ns, operator) = ready_policy("seed001", &jobs_policy("mail", &server, "mail", ""), "mail");
    let mut conn = server.conn();
    produce(&mut conn, "mail", 30);

    // The consumer of the first field report: every third message fails (never ACKed), the rest succeed.
    let mut deliveries: HashMap<u64, u32> = HashMap::new();
    wait_for("the PEL to drain into the dead-letter stream", Duration::from_secs(60), || {
        for (id, n) in poll(&mut conn, "mail", "worker-1").unwrap() {
            let n = n.unwrap();
            *deliveries.entry(n).or_default() += 1;
            if n % 3 != 0 {
                let _: i64 = redis::cmd("XACK").arg("mail").arg("workers").arg(&id).query(&mut conn).unwrap();
            }
        }
        let pending = pel(&mut conn, "mail", "workers").len();
        let dead = dead_lettered(&mut conn, "mail:dlq").len();
        if pending == 0 && dead == 10 { Ok(()) } else { Err(format!("pending {pending}, dead-lettered {dead}")) }
    });
    for n in (0..30).filter(|n| n % 3 == 0) {
        assert_eq!(deliveries[&n], 3, "message {n} is delivered exactly maxDeliveries times");
    }
    let dead = dead_lettered(&mut conn, "mail:dlq");
    assert_eq!(dead, (0..30).filter(|n| n % 3 == 0).map(|n| (n, 1)).collect::<HashMap<_, _>>());
    let raw = xrange(&mut conn, "mail:dlq");
    for entry in &raw {
        assert_eq!(&entry.1[0].0, b"n");
        assert_eq!(&entry.1[1].0, b"body");
        assert_eq!(field(entry, "pelican-reason"), Some(&b"MaxDeliveriesExceeded"[..]));
        assert_eq!(field(entry, "pelican-deliveries"), Some(&b"3"[..]));
        assert_eq!(field(entry, "pelican-group"), Some(&b"workers"[..]));
        assert_eq!(field(entry, "pelican-source-stream"), Some(&b"mail"[..]));
        assert_eq!(field(entry, "pelican-consumer"), Some(&b"worker-1"[..]));
    }

    let policy = wait_for("status to mirror the counters", Duration::from_secs(10), || {
        let p = get_policy(&ns, "mail");
        if p["status"]["totals"]["deadLettered"] == 10 && p["status"]["pending"] == 0 {
            Ok(p)
        } else {
            Err(p["status"].to_string())
        }
    });
    assert_eq!(policy["status"]["totals"]["requeued"], 20);
    assert_eq!(policy["status"]["deadLetterLength"], 10);
    assert_eq!(policy["status"]["terminalAcks"], serde_json::json!([{"reason": "MaxDeliveriesExceeded", "count": 10}]));
    assert!(policy["status"]["lastPassTime"].is_string());
    let table = kubectl_ok(&["get", "cgp", "mail", "-n", &ns]);
    let row = &table_rows(&table)[0];
    assert_eq!((row["PENDING"].as_str(), row["DEAD-LETTERED"].as_str()), ("0", "10"), "{table}");
    assert_eq!(row["OLDEST"], "", "no pending entry, no age:\n{table}");

    // Prometheus shows the same numbers.
    let metrics = operator.metrics();
    let labels = format!(r#"namespace="{ns}",policy="mail",stream="mail",group="workers""#);
    for line in [
        format!("pelican_dead_lettered_total{{{labels}}} 10"),
        format!("pelican_requeued_total{{{labels}}} 20"),
        format!("pelican_group_pending{{{labels}}} 0"),
        format!(r#"pelican_terminal_acks_total{{{labels},reason="MaxDeliveriesExceeded"}} 10"#),
    ] {
        assert!(metrics.lines().any(|l| l == line), "missing {line:?} in\n{metrics}");
    }

    // Events are per pass, never per message.
    let events = events(&ns, "DeadLettered");
    assert!(!events.is_empty() && events.len() < 10, "{} DeadLettered events", events.len());
    assert!(events[0]["note"].as_str().or(events[0]["message"].as_str()).unwrap().contains("dead-lettered"));
}

fn seed_000_deleted_payloads_leave_the_pel_as_payload_deleted(flavor: Flavor) {
    let server = Server::start(flavor);
    let ns = namespace("seed000");
    let _operator = Operator::start(&ns);
    let mut conn = server.conn();
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg("files")
        .arg("workers")
        .arg("0")
        .arg("MKSTREAM")
        .query(&mut conn)
        .unwrap();
    produce(&mut conn, "files", 5_000);
    assert_eq!(poll(&mut conn, "files", "crashed").unwrap().len(), 5_000);
    // One entry deleted by hand, then the stream trimmed to its newest 1,000 while all 5,000 are pending.
    let first: String = pel(&mut conn, "files", "workers")[0].0.clone();
    let _: i64 = redis::cmd("XDEL").arg("files").arg(&first).query(&mut conn).unwrap();
    let _: i64 = redis::cmd("XTRIM").arg("files").arg("MAXLEN").arg(1_000).query(&mut conn).unwrap();

    let dead_letter_only = jobs_policy("files", &server, "files", "")
        .replace("    maxPerPass: 100000\n", "    maxPerPass: 100000\n    strategy: DeadLetterOnly\n");
    assert!(kubectl_apply(&ns, &dead_letter_only).0);
    let policy = wait_for("4,000 stale references to be dropped", Duration::from_secs(30), || {
        let p = get_policy(&ns, "files");
        if p["status"]["totals"]["payloadDeleted"] == 4_000 { Ok(p) } else { Err(p["status"].to_string()) }
    });
    assert_eq!(policy["status"]["pending"], 1_000, "entries with a payload stay pending under DeadLetterOnly");
    assert_eq!(policy["status"]["deadLetterLength"], 0, "a stale reference is never dead-lettered");
    assert_eq!(policy["status"]["terminalAcks"], serde_json::json!([{"reason": "PayloadDeleted", "count": 4000}]));
}

fn suspend_stops_the_jobs_but_not_the_status(flavor: Flavor) {
    let server = Server::start(flavor);
    let ns = namespace("suspend");
    let _operator = Operator::start(&ns);
    let mut conn = server.conn();
    let _: () =
        redis::cmd("XGROUP").arg("CREATE").arg("q").arg("workers").arg("0").arg("MKSTREAM").query(&mut conn).unwrap();
    produce(&mut conn, "q", 10);
    poll(&mut conn, "q", "gone").unwrap();
    assert!(kubectl_apply(&ns, &jobs_policy("q", &server, "q", "  suspend: true\n")).0);
    wait_condition(&ns, "q", "Ready", "True", "Reconciled");
    produce(&mut conn, "q", 5);
    wait_for("status to keep refreshing", Duration::from_secs(10), || {
        let p = get_policy(&ns, "q");
        if p["status"]["streamLength"] == 15 { Ok(()) } else { Err(p["status"].to_string()) }
    });
    thread::sleep(Duration::from_secs(3));
    assert_eq!(pel(&mut conn, "q", "workers").len(), 10, "a suspended policy moves nothing");
    assert!(get_policy(&ns, "q")["status"]["lastPassTime"].is_null());

    kubectl_ok(&["patch", "cgp", "q", "-n", &ns, "--type=merge", "-p", r#"{"spec":{"suspend":false}}"#]);
    wait_for("the jobs to resume", Duration::from_secs(20), || {
        let requeued = get_policy(&ns, "q")["status"]["totals"]["requeued"].clone();
        if requeued == 10 { Ok(()) } else { Err(requeued.to_string()) }
    });
}

/// The crash-safety scenario: `total` messages, a consumer that acknowledges every tenth message and fails the
/// rest, an operator dead-lettering and requeueing them while `chaos` runs. Afterwards every message must be
/// exactly one of: acknowledged by the consumer, or in the dead-letter stream once.
fn account_under_chaos(
    flavor: Flavor,
    total: u64,
    operators: usize,
    server_args: &[&str],
    chaos: impl FnOnce(&mut ChaosBed),
) {
    account_under_chaos_with(flavor, total, operators, server_args, "", chaos)
}

/// The same, with `extra` YAML under the policy's `spec:`.
fn account_under_chaos_with(
    flavor: Flavor,
    total: u64,
    operators: usize,
    server_args: &[&str],
    extra: &str,
    chaos: impl FnOnce(&mut ChaosBed),
) {
    let server = Server::start_with(flavor, server_args);
    let ns = namespace("chaos");
    let mut bed =
        ChaosBed { operators: (0..operators).map(|i| chaos_operator(&ns, i)).collect(), server, namespace: ns.clone() };
    let ack_some = server_args.is_empty();
    let manifest = jobs_policy("chaos", &bed.server, "{chaos}:in", extra).replace("{chaos}:in:dlq", "{chaos}:dlq");
    assert!(kubectl_apply(&ns, &manifest).0);
    wait_condition(&ns, "chaos", "Ready", "True", "Reconciled");
    produce(&mut bed.server.conn(), "{chaos}:in", total);

    let stop = Arc::new(AtomicBool::new(false));
    let port = bed.server.port;
    let consumer = {
        let stop = stop.clone();
        thread::spawn(move || {
            let mut acked = Vec::new();
            let url = format!("redis://127.0.0.1:{port}/0");
            while !stop.load(Ordering::Relaxed) {
                let Ok(mut conn) = redis::Client::open(url.as_str()).unwrap().get_connection() else {
                    thread::sleep(Duration::from_millis(100));
                    continue;
                };
                while !stop.load(Ordering::Relaxed) {
                    let Ok(batch) = poll(&mut conn, "{chaos}:in", "flaky") else { break };
                    for (id, n) in batch {
                        let n = n.unwrap();
                        // Only while the server stays up: an ACK whose reply is lost to a restart is ambiguous.
                        if ack_some && n % 10 == 0 {
                            // An entry idle past minIdle may have been requeued already (the runner passes
                            // continuously): only an XACK that removed it counts as acknowledged.
                            let removed: i64 =
                                redis::cmd("XACK").arg("{chaos}:in").arg("workers").arg(&id).query(&mut conn).unwrap();
                            if removed == 1 {
                                acked.push(n);
                            }
                        }
                    }
                }
            }
            acked
        })
    };
    chaos(&mut bed);

    let mut conn = bed.server.conn();
    let expected_dead = if ack_some { total - total / 10 } else { total };
    let deadline = Duration::from_secs(180);
    wait_for("every failed message to reach the dead-letter stream", deadline, || {
        let dead: usize = dead_lettered(&mut conn, "{chaos}:dlq").values().sum();
        let pending = pel(&mut conn, "{chaos}:in", "workers").len();
        if dead as u64 >= expected_dead && pending == 0 {
            Ok(())
        } else {
            Err(format!("dead {dead}, pending {pending}"))
        }
    });
    stop.store(true, Ordering::Relaxed);
    let acked = consumer.join().unwrap();

    let dead = dead_lettered(&mut conn, "{chaos}:dlq");
    let duplicated: Vec<_> = dead.iter().filter(|(_, c)| **c > 1).collect();
    assert!(duplicated.is_empty(), "dead-lettered more than once: {:?}", &duplicated[..duplicated.len().min(10)]);
    for n in 0..total {
        let in_dlq = dead.contains_key(&n) as usize;
        let by_consumer = acked.iter().filter(|a| **a == n).count();
        assert_eq!(in_dlq + by_consumer, 1, "message {n}: dead-lettered {in_dlq}, acknowledged {by_consumer}");
    }
    assert!(pel(&mut conn, "{chaos}:in", "workers").is_empty());
    let totals: HashMap<String, u64> =
        redis::cmd("HGETALL").arg(pelican::keys::totals_key("{chaos}:in", "workers")).query(&mut conn).unwrap();
    let in_stream: usize = dead.values().sum();
    assert_eq!(totals.get("deadLettered").copied(), Some(in_stream as u64), "the counter agrees with the stream");
}

/// Operator `i` of a chaos bed. Each has a Lease of its own: two writers at once on purpose (what a partition or a
/// paused leader can make of leader election), to show the scripts keep the ledger whoever runs them.
fn chaos_operator(namespace: &str, i: usize) -> Operator {
    Operator::start_with(namespace, &["--leader-election-lease", &format!("chaos-{i}")])
}

struct ChaosBed {
    operators: Vec<Operator>,
    server: Server,
    namespace: String,
}

fn operator_killed_again_and_again_loses_and_duplicates_nothing(flavor: Flavor) {
    account_under_chaos(flavor, 30_000, 1, &[], |bed| {
        let mut rng = Lcg(Instant::now().elapsed().as_nanos() as u64 ^ 0x5eed);
        for _ in 0..20 {
            thread::sleep(Duration::from_millis(rng.next_in(200, 1_500)));
            bed.operators[0].kill9();
            bed.operators[0] = chaos_operator(&bed.namespace, 0);
        }
    });
}

/// The same with `retry.backoff`: each message waits 1, 2 then 4 s before its next delivery or its dead letter, so
/// the kills land in passes that skip entries not due yet.
fn operator_killed_during_passes_with_backoff_loses_and_duplicates_nothing(flavor: Flavor) {
    let extra = "  retry:\n    maxDeliveries: 3\n    backoff: {factor: 2, max: 4s}\n";
    account_under_chaos_with(flavor, 10_000, 1, &[], extra, |bed| {
        let mut rng = Lcg(Instant::now().elapsed().as_nanos() as u64 ^ 0xb0ff);
        for _ in 0..12 {
            thread::sleep(Duration::from_millis(rng.next_in(200, 1_500)));
            bed.operators[0].kill9();
            bed.operators[0] = chaos_operator(&bed.namespace, 0);
        }
    });
}

fn two_operators_at_once_lose_and_duplicate_nothing(flavor: Flavor) {
    account_under_chaos(flavor, 20_000, 2, &[], |bed| {
        let mut rng = Lcg(0xdecaf);
        for round in 0..8 {
            thread::sleep(Duration::from_millis(rng.next_in(500, 2_000)));
            let victim = round % 2;
            bed.operators[victim].kill9();
            bed.operators[victim] = chaos_operator(&bed.namespace, victim);
        }
    });
}

fn server_restarted_mid_pass_loses_and_duplicates_nothing(flavor: Flavor) {
    // appendfsync always: a write the server acknowledged survives its SIGKILL, as with any durable Redis.
    account_under_chaos(flavor, 20_000, 1, &["--appendonly", "yes", "--appendfsync", "always"], |bed| {
        let mut rng = Lcg(0xbad5eed);
        for _ in 0..4 {
            thread::sleep(Duration::from_millis(rng.next_in(1_500, 3_000)));
            bed.server.kill9();
            bed.server.resume();
        }
    });
}

/// Defect (a review's item 4): a pass held one of its server's two permits for up to `maxPerPass` entries, a second
/// or more of wide entries. Two tenants with large PELs held both, and every other policy on that server waited a
/// whole pass for its turn. A pass now gives its permit back after `PASS_SLICE` (100 ms).
#[test]
fn a_poison_message_beside_two_large_pels_is_dead_lettered_without_waiting_their_passes() {
    let server = Server::start(Flavor::Redis);
    let mut conn = server.conn();
    // Two tenants whose workers died holding 200,000 entries of 50 fields each, below their cap: every pass of
    // theirs looks at 100,000 of them, for as long as the workers stay away.
    let large = |name: &str| {
        policy(name, &server.url(), name, "workers", "  retry:\n    maxDeliveries: 100\n").replace(
            "    interval: 1s\n",
            "    interval: 1s\n    minIdle: 1s\n    maxPerPass: 100000\n    strategy: DeadLetterOnly\n",
        )
    };
    for stream in ["large-a", "large-b"] {
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(stream)
            .arg("workers")
            .arg("0")
            .arg("MKSTREAM")
            .query(&mut conn)
            .unwrap();
        // Written and read on the server (a debug-built client takes a minute to parse 200,000 wide entries).
        let fill = "for i = 1, 2000 do local e = {'n', i} for f = 1, 49 do e[#e + 1] = 'attribute-' .. f; e[#e + 1] = f end \
                    redis.call('XADD', KEYS[1], '*', unpack(e)) end";
        for _ in 0..100 {
            let _: () = redis::cmd("EVAL").arg(fill).arg(1).arg(stream).query(&mut conn).unwrap();
        }
        let read = "return #redis.call('XREADGROUP', 'GROUP', 'workers', 'gone', 'STREAMS', KEYS[1], '>')[1][2]";
        let taken: u64 = redis::cmd("EVAL").arg(read).arg(1).arg(stream).query(&mut conn).unwrap();
        assert_eq!(taken, 200_000);
    }
    let poison = jobs_policy("poison", &server, "poison", "  retry:\n    maxDeliveries: 1\n");
    let (ns, operator) = ready_policy("slices", &poison, "poison");
    assert!(kubectl_apply(&ns, &format!("{}\n---\n{}", large("large-a"), large("large-b"))).0);
    wait_condition(&ns, "large-a", "Ready", "True", "Reconciled");
    wait_condition(&ns, "large-b", "Ready", "True", "Reconciled");

    // How late passes started (`pelican_pass_delay_seconds`): (passes, passes that waited more than 512 ms).
    let late = || {
        let metrics = operator.metrics();
        let value = |prefix: &str| -> f64 {
            let line = metrics.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("{prefix}: {metrics}"));
            line.rsplit(' ').next().unwrap().parse().unwrap()
        };
        let count = value("pelican_pass_delay_seconds_count");
        (count, count - value("pelican_pass_delay_seconds_bucket{le=\"0.512\"}"))
    };
    let before = late();
    let mut latencies = Vec::new();
    for n in 0..5 {
        let _: String = redis::cmd("XADD").arg("poison").arg("*").arg("n").arg(n).query(&mut conn).unwrap();
        assert_eq!(read_new(&mut conn, "poison", "workers", "worker", 1).len(), 1);
        // Due once idle for minIdle (1 s); its policy's passes come every interval (1 s).
        let due = Instant::now() + Duration::from_secs(1);
        wait_for("the poison message to be dead-lettered", Duration::from_secs(30), || {
            let dead: u64 = redis::cmd("XLEN").arg("poison:dlq").query(&mut conn).unwrap();
            if dead > n { Ok(()) } else { Err(dead.to_string()) }
        });
        latencies.push(due.elapsed());
    }
    let after = late();
    let (passes, waited) = (after.0 - before.0, after.1 - before.1);
    eprintln!("poison dead-lettered {latencies:?} after due; {passes} passes, {waited} of them waited over 512 ms");
    // Within an interval of being due, give or take a slice and a call.
    assert!(latencies.iter().all(|l| *l < Duration::from_secs(2)), "{latencies:?}");
    assert_eq!(waited, 0.0, "{waited} of {passes} passes waited over 512 ms for a permit");
    let pending: u64 = redis::cmd("XPENDING")
        .arg("large-a")
        .arg("workers")
        .query::<(u64, redis::Value, redis::Value, redis::Value)>(&mut conn)
        .unwrap()
        .0;
    assert_eq!(pending, 200_000, "the large PELs are below their cap and stay pending");
}
