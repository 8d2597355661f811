//! `kubectl pelican`, run through kubectl itself (its plugin mechanism finds `kubectl-pelican`
//! on the PATH), against the bed's API server and a real Redis, with dead letters made by the operator.

#[macro_use]
mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use common::*;
use serde_json::Value;

/// `kubectl <args>` with the directory of the built `kubectl-pelican` first on the PATH.
fn kubectl_plugin_command(args: &[&str]) -> Command {
    let plugin_dir = Path::new(env!("CARGO_BIN_EXE_kubectl-pelican")).parent().unwrap();
    let path = format!("{}:{}", plugin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let mut command = Command::new(bed().var("PELICAN_KUBECTL"));
    command.args(args).env("KUBECONFIG", bed().kubeconfig()).env("PATH", path);
    command
}

fn kubectl_plugin(args: &[&str]) -> Output {
    kubectl_plugin_command(args).output().expect("run kubectl")
}

fn pelican_ok(args: &[&str]) -> String {
    let mut all = vec!["pelican"];
    all.extend_from_slice(args);
    let out = kubectl_plugin(&all);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "kubectl {all:?} failed: {}{text}", String::from_utf8_lossy(&out.stderr));
    println!("$ kubectl {}\n{text}", all.join(" "));
    text
}

/// Two policies on one stream, their operator, and three dead letters: `orders` dead-letters after one delivery
/// left idle for a second; `audit`, a second group on the same stream, keeps its two pending entries.
struct DeadLettered {
    server: Server,
    ns: String,
    _operator: Operator,
}

impl DeadLettered {
    fn start(prefix: &str) -> DeadLettered {
        let server = Server::start(Flavor::Redis);
        let orders = policy("orders", &server.url(), "orders", "workers", "  retry:\n    maxDeliveries: 1\n")
            .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n");
        let audit = policy("audit", &server.url(), "orders", "auditors", "")
            .replace("    stream: \"orders:dlq\"", "    stream: \"orders:audit-dlq\"");
        let (ns, operator) = ready_policy(prefix, &format!("{orders}---\n{audit}"), "orders");
        wait_condition(&ns, "audit", "Ready", "True", "Reconciled");
        let mut conn = server.conn();
        for n in 0..3 {
            let _: String = redis::cmd("XADD")
                .arg("orders")
                .arg("*")
                .arg("n")
                .arg(n)
                .arg("customer")
                .arg("ada")
                .query(&mut conn)
                .unwrap();
        }
        assert_eq!(read_new(&mut conn, "orders", "workers", "worker-1", 10).len(), 3);
        assert_eq!(read_new(&mut conn, "orders", "auditors", "auditor-1", 2).len(), 2);
        wait_for("three dead letters", Duration::from_secs(30), || {
            let n = xrange(&mut conn, "orders:dlq").len();
            if n == 3 { Ok(()) } else { Err(format!("{n}")) }
        });
        DeadLettered { server, ns, _operator: operator }
    }
}

#[test]
fn kubectl_finds_the_plugin_on_the_path() {
    let list = kubectl_plugin(&["plugin", "list"]);
    assert!(String::from_utf8_lossy(&list.stdout).contains("kubectl-pelican"), "{list:?}");
}

/// `status`: every policy of the namespace as a table, then one with its oldest pending entries from the server,
/// in JSON and YAML too.
#[test]
fn status_lists_the_policies_and_one_with_its_oldest_pending_entries() {
    let bed = DeadLettered::start("plugin-status");
    let ns = &bed.ns;
    wait_for("the status to show the dead letters", Duration::from_secs(30), || {
        let policy = get_policy(ns, "orders");
        if policy["status"]["totals"]["deadLettered"] == 3 { Ok(()) } else { Err(policy["status"].to_string()) }
    });
    let table = pelican_ok(&["status", "-n", ns]);
    let rows = table_rows(&table);
    let row = rows.iter().find(|r| r["NAME"] == "orders").unwrap();
    assert_eq!((row["READY"].as_str(), row["DEAD-LETTERED"].as_str()), ("True", "3"), "{table}");
    let audit_row = rows.iter().find(|r| r["NAME"] == "audit").unwrap();
    assert_eq!(audit_row["PENDING"], "2", "{table}");
    let one = pelican_ok(&["status", "audit", "-n", ns, "--pending", "5"]);
    assert!(one.contains("Oldest pending entries:"), "{one}");
    assert_eq!(one.matches("auditor-1").count(), 2, "both pending entries, with their consumer: {one}");
    let json: Value = serde_json::from_str(&pelican_ok(&["status", "audit", "-n", ns, "-o", "json"])).unwrap();
    assert_eq!(json["oldestPending"].as_array().unwrap().len(), 2);
    assert_eq!(json["oldestPending"][0]["consumer"], "auditor-1");
    assert_eq!(json["pending"], 2);
    let yaml: Value = serde_yaml::from_str(&pelican_ok(&["status", "-n", ns, "-o", "yaml"])).unwrap();
    assert_eq!(yaml.as_array().unwrap().len(), 2);
}

/// `dlq`: dead letters grouped by reason and source, with a payload preview that can be turned off.
#[test]
fn dlq_groups_dead_letters_by_reason_and_source_and_hides_payloads_on_request() {
    let bed = DeadLettered::start("plugin-dlq");
    let ns = &bed.ns;
    let dlq = pelican_ok(&["dlq", "orders", "-n", ns]);
    let groups = table_rows(dlq.split("\n\n").nth(1).unwrap());
    assert_eq!(groups.len(), 1, "{dlq}");
    assert_eq!(
        (groups[0]["REASON"].as_str(), groups[0]["SOURCE"].as_str(), groups[0]["COUNT"].as_str()),
        ("MaxDeliveriesExceeded", "orders", "3")
    );
    assert!(dlq.contains("customer=ada n=0"), "{dlq}");
    let private = pelican_ok(&["dlq", "orders", "-n", ns, "--no-payload"]);
    assert!(!private.contains("ada") && !private.contains("PAYLOAD"), "{private}");
    let json: Value =
        serde_json::from_str(&pelican_ok(&["dlq", "orders", "-n", ns, "-o", "json", "--no-payload"])).unwrap();
    assert_eq!(json["length"], 3);
    assert_eq!(json["entries"][0]["deliveries"], "1");
    assert!(json["entries"][0].get("payload").is_none());
}

/// `redrive`: creates the DeadLetterRedrive and follows it to the end.
#[test]
fn redrive_creates_the_object_and_follows_it_to_the_end() {
    let bed = DeadLettered::start("plugin-redrive-one");
    let ns = &bed.ns;
    let out = pelican_ok(&[
        "redrive",
        "orders",
        "-n",
        ns,
        "--reason",
        "MaxDeliveriesExceeded",
        "--rate",
        "100",
        "--name",
        "fixed",
    ]);
    assert!(out.starts_with("deadletterredrive.pelican.io/fixed created"), "{out}");
    assert!(out.lines().last().unwrap().starts_with("Succeeded\tmoved 3 of 3"), "{out}");
    assert!(xrange(&mut bed.server.conn(), "orders:dlq").is_empty());
    println!("{}", kubectl_ok(&["get", "dlr", "-n", ns, "-o", "wide"]));
}

/// `seek`: a dry run prints the plan and moves nothing; `--to-time -1h` replays what came in the last hour; a seek
/// refused says why and fails.
#[test]
fn seek_prints_the_plan_then_moves() {
    let server = Server::start(Flavor::Redis);
    let mut conn = server.conn();
    let (seconds, _): (i64, i64) = redis::cmd("TIME").query(&mut conn).unwrap();
    // Ten entries two hours ago, four in the last hour; all read and acknowledged.
    let times = (0..10).map(|i| (seconds - 7200 + i) * 1000).chain((0..4).map(|i| (seconds - 1800 + i) * 1000));
    for ms in times {
        let _: String =
            redis::cmd("XADD").arg("orders").arg(format!("{ms}-0")).arg("n").arg(1).query(&mut conn).unwrap();
    }
    let (ns, _operator) =
        ready_policy("plugin-seek", &policy("orders", &server.url(), "orders", "workers", ""), "orders");
    let read = read_new(&mut conn, "orders", "workers", "w", 100);
    let _: i64 = redis::cmd("XACK").arg("orders").arg("workers").arg(&read).query(&mut conn).unwrap();
    let refused = kubectl_plugin(&["pelican", "seek", "orders", "-n", &ns, "--to-time", "-1h", "--name", "busy"]);
    let text = String::from_utf8_lossy(&refused.stdout);
    assert!(!refused.status.success() && text.contains("Failed ConsumersActive"), "{text}");
    let common = ["seek", "orders", "-n", &ns, "--to-time", "-1h", "--consumers-idle-for", "0s"];
    let plan = pelican_ok(&[&common[..], &["--dry-run", "--name", "plan"]].concat());
    assert!(plan.contains("redelivered 4, skipped 0") && plan.contains("Succeeded Planned"), "{plan}");
    assert!(read_new(&mut conn, "orders", "workers", "w", 100).is_empty(), "a dry run moves nothing");
    let done = pelican_ok(&[&common[..], &["--name", "replay"]].concat());
    assert!(done.contains("Succeeded Seeked"), "{done}");
    assert_eq!(read_new(&mut conn, "orders", "workers", "w", 100).len(), 4);
    println!("{}", kubectl_ok(&["get", "seek", "-n", &ns, "-o", "wide"]));
}

/// A mistake says what is wrong and how to look.
#[test]
fn a_policy_that_does_not_exist_is_named_with_how_to_list_them() {
    let ns = namespace("plugin-missing");
    let missing = kubectl_plugin(&["pelican", "dlq", "nope", "-n", &ns]);
    assert!(!missing.status.success());
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(err.contains("ConsumerGroupPolicy \"nope\" not found") && err.contains("kubectl get cgp"), "{err}");
}

/// `kubectl pelican redrive` run twice in the same second makes two redrives, and following one that is suspended
/// ends (with how to resume it) instead of waiting forever.
#[test]
fn redrive_twice_at_once_and_following_a_suspended_one() {
    let server = Server::start(Flavor::Redis);
    let (ns, _operator) =
        ready_policy("plugin-redrive", &policy("orders", &server.url(), "orders", "workers", ""), "orders");
    let mut conn = server.conn();
    for n in 0..50 {
        let _: String = redis::cmd("XADD")
            .arg("orders:dlq")
            .arg("*")
            .arg("n")
            .arg(n)
            .arg("pelican-source-stream")
            .arg("orders")
            .arg("pelican-reason")
            .arg("MaxDeliveriesExceeded")
            .query(&mut conn)
            .unwrap();
    }
    let first = pelican_ok(&["redrive", "orders", "-n", &ns, "--rate", "1", "--no-wait"]);
    let second = pelican_ok(&["redrive", "orders", "-n", &ns, "--rate", "1", "--no-wait"]);
    let name = |out: &str| out.trim().strip_prefix("deadletterredrive.pelican.io/").unwrap().replace(" created", "");
    let (first, second) = (name(&first), name(&second));
    assert!(first.starts_with("orders-redrive-") && second.starts_with("orders-redrive-"), "{first} {second}");
    assert_ne!(first, second);

    // Follow a third one (it waits behind the first), suspend it meanwhile: the command ends.
    let mut follow =
        kubectl_plugin_command(&["pelican", "redrive", "orders", "-n", &ns, "--name", "third", "--rate", "1"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
    std::thread::sleep(Duration::from_secs(3));
    kubectl_ok(&["patch", "dlr", "third", "-n", &ns, "--type=merge", "-p", r#"{"spec":{"suspend":true}}"#]);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let exited = loop {
        if let Some(status) = follow.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = follow.kill();
            panic!("kubectl pelican redrive still follows a suspended redrive after 20 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let mut out = String::new();
    std::io::Read::read_to_string(follow.stdout.as_mut().unwrap(), &mut out).unwrap();
    assert!(exited.success(), "{out}");
    assert!(out.contains("redrive third is suspended; resume it with: kubectl patch dlr third"), "{out}");
}

/// `kubectl pelican status <policy>` while the server is down: the Kubernetes status is shown, and the part only
/// the server can tell (the oldest pending entries) says why it is missing, instead of the whole command failing.
#[test]
fn status_of_one_policy_shows_the_kubernetes_status_when_redis_is_down() {
    let mut server = Server::start(Flavor::Redis);
    let (ns, _operator) =
        ready_policy("plugin-down", &policy("orders", &server.url(), "orders", "workers", ""), "orders");
    server.stop();
    let out = pelican_ok(&["status", "orders", "-n", &ns]);
    assert!(out.contains("Policy:") && out.contains("Conditions:"), "{out}");
    assert!(out.contains("not read from the server:"), "{out}");
    let json: Value = serde_json::from_str(&pelican_ok(&["status", "orders", "-n", &ns, "-o", "json"])).unwrap();
    assert_eq!(json["name"], "orders");
    assert!(json["oldestPendingError"].as_str().is_some_and(|e| !e.is_empty()), "{json}");
}

/// `--redis-address`: a policy whose URL names a host that resolves only inside the cluster (here: nowhere) is
/// read through the address given instead, as through a `kubectl port-forward`; without it the command says why
/// the server's part is missing.
#[test]
fn redis_address_reaches_the_server_the_spec_names_only_in_cluster() {
    let server = Server::start(Flavor::Redis);
    let ns = namespace("plugin-address");
    let manifest = policy("orders", "redis://redis.apps.svc.cluster.invalid:6379/0", "orders", "workers", "");
    assert!(kubectl_apply(&ns, &manifest).0);
    let mut conn = server.conn();
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg("orders")
        .arg("workers")
        .arg("0")
        .arg("MKSTREAM")
        .query(&mut conn)
        .unwrap();
    let id: String = redis::cmd("XADD").arg("orders").arg("*").arg("n").arg(1).query(&mut conn).unwrap();
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("workers")
        .arg("w-1")
        .arg("STREAMS")
        .arg("orders")
        .arg(">")
        .query(&mut conn)
        .unwrap();
    let without = pelican_ok(&["status", "orders", "-n", &ns]);
    assert!(without.contains("not read from the server:"), "{without}");
    let address = server.url().trim_start_matches("redis://").trim_end_matches("/0").to_string();
    let with = pelican_ok(&["status", "orders", "-n", &ns, "--redis-address", &address]);
    assert!(with.contains(&id) && with.contains("w-1"), "the pending entry {id} of w-1 is not listed:\n{with}");
    let bad = kubectl_plugin(&["pelican", "status", "orders", "-n", &ns, "--redis-address", "redis://x:1"]);
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && stderr.contains("is not a host name or address"), "{stderr}");
}

/// `status` of a topic: the partitions column in the table; for one topic, each partition with its owner (the member
/// the membership gave it) and its pending count, and the oldest pending entries of every partition, named by their
/// partition's stream.
#[test]
fn status_of_a_topic_shows_each_partition_with_its_owner_and_the_oldest_pending_of_all() {
    let server = Server::start(Flavor::Redis);
    let manifest = policy("orders", &server.url(), "orders", "billing", "  partitions: 2\n");
    let (ns, _operator) = ready_policy("plugin-topic", &manifest, "orders");
    let mut conn = server.conn();
    let member = pelican::topic::Member {
        topic: "orders".into(),
        group: "billing".into(),
        name: "w1".into(),
        ttl: Duration::from_secs(60),
        partitions: 2,
    };
    let assignment = runtime().block_on(async {
        let mut conn = redis::Client::open(server.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
        pelican::topic::heartbeat(&mut conn, &member, false, &[]).await.unwrap()
    });
    assert_eq!(assignment.owned.len(), 2, "the only member owns both partitions");
    for p in 0..2 {
        let stream = pelican::keys::partition_stream("orders", p);
        let _: String = redis::cmd("XADD").arg(&stream).arg("*").arg("n").arg(p).query(&mut conn).unwrap();
        assert_eq!(read_new(&mut conn, &stream, "billing", "w1", 1).len(), 1);
    }
    let table = pelican_ok(&["status", "-n", &ns]);
    assert_eq!(table_rows(&table)[0]["PARTITIONS"], "2", "{table}");
    let one = pelican_ok(&["status", "orders", "-n", &ns]);
    assert!(one.contains("a topic of 2 partitions, 2 with the group"), "{one}");
    assert!(one.contains("{orders:0}") && one.contains("{orders:1}"), "both partitions: {one}");
    let json: Value = serde_json::from_str(&pelican_ok(&["status", "orders", "-n", &ns, "-o", "json"])).unwrap();
    let partitions = json["partitions"].as_array().unwrap();
    assert_eq!(partitions.len(), 2, "{json}");
    assert!(partitions.iter().all(|p| p["owner"] == "w1" && p["pending"] == 1), "{json}");
    let oldest: Vec<&str> =
        json["oldestPending"].as_array().unwrap().iter().map(|e| e["stream"].as_str().unwrap()).collect();
    assert_eq!(oldest.len(), 2, "the oldest pending of every partition: {json}");
    assert!(oldest.contains(&"{orders:0}") && oldest.contains(&"{orders:1}"), "{oldest:?}");
}
