//! Real Redis deployments: TLS with certificates from Secrets (Redis 7.0; the Valkey build of the bed has no TLS),
//! and ACL users with the documented minimal rule set (Redis 7.0 and Valkey 9.1). No secret value ever reaches a
//! log line, the status or an Event.

#[macro_use]
mod common;

use std::time::Duration;

use common::*;

on_both_servers!(
    the_documented_acl_runs_every_job,
    a_missing_acl_permission_stalls_naming_the_command_then_heals,
    a_refusal_inside_the_status_pipeline_names_the_command,
);

/// A Secret `name` with one key per (key, value).
fn secret(name: &str, entries: &[(&str, &str)]) -> String {
    let data: Vec<String> =
        entries.iter().map(|(k, v)| format!("  {k}: {}", serde_json::to_string(v).unwrap())).collect();
    format!("apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\nstringData:\n{}\n", data.join("\n"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap()
}

/// A policy on `url` with `redis_extra` under spec.redis.
fn policy_with(name: &str, url: &str, redis_extra: &str, extra: &str) -> String {
    policy(name, url, name, "g", extra).replacen("  stream:", &format!("{redis_extra}  stream:"), 1)
}

const CA_REF: &str = "    tls:\n      caSecretRef: {name: redis-tls, key: ca.crt}\n";

/// Everything the API server holds about a namespace's policies and events, to grep for secrets.
fn api_objects(ns: &str) -> String {
    kubectl_ok(&["get", "cgp,events", "-n", ns, "-o", "json"])
}

#[test]
fn tls_with_the_ca_from_a_secret_is_ready() {
    let server = Server::start_tls(Flavor::Redis, "server", false);
    let manifests = format!(
        "{}---\n{}",
        secret("redis-tls", &[("ca.crt", &read(&tls_file("ca.crt")))]),
        policy_with("t", &server.tls_url(), CA_REF, "")
    );
    let (_ns, operator) = ready_policy("tls", &manifests, "t");
    let clients: String = redis::cmd("CLIENT").arg("LIST").query(&mut server.conn()).unwrap();
    let tls_port = format!("laddr=127.0.0.1:{} ", server.tls_port.unwrap());
    assert!(clients.lines().any(|c| c.contains(&tls_port)), "the operator is connected to the TLS port: {clients}");
    assert!(!operator.logs().contains("BEGIN CERTIFICATE"));
}

#[test]
fn mutual_tls_uses_the_client_certificate_and_never_shows_the_key() {
    let server = Server::start_tls(Flavor::Redis, "server", true);
    let ns = namespace("mtls");
    let operator = Operator::start(&ns);
    let key = read(&tls_file("client.key"));
    let tls = secret(
        "redis-tls",
        &[("ca.crt", &read(&tls_file("ca.crt"))), ("tls.crt", &read(&tls_file("client.crt"))), ("tls.key", &key)],
    );
    let refs = "    tls:\n      caSecretRef: {name: redis-tls, key: ca.crt}\n      certSecretRef: {name: redis-tls, key: tls.crt}\n      keySecretRef: {name: redis-tls, key: tls.key}\n";
    // The same server, at the same moment, refuses a connection without the client certificate and accepts one
    // with it: so the Ready below is owed to the certificate, not to a server that takes anyone.
    let ca = Some(read(&tls_file("ca.crt")).into_bytes());
    let anonymous = pelican::redis::Target {
        tls: pelican::redis::Tls { ca: ca.clone(), ..Default::default() },
        ..pelican::redis::Target::new(server.tls_url())
    };
    let with_certificate = pelican::redis::Target {
        tls: pelican::redis::Tls {
            ca,
            client_cert: Some(read(&tls_file("client.crt")).into_bytes()),
            client_key: Some(key.clone().into_bytes()),
            insecure_skip_verify: false,
        },
        ..pelican::redis::Target::new(server.tls_url())
    };
    let (refused, accepted) =
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
            let attempt = |target: pelican::redis::Target| async move {
                let keys = pelican::redis::GroupKeys { stream: "s", group: "g", dead_letter: "s:dlq" };
                let mut conn = pelican::redis::Pools::default().get(&target).await?;
                pelican::redis::ensure_group(&mut conn, "test", &keys, "0", false, "test").await
            };
            (attempt(anonymous).await, attempt(with_certificate).await)
        });
    // TLS 1.3 finishes the client's side of the handshake before the server checks the certificate, so the refusal
    // reaches the client as a TLS alert or as a connection closed under it (broken pipe), depending on timing:
    // either way it is a TLS problem with a hint, never "unavailable" (which would be retried forever).
    let refused = refused.expect_err("a server that requires client certificates accepted a connection without one");
    assert_eq!(refused.reason(), "TLSHandshakeFailed", "{refused}");
    assert!(refused.to_string().contains("certSecretRef"), "{refused}");
    assert!(accepted.is_ok(), "with the client certificate: {:?}", accepted.err().map(|e| e.to_string()));
    assert!(kubectl_apply(&ns, &tls).0);
    // Without the certificate the policy is Stalled with a message that says what to set.
    let ca_only = "    tls:\n      caSecretRef: {name: redis-tls, key: ca.crt}\n";
    let no_cert = policy_with("anonymous", &server.tls_url(), ca_only, "");
    assert!(kubectl_apply(&ns, &no_cert).0);
    let stalled = wait_condition(&ns, "anonymous", "Stalled", "True", "TLSHandshakeFailed");
    assert!(stalled.to_string().contains("certSecretRef"), "{stalled}");
    assert!(kubectl_apply(&ns, &policy_with("mutual", &server.tls_url(), refs, "")).0);
    wait_condition(&ns, "mutual", "Ready", "True", "Reconciled");
    let body_line = key.lines().nth(1).unwrap();
    assert!(!operator.logs().contains(body_line), "the client key leaked into the log");
    assert!(!api_objects(&ns).contains(body_line), "the client key leaked into status or an Event");
}

#[test]
fn a_wrong_ca_stalls_then_heals_when_the_secret_is_fixed() {
    let server = Server::start_tls(Flavor::Redis, "server", false);
    let ns = namespace("wrongca");
    let _operator = Operator::start(&ns);
    let wrong = secret("redis-tls", &[("ca.crt", &read(&tls_file("other-ca.crt")))]);
    // A long interval: only the Secret watch can heal the policy within the test's wait.
    let manifest = policy_with("t", &server.tls_url(), CA_REF, "").replace("interval: 1s", "interval: 10m");
    assert!(kubectl_apply(&ns, &format!("{wrong}---\n{manifest}")).0);
    let p = wait_condition(&ns, "t", "Stalled", "True", "TLSHandshakeFailed");
    assert!(p.to_string().contains("spec.redis.tls"), "the message says where to look: {p}");
    assert!(kubectl_apply(&ns, &secret("redis-tls", &[("ca.crt", &read(&tls_file("ca.crt")))])).0);
    wait_condition(&ns, "t", "Ready", "True", "Reconciled");
}

#[test]
fn an_expired_server_certificate_is_refused() {
    let server = Server::start_tls(Flavor::Redis, "expired", false);
    let ns = namespace("expired");
    let _operator = Operator::start(&ns);
    let manifests = format!(
        "{}---\n{}",
        secret("redis-tls", &[("ca.crt", &read(&tls_file("ca.crt")))]),
        policy_with("t", &server.tls_url(), CA_REF, "")
    );
    assert!(kubectl_apply(&ns, &manifests).0);
    let p = wait_condition(&ns, "t", "Stalled", "True", "TLSHandshakeFailed");
    assert!(p.to_string().to_lowercase().contains("expired"), "{p}");
}

#[test]
fn insecure_skip_verify_connects_with_a_warning_event() {
    let server = Server::start_tls(Flavor::Redis, "server", false);
    let ns = namespace("insecure");
    let _operator = Operator::start(&ns);
    let refs = "    tls:\n      insecureSkipVerify: true\n";
    assert!(kubectl_apply(&ns, &policy_with("t", &server.tls_url(), refs, "")).0);
    wait_condition(&ns, "t", "Ready", "True", "Reconciled");
    let warning = wait_for("an InsecureSkipVerify event", Duration::from_secs(10), || {
        events(&ns, "InsecureSkipVerify").into_iter().next().ok_or_else(|| "none".to_string())
    });
    assert_eq!(warning["type"], "Warning");
}

/// The documented rule set (examples/acl/pelican.acl) for one policy's keys.
fn acl_rules(stream: &str, dead_letter: &str, tag: &str, password: &str) -> Vec<String> {
    let file = read(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/acl/pelican.acl"));
    let line = file.lines().find(|l| l.starts_with("user pelican ")).unwrap();
    line.trim_start_matches("user pelican ")
        .replace("~DEAD_LETTER_STREAM", &format!("~{dead_letter}"))
        .replace("~STREAM", &format!("~{stream}"))
        .replace("{D}", &format!("{{{}}}", pelican::keys::hash_tag(dead_letter)))
        .replace("{T}", &format!("{{{tag}}}"))
        .replace(">CHANGE-ME", &format!(">{password}"))
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

fn set_user(server: &Server, rules: &[String]) {
    let mut cmd = redis::cmd("ACL");
    cmd.arg("SETUSER").arg("pelican");
    for rule in rules {
        cmd.arg(rule);
    }
    let _: () = cmd.query(&mut server.conn()).unwrap();
}

const ACL_REFS: &str = "    usernameSecretRef: {name: redis-acl, key: username}\n    passwordSecretRef: {name: redis-acl, key: password}\n";

fn the_documented_acl_runs_every_job(flavor: Flavor) {
    let server = Server::start(flavor);
    set_user(&server, &acl_rules("{acl}:in", "{acl}:dlq", "acl", "acl-pw-1"));
    let ns = namespace("acl");
    let operator = Operator::start(&ns);
    let creds = secret("redis-acl", &[("username", "pelican"), ("password", "acl-pw-1")]);
    let manifest = policy(
        "acl",
        &server.url(),
        "{acl}:in",
        "workers",
        "  retry:\n    maxDeliveries: 2\n  consumers:\n    expireAfter: 1s\n",
    )
    .replace("{acl}:in:dlq", "{acl}:dlq")
    .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n")
    .replacen("  stream:", &format!("{ACL_REFS}  stream:"), 1);
    assert!(kubectl_apply(&ns, &format!("{creds}---\n{manifest}")).0);
    wait_condition(&ns, "acl", "Ready", "True", "Reconciled");
    let mut conn = server.conn();
    for n in 0..5 {
        let _: String = redis::cmd("XADD").arg("{acl}:in").arg("*").arg("n").arg(n).query(&mut conn).unwrap();
    }
    read_new(&mut conn, "{acl}:in", "workers", "crashed", 5);
    // Requeued once, read again and abandoned again: dead-lettered; the idle consumers expire.
    wait_for("requeues", Duration::from_secs(20), || {
        let n = read_new(&mut conn, "{acl}:in", "workers", "crashed-too", 5).len();
        let p = get_policy(&ns, "acl");
        if p["status"]["totals"]["requeued"] == 5 { Ok(n) } else { Err(p["status"].to_string()) }
    });
    let p = wait_for("dead-lettering and consumer expiry", Duration::from_secs(30), || {
        read_new(&mut conn, "{acl}:in", "workers", "crashed-too", 5);
        let p = get_policy(&ns, "acl");
        let t = &p["status"]["totals"];
        if t["deadLettered"] == 5 && t["consumersExpired"].as_i64() >= Some(1) {
            Ok(p)
        } else {
            Err(p["status"].to_string())
        }
    });
    assert_eq!(condition(&p, "Ready").unwrap().0, "True");
    // A redrive of the dead letters, with the same user.
    let redrive = "apiVersion: pelican.io/v1alpha1\nkind: DeadLetterRedrive\nmetadata:\n  name: back\nspec:\n  policyRef: {name: acl}\n";
    assert!(kubectl_apply(&ns, redrive).0);
    let done = wait_for("the redrive to finish", Duration::from_secs(30), || {
        let out = kubectl_ok(&["get", "dlr", "back", "-n", &ns, "-o", "json"]);
        let object: serde_json::Value = serde_json::from_str(&out).unwrap();
        match object["status"]["phase"].as_str() {
            Some("Succeeded" | "Failed") => Ok(object),
            _ => Err(format!(
                "{}; {}",
                object["status"],
                operator
                    .logs()
                    .lines()
                    .filter(|l| l.contains("redrive") || l.contains("WARN"))
                    .collect::<Vec<_>>()
                    .join("\n")
            )),
        }
    });
    assert_eq!(done["status"]["phase"], "Succeeded", "{}", done["status"]);
    assert_eq!(done["status"]["moved"], 5);
    let logs = operator.logs();
    assert!(!logs.contains("NOPERM") && !logs.contains("PermissionDenied"), "{logs}");
    assert!(!logs.contains("acl-pw-1") && !api_objects(&ns).contains("acl-pw-1"), "the password leaked");
}

fn a_missing_acl_permission_stalls_naming_the_command_then_heals(flavor: Flavor) {
    let server = Server::start(flavor);
    let rules = acl_rules("{np}:in", "{np}:dlq", "np", "acl-pw-2");
    set_user(&server, &rules.iter().filter(|r| *r != "+xinfo").cloned().collect::<Vec<_>>());
    let ns = namespace("noperm");
    let mut operator = Operator::start(&ns);
    let creds = secret("redis-acl", &[("username", "pelican"), ("password", "acl-pw-2")]);
    let manifest = policy("np", &server.url(), "{np}:in", "g", "").replace("{np}:in:dlq", "{np}:dlq").replacen(
        "  stream:",
        &format!("{ACL_REFS}  stream:"),
        1,
    );
    assert!(kubectl_apply(&ns, &format!("{creds}---\n{manifest}")).0);
    let p = wait_condition(&ns, "np", "Stalled", "True", "PermissionDenied");
    let message =
        p["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Ready").unwrap()["message"]
            .to_string();
    assert!(message.to_lowercase().contains("xinfo"), "the message names the command: {message}");
    std::thread::sleep(Duration::from_secs(3));
    assert!(operator.is_running(), "no crash loop");
    assert_eq!(condition(&get_policy(&ns, "np"), "Stalled").unwrap().0, "True");
    set_user(&server, &["+xinfo".to_string()]);
    wait_condition(&ns, "np", "Ready", "True", "Reconciled");
    assert!(!operator.logs().contains("acl-pw-2"));
}

/// A job that fails (the retention trim without `+xtrim`) shows in status, Events and metrics, and the other jobs
/// go on: the pass still dead-letters and announces it, consumer expiry still deletes idle consumers.
#[test]
fn a_failing_job_is_visible_and_the_others_go_on() {
    let server = Server::start(Flavor::Redis);
    let rules = acl_rules("{jf}:in", "{jf}:dlq", "jf", "acl-pw-3");
    set_user(&server, &rules.iter().filter(|r| *r != "+xtrim").cloned().collect::<Vec<_>>());
    let ns = namespace("job-fails");
    let operator = Operator::start(&ns);
    let creds = secret("redis-acl", &[("username", "pelican"), ("password", "acl-pw-3")]);
    let extra =
        "  retry:\n    maxDeliveries: 1\n  retention:\n    mode: Acknowledged\n  consumers:\n    expireAfter: 1s\n";
    let manifest = policy("jf", &server.url(), "{jf}:in", "g", extra)
        .replace("{jf}:in:dlq", "{jf}:dlq")
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n")
        .replacen("  stream:", &format!("{ACL_REFS}  stream:"), 1);
    assert!(kubectl_apply(&ns, &format!("{creds}---\n{manifest}")).0);
    let p = wait_condition(&ns, "jf", "Ready", "False", "PermissionDenied");
    let ready = p["status"]["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "Ready").unwrap().clone();
    let message = ready["message"].as_str().unwrap().to_lowercase();
    assert!(message.contains("retention job failed") && message.contains("examples/acl/pelican.acl"), "{message}");
    assert_eq!(condition(&p, "Stalled").unwrap(), ("True".to_string(), "PermissionDenied".to_string()));
    let warning = wait_for("a PermissionDenied event", Duration::from_secs(10), || {
        events(&ns, "PermissionDenied").into_iter().next().ok_or_else(|| "none".to_string())
    });
    assert_eq!(warning["type"], "Warning");
    wait_for("the failures counted", Duration::from_secs(10), || {
        let metrics = operator.metrics();
        let series = format!(
            "pelican_job_failures_total{{namespace=\"{ns}\",policy=\"jf\",task=\"retention\",reason=\"PermissionDenied\"}}"
        );
        if metrics.contains(&series) { Ok(()) } else { Err(metrics) }
    });

    // The pass and consumer expiry still run: a message read and never acknowledged is dead-lettered, and its
    // consumer, with nothing pending any more, is deleted.
    let mut conn = server.conn();
    let _: String = redis::cmd("XADD").arg("{jf}:in").arg("*").arg("n").arg(1).query(&mut conn).unwrap();
    read_new(&mut conn, "{jf}:in", "g", "crashed", 1);
    wait_for("the dead letter and its Event", Duration::from_secs(30), || {
        let dead = xrange(&mut conn, "{jf}:dlq").len();
        let announced = !events(&ns, "DeadLettered").is_empty();
        if dead == 1 && announced { Ok(()) } else { Err(format!("{dead} dead letters, event: {announced}")) }
    });
    wait_for("the idle consumer expired", Duration::from_secs(30), || {
        let consumers: Vec<redis::Value> =
            redis::cmd("XINFO").arg("CONSUMERS").arg("{jf}:in").arg("g").query(&mut conn).unwrap();
        if consumers.is_empty() { Ok(()) } else { Err(format!("{} consumers", consumers.len())) }
    });

    // Granted, the trim succeeds and the policy is Ready again.
    set_user(&server, &["+xtrim".to_string()]);
    wait_condition(&ns, "jf", "Ready", "True", "Reconciled");
}

/// A password rotated while a redrive runs: the old connections are cut, the step fails with the old password,
/// and once the Secret holds the new one the redrive goes on where it was (it never ends Failed for it).
#[test]
fn a_redrive_survives_a_password_rotation() {
    let server = Server::start(Flavor::Redis);
    set_user(&server, &acl_rules("{rot}:in", "{rot}:dlq", "rot", "old-pw"));
    let ns = namespace("redrive-rotation");
    let _operator = Operator::start(&ns);
    let creds = |pw: &str| secret("redis-acl", &[("username", "pelican"), ("password", pw)]);
    let manifest = policy("rot", &server.url(), "{rot}:in", "g", "").replace("{rot}:in:dlq", "{rot}:dlq").replacen(
        "  stream:",
        &format!("{ACL_REFS}  stream:"),
        1,
    );
    assert!(kubectl_apply(&ns, &format!("{}---\n{manifest}", creds("old-pw"))).0);
    wait_condition(&ns, "rot", "Ready", "True", "Reconciled");
    let mut conn = server.conn();
    for n in 0..100 {
        let _: String = redis::cmd("XADD")
            .arg("{rot}:dlq")
            .arg("*")
            .arg("n")
            .arg(n)
            .arg("pelican-source-stream")
            .arg("{rot}:in")
            .query(&mut conn)
            .unwrap();
    }
    let redrive = "apiVersion: pelican.io/v1alpha1\nkind: DeadLetterRedrive\nmetadata:\n  name: back\nspec:\n  policyRef: {name: rot}\n  ratePerSecond: 20\n";
    assert!(kubectl_apply(&ns, redrive).0);
    wait_for("the redrive under way", Duration::from_secs(30), || {
        let moved: i64 = redis::cmd("XLEN").arg("{rot}:in").query(&mut conn).map_err(|e| e.to_string())?;
        if moved >= 20 { Ok(()) } else { Err(format!("{moved} moved")) }
    });
    // Rotation: the server takes only the new password and drops the connections made with the old one.
    set_user(&server, &["resetpass".to_string(), ">new-pw".to_string()]);
    let _: i64 = redis::cmd("CLIENT").arg("KILL").arg("USER").arg("pelican").query(&mut conn).unwrap();
    std::thread::sleep(Duration::from_secs(4));
    let phase = |ns: &str| -> serde_json::Value {
        let out = kubectl_ok(&["get", "dlr", "back", "-n", ns, "-o", "json"]);
        serde_json::from_str(&out).unwrap()
    };
    assert_ne!(phase(&ns)["status"]["phase"], "Failed", "{}", phase(&ns)["status"]);
    assert!(kubectl_apply(&ns, &creds("new-pw")).0);
    let done = wait_for("the redrive Succeeded", Duration::from_secs(60), || {
        let object = phase(&ns);
        if object["status"]["phase"] == "Succeeded" { Ok(object) } else { Err(object["status"].to_string()) }
    });
    assert_eq!(done["status"]["moved"], 100, "{}", done["status"]);
    assert_eq!(xrange(&mut conn, "{rot}:in").len(), 100);
    assert!(xrange(&mut conn, "{rot}:dlq").is_empty());
}

/// The status probe is one pipeline; a NOPERM inside it must still name the command (it comes without a separate
/// detail, unlike a plain reply).
fn a_refusal_inside_the_status_pipeline_names_the_command(flavor: Flavor) {
    let server = Server::start(flavor);
    let rules = acl_rules("{pp}:in", "{pp}:dlq", "pp", "acl-pw-3");
    set_user(&server, &rules.iter().filter(|r| *r != "+xinfo").cloned().collect::<Vec<_>>());
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg("{pp}:in")
        .arg("g")
        .arg("0")
        .arg("MKSTREAM")
        .query(&mut server.conn())
        .unwrap();
    let target = pelican::redis::Target {
        credentials: pelican::redis::Credentials {
            username: Some("pelican".into()),
            password: Some("acl-pw-3".into()),
        },
        ..pelican::redis::Target::new(server.url())
    };
    let error = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
        let mut conn = pelican::redis::Pools::default().get(&target).await.unwrap();
        let keys = pelican::redis::GroupKeys { stream: "{pp}:in", group: "g", dead_letter: "{pp}:dlq" };
        pelican::redis::probe_group(&mut conn, "test", &keys, None).await.unwrap_err()
    });
    assert_eq!(error.reason(), "PermissionDenied");
    assert!(error.to_string().to_lowercase().contains("xinfo"), "{error}");
}
