//! The worker SDK against real Redis 7.0 and Valkey 9.1: the dispatch contract, with the example "file
//! jobs" handler from examples/file_jobs.

#[macro_use]
mod common;
#[path = "../examples/file_jobs/handler.rs"]
mod handler;

use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use handler::{FileJobs, RedisJobStore};
use std::future::ready;

use pelican::worker::{ContractStop, Message, Outcome, Reason, Worker, WorkerConfig, WorkerStats, ack_terminal};

on_both_servers!(
    record_gone_is_terminal_acked_and_counted_without_heavy_work,
    lookup_failure_reaches_the_dispatch_layer_and_stays_pending,
    record_present_is_done,
    handler_panic_is_an_error_and_the_worker_keeps_running,
    invalid_reason_code_is_reported_and_never_acked,
    shutdown_mid_batch_finishes_in_flight_work_and_acks_nothing_unfinished,
    a_second_ack_of_the_same_entry_never_counts_twice,
    own_pel_is_read_before_new_entries,
    terminal_acks_show_up_in_status_and_metrics_next_to_the_operators_reasons,
    entries_reassigned_to_a_running_worker_are_handled,
    a_failed_message_is_left_pending_for_the_operator_not_read_again,
    a_counter_field_holding_no_integer_still_counts_the_terminal_ack,
    a_contract_version_met_while_running_shuts_the_worker_down,
    the_contract_version_is_checked_before_the_other_settings,
    a_block_of_zero_is_refused_when_the_worker_is_built,
    a_missing_group_is_waited_out_and_said_once,
    an_idle_worker_beats_its_heart_at_every_lease_tick,
    live_stats_show_what_a_running_worker_does,
    outcomes_met_by_killed_connections_are_written_once_and_never_run_again,
    a_failure_whose_lease_reply_came_late_is_not_run_again,
    handlers_that_wait_run_in_parallel_on_the_runtimes_threads,
);

const STREAM: &str = "files";
const GROUP: &str = "converters";

/// Log lines the SDK writes during a test (current-thread runtime, so its tasks log to this subscriber).
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).to_string()
    }
}

/// Runs a worker on `server` with `handler` until the stream's group has nothing left to give it (or `stop_after`).
fn run_worker<H, Fut, T>(
    server: &Server,
    config: WorkerConfig,
    setup: impl Future<Output = (H, T)>,
    stop_after: Duration,
) -> (WorkerStats, String, T)
where
    H: Fn(Message) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Outcome, pelican::worker::BoxError>> + Send + 'static,
{
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt().json().with_writer(move || writer.clone()).finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (stats, kept) = runtime.block_on(async {
        let client = redis::Client::open(server.url()).unwrap();
        let worker = Worker::connect(&client, config).await.unwrap();
        let (handler, kept) = setup.await;
        (worker.run(handler, tokio::time::sleep(stop_after)).await.unwrap(), kept)
    });
    (stats, logs.text(), kept)
}

fn config() -> WorkerConfig {
    WorkerConfig { block: Duration::from_millis(100), ..WorkerConfig::new(STREAM, GROUP, "worker-1") }
}

fn setup(server: &Server, jobs: &[&str]) -> Vec<String> {
    let mut conn = server.conn();
    let _: () =
        redis::cmd("XGROUP").arg("CREATE").arg(STREAM).arg(GROUP).arg("0").arg("MKSTREAM").query(&mut conn).unwrap();
    jobs.iter()
        .map(|job| redis::cmd("XADD").arg(STREAM).arg("*").arg("job_id").arg(job).query::<String>(&mut conn).unwrap())
        .collect()
}

/// The example's handler with its record store on `store_server`; built inside the worker's runtime.
async fn file_jobs(store_server: &Server) -> Arc<FileJobs<RedisJobStore>> {
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_number_of_retries(0)
        .set_connection_timeout(Some(Duration::from_millis(500)))
        .set_response_timeout(Some(Duration::from_millis(500)));
    let client = redis::Client::open(store_server.url()).unwrap();
    Arc::new(FileJobs::new(RedisJobStore(client.get_connection_manager_with_config(config).await.unwrap())))
}

type BoxedOutcome = std::pin::Pin<Box<dyn Future<Output = Result<Outcome, pelican::worker::BoxError>> + Send>>;

fn handle_with(jobs: Arc<FileJobs<RedisJobStore>>) -> impl Fn(Message) -> BoxedOutcome + Send + Sync + 'static {
    move |message| {
        let jobs = jobs.clone();
        Box::pin(async move { jobs.handle(message).await })
    }
}

fn terminal_count(conn: &mut redis::Connection, reason: &str) -> i64 {
    redis::cmd("HGET")
        .arg("{files}:pelican:files:converters:terminal")
        .arg(reason)
        .query::<Option<i64>>(conn)
        .unwrap()
        .unwrap_or(0)
}

fn record_gone_is_terminal_acked_and_counted_without_heavy_work(flavor: Flavor) {
    let server = Server::start(flavor);
    let ids = setup(&server, &["job-41"]);
    let setup_handler = async {
        let jobs = file_jobs(&server).await;
        (handle_with(jobs.clone()), jobs)
    };
    let (stats, logs, jobs) = run_worker(&server, config(), setup_handler, Duration::from_millis(800));
    assert_eq!((stats.terminal, stats.done, stats.failed), (1, 0, 0));
    assert_eq!(jobs.heavy_work_started.load(Ordering::Relaxed), 0, "no heavy work for a job whose record is gone");
    let mut conn = server.conn();
    assert!(pel(&mut conn, STREAM, GROUP).is_empty(), "resolved and acknowledged");
    assert_eq!(terminal_count(&mut conn, "RecordNotFound"), 1);
    // One structured WARN line with stream, group, entry id, reason and will_ack, and nothing of the payload.
    let line = logs.lines().find(|l| l.contains("message ended as terminal")).expect(&logs);
    let json: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(json["level"], "WARN");
    assert_eq!(json["fields"]["stream"], STREAM);
    assert_eq!(json["fields"]["group"], GROUP);
    assert_eq!(json["fields"]["entry_id"], ids[0].as_str());
    assert_eq!(json["fields"]["reason"], "RecordNotFound");
    assert_eq!(json["fields"]["will_ack"], true);
    assert!(!logs.contains("job-41"), "the payload must not be logged: {logs}");
    assert_eq!(logs.matches("message ended as terminal").count(), 1);
}

fn lookup_failure_reaches_the_dispatch_layer_and_stays_pending(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut records = Server::start(flavor);
    let ids = setup(&server, &["job-7"]);
    let setup_handler = async {
        let jobs = file_jobs(&records).await;
        records.stop(); // the record store goes down: every lookup fails
        (handle_with(jobs.clone()), jobs)
    };
    let (stats, logs, jobs) = run_worker(&server, config(), setup_handler, Duration::from_millis(1500));
    assert_eq!((stats.failed, stats.done, stats.terminal), (1, 0, 0), "{logs}");
    assert_eq!(jobs.heavy_work_started.load(Ordering::Relaxed), 0);
    let mut conn = server.conn();
    let pending = pel(&mut conn, STREAM, GROUP);
    assert_eq!(pending.len(), 1, "a failed lookup is never acknowledged");
    assert_eq!(pending[0].0, ids[0]);
    assert_eq!(terminal_count(&mut conn, "RecordNotFound"), 0);
    let line = logs.lines().find(|l| l.contains("handler failed")).expect(&logs);
    let json: serde_json::Value = serde_json::from_str(line).unwrap();
    let error = json["fields"]["error"].as_str().unwrap().to_lowercase();
    assert!(
        error.contains("refused") || error.contains("broken") || error.contains("reset") || error.contains("timed out"),
        "the original storage error reaches the dispatch layer: {error}"
    );
    assert_eq!(logs.matches("handler failed").count(), 1, "logged once");
}

fn record_present_is_done(flavor: Flavor) {
    let server = Server::start(flavor);
    setup(&server, &["job-1"]);
    let _: () = redis::cmd("HSET").arg("filejob:job-1").arg("path").arg("/in/a.pdf").query(&mut server.conn()).unwrap();
    let setup_handler = async {
        let jobs = file_jobs(&server).await;
        (handle_with(jobs.clone()), jobs)
    };
    let (stats, _, jobs) = run_worker(&server, config(), setup_handler, Duration::from_millis(800));
    assert_eq!((stats.done, stats.terminal, stats.failed), (1, 0, 0));
    assert_eq!(jobs.heavy_work_started.load(Ordering::Relaxed), 1);
    assert!(pel(&mut server.conn(), STREAM, GROUP).is_empty());
}

fn handler_panic_is_an_error_and_the_worker_keeps_running(flavor: Flavor) {
    let server = Server::start(flavor);
    let ids = setup(&server, &["boom", "fine", "fine-too"]);
    let (stats, logs, ()) = run_worker(
        &server,
        config(),
        ready((
            |m: Message| async move {
                if m.field_str("job_id") == Some("boom") {
                    panic!("corrupt input");
                }
                Ok(Outcome::Done)
            },
            (),
        )),
        Duration::from_millis(800),
    );
    assert_eq!((stats.failed, stats.done), (1, 2));
    let pending: Vec<String> = pel(&mut server.conn(), STREAM, GROUP).into_iter().map(|p| p.0).collect();
    assert_eq!(pending, [ids[0].clone()]);
    assert!(logs.contains("handler panicked") && logs.contains("corrupt input"), "{logs}");
}

fn invalid_reason_code_is_reported_and_never_acked(flavor: Flavor) {
    let server = Server::start(flavor);
    setup(&server, &["job-9"]);
    let (stats, logs, ()) = run_worker(
        &server,
        config(),
        ready((|_| async { Ok(Outcome::terminal("record not found")) }, ())),
        Duration::from_millis(800),
    );
    assert_eq!((stats.failed, stats.terminal), (1, 0));
    assert_eq!(pel(&mut server.conn(), STREAM, GROUP).len(), 1, "never a silent ACK");
    assert!(logs.contains("invalid terminal reason code") && logs.contains("^[A-Z][A-Za-z0-9]{0,62}$"), "{logs}");
}

fn shutdown_mid_batch_finishes_in_flight_work_and_acks_nothing_unfinished(flavor: Flavor) {
    let server = Server::start(flavor);
    let ids = setup(&server, &["quick", "slow", "stuck", "stuck"]);
    let config = WorkerConfig { shutdown_grace: Duration::from_millis(1500), ..config() };
    // Shutdown comes at 300 ms: "quick" is done, "slow" finishes within the grace period, "stuck" never does.
    let (stats, _, ()) = run_worker(
        &server,
        config,
        ready((
            |m: Message| async move {
                match m.field_str("job_id") {
                    Some("slow") => tokio::time::sleep(Duration::from_millis(800)).await,
                    Some("stuck") => std::future::pending::<()>().await,
                    _ => {}
                }
                Ok(Outcome::Done)
            },
            (),
        )),
        Duration::from_millis(300),
    );
    assert_eq!((stats.done, stats.abandoned), (2, 2), "{stats:?}");
    let pending: Vec<String> = pel(&mut server.conn(), STREAM, GROUP).into_iter().map(|p| p.0).collect();
    assert_eq!(pending, ids[2..], "only the unfinished messages stay pending");
}

fn a_second_ack_of_the_same_entry_never_counts_twice(flavor: Flavor) {
    let server = Server::start(flavor);
    setup(&server, &["job-3"]);
    let mut conn = server.conn();
    let id = read_new(&mut conn, STREAM, GROUP, "worker-1", 1).remove(0);
    let reason = Reason::new("RecordNotFound").unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (first, second) = runtime.block_on(async {
        let mut c = redis::Client::open(server.url()).unwrap().get_connection_manager().await.unwrap();
        let first = ack_terminal(&mut c, STREAM, GROUP, &id, &reason).await.unwrap();
        let second = ack_terminal(&mut c, STREAM, GROUP, &id, &reason).await.unwrap();
        (first, second)
    });
    assert_eq!((first, second), (true, false));
    assert_eq!(terminal_count(&mut conn, "RecordNotFound"), 1);
}

fn own_pel_is_read_before_new_entries(flavor: Flavor) {
    let server = Server::start(flavor);
    let ids = setup(&server, &["old-1", "old-2"]);
    // Delivered to worker-1 before it "crashed"; then a new entry arrives.
    read_new(&mut server.conn(), STREAM, GROUP, "worker-1", 10);
    let newer: String =
        redis::cmd("XADD").arg(STREAM).arg("*").arg("job_id").arg("new").query(&mut server.conn()).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    let config = WorkerConfig { concurrency: 1, ..config() };
    let (stats, _, ()) = run_worker(
        &server,
        config,
        ready((
            move |m: Message| {
                record.lock().unwrap().push(m.id.clone());
                async { Ok(Outcome::Done) }
            },
            (),
        )),
        Duration::from_millis(800),
    );
    assert_eq!(stats.done, 3);
    assert_eq!(*seen.lock().unwrap(), [ids[0].clone(), ids[1].clone(), newer]);
}

fn terminal_acks_show_up_in_status_and_metrics_next_to_the_operators_reasons(flavor: Flavor) {
    let server = Server::start(flavor);
    let manifest = policy("files", &server.url(), STREAM, GROUP, "  retry:\n    maxDeliveries: 1\n")
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n");
    let (ns, operator) = ready_policy("worker", &manifest, "files");
    let mut conn = server.conn();
    // Two messages a consumer took and never finished: the operator dead-letters them (maxDeliveries 1).
    for job in ["x", "y"] {
        let _: String = redis::cmd("XADD").arg(STREAM).arg("*").arg("job_id").arg(job).query(&mut conn).unwrap();
    }
    assert_eq!(read_new(&mut conn, STREAM, GROUP, "crashed", 2).len(), 2);
    // Forty file jobs whose records are gone: the worker ends them as RecordNotFound.
    for i in 0..40 {
        let _: String =
            redis::cmd("XADD").arg(STREAM).arg("*").arg("job_id").arg(format!("gone-{i}")).query(&mut conn).unwrap();
    }
    let setup_handler = async { (handle_with(file_jobs(&server).await), ()) };
    let (stats, _, ()) = run_worker(&server, config(), setup_handler, Duration::from_millis(800));
    assert_eq!(stats.terminal, 40);

    let policy = wait_for("terminalAcks in status", Duration::from_secs(30), || {
        let p = get_policy(&ns, "files");
        let acks = p["status"]["terminalAcks"].clone();
        let count = |reason: &str| {
            acks.as_array().and_then(|a| a.iter().find(|x| x["reason"] == reason)).map(|x| x["count"].clone())
        };
        if count("RecordNotFound").is_some() && count("MaxDeliveriesExceeded").is_some() {
            Ok(p)
        } else {
            Err(acks.to_string())
        }
    });
    let yaml = kubectl_ok(&["get", "cgp", "files", "-n", &ns, "-o", "yaml"]);
    assert!(yaml.contains("reason: RecordNotFound"), "{yaml}");
    let acks = policy["status"]["terminalAcks"].clone();
    assert_eq!(
        acks,
        serde_json::json!([{"reason": "MaxDeliveriesExceeded", "count": 2}, {"reason": "RecordNotFound", "count": 40}])
    );
    let record_not_found = 40;
    let metrics = operator.metrics();
    let line = format!(
        r#"pelican_terminal_acks_total{{namespace="{ns}",policy="files",stream="{STREAM}",group="{GROUP}",reason="RecordNotFound"}} {record_not_found}"#
    );
    assert!(metrics.lines().any(|l| l == line), "missing {line}\n{metrics}");
}

/// Defect: the worker read its own PEL only at start, so an entry the operator reassigned to it (strategy
/// Reassign) while it ran was never handled.
fn entries_reassigned_to_a_running_worker_are_handled(flavor: Flavor) {
    let server = Server::start(flavor);
    let ids = setup(&server, &["job-1"]);
    let mut conn = server.conn();
    read_new(&mut conn, STREAM, GROUP, "crashed", 1);
    let handled = Arc::new(Mutex::new(Vec::new()));
    let seen = handled.clone();
    let handler = move |m: Message| {
        seen.lock().unwrap().push(m.id.clone());
        ready(Ok(Outcome::Done))
    };
    let reassign = {
        let url = server.url();
        let id = ids[0].clone();
        async move {
            // Once the worker is running, hand it the entry as the operator's Reassign does.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let mut c = redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap();
            let _: redis::Value = redis::cmd("XCLAIM")
                .arg(STREAM)
                .arg(GROUP)
                .arg("worker-1")
                .arg(0)
                .arg(&id)
                .arg("RETRYCOUNT")
                .arg(2)
                .arg("JUSTID")
                .query_async(&mut c)
                .await
                .unwrap();
        }
    };
    let setup_handler = async move {
        tokio::spawn(reassign);
        (handler, ())
    };
    let (stats, logs, ()) = run_worker(&server, config(), setup_handler, Duration::from_millis(2500));
    assert_eq!(*handled.lock().unwrap(), ids, "{logs}");
    assert_eq!(stats.done, 1);
    assert!(pel(&mut conn, STREAM, GROUP).is_empty());
}

/// A handler error leaves the message pending, and the running worker never reads it again, whatever its PEL checks:
/// each read would be a delivery that resets the entry's idle time, so the operator's pass, which spaces and caps the
/// retries, would never take it (it did, every `pel_check_interval`). The entry stays pending with one delivery.
fn a_failed_message_is_left_pending_for_the_operator_not_read_again(flavor: Flavor) {
    let server = Server::start(flavor);
    setup(&server, &["job-1", "job-2"]);
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let seen = attempts.clone();
    let handler = move |m: Message| {
        seen.lock().unwrap().push(m.field_str("job_id").unwrap().to_string());
        ready(if m.field_str("job_id") == Some("job-1") { Err("flaky".into()) } else { Ok(Outcome::Done) })
    };
    let (stats, logs, ()) = run_worker(&server, config(), async move { (handler, ()) }, Duration::from_millis(2000));
    let attempts = attempts.lock().unwrap().clone();
    assert_eq!(attempts.iter().filter(|j| *j == "job-1").count(), 1, "{attempts:?} {logs}");
    assert_eq!(attempts.iter().filter(|j| *j == "job-2").count(), 1, "a message done is not read again");
    assert_eq!((stats.done, stats.failed), (1, 1));
    let pending = pel(&mut server.conn(), STREAM, GROUP);
    assert_eq!(pending.len(), 1, "{pending:?}");
    assert_eq!(pending[0].3, 1, "one delivery: {pending:?}");
}

/// Defect: a count field holding no integer made the terminal script fail after its XACK, and the SDK logged
/// "stays pending" for a message that was acknowledged. Counting cannot fail now, and the entry is counted.
fn a_counter_field_holding_no_integer_still_counts_the_terminal_ack(flavor: Flavor) {
    let server = Server::start(flavor);
    setup(&server, &["job-1"]);
    let mut conn = server.conn();
    let key = pelican::keys::terminal_key(STREAM, GROUP);
    let _: () = redis::cmd("HSET").arg(&key).arg("RecordNotFound").arg("garbage").query(&mut conn).unwrap();
    let handler = |_m: Message| ready(Ok(Outcome::terminal("RecordNotFound")));
    let (stats, logs, ()) = run_worker(&server, config(), async move { (handler, ()) }, Duration::from_millis(1000));
    assert_eq!((stats.terminal, stats.failed), (1, 0), "{logs}");
    assert!(!logs.contains("stays pending"), "{logs}");
    assert!(pel(&mut conn, STREAM, GROUP).is_empty());
    assert_eq!(terminal_count(&mut conn, "RecordNotFound"), 1);
}

const SETTINGS: &str = "{files}:pelican:files:converters:settings";

/// Publishes the group's settings as the operator does (`contractVersion` as given).
fn publish_settings(conn: &mut redis::Connection, min_idle_ms: u64, version: &str) {
    let _: () = redis::cmd("HSET")
        .arg(SETTINGS)
        .arg("minIdleMs")
        .arg(min_idle_ms)
        .arg("retryAfterMs")
        .arg(min_idle_ms)
        .arg("maxDeliveries")
        .arg(3)
        .arg("contractVersion")
        .arg(version)
        .query(conn)
        .unwrap();
}

/// Defect (issue 65.2): a worker started before its policy (no settings yet) met `contractVersion: 2` first at a lease
/// tick, logged once and went on handling every message (3 of 3). It now shuts down as on SIGTERM (what it holds
/// finishes or is given back) and `run` answers the unknown version; nothing is handled after it.
fn a_contract_version_met_while_running_shuts_the_worker_down(flavor: Flavor) {
    let server = Server::start(flavor);
    setup(&server, &[]);
    let mut conn = server.conn();
    let handled = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = handled.clone();
    let url = server.url();
    let result: Result<WorkerStats, ContractStop> = runtime().block_on(async move {
        let client = redis::Client::open(url.clone()).unwrap();
        let worker = Worker::connect(&client, config()).await.unwrap();
        let handler = move |m: Message| {
            seen.lock().unwrap().push(m.id.clone());
            ready(Ok(Outcome::Done))
        };
        let operator = async move {
            // The worker reads with no settings (it leases every second); then the operator speaks contract 2 and
            // messages arrive.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let mut c = redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap();
            let _: () =
                redis::cmd("HSET").arg(SETTINGS).arg("contractVersion").arg("2").query_async(&mut c).await.unwrap();
            for n in 0..3 {
                tokio::time::sleep(Duration::from_millis(700)).await;
                let _: String =
                    redis::cmd("XADD").arg(STREAM).arg("*").arg("n").arg(n).query_async(&mut c).await.unwrap();
            }
        };
        let run = worker.run(handler, tokio::time::sleep(Duration::from_secs(20)));
        let (result, ()) = tokio::time::timeout(Duration::from_secs(15), async { tokio::join!(run, operator) })
            .await
            .expect("the worker stopped by itself well before its shutdown signal (20 s)");
        result
    });
    let stopped = result.expect_err("run answers the unknown contract");
    assert!(stopped.to_string().contains("contract \"2\""), "{stopped}");
    // At most what it read before its tick saw the version (the first message, read within the same second).
    let handled = handled.lock().unwrap().clone();
    assert!(handled.len() <= 1, "handled under an unknown contract: {handled:?}");
    let unread: usize = xrange(&mut conn, STREAM).len() - handled.len();
    assert!(unread >= 2, "messages were left for a worker that knows the contract");
    assert!(pel(&mut conn, STREAM, GROUP).iter().all(|p| p.1.is_empty()), "nothing left leased to the worker");
}

/// Defect (issue 65.3): the version was checked only when every other settings field parsed: with `maxDeliveries`
/// absent the worker started and handled. And `2.0` read as 1.
fn the_contract_version_is_checked_before_the_other_settings(flavor: Flavor) {
    let server = Server::start(flavor);
    setup(&server, &["job-1"]);
    let mut conn = server.conn();
    for (fields, version) in [
        (&["minIdleMs", "5000"][..], "2"),
        (&["minIdleMs", "5000", "retryAfterMs", "5000", "maxDeliveries", "3"][..], "2.0"),
    ] {
        let _: i64 = redis::cmd("DEL").arg(SETTINGS).query(&mut conn).unwrap();
        let _: () =
            redis::cmd("HSET").arg(SETTINGS).arg(fields).arg("contractVersion").arg(version).query(&mut conn).unwrap();
        let refused = runtime().block_on(async {
            let client = redis::Client::open(server.url()).unwrap();
            Worker::connect(&client, config()).await.err()
        });
        let refused = refused.unwrap_or_else(|| panic!("started under contractVersion {version:?} with {fields:?}"));
        assert!(refused.to_string().contains(&format!("contract {version:?}")), "{refused}");
    }
}

/// Defect (issue 65.6): `block` 0 became `BLOCK 0`, a read that waits for ever on the server while the client gives
/// up after its timeout: entries delivered to reads nobody awaits waited for the operator's pass.
fn a_block_of_zero_is_refused_when_the_worker_is_built(flavor: Flavor) {
    let server = Server::start(flavor);
    setup(&server, &[]);
    let refused = runtime().block_on(async {
        let client = redis::Client::open(server.url()).unwrap();
        Worker::connect(&client, WorkerConfig { block: Duration::ZERO, ..config() }).await.err()
    });
    let refused = refused.expect("a worker with block 0 was built");
    assert!(refused.to_string().contains("WorkerConfig.block must be at least 1 ms"), "{refused}");
}

/// Defect (issue 65.8): without its group the worker logged a WARN and sent an `XREADGROUP` every 500 ms (12 reads,
/// 13 warnings in 6 s). The contract: wait 1 s, then doubling up to 10 s, say so once, and go on once it exists.
fn a_missing_group_is_waited_out_and_said_once(flavor: Flavor) {
    let server = Server::start(flavor);
    let url = server.url();
    let handled = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = handled.clone();
    let setup_handler = async move {
        tokio::spawn(async move {
            // The operator creates the group 4 s later, and a message arrives.
            tokio::time::sleep(Duration::from_secs(4)).await;
            let mut c = redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap();
            let _: () = redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(STREAM)
                .arg(GROUP)
                .arg("0")
                .arg("MKSTREAM")
                .query_async(&mut c)
                .await
                .unwrap();
            let _: String = redis::cmd("XADD").arg(STREAM).arg("*").arg("n").arg(1).query_async(&mut c).await.unwrap();
        });
        let handler = move |m: Message| {
            seen.lock().unwrap().push(m.id.clone());
            ready(Ok(Outcome::Done))
        };
        (handler, ())
    };
    let mut stats_conn = server.conn();
    let before: String = redis::cmd("INFO").arg("commandstats").query(&mut stats_conn).unwrap();
    let (stats, logs, ()) = run_worker(&server, config(), setup_handler, Duration::from_secs(12));
    let after: String = redis::cmd("INFO").arg("commandstats").query(&mut stats_conn).unwrap();
    let reads = |info: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix("cmdstat_xreadgroup:calls="))
            .and_then(|rest| rest.split(',').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let failed_reads = |info: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix("cmdstat_xreadgroup:"))
            .and_then(|rest| rest.split(',').find_map(|kv| kv.strip_prefix("failed_calls="))?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert_eq!(stats.done, 1, "handled once the group exists\n{logs}");
    let warnings = logs.lines().filter(|l| l.contains("the group does not exist yet")).count();
    assert_eq!(warnings, 1, "said once\n{logs}");
    assert!(!logs.contains("read failed"), "NOGROUP is no read failure\n{logs}");
    // 4 s without the group: reads at 0, 1, 3 s (waits of 1, 2, 4 s), not 8 of them.
    let missed = failed_reads(&after) - failed_reads(&before);
    assert!(
        (2..=4).contains(&missed),
        "{missed} reads refused with NOGROUP (of {} reads)",
        reads(&after) - reads(&before)
    );
}

/// Issue 65.12: the worker's heartbeat, which `Reassign` hands entries over on, is written at every lease tick, also
/// while nothing is in flight.
fn an_idle_worker_beats_its_heart_at_every_lease_tick(flavor: Flavor) {
    let server = Server::start(flavor);
    setup(&server, &[]);
    let mut conn = server.conn();
    publish_settings(&mut conn, 600, "1");
    let url = server.url();
    let beats = Arc::new(Mutex::new(Vec::<u64>::new()));
    let seen = beats.clone();
    let setup_handler = async move {
        tokio::spawn(async move {
            let mut c = redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap();
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let beat: Option<u64> = redis::cmd("HGET")
                    .arg("{files}:pelican:files:converters:consumers")
                    .arg("worker-1")
                    .query_async(&mut c)
                    .await
                    .unwrap();
                seen.lock().unwrap().extend(beat);
            }
        });
        (|_: Message| ready(Ok(Outcome::Done)), ())
    };
    let (_, logs, ()) = run_worker(&server, config(), setup_handler, Duration::from_millis(2300));
    let mut beats = beats.lock().unwrap().clone();
    beats.dedup();
    // minIdle 600 ms: a tick every 200 ms, so 2 s of samples see several distinct beats.
    assert!(beats.len() >= 4, "heartbeats seen: {beats:?}\n{logs}");
}

/// Issue 65.8 and 65.11: the Rust worker's counts were known only once `run` returned, and it exported no metrics;
/// an exporter reads them while it runs, under the libraries' one schema.
fn live_stats_show_what_a_running_worker_does(flavor: Flavor) {
    let server = Server::start(flavor);
    setup(&server, &["job-1", "job-2"]);
    let (seen, stats, scrape) = runtime().block_on(async {
        let client = redis::Client::open(server.url()).unwrap();
        let worker = Worker::connect(&client, config()).await.unwrap();
        let live = worker.live_stats();
        let mut registry = prometheus_client::registry::Registry::default();
        pelican::worker::metrics::register(&mut registry, &worker);
        let handler = |m: Message| async move {
            tokio::time::sleep(Duration::from_millis(if m.field_str("job_id") == Some("job-1") { 100 } else { 1500 }))
                .await;
            Ok(Outcome::Done)
        };
        let watch = async {
            let mut seen = Vec::new();
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                seen.push((live.snapshot().done, live.in_flight()));
            }
            seen
        };
        let (stats, seen) = tokio::join!(worker.run(handler, tokio::time::sleep(Duration::from_secs(3))), watch);
        let mut scrape = String::new();
        prometheus_client::encoding::text::encode(&mut scrape, &registry).unwrap();
        (seen, stats.unwrap(), scrape)
    });
    assert!(seen.contains(&(1, 1)), "one done, one in flight, while it ran: {seen:?}");
    assert_eq!(stats.done, 2);
    // The schema every library exports (contract/README.md, "Stats").
    let series = |name: &str, labels: &str| format!("{name}{{stream=\"{STREAM}\",group=\"{GROUP}\"{labels}}}");
    for (outcome, count) in [("done", 2), ("terminal", 0), ("failed", 0), ("retried", 0), ("abandoned", 0)] {
        let line = format!("{} {count}", series("pelican_worker_messages_total", &format!(",outcome=\"{outcome}\"")));
        assert!(scrape.lines().any(|l| l == line), "missing {line}\n{scrape}");
    }
    let line = format!("{} 0", series("pelican_worker_in_flight", ""));
    assert!(scrape.lines().any(|l| l == line), "missing {line}\n{scrape}");
}

/// A handler that waits goes on in a task of its own: handlers that compute after their first `.await` (here they
/// block their thread for a while) run at once on the runtime's threads, not one after the other in the read loop's
/// task. The most seen computing at the same time is what a user sees (four messages take one handler's time).
fn handlers_that_wait_run_in_parallel_on_the_runtimes_threads(flavor: Flavor) {
    let server = Server::start(flavor);
    setup(&server, &["job-1", "job-2", "job-3", "job-4"]);
    let computing = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
    let stats = runtime.block_on(async {
        let client = redis::Client::open(server.url()).unwrap();
        let config = WorkerConfig { concurrency: 4, ..config() };
        let worker = Worker::connect(&client, config).await.unwrap();
        let (computing, most) = (computing.clone(), most.clone());
        let handler = move |_: Message| {
            let (computing, most) = (computing.clone(), most.clone());
            async move {
                tokio::task::yield_now().await;
                most.fetch_max(computing.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(500));
                computing.fetch_sub(1, Ordering::SeqCst);
                Ok(Outcome::Done)
            }
        };
        worker.run(handler, tokio::time::sleep(Duration::from_secs(3))).await.unwrap()
    });
    assert_eq!(stats.done, 4);
    assert!(most.load(Ordering::SeqCst) >= 2, "the handlers computed one after the other: {stats:?}");
}

/// Defect (issue 65, found by the conformance fault ledger): a fault that broke the writer's connection made the
/// first outcome written after it fail ("broken pipe": XACK or terminal ACK outcome unknown), the entry stayed
/// pending, and the worker's own-PEL check took it up and ran it again. Each handler here kills every connection of
/// the worker just before it returns its outcome: each outcome is written all the same, once, and nothing runs twice.
fn outcomes_met_by_killed_connections_are_written_once_and_never_run_again(flavor: Flavor) {
    let server = Server::start(flavor);
    setup(&server, &["done", "gone", "flaky"]);
    let url = server.url();
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let seen = attempts.clone();
    let setup_handler = async move {
        let admin = redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap();
        let handler = move |m: Message| {
            let (mut admin, seen) = (admin.clone(), seen.clone());
            Box::pin(async move {
                let job = m.field_str("job_id").unwrap().to_string();
                seen.lock().unwrap().push(job.clone());
                let _: i64 = redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("TYPE")
                    .arg("normal")
                    .arg("SKIPME")
                    .arg("yes")
                    .query_async(&mut admin)
                    .await
                    .unwrap();
                match job.as_str() {
                    "done" => Ok(Outcome::Done),
                    "gone" => Ok(Outcome::terminal("RecordNotFound")),
                    _ => Err("flaky".into()),
                }
            }) as BoxedOutcome
        };
        (handler, ())
    };
    let (stats, logs, ()) = run_worker(&server, config(), setup_handler, Duration::from_millis(3000));
    let mut attempts = attempts.lock().unwrap().clone();
    attempts.sort();
    assert_eq!(attempts, ["done", "flaky", "gone"], "each handled once\n{logs}");
    assert_eq!((stats.done, stats.terminal, stats.failed), (1, 1, 1), "{logs}");
    let mut conn = server.conn();
    let pending = pel(&mut conn, STREAM, GROUP);
    assert_eq!(pending.len(), 1, "only the failed message stays pending: {pending:?}");
    assert_eq!(terminal_count(&mut conn, "RecordNotFound"), 1);
    let errors: Vec<String> =
        redis::cmd("HVALS").arg("{files}:pelican:files:converters:errors").query(&mut conn).unwrap();
    assert_eq!(errors, ["flaky"], "the failure's last error is recorded");
    assert!(!logs.contains("outcome unknown"), "{logs}");
}

/// Defect (issue 65, all five libraries): a lease sent while a handler ran, answered only after the handler failed (a
/// paused server), reset the entry's idle time after the failure; the own-PEL check then took the entry for a
/// hand-over back to this worker and ran it again at once. Here the handler pauses the server's writes for 2 s (the
/// lease ticks every 200 ms, so one waits behind the pause) and fails 300 ms in.
fn a_failure_whose_lease_reply_came_late_is_not_run_again(flavor: Flavor) {
    let server = Server::start(flavor);
    setup(&server, &["flaky"]);
    publish_settings(&mut server.conn(), 600, "1");
    let url = server.url();
    let attempts = Arc::new(Mutex::new(0));
    let seen = attempts.clone();
    let setup_handler = async move {
        let admin = redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap();
        let handler = move |_: Message| {
            let (mut admin, seen) = (admin.clone(), seen.clone());
            Box::pin(async move {
                *seen.lock().unwrap() += 1;
                let _: () =
                    redis::cmd("CLIENT").arg("PAUSE").arg(2000).arg("WRITE").query_async(&mut admin).await.unwrap();
                tokio::time::sleep(Duration::from_millis(300)).await;
                Err("flaky".into())
            }) as BoxedOutcome
        };
        (handler, ())
    };
    let (stats, logs, ()) = run_worker(&server, config(), setup_handler, Duration::from_millis(4500));
    assert_eq!(*attempts.lock().unwrap(), 1, "run once: nobody handed it back\n{logs}");
    assert_eq!((stats.done, stats.failed), (0, 1), "{logs}");
    let pending = pel(&mut server.conn(), STREAM, GROUP);
    assert_eq!(pending.len(), 1, "left pending for the operator: {pending:?}");
}
