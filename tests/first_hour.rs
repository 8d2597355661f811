//! What a new user touches first: one server however its URL is spelled, and finalizers only where
//! deleting a policy has work to do in Redis.

#[macro_use]
mod common;

use std::time::Duration;

use common::*;

on_both_servers!(
    two_spellings_of_one_server_are_one_server,
    only_policies_with_redis_work_on_deletion_carry_the_finalizer,
    the_documented_move_to_another_host_name_keeps_the_group_and_counters,
    mistakes_a_new_user_makes_are_stalled_with_what_to_change,
);

fn two_spellings_of_one_server_are_one_server(flavor: Flavor) {
    let server = Server::start(flavor);
    let ns = namespace("spelling");
    let _operator = Operator::start(&ns);
    let plain = format!("redis://127.0.0.1:{}", server.port);
    assert!(kubectl_apply(&ns, &policy("first", &plain, "orders", "billing", "")).0);
    wait_condition(&ns, "first", "Ready", "True", "Reconciled");
    for (name, url) in
        [("second", format!("{plain}/0")), ("third", format!("{plain}/00")), ("fourth", format!("{plain}/"))]
    {
        assert!(kubectl_apply(&ns, &policy(name, &url, "orders", "billing", "")).0);
        let p = wait_condition(&ns, name, "Stalled", "True", "ResourceConflict");
        let message =
            p["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Ready").unwrap()["message"]
                .to_string();
        assert!(message.contains("first"), "{message}");
    }
    let clients: String = redis::cmd("CLIENT").arg("LIST").query(&mut server.conn()).unwrap();
    let operator_connections = clients.lines().filter(|l| !l.contains("cmd=client")).count();
    assert_eq!(operator_connections, 1, "one connection per server, whatever the spelling:\n{clients}");
}

fn only_policies_with_redis_work_on_deletion_carry_the_finalizer(flavor: Flavor) {
    let server = Server::start(flavor);
    let ns = namespace("finalizers");
    let mut operator = Operator::start(&ns);
    let retain = policy("retain", &server.url(), "a", "g", "");
    let delete = policy("delete", &server.url(), "b", "g", "  deletionPolicy: Delete\n");
    let bounded = policy("bounded", &server.url(), "c", "g", "  backlog:\n    maxLength: 10\n");
    assert!(kubectl_apply(&ns, &format!("{retain}---\n{delete}---\n{bounded}")).0);
    for name in ["retain", "delete", "bounded"] {
        wait_condition(&ns, name, "Ready", "True", "Reconciled");
    }
    let finalizers = |name: &str| get_policy(&ns, name)["metadata"]["finalizers"].clone();
    assert_eq!(finalizers("retain"), serde_json::Value::Null);
    assert_eq!(finalizers("delete"), serde_json::json!(["pelican.io/cleanup"]));
    assert_eq!(finalizers("bounded"), serde_json::json!(["pelican.io/cleanup"]));

    // Switching to Retain takes the finalizer off.
    switch_to_retain(&ns, "delete");

    // With the operator down, deleting Retain policies does not hang.
    operator.kill9();
    kubectl_ok(&["delete", "cgp", "retain", "delete", "-n", &ns, "--timeout=20s"]);
    operator = Operator::start(&ns);
    // The bounded one still has its finalizer, and its deletion removes the bound from Redis.
    kubectl_ok(&["delete", "cgp", "bounded", "-n", &ns, "--timeout=30s"]);
    let bound: Option<String> =
        redis::cmd("HGET").arg(pelican::keys::bounds_key("c")).arg("g").query(&mut server.conn()).unwrap();
    assert_eq!(bound, None, "the deleted policy's bound is still in Redis");
    assert_eq!(group_names(&mut server.conn(), "a"), ["g"], "Retain leaves the group");
    assert!(operator.is_running());
}

/// Deleting a namespace takes a policy's Redis (and Secret, and the operator's Roles there) with it in no order: a
/// `Delete` policy whose server is gone must not hold the namespace in Terminating for good.
#[test]
fn a_policy_whose_server_is_gone_lets_go_when_its_namespace_is_deleted() {
    let mut server = Server::start(Flavor::Redis);
    let (ns, operator) =
        ready_policy("nsgone", &policy("p", &server.url(), "s", "g", "  deletionPolicy: Delete\n"), "p");
    server.stop();
    kubectl_ok(&["delete", "cgp", "p", "-n", &ns, "--wait=false"]);
    // The server may come back: the policy alone being deleted waits for it.
    std::thread::sleep(Duration::from_secs(4));
    assert!(kubectl(&["get", "cgp", "p", "-n", &ns], None).status.success(), "let go while the server may return");
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"]);
    wait_for("the policy gone with its namespace", Duration::from_secs(70), || {
        if kubectl(&["get", "cgp", "p", "-n", &ns], None).status.success() { Err("still there".into()) } else { Ok(()) }
    });
    let logs = operator.logs();
    let line = logs.lines().find(|l| l.contains("CleanupSkipped"));
    assert!(
        line.is_some_and(|l| l.contains("group \\\"g\\\" left in Redis: the namespace is being deleted")),
        "{logs}"
    );
}

/// The move docs/src/policy.md describes: Retain, delete, apply with the new URL. The group, its PEL and the counters carry on.
fn the_documented_move_to_another_host_name_keeps_the_group_and_counters(flavor: Flavor) {
    let server = Server::start(flavor);
    let ns = namespace("move");
    let _operator = Operator::start(&ns);
    let old = policy(
        "orders",
        &format!("redis://127.0.0.1:{}", server.port),
        "orders",
        "billing",
        "  deletionPolicy: Delete\n",
    )
    .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n")
    .replace("  retry:\n", "");
    let old = old.replace("  deadLetter:", "  retry:\n    maxDeliveries: 1\n  deadLetter:");
    assert!(kubectl_apply(&ns, &old).0);
    wait_condition(&ns, "orders", "Ready", "True", "Reconciled");
    let mut conn = server.conn();
    for n in 0..3 {
        let _: String = redis::cmd("XADD").arg("orders").arg("*").arg("n").arg(n).query(&mut conn).unwrap();
    }
    let read = read_new(&mut conn, "orders", "billing", "c1", 3);
    assert_eq!(read.len(), 3);
    // Past maxDeliveries 1 and idle: dead-lettered and counted.
    wait_for("3 dead-lettered", Duration::from_secs(30), || {
        let p = get_policy(&ns, "orders");
        if p["status"]["totals"]["deadLettered"] == 3 { Ok(()) } else { Err(p["status"]["totals"].to_string()) }
    });
    switch_to_retain(&ns, "orders");
    kubectl_ok(&["delete", "cgp", "orders", "-n", &ns, "--timeout=10s"]);
    // Between the two policies a consumer holds an entry (no policy runs passes now).
    let _: String = redis::cmd("XADD").arg("orders").arg("*").arg("n").arg(9).query(&mut conn).unwrap();
    let pending = read_new(&mut conn, "orders", "billing", "c2", 1);
    let moved =
        old.replace(&format!("redis://127.0.0.1:{}", server.port), &format!("redis://127.0.0.1:{}/0", server.port));
    assert!(kubectl_apply(&ns, &moved).0);
    let p = wait_condition(&ns, "orders", "Ready", "True", "Reconciled");
    assert_eq!(p["status"]["totals"]["deadLettered"], 3, "the counters carried on");
    assert_eq!(pel(&mut conn, "orders", "billing").len(), 1, "the PEL is intact");
    assert_eq!(pel(&mut conn, "orders", "billing")[0].0, pending[0]);
    assert_eq!(events(&ns, "GroupCreated").len(), 1, "the group was found, not created again");
    assert!(events(&ns, "GroupRecreated").is_empty());
}

/// Patches the policy to `Retain` and waits for the operator to take its finalizer off.
fn switch_to_retain(ns: &str, name: &str) {
    patch_policy(ns, name, "merge", r#"{"spec":{"deletionPolicy":"Retain"}}"#);
    wait_for("the finalizer to go", Duration::from_secs(30), || {
        let now = get_policy(ns, name)["metadata"]["finalizers"].clone();
        if now.is_null() || now == serde_json::json!([]) { Ok(()) } else { Err(now.to_string()) }
    });
}

/// Found by tests/settle.rs: these were retried forever as a generic `RedisError`.
fn mistakes_a_new_user_makes_are_stalled_with_what_to_change(flavor: Flavor) {
    let server = Server::start(flavor);
    let ns = namespace("mistakes");
    let _operator = Operator::start(&ns);
    let plain = format!("redis://127.0.0.1:{}", server.port);
    let cluster = policy("cluster", &plain, "{a}", "g", "").replace("    url:", "    mode: Cluster\n    url:");
    let database = policy("database", &format!("{plain}/99"), "b", "g", "");
    let future = policy("future", &plain, "c", "g", "").replace("startId: \"0\"", "startId: \"4000000000000-0\"");
    let huge = policy("huge", &plain, "d", "g", "").replace("startId: \"0\"", "startId: \"19999999999999999999\"");
    assert!(kubectl_apply(&ns, &[cluster, database, future, huge].join("---\n")).0);
    for (name, reason, says) in [
        ("cluster", "NotACluster", "set mode Standalone"),
        ("database", "DatabaseNotFound", "has no database 99"),
        ("future", "InvalidStartId", "ahead of the server's clock"),
        ("huge", "InvalidStartId", "refused it"),
    ] {
        let p = wait_condition(&ns, name, "Stalled", "True", reason);
        let ready =
            p["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Ready").unwrap().clone();
        assert!(ready["message"].as_str().unwrap().contains(says), "{name}: {ready}");
    }
    assert!(group_names(&mut server.conn(), "c").is_empty(), "a group was created at a future id");

    // The default mode pointed at a cluster node that does not own the stream's slot.
    let cluster = Cluster::start(flavor);
    let mut node = cluster.nodes[0].conn();
    let foreign = (0..)
        .map(|i| format!("s{i}"))
        .find(|name| redis::cmd("TYPE").arg(name).query::<String>(&mut node).is_err_and(|e| e.code() == Some("MOVED")))
        .unwrap();
    assert!(kubectl_apply(&ns, &policy("standalone", &cluster.url(), &foreign, "g", "")).0);
    let p = wait_condition(&ns, "standalone", "Stalled", "True", "ClusterNode");
    let ready = p["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Ready").unwrap().clone();
    assert!(ready["message"].as_str().unwrap().contains("set spec.redis.mode to Cluster"), "{ready}");
}
