//! What one call of each Pelican job costs the server at the data sizes of issue 57, beside the data size: the
//! longest single command the server ran for the job, against the one unbounded command a person would otherwise
//! send for the same work, in the same run, on Redis 7.0 and Valkey 9.1 (a server of the bed's
//! `PELICAN_REDIS_SERVER` and one of its `PELICAN_VALKEY_SERVER`, each started for the run on a free port and
//! stopped after it: the slow log is reconfigured and hundreds of megabytes written, which the bed's shared servers
//! are spared).
//!
//! Each job is Pelican's own library call, run to its end (every call of a pass, a seek, a trim, a redrive, a
//! destroy):
//! - Reassign, a seek dry run with `consumersIdleFor`, consumer expiry and `consumers.pods` on a group of 300,000
//!   consumers (32 due entries for Reassign), against `XINFO CONSUMERS` of the group;
//! - Requeue of 1,000 pending entries of 3,900 one-byte fields, against one `XAUTOCLAIM ... COUNT 256` (a page of
//!   the pass's size, claimed with its entries);
//! - a redrive (its snapshot and steps of 128) of 1,000 dead letters of 3,990 empty fields, against one `XRANGE ...
//!   COUNT 128` (the read half of a hand-written redrive's batch);
//! - a seek dry run whose target lies behind 300 entries of 1 MB (it counts them), and the redrive snapshot with a
//!   reason filter over the same 300 dead letters of 1 MB, against one `XRANGE ... COUNT 256` of them;
//! - the retention trim of an acknowledged backlog of 1,000,000 entries (100-byte body), against one `XTRIM MINID`
//!   of the whole backlog;
//! - the destroy of a group of 300,000 consumers and a 300,000-entry PEL, against one `XGROUP DESTROY`: once with
//!   every consumer owning one pending entry, once with the consumers owning none beside a PEL of one consumer.
//!
//! A command's duration is the server's own (`SLOWLOG` with `slowlog-log-slower-than 0` and `slowlog-max-len`
//! 1,000,000, reset before the job and off while data is built), not the round trip. A script call's entry is the
//! whole `EVALSHA`, the commands it ran included; both servers also log those commands one by one (inside the
//! call's time, so never the longest), and the longest calls were the same with a threshold of 3 ms, which logs
//! none of them: logging them does not inflate the script's time.
//!
//!   scripts/testenv up && cargo bench --bench call_cost [-- <scale>]   (default 1: the sizes above; 0.1: a tenth)
//!
//! Prints one line per job and server: the data size, Pelican's longest call and which command it was, the baseline
//! command and its duration, what the job did; ends with one `SUMMARY call_cost` line per row (ratio: Pelican's
//! longest call over the baseline).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pelican::api::{PendingHandling, ReclaimStrategy};
use pelican::jobs::redrive::{Destination, Plan, Progress, snapshot, step};
use pelican::jobs::seek::{self, Outcome, Seek, Target as SeekTarget};
use pelican::jobs::{self, Cursor, PassSettings};
use pelican::keys::{redrive_key, redrive_lock_key};
use pelican::redis::{Conn, Destroyed, GroupKeys, Pools, ServerInfo, Target};
use redis::aio::MultiplexedConnection;
use support::{bed_var, deliver_all, fill_stream};

mod support;

const GROUP: &str = "g";
/// Where the redrives write.
const REDRIVEN: &str = "{cost}:redriven";
/// The idle time after which the reclaim takes an entry.
const MIN_IDLE: Duration = Duration::from_millis(100);

/// A private server for the run, with a Pelican connection (what the jobs use) and a plain one without a response
/// timeout (data, the slow log and the baselines, some of which take longer than a client waits by default).
struct Server {
    label: String,
    address: String,
    child: Child,
    _dir: tempfile::TempDir,
    conn: Conn,
    raw: MultiplexedConnection,
}

impl Server {
    async fn start(binary_var: &str) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new(bed_var(binary_var))
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("start {binary_var}: {e}"));
        let url = format!("redis://127.0.0.1:{port}/0");
        let client = redis::Client::open(&url[..]).unwrap();
        let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
        let started = Instant::now();
        let mut raw = loop {
            match client.get_multiplexed_async_connection_with_config(&config).await {
                Ok(raw) => break raw,
                Err(e) => assert!(started.elapsed() < Duration::from_secs(10), "{binary_var} did not start: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let info: String = redis::cmd("INFO").arg("server").query_async(&mut raw).await.unwrap();
        let _: () = config_set(&mut raw, "slowlog-max-len", "1000000").await;
        let _: () = config_set(&mut raw, "slowlog-log-slower-than", "-1").await;
        let target = Target::new(&url);
        let conn = Pools::default().get(&target).await.unwrap();
        let label = ServerInfo::parse(&info).to_string();
        Server { label, address: target.server(), child, _dir: dir, conn, raw }
    }

    /// A line of the table for this server: `job` on data of `size`, its longest command beside the baseline's.
    fn row(
        &self,
        job: &'static str,
        size: &str,
        pelican: Longest,
        outcome: String,
        baseline: &'static str,
        reference: Longest,
    ) -> Row {
        Row { server: self.label.clone(), job, size: size.to_string(), pelican, outcome, baseline, reference }
    }

    /// Runs `job` with every command the server runs meanwhile in the slow log; its longest command.
    async fn measure<T>(&mut self, job: impl AsyncFnOnce(&mut Conn, &str) -> T) -> (T, Longest) {
        slowlog_on(&mut self.raw).await;
        let done = job(&mut self.conn, &self.address).await;
        (done, slowlog_off(&mut self.raw).await)
    }

    /// The baseline: one command, sent on its own.
    async fn baseline(&mut self, command: &redis::Cmd) -> Longest {
        slowlog_on(&mut self.raw).await;
        let _: redis::Value = command.query_async(&mut self.raw).await.unwrap();
        slowlog_off(&mut self.raw).await
    }

    async fn del(&mut self, keys: &[&str]) {
        let _: () = redis::cmd("DEL").arg(keys).query_async(&mut self.raw).await.unwrap();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn config_set(raw: &mut MultiplexedConnection, name: &str, value: &str) {
    let _: () = redis::cmd("CONFIG").arg("SET").arg(name).arg(value).query_async(raw).await.unwrap();
}

async fn slowlog_on(raw: &mut MultiplexedConnection) {
    config_set(raw, "slowlog-log-slower-than", "0").await;
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query_async(raw).await.unwrap();
}

/// The longest command of a job, by the server's slow log.
#[derive(Clone, Debug, Default)]
struct Longest {
    micros: i64,
    /// Its name (`EVALSHA`, `XRANGE`, ...).
    command: String,
}

impl Longest {
    fn ms(&self) -> f64 {
        self.micros as f64 / 1000.0
    }
}

/// Reads the slow log since [`slowlog_on`] and stops logging (the bench's own `SLOWLOG` and `CONFIG` left out).
async fn slowlog_off(raw: &mut MultiplexedConnection) -> Longest {
    let entries: Vec<Vec<redis::Value>> = redis::cmd("SLOWLOG").arg("GET").arg(-1).query_async(raw).await.unwrap();
    config_set(raw, "slowlog-log-slower-than", "-1").await;
    let mut longest = Longest::default();
    for entry in &entries {
        let name = match &entry[3] {
            redis::Value::Array(command) => match command.first() {
                Some(redis::Value::BulkString(name)) => String::from_utf8_lossy(name).to_uppercase(),
                _ => continue,
            },
            _ => continue,
        };
        if name == "SLOWLOG" || name == "CONFIG" {
            continue;
        }
        let micros: i64 = redis::from_redis_value(entry[2].clone()).unwrap();
        if micros > longest.micros {
            longest.micros = micros;
            longest.command = name;
        }
    }
    longest
}

/// One line of the table.
struct Row {
    server: String,
    job: &'static str,
    size: String,
    pelican: Longest,
    /// What the job said (a refusal, counts).
    outcome: String,
    baseline: &'static str,
    reference: Longest,
}

impl Row {
    fn print(&self) {
        println!(
            "{:<13} {:<31} {:<46} {:>9.2} {:<8}  {:<29} {:>9.2}  {}",
            self.server,
            self.job,
            self.size,
            self.pelican.ms(),
            self.pelican.command,
            self.baseline,
            self.reference.ms(),
            self.outcome
        );
    }

    fn summary(&self) -> String {
        format!(
            "SUMMARY call_cost server={:?} job={:?} size={:?} pelican_longest_ms={:.2} baseline={:?} baseline_ms={:.2} \
             ratio={:.3}",
            self.server,
            self.job,
            self.size,
            self.pelican.ms(),
            self.baseline,
            self.reference.ms(),
            self.pelican.micros as f64 / self.reference.micros.max(1) as f64
        )
    }
}

/// `row` printed as it is measured and kept for the summary.
fn record(rows: &mut Vec<Row>, row: Row) {
    row.print();
    rows.push(row);
}

fn header() {
    println!(
        "{:<13} {:<31} {:<46} {:>9} {:<8}  {:<29} {:>9}  outcome",
        "server", "job", "data size", "worst ms", "command", "baseline command", "ms"
    );
}

/// The sizes of issue 57, times the scale.
struct Sizes {
    consumers: usize,
    field_entries: usize,
    large_entries: usize,
    backlog: usize,
    group: usize,
}

impl Sizes {
    fn scaled(scale: f64) -> Sizes {
        let n = |full: usize, least: usize| ((full as f64 * scale).round() as usize).max(least);
        Sizes {
            consumers: n(300_000, 1),
            field_entries: n(1_000, 1),
            large_entries: n(300, 2),
            backlog: n(1_000_000, 1),
            group: n(300_000, 1),
        }
    }
}

fn time_it(what: &str, started: Instant) {
    eprintln!("  built {what} in {:.1} s", started.elapsed().as_secs_f64());
}

/// An entry's fields as `XADD` arguments.
fn xadd(pipe: &mut redis::Pipeline, stream: &str, fields: &[(&[u8], &[u8])]) {
    let cmd = pipe.cmd("XADD").arg(stream).arg("*");
    for (name, value) in fields {
        cmd.arg(*name).arg(*value);
    }
    cmd.ignore();
}

/// A dead letter's metadata, as the reclaim writes it.
fn dead_letter_fields(source: &str) -> Vec<(&[u8], &[u8])> {
    vec![
        (b"pelican-source-stream".as_slice(), source.as_bytes()),
        (b"pelican-source-id", b"1-1"),
        (b"pelican-origin-id", b"1-1"),
        (b"pelican-group", b"workers"),
        (b"pelican-consumer", b"worker-1"),
        (b"pelican-deliveries", b"3"),
        (b"pelican-reason", b"MaxDeliveriesExceeded"),
        (b"pelican-dead-lettered-at", b"1"),
    ]
}

fn pass_settings(strategy: ReclaimStrategy) -> PassSettings {
    PassSettings {
        min_idle: MIN_IDLE,
        max_per_pass: 1000,
        max_deliveries: 10,
        strategy,
        dead_letter_max_len: None,
        backoff: None,
        handover_grace: Duration::ZERO,
        slice: Duration::from_secs(10),
    }
}

fn redrive_plan(dead_letter: &str, reasons: Vec<String>) -> Plan {
    Plan {
        dead_letter: dead_letter.into(),
        progress_key: redrive_key(dead_letter, "bench", "r"),
        lock_key: redrive_lock_key(dead_letter),
        full_name: "bench/r".into(),
        uid: "bench-uid".into(),
        name: "r".into(),
        target: Destination::Stream(REDRIVEN.into()),
        reasons,
        from: None,
        to: None,
        max_messages: None,
        cluster: false,
        keys: None,
    }
}

fn dry_run(name: &str, target: SeekTarget, idle_ms: u64) -> Seek {
    Seek {
        name: format!("bench/{name}"),
        uid: format!("uid-{name}"),
        target,
        pending: PendingHandling::Keep,
        idle_ms,
        dry_run: true,
        dead_letter_max_len: None,
    }
}

fn said(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Done(moved) => format!("planned: redelivers {}", moved.redelivered),
        Outcome::Finished { .. } => "finished before".into(),
        Outcome::Refused { reason, .. } => format!("refused {reason}"),
    }
}

fn xinfo_consumers(stream: &str) -> redis::Cmd {
    let mut cmd = redis::cmd("XINFO");
    cmd.arg("CONSUMERS").arg(stream).arg(GROUP);
    cmd
}

fn xrange(stream: &str, count: usize) -> redis::Cmd {
    let mut cmd = redis::cmd("XRANGE");
    cmd.arg(stream).arg("-").arg("+").arg("COUNT").arg(count);
    cmd
}

/// Jobs on a group of many consumers: Reassign, a seek's active-consumer check, expiry, `consumers.pods`.
async fn many_consumers(server: &mut Server, count: usize, rows: &mut Vec<Row>) {
    const STREAM: &str = "{cost}:consumers";
    let keys = GroupKeys { stream: STREAM, group: GROUP, dead_letter: "{cost}:consumers-dlq" };
    let started = Instant::now();
    let raw = &mut server.raw;
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(STREAM)
        .arg(GROUP)
        .arg("$")
        .arg("MKSTREAM")
        .query_async(raw)
        .await
        .unwrap();
    let mut pipe = redis::pipe();
    for n in 0..32 {
        xadd(&mut pipe, STREAM, &[(b"n", n.to_string().as_bytes())]);
    }
    let _: () = pipe.query_async(raw).await.unwrap();
    deliver_to(raw, STREAM, "worker-0", 32).await;
    for start in (0..count).step_by(10_000) {
        let mut pipe = redis::pipe();
        for n in start..(start + 10_000).min(count) {
            pipe.cmd("XGROUP").arg("CREATECONSUMER").arg(STREAM).arg(GROUP).arg(format!("worker-{}", n + 1)).ignore();
        }
        let _: () = pipe.query_async(raw).await.unwrap();
    }
    time_it(&format!("{count} consumers"), started);
    tokio::time::sleep(MIN_IDLE * 2).await;
    let size = format!("{} consumers", count + 1);
    let baseline = "XINFO CONSUMERS (all)";

    let seek = dry_run("idle-check", SeekTarget::Earliest, 30_000);
    let (outcome, pelican) = server.measure(async |conn, at| seek::run(conn, at, &keys, &seek, || true).await).await;
    let reference = server.baseline(&xinfo_consumers(STREAM)).await;
    let outcome = said(&outcome.unwrap());
    record(rows, server.row("seek dry run, consumersIdleFor", &size, pelican, outcome, baseline, reference));

    let (expired, pelican) =
        server.measure(async |conn, at| jobs::expire_consumers(conn, at, &keys, Duration::ZERO).await).await;
    let reference = server.baseline(&xinfo_consumers(STREAM)).await;
    let outcome = expired.map_or_else(|e| format!("failed {}", e.reason()), |n| format!("expired {n}"));
    record(rows, server.row("consumer expiry", &size, pelican, outcome, baseline, reference));

    let (listed, pelican) = server.measure(async |conn, at| jobs::consumers(conn, at, &keys).await).await;
    let reference = server.baseline(&xinfo_consumers(STREAM)).await;
    let outcome = listed.map_or_else(|e| format!("failed {}", e.reason()), |c| format!("listed {}", c.len()));
    record(rows, server.row("consumers.pods (listing)", &size, pelican, outcome, baseline, reference));

    let settings = pass_settings(ReclaimStrategy::Reassign);
    let (report, pelican) = server
        .measure(async |conn, at| {
            jobs::reclaim_pass(conn, at, &keys, &settings, &mut Cursor::default(), &|| true).await.unwrap()
        })
        .await;
    let reference = server.baseline(&xinfo_consumers(STREAM)).await;
    let outcome = format!(
        "requeued {} reassigned {} (consumers unlisted: {})",
        report.requeued, report.reassigned, report.consumers_unlisted
    );
    record(
        rows,
        server.row("reclaim Reassign, 32 due", &format!("{size}, 32 due"), pelican, outcome, baseline, reference),
    );
    server.del(&[STREAM]).await;
}

/// `count` new entries of `stream` delivered to `consumer` (one XREADGROUP).
async fn deliver_to(raw: &mut MultiplexedConnection, stream: &str, consumer: &str, count: usize) {
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(GROUP)
        .arg(consumer)
        .arg("COUNT")
        .arg(count)
        .arg("STREAMS")
        .arg(stream)
        .arg(">")
        .query_async(raw)
        .await
        .unwrap();
}

/// Requeue of pending entries of many one-byte fields.
async fn many_fields_requeued(server: &mut Server, count: usize, rows: &mut Vec<Row>) {
    const STREAM: &str = "{cost}:fields";
    let keys = GroupKeys { stream: STREAM, group: GROUP, dead_letter: "{cost}:fields-dlq" };
    let started = Instant::now();
    // 1,950 names and as many values, a byte each: 3,900 fields.
    let names: Vec<[u8; 1]> = (0..1950).map(|i| [b'a' + (i % 26) as u8]).collect();
    let fields: Vec<(&[u8], &[u8])> = names.iter().map(|name| (name.as_slice(), b"x".as_slice())).collect();
    for start in (0..count).step_by(50) {
        let mut pipe = redis::pipe();
        for _ in start..(start + 50).min(count) {
            xadd(&mut pipe, STREAM, &fields);
        }
        let _: () = pipe.query_async(&mut server.raw).await.unwrap();
    }
    let _: () =
        redis::cmd("XGROUP").arg("CREATE").arg(STREAM).arg(GROUP).arg("0").query_async(&mut server.raw).await.unwrap();
    deliver_all(&mut server.raw, STREAM, GROUP, count).await;
    time_it(&format!("{count} pending entries of 3,900 fields"), started);
    // The baseline first: it claims a page, and leaves it pending (to another consumer).
    let mut claim = redis::cmd("XAUTOCLAIM");
    claim.arg(STREAM).arg(GROUP).arg("claimer").arg(0).arg("0-0").arg("COUNT").arg(256);
    let reference = server.baseline(&claim).await;
    tokio::time::sleep(MIN_IDLE * 2).await;
    let settings = pass_settings(ReclaimStrategy::Requeue);
    let (requeued, pelican) = server
        .measure(async |conn, at| {
            let (mut requeued, mut cursor) = (0, Cursor::default());
            for _ in 0..count * 2 {
                requeued +=
                    jobs::reclaim_pass(conn, at, &keys, &settings, &mut cursor, &|| true).await.unwrap().requeued;
                if requeued >= count as u64 {
                    break;
                }
            }
            requeued
        })
        .await;
    assert_eq!(requeued, count as u64);
    record(
        rows,
        server.row(
            "reclaim Requeue",
            &format!("{count} pending x 3,900 1-byte fields"),
            pelican,
            format!("requeued {requeued}"),
            "XAUTOCLAIM COUNT 256",
            reference,
        ),
    );
    server.del(&[STREAM]).await;
}

/// Moves every dead letter of `plan` with steps of 128 (the operator's step without a rate); how many.
async fn redrive_all(conn: &mut Conn, at: &str, plan: &Plan) -> u64 {
    let until = snapshot(conn, at, plan).await.unwrap().until_id.unwrap();
    let mut progress = Progress::default();
    let mut destinations = Vec::new();
    loop {
        let done = step(conn, at, plan, &until, &progress, 128, &mut destinations).await.unwrap();
        progress.moved += done.moved;
        progress.last_id = done.last_id;
        if done.finished {
            return progress.moved;
        }
    }
}

/// A redrive of dead letters of many empty fields.
async fn many_fields_redriven(server: &mut Server, count: usize, rows: &mut Vec<Row>) {
    const DLQ: &str = "{cost}:dlq-fields";
    let started = Instant::now();
    // 1,995 empty names with empty values, then the metadata: 4,006 fields.
    let mut fields: Vec<(&[u8], &[u8])> = vec![(b"".as_slice(), b"".as_slice()); 1995];
    fields.extend(dead_letter_fields(REDRIVEN));
    for start in (0..count).step_by(50) {
        let mut pipe = redis::pipe();
        for _ in start..(start + 50).min(count) {
            xadd(&mut pipe, DLQ, &fields);
        }
        let _: () = pipe.query_async(&mut server.raw).await.unwrap();
    }
    time_it(&format!("{count} dead letters of 3,990 empty fields"), started);
    let reference = server.baseline(&xrange(DLQ, 128)).await;
    let plan = redrive_plan(DLQ, Vec::new());
    let (moved, pelican) = server.measure(async |conn, at| redrive_all(conn, at, &plan).await).await;
    assert_eq!(moved, count as u64);
    record(
        rows,
        server.row(
            "redrive (snapshot + steps)",
            &format!("{count} dead letters x 3,990 empty fields"),
            pelican,
            format!("moved {moved}"),
            "XRANGE COUNT 128",
            reference,
        ),
    );
    server.del(&[DLQ, REDRIVEN, &plan.progress_key]).await;
}

/// A seek that walks entries of 1 MB, and the redrive snapshot with a reason filter over dead letters of 1 MB.
async fn large_entries(server: &mut Server, count: usize, rows: &mut Vec<Row>) {
    const STREAM: &str = "{cost}:large";
    let started = Instant::now();
    let megabyte = vec![b'x'; 1 << 20];
    let mut fields: Vec<(&[u8], &[u8])> = vec![(b"body".as_slice(), megabyte.as_slice())];
    fields.extend(dead_letter_fields("{cost}:source"));
    for start in (0..count).step_by(16) {
        let mut pipe = redis::pipe();
        for _ in start..(start + 16).min(count) {
            xadd(&mut pipe, STREAM, &fields);
        }
        let _: () = pipe.query_async(&mut server.raw).await.unwrap();
    }
    let _: () =
        redis::cmd("XGROUP").arg("CREATE").arg(STREAM).arg(GROUP).arg("0").query_async(&mut server.raw).await.unwrap();
    let first_two: Vec<(String, redis::Value)> = redis::cmd("XRANGE")
        .arg(STREAM)
        .arg("-")
        .arg("+")
        .arg("COUNT")
        .arg(2)
        .query_async(&mut server.raw)
        .await
        .unwrap();
    time_it(&format!("{count} entries of 1 MB"), started);
    let size = format!("{count} entries of 1 MB");
    let page = count.min(256);
    let baseline = if page == 256 { "XRANGE COUNT 256" } else { "XRANGE COUNT <all>" };

    // The target is the second entry: the seek counts the entries after it, walking them.
    let keys = GroupKeys { stream: STREAM, group: GROUP, dead_letter: "{cost}:large-dlq" };
    let seek = dry_run("walk", SeekTarget::Id(first_two[1].0.clone()), 0);
    let (outcome, pelican) = server.measure(async |conn, at| seek::run(conn, at, &keys, &seek, || true).await).await;
    let reference = server.baseline(&xrange(STREAM, page)).await;
    let outcome = said(&outcome.unwrap());
    record(rows, server.row("seek dry run, walk", &size, pelican, outcome, baseline, reference));

    let plan = redrive_plan(STREAM, vec!["MaxDeliveriesExceeded".into()]);
    let (counted, pelican) = server.measure(async |conn, at| snapshot(conn, at, &plan).await.unwrap().to_move).await;
    assert_eq!(counted, count as u64);
    let reference = server.baseline(&xrange(STREAM, page)).await;
    record(
        rows,
        server.row(
            "redrive snapshot, reason filter",
            &format!("{count} dead letters of 1 MB"),
            pelican,
            format!("counted {counted}"),
            baseline,
            reference,
        ),
    );
    server.del(&[STREAM]).await;
}

/// A backlog of `count` entries the group read and acknowledged (group at the end, nothing pending); the first id
/// after the last entry.
async fn acknowledged_backlog(raw: &mut MultiplexedConnection, stream: &str, count: usize) -> String {
    fill_stream(raw, stream, GROUP, count, 100).await;
    let _: () = redis::cmd("XGROUP").arg("SETID").arg(stream).arg(GROUP).arg("$").query_async(raw).await.unwrap();
    let last: Vec<(String, redis::Value)> =
        redis::cmd("XREVRANGE").arg(stream).arg("+").arg("-").arg("COUNT").arg(1).query_async(raw).await.unwrap();
    let (ms, seq) = last[0].0.split_once('-').unwrap();
    format!("{ms}-{}", seq.parse::<u64>().unwrap() + 1)
}

/// The retention trim of an acknowledged backlog.
async fn backlog_trimmed(server: &mut Server, count: usize, rows: &mut Vec<Row>) {
    const STREAM: &str = "{cost}:backlog";
    let keys = GroupKeys { stream: STREAM, group: GROUP, dead_letter: "{cost}:backlog-dlq" };
    let started = Instant::now();
    acknowledged_backlog(&mut server.raw, STREAM, count).await;
    time_it(&format!("an acknowledged backlog of {count}"), started);
    let (trimmed, pelican) = server
        .measure(async |conn, at| {
            let mut trimmed = 0;
            // Each trim goes on for at most a second; the runner's next sweeps take the rest.
            while trimmed < count as u64 {
                let trim = jobs::trim_acknowledged(conn, at, &keys, Duration::ZERO, false).await.unwrap();
                assert!(trim.trimmed > 0, "the trim stopped at {trimmed}");
                trimmed += trim.trimmed;
            }
            trimmed
        })
        .await;
    assert_eq!(trimmed, count as u64);
    let started = Instant::now();
    let after_last = acknowledged_backlog(&mut server.raw, STREAM, count).await;
    time_it(&format!("an acknowledged backlog of {count} again"), started);
    let mut xtrim = redis::cmd("XTRIM");
    xtrim.arg(STREAM).arg("MINID").arg(&after_last);
    let reference = server.baseline(&xtrim).await;
    record(
        rows,
        server.row(
            "retention trim (Acknowledged)",
            &format!("{count} acknowledged entries"),
            pelican,
            format!("trimmed {trimmed}"),
            "XTRIM MINID (all of it)",
            reference,
        ),
    );
    server.del(&[STREAM]).await;
}

/// A group of `count` pending entries and `count` consumers: each consumer owning one entry (`owning`), or owning
/// none beside one consumer that owns them all.
async fn big_group(raw: &mut MultiplexedConnection, stream: &str, count: usize, owning: bool) {
    fill_stream(raw, stream, GROUP, count, 16).await;
    for start in (0..count).step_by(10_000) {
        let mut pipe = redis::pipe();
        for n in start..(start + 10_000).min(count) {
            if owning {
                pipe.cmd("XREADGROUP").arg("GROUP").arg(GROUP).arg(format!("worker-{n}")).arg("COUNT").arg(1);
                pipe.arg("STREAMS").arg(stream).arg(">").ignore();
            } else {
                pipe.cmd("XGROUP").arg("CREATECONSUMER").arg(stream).arg(GROUP).arg(format!("idle-{n}")).ignore();
            }
        }
        let _: () = pipe.query_async(raw).await.unwrap();
    }
    if !owning {
        deliver_all(raw, stream, GROUP, count).await;
    }
}

/// The destroy of a deleted policy's group.
async fn group_destroyed(server: &mut Server, count: usize, owning: bool, rows: &mut Vec<Row>) {
    const STREAM: &str = "{cost}:destroyed";
    let layout = if owning { "1 each" } else { "one owns all" };
    let started = Instant::now();
    big_group(&mut server.raw, STREAM, count, owning).await;
    time_it(&format!("a group of {count} consumers and {count} pending ({layout})"), started);
    let (destroyed, pelican) = server
        .measure(async |conn, at| pelican::redis::destroy_group(conn, at, STREAM, GROUP, "uid", true).await.unwrap())
        .await;
    assert_eq!(destroyed, Destroyed::Destroyed);
    server.del(&[STREAM]).await;
    let started = Instant::now();
    big_group(&mut server.raw, STREAM, count, owning).await;
    time_it(&format!("a group of {count} consumers and {count} pending again"), started);
    let mut destroy = redis::cmd("XGROUP");
    destroy.arg("DESTROY").arg(STREAM).arg(GROUP);
    let reference = server.baseline(&destroy).await;
    record(
        rows,
        server.row(
            if owning { "destroy group" } else { "destroy group, idle consumers" },
            &format!("{count} consumers, {count} pending ({layout})"),
            pelican,
            "destroyed".into(),
            "XGROUP DESTROY",
            reference,
        ),
    );
    server.del(&[STREAM]).await;
}

#[tokio::main]
async fn main() {
    let scale: f64 = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(1.0);
    let sizes = Sizes::scaled(scale);
    println!("the longest command each job ran on the server (SLOWLOG), beside one unbounded command; scale {scale}");
    let mut rows = Vec::new();
    let started = Instant::now();
    for var in ["PELICAN_REDIS_SERVER", "PELICAN_VALKEY_SERVER"] {
        let mut server = Server::start(var).await;
        eprintln!("{} at {}", server.label, server.address);
        println!();
        header();
        many_consumers(&mut server, sizes.consumers, &mut rows).await;
        many_fields_requeued(&mut server, sizes.field_entries, &mut rows).await;
        many_fields_redriven(&mut server, sizes.field_entries, &mut rows).await;
        large_entries(&mut server, sizes.large_entries, &mut rows).await;
        backlog_trimmed(&mut server, sizes.backlog, &mut rows).await;
        group_destroyed(&mut server, sizes.group, true, &mut rows).await;
        group_destroyed(&mut server, sizes.group, false, &mut rows).await;
    }
    eprintln!("whole run: {:.0} s", started.elapsed().as_secs_f64());
    println!();
    for row in &rows {
        println!("{}", row.summary());
    }
}
