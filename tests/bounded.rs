//! Bounded streams and retention against real Redis 7.0 and Valkey 9.1, below the operator: the
//! bounded-publish script called the way any client calls it (EVALSHA with the documented KEYS / ARGV, and
//! redis-cli), the SDK's `Producer`, and the retention trim. The operator-level scenarios (the bound kept from the
//! policy, `Saturated`, Events, status) are in tests/backpressure.rs.

#[macro_use]
mod common;

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::*;
use pelican::jobs;
use pelican::keys::{bounds_key, rejected_key, totals_key};
use pelican::redis::{GroupKeys, Pools, Target};
use pelican::worker::{BOUNDED_PUBLISH_BATCH_LUA, BOUNDED_PUBLISH_LUA, Producer, PublishError, Published, Refusal};

on_every_server!(
    twelve_thousand_into_a_bound_of_ten_thousand_refuses_exactly_two_thousand,
    pending_entries_of_a_crashed_consumer_still_count,
    eight_producers_at_once_never_push_the_backlog_past_the_bound,
    the_documented_redis_cli_call_publishes_and_is_refused_when_full,
    the_sdk_producer_tells_a_refusal_from_an_unknown_outcome,
    a_lag_the_server_cannot_tell_counts_the_whole_stream,
    a_check_the_server_refuses_is_an_error_never_an_unbounded_publish,
    a_bound_that_is_no_number_bounds_nothing,
    a_batch_is_written_in_order_up_to_the_room_and_the_rest_refused,
    eight_producers_of_batches_never_push_the_backlog_past_the_bound,
    a_malformed_batch_writes_nothing_and_says_what_is_wrong,
    a_batch_is_never_written_in_part_and_reported_not_written,
    retention_stops_at_an_unmanaged_groups_pending_then_at_its_read_position,
    retention_never_trims_a_stream_without_groups,
    the_trim_asks_the_server_to_keep_unacknowledged_entries_where_it_can,
    retention_keeps_entries_younger_than_min_age,
    retention_frees_a_large_backlog_a_bounded_call_at_a_time,
);

const STREAM: &str = "{orders}:in";
const GROUP: &str = "billing";

/// The script's SHA, loaded the way a client of another language would (SCRIPT LOAD of the repository's file).
fn load(conn: &mut redis::Connection) -> String {
    redis::cmd("SCRIPT").arg("LOAD").arg(BOUNDED_PUBLISH_LUA).query(conn).unwrap()
}

/// One raw EVALSHA with the documented KEYS and ARGV.
fn publish_cmd(sha: &str, n: u64) -> redis::Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(sha).arg(3).arg(STREAM).arg(bounds_key(STREAM)).arg(rejected_key(STREAM)).arg("n").arg(n);
    cmd
}

/// Publishes `count` entries in pipelines of 500: (accepted ids, refusal messages).
fn publish_many(conn: &mut redis::Connection, sha: &str, first: u64, count: u64) -> (Vec<String>, Vec<String>) {
    let (mut accepted, mut refused) = (Vec::new(), Vec::new());
    let mut n = first;
    while n < first + count {
        let chunk = (first + count - n).min(500);
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for i in 0..chunk {
            pipe.add_command(publish_cmd(sha, n + i));
        }
        let replies: Vec<redis::Value> = pipe.query(conn).unwrap();
        for reply in replies {
            match reply {
                redis::Value::BulkString(id) => accepted.push(String::from_utf8(id).unwrap()),
                redis::Value::ServerError(e) => refused.push(format!("{} {}", e.code(), e.details().unwrap_or(""))),
                other => panic!("unexpected reply {other:?}"),
            }
        }
        n += chunk;
    }
    (accepted, refused)
}

fn group_at_zero(conn: &mut redis::Connection, group: &str) {
    let _: () = redis::cmd("XGROUP").arg("CREATE").arg(STREAM).arg(group).arg("0").arg("MKSTREAM").query(conn).unwrap();
}

fn bound(conn: &mut redis::Connection, group: &str, max: u64) {
    let _: () = redis::cmd("HSET").arg(bounds_key(STREAM)).arg(group).arg(max).query(conn).unwrap();
}

/// lag + pending of a group, as XINFO GROUPS reports them.
fn backlog(conn: &mut redis::Connection, group: &str) -> i64 {
    let groups = xinfo_groups(conn, STREAM);
    let info = groups.iter().find(|g| group_field::<String>(g, "name") == group).expect("the group");
    group_field::<i64>(info, "lag") + group_field::<i64>(info, "pending")
}

fn ack_all(conn: &mut redis::Connection, group: &str, ids: &[String]) {
    for chunk in ids.chunks(1000) {
        let _: i64 = redis::cmd("XACK").arg(STREAM).arg(group).arg(chunk).query(conn).unwrap();
    }
}

fn rejected(conn: &mut redis::Connection, group: &str) -> Option<i64> {
    redis::cmd("HGET").arg(rejected_key(STREAM)).arg(group).query(conn).unwrap()
}

/// Seed 002: a bound of 10,000, no consumer, 12,000 publishes. Then a consumer drains 5,000 and a burst of 3,000
/// is accepted whole.
fn twelve_thousand_into_a_bound_of_ten_thousand_refuses_exactly_two_thousand(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    group_at_zero(&mut conn, GROUP);
    bound(&mut conn, GROUP, 10_000);
    let sha = load(&mut conn);

    let (accepted, refused) = publish_many(&mut conn, &sha, 0, 12_000);
    assert_eq!((accepted.len(), refused.len()), (10_000, 2_000));
    assert!(refused.iter().all(|r| r == "PELICAN_BACKLOG_FULL billing 10000 10000"), "{:?}", refused.first());
    assert_eq!(rejected(&mut conn, GROUP), Some(2_000));
    assert_eq!(backlog(&mut conn, GROUP), 10_000);

    let drained = read_new(&mut conn, STREAM, GROUP, "c1", 5_000);
    ack_all(&mut conn, GROUP, &drained);
    let (burst, refused) = publish_many(&mut conn, &sha, 12_000, 3_000);
    assert_eq!((burst.len(), refused.len()), (3_000, 0));
    assert_eq!(backlog(&mut conn, GROUP), 8_000);

    // No accepted entry is lost: every id the script returned is in the stream, and nothing else is.
    let ids: Vec<String> = xrange(&mut conn, STREAM).into_iter().map(|(id, _)| id).collect();
    assert_eq!(ids, accepted.into_iter().chain(burst).collect::<Vec<_>>());
}

/// A consumer that read 1,000 entries and crashed before acknowledging: its PEL still counts.
fn pending_entries_of_a_crashed_consumer_still_count(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    group_at_zero(&mut conn, GROUP);
    bound(&mut conn, GROUP, 3_000);
    let sha = load(&mut conn);
    let (accepted, _) = publish_many(&mut conn, &sha, 0, 3_000);
    assert_eq!(accepted.len(), 3_000);
    let read = read_new(&mut conn, STREAM, GROUP, "crashed", 1_000);
    assert_eq!(read.len(), 1_000);
    let (more, refused) = publish_many(&mut conn, &sha, 3_000, 1);
    assert_eq!((more.len(), refused.as_slice()), (0, &["PELICAN_BACKLOG_FULL billing 3000 3000".to_string()][..]));
    // Acknowledging what the crashed consumer held makes room for exactly that many.
    ack_all(&mut conn, GROUP, &read[..400]);
    let (more, refused) = publish_many(&mut conn, &sha, 3_001, 500);
    assert_eq!((more.len(), refused.len()), (400, 100));
}

/// A consumer that reads and acknowledges 50 entries every 5 ms, and a sampler that records the highest backlog it
/// sees, both running until `finish`.
struct Traffic {
    done: Arc<AtomicBool>,
    highest: Arc<AtomicU64>,
    sampler: std::thread::JoinHandle<()>,
    consumer: std::thread::JoinHandle<usize>,
}

impl Traffic {
    fn start(server: &Server) -> Traffic {
        let done = Arc::new(AtomicBool::new(false));
        let highest = Arc::new(AtomicU64::new(0));
        let sampler = {
            let (mut conn, done, highest) = (server.conn(), done.clone(), highest.clone());
            std::thread::spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    highest.fetch_max(backlog(&mut conn, GROUP) as u64, Ordering::Relaxed);
                }
            })
        };
        let consumer = {
            let (mut conn, done) = (server.conn(), done.clone());
            std::thread::spawn(move || {
                let mut handled = 0;
                while !done.load(Ordering::Relaxed) {
                    let ids = read_new(&mut conn, STREAM, GROUP, "c1", 50);
                    ack_all(&mut conn, GROUP, &ids);
                    handled += ids.len();
                    std::thread::sleep(Duration::from_millis(5));
                }
                handled
            })
        };
        Traffic { done, highest, sampler, consumer }
    }

    /// Stops both: (entries handled, highest backlog seen).
    fn finish(self) -> (usize, i64) {
        self.done.store(true, Ordering::Relaxed);
        self.sampler.join().unwrap();
        let handled = self.consumer.join().unwrap();
        (handled, self.highest.load(Ordering::Relaxed) as i64)
    }
}

/// 8 producers publish at once while a consumer reads and acknowledges; a sampler watches the backlog the whole
/// time. It never exceeds the bound, and every accepted entry is in the stream.
fn eight_producers_at_once_never_push_the_backlog_past_the_bound(flavor: Flavor) {
    const MAX: i64 = 2_000;
    let server = Server::start(flavor);
    let mut conn = server.conn();
    group_at_zero(&mut conn, GROUP);
    bound(&mut conn, GROUP, MAX as u64);
    let sha = load(&mut conn);
    let start = Arc::new(Barrier::new(8));
    let producers: Vec<_> = (0..8u64)
        .map(|p| {
            let (mut conn, sha, start) = (server.conn(), sha.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                let mut accepted = Vec::new();
                for round in 0..20 {
                    let (ids, _) = publish_many(&mut conn, &sha, p * 1_000_000 + round * 100, 100);
                    accepted.extend(ids);
                }
                accepted
            })
        })
        .collect();
    let traffic = Traffic::start(&server);
    let accepted: Vec<String> = producers.into_iter().flat_map(|p| p.join().unwrap()).collect();
    let (handled, highest) = traffic.finish();
    println!(
        "{flavor:?}: 16,000 offered, {} accepted, {handled} handled, highest backlog seen {highest}",
        accepted.len()
    );
    assert!(highest <= MAX, "backlog reached {highest}, bound {MAX}");
    assert!(backlog(&mut conn, GROUP) <= MAX);
    let refused = rejected(&mut conn, GROUP).unwrap_or(0);
    assert_eq!(accepted.len() as i64 + refused, 16_000);
    assert!(refused > 0, "the bound was never reached: the test proves nothing");
    let in_stream: std::collections::HashSet<String> =
        xrange(&mut conn, STREAM).into_iter().map(|(id, _)| id).collect();
    assert!(accepted.iter().all(|id| in_stream.contains(id)), "an accepted entry is missing");
}

/// The redis-cli line of docs/src/bounded-streams.md, verbatim but for the port.
fn the_documented_redis_cli_call_publishes_and_is_refused_when_full(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    group_at_zero(&mut conn, GROUP);
    bound(&mut conn, GROUP, 1);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/contract/scripts/bounded_publish.lua");
    let cli = |n: &str| {
        let out = Command::new("redis-cli")
            .args(["-p", &server.port.to_string(), "--eval", script])
            .args([STREAM, &bounds_key(STREAM), &rejected_key(STREAM), ",", "order", n])
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let first = cli("1");
    assert!(first.contains('-') && !first.contains("PELICAN"), "{first}");
    assert_eq!(cli("2").trim_start_matches("(error) "), "PELICAN_BACKLOG_FULL billing 1 1");
    assert_eq!(rejected(&mut conn, GROUP), Some(1));
}

fn the_sdk_producer_tells_a_refusal_from_an_unknown_outcome(flavor: Flavor) {
    let mut server = Server::start(flavor);
    let group = "billing eu";
    let mut conn = server.conn();
    group_at_zero(&mut conn, group);
    bound(&mut conn, group, 2);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = redis::Client::open(server.url()).unwrap();
    let producer = runtime.block_on(Producer::connect(&client, STREAM)).unwrap();
    for n in ["1", "2"] {
        runtime.block_on(producer.publish(&[("n", n)])).unwrap();
    }
    let refused = runtime.block_on(producer.publish(&[("n", "3")])).unwrap_err();
    match &refused {
        PublishError::Refused { group: g, backlog, max } => assert_eq!((g.as_str(), *backlog, *max), (group, 2, 2)),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(refused.certainly_not_written());
    assert_eq!(xrange(&mut conn, STREAM).len(), 2);
    // A key of the wrong type: the server answered, nothing written, and it says so.
    let other = runtime.block_on(Producer::connect(&client, "{orders}:bad")).unwrap();
    let _: () = redis::cmd("SET").arg(bounds_key("{orders}:bad")).arg("x").query(&mut conn).unwrap();
    let failed = runtime.block_on(other.publish(&[("n", "1")])).unwrap_err();
    assert!(matches!(failed, PublishError::Failed(_)), "{failed:?}");
    // The server gone: the outcome is unknown, never reported as a refusal.
    server.stop();
    let unknown = runtime.block_on(producer.publish(&[("n", "4")])).unwrap_err();
    assert!(matches!(unknown, PublishError::OutcomeUnknown(_)), "{unknown:?}");
    assert!(!unknown.certainly_not_written());
}

/// After an XDEL among the unread entries the server reports no lag: the script counts the whole stream as
/// unread, so the bound still holds (early refusals, never a backlog past the bound).
fn a_lag_the_server_cannot_tell_counts_the_whole_stream(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    group_at_zero(&mut conn, GROUP);
    bound(&mut conn, GROUP, 10);
    let sha = load(&mut conn);
    let (ids, _) = publish_many(&mut conn, &sha, 0, 8);
    let read = read_new(&mut conn, STREAM, GROUP, "c1", 2);
    ack_all(&mut conn, GROUP, &read);
    let _: i64 = redis::cmd("XDEL").arg(STREAM).arg(&ids[5]).query(&mut conn).unwrap();
    // 7 entries in the stream (2 acknowledged, 5 unread): the true backlog is 5, the script assumes 7.
    let (more, refused) = publish_many(&mut conn, &sha, 8, 5);
    assert_eq!((more.len(), refused.len()), (3, 2));
    assert_eq!(refused[0], "PELICAN_BACKLOG_FULL billing 10 10");
}

/// The check reads the groups with `redis.pcall` so that a stream not created yet (no group to bound) is published
/// to; any other error of that read is the reply. A producer whose ACL lacks XINFO gets the server's ACL error from
/// both scripts and writes nothing: never an entry past a bound it could not check.
fn a_check_the_server_refuses_is_an_error_never_an_unbounded_publish(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    bound(&mut conn, GROUP, 1);
    // No stream yet: the bound names a group it does not have, so the entry is added (and the stream created).
    let sha = load(&mut conn);
    let (ids, refused) = publish_many(&mut conn, &sha, 0, 1);
    assert_eq!((ids.len(), refused.len()), (1, 0), "{refused:?}");
    group_at_zero(&mut conn, GROUP);
    let _: () =
        redis::cmd("ACL").arg(&["SETUSER", "no-xinfo", "on", ">pw", "~*", "+@all", "-xinfo"]).query(&mut conn).unwrap();
    let mut producer = server.conn();
    let _: () = redis::cmd("AUTH").arg("no-xinfo").arg("pw").query(&mut producer).unwrap();
    let single: redis::RedisResult<String> = publish_cmd(&sha, 1).query(&mut producer);
    let batch: redis::RedisResult<redis::Value> = redis::cmd("EVAL")
        .arg(BOUNDED_PUBLISH_BATCH_LUA)
        .arg(3)
        .arg(STREAM)
        .arg(bounds_key(STREAM))
        .arg(rejected_key(STREAM))
        .arg(&[1, 2])
        .arg(&["n", "2"])
        .query(&mut producer);
    for (script, result) in [("single", single.map(|_| ())), ("batch", batch.map(|_| ()))] {
        let error = result.expect_err(script);
        let message = error.to_string();
        assert!(message.contains("can't run") || message.contains("no permissions"), "{script}: {message}");
    }
    assert_eq!(xrange(&mut conn, STREAM).len(), 1, "nothing written past the check");
}

/// Any client that may run the scripts may write the bounds hash (the operator puts the policy's value back at its
/// next look): a value that is no number bounds nothing, in both scripts, rather than failing every publish.
fn a_bound_that_is_no_number_bounds_nothing(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    group_at_zero(&mut conn, GROUP);
    let _: () = redis::cmd("HSET").arg(bounds_key(STREAM)).arg(GROUP).arg("many").query(&mut conn).unwrap();
    let sha = load(&mut conn);
    let (ids, refused) = publish_many(&mut conn, &sha, 0, 3);
    assert_eq!((ids.len(), refused.len()), (3, 0), "{refused:?}");
    let (batch_ids, refusal): (Vec<String>, Vec<String>) = redis::cmd("EVAL")
        .arg(BOUNDED_PUBLISH_BATCH_LUA)
        .arg(3)
        .arg(STREAM)
        .arg(bounds_key(STREAM))
        .arg(rejected_key(STREAM))
        .arg(&[1, 2])
        .arg(&["n", "3"])
        .query(&mut conn)
        .unwrap();
    assert_eq!((batch_ids.len(), refusal.len()), (1, 0));
    assert_eq!(xrange(&mut conn, STREAM).len(), 4);
}

/// Defect: an entry of ~4,100 fields (past what Lua's unpack hands on) failed after the entries before it were
/// added, and a bound of `2.5` made the refusal's count fail after `floor(room)` entries; both came back as `Failed`
/// ("certainly not written"), so a retry duplicated the prefix. The first is refused before any write; the second
/// bounds at 2.
fn a_batch_is_never_written_in_part_and_reported_not_written(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    group_at_zero(&mut conn, GROUP);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let producer = runtime.block_on(Producer::connect(&redis::Client::open(server.url()).unwrap(), STREAM)).unwrap();
    let wide: Vec<(String, String)> = (0..4100).map(|i| (format!("f{i}"), "v".to_string())).collect();
    let batch = vec![vec![("n".to_string(), "0".to_string())], vec![("n".to_string(), "1".to_string())], wide];
    let error = runtime.block_on(producer.publish_batch(&batch)).unwrap_err();
    assert!(error.certainly_not_written(), "{error:?}");
    assert!(error.to_string().contains("4100 fields"), "{error}");
    assert_eq!(xrange(&mut conn, STREAM).len(), 0, "a batch reported not written wrote entries");

    let _: () = redis::cmd("HSET").arg(bounds_key(STREAM)).arg(GROUP).arg("2.5").query(&mut conn).unwrap();
    let five: Vec<Vec<(&str, u64)>> = (0..5).map(|n| vec![("n", n)]).collect();
    let published = runtime.block_on(producer.publish_batch(&five)).unwrap();
    assert_eq!(published.ids.len(), 2);
    assert_eq!(published.refused, Some(Refusal { group: GROUP.into(), backlog: 0, max: 2 }));
    assert_eq!(rejected(&mut conn, GROUP), Some(3));
    assert_eq!(xrange(&mut conn, STREAM).len(), 2);
}

fn trim(server: &Server, min_age: Duration) -> jobs::Trim {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let mut conn = Pools::default().get(&Target::new(server.url())).await.unwrap();
        let keys = GroupKeys { stream: STREAM, group: GROUP, dead_letter: "{orders}:dlq" };
        // As the runner does: ACKED where the server has it.
        let acked = pelican::redis::features::detect(&mut conn, "test").await.unwrap().has("XTRIM ACKED");
        jobs::trim_acknowledged(&mut conn, "test", &keys, min_age, acked).await.unwrap()
    })
}

fn add(conn: &mut redis::Connection, n: usize) -> Vec<String> {
    (0..n).map(|i| redis::cmd("XADD").arg(STREAM).arg("*").arg("n").arg(i).query(conn).unwrap()).collect()
}

/// The managed group acknowledged everything; a second group no policy manages read 30 and acknowledged 10. The
/// trim stops at its oldest pending entry, then at its read position once it acknowledges; a group created at 0
/// afterwards stops it at once.
fn retention_stops_at_an_unmanaged_groups_pending_then_at_its_read_position(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    group_at_zero(&mut conn, GROUP);
    group_at_zero(&mut conn, "audit");
    let ids = add(&mut conn, 100);
    let all = read_new(&mut conn, STREAM, GROUP, "c1", 100);
    ack_all(&mut conn, GROUP, &all);
    let audit = read_new(&mut conn, STREAM, "audit", "a1", 30);
    ack_all(&mut conn, "audit", &audit[..10]);

    let first = trim(&server, Duration::ZERO);
    assert_eq!(first.trimmed, 10);
    assert_eq!(first.pinned_by.as_ref().unwrap().to_string(), format!("group audit (oldest pending {})", ids[10]));
    assert_eq!(xrange(&mut conn, STREAM)[0].0, ids[10]);

    ack_all(&mut conn, "audit", &audit[10..]);
    let second = trim(&server, Duration::ZERO);
    assert_eq!(second.trimmed, 20);
    assert_eq!(second.pinned_by.unwrap().to_string(), format!("group audit (not read from {} on)", after(&ids[29])));
    assert_eq!(xrange(&mut conn, STREAM).len(), 70);

    group_at_zero(&mut conn, "late");
    let third = trim(&server, Duration::ZERO);
    assert_eq!(third.trimmed, 0);
    assert_eq!(third.pinned_by.unwrap().group, "late");
    let counted: i64 = redis::cmd("HGET").arg(totals_key(STREAM, GROUP)).arg("trimmed").query(&mut conn).unwrap();
    assert_eq!(counted, 30);
}

fn after(id: &str) -> String {
    let (ms, seq) = id.split_once('-').unwrap();
    format!("{ms}-{}", seq.parse::<u64>().unwrap() + 1)
}

fn retention_never_trims_a_stream_without_groups(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    add(&mut conn, 50);
    let trim = trim(&server, Duration::ZERO);
    assert_eq!((trim.trimmed, trim.pinned_by), (0, None));
    assert_eq!(xrange(&mut conn, STREAM).len(), 50);
}

/// What the trim sends, seen with `MONITOR` (which shows the commands scripts run): its exact `XTRIM ... MINID <id>
/// ACKED` on a server that has `ACKED` trimming (Redis 8.2), plain `MINID` elsewhere; the same entries either way.
fn the_trim_asks_the_server_to_keep_unacknowledged_entries_where_it_can(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    group_at_zero(&mut conn, GROUP);
    add(&mut conn, 20);
    let read = read_new(&mut conn, STREAM, GROUP, "c1", 12);
    ack_all(&mut conn, GROUP, &read[..8]);
    let mut monitor = std::process::Command::new("redis-cli")
        .args(["-p", &server.port.to_string(), "MONITOR"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("redis-cli MONITOR");
    let (sender, lines) = std::sync::mpsc::channel::<String>();
    let out = monitor.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(out)).map_while(Result::ok) {
            let _ = sender.send(line);
        }
    });
    // MONITOR answers OK once it is on: only then does the trim run (a busy machine starts redis-cli late).
    let first = lines.recv_timeout(Duration::from_secs(10)).expect("MONITOR's OK");
    assert_eq!(first, "OK");
    let trimmed = trim(&server, Duration::ZERO);
    // The exact trim of what whole nodes left (`~ ... LIMIT` comes first, without ACKED).
    let exact = |l: &str| l.contains("\"XTRIM\"") && !l.contains("\"~\"");
    let mut seen = Vec::new();
    let xtrim = loop {
        match lines.recv_timeout(Duration::from_secs(10)) {
            Ok(line) if exact(&line) => break line,
            Ok(line) => seen.push(line),
            Err(_) => panic!("no exact XTRIM in:\n{}", seen.join("\n")),
        }
    };
    let _ = monitor.kill();
    let _ = monitor.wait();
    println!("{flavor:?}: {xtrim}");
    assert_eq!(trimmed.trimmed, 8, "the same safe point either way");
    assert_eq!(xtrim.contains("\"ACKED\""), matches!(flavor, Flavor::Redis82 | Flavor::Redis86), "{xtrim}");
}

fn retention_keeps_entries_younger_than_min_age(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    group_at_zero(&mut conn, GROUP);
    let old: Vec<String> = (1..=5)
        .map(|i| redis::cmd("XADD").arg(STREAM).arg(format!("{i}-0")).arg("n").arg(i).query(&mut conn).unwrap())
        .collect();
    let young = add(&mut conn, 5);
    let read = read_new(&mut conn, STREAM, GROUP, "c1", 10);
    ack_all(&mut conn, GROUP, &read);
    let trim = trim(&server, Duration::from_secs(3600));
    assert_eq!((trim.trimmed, trim.pinned_by), (5, None));
    let left: Vec<String> = xrange(&mut conn, STREAM).into_iter().map(|(id, _)| id).collect();
    assert_eq!(left, young);
    assert!(!left.contains(&old[4]));
}

/// A bound of 10: a batch of 4 goes in whole; of the next 8, the first 6 go in, in order, and 2 are refused and
/// counted; with the bound full, a batch writes nothing.
fn a_batch_is_written_in_order_up_to_the_room_and_the_rest_refused(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    group_at_zero(&mut conn, GROUP);
    bound(&mut conn, GROUP, 10);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = redis::Client::open(server.url()).unwrap();
    let producer = runtime.block_on(Producer::connect(&client, STREAM)).unwrap();
    let batch = |from: usize, count: usize| -> Vec<Vec<(String, String)>> {
        (from..from + count).map(|n| vec![("n".to_string(), n.to_string()), ("body".into(), "x".into())]).collect()
    };
    let first = runtime.block_on(producer.publish_batch(&batch(0, 4))).unwrap();
    assert_eq!((first.ids.len(), first.refused), (4, None));
    let second = runtime.block_on(producer.publish_batch(&batch(4, 8))).unwrap();
    assert_eq!(second.ids.len(), 6);
    assert_eq!(second.refused, Some(Refusal { group: GROUP.into(), backlog: 4, max: 10 }));
    let stream = xrange(&mut conn, STREAM);
    let values: Vec<String> = stream.iter().map(|(_, f)| String::from_utf8_lossy(&f[0].1).into_owned()).collect();
    assert_eq!(values, (0..10).map(|n| n.to_string()).collect::<Vec<_>>(), "the first 10, in order");
    let ids: Vec<String> = stream.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!([first.ids, second.ids].concat(), ids, "the ids returned are the entries written");
    assert_eq!(rejected(&mut conn, GROUP), Some(2));
    let full: Published = runtime.block_on(producer.publish_batch(&batch(12, 3))).unwrap();
    assert_eq!(full, Published { ids: vec![], refused: Some(Refusal { group: GROUP.into(), backlog: 10, max: 10 }) });
    assert_eq!(rejected(&mut conn, GROUP), Some(5));
    assert_eq!(xrange(&mut conn, STREAM).len(), 10);
    // A consumer handles 7: the next batch of 9 finds room for 7.
    let read = read_new(&mut conn, STREAM, GROUP, "c1", 7);
    ack_all(&mut conn, GROUP, &read);
    let after = runtime.block_on(producer.publish_batch(&batch(15, 9))).unwrap();
    assert_eq!((after.ids.len(), after.refused.map(|r| r.backlog)), (7, Some(3)));
    assert_eq!(backlog(&mut conn, GROUP), 10);
}

/// As the eight single-entry producers above, with batches of 50: the backlog never passes the bound, and every
/// entry is either in the stream or counted as refused.
fn eight_producers_of_batches_never_push_the_backlog_past_the_bound(flavor: Flavor) {
    const MAX: i64 = 2_000;
    let server = Server::start(flavor);
    let mut conn = server.conn();
    group_at_zero(&mut conn, GROUP);
    bound(&mut conn, GROUP, MAX as u64);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let client = redis::Client::open(server.url()).unwrap();
    let traffic = Traffic::start(&server);
    let accepted: Vec<String> = runtime.block_on(async {
        let producers = (0..8).map(|p| {
            let client = client.clone();
            tokio::spawn(async move {
                let producer = Producer::connect(&client, STREAM).await.unwrap();
                let mut accepted = Vec::new();
                for round in 0..40 {
                    let batch: Vec<[(&str, String); 1]> =
                        (0..50).map(|i| [("n", format!("{p}-{round}-{i}"))]).collect();
                    let published = producer.publish_batch(&batch).await.unwrap();
                    accepted.extend(published.ids);
                }
                accepted
            })
        });
        futures::future::join_all(producers).await.into_iter().flat_map(Result::unwrap).collect()
    });
    let (_, highest) = traffic.finish();
    println!(
        "{flavor:?}: 16,000 offered in batches of 50, {} accepted, highest backlog seen {highest}",
        accepted.len()
    );
    assert!(highest <= MAX, "backlog reached {highest}, bound {MAX}");
    let refused = rejected(&mut conn, GROUP).unwrap_or(0);
    assert_eq!(accepted.len() as i64 + refused, 16_000);
    assert!(refused > 0, "the bound was never reached: the test proves nothing");
    let in_stream: Vec<String> = xrange(&mut conn, STREAM).into_iter().map(|(id, _)| id).collect();
    assert_eq!(in_stream.len(), accepted.len(), "every accepted entry, and nothing else, is in the stream");
}

/// Any client can call the batch script: a count that does not match the arguments, or an odd number of them, is an
/// error that says which entry is wrong, and nothing is written.
fn a_malformed_batch_writes_nothing_and_says_what_is_wrong(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    group_at_zero(&mut conn, GROUP);
    bound(&mut conn, GROUP, 100);
    let sha: String = redis::cmd("SCRIPT").arg("LOAD").arg(BOUNDED_PUBLISH_BATCH_LUA).query(&mut conn).unwrap();
    let call = |conn: &mut redis::Connection, argv: &[&str]| -> String {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&sha).arg(3).arg(STREAM).arg(bounds_key(STREAM)).arg(rejected_key(STREAM)).arg(argv);
        match cmd.query::<redis::Value>(conn) {
            Err(e) => e.to_string(),
            Ok(v) => format!("{v:?}"),
        }
    };
    let odd = call(&mut conn, &["2", "2", "n", "1", "3", "n", "2", "x"]);
    assert!(odd.contains("entry 2 needs an even number of arguments"), "{odd}");
    let short = call(&mut conn, &["3", "2", "n", "1", "2", "n", "2"]);
    assert!(short.contains("entry 3"), "{short}");
    let extra = call(&mut conn, &["1", "2", "n", "1", "left", "over"]);
    assert!(extra.contains("2 arguments after the last of 1 entries"), "{extra}");
    let count = call(&mut conn, &["zero"]);
    assert!(count.contains("number of entries first"), "{count}");
    assert!(xrange(&mut conn, STREAM).is_empty(), "nothing written");
    let good = call(&mut conn, &["2", "2", "n", "1", "4", "n", "2", "body", "b"]);
    assert_eq!(xrange(&mut conn, STREAM).len(), 2, "{good}");
}

/// Defect (issue 57, cost): the trim freed the whole acknowledged backlog in one exact `XTRIM MINID` (a million
/// entries held Redis 7.0 149 ms, Valkey 9.1 297 ms). A call now frees at most 10,000; the trim calls again until
/// the safe point, and the count stays exact.
fn retention_frees_a_large_backlog_a_bounded_call_at_a_time(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    group_at_zero(&mut conn, GROUP);
    let mut pipe = redis::pipe();
    for i in 0..25_000 {
        pipe.cmd("XADD").arg(STREAM).arg("*").arg("n").arg(i).ignore();
    }
    let _: () = pipe.query(&mut conn).unwrap();
    let read = read_new(&mut conn, STREAM, GROUP, "c1", 25_000);
    for chunk in read.chunks(5000) {
        ack_all(&mut conn, GROUP, chunk);
    }
    // One call, as the runner makes it.
    let script = redis::Script::new(include_str!("../src/jobs/scripts/trim_acknowledged.lua"));
    let reply: Vec<redis::Value> =
        script.key(STREAM).key(totals_key(STREAM, GROUP)).arg(0).arg(0).arg(10_000).invoke(&mut conn).unwrap();
    let first: i64 = redis::from_redis_value(reply[0].clone()).unwrap();
    assert!((1..=10_000).contains(&first), "one call freed {first}");
    assert_eq!(reply.get(4), Some(&redis::Value::Int(1)), "it says more is left: {reply:?}");
    // The trim goes on until the safe point: exactly the rest.
    let rest = trim(&server, Duration::ZERO);
    assert_eq!(first as u64 + rest.trimmed, 25_000);
    let length: u64 = redis::cmd("XLEN").arg(STREAM).query(&mut conn).unwrap();
    assert_eq!(length, 0);
    let counted: u64 = redis::cmd("HGET").arg(totals_key(STREAM, GROUP)).arg("trimmed").query(&mut conn).unwrap();
    assert_eq!(counted, 25_000);
}
