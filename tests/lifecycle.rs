//! Workers come and go (SPEC 18), through the operator against the real API server and real Redis 7.0 / Valkey 9.1:
//! a handler slower than `minIdle` keeps its message with a lease (the SDK, and redis-py and go-redis with the
//! documented call), a
//! worker that claims by itself cannot defeat the cap, what a shutdown cuts off is given back at once without
//! counting, and `Outcome::Retry` is retried by the next pass. On Redis 8.6.3, workers that read with
//! `XREADGROUP ... CLAIM` keep the cap and share the work with the requeue pass.

#[macro_use]
mod common;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::*;
use pelican::keys::{settings_key, totals_key};
use pelican::worker::{Message, Outcome, Worker, WorkerConfig};

on_both_servers!(
    sdk_workers_slower_than_min_idle_handle_each_message_once,
    a_redis_py_worker_with_the_lease_call_handles_each_message_once,
    a_go_redis_worker_with_the_lease_call_handles_each_message_once,
    a_spring_data_redis_worker_with_the_lease_call_handles_each_message_once,
    a_worker_claiming_every_second_cannot_defeat_the_cap,
    a_shutdown_gives_back_what_its_grace_cut_off_at_once_and_uncounted,
    outcome_retry_is_retried_by_the_next_pass_and_counted,
    a_deleted_pods_messages_are_retried_at_once_and_its_consumer_removed,
    a_handler_past_max_handling_loses_its_lease,
    under_reassign_a_shutdowns_work_goes_to_the_next_worker_not_the_leaver,
);

/// A policy on `tasks` with `minIdle`, a pass every second, `maxDeliveries: 3`, `Requeue`.
fn manifest(server: &Server, min_idle: &str) -> String {
    policy("p", &server.url(), "tasks", "workers", "  retry:\n    maxDeliveries: 3\n")
        .replace("    interval: 1s\n", &format!("    interval: 1s\n    minIdle: {min_idle}\n"))
}

fn publish(conn: &mut redis::Connection, count: usize) {
    for n in 0..count {
        let _: String = redis::cmd("XADD").arg("tasks").arg("*").arg("n").arg(n).query(conn).unwrap();
    }
}

/// The operator's counters of the group.
fn totals(conn: &mut redis::Connection) -> BTreeMap<String, i64> {
    redis::cmd("HGETALL").arg(totals_key("tasks", "workers")).query(conn).unwrap()
}

/// What a user checks after slow handlers: nothing was copied, dead-lettered or left pending.
fn assert_no_copies(conn: &mut redis::Connection, published: usize) {
    let length: usize = redis::cmd("XLEN").arg("tasks").query(conn).unwrap();
    let dead: usize = redis::cmd("XLEN").arg("tasks:dlq").query(conn).unwrap();
    assert_eq!((length, dead), (published, 0), "requeue copies or dead letters; totals {:?}", totals(conn));
    assert!(pel(conn, "tasks", "workers").is_empty());
}

/// Defect (issue 49): `idle minIdle` was taken for abandoned, so a handler slower than `minIdle` had its message
/// requeued under it, handled again and again and dead-lettered although every run succeeded (the issue measured
/// 36 runs and 12 dead letters for 12 messages). Two SDK workers, 12 messages, a handler of 6 s that always
/// succeeds, `minIdle: 2s`: each message is handled once, no copy, no dead letter.
fn sdk_workers_slower_than_min_idle_handle_each_message_once(flavor: Flavor) {
    let server = Server::start(flavor);
    let (_ns, _operator) = ready_policy("lease-sdk", &manifest(&server, "2s"), "p");
    let mut conn = server.conn();
    let published: Option<BTreeMap<String, String>> =
        redis::cmd("HGETALL").arg(settings_key("tasks", "workers")).query(&mut conn).ok();
    assert_eq!(
        published.unwrap_or_default().get("minIdleMs").map(String::as_str),
        Some("2000"),
        "the operator publishes the group's settings"
    );
    publish(&mut conn, 12);
    let runs = Arc::new(Mutex::new(Vec::<String>::new()));
    runtime().block_on(async {
        let client = redis::Client::open(server.url()).unwrap();
        let stop = Arc::new(tokio::sync::Notify::new());
        let mut workers = Vec::new();
        for consumer in ["w1", "w2"] {
            let worker = Worker::connect(&client, WorkerConfig::new("tasks", "workers", consumer)).await.unwrap();
            let (runs, stop) = (runs.clone(), stop.clone());
            let handler = move |message: Message| {
                let runs = runs.clone();
                async move {
                    tokio::time::sleep(Duration::from_secs(6)).await;
                    runs.lock().unwrap().push(message.field_str("n").unwrap_or("?").to_string());
                    Ok(Outcome::Done)
                }
            };
            workers.push(tokio::spawn(worker.run(handler, async move { stop.notified().await })));
        }
        let started = Instant::now();
        while runs.lock().unwrap().len() < 12 && started.elapsed() < Duration::from_secs(40) {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Two more passes: a copy made late would show.
        tokio::time::sleep(Duration::from_secs(3)).await;
        stop.notify_waiters();
        for worker in workers {
            worker.await.unwrap().unwrap();
        }
    });
    let mut runs = runs.lock().unwrap().clone();
    eprintln!("{} handler runs for 12 messages; totals {:?}", runs.len(), totals(&mut conn));
    runs.sort_by_key(|n| n.parse::<u32>().unwrap_or(u32::MAX));
    assert_eq!(runs, (0..12).map(|n| n.to_string()).collect::<Vec<_>>(), "each message handled once");
    assert_no_copies(&mut conn, 12);
}

/// `python3 <script> <args>` with the bed's redis-py, its output piped.
fn python(script: &str, args: &[&str]) -> Command {
    let mut command = Command::new("python3");
    command
        .arg(format!("{}/{script}", env!("CARGO_MANIFEST_DIR")))
        .args(args)
        .env("PYTHONPATH", bed().var("PELICAN_PYTHONPATH"))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    command
}

/// 12 messages, each handler run 6 s under `minIdle: 2s`, by a worker in another language (`worker` given the
/// server's URL, the stream, the group, its consumer name, the seconds and the count, as
/// `examples/workers/slow_worker.py` takes them) that extends its messages with the documented lease call: each
/// message is handled once, no copy, no dead letter.
fn each_message_handled_once_by(flavor: Flavor, prefix: &str, worker: impl FnOnce(&[&str]) -> Command) {
    let server = Server::start(flavor);
    let (_ns, _operator) = ready_policy(prefix, &manifest(&server, "2s"), "p");
    let mut conn = server.conn();
    publish(&mut conn, 12);
    let url = server.url();
    let mut worker = worker(&[&url, "tasks", "workers", prefix, "6", "12"]);
    let output = worker.stdout(Stdio::piped()).stderr(Stdio::inherit()).output().expect("the worker");
    assert!(output.status.success(), "the worker failed: {worker:?}");
    let handled = String::from_utf8_lossy(&output.stdout).lines().filter(|l| l.starts_with("handled ")).count();
    std::thread::sleep(Duration::from_secs(3));
    eprintln!("{handled} handler runs for 12 messages; totals {:?}", totals(&mut conn));
    assert_eq!(handled, 12, "each message handled once");
    assert_no_copies(&mut conn, 12);
    // The lease call is also the worker's heartbeat, which `strategy: Reassign` reads (a plain XCLAIM writes none).
    let beat: Option<u64> =
        redis::cmd("HGET").arg(pelican::keys::consumers_key("tasks", "workers")).arg(prefix).query(&mut conn).unwrap();
    assert!(beat.is_some(), "no heartbeat of {prefix} in the consumers hash");
}

/// The same with a worker in Python: `examples/workers/slow_worker.py` extends its messages with the call the workers
/// page documents, at the interval it reads from the settings the operator publishes.
fn a_redis_py_worker_with_the_lease_call_handles_each_message_once(flavor: Flavor) {
    each_message_handled_once_by(flavor, "lease-py", |args| python("examples/workers/slow_worker.py", args));
}

/// `examples/workers/go` built once per test binary with the bed's Go caches (its modules through the Go module
/// proxy the first time); the binary's path.
fn go_slow_worker() -> &'static str {
    static BUILT: OnceLock<String> = OnceLock::new();
    BUILT.get_or_init(|| {
        let out = format!("{}/go/slow-worker", env!("CARGO_TARGET_TMPDIR"));
        let build = Command::new("go")
            .args(["build", "-o", &out, "."])
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/workers/go"))
            .env("GOMODCACHE", bed().var("PELICAN_GOMODCACHE"))
            .env("GOCACHE", bed().var("PELICAN_GOCACHE"))
            .env("CGO_ENABLED", "0")
            .output()
            .expect("go");
        assert!(build.status.success(), "go build: {}", String::from_utf8_lossy(&build.stderr));
        out
    })
}

/// The same with a worker in Go: `examples/workers/go` (go-redis v9) extends its messages with the contract's
/// `lease.lua`, the call the workers page documents.
fn a_go_redis_worker_with_the_lease_call_handles_each_message_once(flavor: Flavor) {
    each_message_handled_once_by(flavor, "lease-go", |args| {
        let mut go = Command::new(go_slow_worker());
        go.args(args);
        go
    });
}

/// `examples/workers/spring` compiled once per test binary with Maven (its dependencies from the Maven repository
/// the first time): the `java` arguments that run it.
fn spring_slow_worker() -> &'static [String] {
    static BUILT: OnceLock<Vec<String>> = OnceLock::new();
    BUILT.get_or_init(|| {
        let dir = format!("{}/spring", env!("CARGO_TARGET_TMPDIR"));
        let classpath = format!("{dir}/classpath.txt");
        let build = Command::new("mvn")
            .args(["-q", "-B", "compile", "dependency:build-classpath"])
            .arg(format!("-Dmdep.outputFile={classpath}"))
            .arg(format!("-Dworker.output={dir}"))
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/workers/spring"))
            .output()
            .expect("mvn");
        assert!(build.status.success(), "mvn: {}", String::from_utf8_lossy(&build.stdout));
        let dependencies = std::fs::read_to_string(&classpath).unwrap();
        vec!["-cp".into(), format!("{dir}/classes:{dependencies}"), "SlowWorker".into()]
    })
}

/// The same with a worker in Java: `examples/workers/spring` (Spring Data Redis with Lettuce) extends its messages
/// with the contract's `lease.lua`, the call the workers page documents.
fn a_spring_data_redis_worker_with_the_lease_call_handles_each_message_once(flavor: Flavor) {
    each_message_handled_once_by(flavor, "lease-java", |args| {
        let mut java = Command::new("java");
        java.args(spring_slow_worker()).args(args);
        java
    });
}

/// Defect (issue 49): a worker that claims by itself with a shorter idle than the policy's (`XAUTOCLAIM` every
/// second, as tutorials write it) kept the entry from ever going idle `minIdle`: delivered forever, never
/// dead-lettered (the issue: 45 deliveries in 45 s). With `minIdle: 30s, maxDeliveries: 3` the message is
/// dead-lettered once its deliveries pass 3, long before it could ever be idle 30 s.
fn a_worker_claiming_every_second_cannot_defeat_the_cap(flavor: Flavor) {
    the_cap_holds_against(flavor, "autoclaim", &["tests/python/autoclaim.py", "greedy", "12"]);
}

/// A policy with `minIdle: 30s, maxDeliveries: 3`, one message, and `worker` (a Python script and its arguments after
/// URL, stream and group) failing it and claiming it back by itself for 12 s: it is dead-lettered once its
/// deliveries pass 3, the worker seeing it at most 5 times.
fn the_cap_holds_against(flavor: Flavor, prefix: &str, worker: &[&str]) {
    let server = Server::start(flavor);
    let (_ns, _operator) = ready_policy(prefix, &manifest(&server, "30s"), "p");
    let mut conn = server.conn();
    publish(&mut conn, 1);
    let url = server.url();
    let args: Vec<&str> = [&url[..], "tasks", "workers"].into_iter().chain(worker[1..].iter().copied()).collect();
    let worker = python(worker[0], &args).spawn().expect("python3");
    let started = Instant::now();
    let dead = wait_for("the message to be dead-lettered", Duration::from_secs(20), || {
        let dead = xrange(&mut conn, "tasks:dlq");
        if dead.is_empty() { Err(format!("{:?}", pel(&mut conn, "tasks", "workers"))) } else { Ok(dead) }
    });
    let took = started.elapsed();
    let output = worker.wait_with_output().unwrap();
    assert!(output.status.success(), "the Python worker failed");
    let deliveries = String::from_utf8_lossy(&output.stdout).lines().filter(|l| l.starts_with("delivery ")).count();
    eprintln!("{flavor:?} {prefix}: dead-lettered after {took:?}; the worker saw {deliveries} deliveries in 12 s");
    assert_eq!(dead.len(), 1);
    assert_eq!(field(&dead[0], "pelican-reason"), Some(&b"MaxDeliveriesExceeded"[..]));
    let counted: u64 = std::str::from_utf8(field(&dead[0], "pelican-deliveries").unwrap()).unwrap().parse().unwrap();
    assert!(counted > 3, "dead-lettered with {counted} deliveries");
    assert!(deliveries <= 5, "{deliveries} deliveries: the cap is 3 and a pass runs every second");
    assert!(pel(&mut conn, "tasks", "workers").is_empty());
}

/// Reads that claim (issue 50, Redis 8.6.3): a worker that reads with `XREADGROUP ... CLAIM 1000` (redis-py's
/// `claim_min_idle_time`) and never acknowledges takes its poison message back every time it is idle 1 s, each a
/// delivery the server counts. With `minIdle: 30s, maxDeliveries: 3` Pelican's pass still dead-letters it once its
/// deliveries pass 3, as it does for `XAUTOCLAIM`.
#[test]
fn a_worker_reading_with_claim_cannot_defeat_the_cap() {
    the_cap_holds_against(
        Flavor::Redis86,
        "claim-cap",
        &["tests/python/claim_reader.py", "greedy", "12", "1000", "fail"],
    );
}

/// Reads that claim share the work with the requeue pass (Redis 8.6.3): a consumer crashed holding 10 of 20
/// messages; a worker reading with `CLAIM <min-idle>` acknowledges what it gets, while the pass requeues what is
/// idle `minIdle` (2 s). With a min-idle below `minIdle` the reader mostly takes the entries back itself; above it,
/// the pass requeues them first and the reader gets the copies as new entries. Either way every message is handled
/// exactly once: the pass writes a copy in the call that acknowledges the original, so nobody gets both.
#[test]
fn a_worker_reading_with_claim_and_the_requeue_pass_handle_each_message_once() {
    for claim_min_idle in ["1000", "5000"] {
        let server = Server::start(Flavor::Redis86);
        let (_ns, _operator) = ready_policy("claim-share", &manifest(&server, "2s"), "p");
        let mut conn = server.conn();
        publish(&mut conn, 20);
        let _: redis::Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("workers")
            .arg("crashed")
            .arg("COUNT")
            .arg(10)
            .arg("STREAMS")
            .arg("tasks")
            .arg(">")
            .query(&mut conn)
            .unwrap();
        let url = server.url();
        let args = [&url[..], "tasks", "workers", "reader", "9", claim_min_idle, "ack"];
        let output = python("tests/python/claim_reader.py", &args).output().unwrap();
        assert!(output.status.success(), "the Python worker failed");
        let stdout = String::from_utf8_lossy(&output.stdout).to_string();
        let mut handled: Vec<u32> = stdout.lines().filter_map(|l| l.split(' ').nth(2)?.parse().ok()).collect();
        let claimed = stdout.lines().filter(|l| !l.ends_with(" 0")).count();
        let requeued = totals(&mut conn).get("requeued").copied().unwrap_or(0);
        eprintln!(
            "CLAIM {claim_min_idle} ms, minIdle 2s: {} handler runs for 20 messages, {claimed} taken back by CLAIM, \
             {requeued} requeued by the pass",
            handled.len()
        );
        handled.sort_unstable();
        assert_eq!(handled, (0..20).collect::<Vec<_>>(), "each message handled once");
        assert_eq!(claimed as i64 + requeued, 10, "each of the crashed consumer's 10 taken back once");
        assert!(pel(&mut conn, "tasks", "workers").is_empty());
        assert!(xrange(&mut conn, "tasks:dlq").is_empty());
    }
}

/// Defect (issue 49): a shutdown left what its grace cut off pending for `minIdle` (5 minutes by default), and the
/// cut-off delivery counted. With `minIdle: 60s`, four messages whose handlers outlast a 1 s grace are requeued by
/// the next pass after the worker stopped, each copy carrying the deliveries before the cut-off one (none).
fn a_shutdown_gives_back_what_its_grace_cut_off_at_once_and_uncounted(flavor: Flavor) {
    let server = Server::start(flavor);
    let (_ns, _operator) = ready_policy("give-back", &manifest(&server, "60s"), "p");
    let mut conn = server.conn();
    publish(&mut conn, 4);
    let stats = runtime().block_on(async {
        let client = redis::Client::open(server.url()).unwrap();
        let config =
            WorkerConfig { shutdown_grace: Duration::from_secs(1), ..WorkerConfig::new("tasks", "workers", "w1") };
        let worker = Worker::connect(&client, config).await.unwrap();
        let handler = |_message: Message| async move {
            tokio::time::sleep(Duration::from_secs(600)).await;
            Ok(Outcome::Done)
        };
        let mut probe = client.get_multiplexed_async_connection().await.unwrap();
        let shutdown = async move {
            loop {
                let pending: Vec<redis::Value> =
                    redis::cmd("XPENDING").arg("tasks").arg("workers").query_async(&mut probe).await.unwrap();
                if redis::from_redis_value::<i64>(pending[0].clone()).unwrap() == 4 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        worker.run(handler, shutdown).await.unwrap()
    });
    let stopped = Instant::now();
    assert_eq!(stats.abandoned, 4, "{stats:?}");
    let copies = wait_for("the given-back messages to be requeued", Duration::from_secs(10), || {
        let copies: Vec<RawEntry> =
            xrange(&mut conn, "tasks").into_iter().filter(|e| field(e, "pelican-origin-id").is_some()).collect();
        if copies.len() == 4 { Ok(copies) } else { Err(format!("{} copies", copies.len())) }
    });
    eprintln!("requeued {:?} after the worker stopped (minIdle 60 s)", stopped.elapsed());
    for copy in &copies {
        assert_eq!(field(copy, "pelican-deliveries"), Some(&b"0"[..]), "the cut-off delivery does not count");
    }
    assert!(pel(&mut conn, "tasks", "workers").is_empty());
}

/// `Outcome::Retry`: the message is given back at once and retried by the next pass (not after `minIdle: 60s`),
/// the delivery counted: the copy the handler sees next carries one delivery.
fn outcome_retry_is_retried_by_the_next_pass_and_counted(flavor: Flavor) {
    let server = Server::start(flavor);
    let (_ns, _operator) = ready_policy("retry-now", &manifest(&server, "60s"), "p");
    let mut conn = server.conn();
    publish(&mut conn, 1);
    let seen = Arc::new(Mutex::new(Vec::<(Option<String>, Instant)>::new()));
    let stats = runtime().block_on(async {
        let client = redis::Client::open(server.url()).unwrap();
        let worker = Worker::connect(&client, WorkerConfig::new("tasks", "workers", "w1")).await.unwrap();
        let handler = {
            let seen = seen.clone();
            move |message: Message| {
                let seen = seen.clone();
                async move {
                    let deliveries = message.field_str("pelican-deliveries").map(str::to_string);
                    let first = deliveries.is_none();
                    seen.lock().unwrap().push((deliveries, Instant::now()));
                    Ok(if first { Outcome::Retry } else { Outcome::Done })
                }
            }
        };
        let done = {
            let seen = seen.clone();
            async move {
                let started = Instant::now();
                while seen.lock().unwrap().len() < 2 && started.elapsed() < Duration::from_secs(20) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        };
        worker.run(handler, done).await.unwrap()
    });
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "handled once, retried once: {seen:?}");
    let after = seen[1].1 - seen[0].1;
    eprintln!("retried {after:?} after Outcome::Retry (minIdle 60 s); {stats:?}");
    assert_eq!(seen[1].0.as_deref(), Some("1"), "the retried delivery counts");
    assert!(after < Duration::from_secs(10), "retried after {after:?}");
    assert_eq!((stats.retried, stats.done), (1, 1), "{stats:?}");
    assert_no_copies_left(&mut conn);
}

fn assert_no_copies_left(conn: &mut redis::Connection) {
    assert!(pel(conn, "tasks", "workers").is_empty());
    let dead: usize = redis::cmd("XLEN").arg("tasks:dlq").query(conn).unwrap();
    assert_eq!(dead, 0);
}

/// A Pod object that never runs (bound to a node that does not exist): what the operator sees of a worker's Pod.
fn pod(name: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  labels:\n    app: workers\nspec:\n  nodeName: \
         no-such-node\n  containers:\n    - name: worker\n      image: localhost/pelican-consumer:none\n"
    )
}

/// Defect (issue 49): a worker Pod deleted with messages in flight left them pending for `minIdle` (5 minutes by
/// default) before anyone retried them. With `spec.consumers.pods` and `minIdle: 60s`: the deleted Pod's three
/// messages are requeued within a few passes (each copy counting the delivery the Pod had), its consumer is removed
/// from the group, and the other Pod's two messages stay with it.
fn a_deleted_pods_messages_are_retried_at_once_and_its_consumer_removed(flavor: Flavor) {
    let server = Server::start(flavor);
    let ns = namespace("pods");
    let _operator = Operator::start(&ns);
    // The bed without its node runs no controller that makes the namespace's default ServiceAccount.
    assert!(kubectl_apply(&ns, "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: default\n").0);
    for name in ["worker-a", "worker-b"] {
        assert!(kubectl_apply(&ns, &pod(name)).0);
    }
    let pods = "  consumers:\n    pods:\n      matchLabels:\n        app: workers\n";
    assert!(kubectl_apply(&ns, &format!("{}{pods}", manifest(&server, "60s"))).0);
    wait_condition(&ns, "p", "Ready", "True", "Reconciled");
    let mut conn = server.conn();
    publish(&mut conn, 5);
    assert_eq!(read_new(&mut conn, "tasks", "workers", "worker-a", 3).len(), 3);
    assert_eq!(read_new(&mut conn, "tasks", "workers", "worker-b", 2).len(), 2);
    // Both Pods exist: several passes leave their messages alone.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(pel(&mut conn, "tasks", "workers").len(), 5);

    kubectl_ok(&["delete", "pod", "worker-a", "-n", &ns, "--grace-period=0", "--force"]);
    let deleted = Instant::now();
    let copies = wait_for("the deleted Pod's messages to be requeued", Duration::from_secs(20), || {
        let copies: Vec<RawEntry> =
            xrange(&mut conn, "tasks").into_iter().filter(|e| field(e, "pelican-origin-id").is_some()).collect();
        if copies.len() == 3 { Ok(copies) } else { Err(format!("{} copies", copies.len())) }
    });
    let took = deleted.elapsed();
    eprintln!("the deleted Pod's messages were requeued {took:?} after its deletion (minIdle 60 s)");
    for copy in &copies {
        assert_eq!(field(copy, "pelican-deliveries"), Some(&b"1"[..]), "the Pod's delivery counts");
    }
    wait_for("the consumer to be removed", Duration::from_secs(10), || {
        let consumers: Vec<redis::Value> =
            redis::cmd("XINFO").arg("CONSUMERS").arg("tasks").arg("workers").query(&mut conn).unwrap();
        let text = format!("{consumers:?}");
        if text.contains("worker-a") { Err(text) } else { Ok(()) }
    });
    let owners: Vec<String> = pel(&mut conn, "tasks", "workers").into_iter().map(|(_, owner, ..)| owner).collect();
    assert_eq!(owners, ["worker-b", "worker-b"], "the live Pod keeps its messages");
    let removed = events(&ns, "ConsumersRemoved");
    assert!(
        removed.iter().any(|e| e["message"].as_str().is_some_and(|m| m.contains("worker-a"))),
        "a ConsumersRemoved Event names the consumer: {removed:?}"
    );
    assert!(took < Duration::from_secs(10), "requeued {took:?} after the Pod's deletion");
}

/// A lease lasts `max_handling`: a handler stuck past it is taken for stuck, and the pass retries its message once
/// it has been idle `minIdle` (here 3 s + 2 s), while the handler still runs.
fn a_handler_past_max_handling_loses_its_lease(flavor: Flavor) {
    let server = Server::start(flavor);
    let (_ns, _operator) = ready_policy("max-handling", &manifest(&server, "2s"), "p");
    let mut conn = server.conn();
    publish(&mut conn, 1);
    let started = Arc::new(Mutex::new(None::<Instant>));
    let copy_after = runtime().block_on(async {
        let client = redis::Client::open(server.url()).unwrap();
        let config = WorkerConfig {
            max_handling: Duration::from_secs(3),
            shutdown_grace: Duration::from_secs(1),
            ..WorkerConfig::new("tasks", "workers", "w1")
        };
        let worker = Worker::connect(&client, config).await.unwrap();
        let handler = {
            let started = started.clone();
            move |message: Message| {
                let started = started.clone();
                async move {
                    if message.field("pelican-origin-id").is_none() {
                        *started.lock().unwrap() = Some(Instant::now());
                        tokio::time::sleep(Duration::from_secs(20)).await;
                    }
                    Ok(Outcome::Done)
                }
            }
        };
        let mut probe = client.get_multiplexed_async_connection().await.unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let watch = async move {
            loop {
                let length: usize = redis::cmd("XLEN").arg("tasks").query_async(&mut probe).await.unwrap();
                let since = started.lock().unwrap().map(|at| at.elapsed());
                if length == 2 || since.is_some_and(|s| s > Duration::from_secs(15)) {
                    let _ = tx.send(since);
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        let stats = worker.run(handler, watch).await.unwrap();
        (rx.await.unwrap(), stats)
    });
    let (after, stats) = copy_after;
    eprintln!("requeued {after:?} into a handler stuck past max_handling 3 s (minIdle 2 s); {stats:?}");
    let after = after.expect("the handler never started");
    assert!(after >= Duration::from_secs(3), "requeued after {after:?}: the lease held for max_handling");
    assert!(after < Duration::from_secs(12), "still not retried {after:?} after the handler started");
}

/// Defect (issue 57.5): under `Reassign`, the shutdown's give-back claimed the entries for the leaving worker (`XCLAIM`
/// made it look live), so the pass handed them back to it, and the next worker (a single replica during a drain,
/// `Recreate`) waited `minIdle` plus the hand-over grace. Now the give-back leaves them without an owner and the
/// worker leaves the group: with no consumer live the pass requeues them, and the next worker reads them at once.
fn under_reassign_a_shutdowns_work_goes_to_the_next_worker_not_the_leaver(flavor: Flavor) {
    let server = Server::start(flavor);
    let manifest = manifest(&server, "1h").replace("    minIdle: 1h\n", "    minIdle: 1h\n    strategy: Reassign\n");
    let (_ns, _operator) = ready_policy("leave", &manifest, "p");
    let mut conn = server.conn();
    publish(&mut conn, 2);
    let client = redis::Client::open(server.url()).unwrap();
    let slow = |_message: Message| async move {
        tokio::time::sleep(Duration::from_secs(600)).await;
        Ok(Outcome::Done)
    };
    let stats = runtime().block_on(async {
        let config = WorkerConfig {
            shutdown_grace: Duration::from_millis(300),
            ..WorkerConfig::new("tasks", "workers", "leaving")
        };
        let worker = Worker::connect(&client, config).await.unwrap();
        let mut probe = client.get_multiplexed_async_connection().await.unwrap();
        let shutdown = async move {
            while redis::cmd("XPENDING")
                .arg("tasks")
                .arg("workers")
                .query_async::<Vec<redis::Value>>(&mut probe)
                .await
                .map(|p| redis::from_redis_value::<i64>(p[0].clone()).unwrap_or(0))
                .unwrap_or(0)
                < 2
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        worker.run(slow, shutdown).await.unwrap()
    });
    assert_eq!(stats.abandoned, 2, "{stats:?}");
    // The drain: no worker for a few passes.
    std::thread::sleep(Duration::from_secs(3));
    let owners: Vec<String> = pel(&mut conn, "tasks", "workers").into_iter().map(|p| p.1).collect();
    assert!(!owners.iter().any(|o| o == "leaving"), "handed back to the worker that left: {owners:?}");
    let handled = Arc::new(Mutex::new(0));
    let next = runtime().block_on(async {
        let worker = Worker::connect(&client, WorkerConfig::new("tasks", "workers", "next")).await.unwrap();
        let count = handled.clone();
        let handler = move |_message: Message| {
            let count = count.clone();
            async move {
                *count.lock().unwrap() += 1;
                Ok(Outcome::Done)
            }
        };
        let started = Instant::now();
        let done = handled.clone();
        let stop = async move {
            while *done.lock().unwrap() < 2 && started.elapsed() < Duration::from_secs(20) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        worker.run(handler, stop).await.unwrap();
        started.elapsed()
    });
    assert_eq!(*handled.lock().unwrap(), 2, "the next worker handled both, {next:?} after it started");
    assert!(pel(&mut conn, "tasks", "workers").is_empty());
}
