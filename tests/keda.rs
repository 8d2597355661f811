//! KEDA itself scaling consumers on what Pelican measures: KEDA's operator and metrics adapter (built from its Go
//! module by `scripts/testenv keda`, run as local processes against the bed's API server), a `ScaledObject` with an
//! `external-push` trigger naming a policy, and a Deployment of consumers (`scripts/image consumer`, the SDK's
//! worker) on the bed's node, which reach the test's Redis through the node's address. From 1 to N replicas the
//! node's HPA controller reads the adapter through the API server's aggregation layer: an `APIService` whose
//! Service is an `ExternalName` of `localhost`, where the adapter listens (the API server proxies to the name an
//! ExternalName Service gives, while endpoints may not be loopback addresses), trusting the bed's front proxy.
//!
//! Needs the node and KEDA, so it is ignored in the main run; `scripts/test` runs it after the suite with
//! `--ignored`, the node up, the consumer image imported and `eval "$(scripts/testenv keda)"` done.

mod common;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::*;

/// KEDA's operator and metrics adapter as local processes watching one namespace, the adapter registered as
/// `v1beta1.external.metrics.k8s.io`; stopped and unregistered when dropped.
struct Keda {
    children: Vec<Child>,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

const METRICS_API: &str = "v1beta1.external.metrics.k8s.io";

impl Keda {
    fn start(namespace: &str) -> Keda {
        let binary = std::env::var("PELICAN_KEDA_OPERATOR")
            .expect("PELICAN_KEDA_OPERATOR is not set: run `eval \"$(scripts/testenv keda)\"` first");
        let crds = std::env::var("PELICAN_KEDA_CRDS").expect("PELICAN_KEDA_CRDS is not set (scripts/testenv keda)");
        let out = kubectl(&["apply", "--server-side", "-f", &crds], None);
        assert!(out.status.success(), "KEDA's CRDs: {}", String::from_utf8_lossy(&out.stderr));
        wait_for("KEDA's CRDs established", Duration::from_secs(30), || {
            let path = "jsonpath={.status.conditions[?(@.type==\"Established\")].status}";
            // Before the API server sets the first condition, the filter fails: not established yet either.
            let out = kubectl(&["get", "crd", "scaledobjects.keda.sh", "-o", path], None);
            match String::from_utf8_lossy(&out.stdout).trim() {
                "True" => Ok(()),
                _ => Err(String::from_utf8_lossy(&out.stderr).lines().next().unwrap_or_default().to_string()),
            }
        });
        let dir = tempfile::tempdir().unwrap();
        // The gRPC service KEDA's metrics adapter reads (not used here) wants a certificate: the bed's test CA's.
        for (from, to) in [("ca.crt", "ca.crt"), ("server.crt", "tls.crt"), ("server.key", "tls.key")] {
            std::fs::copy(tls_file(from), dir.path().join(to)).unwrap();
        }
        let log = dir.path().join("keda.log");
        let file = std::fs::File::create(&log).unwrap();
        let (metrics_service, adapter_port) = (free_port(), free_port());
        let certs = dir.path().display().to_string();
        let kubeconfig = bed().kubeconfig();
        let start = |binary: &str, args: Vec<String>| {
            Command::new(binary)
                .args(args)
                .env("KUBECONFIG", kubeconfig)
                .env("WATCH_NAMESPACE", namespace)
                .env("KEDA_CLUSTER_OBJECT_NAMESPACE", namespace)
                .env("POD_NAMESPACE", namespace)
                .stdout(file.try_clone().unwrap())
                .stderr(file.try_clone().unwrap())
                .spawn()
                .unwrap_or_else(|e| panic!("start {binary}: {e}"))
        };
        let operator = start(
            &binary,
            vec![
                format!("--metrics-bind-address=127.0.0.1:{}", free_port()),
                format!("--health-probe-bind-address=127.0.0.1:{}", free_port()),
                format!("--metrics-service-bind-address=127.0.0.1:{metrics_service}"),
                format!("--cert-dir={certs}"),
                format!("--ca-dir={certs}"),
            ],
        );
        let adapter = std::env::var("PELICAN_KEDA_ADAPTER")
            .expect("PELICAN_KEDA_ADAPTER is not set: run `eval \"$(scripts/testenv keda)\"` first");
        let adapter = start(
            &adapter,
            vec![
                format!("--secure-port={adapter_port}"),
                "--bind-address=127.0.0.1".into(),
                format!("--cert-dir={certs}"),
                format!("--tls-cert-file={certs}/tls.crt"),
                format!("--tls-private-key-file={certs}/tls.key"),
                format!("--port={}", free_port()),
                format!("--metrics-service-address=127.0.0.1:{metrics_service}"),
                "--metrics-service-grpc-authority=localhost".into(),
                format!("--authentication-kubeconfig={kubeconfig}"),
                format!("--authorization-kubeconfig={kubeconfig}"),
                format!("--lister-kubeconfig={kubeconfig}"),
            ],
        );
        let registration = format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: keda-metrics-apiserver\n  namespace: {namespace}\nspec:\n  type: ExternalName\n  externalName: localhost\n---\napiVersion: apiregistration.k8s.io/v1\nkind: APIService\nmetadata:\n  name: {METRICS_API}\nspec:\n  group: external.metrics.k8s.io\n  version: v1beta1\n  groupPriorityMinimum: 100\n  versionPriority: 100\n  insecureSkipTLSVerify: true\n  service: {{name: keda-metrics-apiserver, namespace: {namespace}, port: {adapter_port}}}\n"
        );
        let out = kubectl(&["apply", "-f", "-"], Some(&registration));
        assert!(out.status.success(), "registering the adapter: {}", String::from_utf8_lossy(&out.stderr));
        Keda { children: vec![operator, adapter], log, _dir: dir }
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
        let _ = kubectl(&["delete", "apiservice", METRICS_API, "--ignore-not-found", "--wait=false"], None);
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn consumers(redis_port: u16) -> String {
    let url = format!("redis://{NODE_IP}:{redis_port}/0");
    let env = [("REDIS_URL", url.as_str()), ("STREAM", "orders"), ("GROUP", "billing"), ("HANDLE_MS", "250")];
    consumer_deployment("consumers", 0, 5, &env)
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
  advanced:
    horizontalPodAutoscalerConfig:
      behavior:
        scaleUp: {{stabilizationWindowSeconds: 0, policies: [{{type: Pods, value: 4, periodSeconds: 5}}]}}
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

/// 0 replicas while the stream is idle; 4,000 entries published -> KEDA scales the consumers to 1 within seconds
/// (pushed by `StreamIsActive`, not waiting for the 5 s polling interval); the HPA reads the backlog (target 100 per
/// replica) through KEDA's adapter -> 4 replicas (the maximum); they handle everything -> back to 0 after the 10 s
/// cooldown.
#[test]
#[ignore = "needs the node and KEDA: scripts/test runs it after the suite"]
fn keda_scales_consumers_from_zero_to_one_to_four_on_the_backlog_and_back_to_zero() {
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
    for n in 0..4_000 {
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
    println!("4,000 entries published: 1 replica after {scaled:.2?}, its pod Ready after {running:.2?}");
    assert!(scaled < Duration::from_secs(5), "scaled after {scaled:?}: the push, not the 5 s poll, should do it");

    // 1 -> N: the HPA KEDA made reads `GetMetrics` through the adapter and the aggregation layer.
    let mut most = 0;
    wait_for("the HPA to scale the consumers to 4", Duration::from_secs(90), || {
        let (wanted, ready) = replicas(&ns);
        most = most.max(ready);
        match wanted {
            4 => Ok(()),
            _ => {
                let path = "jsonpath={.status.conditions[?(@.type==\"ScalingActive\")].message}";
                let hpa = kubectl(&["get", "hpa", "keda-hpa-consumers", "-n", &ns, "-o", path], None);
                Err(format!("{wanted} replicas wanted, {ready} ready; HPA: {}", String::from_utf8_lossy(&hpa.stdout)))
            }
        }
    });
    let four = published.elapsed();
    let backlog_then = {
        let group = &xinfo_groups(&mut conn, "orders")[0];
        group_field::<Option<i64>>(group, "lag").unwrap_or_default() + group_field::<i64>(group, "pending")
    };
    let path = "jsonpath={.status.currentMetrics[0].external.metric.name}={.status.currentMetrics[0].external.current.averageValue}";
    let seen = kubectl_ok(&["get", "hpa", "keda-hpa-consumers", "-n", &ns, "-o", path]);
    println!("4 replicas wanted after {four:.2?} (backlog then {backlog_then}; the HPA read {seen} per replica)");

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
}
