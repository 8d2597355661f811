//! When Redis loses data (issue 51.3): a server restarted from an older snapshot, then flushed, under a running
//! operator, as a user sees it. Redis is the only record of the groups, their PELs and Pelican's counters, so those
//! go back with it; a finished `DeadLetterRedrive` or `GroupSeek` is recorded twice, in Redis and in its own status,
//! and the status alone keeps it from running again once Redis forgot it.

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

fn dead_lettered(ns: &str) -> i64 {
    get_policy(ns, "p")["status"]["totals"]["deadLettered"].as_i64().unwrap_or(-1)
}

fn wait_dead_lettered(ns: &str, expected: i64) {
    wait_for(&format!("status.totals.deadLettered {expected}"), Duration::from_secs(30), || {
        let counted = dead_lettered(ns);
        if counted == expected { Ok(()) } else { Err(counted.to_string()) }
    });
}

/// `count` messages read by a consumer that dies with them: dead-lettered after `minIdle` (maxDeliveries 1).
fn poison(conn: &mut redis::Connection, count: usize) {
    for n in 0..count {
        let _: String = redis::cmd("XADD").arg("s").arg("*").arg("n").arg(n).query(conn).unwrap();
    }
    assert_eq!(read_new(conn, "s", "g", "dies", count).len(), count);
}

fn object(ns: &str, kind: &str, name: &str) -> Value {
    serde_json::from_str(&kubectl_ok(&["get", kind, name, "-n", ns, "-o", "json"])).unwrap()
}

fn wait_succeeded(ns: &str, kind: &str, name: &str) -> Value {
    wait_for(&format!("{kind} {name} Succeeded"), Duration::from_secs(60), || {
        let found = object(ns, kind, name);
        if found["status"]["phase"] == "Succeeded" { Ok(found) } else { Err(found["status"].to_string()) }
    })
}

fn last_delivered(conn: &mut redis::Connection) -> String {
    let groups = xinfo_groups(conn, "s");
    group_field(&groups[0], "last-delivered-id")
}

#[test]
fn a_server_restarted_from_an_older_snapshot_then_flushed() {
    let mut server = Server::start(Flavor::Redis);
    let manifest = policy("p", &server.url(), "s", "g", "  retry:\n    maxDeliveries: 1\n")
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n");
    let (ns, _operator) = ready_policy("restore", &manifest, "p");
    let mut conn = server.conn();

    // The snapshot: three dead letters, counted.
    poison(&mut conn, 3);
    wait_dead_lettered(&ns, 3);
    let _: () = redis::cmd("SAVE").query(&mut conn).unwrap();
    let snapshot = server.data_dir().join("snapshot.rdb");
    std::fs::copy(server.data_dir().join("dump.rdb"), &snapshot).unwrap();
    let delivered_at_snapshot = last_delivered(&mut conn);

    // After it: two more dead letters, a redrive of all five back to the stream, and a seek past them.
    poison(&mut conn, 2);
    wait_dead_lettered(&ns, 5);
    assert!(kubectl_apply(&ns, "apiVersion: pelican.io/v1alpha1\nkind: DeadLetterRedrive\nmetadata:\n  name: back\nspec:\n  policyRef:\n    name: p\n").0);
    let redrive = wait_succeeded(&ns, "dlr", "back");
    assert_eq!(redrive["status"]["moved"], 5, "{}", redrive["status"]);
    let seek = "apiVersion: pelican.io/v1alpha1\nkind: GroupSeek\nmetadata:\n  name: skip\nspec:\n  policyRef: {name: p}\n  to: {position: Latest}\n  consumersIdleFor: 0s\n";
    assert!(kubectl_apply(&ns, seek).0);
    let sought = wait_succeeded(&ns, "seek", "skip");
    let delivered_after_seek = last_delivered(&mut conn);
    assert_ne!(delivered_after_seek, delivered_at_snapshot);

    // The server comes back from the snapshot: what Redis held goes back with it.
    server.stop();
    std::fs::copy(&snapshot, server.data_dir().join("dump.rdb")).unwrap();
    server.resume();
    let mut conn = server.conn();
    wait_dead_lettered(&ns, 3);
    assert_eq!(xrange(&mut conn, "s:dlq").len(), 3, "the snapshot's dead letters");
    assert_eq!(last_delivered(&mut conn), delivered_at_snapshot, "the group where the snapshot had it");
    // The finished redrive and seek are not run again, although Redis no longer has their records: several passes
    // later the snapshot's three dead letters are still there and the group has not moved.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(xrange(&mut conn, "s:dlq").len(), 3, "the redrive ran again");
    assert_eq!(last_delivered(&mut conn), delivered_at_snapshot, "the seek ran again");
    assert_eq!(object(&ns, "dlr", "back")["status"], redrive["status"]);
    assert_eq!(object(&ns, "seek", "skip")["status"], sought["status"]);
    println!(
        "restored: deadLettered 5 -> 3, the group back at {delivered_at_snapshot}; redrive and seek not run again"
    );

    // Flushed: the group is re-created at startId, with a Warning; the counters start from zero.
    let _: () = redis::cmd("FLUSHALL").query(&mut conn).unwrap();
    let recreated = wait_for("a GroupRecreated Event", Duration::from_secs(30), || {
        events(&ns, "GroupRecreated").into_iter().next().ok_or_else(|| "none".to_string())
    });
    assert_eq!(recreated["type"], "Warning");
    println!("{}", recreated["message"]);
    assert_eq!(group_names(&mut conn, "s"), ["g"]);
    wait_dead_lettered(&ns, 0);
    std::thread::sleep(Duration::from_secs(3));
    assert!(xrange(&mut conn, "s:dlq").is_empty(), "nothing redriven or dead-lettered from nothing");
    assert_eq!(object(&ns, "seek", "skip")["status"], sought["status"]);
}
