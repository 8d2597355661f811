//! Partitioned policies (SPEC 22) through the operator: a topic's partitions `{t:0}`..`{t:n-1}` each get the group,
//! the settings, the passes and the probe; the status shows the topic as one. Real API server, real Redis 7.0.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use pelican::keys::{partition_stream, settings_key, topic_key};

const URL: &str = "redis://127.0.0.1:6379/0";

/// A policy of topic `t`, group `g`, passes every second on entries idle 1 s.
fn topic_policy(server: &Server, extra: &str) -> String {
    policy("t", &server.url(), "t", "g", extra).replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n")
}

fn refused(namespace: &str, manifest: &str) -> String {
    let (ok, out) = kubectl_apply(namespace, manifest);
    assert!(!ok, "the API server accepted:\n{manifest}");
    out
}

fn hash(conn: &mut redis::Connection, key: &str) -> HashMap<String, String> {
    redis::cmd("HGETALL").arg(key).query(conn).unwrap()
}

/// Field `name` of a raw entry, as text.
fn field(entry: &RawEntry, name: &str) -> String {
    let value = entry.1.iter().find(|(f, _)| f == name.as_bytes()).map(|(_, v)| v.clone()).unwrap_or_default();
    String::from_utf8(value).unwrap()
}

fn xadd(conn: &mut redis::Connection, stream: &str) -> String {
    redis::cmd("XADD").arg(stream).arg("*").arg("key").arg("k").query(conn).unwrap()
}

/// Delivers entry `id` of `stream` once more to `consumer`, as a worker that took it up again would.
fn deliver_again(conn: &mut redis::Connection, stream: &str, id: &str, consumer: &str) {
    let _: redis::Value = redis::cmd("XCLAIM").arg(stream).arg("g").arg(consumer).arg(0).arg(id).query(conn).unwrap();
}

fn wait_dead_letters(conn: &mut redis::Connection, count: usize) -> Vec<RawEntry> {
    wait_for(&format!("{count} dead letters"), Duration::from_secs(30), || {
        let letters = xrange(conn, "t:dlq");
        if letters.len() == count { Ok(letters) } else { Err(format!("{} dead letters", letters.len())) }
    })
}

#[test]
fn admission_refuses_topics_it_cannot_serve_and_says_what_to_do() {
    let ns = namespace("topic-adm");
    let plain = |extra: &str| policy("p", URL, "t", "g", extra);
    let out = refused(&ns, &policy("p", URL, "{t}", "g", "  partitions: 4\n"));
    assert!(out.contains("spec.stream") && out.contains("hash tag of its own"), "{out}");
    let out = refused(&ns, &plain("  partitions: 4\n").replace("stream: \"t:dlq\"", "stream: \"{t:3}\""));
    assert!(out.contains("spec.deadLetter.stream") && out.contains("name a stream outside the topic"), "{out}");
    let out = refused(&ns, &plain("  ordering: PerKey\n"));
    assert!(out.contains("spec.ordering") && out.contains("set spec.partitions"), "{out}");
    for count in ["0", "1025"] {
        let out = refused(&ns, &plain(&format!("  partitions: {count}\n")));
        assert!(out.contains("spec.partitions"), "{count}: {out}");
    }

    assert!(kubectl_apply(&ns, &plain("  partitions: 4\n")).0);
    let out = refused(&ns, &plain("  partitions: 8\n"));
    assert!(out.contains("spec.partitions is immutable") && out.contains("move the producers"), "{out}");
    let out = refused(&ns, &plain(""));
    assert!(out.contains("spec.partitions cannot be added or removed") && out.contains("new policy"), "{out}");
}

#[test]
fn a_topic_of_four_partitions_is_converged_partition_by_partition_and_shown_as_one() {
    let server = Server::start(Flavor::Redis);
    let extra = "  partitions: 4\n  deletionPolicy: Delete\n  retry:\n    maxDeliveries: 1\n";
    let (ns, _operator) = ready_policy("topic", &topic_policy(&server, extra), "t");
    let mut conn = server.conn();
    for index in 0..4 {
        assert_eq!(group_names(&mut conn, &partition_stream("t", index)), ["g"], "partition {index}");
    }
    assert!(group_names(&mut conn, "t").is_empty(), "the topic's name is no stream of its own");
    let topic = hash(&mut conn, &settings_key("t", "g"));
    assert_eq!(topic["partitions"], "4", "{topic:?}");
    assert_eq!(topic["ordering"], "None", "{topic:?}");
    assert_eq!(topic["contractVersion"], "2", "{topic:?}");
    assert_eq!((topic["backoffFactor"].as_str(), topic["backoffMaxMs"].as_str()), ("1", "0"), "no backoff: {topic:?}");
    let described = hash(&mut conn, &topic_key("t"));
    assert_eq!((described["partitions"].as_str(), described["contractVersion"].as_str()), ("4", "2"), "for producers");
    let partition = hash(&mut conn, &settings_key("{t:2}", "g"));
    assert_eq!((partition["contractVersion"].as_str(), partition.get("partitions")), ("2", None), "{partition:?}");

    // One entry in each partition, a second one in partition 2, read by a worker that then goes away.
    for index in 0..4 {
        xadd(&mut conn, &partition_stream("t", index));
    }
    let second = xadd(&mut conn, "{t:2}");
    let read = read_new(&mut conn, "{t:2}", "g", "gone-worker", 1);
    assert_eq!(pel(&mut conn, "{t:2}", "g").len(), 1, "{read:?}");

    let letters = wait_dead_letters(&mut conn, 1);
    assert_eq!(field(&letters[0], "pelican-source-stream"), "{t:2}");
    assert_eq!(field(&letters[0], "pelican-source-id"), read[0]);
    assert_ne!(read[0], second, "the worker read the older entry of the partition");
    let status = wait_for("the status to count the dead letter", Duration::from_secs(30), || {
        let status = get_policy(&ns, "t")["status"].clone();
        if status["totals"]["deadLettered"] == 1 { Ok(status) } else { Err(status.to_string()) }
    });
    assert_eq!(status["streamLength"], 5, "{status}");
    assert_eq!(status["lag"], 4, "{status}");
    assert_eq!(status["pending"], 0, "{status}");
    assert_eq!(status["deadLetterLength"], 1, "one dead-letter stream for the topic: {status}");
    assert_eq!(
        status["partitions"],
        serde_json::json!({"count": 4, "withGroup": 4, "members": 0, "largestBacklog": {"partition": 0, "backlog": 1}}),
        "no worker: no member; each partition's backlog 1, the first named; {status}"
    );
    let table = kubectl_ok(&["get", "cgp", "t", "-n", &ns, "-o", "wide"]);
    assert_eq!(table_rows(&table)[0]["PARTITIONS"], "4", "{table}");

    kubectl_ok(&["delete", "cgp", "t", "-n", &ns, "--timeout=30s"]);
    for index in 0..4 {
        let stream = partition_stream("t", index);
        assert!(group_names(&mut conn, &stream).is_empty(), "Delete must destroy the group on {stream}");
    }
}

/// With `ordering: PerKey` an idle entry below the cap stays where it is, with its id, until its deliveries reach
/// the cap: a requeued copy would overtake the entries of its key behind it.
#[test]
fn per_key_ordering_never_requeues_and_dead_letters_at_the_cap() {
    let server = Server::start(Flavor::Redis);
    let extra = "  partitions: 2\n  ordering: PerKey\n  retry:\n    maxDeliveries: 2\n    backoff:\n      factor: 3\n      max: 20s\n";
    let (ns, _operator) = ready_policy("topic-order", &topic_policy(&server, extra), "t");
    let mut conn = server.conn();
    let settings = hash(&mut conn, &settings_key("t", "g"));
    assert_eq!(settings["ordering"], "PerKey");
    // What a PerKey worker spaces its retries in place by.
    assert_eq!((settings["backoffFactor"].as_str(), settings["backoffMaxMs"].as_str()), ("3", "20000"), "{settings:?}");

    // Both idle past minIdle: the pass that dead-letters `capped` also sees `waiting`, and with `ordering: None`
    // it would requeue it.
    let waiting = xadd(&mut conn, "{t:1}");
    let capped = xadd(&mut conn, "{t:1}");
    assert_eq!(read_new(&mut conn, "{t:1}", "g", "w", 2), [waiting.clone(), capped.clone()]);
    deliver_again(&mut conn, "{t:1}", &capped, "w");
    let letters = wait_dead_letters(&mut conn, 1);
    assert_eq!(field(&letters[0], "pelican-source-id"), capped);
    let pending: Vec<(String, String, i64)> = pel(&mut conn, "{t:1}", "g")
        .into_iter()
        .map(|(id, consumer, _, deliveries)| (id, consumer, deliveries))
        .collect();
    assert_eq!(pending, [(waiting.clone(), "w".to_string(), 1)], "left in its partition, as it was");
    assert_eq!(xrange_page(&mut conn, "{t:1}", "-", 10), [waiting.clone(), capped], "no copy was added");

    deliver_again(&mut conn, "{t:1}", &waiting, "w");
    let letters = wait_dead_letters(&mut conn, 2);
    assert_eq!(field(&letters[1], "pelican-source-stream"), "{t:1}");
    assert_eq!(field(&letters[1], "pelican-source-id"), waiting);
    let status = get_policy(&ns, "t")["status"].clone();
    assert_eq!(status["totals"]["requeued"], 0, "{status}");
}

/// Sum and count of `controller_runtime_reconcile_time_seconds` in the operator's metrics.
fn reconcile_time(metrics: &str) -> (f64, f64) {
    let value = |name: &str| {
        metrics
            .lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    (value("controller_runtime_reconcile_time_seconds_sum"), value("controller_runtime_reconcile_time_seconds_count"))
}

fn commands_processed(conn: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("stats").query(conn).unwrap();
    let line = info.lines().find(|l| l.starts_with("total_commands_processed:")).unwrap();
    line["total_commands_processed:".len()..].trim().parse().unwrap()
}

/// SPEC 22's cost: a topic's first reconcile (each partition's group created, settings published, probe) stays well
/// inside the reconcile limit (30 s) at the largest count admission allows.
#[test]
fn a_reconcile_of_1024_partitions_stays_well_inside_the_reconcile_limit() {
    for partitions in [64, 1024] {
        let server = Server::start(Flavor::Redis);
        let mut conn = server.conn();
        let ns = namespace("topic-cost");
        let operator = Operator::start(&ns);
        let before = commands_processed(&mut conn);
        // Passes every 10 minutes: the first reconcile is what is measured, not the partitions' passes.
        let extra = format!("  partitions: {partitions}\n");
        let manifest = topic_policy(&server, &extra).replace("interval: 1s", "interval: 10m");
        assert!(kubectl_apply(&ns, &manifest).0);
        wait_condition(&ns, "t", "Ready", "True", "Reconciled");
        let commands = commands_processed(&mut conn) - before;
        let (seconds, count) = reconcile_time(&operator.metrics());
        let mean = seconds / count.max(1.0);
        eprintln!("{partitions} partitions: {count} reconciles, {mean:.3} s each, {commands} commands to Ready");
        assert!(mean < 10.0, "{partitions} partitions: a reconcile took {mean:.3} s on average");
        assert_eq!(get_policy(&ns, "t")["status"]["partitions"]["withGroup"], partitions);

        // A reconcile of a topic that exists: a spec change makes one (new settings on every partition).
        let before = commands_processed(&mut conn);
        patch_policy(&ns, "t", "merge", r#"{"spec":{"retry":{"maxDeliveries":4}}}"#);
        wait_for("the change to be reconciled", Duration::from_secs(30), || {
            let status = get_policy(&ns, "t")["status"].clone();
            if status["observedGeneration"] == 2 { Ok(()) } else { Err(status["observedGeneration"].to_string()) }
        });
        let commands = commands_processed(&mut conn) - before;
        let (after, count_after) = reconcile_time(&operator.metrics());
        let mean = (after - seconds) / (count_after - count).max(1.0);
        eprintln!(
            "{partitions} partitions: {} more reconciles, {mean:.3} s each, {commands} commands",
            count_after - count
        );
        assert!(mean < 10.0, "{partitions} partitions: a reconcile took {mean:.3} s on average");
    }
}

/// On a Cluster the partitions spread over the shards, and each partition dead-letters into a stream in its own
/// slot (a pass moves an entry in one script, which a Cluster runs on one slot only).
#[test]
fn on_a_cluster_the_partitions_spread_over_the_shards_and_dead_letter_in_their_slot() {
    let cluster = Cluster::start(Flavor::Redis);
    let manifest = policy("t", &cluster.url(), "t", "g", "  partitions: 8\n  retry:\n    maxDeliveries: 1\n")
        .replacen("  stream:", "    mode: Cluster\n  stream:", 1)
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n");
    let (ns, _operator) = ready_policy("topic-cluster", &manifest, "t");
    let mut conn = cluster.conn();
    for index in 0..8 {
        assert_eq!(group_names(&mut conn, &partition_stream("t", index)), ["g"], "partition {index}");
    }
    // Where each partition lives, asked of each node: only the one serving its slot answers for it.
    let mut expected = serde_json::Map::new();
    for node in &cluster.nodes {
        let served = (0..8)
            .filter(|i| {
                let groups: redis::RedisResult<redis::Value> =
                    redis::cmd("XINFO").arg("GROUPS").arg(partition_stream("t", *i)).query(&mut node.conn());
                groups.is_ok()
            })
            .count();
        if served > 0 {
            expected.insert(format!("127.0.0.1:{}", node.port), served.into());
        }
    }
    let status = get_policy(&ns, "t")["status"].clone();
    assert_eq!(status["partitions"]["shards"], serde_json::Value::Object(expected), "{status}");
    assert_eq!(status["partitions"]["withGroup"], 8, "{status}");

    let _: String = redis::cmd("XADD").arg("{t:5}").arg("*").arg("key").arg("k").query(&mut conn).unwrap();
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("g")
        .arg("gone")
        .arg("STREAMS")
        .arg("{t:5}")
        .arg(">")
        .query(&mut conn)
        .unwrap();
    let dead_letters = "{t:5}:t:dlq";
    wait_for("the dead letter in partition 5's slot", Duration::from_secs(30), || {
        let length: i64 = redis::cmd("XLEN").arg(dead_letters).query(&mut conn).map_err(|e| e.to_string())?;
        if length == 1 { Ok(()) } else { Err(format!("{length} dead letters")) }
    });
    let status = wait_for("the status to count it", Duration::from_secs(30), || {
        let status = get_policy(&ns, "t")["status"].clone();
        if status["deadLetterLength"] == 1 { Ok(status) } else { Err(status.to_string()) }
    });
    assert_eq!(status["totals"]["deadLettered"], 1, "{status}");
}

/// `suspend` stops the job of every partition (each runs as a task of its own), and resuming starts them again.
#[test]
fn suspend_stops_every_partitions_jobs() {
    let server = Server::start(Flavor::Redis);
    let extra = "  partitions: 2\n  retry:\n    maxDeliveries: 1\n";
    let (ns, _operator) = ready_policy("topic-suspend", &topic_policy(&server, extra), "t");
    patch_policy(&ns, "t", "merge", r#"{"spec":{"suspend":true}}"#);
    wait_for("the suspension to be reconciled", Duration::from_secs(30), || {
        let status = get_policy(&ns, "t")["status"].clone();
        if status["observedGeneration"] == 2 { Ok(()) } else { Err(status.to_string()) }
    });
    let mut conn = server.conn();
    xadd(&mut conn, "{t:1}");
    read_new(&mut conn, "{t:1}", "g", "gone", 1);
    wait_for("the status to show the pending entry", Duration::from_secs(30), || {
        let status = get_policy(&ns, "t")["status"].clone();
        if status["pending"] == 1 { Ok(()) } else { Err(status.to_string()) }
    });
    // Three passes' worth of time past minIdle: a partition's job still running would have dead-lettered it.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(pel(&mut conn, "{t:1}", "g").len(), 1, "a suspended topic moves nothing");
    assert!(xrange(&mut conn, "t:dlq").is_empty());

    patch_policy(&ns, "t", "merge", r#"{"spec":{"suspend":false}}"#);
    let letters = wait_dead_letters(&mut conn, 1);
    assert_eq!(field(&letters[0], "pelican-source-stream"), "{t:1}");
}

/// `spec.backlog.maxLength` bounds each partition (SPEC 22): a key whose partition is full is refused while another
/// key's partition takes more; `Saturated` names the full partition, `status.partitions.largestBacklog` shows it; a
/// bound removed from the spec leaves no partition's bounds hash.
#[test]
fn a_backlog_bound_holds_each_partition() {
    let server = Server::start(Flavor::Redis);
    let (ns, _operator) =
        ready_policy("topic-backlog", &topic_policy(&server, "  partitions: 2\n  backlog:\n    maxLength: 3\n"), "t");
    let runtime = runtime();
    let source = pelican::worker::Source::Server(redis::Client::open(server.url()).unwrap());
    let producer = runtime.block_on(pelican::worker::TopicProducer::connect_to(&source, "t")).unwrap();
    let full = producer.partition(Some(b"a"));
    let other = (0..100).map(|i| format!("k{i}")).find(|k| producer.partition(Some(k.as_bytes())) != full).unwrap();
    for n in 0..3 {
        runtime.block_on(producer.publish(Some(b"a"), &[("n", n)])).unwrap();
    }
    match runtime.block_on(producer.publish(Some(b"a"), &[("n", 3)])) {
        Err(pelican::worker::PublishError::Refused { backlog: 3, max: 3, .. }) => {}
        other => panic!("the fourth message of a full partition: {other:?}"),
    }
    for n in 0..2 {
        runtime.block_on(producer.publish(Some(other.as_bytes()), &[("n", n)])).unwrap();
    }
    let saturated = wait_condition(&ns, "t", "Saturated", "True", "BacklogFull");
    let conditions = saturated["status"]["conditions"].as_array().unwrap();
    let message = conditions.iter().find(|c| c["type"] == "Saturated").unwrap()["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("partition {full}'s backlog 3")) && message.contains("per partition"),
        "{message}"
    );
    let largest = &saturated["status"]["partitions"]["largestBacklog"];
    assert_eq!(largest["backlog"], 3, "{}", saturated["status"]);
    assert_eq!(saturated["status"]["backlog"], 5, "{}", saturated["status"]);

    patch_policy(&ns, "t", "json", r#"[{"op": "remove", "path": "/spec/backlog"}]"#);
    let mut conn = server.conn();
    wait_for("no partition's bound left", Duration::from_secs(30), || {
        let bounds: Vec<usize> =
            (0..2).map(|i| hash(&mut conn, &pelican::keys::bounds_key(&partition_stream("t", i))).len()).collect();
        if bounds == [0, 0] { Ok(()) } else { Err(format!("{bounds:?}")) }
    });
    runtime.block_on(producer.publish(Some(b"a"), &[("n", 4)])).unwrap();
}
