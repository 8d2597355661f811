//! KEDA itself scaling consumers on what Pelican measures: KEDA's operator (built from its Go module by
//! `scripts/testenv keda`, run as a local process against the bed's API server), a `ScaledObject` with an
//! `external-push` trigger naming a policy, and a Deployment of consumers (`scripts/image consumer`, the SDK's
//! worker) on the bed's node, which reach the test's Redis through the node's address.
//!
//! Needs the node and KEDA, so it is ignored in the main run; `scripts/test` runs it after the suite with
//! `--ignored`, the node up, the consumer image imported and `eval "$(scripts/testenv keda)"` done.

mod common;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::*;

/// KEDA's operator as a local process watching one namespace, stopped when dropped.
struct Keda {
    child: Child,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Keda {
    fn start(namespace: &str) -> Keda {
        let binary = std::env::var("PELICAN_KEDA_OPERATOR")
            .expect("PELICAN_KEDA_OPERATOR is not set: run `eval \"$(scripts/testenv keda)\"` first");
        let crds = std::env::var("PELICAN_KEDA_CRDS").expect("PELICAN_KEDA_CRDS is not set (scripts/testenv keda)");
        let out = kubectl(&["apply", "--server-side", "-f", &crds], None);
        assert!(out.status.success(), "KEDA's CRDs: {}", String::from_utf8_lossy(&out.stderr));
        wait_for("KEDA's CRDs established", Duration::from_secs(30), || {
            let path = "jsonpath={.status.conditions[?(@.type==\"Established\")].status}";
            match kubectl_ok(&["get", "crd", "scaledobjects.keda.sh", "-o", path]).as_str() {
                "True" => Ok(()),
                other => Err(other.to_string()),
            }
        });
        let dir = tempfile::tempdir().unwrap();
        // The gRPC service KEDA's metrics adapter reads (not used here) wants a certificate: the bed's test CA's.
        for (from, to) in [("ca.crt", "ca.crt"), ("server.crt", "tls.crt"), ("server.key", "tls.key")] {
            std::fs::copy(tls_file(from), dir.path().join(to)).unwrap();
        }
        let log = dir.path().join("keda.log");
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(binary)
            .arg(format!("--metrics-bind-address=127.0.0.1:{}", free_port()))
            .arg(format!("--health-probe-bind-address=127.0.0.1:{}", free_port()))
            .arg(format!("--metrics-service-bind-address=127.0.0.1:{}", free_port()))
            .arg(format!("--cert-dir={}", dir.path().display()))
            .arg(format!("--ca-dir={}", dir.path().display()))
            .env("KUBECONFIG", bed().kubeconfig())
            .env("WATCH_NAMESPACE", namespace)
            .env("KEDA_CLUSTER_OBJECT_NAMESPACE", namespace)
            .env("POD_NAMESPACE", namespace)
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .expect("start KEDA's operator");
        Keda { child, log, _dir: dir }
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Keda {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- KEDA's log (last 40 lines) ---");
            let logs = self.logs();
            let lines: Vec<&str> = logs.lines().collect();
            eprintln!("{}", lines[lines.len().saturating_sub(40)..].join("\n"));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn consumers(redis_port: u16) -> String {
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: consumers
spec:
  replicas: 0
  selector:
    matchLabels: {{app: consumers}}
  template:
    metadata:
      labels: {{app: consumers}}
    spec:
      terminationGracePeriodSeconds: 5
      securityContext:
        runAsNonRoot: true
        runAsUser: 65532
        seccompProfile: {{type: RuntimeDefault}}
      containers:
        - name: consumer
          image: localhost/pelican-consumer:bed
          imagePullPolicy: Never
          env:
            - {{name: REDIS_URL, value: "redis://{NODE_IP}:{redis_port}/0"}}
            - {{name: STREAM, value: orders}}
            - {{name: GROUP, value: billing}}
            - {{name: HANDLE_MS, value: "10"}}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities: {{drop: [ALL]}}
"#
    )
}

fn scaled_object(scaler: &str) -> String {
    format!(
        r#"apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: consumers
spec:
  scaleTargetRef: {{name: consumers}}
  minReplicaCount: 0
  maxReplicaCount: 4
  pollingInterval: 5
  cooldownPeriod: 10
  triggers:
    - type: external-push
      metadata:
        scalerAddress: "{scaler}"
        policy: orders
        metric: backlog
        target: "100"
"#
    )
}

fn replicas(namespace: &str) -> (i64, i64) {
    let path = "jsonpath={.spec.replicas} {.status.readyReplicas}";
    let out = kubectl_ok(&["get", "deployment", "consumers", "-n", namespace, "-o", path]);
    let mut numbers = out.split_whitespace().map(|n| n.parse().unwrap_or(0));
    (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0))
}

/// 0 replicas while the stream is idle; entries published -> KEDA scales the consumers to 1 within seconds
/// (pushed by `StreamIsActive`, not waiting for the 5 s polling interval); they handle everything -> back to 0
/// after the 10 s cooldown.
#[test]
#[ignore = "needs the node and KEDA: scripts/test runs it after the suite"]
fn keda_scales_consumers_from_zero_to_one_on_the_backlog_and_back_to_zero() {
    let server = Server::start(Flavor::Redis);
    let _forward = NodeForward::to_loopback(server.port);
    let ns = namespace("keda");
    let scaler = format!("127.0.0.1:{}", free_port());
    let _operator = Operator::start_with(&ns, &[&format!("--external-scaler-addr={scaler}")]);
    let manifest = policy("orders", &server.url(), "orders", "billing", "");
    let (applied, out) = kubectl_apply(&ns, &manifest);
    assert!(applied, "{out}");
    wait_condition(&ns, "orders", "Ready", "True", "Reconciled");
    let (applied, out) = kubectl_apply(&ns, &consumers(server.port));
    assert!(applied, "{out}");

    let keda = Keda::start(&ns);
    let (applied, out) = kubectl_apply(&ns, &scaled_object(&scaler));
    assert!(applied, "{out}");
    wait_for("the ScaledObject Ready", Duration::from_secs(60), || {
        let path = "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}";
        match kubectl_ok(&["get", "scaledobject", "consumers", "-n", &ns, "-o", path]).as_str() {
            "True" => Ok(()),
            other => Err(format!("Ready={other:?}; KEDA: {}", keda.logs().lines().last().unwrap_or_default())),
        }
    });

    // Idle: nothing to do, no consumer.
    let idle = Instant::now();
    while idle.elapsed() < Duration::from_secs(6) {
        assert_eq!(replicas(&ns).0, 0, "an idle stream scaled the consumers up");
        std::thread::sleep(Duration::from_millis(500));
    }

    let mut conn = server.conn();
    let mut pipe = redis::pipe();
    for n in 0..2_000 {
        pipe.cmd("XADD").arg("orders").arg("*").arg("n").arg(n).ignore();
    }
    pipe.query::<()>(&mut conn).unwrap();
    let published = Instant::now();
    wait_for("KEDA to scale the consumers to 1", Duration::from_secs(30), || match replicas(&ns) {
        (0, _) => Err("0 replicas".to_string()),
        _ => Ok(()),
    });
    let scaled = published.elapsed();
    wait_for("a consumer Ready", Duration::from_secs(60), || match replicas(&ns) {
        (_, 0) => Err(format!("{:?}", replicas(&ns))),
        _ => Ok(()),
    });
    let running = published.elapsed();
    println!("2,000 entries published: 1 replica after {scaled:.2?}, its pod Ready after {running:.2?}");
    assert!(scaled < Duration::from_secs(5), "scaled after {scaled:?}: the push, not the 5 s poll, should do it");

    wait_for("the consumers to handle every entry", Duration::from_secs(120), || {
        let group = &xinfo_groups(&mut conn, "orders")[0];
        let (lag, pending): (Option<i64>, i64) = (group_field(group, "lag"), group_field(group, "pending"));
        match (lag, pending) {
            (Some(0), 0) => Ok(()),
            other => Err(format!("lag, pending = {other:?}")),
        }
    });
    let handled = published.elapsed();
    wait_for("KEDA to scale the consumers back to 0", Duration::from_secs(90), || match replicas(&ns) {
        (0, _) => Ok(()),
        other => Err(format!("{other:?}")),
    });
    let zero = published.elapsed();
    println!("all handled after {handled:.2?}; 0 replicas after {zero:.2?} (cooldown 10 s)");
    assert!(zero - handled < Duration::from_secs(30), "back to 0 {:?} after the last entry", zero - handled);

    // 1 -> N goes through the HPA KEDA made, which reads KEDA's metrics adapter through the API server's
    // aggregation layer: say what the HPA saw.
    let path = "jsonpath={.status.conditions[?(@.type==\"ScalingActive\")].message}";
    let hpa = kubectl(&["get", "hpa", "keda-hpa-consumers", "-n", &ns, "-o", path], None);
    println!("the HPA KEDA made: {}", String::from_utf8_lossy(&hpa.stdout));
}
