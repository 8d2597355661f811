//! The documented ACL rule sets (`examples/acl/*.acl`), one per role, each role run with exactly its rules: the
//! operator (a policy with a bound and retention, its passes and a redrive), a producer through the SDK and through
//! the script sent whole (`EVAL`, as clients do that fall back from `EVALSHA`), and a worker through the SDK with a
//! failure and a terminal ACK. On untagged names, tagged names, database 3 and a Redis Cluster (Redis 7.0). A topic's
//! three roles (`topic-*.acl`) the same way, on one server and on a Cluster.

#[macro_use]
mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use pelican::keys::hash_tag;
use pelican::worker::{
    BOUNDED_PUBLISH_LUA, Connection, Message, Outcome, Producer, PublishError, Source, TopicProducer, TopicWorker,
    TopicWorkerConfig, Worker, WorkerConfig,
};

const GROUP: &str = "workers";

/// Where the roles run, and how their keys are named.
enum Bed {
    Server(Server, u8),
    Cluster(Cluster),
}

impl Bed {
    fn url(&self, user: &str, password: &str) -> String {
        match self {
            Bed::Server(server, db) => format!("redis://{user}:{password}@127.0.0.1:{}/{db}", server.port),
            Bed::Cluster(cluster) => format!("redis://{user}:{password}@127.0.0.1:{}", cluster.nodes[0].port),
        }
    }

    fn source(&self, user: &str, password: &str) -> Source {
        match self {
            Bed::Server(..) => Source::Server(redis::Client::open(self.url(user, password)).unwrap()),
            Bed::Cluster(_) => {
                Source::Cluster(redis::cluster::ClusterClient::new(vec![self.url(user, password)]).unwrap())
            }
        }
    }

    /// A plain connection as `user`, for commands of the test's own.
    async fn conn(&self, user: &str, password: &str) -> Connection {
        match self.source(user, password) {
            Source::Server(client) => Connection::Single(client.get_connection_manager().await.unwrap()),
            Source::Cluster(client) => Connection::Cluster(client.get_async_connection().await.unwrap()),
            Source::Sentinel { .. } => unreachable!("no sentinel here"),
        }
    }

    /// An admin command on every node (ACL SETUSER on each node of a cluster).
    fn on_every_node(&self, cmd: &redis::Cmd) {
        let nodes: Vec<&Server> = match self {
            Bed::Server(server, _) => vec![server],
            Bed::Cluster(cluster) => cluster.nodes.iter().collect(),
        };
        for node in nodes {
            let _: redis::Value = cmd.query(&mut node.conn()).unwrap();
        }
    }

    /// An admin command on the node that holds `key` (in the bed's database).
    fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        match self {
            Bed::Server(server, db) => {
                let mut conn = server.conn();
                let _: () = redis::cmd("SELECT").arg(*db).query(&mut conn).unwrap();
                cmd.query(&mut conn).unwrap()
            }
            Bed::Cluster(cluster) => cmd.query(&mut cluster.conn()).unwrap(),
        }
    }

    fn policy_url(&self) -> String {
        match self {
            Bed::Server(server, db) => format!("redis://127.0.0.1:{}/{db}", server.port),
            Bed::Cluster(cluster) => cluster.url(),
        }
    }
}

/// The rules of `examples/acl/<role>.acl` for these names.
fn rules(role: &str, stream: &str, dead_letter: &str, password: &str) -> Vec<String> {
    let path = format!("{}/examples/acl/{role}.acl", env!("CARGO_MANIFEST_DIR"));
    let file = std::fs::read_to_string(path).unwrap();
    let line = file.lines().find(|l| l.starts_with("user ")).unwrap();
    let tag = |key: &str| format!("{{{}}}", hash_tag(key));
    line.split_whitespace()
        .skip(2)
        .map(|rule| {
            rule.replace("{D}", &tag(dead_letter))
                .replace("{T}", &tag(stream))
                .replace("DEAD_LETTER_STREAM", dead_letter)
                .replace("TOPIC", stream)
                .replace("STREAM", stream)
                .replace("GROUP", GROUP)
                .replace(">CHANGE-ME", &format!(">{password}"))
        })
        .collect()
}

fn set_user(bed: &Bed, user: &str, rules: &[String]) {
    let mut cmd = redis::cmd("ACL");
    cmd.arg("SETUSER").arg(user).arg("reset");
    for rule in rules {
        cmd.arg(rule);
    }
    bed.on_every_node(&cmd);
}

fn every_role_runs_with_its_rules(bed: Bed, stream: &str, dead_letter: &str) {
    for (user, role) in [("pelican", "pelican"), ("producer", "producer"), ("worker", "worker")] {
        set_user(&bed, user, &rules(role, stream, dead_letter, &format!("{user}-pw")));
    }
    let ns = namespace("acl-roles");
    let operator = Operator::start(&ns);
    let secret = "apiVersion: v1\nkind: Secret\nmetadata:\n  name: redis-acl\nstringData:\n  username: pelican\n  password: pelican-pw\n";
    let refs = "    usernameSecretRef: {name: redis-acl, key: username}\n    passwordSecretRef: {name: redis-acl, key: password}\n";
    let mode = if matches!(bed, Bed::Cluster(_)) { "    mode: Cluster\n" } else { "" };
    let extra =
        "  retry:\n    maxDeliveries: 2\n  backlog:\n    maxLength: 100\n  retention:\n    mode: Acknowledged\n";
    let manifest = policy("roles", &bed.policy_url(), stream, GROUP, extra)
        .replace(&format!("\"{stream}:dlq\""), &format!("\"{dead_letter}\""))
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n")
        .replacen("  stream:", &format!("{refs}{mode}  stream:"), 1);
    assert!(kubectl_apply(&ns, &format!("{secret}---\n{manifest}")).0);
    wait_condition(&ns, "roles", "Ready", "True", "Reconciled");

    let runtime = runtime();
    // The producer: five entries through the SDK (EVALSHA, SCRIPT LOAD on first use).
    let producer = runtime.block_on(Producer::connect_to(&bed.source("producer", "producer-pw"), stream)).unwrap();
    for n in 0..5 {
        runtime.block_on(producer.publish(&[("n", n)])).unwrap_or_else(|e| panic!("producer: {e}"));
    }
    // The worker: fails message 0 every time, ends message 1 as terminal, handles the rest.
    let config = WorkerConfig { block: Duration::from_millis(100), ..WorkerConfig::new(stream, GROUP, "w1") };
    let stats = runtime.block_on(async {
        let worker = Worker::connect_to(bed.source("worker", "worker-pw"), config).await.unwrap();
        let handler = |m: Message| async move {
            match m.field_str("n") {
                Some("0") => Err("downstream refused".into()),
                Some("1") => Ok(Outcome::terminal("RecordNotFound")),
                _ => Ok(Outcome::Done),
            }
        };
        worker.run(handler, tokio::time::sleep(Duration::from_secs(8))).await.unwrap()
    });
    assert!(stats.done >= 3 && stats.terminal == 1 && stats.failed >= 1, "{stats:?}");
    // The worker reads the group's settings and cannot rewrite them for everyone (issue 57.9).
    let settings = pelican::keys::settings_key(stream, GROUP);
    let mut conn = runtime.block_on(bed.conn("worker", "worker-pw"));
    let mut rewrite = redis::cmd("HSET");
    rewrite.arg(&settings).arg("minIdleMs").arg(3_600_000).arg("retryAfterMs").arg(0);
    let refused = runtime.block_on(rewrite.query_async::<i64>(&mut conn)).expect_err("the worker may not write");
    assert_eq!(refused.code(), Some("NOPERM"), "{refused}");
    let read: BTreeMap<String, String> =
        runtime.block_on(redis::cmd("HGETALL").arg(&settings).query_async(&mut conn)).unwrap();
    assert_eq!(read.get("minIdleMs").map(String::as_str), Some("1000"), "{read:?}");
    // The operator: message 0 dead-lettered after its second delivery, the rest trimmed by retention.
    let policy = wait_for("the dead letter and the trim in status", Duration::from_secs(60), || {
        let p = get_policy(&ns, "roles");
        let totals = &p["status"]["totals"];
        if totals["deadLettered"] == 1 && totals["trimmed"].as_i64().unwrap_or(0) >= 4 {
            Ok(p)
        } else {
            Err(p["status"].to_string())
        }
    });
    let terminal = &policy["status"]["terminalAcks"];
    let expected =
        serde_json::json!([{"reason": "MaxDeliveriesExceeded", "count": 1}, {"reason": "RecordNotFound", "count": 1}]);
    assert_eq!(terminal, &expected, "{}", policy["status"]);
    // The operator's redrive puts it back.
    let redrive = "apiVersion: pelican.io/v1alpha1\nkind: DeadLetterRedrive\nmetadata:\n  name: back\nspec:\n  policyRef: {name: roles}\n";
    assert!(kubectl_apply(&ns, redrive).0);
    let done = wait_for("the redrive Succeeded", Duration::from_secs(60), || {
        let out = kubectl_ok(&["get", "dlr", "back", "-n", &ns, "-o", "json"]);
        let object: serde_json::Value = serde_json::from_str(&out).unwrap();
        if object["status"]["phase"] == "Succeeded" { Ok(object) } else { Err(object["status"].to_string()) }
    });
    assert_eq!(done["status"]["moved"], 1, "{}", done["status"]);
    let redriven: usize = bed.query(redis::cmd("XLEN").arg(dead_letter));
    assert_eq!(redriven, 0);

    // The producer at the bound: refused (not NOPERM), also with the script sent whole.
    patch_policy(&ns, "roles", "merge", r#"{"spec":{"backlog":{"maxLength":1}}}"#);
    wait_condition(&ns, "roles", "Saturated", "True", "BacklogFull");
    match runtime.block_on(producer.publish(&[("n", 9)])) {
        Err(PublishError::Refused { .. }) => {}
        other => panic!("expected a refusal, got {other:?}"),
    }
    let bounds = format!("{{{}}}:pelican:{stream}:bounds", hash_tag(stream));
    let rejected = format!("{{{}}}:pelican:{stream}:rejected", hash_tag(stream));
    let eval = runtime.block_on(async {
        let mut conn = bed.conn("producer", "producer-pw").await;
        redis::cmd("EVAL")
            .arg(BOUNDED_PUBLISH_LUA)
            .arg(3)
            .arg(stream)
            .arg(&bounds)
            .arg(&rejected)
            .arg("n")
            .arg(10)
            .query_async::<String>(&mut conn)
            .await
    });
    let refusal = eval.expect_err("the bound is full");
    assert_eq!(refusal.code(), Some("PELICAN_BACKLOG_FULL"), "{refusal}");
    // Scripts' keys are read-write for Redis, so a producer could raise its own bound: the operator puts the
    // policy's value back at its next look.
    let mut conn = runtime.block_on(bed.conn("producer", "producer-pw"));
    let _: i64 =
        runtime.block_on(redis::cmd("HINCRBY").arg(&bounds).arg(GROUP).arg(1_000_000).query_async(&mut conn)).unwrap();
    wait_for("the operator to restore the bound", Duration::from_secs(30), || {
        let bound: Option<String> = bed.query(redis::cmd("HGET").arg(&bounds).arg(GROUP));
        if bound.as_deref() == Some("1") { Ok(()) } else { Err(format!("{bound:?}")) }
    });

    assert!(condition(&get_policy(&ns, "roles"), "Ready") == Some(("True".into(), "Reconciled".into())));
    let logs = operator.logs();
    assert!(!logs.contains("NOPERM") && !logs.contains("can't run"), "a refusal in the operator's log");
    let conditions: BTreeMap<String, String> = get_policy(&ns, "roles")["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["type"].as_str().unwrap().to_string(), c["reason"].as_str().unwrap().to_string()))
        .collect();
    println!("roles ran with exactly their rules on {stream} / {dead_letter}: {conditions:?}");
}

#[test]
fn untagged_names() {
    every_role_runs_with_its_rules(Bed::Server(Server::start(Flavor::Redis), 0), "orders", "orders:dlq");
}

#[test]
fn tagged_names() {
    every_role_runs_with_its_rules(Bed::Server(Server::start(Flavor::Redis), 0), "{orders}:in", "{orders}:dlq");
}

#[test]
fn database_3() {
    every_role_runs_with_its_rules(Bed::Server(Server::start(Flavor::Redis), 3), "orders", "orders:dlq");
}

#[test]
fn redis_cluster() {
    every_role_runs_with_its_rules(Bed::Cluster(Cluster::start(Flavor::Redis)), "{orders}:in", "{orders}:dlq");
}

/// A topic's roles, each with exactly its rules: the operator converges 4 partitions and dead-letters at the cap, a
/// keyed producer publishes to them, a member takes every partition and handles what it reads and cannot rewrite a
/// partition's settings.
fn a_topics_roles_run_with_their_rules(bed: Bed) {
    let (topic, dead_letter) = ("orders", "orders:dlq");
    for (user, role) in [("pelican", "topic-pelican"), ("producer", "topic-producer"), ("worker", "topic-worker")] {
        set_user(&bed, user, &rules(role, topic, dead_letter, &format!("{user}-pw")));
    }
    let ns = namespace("acl-topic");
    let operator = Operator::start(&ns);
    let secret = "apiVersion: v1\nkind: Secret\nmetadata:\n  name: redis-acl\nstringData:\n  username: pelican\n  password: pelican-pw\n";
    let refs = "    usernameSecretRef: {name: redis-acl, key: username}\n    passwordSecretRef: {name: redis-acl, key: password}\n";
    let mode = if matches!(bed, Bed::Cluster(_)) { "    mode: Cluster\n" } else { "" };
    let manifest =
        policy("roles", &bed.policy_url(), topic, GROUP, "  partitions: 4\n  retry:\n    maxDeliveries: 2\n")
            .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n")
            .replacen("  stream:", &format!("{refs}{mode}  stream:"), 1);
    assert!(kubectl_apply(&ns, &format!("{secret}---\n{manifest}")).0);
    wait_condition(&ns, "roles", "Ready", "True", "Reconciled");

    let runtime = runtime();
    let producer = runtime.block_on(TopicProducer::connect_to(&bed.source("producer", "producer-pw"), topic)).unwrap();
    let mut partitions = std::collections::BTreeSet::new();
    for key in ["bad", "k1", "k2", "k3", "k4", "k5", "k6", "k7"] {
        let (partition, _) = runtime
            .block_on(producer.publish(Some(key.as_bytes()), &[("n", key)]))
            .unwrap_or_else(|e| panic!("producer: {e}"));
        partitions.insert(partition);
    }
    let mut config = TopicWorkerConfig::new(topic, GROUP, "w1");
    config.worker.block = Duration::from_millis(100);
    let stats = runtime.block_on(async {
        let worker = TopicWorker::connect_to(bed.source("worker", "worker-pw"), config).await.unwrap();
        let handler = |m: Message| async move {
            match m.field_str("n") {
                Some("bad") => Err("downstream refused".into()),
                _ => Ok(Outcome::Done),
            }
        };
        worker.run(handler, tokio::time::sleep(Duration::from_secs(8))).await.unwrap()
    });
    assert!(stats.done == 7 && stats.failed >= 1, "{stats:?} over partitions {partitions:?}");
    let settings = pelican::keys::settings_key(&pelican::keys::partition_stream(topic, 0), GROUP);
    let mut conn = runtime.block_on(bed.conn("worker", "worker-pw"));
    let mut rewrite = redis::cmd("HSET");
    rewrite.arg(&settings).arg("minIdleMs").arg(3_600_000);
    let refused = runtime.block_on(rewrite.query_async::<i64>(&mut conn)).expect_err("the worker may not write");
    assert_eq!(refused.code(), Some("NOPERM"), "{refused}");
    let policy = wait_for("the dead letter in status", Duration::from_secs(60), || {
        let p = get_policy(&ns, "roles");
        if p["status"]["totals"]["deadLettered"] == 1 { Ok(p) } else { Err(p["status"].to_string()) }
    });
    assert!(condition(&policy, "Ready") == Some(("True".into(), "Reconciled".into())), "{}", policy["status"]);
    let logs = operator.logs();
    assert!(!logs.contains("NOPERM") && !logs.contains("can't run"), "a refusal in the operator's log");
    println!("a topic's roles ran with exactly their rules: {stats:?}, {}", policy["status"]["totals"]);
}

#[test]
fn a_topic_on_one_server() {
    a_topics_roles_run_with_their_rules(Bed::Server(Server::start(Flavor::Redis), 0));
}

#[test]
fn a_topic_on_a_cluster() {
    a_topics_roles_run_with_their_rules(Bed::Cluster(Cluster::start(Flavor::Redis)));
}
