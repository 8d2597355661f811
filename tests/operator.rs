//! The operator end to end: real kube-apiserver (scripts/testenv), real Redis 7.0 and Valkey 9.1.
//! Every scenario runs on both servers.

#[macro_use]
mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

on_both_servers!(
    apply_makes_the_group_and_get_shows_live_numbers,
    group_deleted_out_of_band_is_recreated_with_a_warning,
    retain_leaves_the_group_and_delete_destroys_it,
    missing_secret_stalls_then_heals_when_created,
    wrong_password_is_refused_then_heals_when_fixed,
    server_restart_is_redis_unavailable_then_heals,
    stream_key_of_another_type_stalls_until_removed,
    second_policy_for_the_same_group_is_a_conflict,
);

fn status_i64(policy: &Value, field: &str) -> Option<i64> {
    policy["status"][field].as_i64()
}

fn apply_makes_the_group_and_get_shows_live_numbers(flavor: Flavor) {
    let server = Server::start(flavor);
    let ns = namespace("ready");
    let operator = Operator::start(&ns);
    let manifest = policy("orders", &server.url(), "orders", "billing", "");
    let (ok, out) = kubectl_apply(&ns, &manifest);
    assert!(ok, "{out}");
    kubectl_ok(&["wait", "-n", &ns, "--for=condition=Ready", "--timeout=30s", "cgp/orders"]);
    assert_eq!(group_names(&mut server.conn(), "orders"), vec!["billing"]);

    // Produce 10, deliver 6 to two consumers, acknowledge 2: 4 pending, 4 never delivered.
    let mut conn = server.conn();
    for i in 0..10 {
        let _: String = redis::cmd("XADD").arg("orders").arg("*").arg("n").arg(i).query(&mut conn).unwrap();
    }
    let read = |consumer: &str, count: usize, conn: &mut redis::Connection| -> Vec<String> {
        let reply: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("billing")
            .arg(consumer)
            .arg("COUNT")
            .arg(count)
            .arg("STREAMS")
            .arg("orders")
            .arg(">")
            .query(conn)
            .unwrap();
        reply.keys[0].ids.iter().map(|e| e.id.clone()).collect()
    };
    let first = read("worker-a", 3, &mut conn);
    let _second = read("worker-b", 3, &mut conn);
    let _: i64 =
        redis::cmd("XACK").arg("orders").arg("billing").arg(&first[0]).arg(&first[1]).query(&mut conn).unwrap();

    let policy = wait_for("status to show 4 pending", Duration::from_secs(20), || {
        let p = get_policy(&ns, "orders");
        if status_i64(&p, "pending") == Some(4) && status_i64(&p, "lag") == Some(4) {
            Ok(p)
        } else {
            Err(p["status"].to_string())
        }
    });
    let status = &policy["status"];
    assert_eq!(status["streamLength"], 10);
    assert_eq!(status["consumers"], 2);
    assert_eq!(status["oldestPendingId"], first[2].as_str());
    assert_eq!(status["deadLetterLength"], 0);
    assert_eq!(status["observedGeneration"], policy["metadata"]["generation"]);
    let expected_version = if flavor == Flavor::Valkey { "valkey 9." } else { "redis 7.0." };
    assert!(status["serverVersion"].as_str().unwrap().starts_with(expected_version), "{status}");

    // The same numbers straight from the server.
    let pending: (i64, String, String, Vec<(String, String)>) =
        redis::cmd("XPENDING").arg("orders").arg("billing").query(&mut conn).unwrap();
    assert_eq!(pending.0, 4);
    assert_eq!(pending.1, first[2]);
    let millis: i64 = first[2].split('-').next().unwrap().parse().unwrap();
    let oldest = status["oldestPendingTime"].as_str().unwrap();
    let expected_time = k8s_openapi::jiff::Timestamp::from_second(millis / 1000).unwrap().to_string();
    assert_eq!(oldest, expected_time);

    // What a person sees.
    let table = kubectl_ok(&["get", "cgp", "-n", &ns]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["NAME", "STREAM", "GROUP", "PENDING", "OLDEST", "LAG", "DEAD-LETTERED", "READY", "AGE"]);
    let row = &table_rows(&table)[0];
    let cells: Vec<&str> = header.iter().map(|h| row[*h].as_str()).collect();
    assert_eq!(cells[..4], ["orders", "orders", "billing", "4"], "{table}");
    assert!(cells[4].ends_with('s') || cells[4].ends_with('m'), "OLDEST is an age: {table}");
    assert_eq!(cells[5..8], ["4", "0", "True"], "{table}");
    wait_for("/readyz", Duration::from_secs(5), || match Operator::http_get(operator.health_port, "/readyz") {
        (200, body) if body == "ok" => Ok(()),
        other => Err(format!("{other:?}")),
    });
    assert_eq!(Operator::http_get(operator.health_port, "/healthz").0, 200);
    // JSON log lines, each about one policy with its namespace and name (the reconcile's span).
    let logs = operator.logs();
    let ready_line = logs
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("not a JSON log line ({e}): {l}")))
        .find(|l| l["message"].as_str().is_some_and(|m| m.contains("is ready")))
        .expect("a log line saying the policy is ready");
    let span = &ready_line["span"];
    assert_eq!(
        (span["namespace"].as_str(), span["policy"].as_str()),
        (Some(ns.as_str()), Some("orders")),
        "{ready_line}"
    );
    assert_eq!(ready_line["level"], "INFO");
    let metrics = operator.metrics();
    let labels = format!(r#"namespace="{ns}",policy="orders",stream="orders",group="billing""#);
    assert!(metrics.contains(&format!("pelican_group_pending{{{labels}}} 4")), "{metrics}");
    assert!(metrics.contains(&format!("pelican_group_lag{{{labels}}} 4")), "{metrics}");
    assert!(
        metrics.contains("controller_runtime_reconcile_total{controller=\"consumergrouppolicy\",result=\"success\"}")
    );
    let wide = kubectl_ok(&["get", "cgp", "-n", &ns, "-o", "wide"]);
    assert!(wide.lines().next().unwrap().contains("CONSUMERS"), "{wide}");
    assert!(wide.lines().nth(1).unwrap().contains("Reconciled"), "{wide}");
}

fn group_deleted_out_of_band_is_recreated_with_a_warning(flavor: Flavor) {
    let server = Server::start(flavor);
    let (ns, _operator) = ready_policy("recreate", &policy("jobs", &server.url(), "jobs", "runner", ""), "jobs");
    let _: i64 = redis::cmd("XGROUP").arg("DESTROY").arg("jobs").arg("runner").query(&mut server.conn()).unwrap();
    wait_for("group to be recreated", Duration::from_secs(20), || {
        if group_names(&mut server.conn(), "jobs") == ["runner"] { Ok(()) } else { Err("missing".into()) }
    });
    let recreated = wait_for("GroupRecreated event", Duration::from_secs(10), || {
        let ev = events(&ns, "GroupRecreated");
        if ev.is_empty() { Err("none".into()) } else { Ok(ev) }
    });
    assert_eq!(recreated[0]["type"], "Warning");
}

fn retain_leaves_the_group_and_delete_destroys_it(flavor: Flavor) {
    let server = Server::start(flavor);
    let ns = namespace("deletion");
    let _operator = Operator::start(&ns);
    let kept = policy("kept", &server.url(), "kept", "g", "  deletionPolicy: Retain\n");
    let gone = policy("gone", &server.url(), "gone", "g", "  deletionPolicy: Delete\n");
    assert!(kubectl_apply(&ns, &format!("{kept}\n---\n{gone}")).0);
    wait_condition(&ns, "kept", "Ready", "True", "Reconciled");
    wait_condition(&ns, "gone", "Ready", "True", "Reconciled");
    // Only the policy whose deletion has work to do in Redis carries the finalizer.
    assert_eq!(get_policy(&ns, "kept")["metadata"]["finalizers"], serde_json::Value::Null);
    assert_eq!(get_policy(&ns, "gone")["metadata"]["finalizers"], serde_json::json!(["pelican.io/cleanup"]));

    kubectl_ok(&["delete", "cgp", "kept", "gone", "-n", &ns, "--timeout=30s"]);
    assert_eq!(group_names(&mut server.conn(), "kept"), ["g"], "Retain must leave the group");
    assert!(group_names(&mut server.conn(), "gone").is_empty(), "Delete must destroy the group");
    let kind: String = redis::cmd("TYPE").arg("gone").query(&mut server.conn()).unwrap();
    assert_eq!(kind, "stream", "the stream itself is never deleted");
}

fn with_password(name: &str, server: &Server, extra: &str) -> String {
    let refs = "    passwordSecretRef: {name: redis-auth, key: password}\n";
    policy(name, &server.url(), name, "g", extra).replacen("  stream:", &format!("{refs}  stream:"), 1)
}

fn secret(password: &str) -> String {
    format!("apiVersion: v1\nkind: Secret\nmetadata:\n  name: redis-auth\nstringData:\n  password: {password}\n")
}

fn missing_secret_stalls_then_heals_when_created(flavor: Flavor) {
    let server = Server::start_with(flavor, &["--requirepass", "s3cret-pw-1"]);
    let ns = namespace("secret");
    let operator = Operator::start(&ns);
    // A long interval: only the Secret watch can heal the policy within the test's wait.
    let manifest = with_password("paid", &server, "").replace("interval: 1s", "interval: 10m");
    assert!(kubectl_apply(&ns, &manifest).0);
    let p = wait_condition(&ns, "paid", "Stalled", "True", "SecretNotFound");
    assert_eq!(condition(&p, "Ready"), Some(("False".into(), "SecretNotFound".into())));
    let message =
        p["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Ready").unwrap()["message"].clone();
    assert!(message.as_str().unwrap().contains("redis-auth"), "{message}");

    assert!(kubectl_apply(&ns, &secret("s3cret-pw-1")).0);
    // Healed by the Secret watch, well before the policy's own timer would matter.
    wait_condition(&ns, "paid", "Ready", "True", "Reconciled");
    assert_eq!(group_names(&mut server.conn(), "paid"), ["g"]);
    assert!(!operator.logs().contains("s3cret-pw-1"), "the password leaked into the operator log");
}

fn wrong_password_is_refused_then_heals_when_fixed(flavor: Flavor) {
    let server = Server::start_with(flavor, &["--requirepass", "right-pw-2"]);
    let ns = namespace("auth");
    let operator = Operator::start(&ns);
    assert!(kubectl_apply(&ns, &secret("wrong-pw-2")).0);
    assert!(kubectl_apply(&ns, &with_password("auth", &server, "")).0);
    let p = wait_condition(&ns, "auth", "Stalled", "True", "AuthenticationFailed");
    assert!(!p.to_string().contains("wrong-pw-2"));
    assert!(kubectl_apply(&ns, &secret("right-pw-2")).0);
    wait_condition(&ns, "auth", "Ready", "True", "Reconciled");
    let logs = operator.logs();
    assert!(logs.contains("AuthenticationFailed"), "the failure should be logged");
    assert!(!logs.contains("wrong-pw-2") && !logs.contains("right-pw-2"), "a password leaked into the log");
    let events = kubectl_ok(&["get", "events", "-n", &ns, "-o", "json"]);
    assert!(!events.contains("wrong-pw-2") && !events.contains("right-pw-2"), "a password leaked into an Event");
}

fn server_restart_is_redis_unavailable_then_heals(flavor: Flavor) {
    let mut server = Server::start(flavor);
    let (ns, mut operator) = ready_policy("restart", &policy("flaky", &server.url(), "flaky", "g", ""), "flaky");
    server.stop();
    let p = wait_condition(&ns, "flaky", "Ready", "False", "RedisUnavailable");
    assert_eq!(condition(&p, "Reconciling"), Some(("True".into(), "RedisUnavailable".into())));
    assert_eq!(condition(&p, "Stalled").unwrap().0, "False");
    server.resume();
    wait_condition(&ns, "flaky", "Ready", "True", "Reconciled");
    assert_eq!(group_names(&mut server.conn(), "flaky"), ["g"], "the restarted (empty) server gets the group again");
    // The most common way to lose a group (a restart without persistence) is a Warning, whatever the condition
    // was just before (RedisUnavailable here), never a Normal GroupCreated.
    let recreated = wait_for("GroupRecreated event", Duration::from_secs(10), || {
        let ev = events(&ns, "GroupRecreated");
        if ev.is_empty() {
            Err(format!("GroupCreated events: {:?}", events(&ns, "GroupCreated").len()))
        } else {
            Ok(ev)
        }
    });
    assert_eq!(recreated[0]["type"], "Warning");
    assert_eq!(events(&ns, "GroupCreated").len(), 1, "only the first creation is a Normal GroupCreated");
    assert!(operator.is_running(), "the operator must not crash");
}

fn stream_key_of_another_type_stalls_until_removed(flavor: Flavor) {
    let server = Server::start(flavor);
    let _: () = redis::cmd("SET").arg("typed").arg("not a stream").query(&mut server.conn()).unwrap();
    let ns = namespace("keytype");
    let _operator = Operator::start(&ns);
    assert!(kubectl_apply(&ns, &policy("typed", &server.url(), "typed", "g", "")).0);
    let p = wait_condition(&ns, "typed", "Stalled", "True", "WrongKeyType");
    assert!(p.to_string().contains("holds a string"), "{p}");
    let value: String = redis::cmd("GET").arg("typed").query(&mut server.conn()).unwrap();
    assert_eq!(value, "not a stream", "the other value must be left alone");
    let _: i64 = redis::cmd("DEL").arg("typed").query(&mut server.conn()).unwrap();
    wait_condition(&ns, "typed", "Ready", "True", "Reconciled");
}

fn second_policy_for_the_same_group_is_a_conflict(flavor: Flavor) {
    let server = Server::start(flavor);
    let (ns, _operator) = ready_policy("conflict", &policy("first", &server.url(), "shared", "g", ""), "first");
    std::thread::sleep(Duration::from_millis(1100)); // creation timestamps have one-second resolution
    let second = policy("second", &server.url(), "shared", "g", "  deletionPolicy: Delete\n");
    assert!(kubectl_apply(&ns, &second).0);
    let p = wait_condition(&ns, "second", "Stalled", "True", "ResourceConflict");
    assert!(p.to_string().contains(&format!("{ns}/first")), "{p}");
    // Deleting the loser must not destroy the winner's group, even with deletionPolicy Delete.
    kubectl_ok(&["delete", "cgp", "second", "-n", &ns, "--timeout=30s"]);
    assert_eq!(group_names(&mut server.conn(), "shared"), ["g"]);
    wait_condition(&ns, "first", "Ready", "True", "Reconciled");
}

/// Requeueing into a stream other groups read gives each of them a copy: `kubectl get -o wide` names them and a
/// Warning Event says so when it starts.
#[test]
fn requeue_on_a_stream_other_groups_read_is_signalled() {
    let server = Server::start(Flavor::Redis);
    let ns = namespace("requeue-copies");
    let _operator = Operator::start(&ns);
    let mut conn = server.conn();
    for group in ["audit", "search"] {
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg("orders")
            .arg(group)
            .arg("$")
            .arg("MKSTREAM")
            .query(&mut conn)
            .unwrap();
    }
    assert!(kubectl_apply(&ns, &policy("orders", &server.url(), "orders", "billing", "")).0);
    wait_condition(&ns, "orders", "Ready", "True", "Reconciled");
    let policy_json = wait_for("status.requeueCopiesTo", Duration::from_secs(20), || {
        let p = get_policy(&ns, "orders");
        if p["status"]["requeueCopiesTo"].is_string() { Ok(p) } else { Err(p["status"].to_string()) }
    });
    assert_eq!(policy_json["status"]["requeueCopiesTo"], "audit,search");
    let wide = table_rows(&kubectl_ok(&["get", "cgp", "orders", "-n", &ns, "-o", "wide"]));
    assert_eq!(wide[0]["REQUEUE-COPIES-TO"], "audit,search", "{wide:?}");
    let warning = wait_for("a RequeueCopies event", Duration::from_secs(10), || {
        events(&ns, "RequeueCopies").into_iter().next().ok_or_else(|| "none".to_string())
    });
    assert_eq!(warning["type"], "Warning");
    let message = warning["message"].as_str().unwrap();
    assert!(message.contains("audit,search") && message.contains("Reassign"), "{message}");

    // Reassign hands idle entries to a consumer of the same group: nobody else gets a copy, nothing to signal.
    patch_policy(&ns, "orders", "merge", r#"{"spec":{"reclaim":{"strategy":"Reassign"}}}"#);
    wait_for("requeueCopiesTo gone", Duration::from_secs(20), || {
        let p = get_policy(&ns, "orders");
        if p["status"]["requeueCopiesTo"].is_null() { Ok(()) } else { Err(p["status"].to_string()) }
    });
}

/// The sizes of the operator's in-memory maps, from `pelican_state_entries`.
fn state_entries(operator: &Operator) -> std::collections::BTreeMap<String, i64> {
    operator
        .metrics()
        .lines()
        .filter_map(|line| line.strip_prefix("pelican_state_entries{map=\""))
        .filter_map(|rest| {
            let (map, value) = rest.split_once("\"} ")?;
            Some((map.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// 1,000 policies (with a password Secret, on a server of their own) created and deleted in two rounds of 500:
/// afterwards every map of the operator is back to its size before, and the second round costs no memory the first
/// did not (a leak grows with every round).
#[test]
fn a_churn_of_a_thousand_policies_leaves_nothing_behind() {
    const ROUND: usize = 500;
    let steady_server = Server::start(Flavor::Valkey);
    let churn_server = Server::start_with(Flavor::Valkey, &["--requirepass", "churn-pw"]);
    let (ns, operator) = ready_policy("churn", &policy("steady", &steady_server.url(), "steady", "g", ""), "steady");
    let secret = "apiVersion: v1\nkind: Secret\nmetadata:\n  name: churn-auth\nstringData:\n  password: churn-pw\n";
    assert!(kubectl_apply(&ns, secret).0);
    std::thread::sleep(Duration::from_secs(12));
    let baseline = state_entries(&operator);
    assert!(baseline.contains_key("runner_tasks"), "{baseline:?}");
    let mut rss = Vec::new();
    for round in 0..2 {
        let manifests: Vec<String> = (0..ROUND)
            .map(|i| {
                policy(&format!("churn-{round}-{i}"), &churn_server.url(), &format!("s{i}"), "g", "")
                    .replace("metadata:\n", "metadata:\n  labels: {churn: \"yes\"}\n")
                    .replacen("  stream:", "    passwordSecretRef: {name: churn-auth, key: password}\n  stream:", 1)
            })
            .collect();
        let (ok, out) = kubectl_apply(&ns, &manifests.join("---\n"));
        assert!(ok, "{out}");
        wait_all_ready(&ns, ROUND + 1, Duration::from_secs(180));
        let busy = state_entries(&operator);
        assert_eq!(busy["runner_tasks"], baseline["runner_tasks"] + ROUND as i64, "{busy:?}");
        kubectl_ok(&["delete", "cgp", "-n", &ns, "-l", "churn=yes", "--wait=true"]);
        let after = wait_for("the maps back to their size before the round", Duration::from_secs(60), || {
            let now = state_entries(&operator);
            let back = now.iter().all(|(map, n)| map == "deleted_policies" || baseline.get(map) == Some(n));
            if back { Ok(now) } else { Err(format!("before {baseline:?}, now {now:?}")) }
        });
        // Deleted policies are remembered for ten minutes (a reconcile in flight must not restart their jobs).
        assert!(after["deleted_policies"] <= ((round + 1) * ROUND) as i64, "{after:?}");
        let series = operator.metrics().lines().filter(|l| l.contains("policy=\"churn-")).count();
        assert_eq!(series, 0, "metric series of deleted policies remain");
        rss.push(rss_kib(operator.pid()));
        println!("round {round}: {ROUND} policies created, Ready and deleted; maps {after:?}; RSS {} KiB", rss[round]);
    }
    assert!(rss[1] <= rss[0] + rss[0] / 10, "memory grew from round to round: {rss:?} KiB");
}

/// Defect (issue 48.18): a policy with `deletionPolicy: Delete` that found an existing group (someone else's) and was
/// deleted destroyed it, pending entries included. `Delete` now destroys only a group the policy created: the group
/// made by hand stays with its PEL and an Event says why; with `adoptGroup: true` it goes.
#[test]
fn delete_destroys_only_a_group_the_policy_created_or_adopts() {
    let server = Server::start(Flavor::Redis);
    let mut conn = server.conn();
    for stream in ["theirs", "adopted"] {
        let _: () =
            redis::cmd("XGROUP").arg("CREATE").arg(stream).arg("g").arg("0").arg("MKSTREAM").query(&mut conn).unwrap();
        let _: String = redis::cmd("XADD").arg(stream).arg("*").arg("n").arg(1).query(&mut conn).unwrap();
        let read: redis::Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("g")
            .arg("someone")
            .arg("STREAMS")
            .arg(stream)
            .arg(">")
            .query(&mut conn)
            .unwrap();
        assert_ne!(read, redis::Value::Nil);
    }
    let ns = namespace("adopt");
    let _operator = Operator::start(&ns);
    let theirs = policy("theirs", &server.url(), "theirs", "g", "  deletionPolicy: Delete\n");
    let adopted = policy("adopted", &server.url(), "adopted", "g", "  deletionPolicy: Delete\n  adoptGroup: true\n");
    assert!(kubectl_apply(&ns, &format!("{theirs}\n---\n{adopted}")).0);
    wait_condition(&ns, "theirs", "Ready", "True", "Reconciled");
    wait_condition(&ns, "adopted", "Ready", "True", "Reconciled");
    kubectl_ok(&["delete", "cgp", "theirs", "adopted", "-n", &ns, "--timeout=30s"]);

    assert_eq!(group_names(&mut server.conn(), "theirs"), ["g"], "a group the policy did not create stays");
    let summary: (i64, redis::Value, redis::Value, redis::Value) =
        redis::cmd("XPENDING").arg("theirs").arg("g").query(&mut conn).unwrap();
    assert_eq!(summary.0, 1, "with its pending entry");
    let retained = events(&ns, "GroupRetained");
    let note = retained.iter().map(|e| e["message"].as_str().unwrap_or_default()).collect::<Vec<_>>().join("\n");
    assert!(note.contains("not by a policy") && note.contains("adoptGroup"), "{retained:?}");
    assert!(group_names(&mut server.conn(), "adopted").is_empty(), "adoptGroup: true destroys it");
}
