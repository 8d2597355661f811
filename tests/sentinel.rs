//! `mode: Sentinel` on a real primary, two replicas and three sentinels (Redis 7.0 and Valkey 9.1):
//! credentials for the sentinels and the data nodes, failovers followed, and a primary killed with SIGKILL while
//! 100,000 messages are being dead-lettered.

#[macro_use]
mod common;

use std::time::{Duration, Instant};

use common::*;

on_every_server!(
    a_sentinel_policy_finds_the_primary_with_credentials_for_both_and_follows_a_failover,
    primary_killed_while_100000_messages_are_dead_lettered_loses_and_duplicates_nothing,
);

/// A policy in Sentinel mode; `auth` adds the Secret references of the data nodes and the sentinels.
fn sentinel_policy(name: &str, sentinels: &Sentinels, master: &str, extra: &str, auth: bool) -> String {
    let mut redis =
        format!("    url: {}\n    mode: Sentinel\n    sentinel:\n      masterName: {master}\n", sentinels.url());
    if auth {
        redis = format!(
            "{redis}      passwordSecretRef: {{name: redis-auth, key: sentinel}}\n    passwordSecretRef: {{name: redis-auth, key: data}}\n"
        );
    }
    policy(name, "X", "jobs", "workers", extra).replacen("    url: X\n", &redis, 1)
}

fn primary_of(ns: &str, name: &str) -> Option<String> {
    get_policy(ns, name)["status"]["primary"].as_str().map(str::to_string)
}

fn a_sentinel_policy_finds_the_primary_with_credentials_for_both_and_follows_a_failover(flavor: Flavor) {
    let mut sentinels = Sentinels::start_with_passwords(flavor, Some(("data-pw", "sentinel-pw")));
    let ns = namespace("sentinel");
    let _operator = Operator::start(&ns);
    let secret = "apiVersion: v1\nkind: Secret\nmetadata:\n  name: redis-auth\nstringData:\n  data: data-pw\n  sentinel: sentinel-pw\n";
    let good = sentinel_policy("jobs", &sentinels, MASTER_NAME, "", true);
    let unknown =
        sentinel_policy("typo", &sentinels, "mymastr", "", true).replace("stream: \"jobs\"", "stream: \"other\"");
    // Issue 66.2: a database other than 0 is the data nodes'; the sentinel connection was opened with it, and a
    // sentinel implements no SELECT.
    let database_3 = sentinel_policy("db3", &sentinels, MASTER_NAME, "", true).replacen(
        &sentinels.url(),
        &sentinels.url().replace("/0", "/3"),
        1,
    );
    assert!(kubectl_apply(&ns, &format!("{secret}---\n{good}---\n{unknown}---\n{database_3}")).0);
    let first = sentinels.primary_port();
    let ready = wait_condition(&ns, "jobs", "Ready", "True", "Reconciled");
    assert_eq!(ready["status"]["primary"], format!("127.0.0.1:{first}"));
    wait_condition(&ns, "db3", "Ready", "True", "Reconciled");
    let mut db3 =
        redis::Client::open(format!("redis://:data-pw@127.0.0.1:{first}/3")).unwrap().get_connection().unwrap();
    let groups: Vec<redis::Value> = redis::cmd("XINFO").arg("GROUPS").arg("jobs").query(&mut db3).unwrap();
    assert_eq!(groups.len(), 1, "the group is in database 3");
    let stalled = wait_condition(&ns, "typo", "Stalled", "True", "SentinelMasterUnknown");
    let conditions = stalled["status"]["conditions"].as_array().unwrap();
    let message = conditions.iter().find(|c| c["type"] == "Stalled").unwrap()["message"].as_str().unwrap().to_string();
    assert!(message.contains("\"mymastr\"") && message.contains("SENTINEL MASTERS"), "{message}");
    let logs = _operator.logs();
    assert!(!logs.contains("data-pw") && !logs.contains("sentinel-pw"), "a password reached the log");

    // A failover (the sentinels' own, gracefully): the policy follows, says so, and works on the new primary.
    let mut conn = sentinels.server(first).conn();
    let _: String = redis::cmd("XADD").arg("jobs").arg("*").arg("n").arg(1).query(&mut conn).unwrap();
    let mut admin = redis::Client::open(format!("redis://:sentinel-pw@127.0.0.1:{}", sentinels.sentinels[0].0))
        .unwrap()
        .get_connection()
        .unwrap();
    let _: () = redis::cmd("SENTINEL").arg("FAILOVER").arg(MASTER_NAME).query(&mut admin).unwrap();
    let second = wait_for("the sentinels to elect another primary", Duration::from_secs(60), || {
        let port = sentinels.primary_port();
        if port != first { Ok(port) } else { Err(format!("still {port}")) }
    });
    wait_for("the policy to follow the failover", Duration::from_secs(30), || match primary_of(&ns, "jobs") {
        Some(p) if p == format!("127.0.0.1:{second}") => Ok(()),
        other => Err(format!("{other:?}")),
    });
    let changed: Vec<_> =
        events(&ns, "PrimaryChanged").into_iter().filter(|e| e["involvedObject"]["name"] == "jobs").collect();
    assert_eq!(changed.len(), 1, "{changed:?}");
    assert_eq!(changed[0]["type"], "Warning");
    let mut conn = sentinels.server(second).conn();
    wait_for("the stream written before the failover", Duration::from_secs(30), || {
        let len: i64 = redis::cmd("XLEN").arg("jobs").query(&mut conn).map_err(|e| e.to_string())?;
        if len == 1 { Ok(()) } else { Err(format!("{len}")) }
    });
    let _: String = redis::cmd("XADD").arg("jobs").arg("*").arg("n").arg(2).query(&mut conn).unwrap();
    wait_for("status from the new primary", Duration::from_secs(30), || {
        let p = get_policy(&ns, "jobs");
        if p["status"]["streamLength"] == 2 { Ok(()) } else { Err(p["status"].to_string()) }
    });

    // A seek after the failover moves the group on the new primary: both entries, read once, are read again.
    assert_eq!(read_new(&mut conn, "jobs", "workers", "c1", 10).len(), 2);
    let seek = "apiVersion: pelican.io/v1alpha1\nkind: GroupSeek\nmetadata:\n  name: replay\nspec:\n  \
                policyRef: {name: jobs}\n  to: {position: Earliest}\n  consumersIdleFor: 0s\n";
    assert!(kubectl_apply(&ns, seek).0);
    let done = wait_for("the seek", Duration::from_secs(30), || {
        let seek: serde_json::Value =
            serde_json::from_str(&kubectl_ok(&["get", "seek", "replay", "-n", &ns, "-o", "json"])).unwrap();
        if seek["status"]["phase"] == "Succeeded" { Ok(seek) } else { Err(seek["status"].to_string()) }
    });
    assert_eq!(done["status"]["to"]["lag"], 2, "{done}");
    assert_eq!(read_new(&mut conn, "jobs", "workers", "c1", 10).len(), 2);
}

/// SIGKILL of the primary while its PEL is being dead-lettered. The guarantee: a move is one script, which the
/// primary replicates as one unit (a MULTI/EXEC of its effects), so a replica has all of a move or none of it;
/// writes the old primary did not replicate in time are lost with it, and on the new primary every message is
/// still there exactly once: dead-lettered (and acknowledged), pending again, or not delivered yet.
fn primary_killed_while_100000_messages_are_dead_lettered_loses_and_duplicates_nothing(flavor: Flavor) {
    // Enough for a few seconds of dead-lettering at the pass's speed (tens of thousands a second), so the kill lands
    // in the middle of it; `minIdle: 3s`, so the crashed consumer's read of all of them is over before the first is
    // idle long enough to move (on a busy machine the read alone takes seconds).
    const COUNT: usize = 100_000;
    let mut sentinels = Sentinels::start(flavor);
    let extra = "  retry:\n    maxDeliveries: 1\n";
    let manifest = sentinel_policy("jobs", &sentinels, MASTER_NAME, extra, false)
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 3s\n    maxPerPass: 2000\n");
    let (ns, _operator) = ready_policy("sentinel-failover", &manifest, "jobs");
    let first = sentinels.primary_port();
    let mut conn = sentinels.server(first).conn();
    for start in (0..COUNT).step_by(1000) {
        let mut pipe = redis::pipe();
        for n in start..start + 1000 {
            pipe.cmd("XADD").arg("jobs").arg("*").arg("n").arg(n).ignore();
        }
        let _: () = pipe.query(&mut conn).unwrap();
    }
    // One consumer takes everything and dies: a PEL of 100,000 for the operator to dead-letter.
    // 10,000 at a time, the replies left unparsed: one read of 100,000 held a starved primary long enough for the
    // sentinels to fail over before the kill, and a debug build's typed parse of them could outlast `minIdle`.
    for _ in (0..COUNT).step_by(10_000) {
        let _: redis::Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("workers")
            .arg("crashed")
            .arg("COUNT")
            .arg(10_000)
            .arg("STREAMS")
            .arg("jobs")
            .arg(">")
            .query(&mut conn)
            .unwrap();
    }
    let dead_at_kill = dead_lettering_under_way(&mut conn, "jobs:dlq", 1000);
    sentinels.server(first).kill9();
    let killed = Instant::now();
    assert!(dead_at_kill < COUNT, "all was dead-lettered before the kill: lower the pass size");
    let second = wait_for("the sentinels to promote a replica", Duration::from_secs(60), || {
        let port = sentinels.primary_port();
        if port != first { Ok(port) } else { Err("no failover yet".into()) }
    });
    let elected = killed.elapsed();
    wait_for("the policy Ready on the new primary", Duration::from_secs(60), || {
        let p = get_policy(&ns, "jobs");
        let ready = condition(&p, "Ready").is_some_and(|(s, _)| s == "True");
        if ready && primary_of(&ns, "jobs") == Some(format!("127.0.0.1:{second}")) {
            Ok(())
        } else {
            Err(p["status"].to_string())
        }
    });
    let followed = killed.elapsed();
    let mut conn = sentinels.server(second).conn();
    wait_for("the new primary's PEL drained", Duration::from_secs(120), || {
        let pending: (i64, redis::Value, redis::Value, redis::Value) =
            redis::cmd("XPENDING").arg("jobs").arg("workers").query(&mut conn).map_err(|e| e.to_string())?;
        if pending.0 == 0 { Ok(()) } else { Err(format!("{} pending", pending.0)) }
    });

    // The ledger, on the new primary.
    let (dead_lettered, open) = failover_ledger(&mut conn, "jobs", "jobs:dlq", "workers");
    assert_eq!(dead_lettered + open, COUNT, "every message is in the new primary's stream");
    println!(
        "{flavor:?}: primary killed with {dead_at_kill} of {COUNT} dead-lettered; a replica elected after {elected:?}; \
         the policy Ready on it after {followed:?}; ledger on the new primary: {dead_lettered} dead-lettered once, \
         {open} pending or not delivered, 0 lost, 0 duplicated"
    );
}

/// TLS to the sentinels and to the data nodes alike (`rediss://`, the CA from a Secret): the sentinels name the
/// primary's TLS port, and the operator reaches it with the same TLS settings.
#[test]
fn sentinels_and_data_nodes_over_tls() {
    let sentinels = Sentinels::start_tls(Flavor::Redis);
    let ns = namespace("sentinel-tls");
    let _operator = Operator::start(&ns);
    let ca = std::fs::read_to_string(tls_file("ca.crt")).unwrap();
    let secret = format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: redis-ca\nstringData:\n  ca.crt: {}\n",
        serde_json::to_string(&ca).unwrap()
    );
    let redis = format!(
        "    url: {}\n    mode: Sentinel\n    sentinel:\n      masterName: {MASTER_NAME}\n    tls:\n      caSecretRef: {{name: redis-ca, key: ca.crt}}\n",
        sentinels.tls_url()
    );
    let manifest = policy("secure", "X", "jobs", "workers", "").replacen("    url: X\n", &redis, 1);
    assert!(kubectl_apply(&ns, &format!("{secret}---\n{manifest}")).0);
    let ready = wait_condition(&ns, "secure", "Ready", "True", "Reconciled");
    let primary = sentinels.servers[0].tls_port.unwrap();
    assert_eq!(ready["status"]["primary"], format!("127.0.0.1:{primary}"), "the primary's TLS port");
}

/// A redrive running when the primary is killed (SIGKILL, not the sentinels' graceful failover) follows its
/// policy to the new primary and finishes there: every message once in the source stream, `moved` exact.
#[test]
fn a_redrive_follows_a_failover_and_finishes_on_the_new_primary() {
    const COUNT: u64 = 200;
    let mut sentinels = Sentinels::start(Flavor::Redis);
    sentinels.wait_settled(2);
    let (ns, _operator) =
        ready_policy("sentinel-redrive", &sentinel_policy("jobs", &sentinels, MASTER_NAME, "", false), "jobs");
    let first = sentinels.primary_port();
    let mut conn = sentinels.server(first).conn();
    for n in 0..COUNT {
        let _: String = redis::cmd("XADD")
            .arg("jobs:dlq")
            .arg("*")
            .arg("n")
            .arg(n)
            .arg("pelican-source-stream")
            .arg("jobs")
            .query(&mut conn)
            .unwrap();
    }
    let _: i64 = redis::cmd("WAIT").arg(2).arg(5000).query(&mut conn).unwrap();
    let redrive = "apiVersion: pelican.io/v1alpha1\nkind: DeadLetterRedrive\nmetadata:\n  name: back\nspec:\n  policyRef: {name: jobs}\n  ratePerSecond: 20\n";
    assert!(kubectl_apply(&ns, redrive).0);
    wait_for("the redrive under way", Duration::from_secs(30), || {
        let moved: i64 = redis::cmd("XLEN").arg("jobs").query(&mut conn).map_err(|e| e.to_string())?;
        if moved >= 40 { Ok(()) } else { Err(format!("{moved} moved")) }
    });
    sentinels.server(first).kill9();
    let killed = Instant::now();
    let second = wait_for("the sentinels to promote a replica", Duration::from_secs(60), || {
        let port = sentinels.primary_port();
        if port != first { Ok(port) } else { Err("no failover yet".into()) }
    });
    let done = wait_for("the redrive Succeeded", Duration::from_secs(90), || {
        let out = kubectl_ok(&["get", "dlr", "back", "-n", &ns, "-o", "json"]);
        let object: serde_json::Value = serde_json::from_str(&out).unwrap();
        if object["status"]["phase"] == "Succeeded" { Ok(object) } else { Err(object["status"].to_string()) }
    });
    let mut conn = sentinels.server(second).conn();
    let entries = xrange(&mut conn, "jobs");
    let mut seen: Vec<u64> =
        entries.iter().map(|e| String::from_utf8_lossy(field(e, "n").unwrap()).parse().unwrap()).collect();
    seen.sort();
    assert_eq!(seen, (0..COUNT).collect::<Vec<_>>(), "every message once in the new primary's stream");
    assert!(xrange(&mut conn, "jobs:dlq").is_empty());
    assert_eq!(done["status"]["moved"], COUNT, "{}", done["status"]);
    println!(
        "primary killed mid-redrive; the redrive Succeeded on the new primary {:?} after the kill",
        killed.elapsed()
    );
}
