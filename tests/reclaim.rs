//! The reclaim / dead-letter scripts against real Redis 7.0 and Valkey 9.1, driven through the library the
//! operator uses (no Kubernetes here; the operator-level scenarios are in tests/jobs.rs).

#[macro_use]
mod common;

use std::time::Duration;

use common::*;
use pelican::api::ReclaimStrategy;
use pelican::jobs::{self, Backoff, Cursor, PassSettings};
use pelican::keys::errors_key;
use pelican::redis::{Conn, GroupKeys, Pools, Target};

on_both_servers!(
    requeue_appends_one_copy_with_origin_and_acks_the_original,
    dead_letter_keeps_every_original_field_byte_exact_and_in_order,
    entry_with_thousands_of_fields_is_moved_and_a_larger_one_stays_pending,
    consumer_that_acks_or_rereads_before_the_pass_wins,
    deleted_and_trimmed_payloads_are_dropped_as_payload_deleted,
    dead_letter_key_of_another_type_writes_nothing,
    group_destroyed_mid_pass_writes_nothing,
    lost_script_cache_is_reloaded,
    pass_on_a_big_pel_with_nothing_idle_looks_at_max_per_pass_entries,
    reassign_gives_the_entry_to_the_least_loaded_live_consumer,
    reassign_hands_back_to_a_lone_owner_once_per_grace,
    consumer_expiry_never_destroys_a_pending_entry,
    reassigned_entry_nobody_rereads_reaches_the_cap_and_is_dead_lettered,
    a_batch_of_large_entries_never_makes_other_clients_wait_busy,
    a_counter_field_holding_no_integer_does_not_stop_the_pass,
    dead_letters_evicted_by_max_len_are_counted,
    a_large_max_len_is_sent_as_an_integer,
    a_server_error_quoting_a_key_named_like_tls_is_not_a_tls_failure,
    consumer_blocking_on_a_quiet_stream_is_not_expired,
    forged_delivery_counts_cost_one_short_call_and_are_dead_lettered,
    entries_left_without_an_owner_as_xnack_leaves_them_are_taken_at_once,
    a_requeued_copy_keeps_the_last_error_until_a_delivery_records_another,
    reassign_hands_a_gone_consumers_and_unowned_entries_over_at_once,
    reassign_with_no_consumer_that_looks_live_requeues,
    a_requeued_copy_a_worker_keeps_claiming_is_dead_lettered_past_the_cap,
    what_a_pod_recreated_under_a_gone_name_reads_is_not_taken,
    the_last_hand_over_is_left_to_its_new_owner_for_the_grace,
    reassign_past_the_consumers_it_lists_requeues_and_says_so,
    consumer_expiry_and_pod_matching_refuse_to_list_too_many_consumers,
    a_call_charges_entries_of_many_empty_fields_what_they_cost,
    a_group_is_destroyed_a_bounded_step_at_a_time,
    reassign_hands_over_only_to_consumers_whose_worker_beats,
);

const STREAM: &str = "{jobs}:in";
const DLQ: &str = "{jobs}:dlq";
const GROUP: &str = "workers";
const IDLE: Duration = Duration::from_millis(150);

fn keys() -> GroupKeys<'static> {
    GroupKeys { stream: STREAM, group: GROUP, dead_letter: DLQ }
}

fn settings(strategy: ReclaimStrategy, max_deliveries: u32) -> PassSettings {
    PassSettings {
        min_idle: IDLE,
        max_per_pass: 1000,
        max_deliveries,
        strategy,
        dead_letter_max_len: None,
        backoff: None,
        handover_grace: Duration::ZERO,
        slice: Duration::MAX,
    }
}

async fn connect(server: &Server) -> Conn {
    let target = Target::new(server.url());
    Pools::default().get(&target).await.unwrap()
}

/// A stream with a group at 0 and `entries` added (each a list of field pairs).
fn seed(server: &Server, entries: &[Vec<(Vec<u8>, Vec<u8>)>]) -> Vec<String> {
    let mut conn = server.conn();
    let _: () =
        redis::cmd("XGROUP").arg("CREATE").arg(STREAM).arg(GROUP).arg("0").arg("MKSTREAM").query(&mut conn).unwrap();
    entries
        .iter()
        .map(|fields| {
            let mut cmd = redis::cmd("XADD");
            cmd.arg(STREAM).arg("*");
            for (k, v) in fields {
                cmd.arg(k).arg(v);
            }
            cmd.query::<String>(&mut conn).unwrap()
        })
        .collect()
}

fn plain(n: usize) -> Vec<Vec<(Vec<u8>, Vec<u8>)>> {
    (0..n).map(|i| vec![(b"n".to_vec(), i.to_string().into_bytes())]).collect()
}

/// One dead-letter pass with a fresh cursor.
fn try_pass(server: &Server, settings: &PassSettings) -> Result<jobs::PassReport, pelican::Error> {
    runtime().block_on(async {
        let mut conn = connect(server).await;
        jobs::reclaim_pass(&mut conn, "test", &keys(), settings, &mut Cursor::default(), &|| true).await
    })
}

fn pass(server: &Server, settings: &PassSettings) -> jobs::PassReport {
    try_pass(server, settings).unwrap()
}

/// `consumer` reads up to `count` new entries and leaves them idle past `minIdle`.
fn read_and_leave_idle(conn: &mut redis::Connection, consumer: &str, count: usize) -> Vec<String> {
    let ids = read_new(conn, STREAM, GROUP, consumer, count);
    std::thread::sleep(IDLE * 2);
    ids
}

const HEARTBEATS: &str = "{jobs}:pelican:{jobs}:in:workers:consumers";

/// The workers named `consumers` beat their hearts now (the server's time, as `lease.lua` writes it at every lease
/// tick), so Reassign takes them for live for `minIdle`.
fn beat(conn: &mut redis::Connection, consumers: &[&str]) {
    let (seconds, micros): (u64, u64) = redis::cmd("TIME").query(conn).unwrap();
    let now = seconds * 1000 + micros / 1000;
    let mut cmd = redis::cmd("HSET");
    cmd.arg(HEARTBEATS);
    for consumer in consumers {
        cmd.arg(*consumer).arg(now);
    }
    let _: i64 = cmd.query(conn).unwrap();
}

fn hget(conn: &mut redis::Connection, key: &str, field: &str) -> i64 {
    redis::cmd("HGET").arg(key).arg(field).query::<Option<i64>>(conn).unwrap().unwrap_or(0)
}

fn requeue_appends_one_copy_with_origin_and_acks_the_original(flavor: Flavor) {
    let server = Server::start(flavor);
    let ids = seed(&server, &[vec![(b"a".to_vec(), b"1".to_vec()), (b"b".to_vec(), b"2".to_vec())]]);
    let mut conn = server.conn();
    read_and_leave_idle(&mut conn, "crashed", 10);

    let report = pass(&server, &settings(ReclaimStrategy::Requeue, 3));
    assert_eq!((report.requeued, report.dead_lettered), (1, 0));
    assert!(pel(&mut conn, STREAM, GROUP).is_empty(), "the original must be acknowledged");
    let entries = xrange(&mut conn, STREAM);
    assert_eq!(entries.len(), 2);
    let copy = &entries[1];
    let names: Vec<&[u8]> = copy.1.iter().map(|(k, _)| k.as_slice()).collect();
    assert_eq!(names, [&b"a"[..], b"b", b"pelican-origin-id", b"pelican-deliveries"]);
    assert_eq!(field(copy, "pelican-origin-id"), Some(ids[0].as_bytes()));
    assert_eq!(field(copy, "pelican-deliveries"), Some(&b"1"[..]));

    // Delivered again, failed again: the copy's own delivery count adds to the carried one, and the cap (2) is hit.
    assert_eq!(read_new(&mut conn, STREAM, GROUP, "crashed-again", 10), std::slice::from_ref(&copy.0));
    std::thread::sleep(IDLE * 2);
    let report = pass(&server, &settings(ReclaimStrategy::Requeue, 2));
    assert_eq!((report.requeued, report.dead_lettered), (0, 1));
    let dead = xrange(&mut conn, DLQ);
    assert_eq!(dead.len(), 1);
    assert_eq!(field(&dead[0], "pelican-deliveries"), Some(&b"2"[..]));
    assert_eq!(field(&dead[0], "pelican-origin-id"), Some(ids[0].as_bytes()));
    assert_eq!(field(&dead[0], "pelican-source-id"), Some(copy.0.as_bytes()));
    assert_eq!(xrange(&mut conn, STREAM).len(), 2, "dead-lettering adds nothing to the source stream");
    assert_eq!(hget(&mut conn, "{jobs}:pelican:{jobs}:in:workers:totals", "requeued"), 1);
    assert_eq!(hget(&mut conn, "{jobs}:pelican:{jobs}:in:workers:totals", "deadLettered"), 1);
    assert_eq!(hget(&mut conn, "{jobs}:pelican:{jobs}:in:workers:terminal", "MaxDeliveriesExceeded"), 1);
}

fn dead_letter_keeps_every_original_field_byte_exact_and_in_order(flavor: Flavor) {
    let server = Server::start(flavor);
    let big = vec![0xA5u8; 2 * 1024 * 1024];
    let fields: Vec<(Vec<u8>, Vec<u8>)> = vec![
        (b"payload".to_vec(), vec![0xff, 0xfe, 0x00, 0x80, b'\n']),
        (b"empty".to_vec(), Vec::new()),
        (b"dup".to_vec(), b"first".to_vec()),
        (b"dup".to_vec(), b"second".to_vec()),
        (b"pelican-reason".to_vec(), b"the application's own".to_vec()),
        (b"pelican-deliveries".to_vec(), b"not ours".to_vec()),
        (vec![0xc3, 0x28], b"non-UTF-8 name".to_vec()),
        (b"big".to_vec(), big.clone()),
    ];
    let ids = seed(&server, std::slice::from_ref(&fields));
    let mut conn = server.conn();
    read_and_leave_idle(&mut conn, "c1", 10);

    let report = pass(&server, &settings(ReclaimStrategy::Requeue, 1));
    assert_eq!(report.dead_lettered, 1);
    let dead = xrange(&mut conn, DLQ);
    assert_eq!(dead.len(), 1);
    let (originals, meta) = dead[0].1.split_at(fields.len());
    assert_eq!(originals, &fields[..], "original fields must be unchanged and in order");
    let meta: Vec<(String, Vec<u8>)> =
        meta.iter().map(|(k, v)| (String::from_utf8(k.clone()).unwrap(), v.clone())).collect();
    let names: Vec<&str> = meta.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        names,
        [
            "pelican-source-stream",
            "pelican-source-id",
            "pelican-origin-id",
            "pelican-group",
            "pelican-consumer",
            "pelican-deliveries",
            "pelican-reason",
            "pelican-dead-lettered-at"
        ]
    );
    let value = |name: &str| meta.iter().find(|(k, _)| k == name).unwrap().1.clone();
    assert_eq!(value("pelican-source-stream"), STREAM.as_bytes());
    assert_eq!(value("pelican-source-id"), ids[0].as_bytes());
    assert_eq!(value("pelican-consumer"), b"c1");
    assert_eq!(value("pelican-reason"), b"MaxDeliveriesExceeded");
    let at: i64 = String::from_utf8(value("pelican-dead-lettered-at")).unwrap().parse().unwrap();
    let millis: i64 = ids[0].split('-').next().unwrap().parse().unwrap();
    assert!(at >= millis && at < millis + 60_000, "dead-lettered-at {at} is not a unix ms time near {millis}");
    assert!(pel(&mut conn, STREAM, GROUP).is_empty());
}

fn entry_with_thousands_of_fields_is_moved_and_a_larger_one_stays_pending(flavor: Flavor) {
    let server = Server::start(flavor);
    let wide =
        |n: usize| (0..n).map(|i| (format!("f{i}").into_bytes(), format!("v{i}").into_bytes())).collect::<Vec<_>>();
    let ids = seed(&server, &[wide(3_000), wide(5_000)]);
    let mut conn = server.conn();
    read_and_leave_idle(&mut conn, "c1", 10);
    let report = pass(&server, &settings(ReclaimStrategy::Requeue, 1));
    assert_eq!((report.dead_lettered, report.too_large), (1, 1));
    let dead = xrange(&mut conn, DLQ);
    assert_eq!(dead[0].1[..3_000], wide(3_000)[..]);
    let pending: Vec<String> = pel(&mut conn, STREAM, GROUP).into_iter().map(|p| p.0).collect();
    assert_eq!(pending, [ids[1].clone()], "an entry too large to move stays pending, never half-moved");
}

fn consumer_that_acks_or_rereads_before_the_pass_wins(flavor: Flavor) {
    let server = Server::start(flavor);
    let ids = seed(&server, &plain(3));
    let mut conn = server.conn();
    read_and_leave_idle(&mut conn, "slow", 10);
    // All three are idle. Then, before the pass: one is acknowledged, the other two re-read by their consumer.
    let _: i64 = redis::cmd("XACK").arg(STREAM).arg(GROUP).arg(&ids[0]).query(&mut conn).unwrap();
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(GROUP)
        .arg("slow")
        .arg("STREAMS")
        .arg(STREAM)
        .arg(&ids[0])
        .query(&mut conn)
        .unwrap();
    let report = pass(&server, &settings(ReclaimStrategy::Requeue, 3));
    assert_eq!((report.scanned, report.idle, report.requeued), (2, 0, 0), "{report:?}");

    let _: i64 = redis::cmd("XACK").arg(STREAM).arg(GROUP).arg(&ids[1]).query(&mut conn).unwrap();
    std::thread::sleep(IDLE * 2);
    let report = pass(&server, &settings(ReclaimStrategy::Requeue, 3));
    assert_eq!((report.scanned, report.requeued), (1, 1), "only the untouched idle entry moves: {report:?}");
    assert_eq!(xrange(&mut conn, STREAM).len(), 4);
}

fn deleted_and_trimmed_payloads_are_dropped_as_payload_deleted(flavor: Flavor) {
    let server = Server::start(flavor);
    let ids = seed(&server, &plain(3_001));
    let mut conn = server.conn();
    assert_eq!(read_new(&mut conn, STREAM, GROUP, "c1", 5_000).len(), 3_001);
    let _: i64 = redis::cmd("XDEL").arg(STREAM).arg(&ids[3_000]).query(&mut conn).unwrap();
    let _: i64 = redis::cmd("XTRIM").arg(STREAM).arg("MAXLEN").arg(0).query(&mut conn).unwrap();
    std::thread::sleep(IDLE * 2);
    let report = pass(&server, &PassSettings { max_per_pass: 5_000, ..settings(ReclaimStrategy::Requeue, 1) });
    assert_eq!((report.payload_deleted, report.dead_lettered, report.requeued), (3_001, 0, 0));
    assert!(pel(&mut conn, STREAM, GROUP).is_empty());
    let dlq_len: i64 = redis::cmd("XLEN").arg(DLQ).query(&mut conn).unwrap();
    assert_eq!(dlq_len, 0, "a stale reference is never dead-lettered as if it had a payload");
    assert_eq!(hget(&mut conn, "{jobs}:pelican:{jobs}:in:workers:terminal", "PayloadDeleted"), 3_001);
    assert_eq!(hget(&mut conn, "{jobs}:pelican:{jobs}:in:workers:totals", "payloadDeleted"), 3_001);
}

fn dead_letter_key_of_another_type_writes_nothing(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(5));
    let mut conn = server.conn();
    read_new(&mut conn, STREAM, GROUP, "c1", 10);
    let _: () = redis::cmd("SET").arg(DLQ).arg("taken").query(&mut conn).unwrap();
    std::thread::sleep(IDLE * 2);
    let error = try_pass(&server, &settings(ReclaimStrategy::Requeue, 1)).unwrap_err();
    assert_eq!(error.reason(), "WrongKeyType", "{error}");
    assert!(error.to_string().contains(DLQ), "{error}");
    assert_eq!(pel(&mut conn, STREAM, GROUP).len(), 5);
    assert_eq!(xrange(&mut conn, STREAM).len(), 5);
    let value: String = redis::cmd("GET").arg(DLQ).query(&mut conn).unwrap();
    assert_eq!(value, "taken");
}

fn group_destroyed_mid_pass_writes_nothing(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(5));
    let mut conn = server.conn();
    read_and_leave_idle(&mut conn, "c1", 10);
    let _: i64 = redis::cmd("XGROUP").arg("DESTROY").arg(STREAM).arg(GROUP).query(&mut conn).unwrap();
    let error = try_pass(&server, &settings(ReclaimStrategy::Requeue, 1)).unwrap_err();
    assert!(error.to_string().contains("NOGROUP"), "{error}");
    assert_eq!(xrange(&mut conn, STREAM).len(), 5);
    let dlq_type: String = redis::cmd("TYPE").arg(DLQ).query(&mut conn).unwrap();
    assert_eq!(dlq_type, "none");
}

fn lost_script_cache_is_reloaded(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(4));
    let mut conn = server.conn();
    read_and_leave_idle(&mut conn, "c1", 2);
    runtime().block_on(async {
        let mut c = connect(&server).await;
        let s = settings(ReclaimStrategy::Requeue, 5);
        assert_eq!(
            jobs::reclaim_pass(&mut c, "test", &keys(), &s, &mut Cursor::default(), &|| true).await.unwrap().requeued,
            2
        );
        let _: () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut c).await.unwrap();
        read_new(&mut conn, STREAM, GROUP, "c1", 2);
        tokio::time::sleep(IDLE * 2).await;
        assert_eq!(
            jobs::reclaim_pass(&mut c, "test", &keys(), &s, &mut Cursor::default(), &|| true).await.unwrap().requeued,
            2
        );
    });
}

fn pass_on_a_big_pel_with_nothing_idle_looks_at_max_per_pass_entries(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(20_000));
    let mut conn = server.conn();
    assert_eq!(read_new(&mut conn, STREAM, GROUP, "c1", 20_000).len(), 20_000);
    let s = PassSettings { min_idle: Duration::from_secs(3600), ..settings(ReclaimStrategy::Requeue, 3) };
    runtime().block_on(async {
        let mut c = connect(&server).await;
        let mut cursor = Cursor::default();
        let (mut passes, mut scanned) = (0, 0);
        loop {
            let report = jobs::reclaim_pass(&mut c, "test", &keys(), &s, &mut cursor, &|| true).await.unwrap();
            passes += 1;
            scanned += report.scanned;
            assert!(report.scanned <= 1_000, "a pass looked at {} entries", report.scanned);
            assert_eq!(report.moved(), 0);
            if cursor.at_start() {
                break;
            }
        }
        // 20 full pages, then one that finds the end and starts over.
        assert_eq!((passes, scanned), (21, 20_000), "the cursor walks the whole PEL once, 1000 entries a pass");
    });
}

fn reassign_gives_the_entry_to_the_least_loaded_live_consumer(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(4));
    let mut conn = server.conn();
    read_and_leave_idle(&mut conn, "dead", 1);
    read_new(&mut conn, STREAM, GROUP, "busy", 2);
    // "idle" is a consumer that is alive (just polled, and its worker beats) and owns nothing.
    read_new(&mut conn, STREAM, GROUP, "idle", 0);
    beat(&mut conn, &["busy", "idle"]);
    let report = runtime().block_on(async {
        let mut c = connect(&server).await;
        let s = settings(ReclaimStrategy::Reassign, 3);
        jobs::reclaim_pass(&mut c, "test", &keys(), &s, &mut Cursor::default(), &|| true).await.unwrap()
    });
    assert_eq!(report.reassigned, 1, "{report:?}");
    let owners: Vec<(String, i64)> = pel(&mut conn, STREAM, GROUP).into_iter().map(|p| (p.1, p.3)).collect();
    assert_eq!(
        owners[0],
        ("idle".to_string(), 2),
        "claimed by the live consumer with fewest entries; the hand-over counts"
    );
}

fn consumer_expiry_never_destroys_a_pending_entry(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(2));
    let mut conn = server.conn();
    read_new(&mut conn, STREAM, GROUP, "holds-one", 1);
    read_new(&mut conn, STREAM, GROUP, "owns-nothing", 1);
    let first: String = pel(&mut conn, STREAM, GROUP).into_iter().find(|p| p.1 == "owns-nothing").unwrap().0;
    let _: i64 = redis::cmd("XACK").arg(STREAM).arg(GROUP).arg(first).query(&mut conn).unwrap();
    std::thread::sleep(IDLE * 2);
    let expired = runtime().block_on(async {
        let mut c = connect(&server).await;
        jobs::expire_consumers(&mut c, "test", &keys(), IDLE).await.unwrap()
    });
    assert_eq!(expired, 1);
    let consumers: Vec<redis::Value> =
        redis::cmd("XINFO").arg("CONSUMERS").arg(STREAM).arg(GROUP).query(&mut conn).unwrap();
    assert_eq!(consumers.len(), 1);
    assert_eq!(pel(&mut conn, STREAM, GROUP).len(), 1, "the pending entry survives");
    assert_eq!(hget(&mut conn, "{jobs}:pelican:{jobs}:in:workers:totals", "consumersExpired"), 1);
}

/// Defect: XCLAIM JUSTID left the delivery count as it was, so an entry handed to consumers that only read `>`
/// was reassigned forever. Each hand-over now counts, and the cap (3) is reached after two hand-overs.
fn reassigned_entry_nobody_rereads_reaches_the_cap_and_is_dead_lettered(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(2));
    let mut conn = server.conn();
    read_new(&mut conn, STREAM, GROUP, "a", 1);
    // Redis 7.0 creates a consumer only when a read gives it something: "b" handles the second message.
    let done = read_new(&mut conn, STREAM, GROUP, "b", 1);
    let _: i64 = redis::cmd("XACK").arg(STREAM).arg(GROUP).arg(&done).query(&mut conn).unwrap();
    let s = settings(ReclaimStrategy::Reassign, 3);
    let mut reassigned = 0;
    for _ in 0..10 {
        std::thread::sleep(IDLE * 2);
        // Both consumers are alive (they read and acknowledge new messages, and their workers beat) but never
        // re-read their own PEL.
        for consumer in ["a", "b"] {
            let _: String = redis::cmd("XADD").arg(STREAM).arg("*").arg("filler").arg(1).query(&mut conn).unwrap();
            let ids = read_new(&mut conn, STREAM, GROUP, consumer, 1);
            let _: i64 = redis::cmd("XACK").arg(STREAM).arg(GROUP).arg(&ids).query(&mut conn).unwrap();
        }
        beat(&mut conn, &["a", "b"]);
        let report = pass(&server, &s);
        reassigned += report.reassigned;
        if report.dead_lettered == 1 {
            break;
        }
    }
    let dead = xrange(&mut conn, DLQ);
    assert_eq!(dead.len(), 1, "dead-lettered after {reassigned} hand-overs");
    assert_eq!(field(&dead[0], "pelican-deliveries"), Some(&b"3"[..]));
    assert_eq!(reassigned, 2, "two hand-overs, then the cap");
    assert!(pel(&mut conn, STREAM, GROUP).is_empty());
}

/// Defect: one script call copied a whole batch of any size: 128 entries of 2 MB are 256 MB copied in one atomic
/// script, and every other client of the server waits for all of it (or gets BUSY once the script runs longer than
/// the busy threshold and the server gets to answer). The byte budget keeps every call short: another client's
/// slowest reply during the whole pass stays far below the time the pass takes.
fn a_batch_of_large_entries_never_makes_other_clients_wait_busy(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    let big = vec![b'x'; 2 << 20];
    seed(&server, &(0..128).map(|_| vec![(b"blob".to_vec(), big.clone())]).collect::<Vec<_>>());
    read_and_leave_idle(&mut conn, "crashed", 128);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (stop, mut probe) = (stop.clone(), server.conn());
        std::thread::spawn(move || {
            let (mut busy, mut slowest) = (0, Duration::ZERO);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let asked = std::time::Instant::now();
                match redis::cmd("GET").arg("{jobs}:probe").query::<Option<String>>(&mut probe) {
                    Ok(_) => slowest = slowest.max(asked.elapsed()),
                    Err(e) if e.code() == Some("BUSY") => busy += 1,
                    Err(e) => panic!("{e}"),
                }
            }
            (busy, slowest)
        })
    };
    let started = std::time::Instant::now();
    let report = pass(&server, &settings(ReclaimStrategy::Requeue, 1));
    let took = started.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (busy, slowest) = watcher.join().unwrap();
    eprintln!("pass of 256 MB took {took:?}; another client's slowest reply meanwhile: {slowest:?}");
    assert_eq!(report.dead_lettered, 128);
    assert_eq!(busy, 0, "BUSY replies while the pass ran");
    assert!(slowest * 4 < took, "another client waited {slowest:?} during a pass of {took:?}");
    assert_eq!(xrange(&mut conn, DLQ).len(), 128);
}

/// Defect: HINCRBY on a field that held no integer failed after the move, aborting the batch on every pass.
fn a_counter_field_holding_no_integer_does_not_stop_the_pass(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(300));
    let mut conn = server.conn();
    let totals = pelican::keys::totals_key(STREAM, GROUP);
    let terminal = pelican::keys::terminal_key(STREAM, GROUP);
    let _: () = redis::cmd("HSET").arg(&totals).arg("deadLettered").arg("not a number").query(&mut conn).unwrap();
    let _: () = redis::cmd("HSET").arg(&terminal).arg("MaxDeliveriesExceeded").arg("1.5").query(&mut conn).unwrap();
    read_and_leave_idle(&mut conn, "c1", 300);
    let report = pass(&server, &settings(ReclaimStrategy::Requeue, 1));
    assert_eq!(report.dead_lettered, 300);
    assert!(pel(&mut conn, STREAM, GROUP).is_empty());
    assert_eq!(xrange(&mut conn, DLQ).len(), 300);
    assert_eq!(
        hget(&mut conn, &totals, "deadLettered"),
        300,
        "the unreadable value started again from the first count"
    );
    assert_eq!(hget(&mut conn, &terminal, "MaxDeliveriesExceeded"), 300);
}

/// Defect: `deadLetter.maxLen` dropped dead letters with no trace.
fn dead_letters_evicted_by_max_len_are_counted(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(1_000));
    let mut conn = server.conn();
    read_new(&mut conn, STREAM, GROUP, "c1", 1_000);
    std::thread::sleep(IDLE * 2);
    let s = PassSettings { dead_letter_max_len: Some(100), ..settings(ReclaimStrategy::Requeue, 1) };
    let report = pass(&server, &s);
    let kept = xrange(&mut conn, DLQ).len() as u64;
    assert!(kept < 1_000, "maxLen 100 (approximate) kept {kept}");
    assert_eq!(report.dead_lettered, 1_000);
    assert_eq!(report.dead_letter_evicted, 1_000 - kept);
    let totals = pelican::keys::totals_key(STREAM, GROUP);
    assert_eq!(hget(&mut conn, &totals, "deadLetterEvicted") as u64, 1_000 - kept);
}

/// Defect: the MAXLEN argument was a Lua number, which large values turn into `1e+17` (refused by the server).
fn a_large_max_len_is_sent_as_an_integer(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(3));
    let mut conn = server.conn();
    read_and_leave_idle(&mut conn, "c1", 3);
    let s =
        PassSettings { dead_letter_max_len: Some(100_000_000_000_000_000), ..settings(ReclaimStrategy::Requeue, 1) };
    let report = runtime().block_on(async {
        let mut c = connect(&server).await;
        jobs::reclaim_pass(&mut c, "test", &keys(), &s, &mut Cursor::default(), &|| true).await
    });
    assert_eq!(report.map(|r| r.dead_lettered).map_err(|e| e.to_string()), Ok(3));
}

/// Defect: errors were classified by words in the message, so a WRONGTYPE naming the key `mtls-audit` was shown
/// as TLSHandshakeFailed.
fn a_server_error_quoting_a_key_named_like_tls_is_not_a_tls_failure(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(2));
    let mut conn = server.conn();
    read_new(&mut conn, STREAM, GROUP, "c1", 2);
    let _: () = redis::cmd("SET").arg("{jobs}:mtls-audit").arg("x").query(&mut conn).unwrap();
    std::thread::sleep(IDLE * 2);
    let keys = GroupKeys { dead_letter: "{jobs}:mtls-audit", ..keys() };
    let error = runtime().block_on(async {
        let mut c = connect(&server).await;
        jobs::reclaim_pass(
            &mut c,
            "test",
            &keys,
            &settings(ReclaimStrategy::Requeue, 1),
            &mut Cursor::default(),
            &|| true,
        )
        .await
        .unwrap_err()
    });
    assert_eq!(error.reason(), "WrongKeyType", "{error}");
}

/// Defect: expiry used `inactive` (time since the last read that returned something, Redis 7.2+ / Valkey), so
/// a healthy worker blocking on a quiet stream was deleted every expireAfter. A consumer that keeps polling stays.
fn consumer_blocking_on_a_quiet_stream_is_not_expired(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(2));
    let mut conn = server.conn();
    // Both consumers handled a message (Redis 7.0 creates a consumer only when a read gives it something).
    for consumer in ["gone", "polling"] {
        let ids = read_new(&mut conn, STREAM, GROUP, consumer, 1);
        let _: i64 = redis::cmd("XACK").arg(STREAM).arg(GROUP).arg(&ids).query(&mut conn).unwrap();
    }
    let expire_after = Duration::from_millis(600);
    let started = std::time::Instant::now();
    while started.elapsed() < expire_after * 3 {
        // The quiet stream has nothing new: each blocking read returns nil after 100 ms.
        let _: redis::Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(GROUP)
            .arg("polling")
            .arg("BLOCK")
            .arg(100)
            .arg("STREAMS")
            .arg(STREAM)
            .arg(">")
            .query(&mut conn)
            .unwrap();
    }
    let expired = runtime().block_on(async {
        let mut c = connect(&server).await;
        jobs::expire_consumers(&mut c, "test", &keys(), expire_after).await.unwrap()
    });
    let consumers: Vec<std::collections::HashMap<String, redis::Value>> =
        redis::cmd("XINFO").arg("CONSUMERS").arg(STREAM).arg(GROUP).query(&mut conn).unwrap();
    let names: Vec<String> = consumers.iter().map(|c| redis::from_redis_value(c["name"].clone()).unwrap()).collect();
    match flavor {
        // Redis 7.2+ and Valkey refresh `idle` on every read attempt, blocked or not.
        Flavor::Valkey | Flavor::Redis8 | Flavor::Redis82 | Flavor::Redis86 | Flavor::Valkey81 | Flavor::ValkeyTls => {
            assert_eq!(
                (expired, names),
                (1, vec!["polling".to_string()]),
                "only the consumer that stopped polling goes"
            )
        }
        // Redis 7.0 refreshes `idle` only when a read delivers something: a poller on a quiet stream cannot be told
        // from a dead consumer (docs/src/jobs.md says so). It owns nothing, so deleting it loses nothing, and its next
        // read that receives a message makes it again.
        Flavor::Redis => {
            assert_eq!((expired, names.len()), (2, 0));
            let _: String = redis::cmd("XADD").arg(STREAM).arg("*").arg("n").arg(9).query(&mut conn).unwrap();
            assert_eq!(read_new(&mut conn, STREAM, GROUP, "polling", 1).len(), 1);
        }
    }
}

/// What `XNACK` (Redis 8.8) leaves is an entry without an owner: consumer `""` (idle -1 until read again). No server
/// here has XNACK; a read by the consumer `""` makes the same PEL entry, and `XCLAIM ... RETRYCOUNT` the count each
/// mode leaves. With `minIdle` an hour, the pass takes them at once with that count: SILENT's (the aborted delivery
/// uncounted: 0) and FAIL's (1) are requeued, FATAL's (i64 max) is dead-lettered as `NackedFatal`; a live
/// consumer's entry stays. (Without the change, all four stay pending for the hour.)
fn entries_left_without_an_owner_as_xnack_leaves_them_are_taken_at_once(flavor: Flavor) {
    let server = Server::start(flavor);
    let ids = seed(&server, &plain(4));
    let mut conn = server.conn();
    assert_eq!(read_new(&mut conn, STREAM, GROUP, "", 3).len(), 3);
    assert_eq!(read_new(&mut conn, STREAM, GROUP, "live", 1).len(), 1);
    for (id, count) in [(&ids[0], 0), (&ids[2], i64::MAX)] {
        let _: Vec<String> = redis::cmd("XCLAIM")
            .arg(STREAM)
            .arg(GROUP)
            .arg("")
            .arg(0)
            .arg(id)
            .arg("RETRYCOUNT")
            .arg(count)
            .arg("JUSTID")
            .query(&mut conn)
            .unwrap();
    }
    let s = PassSettings { min_idle: Duration::from_secs(3600), ..settings(ReclaimStrategy::Requeue, 3) };
    let report = pass(&server, &s);
    assert_eq!((report.requeued, report.dead_lettered), (2, 1), "{report:?}");
    let copies: Vec<(String, String)> = xrange(&mut conn, STREAM)
        .iter()
        .filter_map(|e| {
            let text = |name| field(e, name).map(|v| String::from_utf8_lossy(v).into_owned());
            Some((text("pelican-origin-id")?, text("pelican-deliveries")?))
        })
        .collect();
    assert_eq!(copies, [(ids[0].clone(), "0".to_string()), (ids[1].clone(), "1".to_string())]);
    let dead = xrange(&mut conn, DLQ);
    assert_eq!(dead.len(), 1);
    assert_eq!(field(&dead[0], "pelican-source-id"), Some(ids[2].as_bytes()));
    assert_eq!(field(&dead[0], "pelican-reason"), Some(&b"NackedFatal"[..]));
    assert_eq!(hget(&mut conn, "{jobs}:pelican:{jobs}:in:workers:terminal", "NackedFatal"), 1);
    let pending: Vec<(String, String)> =
        pel(&mut conn, STREAM, GROUP).into_iter().map(|(id, owner, _, _)| (id, owner)).collect();
    assert_eq!(pending, [(ids[3].clone(), "live".to_string())]);
}

/// Defect: the backoff threshold looped once per delivery, and the count is data clients control: a consumer's
/// `XCLAIM ... RETRYCOUNT`, a producer's `pelican-deliveries`. With `factor: 1` a count of 80,000,000 held the server
/// for seconds and `inf` for ever. Now each costs the same short call: a forged finite count reaches the cap, one that
/// is no finite non-negative integer is dead-lettered as `InvalidDeliveryCount`; no call enters the slow log.
fn forged_delivery_counts_cost_one_short_call_and_are_dead_lettered(flavor: Flavor) {
    let server = Server::start(flavor);
    let forged = |n: &str, count: &str| {
        vec![
            (b"n".to_vec(), n.as_bytes().to_vec()),
            (b"pelican-origin-id".to_vec(), b"1-0".to_vec()),
            (b"pelican-deliveries".to_vec(), count.as_bytes().to_vec()),
        ]
    };
    let entries = [plain(1), vec![forged("1", "50000000"), forged("2", "inf"), forged("3", "-1"), forged("4", "nan")]];
    let ids = seed(&server, &entries.concat());
    let mut conn = server.conn();
    let _: () = redis::cmd("CONFIG").arg("SET").arg("slowlog-log-slower-than").arg(1_000_000).query(&mut conn).unwrap();
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(&mut conn).unwrap();
    read_new(&mut conn, STREAM, GROUP, "c", 10);
    let _: Vec<String> = redis::cmd("XCLAIM")
        .arg(STREAM)
        .arg(GROUP)
        .arg("c")
        .arg(0)
        .arg(&ids[0])
        .arg("RETRYCOUNT")
        .arg(80_000_000)
        .arg("JUSTID")
        .query(&mut conn)
        .unwrap();
    std::thread::sleep(IDLE * 2);
    let backoff = Some(Backoff { factor: 1, max: Duration::from_secs(3600) });
    let report = pass(&server, &PassSettings { backoff, ..settings(ReclaimStrategy::Requeue, 3) });
    assert_eq!(report.dead_lettered, 5, "{report:?}");
    let reasons: Vec<(String, String)> = xrange(&mut conn, DLQ)
        .iter()
        .map(|e| {
            let text = |name| String::from_utf8_lossy(field(e, name).unwrap()).into_owned();
            (text("pelican-reason"), text("pelican-deliveries"))
        })
        .collect();
    let expected = [
        ("MaxDeliveriesExceeded", "80000000"),
        ("MaxDeliveriesExceeded", "50000001"),
        ("InvalidDeliveryCount", "3"),
        ("InvalidDeliveryCount", "3"),
        ("InvalidDeliveryCount", "3"),
    ];
    assert_eq!(reasons, expected.map(|(r, n)| (r.to_string(), n.to_string())));
    assert_eq!(hget(&mut conn, "{jobs}:pelican:{jobs}:in:workers:terminal", "InvalidDeliveryCount"), 3);
    assert_eq!(hget(&mut conn, "{jobs}:pelican:{jobs}:in:workers:terminal", "MaxDeliveriesExceeded"), 2);
    let slow: Vec<redis::Value> = redis::cmd("SLOWLOG").arg("GET").query(&mut conn).unwrap();
    assert!(slow.is_empty(), "calls of a second or more: {slow:?}");
}

/// Defect: a requeue moved the last error to the copy's id, and the same call then pruned it (the copy is in no PEL
/// until read), so a final delivery that recorded nothing was dead-lettered without the error of the one before.
fn a_requeued_copy_keeps_the_last_error_until_a_delivery_records_another(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(1));
    let mut conn = server.conn();
    let errors = errors_key(STREAM, GROUP);
    let first = read_new(&mut conn, STREAM, GROUP, "c", 1);
    let _: i64 = redis::cmd("HSET").arg(&errors).arg(&first[0]).arg("first failure").query(&mut conn).unwrap();
    std::thread::sleep(IDLE * 2);
    assert_eq!(pass(&server, &settings(ReclaimStrategy::Requeue, 2)).requeued, 1);
    // Passes before a consumer reads the copy leave its error alone.
    assert_eq!(pass(&server, &settings(ReclaimStrategy::Requeue, 2)).moved(), 0);
    // The second delivery crashes without recording anything.
    let copy = read_new(&mut conn, STREAM, GROUP, "c", 1);
    std::thread::sleep(IDLE * 2);
    assert_eq!(pass(&server, &settings(ReclaimStrategy::Requeue, 2)).dead_lettered, 1);
    let dead = xrange(&mut conn, DLQ);
    assert_eq!(field(&dead[0], "pelican-source-id"), Some(copy[0].as_bytes()));
    assert_eq!(field(&dead[0], "pelican-last-error"), Some(&b"first failure"[..]));
    let left: i64 = redis::cmd("HLEN").arg(&errors).query(&mut conn).unwrap();
    assert_eq!(left, 0, "the field left with the dead letter");
}

/// Defect (issue 48.3, then 57): the expiry deleted every idle consumer in one script call (100,000 consumers held
/// the server about half a second), then listed them all in one `XINFO CONSUMERS` (97-151 ms at 300,000 on Redis
/// 7.0). Redis has no bounded way to list consumers: past `CONSUMERS_LISTED_MAX` the expiry lists none, deletes none,
/// and says why and what to do; no command of it reaches the SLOWLOG at 5 ms. Below it the expiry deletes the idle
/// ones, a hundred per call, and the consumer that owns a pending entry stays.
#[test]
fn a_hundred_thousand_idle_consumers_are_not_listed_and_the_expiry_says_why() {
    let server = Server::start(Flavor::Redis);
    seed(&server, &plain(1));
    let mut conn = server.conn();
    read_new(&mut conn, STREAM, GROUP, "holds-one", 1);
    for chunk in (0..100_000).collect::<Vec<_>>().chunks(10_000) {
        let mut pipe = redis::pipe();
        for i in chunk {
            pipe.cmd("XGROUP").arg("CREATECONSUMER").arg(STREAM).arg(GROUP).arg(format!("worker-{i}")).ignore();
        }
        pipe.query::<()>(&mut conn).unwrap();
    }
    std::thread::sleep(IDLE * 2);
    let _: () = redis::cmd("CONFIG").arg("SET").arg("slowlog-log-slower-than").arg(5_000).query(&mut conn).unwrap();
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(&mut conn).unwrap();
    let expire = || {
        runtime().block_on(async {
            let mut c = connect(&server).await;
            jobs::expire_consumers(&mut c, "test", &keys(), IDLE).await
        })
    };
    let error = expire().unwrap_err();
    assert_eq!(error.reason(), "TooManyConsumers", "{error}");
    let slow: Vec<redis::Value> = redis::cmd("SLOWLOG").arg("GET").arg(10).query(&mut conn).unwrap();
    assert!(slow.is_empty(), "calls slower than 5 ms: {slow:?}");
    // Cleared by hand below the limit, the expiry takes over.
    let mut pipe = redis::pipe();
    for i in 0..99_500 {
        pipe.cmd("XGROUP").arg("DELCONSUMER").arg(STREAM).arg(GROUP).arg(format!("worker-{i}")).ignore();
    }
    pipe.query::<()>(&mut conn).unwrap();
    assert_eq!(expire().unwrap(), 500);
    let groups = xinfo_groups(&mut conn, STREAM);
    assert_eq!(group_field::<i64>(&groups[0], "consumers"), 1);
    assert_eq!(pel(&mut conn, STREAM, GROUP).len(), 1, "the pending entry survives");
    assert_eq!(hget(&mut conn, "{jobs}:pelican:{jobs}:in:workers:totals", "consumersExpired"), 500);
}

/// Defect (issue 48.2): the byte budget counted bytes copied, not bytes read. A PEL with one pending entry in 64
/// (16 KB entries: a poison storm) had each run read 64 entries to use one, so a call read ~64 times its budget.
/// Every byte read counts now and the read-ahead follows the PEL's gaps: a call costs the server what its budget
/// allows. Measured in the server's CPU time (`INFO cpu`) a call, not in the calls' wall time (`SLOWLOG`), which a
/// busy machine lengthens by whatever it runs meanwhile (CI once saw a call of 109 ms there).
#[test]
fn a_sparse_pel_of_large_entries_costs_a_call_its_budget_not_sixty_four_times_it() {
    let server = Server::start(Flavor::Redis);
    let mut conn = server.conn();
    let body = vec![b'x'; 16 << 10];
    seed(&server, &[]);
    let mut pending = Vec::new();
    for chunk in 0..256 {
        let mut pipe = redis::pipe();
        for _ in 0..64 {
            pipe.cmd("XADD").arg(STREAM).arg("*").arg("body").arg(&body);
        }
        let ids: Vec<String> = pipe.query(&mut conn).unwrap();
        // Read all 64, acknowledge all but the first: it stays pending, 63 entries from the next.
        assert_eq!(read_new(&mut conn, STREAM, GROUP, "crashed", 64), ids);
        let _: i64 = redis::cmd("XACK").arg(STREAM).arg(GROUP).arg(&ids[1..]).query(&mut conn).unwrap();
        pending.push(ids[0].clone());
        assert_eq!(pel(&mut conn, STREAM, GROUP).len(), chunk + 1);
    }
    std::thread::sleep(IDLE * 2);
    let (cpu, calls) = (server_cpu(&mut conn), script_calls(&mut conn));
    let report = pass(&server, &settings(ReclaimStrategy::DeadLetterOnly, 1));
    assert_eq!(report.dead_lettered, 256, "{report:?}");
    let calls = script_calls(&mut conn) - calls;
    let per_call = (server_cpu(&mut conn) - cpu) / calls as f64;
    println!(
        "256 pending entries 64 apart, 16 KB each: {calls} calls, {:.1} ms of the server's CPU a call",
        per_call * 1e3
    );
    assert!(per_call < 0.05, "a reclaim call cost the server {:.1} ms of CPU", per_call * 1e3);
    let letters: Vec<String> = xrange(&mut conn, DLQ)
        .iter()
        .map(|e| String::from_utf8(field(e, "pelican-source-id").unwrap().to_vec()).unwrap())
        .collect();
    assert_eq!(letters, pending, "each pending entry dead-lettered once, in order");
}

/// Defects (issue 48.9 and 48.10): `Reassign` handed an entry only to a live consumer other than its owner, so with
/// one worker (which leaves its failures to the pass) a failed message was never retried; and it handed an entry
/// over again every `minIdle`, each time a delivery, faster than an SDK worker looks at its PEL (every 30 s), so a
/// message was dead-lettered after one real attempt. Now the lone owner gets it back, and an entry handed over is
/// not handed over (nor counted) again within the grace.
fn reassign_hands_back_to_a_lone_owner_once_per_grace(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(2));
    let mut conn = server.conn();
    // "only" failed the first message and goes on reading new ones: alive, and the only consumer.
    let failed = read_new(&mut conn, STREAM, GROUP, "only", 1);
    std::thread::sleep(IDLE * 2);
    let done = read_new(&mut conn, STREAM, GROUP, "only", 1);
    let _: i64 = redis::cmd("XACK").arg(STREAM).arg(GROUP).arg(&done).query(&mut conn).unwrap();
    let grace = Duration::from_secs(3);
    let s = PassSettings { handover_grace: grace, ..settings(ReclaimStrategy::Reassign, 5) };
    beat(&mut conn, &["only"]);
    assert_eq!(pass(&server, &s).reassigned, 1, "handed back to its owner, the only live consumer");
    let owners: Vec<(String, String, i64)> =
        pel(&mut conn, STREAM, GROUP).into_iter().map(|p| (p.0, p.1, p.3)).collect();
    assert_eq!(owners, [(failed[0].clone(), "only".to_string(), 2)]);
    // Idle again (the worker has not looked at its PEL yet): within the grace nothing is handed over or counted.
    for _ in 0..3 {
        std::thread::sleep(IDLE * 2);
        let _: String = redis::cmd("XADD").arg(STREAM).arg("*").arg("filler").arg(1).query(&mut conn).unwrap();
        let ids = read_new(&mut conn, STREAM, GROUP, "only", 1);
        let _: i64 = redis::cmd("XACK").arg(STREAM).arg(GROUP).arg(&ids).query(&mut conn).unwrap();
        beat(&mut conn, &["only"]);
        assert_eq!(pass(&server, &s).reassigned, 0);
    }
    assert_eq!(pel(&mut conn, STREAM, GROUP)[0].3, 2, "the count grows no faster than the owner takes it up");
    // After the grace it is handed over again, and counted.
    std::thread::sleep(grace);
    let _: String = redis::cmd("XADD").arg(STREAM).arg("*").arg("filler").arg(1).query(&mut conn).unwrap();
    let ids = read_new(&mut conn, STREAM, GROUP, "only", 1);
    let _: i64 = redis::cmd("XACK").arg(STREAM).arg(GROUP).arg(&ids).query(&mut conn).unwrap();
    beat(&mut conn, &["only"]);
    assert_eq!(pass(&server, &s).reassigned, 1);
    assert_eq!(pel(&mut conn, STREAM, GROUP)[0].3, 3);
    // Acknowledged by its owner: the record of its hand-over goes with the next passes.
    let _: i64 = redis::cmd("XACK").arg(STREAM).arg(GROUP).arg(&failed).query(&mut conn).unwrap();
    pass(&server, &s);
    let left: i64 = redis::cmd("HLEN").arg("{jobs}:pelican:{jobs}:in:workers:handovers").query(&mut conn).unwrap();
    assert_eq!(left, 0);
}

/// Defect (issue 57.1): the hand-over's `XCLAIM` passed `minIdle` as its min-idle-time, so the entries of a consumer
/// whose Pod is gone, and entries without an owner, which are due whatever their idle time, were silently not
/// claimed, yet counted as reassigned (4 counted, all 4 still the gone consumer's). Now they are handed over at once
/// and counted only when the claim took them.
fn reassign_hands_a_gone_consumers_and_unowned_entries_over_at_once(flavor: Flavor) {
    let server = Server::start(flavor);
    let ids = seed(&server, &plain(6));
    let mut conn = server.conn();
    assert_eq!(read_new(&mut conn, STREAM, GROUP, "gone-pod", 4).len(), 4);
    assert_eq!(read_new(&mut conn, STREAM, GROUP, "", 1).len(), 1);
    assert_eq!(read_new(&mut conn, STREAM, GROUP, "live", 1).len(), 1);
    beat(&mut conn, &["live"]);
    // minIdle an hour: nothing here is idle; the gone consumer's and the unowned entry are due all the same.
    let s = PassSettings { min_idle: Duration::from_secs(3600), ..settings(ReclaimStrategy::Reassign, 5) };
    let report = runtime().block_on(async {
        let mut c = connect(&server).await;
        let mut cursor = Cursor::default();
        cursor.gone = vec!["gone-pod".to_string()];
        jobs::reclaim_pass(&mut c, "test", &keys(), &s, &mut cursor, &|| true).await.unwrap()
    });
    assert_eq!(report.reassigned, 5, "{report:?}");
    let owners: Vec<(String, String, i64)> =
        pel(&mut conn, STREAM, GROUP).into_iter().map(|(id, owner, _, count)| (id, owner, count)).collect();
    let expected: Vec<(String, String, i64)> =
        ids.iter().enumerate().map(|(i, id)| (id.clone(), "live".to_string(), if i < 5 { 2 } else { 1 })).collect();
    assert_eq!(owners, expected, "every entry the live consumer's, each hand-over counted");
    assert_eq!(hget(&mut conn, "{jobs}:pelican:{jobs}:in:workers:totals", "reassigned"), 5);
}

/// Defect (issue 57.2): with no consumer that looks live, `Reassign` left a due entry where it was, for ever: on Redis
/// 7.0 a lone worker waiting on new entries looks idle (an empty read does not reset `idle` before 7.2), so its
/// failed message was never retried nor dead-lettered. Now such an entry is requeued: a copy at the end of the stream
/// reaches whoever reads next.
fn reassign_with_no_consumer_that_looks_live_requeues(flavor: Flavor) {
    let server = Server::start(flavor);
    let ids = seed(&server, &plain(1));
    let mut conn = server.conn();
    // The lone worker read the message, failed it, and has read nothing since (idle past minIdle).
    read_and_leave_idle(&mut conn, "worker-0", 1);
    let s = settings(ReclaimStrategy::Reassign, 3);
    let report = pass(&server, &s);
    assert_eq!((report.requeued, report.reassigned, report.skipped), (1, 0, 0), "{report:?}");
    assert!(pel(&mut conn, STREAM, GROUP).is_empty(), "the original acknowledged");
    let entries = xrange(&mut conn, STREAM);
    assert_eq!(entries.len(), 2);
    assert_eq!(field(&entries[1], "pelican-origin-id"), Some(ids[0].as_bytes()));
    assert_eq!(field(&entries[1], "pelican-deliveries"), Some(&b"1"[..]));
    // The worker's next read of new entries gets the retry.
    assert_eq!(read_new(&mut conn, STREAM, GROUP, "worker-0", 10).len(), 1);
}

/// Defect (issue 57.4): "past the cap whatever its idle time" read a requeued copy's `pelican-deliveries` only for
/// copies an earlier call had found not due, so a copy that a worker kept claiming by itself (`XAUTOCLAIM` with a
/// short idle) never looked past the cap: a message with `maxDeliveries: 3` was dead-lettered at 6 deliveries.
fn a_requeued_copy_a_worker_keeps_claiming_is_dead_lettered_past_the_cap(flavor: Flavor) {
    let server = Server::start(flavor);
    let copy = vec![
        (b"n".to_vec(), b"1".to_vec()),
        (b"pelican-origin-id".to_vec(), b"1-0".to_vec()),
        (b"pelican-deliveries".to_vec(), b"2".to_vec()),
    ];
    let ids = seed(&server, &[copy]);
    let mut conn = server.conn();
    read_new(&mut conn, STREAM, GROUP, "claimer", 1);
    // The worker claims it again at once: its own count 2, the message's 4, and it never goes idle.
    let _: redis::Value =
        redis::cmd("XCLAIM").arg(STREAM).arg(GROUP).arg("claimer").arg(0).arg(&ids[0]).query(&mut conn).unwrap();
    let s = PassSettings { min_idle: Duration::from_secs(3600), ..settings(ReclaimStrategy::Requeue, 3) };
    let report = pass(&server, &s);
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    let dead = xrange(&mut conn, DLQ);
    assert_eq!(field(&dead[0], "pelican-deliveries"), Some(&b"4"[..]));
    assert_eq!(field(&dead[0], "pelican-reason"), Some(&b"MaxDeliveriesExceeded"[..]));
    assert!(pel(&mut conn, STREAM, GROUP).is_empty());
}

/// Defect (issue 57.8): the gone list is computed once for a sweep of many passes, and a StatefulSet Pod recreated
/// under the same name during the sweep lost what it had just read: its entries were taken as the gone Pod's. Now
/// only what the consumer read before it was found gone is.
fn what_a_pod_recreated_under_a_gone_name_reads_is_not_taken(flavor: Flavor) {
    let server = Server::start(flavor);
    let ids = seed(&server, &plain(2));
    let mut conn = server.conn();
    read_new(&mut conn, STREAM, GROUP, "pod-0", 1);
    std::thread::sleep(Duration::from_millis(600));
    // The sweep found pod-0 gone 300 ms ago; its new Pod reads the second entry now.
    let listed = std::time::Instant::now() - Duration::from_millis(300);
    read_new(&mut conn, STREAM, GROUP, "pod-0", 1);
    let s = PassSettings { min_idle: Duration::from_secs(3600), ..settings(ReclaimStrategy::Requeue, 5) };
    let report = runtime().block_on(async {
        let mut c = connect(&server).await;
        let mut cursor = Cursor::default();
        cursor.gone = vec!["pod-0".to_string()];
        cursor.gone_listed_at = Some(listed);
        jobs::reclaim_pass(&mut c, "test", &keys(), &s, &mut cursor, &|| true).await.unwrap()
    });
    assert_eq!(report.requeued, 1, "{report:?}");
    let pending: Vec<(String, String)> = pel(&mut conn, STREAM, GROUP).into_iter().map(|p| (p.0, p.1)).collect();
    assert_eq!(pending, [(ids[1].clone(), "pod-0".to_string())], "the new Pod keeps what it read");
}

/// Defect (found by the conformance suite): a hand-over that was the message's last delivery (its count now the cap)
/// was dead-lettered by the next pass, `minIdle` later, before its new owner had its look at its PEL (every 30 s):
/// the delivery the hand-over counted never happened. It now waits the hand-over grace like any other.
fn the_last_hand_over_is_left_to_its_new_owner_for_the_grace(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(2));
    let mut conn = server.conn();
    read_and_leave_idle(&mut conn, "a", 1);
    // "b" is live (Redis 7.0 creates a consumer only when a read gives it something).
    let done = read_new(&mut conn, STREAM, GROUP, "b", 1);
    let _: i64 = redis::cmd("XACK").arg(STREAM).arg(GROUP).arg(&done).query(&mut conn).unwrap();
    beat(&mut conn, &["b"]);
    let grace = Duration::from_secs(2);
    let s = PassSettings { handover_grace: grace, ..settings(ReclaimStrategy::Reassign, 2) };
    assert_eq!(pass(&server, &s).reassigned, 1);
    std::thread::sleep(IDLE * 2);
    let within = pass(&server, &s);
    assert_eq!((within.dead_lettered, within.skipped), (0, 1), "{within:?}");
    assert_eq!(pel(&mut conn, STREAM, GROUP)[0].3, 2, "still pending, handed over once");
    std::thread::sleep(grace);
    assert_eq!(pass(&server, &s).dead_lettered, 1, "after the grace, at the cap");
}

/// `count` consumers named `prefix-<n>`, created now and their workers beating (so they are live), pipelined.
fn create_consumers(conn: &mut redis::Connection, prefix: &str, count: usize) {
    let mut pipe = redis::pipe();
    for n in 0..count {
        pipe.cmd("XGROUP").arg("CREATECONSUMER").arg(STREAM).arg(GROUP).arg(format!("{prefix}-{n}")).ignore();
    }
    let _: () = pipe.query(conn).unwrap();
    let names: Vec<String> = (0..count).map(|n| format!("{prefix}-{n}")).collect();
    beat(conn, &names.iter().map(String::as_str).collect::<Vec<_>>());
}

/// One script call of a pass (the pass stops before its second call, as it does when leadership is lost).
fn one_call(server: &Server, settings: &PassSettings) -> jobs::PassReport {
    let calls = std::sync::atomic::AtomicUsize::new(0);
    runtime().block_on(async {
        let mut conn = connect(server).await;
        let may_write = || calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 0;
        jobs::reclaim_pass(&mut conn, "test", &keys(), settings, &mut Cursor::default(), &may_write).await.unwrap()
    })
}

/// Defect (issue 57, cost): Reassign listed every consumer inside the script (`XINFO CONSUMERS`, each made a Lua
/// table) and looked at every live one per due entry: 300,000 consumers held the server 1.8 s (Redis 7.0). Past
/// `CONSUMERS_LISTED_MAX` it lists none and requeues instead, and the report says how many there were.
fn reassign_past_the_consumers_it_lists_requeues_and_says_so(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(1));
    let mut conn = server.conn();
    read_and_leave_idle(&mut conn, "worker-0", 1);
    let many = jobs::CONSUMERS_LISTED_MAX as usize;
    create_consumers(&mut conn, "live", many);
    let report = pass(&server, &settings(ReclaimStrategy::Reassign, 3));
    assert_eq!((report.requeued, report.reassigned), (1, 0), "{report:?}");
    assert_eq!(report.consumers_unlisted, many as u64 + 1);
    assert!(pel(&mut conn, STREAM, GROUP).is_empty(), "the original acknowledged, its copy at the tail");
    assert_eq!(xrange(&mut conn, STREAM).len(), 2);
    // At the limit, it lists them and hands over.
    let server = Server::start(flavor);
    seed(&server, &plain(1));
    let mut conn = server.conn();
    read_and_leave_idle(&mut conn, "worker-0", 1);
    create_consumers(&mut conn, "live", many - 1);
    let report = pass(&server, &settings(ReclaimStrategy::Reassign, 3));
    assert_eq!((report.requeued, report.reassigned, report.consumers_unlisted), (0, 1, 0), "{report:?}");
    assert!(pel(&mut conn, STREAM, GROUP)[0].1.starts_with("live-"));
}

/// Consumer expiry and `spec.consumers.pods` list the consumers outside scripts; past `CONSUMERS_LISTED_MAX` they
/// do not, and the error names the count and what to do.
fn consumer_expiry_and_pod_matching_refuse_to_list_too_many_consumers(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(1));
    let mut conn = server.conn();
    create_consumers(&mut conn, "idle", jobs::CONSUMERS_LISTED_MAX as usize + 1);
    std::thread::sleep(IDLE * 2);
    let (expired, listed) = runtime().block_on(async {
        let mut c = connect(&server).await;
        (jobs::expire_consumers(&mut c, "test", &keys(), IDLE).await, jobs::consumers(&mut c, "test", &keys()).await)
    });
    for error in [expired.unwrap_err(), listed.unwrap_err()] {
        assert_eq!(error.reason(), "TooManyConsumers");
        let message = error.to_string();
        assert!(message.contains("has 1001 consumers, more than the 1000"), "{message}");
        assert!(message.contains("XGROUP DELCONSUMER"), "{message}");
    }
    let consumers: Vec<redis::Value> =
        redis::cmd("XINFO").arg("CONSUMERS").arg(STREAM).arg(GROUP).query(&mut conn).unwrap();
    assert_eq!(consumers.len(), 1001, "none deleted");
}

/// Defect (issue 57, cost): the byte budget counted bytes only, so entries of thousands of empty fields weighed
/// nothing and one call copied as many as its page held (3,900 small fields an entry: 194 ms on Redis 7.0). A field
/// now costs FIELD_COST (512) bytes beyond its length: one call takes what about 4 MB of such weight is.
fn a_call_charges_entries_of_many_empty_fields_what_they_cost(flavor: Flavor) {
    let server = Server::start(flavor);
    let empty: Vec<(Vec<u8>, Vec<u8>)> = (0..1995).map(|_| (Vec::new(), Vec::new())).collect();
    seed(&server, &vec![empty; 64]);
    let mut conn = server.conn();
    read_and_leave_idle(&mut conn, "crashed", 64);
    let report = one_call(&server, &settings(ReclaimStrategy::Requeue, 3));
    // 3,990 fields of 512 bytes each: 2 MB an entry, 2 of them in the 4 MB budget (the second reaches it).
    assert!((1..=3).contains(&report.requeued), "one call requeued {}: {report:?}", report.requeued);
    assert_eq!(pel(&mut conn, STREAM, GROUP).len() as u64, 64 - report.requeued);
    // The rest follow in the next calls of a pass.
    let report = pass(&server, &settings(ReclaimStrategy::Requeue, 3));
    assert!(pel(&mut conn, STREAM, GROUP).is_empty(), "{report:?}");
}

/// Defect (issue 57, cost): a deleted policy's group went in one `XGROUP DESTROY`, freeing its PEL and consumers in
/// one command (300,000 of each held Redis 7.0 119 ms, Valkey 9.1 389 ms). It is now taken apart 1,000 entries a
/// call: the pending entries acknowledged, each consumer deleted once it owns nothing, then destroyed.
fn a_group_is_destroyed_a_bounded_step_at_a_time(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(2500));
    let mut conn = server.conn();
    read_new(&mut conn, STREAM, GROUP, "a", 1000);
    read_new(&mut conn, STREAM, GROUP, "b", 1000);
    read_new(&mut conn, STREAM, GROUP, "c", 500);
    let creator = pelican::keys::creator_key(STREAM, GROUP);
    let _: () = redis::cmd("SET").arg(&creator).arg("uid-1").query(&mut conn).unwrap();
    // One call, as the operator makes it.
    let script = redis::Script::new(include_str!("../src/redis/scripts/destroy_group.lua"));
    let settings = pelican::keys::settings_key(STREAM, GROUP);
    let reply: Vec<String> = script
        .key(STREAM)
        .key(&creator)
        .key(&settings)
        .arg(GROUP)
        .arg("uid-1")
        .arg("0")
        .arg(1000)
        .invoke(&mut conn)
        .unwrap();
    assert_eq!(reply, ["step"]);
    assert_eq!(pel(&mut conn, STREAM, GROUP).len(), 1500, "a thousand acknowledged");
    let consumers: Vec<redis::Value> =
        redis::cmd("XINFO").arg("CONSUMERS").arg(STREAM).arg(GROUP).query(&mut conn).unwrap();
    assert_eq!(consumers.len(), 2, "the consumer that owned them, deleted");
    // Another policy's uid touches nothing.
    let reply: Vec<String> = script
        .key(STREAM)
        .key(&creator)
        .key(&settings)
        .arg(GROUP)
        .arg("uid-2")
        .arg("0")
        .arg(1000)
        .invoke(&mut conn)
        .unwrap();
    assert_eq!(reply, ["retained", "uid-1"]);
    assert_eq!(pel(&mut conn, STREAM, GROUP).len(), 1500);
    // The operator's call goes on until the group is gone.
    let destroyed = runtime().block_on(async {
        let mut c = connect(&server).await;
        pelican::redis::destroy_group(&mut c, "test", STREAM, GROUP, "uid-1", false).await.unwrap()
    });
    assert_eq!(destroyed, pelican::redis::Destroyed::Destroyed);
    let groups: Vec<redis::Value> = redis::cmd("XINFO").arg("GROUPS").arg(STREAM).query(&mut conn).unwrap();
    assert!(groups.is_empty());
    assert_eq!(xrange(&mut conn, STREAM).len(), 2500, "the stream itself stays");
    let exists: bool = redis::cmd("EXISTS").arg(&creator).query(&mut conn).unwrap();
    assert!(!exists);
}

/// Defect (issue 65.12, found by the chaos soak): Reassign took a consumer whose `XINFO` idle was under `minIdle` for
/// live and preferred the one with the fewest pending. A consumer whose process died owns nothing and won, each
/// hand-over counted a delivery no handler saw, and the hand-over itself (an `XCLAIM` to a consumer resets its idle)
/// kept it looking live for the next; Redis 7.0 also starts every consumer's idle again when it loads its AOF. Only
/// a worker's own heartbeat, which `lease.lua` writes at every lease tick, makes a consumer live now.
fn reassign_hands_over_only_to_consumers_whose_worker_beats(flavor: Flavor) {
    let server = Server::start(flavor);
    seed(&server, &plain(4));
    let mut conn = server.conn();
    let due = read_and_leave_idle(&mut conn, "crashed", 2);
    // "dead" read a moment ago (its XINFO idle is small) and owns nothing, but no worker of it beats.
    let read = read_new(&mut conn, STREAM, GROUP, "dead", 1);
    let _: i64 = redis::cmd("XACK").arg(STREAM).arg(GROUP).arg(&read).query(&mut conn).unwrap();
    // "alive" holds one entry, and its worker beats through the contract's own script.
    let held = read_new(&mut conn, STREAM, GROUP, "alive", 1);
    let lease = redis::Script::new(include_str!("../contract/scripts/lease.lua"));
    let extended: Vec<String> =
        lease.key(STREAM).key(HEARTBEATS).arg(GROUP).arg("alive").arg(&held).invoke(&mut conn).unwrap();
    assert_eq!(extended, held, "the lease still extends what the worker holds");
    // A heartbeat left by a worker long gone is pruned by the pass.
    let _: i64 = redis::cmd("HSET").arg(HEARTBEATS).arg("left-last-year").arg(1_000).query(&mut conn).unwrap();
    let report = pass(&server, &settings(ReclaimStrategy::Reassign, 5));
    assert_eq!(report.reassigned, 2, "{report:?}");
    let owners: Vec<(String, String)> = pel(&mut conn, STREAM, GROUP).into_iter().map(|p| (p.0, p.1)).collect();
    let expected: Vec<(String, String)> =
        [&due[..], &held[..]].concat().into_iter().map(|id| (id, "alive".to_string())).collect();
    assert_eq!(owners, expected, "every hand-over went to the consumer whose worker beats, none to \"dead\"");
    let left: Option<String> = redis::cmd("HGET").arg(HEARTBEATS).arg("left-last-year").query(&mut conn).unwrap();
    assert_eq!(left, None, "the stale heartbeat is pruned");
    // Without a heartbeat younger than minIdle, nobody is live: the next due entries are requeued, never handed over.
    std::thread::sleep(IDLE * 2);
    let report = pass(&server, &settings(ReclaimStrategy::Reassign, 5));
    assert_eq!((report.reassigned, report.requeued), (0, 3), "{report:?}");
}

/// The CPU time the server has used so far, in seconds (its main process: user and system).
fn server_cpu(conn: &mut redis::Connection) -> f64 {
    let info: String = redis::cmd("INFO").arg("cpu").query(conn).unwrap();
    info.lines()
        .filter_map(|line| line.strip_prefix("used_cpu_user:").or_else(|| line.strip_prefix("used_cpu_sys:")))
        .map(|value| value.trim().parse::<f64>().unwrap())
        .sum()
}

/// The script calls (`EVAL`, `EVALSHA`) the server has run so far.
fn script_calls(conn: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(conn).unwrap();
    info.lines()
        .filter_map(|line| {
            line.strip_prefix("cmdstat_evalsha:calls=").or_else(|| line.strip_prefix("cmdstat_eval:calls="))
        })
        .map(|rest| rest.split(',').next().unwrap().parse::<u64>().unwrap())
        .sum()
}
