//! Counter keys that name the stream: streams sharing a hash tag never share counters, the 0.1
//! keys are carried over once when unambiguous, and key names that still collide are a ResourceConflict.

#[macro_use]
mod common;

use std::time::Duration;

use common::*;
use pelican::keys::{terminal_key, totals_key};
use pelican::worker::{Reason, ack_terminal};
use serde_json::Value;

on_both_servers!(
    streams_sharing_a_hash_tag_keep_their_own_terminal_counts,
    counts_in_the_old_keys_are_carried_over_once,
    counts_in_old_keys_shared_by_two_streams_are_left_alone,
    policies_whose_key_names_collide_are_a_conflict,
);

fn terminal_acks(policy: &Value) -> Vec<(String, i64)> {
    let list = policy["status"]["terminalAcks"].as_array().cloned().unwrap_or_default();
    list.iter().map(|t| (t["reason"].as_str().unwrap().to_string(), t["count"].as_i64().unwrap())).collect()
}

fn wait_terminal_acks(ns: &str, name: &str, expected: &[(&str, i64)]) -> Value {
    let expected: Vec<(String, i64)> = expected.iter().map(|(r, n)| (r.to_string(), *n)).collect();
    wait_for(&format!("{name} terminalAcks {expected:?}"), Duration::from_secs(30), || {
        let p = get_policy(ns, name);
        if terminal_acks(&p) == expected { Ok(p) } else { Err(p["status"].to_string()) }
    })
}

/// End `count` messages of `stream` as terminal with `reason`, as a worker does.
fn end_as_terminal(server: &Server, stream: &str, group: &str, reason: &str, count: usize) {
    let mut conn = server.conn();
    for n in 0..count {
        let _: String = redis::cmd("XADD").arg(stream).arg("*").arg("n").arg(n).query(&mut conn).unwrap();
    }
    let ids = read_new(&mut conn, stream, group, "worker", count);
    let reason = Reason::new(reason).unwrap();
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
        let client = redis::Client::open(server.url()).unwrap();
        let mut writer = redis::aio::ConnectionManager::new(client).await.unwrap();
        for id in &ids {
            assert!(ack_terminal(&mut writer, stream, group, id, &reason).await.unwrap());
        }
    });
}

fn streams_sharing_a_hash_tag_keep_their_own_terminal_counts(flavor: Flavor) {
    let server = Server::start(flavor);
    let ns = namespace("sharedtag");
    let operator = Operator::start(&ns);
    let events = policy("events", &server.url(), "{orders}:events", "billing", "");
    let refunds = policy("refunds", &server.url(), "{orders}:refunds", "billing", "");
    assert!(kubectl_apply(&ns, &format!("{events}\n---\n{refunds}")).0);
    wait_all_ready(&ns, 2, Duration::from_secs(30));
    end_as_terminal(&server, "{orders}:events", "billing", "RecordNotFound", 3);
    end_as_terminal(&server, "{orders}:refunds", "billing", "AlreadyRefunded", 5);

    wait_terminal_acks(&ns, "events", &[("RecordNotFound", 3)]);
    wait_terminal_acks(&ns, "refunds", &[("AlreadyRefunded", 5)]);
    let metrics = operator.metrics();
    let series = |policy: &str, reason: &str| {
        metrics
            .lines()
            .find(|l| {
                l.starts_with("pelican_terminal_acks_total{")
                    && l.contains(&format!("policy=\"{policy}\""))
                    && l.contains(&format!("reason=\"{reason}\""))
            })
            .map(|l| l.rsplit(' ').next().unwrap().to_string())
    };
    assert_eq!(series("events", "RecordNotFound").as_deref(), Some("3"), "{metrics}");
    assert_eq!(series("refunds", "AlreadyRefunded").as_deref(), Some("5"));
    assert_eq!(series("events", "AlreadyRefunded"), None, "one policy shows another's counts");
    assert_eq!(series("refunds", "RecordNotFound"), None, "one policy shows another's counts");
}

fn counts_in_the_old_keys_are_carried_over_once(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    let _: () = redis::cmd("HSET")
        .arg("{files}:pelican:converters:terminal")
        .arg("RecordNotFound")
        .arg(7)
        .query(&mut conn)
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg("{files}:pelican:converters:totals")
        .arg("deadLettered")
        .arg(2)
        .query(&mut conn)
        .unwrap();
    let ns = namespace("carryover");
    let _operator = Operator::start(&ns);
    assert!(kubectl_apply(&ns, &policy("files", &server.url(), "files", "converters", "")).0);
    let p = wait_terminal_acks(&ns, "files", &[("RecordNotFound", 7)]);
    assert_eq!(p["status"]["totals"]["deadLettered"], 2);
    let old: i64 = redis::cmd("EXISTS")
        .arg("{files}:pelican:converters:terminal")
        .arg("{files}:pelican:converters:totals")
        .query(&mut conn)
        .unwrap();
    assert_eq!(old, 0, "the old keys are gone once carried over");
    let new: i64 =
        redis::cmd("HGET").arg(terminal_key("files", "converters")).arg("RecordNotFound").query(&mut conn).unwrap();
    assert_eq!(new, 7);
    let carried = events(&ns, "CountersCarriedOver");
    assert_eq!(carried.len(), 1, "{carried:?}");
    // Later reconciles (interval 1s) carry nothing again.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(terminal_acks(&get_policy(&ns, "files")), [("RecordNotFound".to_string(), 7)]);
    let again: i64 =
        redis::cmd("HGET").arg(totals_key("files", "converters")).arg("deadLettered").query(&mut conn).unwrap();
    assert_eq!(again, 2);
}

fn counts_in_old_keys_shared_by_two_streams_are_left_alone(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    let _: () = redis::cmd("HSET")
        .arg("{orders}:pelican:billing:terminal")
        .arg("RecordNotFound")
        .arg(9)
        .query(&mut conn)
        .unwrap();
    let ns = namespace("ambiguous");
    let _operator = Operator::start(&ns);
    let events = policy("events", &server.url(), "{orders}:events", "billing", "");
    let refunds = policy("refunds", &server.url(), "{orders}:refunds", "billing", "");
    assert!(kubectl_apply(&ns, &format!("{events}\n---\n{refunds}")).0);
    wait_all_ready(&ns, 2, Duration::from_secs(30));
    std::thread::sleep(Duration::from_secs(2));
    assert!(terminal_acks(&get_policy(&ns, "events")).is_empty(), "counts of two streams given to one");
    assert!(terminal_acks(&get_policy(&ns, "refunds")).is_empty(), "counts of two streams given to one");
    let old: i64 =
        redis::cmd("HGET").arg("{orders}:pelican:billing:terminal").arg("RecordNotFound").query(&mut conn).unwrap();
    assert_eq!(old, 9, "ambiguous old counts stay where they are");
}

fn policies_whose_key_names_collide_are_a_conflict(flavor: Flavor) {
    let server = Server::start(flavor);
    let ns = namespace("collide");
    let _operator = Operator::start(&ns);
    // "{x}a" + "b:c" and "{x}a:b" + "c" both give {x}:pelican:{x}a:b:c:terminal.
    assert_eq!(terminal_key("{x}a", "b:c"), terminal_key("{x}a:b", "c"));
    assert!(kubectl_apply(&ns, &policy("first", &server.url(), "{x}a", "\"b:c\"", "")).0);
    wait_condition(&ns, "first", "Ready", "True", "Reconciled");
    std::thread::sleep(Duration::from_millis(1100)); // creation timestamps have one-second resolution
    assert!(kubectl_apply(&ns, &policy("second", &server.url(), "{x}a:b", "c", "")).0);
    let p = wait_condition(&ns, "second", "Stalled", "True", "ResourceConflict");
    let message = p["status"]["conditions"].to_string();
    assert!(message.contains(&format!("{ns}/first")) && message.contains("{x}:pelican:{x}a:b:c:terminal"), "{message}");
    let groups = group_names(&mut server.conn(), "{x}a:b");
    assert!(groups.is_empty(), "the refused policy must not create its group");
}
