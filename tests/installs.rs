//! Two installs of Pelican on one Redis (issue 66): a DR pair or two clusters whose policies name the same group.
//! Each install claims the groups it runs on the server itself (`{T}:pelican:<stream>:<group>:owner`), so the second
//! stands by, whatever API server it watches; a passive install claims nothing. Here the two "clusters" are two
//! operators on the bed's API server, each watching its own namespace under its own `--install-id`.

mod common;

use std::time::Duration;

use common::*;
use pelican::keys::{owner_key, settings_key};

/// A policy on the shared group `orders`/`billing` with its own `maxDeliveries`, to tell whose settings the server has.
fn shared_group(url: &str, max_deliveries: u32) -> String {
    policy("orders", url, "orders", "billing", &format!("  retry:\n    maxDeliveries: {max_deliveries}\n"))
}

fn settings_max_deliveries(conn: &mut redis::Connection) -> Option<String> {
    redis::cmd("HGET").arg(settings_key("orders", "billing")).arg("maxDeliveries").query(conn).unwrap()
}

fn ready_message(policy: &serde_json::Value) -> String {
    let conditions = policy["status"]["conditions"].as_array().cloned().unwrap_or_default();
    conditions.iter().find(|c| c["type"] == "Ready").map(|c| c["message"].as_str().unwrap_or("").to_string()).unwrap()
}

/// The second install finds the first's claim: its policy is `AnotherInstallRuns` naming `east`, and the server keeps
/// the first install's settings while both run. A passive third install says who runs the group and writes nothing.
/// Once the first install stops, its claim lapses and the second takes the group over by itself.
#[test]
fn a_second_install_on_one_redis_stands_by_and_takes_over_when_the_first_stops() {
    let server = Server::start(Flavor::Redis);
    let mut conn = server.conn();
    let (east_ns, west_ns, south_ns) =
        (namespace("install-east"), namespace("install-west"), namespace("install-south"));
    let east = Operator::start_with(&east_ns, &["--install-id", "east"]);
    let (applied, out) = kubectl_apply(&east_ns, &shared_group(&server.url(), 3));
    assert!(applied, "{out}");
    wait_condition(&east_ns, "orders", "Ready", "True", "Reconciled");
    let owner: Option<String> = redis::cmd("GET").arg(owner_key("orders", "billing")).query(&mut conn).unwrap();
    assert_eq!(owner.as_deref(), Some("east"), "the first install claims the group");

    let _west = Operator::start_with(&west_ns, &["--install-id", "west"]);
    let (applied, out) = kubectl_apply(&west_ns, &shared_group(&server.url(), 5));
    assert!(applied, "{out}");
    let standing_by = wait_condition(&west_ns, "orders", "Ready", "False", "AnotherInstallRuns");
    let message = ready_message(&standing_by);
    assert!(message.contains("(east)") && message.contains("(west)"), "names both installs: {message}");
    let _south = Operator::start_with(&south_ns, &["--install-id", "south", "--passive"]);
    let (applied, out) = kubectl_apply(&south_ns, &shared_group(&server.url(), 7));
    assert!(applied, "{out}");
    let passive = wait_condition(&south_ns, "orders", "Ready", "False", "Passive");
    assert!(ready_message(&passive).contains("the install east runs its jobs"), "{}", ready_message(&passive));
    // A redrive of the group, applied where another install runs it, waits and says why (the same manifest in both
    // clusters of a DR pair runs where the group runs); a seek there fails as for any policy not Ready, saying why.
    let redrive = "apiVersion: pelican.io/v1alpha1\nkind: DeadLetterRedrive\nmetadata:\n  name: again\nspec:\n  \
                   policyRef:\n    name: orders\n";
    let seek = "apiVersion: pelican.io/v1alpha1\nkind: GroupSeek\nmetadata:\n  name: skip\nspec:\n  policyRef: {name: \
                orders}\n  to: {shift: 1}\n  consumersIdleFor: 0s\n";
    for (kind, manifest) in [("dlr", redrive), ("groupseek", seek)] {
        let (applied, out) = kubectl_apply(&west_ns, manifest);
        assert!(applied, "{out}");
        let name = if kind == "dlr" { "again" } else { "skip" };
        wait_for(&format!("the {kind} to wait for the install that runs the group"), Duration::from_secs(60), || {
            let object: serde_json::Value =
                serde_json::from_str(&kubectl_ok(&["get", kind, name, "-n", &west_ns, "-o", "json"])).unwrap();
            let status = &object["status"];
            let conditions = status["conditions"].as_array().cloned().unwrap_or_default();
            let said = match kind {
                "dlr" => status["phase"] == "Pending" && conditions.iter().any(|c| c["reason"] == "AnotherInstallRuns"),
                _ => {
                    status["phase"] == "Failed"
                        && conditions
                            .iter()
                            .any(|c| c["message"].as_str().is_some_and(|m| m.contains("AnotherInstallRuns")))
                }
            };
            if said { Ok(()) } else { Err(status.to_string()) }
        });
    }
    // Several reconciles of all three later, only the first install's settings are on the server.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(settings_max_deliveries(&mut conn).as_deref(), Some("3"), "only the claim's owner writes settings");

    drop(east);
    wait_for("the second install to take the group over", Duration::from_secs(60), || {
        let policy = get_policy(&west_ns, "orders");
        match condition(&policy, "Ready") {
            Some((status, _)) if status == "True" => Ok(()),
            other => Err(format!("{other:?}: {}", ready_message(&policy))),
        }
    });
    assert_eq!(settings_max_deliveries(&mut conn).as_deref(), Some("5"), "the new owner's settings");
    let owner: Option<String> = redis::cmd("GET").arg(owner_key("orders", "billing")).query(&mut conn).unwrap();
    assert_eq!(owner.as_deref(), Some("west"));
    // The passive install says who runs the group at its next reconcile (between two claims, that nobody does).
    wait_for("the passive install to name the new owner", Duration::from_secs(60), || {
        let message = ready_message(&get_policy(&south_ns, "orders"));
        if message.contains("the install west runs its jobs") { Ok(()) } else { Err(message) }
    });
}
