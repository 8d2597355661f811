//! `mode: Cluster` on a real three-primary Redis Cluster (Redis 7.0 and Valkey 9.1), started by the test.

#[macro_use]
mod common;

use std::time::Duration;

use common::*;

on_both_servers!(
    a_cluster_policy_is_ready_and_dead_letters_in_the_streams_slot,
    keys_in_different_slots_are_refused_before_any_write,
    a_node_down_is_redis_unavailable_then_heals,
);

fn cluster_policy(name: &str, cluster: &Cluster, stream: &str, dead_letter: &str, extra: &str) -> String {
    policy(name, &cluster.url(), stream, "workers", extra)
        .replace(&format!("{stream}:dlq"), dead_letter)
        .replacen("  stream:", "    mode: Cluster\n  stream:", 1)
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n")
}

fn a_cluster_policy_is_ready_and_dead_letters_in_the_streams_slot(flavor: Flavor) {
    let cluster = Cluster::start(flavor);
    let ns = namespace("cluster");
    let _operator = Operator::start(&ns);
    let manifest =
        cluster_policy("orders", &cluster, "{orders}:events", "{orders}:dlq", "  retry:\n    maxDeliveries: 1\n");
    assert!(kubectl_apply(&ns, &manifest).0);
    wait_condition(&ns, "orders", "Ready", "True", "Reconciled");
    let mut conn = cluster.conn();
    for n in 0..10 {
        let _: String = redis::cmd("XADD").arg("{orders}:events").arg("*").arg("n").arg(n).query(&mut conn).unwrap();
    }
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("workers")
        .arg("crashed")
        .arg("COUNT")
        .arg(10)
        .arg("STREAMS")
        .arg("{orders}:events")
        .arg(">")
        .query(&mut conn)
        .unwrap();
    let p = wait_for("10 dead-lettered", Duration::from_secs(30), || {
        let p = get_policy(&ns, "orders");
        if p["status"]["totals"]["deadLettered"] == 10 { Ok(p) } else { Err(p["status"].to_string()) }
    });
    assert_eq!(p["status"]["pending"], 0);
    assert_eq!(p["status"]["deadLetterLength"], 10);
    let dead: i64 = redis::cmd("XLEN").arg("{orders}:dlq").query(&mut conn).unwrap();
    assert_eq!(dead, 10);
    let counted: i64 =
        redis::cmd("HGET").arg("{orders}:pelican:workers:totals").arg("deadLettered").query(&mut conn).unwrap();
    assert_eq!(counted, 10);
}

fn keys_in_different_slots_are_refused_before_any_write(flavor: Flavor) {
    let cluster = Cluster::start(flavor);
    let ns = namespace("crossslot");
    let _operator = Operator::start(&ns);
    assert!(kubectl_apply(&ns, &cluster_policy("split", &cluster, "orders", "orders-dlq", "")).0);
    let p = wait_condition(&ns, "split", "Stalled", "True", "CrossSlot");
    let message = p.to_string();
    assert!(
        message.contains("{orders}:events") && message.contains("{orders}:dlq"),
        "the message shows names to use: {message}"
    );
    let exists: i64 = redis::cmd("EXISTS").arg("orders").query(&mut cluster.conn()).unwrap();
    assert_eq!(exists, 0, "nothing is written for a cross-slot policy");
}

fn a_node_down_is_redis_unavailable_then_heals(flavor: Flavor) {
    let mut cluster = Cluster::start(flavor);
    let ns = namespace("nodedown");
    let mut operator = Operator::start(&ns);
    assert!(kubectl_apply(&ns, &cluster_policy("p", &cluster, "{down}:s", "{down}:dlq", "")).0);
    wait_condition(&ns, "p", "Ready", "True", "Reconciled");
    cluster.owner("{down}:s").stop();
    let p = wait_for("Ready=False while the node is down", Duration::from_secs(60), || {
        let p = get_policy(&ns, "p");
        match condition(&p, "Ready") {
            Some((s, _)) if s == "False" => Ok(p),
            other => Err(format!("{other:?}")),
        }
    });
    assert_eq!(condition(&p, "Ready").unwrap().1, "RedisUnavailable", "{}", p["status"]);
    cluster.owner("{down}:s").resume();
    cluster.wait_ok();
    wait_condition(&ns, "p", "Ready", "True", "Reconciled");
    assert!(operator.is_running());
}
