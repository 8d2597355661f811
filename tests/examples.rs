//! Every example in `examples/` is applied to the bed the way a user would (the server address and the PEM
//! placeholders filled in) and reaches Ready against a real server of the kind it describes.

mod common;

use std::collections::BTreeSet;

use common::*;

const EXAMPLES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples");

fn example(name: &str) -> String {
    std::fs::read_to_string(format!("{EXAMPLES}/{name}")).unwrap()
}

/// A PEM file of the bed as a YAML double-quoted string.
fn pem(name: &str) -> String {
    serde_json::to_string(&std::fs::read_to_string(tls_file(name)).unwrap()).unwrap()
}

/// Applies a filled-in example in a fresh namespace and waits for every policy in it to be Ready.
fn applies_and_gets_ready(prefix: &str, manifest: &str) {
    let ns = namespace(prefix);
    let _operator = Operator::start(&ns);
    let (ok, out) = kubectl_apply(&ns, manifest);
    assert!(ok, "{out}");
    let names: Vec<String> = manifest
        .split("\n---")
        .filter(|doc| doc.contains("kind: ConsumerGroupPolicy"))
        .filter_map(|doc| doc.lines().find_map(|l| l.trim().strip_prefix("name: ").map(str::to_string)))
        .collect();
    assert!(!names.is_empty(), "no policy in {prefix}");
    for name in names {
        wait_condition(&ns, &name, "Ready", "True", "Reconciled");
    }
}

#[test]
fn every_example_is_covered_here() {
    let covered: BTreeSet<&str> = [
        "notifications.yaml",
        "with-password.yaml",
        "tls.yaml",
        "mutual-tls.yaml",
        "cluster.yaml",
        "reassign.yaml",
        "bounded.yaml",
        "redrive.yaml",
        "seek.yaml",
        "backoff.yaml",
        "ordered.yaml",
    ]
    .into();
    let present: BTreeSet<String> = std::fs::read_dir(EXAMPLES)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    let present: BTreeSet<&str> = present.iter().map(String::as_str).collect();
    assert_eq!(present, covered, "an example without a test, or a test without its example");
}

#[test]
fn plain_examples_get_ready() {
    let server = Server::start_with(Flavor::Valkey, &["--requirepass", "change-me"]);
    let open = Server::start(Flavor::Redis);
    let address = |s: &Server| format!("127.0.0.1:{}", s.port);
    applies_and_gets_ready("ex-notif", &example("notifications.yaml").replace("127.0.0.1:6379", &address(&open)));
    for name in ["reassign.yaml", "bounded.yaml", "backoff.yaml", "ordered.yaml"] {
        applies_and_gets_ready("ex-plain", &example(name).replace("redis.apps.svc:6379", &address(&open)));
    }
    applies_and_gets_ready(
        "ex-file-jobs",
        &example("file_jobs/policy.yaml").replace("redis.apps.svc:6379", &address(&open)),
    );
    applies_and_gets_ready("ex-acl", &example("with-password.yaml").replace("redis.apps.svc:6379", &address(&server)));
}

#[test]
fn tls_examples_get_ready() {
    // Server certificate only, then a server that also requires a client certificate.
    let server = Server::start_tls(Flavor::Redis, "server", false);
    let mutual_server = Server::start_tls(Flavor::Redis, "server", true);
    let tls = format!("127.0.0.1:{}", server.tls_port.unwrap());
    let mutual_tls = format!("127.0.0.1:{}", mutual_server.tls_port.unwrap());
    let ca = example("tls.yaml")
        .replace("redis.apps.svc:6380", &tls)
        .replace("\"<the CA certificate, PEM>\"", &pem("ca.crt"));
    applies_and_gets_ready("ex-tls", &ca);
    let mutual = example("mutual-tls.yaml")
        .replace("redis.apps.svc:6380", &mutual_tls)
        .replace("\"<the CA certificate, PEM>\"", &pem("ca.crt"))
        .replace("\"<the client certificate, PEM>\"", &pem("client.crt"))
        .replace("\"<the client key, PEM>\"", &pem("client.key"));
    applies_and_gets_ready("ex-mtls", &mutual);
}

#[test]
fn cluster_example_gets_ready() {
    let cluster = Cluster::start(Flavor::Valkey);
    let seed = cluster.url().trim_start_matches("redis://").trim_end_matches("/0").to_string();
    applies_and_gets_ready("ex-cluster", &example("cluster.yaml").replace("redis-cluster.apps.svc:6379", &seed));
}

#[test]
fn redrive_example_moves_the_notifications_dead_letters_back() {
    let open = Server::start(Flavor::Redis);
    let policy = example("notifications.yaml").replace("127.0.0.1:6379", &format!("127.0.0.1:{}", open.port));
    let (ns, _operator) = ready_policy("ex-redrive", &policy, "notifications");
    let mut conn = open.conn();
    for (n, reason) in [(1, "MaxDeliveriesExceeded"), (2, "Other"), (3, "MaxDeliveriesExceeded")] {
        let _: String = redis::cmd("XADD")
            .arg("notifications:dlq")
            .arg("*")
            .arg("n")
            .arg(n)
            .arg("pelican-source-stream")
            .arg("notifications")
            .arg("pelican-reason")
            .arg(reason)
            .query(&mut conn)
            .unwrap();
    }
    let (ok, out) = kubectl_apply(&ns, &example("redrive.yaml"));
    assert!(ok, "{out}");
    let done = wait_for("the example redrive to succeed", std::time::Duration::from_secs(30), || {
        let out = kubectl_ok(&["get", "dlr", "notifications-after-fix-1", "-n", &ns, "-o", "json"]);
        let object: serde_json::Value = serde_json::from_str(&out).unwrap();
        if object["status"]["phase"] == "Succeeded" { Ok(object) } else { Err(object["status"].to_string()) }
    });
    assert_eq!((done["status"]["moved"].as_i64(), done["status"]["skipped"].as_i64()), (Some(2), Some(1)));
    assert_eq!(xrange(&mut conn, "notifications:dlq").len(), 1, "the Other dead letter stays");
}

#[test]
fn seek_example_replays_what_came_after_its_time() {
    let open = Server::start(Flavor::Redis);
    let policy = example("notifications.yaml").replace("127.0.0.1:6379", &format!("127.0.0.1:{}", open.port));
    let (ns, _operator) = ready_policy("ex-seek", &policy, "notifications");
    let mut conn = open.conn();
    // Three entries before the example's time, five after; all read and acknowledged, the consumer gone.
    let at = |ms: i64| format!("{ms}-0");
    let nine = 1_796_202_000_000_i64;
    for ms in [nine - 3000, nine - 2000, nine - 1000, nine, nine + 1000, nine + 2000, nine + 3000, nine + 4000] {
        let _: String = redis::cmd("XADD").arg("notifications").arg(at(ms)).arg("n").arg(ms).query(&mut conn).unwrap();
    }
    let read = read_new(&mut conn, "notifications", "notifier", "worker", 100);
    let _: i64 = redis::cmd("XACK").arg("notifications").arg("notifier").arg(&read).query(&mut conn).unwrap();
    let _: i64 = redis::cmd("XGROUP")
        .arg("DELCONSUMER")
        .arg("notifications")
        .arg("notifier")
        .arg("worker")
        .query(&mut conn)
        .unwrap();
    let (ok, out) = kubectl_apply(&ns, &example("seek.yaml"));
    assert!(ok, "{out}");
    let done = wait_for("the example seek to succeed", std::time::Duration::from_secs(30), || {
        let out = kubectl_ok(&["get", "seek", "notifications-replay-after-deploy-481", "-n", &ns, "-o", "json"]);
        let object: serde_json::Value = serde_json::from_str(&out).unwrap();
        if object["status"]["phase"] == "Succeeded" { Ok(object) } else { Err(object["status"].to_string()) }
    });
    assert_eq!(done["status"]["redelivered"].as_i64(), Some(5), "{done}");
    assert_eq!(
        read_new(&mut conn, "notifications", "notifier", "worker", 100),
        [nine, nine + 1000, nine + 2000, nine + 3000, nine + 4000].map(at)
    );
}

/// Every YAML manifest of the documentation (the README, the chart's README, the book) that declares a Pelican
/// resource is accepted by the API server as written (`kubectl apply --dry-run=server`: the CRDs' schema and rules),
/// so no page shows a field that does not exist or a value admission refuses. Fragments (a `spec:` excerpt without
/// `apiVersion`) are not whole objects and are left out.
#[test]
fn every_resource_in_the_documentation_is_admitted_by_the_crds() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut pages = vec![root.join("README.md"), root.join("charts/pelican/README.md")];
    pages.extend(files_below(&root.join("docs/src"), ".md"));
    let ns = namespace("docs");
    let inline_namespace = regex::Regex::new(r",\s*namespace:\s*[a-z0-9-]+").unwrap();
    let mut checked = 0;
    for page in pages {
        let text = std::fs::read_to_string(&page).unwrap();
        let mut block: Option<String> = None;
        for line in text.lines() {
            match (&mut block, line.trim_start()) {
                (None, fence) if fence.starts_with("```yaml") => block = Some(String::new()),
                (Some(yaml), "```") => {
                    for doc in yaml.split("\n---") {
                        if !doc.contains("apiVersion: pelican.io/") {
                            continue;
                        }
                        // A namespace in the example is the reader's; the check runs in its own.
                        let doc: String = doc
                            .lines()
                            .filter(|l| !l.trim_start().starts_with("namespace:"))
                            .map(|l| format!("{l}\n"))
                            .collect();
                        let doc = inline_namespace.replace_all(&doc, "");
                        let out = kubectl(&["apply", "--dry-run=server", "-n", &ns, "-f", "-"], Some(&doc));
                        assert!(
                            out.status.success(),
                            "{}: the API server refuses\n{doc}\n{}",
                            page.display(),
                            String::from_utf8_lossy(&out.stderr)
                        );
                        checked += 1;
                    }
                    block = None;
                }
                (Some(yaml), _) => {
                    // Code blocks in lists are indented: keep the YAML's own indentation only.
                    yaml.push_str(line);
                    yaml.push('\n');
                }
                _ => {}
            }
        }
    }
    println!("{checked} resources of the documentation admitted");
    assert!(checked >= 5, "only {checked} resources found in the documentation: did the pages move?");
}
