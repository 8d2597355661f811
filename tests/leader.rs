//! Two operator replicas with leader election on a real Lease: exactly one leads and writes; when it dies the
//! other takes over within the lease duration; the standby is ready all along.

#[macro_use]
mod common;

use std::time::{Duration, Instant};

use common::*;

fn replica(ns: &str) -> Operator {
    Operator::start_with(ns, &["--leader-elect", "--leader-election-namespace", ns, "--log-format", "json"])
}

fn leads(operator: &Operator) -> bool {
    operator.logs().contains("acquired the leader lease")
}

fn reconciled(operator: &Operator) -> bool {
    operator.logs().contains("\"name\":\"p\"")
}

#[test]
fn exactly_one_replica_leads_and_the_other_takes_over_when_it_dies() {
    let server = Server::start(Flavor::Redis);
    let ns = namespace("leader");
    let mut replicas = [replica(&ns), replica(&ns)];
    assert!(kubectl_apply(&ns, &policy("p", &server.url(), "s", "g", "")).0);
    wait_condition(&ns, "p", "Ready", "True", "Reconciled");

    let leader = wait_for("one replica to lead", Duration::from_secs(20), || {
        match replicas.iter().map(leads).collect::<Vec<_>>()[..] {
            [true, false] => Ok(0),
            [false, true] => Ok(1),
            ref other => Err(format!("{other:?}")),
        }
    });
    let standby = 1 - leader;
    std::thread::sleep(Duration::from_secs(3));
    assert!(!leads(&replicas[standby]), "two leaders at once");
    assert!(reconciled(&replicas[leader]));
    assert!(!reconciled(&replicas[standby]), "the standby must not reconcile (no writes to Redis or the API)");
    let lease: serde_json::Value =
        serde_json::from_str(&kubectl_ok(&["get", "lease", "pelican-leader", "-n", &ns, "-o", "json"])).unwrap();
    assert!(lease["spec"]["holderIdentity"].as_str().is_some_and(|h| !h.is_empty()), "{lease}");
    assert_eq!(Operator::http_get(replicas[standby].health_port, "/readyz").0, 200, "a standby is ready");

    replicas[leader].kill9();
    let killed_at = Instant::now();
    wait_for("the standby to take over", Duration::from_secs(30), || {
        if leads(&replicas[standby]) { Ok(()) } else { Err("still standing by".into()) }
    });
    let took = killed_at.elapsed();
    eprintln!("takeover after SIGKILL took {took:?}");
    assert!(took <= Duration::from_secs(20), "took over after {took:?}; the lease lasts 15s");
    // The new leader works: a change on the server shows up in status.
    let _: String = redis::cmd("XADD").arg("s").arg("*").arg("k").arg("v").query(&mut server.conn()).unwrap();
    wait_for("the new leader to refresh status", Duration::from_secs(15), || {
        let p = get_policy(&ns, "p");
        if p["status"]["streamLength"] == 1 { Ok(()) } else { Err(p["status"].to_string()) }
    });
}

#[test]
fn sigterm_releases_the_lease_and_a_standby_takes_over() {
    let ns = namespace("handover");
    let first = replica(&ns);
    wait_for("the first replica to lead", Duration::from_secs(20), || {
        if leads(&first) { Ok(()) } else { Err(first.logs()) }
    });
    let second = replica(&ns);
    std::thread::sleep(Duration::from_secs(2));
    assert!(!leads(&second));
    let holder = || {
        let lease = kubectl_ok(&["get", "lease", "pelican-leader", "-n", &ns, "-o", "json"]);
        let lease: serde_json::Value = serde_json::from_str(&lease).unwrap();
        lease["spec"]["holderIdentity"].as_str().unwrap_or_default().to_string()
    };
    let first_identity = holder();
    assert!(!first_identity.is_empty());
    let status = std::process::Command::new("kill").arg("-TERM").arg(first.pid().to_string()).status().unwrap();
    assert!(status.success());
    let start = Instant::now();
    // The Lease object itself says the first replica let go, long before the 15 s lease could expire.
    wait_for("the first replica to release the Lease", Duration::from_secs(5), || {
        let now = holder();
        if now != first_identity { Ok(()) } else { Err(format!("still held by {now}")) }
    });
    wait_for("the second replica to lead", Duration::from_secs(20), || {
        if leads(&second) { Ok(()) } else { Err("waiting".into()) }
    });
    let took = start.elapsed();
    eprintln!("handover after SIGTERM took {took:?}");
    assert!(first.logs().contains("released the leader lease"), "{}", first.logs());
    assert!(took <= Duration::from_secs(15), "handover took {took:?}, more than the lease duration");
}
