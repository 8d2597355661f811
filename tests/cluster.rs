//! `mode: Cluster` on a real three-primary Redis Cluster (Redis 7.0 and Valkey 9.1), started by the test.

#[macro_use]
mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use common::*;

on_every_server!(
    a_cluster_policy_is_ready_and_dead_letters_in_the_streams_slot,
    keys_in_different_slots_are_refused_before_any_write,
    a_node_down_is_redis_unavailable_then_heals,
    kill_9_and_a_slot_migration_during_dead_lettering_lose_and_duplicate_nothing,
    a_password_protected_cluster_takes_the_password_from_the_secret,
    hash_slots_of_stream_and_counter_keys_match_cluster_keyslot,
    a_stream_whose_counters_cannot_share_its_slot_is_cross_slot,
    bounded_publish_and_retention_work_in_the_streams_slot,
    a_redrive_moves_within_the_slot_and_refuses_a_target_in_another,
    a_seek_moves_the_group_in_the_streams_slot,
    the_streams_primary_killed_while_50000_messages_are_dead_lettered_its_replica_takes_over,
);

/// Tricky names: tags, empty tags, braces in odd places, a stray `}`.
const NAMES: [&str; 12] = [
    "orders",
    "{orders}:events",
    "a{b}c{d}",
    "{a{b}x",
    "open{only",
    "x}{tag}",
    "a}b",
    "jobs{}v2",
    "}",
    "{}",
    "{}{x}",
    "é{ü}",
];

fn hash_slots_of_stream_and_counter_keys_match_cluster_keyslot(flavor: Flavor) {
    let cluster = Cluster::start(flavor);
    let mut conn = cluster.conn();
    let keyslot = |conn: &mut redis::cluster::ClusterConnection, key: &str| -> u16 {
        redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query(conn).unwrap()
    };
    for name in NAMES {
        assert_eq!(pelican::keys::slot(name), keyslot(&mut conn, name), "slot of {name:?}");
        let totals = pelican::keys::totals_key(name, "g");
        let same = keyslot(&mut conn, &totals) == keyslot(&mut conn, name);
        assert_eq!(pelican::keys::has_same_slot_keys(name), same, "{name:?}: {totals:?} in the stream's slot");
    }
}

fn a_stream_whose_counters_cannot_share_its_slot_is_cross_slot(flavor: Flavor) {
    let cluster = Cluster::start(flavor);
    let ns = namespace("straybrace");
    let _operator = Operator::start(&ns);
    // A dead-letter stream that happens to share the slot of "a}b", so only the counters are in another slot.
    let stream = "a}b";
    let dead_letter = (0..)
        .map(|n| format!("dlq-{n}"))
        .find(|name| pelican::keys::slot(name) == pelican::keys::slot(stream))
        .unwrap();
    let manifest = cluster_policy("stray", &cluster, stream, &dead_letter, "");
    assert!(kubectl_apply(&ns, &manifest).0);
    let p = wait_condition(&ns, "stray", "Stalled", "True", "CrossSlot");
    let message = p["status"]["conditions"].to_string();
    assert!(message.contains("hash tag") && message.contains("{ab}:events"), "{message}");
    let exists: i64 = redis::cmd("EXISTS").arg(stream).query(&mut cluster.conn()).unwrap();
    assert_eq!(exists, 0, "nothing is written");
}

fn cluster_policy(name: &str, cluster: &Cluster, stream: &str, dead_letter: &str, extra: &str) -> String {
    policy(name, &cluster.url(), stream, "workers", extra)
        .replace(&format!("{stream}:dlq"), dead_letter)
        .replacen("  stream:", "    mode: Cluster\n  stream:", 1)
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n")
}

fn a_cluster_policy_is_ready_and_dead_letters_in_the_streams_slot(flavor: Flavor) {
    let cluster = Cluster::start(flavor);
    let manifest =
        cluster_policy("orders", &cluster, "{orders}:events", "{orders}:dlq", "  retry:\n    maxDeliveries: 1\n");
    let (ns, _operator) = ready_policy("cluster", &manifest, "orders");
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
    let counted: i64 = redis::cmd("HGET")
        .arg(pelican::keys::totals_key("{orders}:events", "workers"))
        .arg("deadLettered")
        .query(&mut conn)
        .unwrap();
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
    let (ns, mut operator) =
        ready_policy("nodedown", &cluster_policy("p", &cluster, "{down}:s", "{down}:dlq", ""), "p");
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

/// Values of field `n` in a stream of the cluster, with how often each appears.
fn count_n(conn: &mut redis::cluster::ClusterConnection, stream: &str) -> HashMap<u64, usize> {
    let raw: Vec<(String, Vec<Vec<u8>>)> = redis::cmd("XRANGE").arg(stream).arg("-").arg("+").query(conn).unwrap();
    let mut seen = HashMap::new();
    for (_, n) in entries_n(raw) {
        *seen.entry(n.expect("every entry keeps its fields")).or_default() += 1;
    }
    seen
}

fn kill_9_and_a_slot_migration_during_dead_lettering_lose_and_duplicate_nothing(flavor: Flavor) {
    const TOTAL: u64 = 20_000;
    let mut cluster = Cluster::start(flavor);
    let ns = namespace("clusterchaos");
    let mut operator = Operator::start(&ns);
    let extra = "  retry:\n    maxDeliveries: 2\n";
    let manifest = cluster_policy("chaos", &cluster, "{mig}:in", "{mig}:dlq", extra);
    assert!(kubectl_apply(&ns, &manifest.replace("    minIdle: 1s\n", "    minIdle: 1s\n    maxPerPass: 100000\n")).0);
    wait_condition(&ns, "chaos", "Ready", "True", "Reconciled");
    let mut conn = cluster.conn();
    for start in (0..TOTAL).step_by(1000) {
        let mut pipe = redis::cluster::cluster_pipe();
        for n in start..(start + 1000).min(TOTAL) {
            pipe.cmd("XADD").arg("{mig}:in").arg("*").arg("n").arg(n).ignore();
        }
        let _: () = pipe.query(&mut conn).unwrap();
    }

    // A consumer that reads everything and acknowledges nothing: every message must end in the dead-letter stream.
    let stop = Arc::new(AtomicBool::new(false));
    let urls: Vec<String> = cluster.nodes.iter().map(|n| n.url()).collect();
    let consumer = {
        let stop = stop.clone();
        thread::spawn(move || {
            let client = redis::cluster::ClusterClient::new(urls).unwrap();
            while !stop.load(Ordering::Relaxed) {
                let Ok(mut conn) = client.get_connection() else { continue };
                while !stop.load(Ordering::Relaxed) {
                    let read: redis::RedisResult<redis::Value> = redis::cmd("XREADGROUP")
                        .arg("GROUP")
                        .arg("workers")
                        .arg("flaky")
                        .arg("COUNT")
                        .arg(5000)
                        .arg("STREAMS")
                        .arg("{mig}:in")
                        .arg(">")
                        .query(&mut conn);
                    if read.is_err() {
                        thread::sleep(Duration::from_millis(50));
                        break;
                    }
                    thread::sleep(Duration::from_millis(100));
                }
            }
        })
    };

    let mut rng = Lcg(Instant::now().elapsed().as_nanos() as u64 ^ 0xc1u64);
    for round in 0..12 {
        thread::sleep(Duration::from_millis(rng.next_in(200, 1_200)));
        if round == 4 || round == 8 {
            // While the operator is alive and passing: its scripts meet ASK, TRYAGAIN and then MOVED.
            let before = cluster.owner("{mig}:in").port;
            cluster.migrate_slot_of("{mig}:in");
            assert_ne!(cluster.owner("{mig}:in").port, before, "the stream's slot moved to another node");
            assert!(operator.is_running(), "a slot migration must not stop the operator");
        }
        operator.kill9();
        operator = Operator::start(&ns);
    }

    wait_for("every message in the dead-letter stream", Duration::from_secs(180), || {
        let dead: usize = count_n(&mut conn, "{mig}:dlq").values().sum();
        let pending: (i64, redis::Value, redis::Value, redis::Value) =
            redis::cmd("XPENDING").arg("{mig}:in").arg("workers").query(&mut conn).map_err(|e| e.to_string())?;
        if dead as u64 >= TOTAL && pending.0 == 0 { Ok(()) } else { Err(format!("dead {dead}, pending {}", pending.0)) }
    });
    stop.store(true, Ordering::Relaxed);
    consumer.join().unwrap();
    let dead = count_n(&mut conn, "{mig}:dlq");
    let duplicated: Vec<_> = dead.iter().filter(|(_, c)| **c > 1).take(10).collect();
    assert!(duplicated.is_empty(), "dead-lettered more than once: {duplicated:?}");
    let missing: Vec<u64> = (0..TOTAL).filter(|n| !dead.contains_key(n)).take(10).collect();
    assert!(missing.is_empty(), "lost: {missing:?}");
    let counted: i64 = redis::cmd("HGET")
        .arg(pelican::keys::totals_key("{mig}:in", "workers"))
        .arg("deadLettered")
        .query(&mut conn)
        .unwrap();
    assert_eq!(counted as u64, TOTAL);
}

fn a_password_protected_cluster_takes_the_password_from_the_secret(flavor: Flavor) {
    let cluster = Cluster::start_with_password(flavor, Some("cluster-pw-1"));
    let ns = namespace("clusterauth");
    let operator = Operator::start(&ns);
    let secret = "apiVersion: v1\nkind: Secret\nmetadata:\n  name: auth\nstringData:\n  password: cluster-pw-1\n";
    let manifest = cluster_policy("p", &cluster, "{auth}:s", "{auth}:dlq", "").replacen(
        "  stream:",
        "    passwordSecretRef: {name: auth, key: password}\n  stream:",
        1,
    );
    assert!(kubectl_apply(&ns, &format!("{secret}---\n{manifest}")).0);
    wait_condition(&ns, "p", "Ready", "True", "Reconciled");
    let groups = group_names(&mut cluster.conn(), "{auth}:s");
    assert_eq!(groups.len(), 1);
    assert!(!operator.logs().contains("cluster-pw-1"));
}

/// The bounded-publish script's three keys and the retention trim's keys are in the stream's slot, so both run
/// on a cluster (a CROSSSLOT error would say otherwise), whichever node owns the slot.
fn bounded_publish_and_retention_work_in_the_streams_slot(flavor: Flavor) {
    use pelican::keys::{bounds_key, rejected_key};
    let cluster = Cluster::start(flavor);
    let mut conn = cluster.conn();
    let stream = "{orders}:events";
    let _: () =
        redis::cmd("XGROUP").arg("CREATE").arg(stream).arg("g").arg("0").arg("MKSTREAM").query(&mut conn).unwrap();
    let _: () = redis::cmd("HSET").arg(bounds_key(stream)).arg("g").arg(3).query(&mut conn).unwrap();
    let script = redis::Script::new(pelican::worker::BOUNDED_PUBLISH_LUA);
    let publish = |conn: &mut redis::cluster::ClusterConnection, n: u32| -> redis::RedisResult<String> {
        script.key(stream).key(bounds_key(stream)).key(rejected_key(stream)).arg("n").arg(n).invoke(conn)
    };
    let ids: Vec<String> = (0..3).map(|n| publish(&mut conn, n).unwrap()).collect();
    let refused = publish(&mut conn, 3).unwrap_err();
    assert_eq!(refused.code(), Some("PELICAN_BACKLOG_FULL"), "{refused}");
    // A consumer reads and acknowledges two; the trim removes exactly those.
    let read: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("g")
        .arg("c")
        .arg("COUNT")
        .arg(2)
        .arg("STREAMS")
        .arg(stream)
        .arg(">")
        .query(&mut conn)
        .unwrap();
    assert_eq!(read.keys[0].ids.len(), 2);
    let _: i64 = redis::cmd("XACK").arg(stream).arg("g").arg(&ids[..2]).query(&mut conn).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let trim = runtime.block_on(async {
        let target = pelican::redis::Target { cluster: true, ..pelican::redis::Target::new(cluster.url()) };
        let mut conn = pelican::redis::Pools::default().get(&target).await.unwrap();
        let keys = pelican::redis::GroupKeys { stream, group: "g", dead_letter: "{orders}:dlq" };
        pelican::jobs::trim_acknowledged(&mut conn, "cluster", &keys, Duration::ZERO, false).await.unwrap()
    });
    assert_eq!(trim.trimmed, 2);
    let left: Vec<(String, HashMap<String, String>)> =
        redis::cmd("XRANGE").arg(stream).arg("-").arg("+").query(&mut conn).unwrap();
    assert_eq!(left.into_iter().map(|(id, _)| id).collect::<Vec<_>>(), ids[2..]);
}

/// A redrive on a Cluster: every move is one script, so the target shares the dead-letter stream's slot; a target
/// in another slot fails with CrossSlot before anything moves.
fn a_redrive_moves_within_the_slot_and_refuses_a_target_in_another(flavor: Flavor) {
    let cluster = Cluster::start(flavor);
    let manifest = cluster_policy("orders", &cluster, "{orders}:events", "{orders}:dlq", "");
    let (ns, _operator) = ready_policy("cluster-redrive", &manifest, "orders");
    let mut conn = cluster.conn();
    for n in 0..20 {
        let _: String = redis::cmd("XADD")
            .arg("{orders}:dlq")
            .arg("*")
            .arg("n")
            .arg(n)
            .arg("pelican-source-stream")
            .arg("{orders}:events")
            .arg("pelican-reason")
            .arg("MaxDeliveriesExceeded")
            .query(&mut conn)
            .unwrap();
    }
    let redrive = |name: &str, extra: &str| {
        format!(
            "apiVersion: pelican.io/v1alpha1\nkind: DeadLetterRedrive\nmetadata:\n  name: {name}\nspec:\n  policyRef: {{name: orders}}\n{extra}"
        )
    };
    let phase = |name: &str, want: &str| {
        wait_for(&format!("{name} {want}"), Duration::from_secs(30), || {
            let object: serde_json::Value =
                serde_json::from_str(&kubectl_ok(&["get", "dlr", name, "-n", &ns, "-o", "json"])).unwrap();
            if object["status"]["phase"] == want { Ok(object) } else { Err(object["status"].to_string()) }
        })
    };
    assert!(kubectl_apply(&ns, &redrive("elsewhere", "  target: other-stream\n")).0);
    let failed = phase("elsewhere", "Failed");
    let reason = failed["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Failed").unwrap();
    assert_eq!(reason["reason"], "CrossSlot", "{failed}");
    let dead: i64 = redis::cmd("XLEN").arg("{orders}:dlq").query(&mut conn).unwrap();
    assert_eq!(dead, 20, "nothing moved");
    assert!(kubectl_apply(&ns, &redrive("home", "")).0);
    let done = phase("home", "Succeeded");
    assert_eq!(done["status"]["moved"], 20);
    let dead: i64 = redis::cmd("XLEN").arg("{orders}:dlq").query(&mut conn).unwrap();
    let back: i64 = redis::cmd("XLEN").arg("{orders}:events").query(&mut conn).unwrap();
    assert_eq!((dead, back), (0, 20));
}

fn a_seek_moves_the_group_in_the_streams_slot(flavor: Flavor) {
    let cluster = Cluster::start(flavor);
    let manifest = cluster_policy("orders", &cluster, "{orders}:events", "{orders}:dlq", "");
    let (ns, _operator) = ready_policy("cluster-seek", &manifest, "orders");
    let mut conn = cluster.conn();
    for n in 0..100 {
        let _: String = redis::cmd("XADD").arg("{orders}:events").arg("*").arg("n").arg(n).query(&mut conn).unwrap();
    }
    let read = |conn: &mut redis::cluster::ClusterConnection| -> usize {
        let reply: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("workers")
            .arg("c1")
            .arg("COUNT")
            .arg(1000)
            .arg("STREAMS")
            .arg("{orders}:events")
            .arg(">")
            .query(conn)
            .unwrap();
        reply.keys.iter().map(|k| k.ids.len()).sum()
    };
    assert_eq!(read(&mut conn), 100);
    let seek = |name: &str, policy: &str| {
        format!(
            "apiVersion: pelican.io/v1alpha1\nkind: GroupSeek\nmetadata:\n  name: {name}\nspec:\n  policyRef: {{name: {policy}}}\n  \
             to: {{position: Earliest}}\n  pending: Acknowledge\n  consumersIdleFor: 0s\n"
        )
    };
    let finished = |name: &str| {
        wait_for(&format!("{name} finished"), Duration::from_secs(30), || {
            let object: serde_json::Value =
                serde_json::from_str(&kubectl_ok(&["get", "seek", name, "-n", &ns, "-o", "json"])).unwrap();
            match object["status"]["phase"].as_str() {
                Some("Succeeded" | "Failed") => Ok(object["status"].clone()),
                _ => Err(object["status"].to_string()),
            }
        })
    };
    assert!(kubectl_apply(&ns, &seek("replay", "orders")).0);
    let done = finished("replay");
    assert_eq!((done["phase"].as_str(), done["to"]["lag"].as_i64()), (Some("Succeeded"), Some(100)), "{done}");
    assert_eq!(done["pendingHandled"].as_i64(), Some(100));
    let groups = xinfo_groups(&mut conn, "{orders}:events");
    assert_eq!(group_field::<i64>(&groups[0], "lag"), 100);
    assert_eq!(read(&mut conn), 100, "read again after the seek");
    // A policy whose keys are in different slots is not Ready (CrossSlot): its seek is refused, nothing written.
    assert!(kubectl_apply(&ns, &cluster_policy("split", &cluster, "orders", "orders-dlq", "")).0);
    wait_condition(&ns, "split", "Ready", "False", "CrossSlot");
    assert!(kubectl_apply(&ns, &seek("split-seek", "split")).0);
    let refused = finished("split-seek");
    let failed = refused["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Failed").unwrap();
    assert_eq!(failed["reason"], "PolicyNotReady", "{refused}");
    assert!(failed["message"].as_str().unwrap().contains("CrossSlot"), "{refused}");
}

/// A Cluster with replicas: the primary serving the stream's slot is killed with SIGKILL while 50,000 messages are
/// being dead-lettered; its replica takes over, the operator follows (MOVED), and on the new primary every message is
/// exactly once dead-lettered, or still pending / not delivered (a move is one script, replicated as one unit).
fn the_streams_primary_killed_while_50000_messages_are_dead_lettered_its_replica_takes_over(flavor: Flavor) {
    const COUNT: usize = 50_000;
    let mut cluster = Cluster::start_with_replicas(flavor);
    let extra = "  retry:\n    maxDeliveries: 1\n";
    // `minIdle: 5s`: the crashed consumer's read of all of them is over before the pass may move the first; 50,000
    // take the pass about a second, so the kill lands while it moves them.
    let manifest = cluster_policy("fo", &cluster, "{fo}:in", "{fo}:dlq", extra)
        .replace("    minIdle: 1s\n", "    minIdle: 5s\n    maxPerPass: 2000\n");
    let (ns, _operator) = ready_policy("cluster-failover", &manifest, "fo");
    let mut conn = cluster.conn();
    for start in (0..COUNT).step_by(1000) {
        let mut pipe = redis::cluster::cluster_pipe();
        for n in start..start + 1000 {
            pipe.cmd("XADD").arg("{fo}:in").arg("*").arg("n").arg(n).ignore();
        }
        let _: () = pipe.query(&mut conn).unwrap();
    }
    // The crashed consumer's read, its reply left unparsed: a debug build's typed parse of 50,000 entries took
    // longer than `minIdle` on a busy machine, and the pass had moved them all before the test looked.
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("workers")
        .arg("crashed")
        .arg("COUNT")
        .arg(COUNT)
        .arg("STREAMS")
        .arg("{fo}:in")
        .arg(">")
        .query(&mut conn)
        .unwrap();
    let dead_at_kill = dead_lettering_under_way(&mut conn, "{fo}:dlq", 1000);
    let first = cluster.owner("{fo}:in").port;
    cluster.owner("{fo}:in").kill9();
    let killed = Instant::now();
    assert!(dead_at_kill < COUNT, "all was dead-lettered before the kill: lower the pass size");
    let second = wait_for("the replica to take the slot over", Duration::from_secs(60), || {
        let port = cluster.owner("{fo}:in").port;
        if port != first { Ok(port) } else { Err("not yet".into()) }
    });
    let promoted = killed.elapsed();
    let mut conn = cluster.nodes.iter().find(|n| n.port == second).unwrap().conn();
    wait_for("the new primary's PEL drained by the operator", Duration::from_secs(120), || {
        let pending: (i64, redis::Value, redis::Value, redis::Value) =
            redis::cmd("XPENDING").arg("{fo}:in").arg("workers").query(&mut conn).map_err(|e| e.to_string())?;
        if pending.0 == 0 { Ok(()) } else { Err(format!("{} pending", pending.0)) }
    });
    let drained = killed.elapsed();
    let p = wait_condition(&ns, "fo", "Ready", "True", "Reconciled");
    let (dead_lettered, open) = failover_ledger(&mut conn, "{fo}:in", "{fo}:dlq", "workers");
    assert_eq!(dead_lettered + open, COUNT, "every message is in the new primary's stream");
    println!(
        "{flavor:?}: primary of the slot killed with {dead_at_kill} of {COUNT} dead-lettered; replica promoted after \
         {promoted:?}; PEL drained on it after {drained:?}; ledger: {dead_lettered} dead-lettered once, {open} pending or \
         not delivered, 0 lost, 0 duplicated; status deadLettered {}",
        p["status"]["totals"]["deadLettered"]
    );
}
