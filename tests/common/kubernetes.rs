//! The Kubernetes side of a scenario: kubectl, namespaces, policies and their conditions, Events, and the
//! operator as a local process.

use super::*;

pub fn kubectl(args: &[&str], stdin: Option<&str>) -> Output {
    let bed = bed();
    let mut child = Command::new(bed.var("PELICAN_KUBECTL"))
        .args(args)
        .env("KUBECONFIG", bed.kubeconfig())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kubectl");
    if let Some(input) = stdin {
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    }
    drop(child.stdin.take());
    child.wait_with_output().expect("kubectl output")
}

/// Runs kubectl and returns stdout; panics with stderr on failure.
pub fn kubectl_ok(args: &[&str]) -> String {
    let out = kubectl(args, None);
    assert!(out.status.success(), "kubectl {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// `kubectl apply -f -`; returns (success, stdout + stderr).
pub fn kubectl_apply(namespace: &str, manifest: &str) -> (bool, String) {
    let out = kubectl(&["apply", "-n", namespace, "-f", "-"], Some(manifest));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// `kubectl patch cgp <name> -n <namespace> --type <merge|json> -p <patch>`.
pub fn patch_policy(namespace: &str, name: &str, kind: &str, patch: &str) {
    kubectl_ok(&["patch", "cgp", name, "-n", namespace, "--type", kind, "-p", patch]);
}

/// The operator, run as a local process against the test bed, watching one namespace.
pub struct Operator {
    child: Child,
    log: PathBuf,
    pub metrics_port: u16,
    pub health_port: u16,
    _dir: tempfile::TempDir,
}

impl Operator {
    pub fn start(namespace: &str) -> Operator {
        Operator::start_with(namespace, &[])
    }

    /// With extra `pelican run` flags.
    pub fn start_with(namespace: &str, extra: &[&str]) -> Operator {
        let args: Vec<&str> = ["--namespace", namespace].iter().chain(extra).copied().collect();
        Operator::launch(&args, bed().kubeconfig())
    }

    /// Watching one namespace, its traces exported over OTLP to `endpoint` as service `pelican-operator`.
    pub fn start_exporting(namespace: &str, endpoint: &str) -> Operator {
        Operator::spawn(
            "127.0.0.1",
            &["--namespace", namespace],
            bed().kubeconfig(),
            &[("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)],
        )
    }

    /// `pelican run <args>` against the API server of `kubeconfig`.
    pub fn launch(args: &[&str], kubeconfig: &str) -> Operator {
        Operator::launch_listening("127.0.0.1", args, kubeconfig)
    }

    /// The same, its metrics and health listeners on `host` (`[::]` for every IPv6 address).
    pub fn launch_listening(host: &str, args: &[&str], kubeconfig: &str) -> Operator {
        Operator::spawn(host, args, kubeconfig, &[])
    }

    fn spawn(host: &str, args: &[&str], kubeconfig: &str, env: &[(&str, &str)]) -> Operator {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("operator.log");
        let file = std::fs::File::create(&log).unwrap();
        let (metrics_port, health_port) = (free_port(), free_port());
        // PELICAN_BIN runs another build (an older release, for a benchmark's baseline).
        let binary = std::env::var("PELICAN_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_pelican").to_string());
        let child = Command::new(binary)
            .arg("run")
            .arg(format!("--metrics-addr={host}:{metrics_port}"))
            .arg(format!("--health-addr={host}:{health_port}"))
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info,pelican=debug")
            .envs(env.iter().copied())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .expect("start pelican run");
        Operator { child, log, metrics_port, health_port, _dir: dir }
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// GET of a path on one of the operator's ports, as `curl` sees it: (HTTP status, body).
    pub fn http_get(port: u16, path: &str) -> (u16, String) {
        let out = Command::new("curl")
            .args(["-s", "-w", "\n%{http_code}", &format!("http://127.0.0.1:{port}{path}")])
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_string())
    }

    pub fn metrics(&self) -> String {
        Operator::http_get(self.metrics_port, "/metrics").1
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        // A failing test shows what the operator was doing last (its log goes with its temporary directory).
        if std::thread::panicking() {
            let logs = self.logs();
            let lines: Vec<&str> = logs.lines().collect();
            eprintln!(
                "--- the operator's log, last 40 lines ---\n{}",
                lines[lines.len().saturating_sub(40)..].join("\n")
            );
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh namespace for one test. Left behind on purpose: without kube-controller-manager a deleted
/// namespace never finishes terminating, and the bed is thrown away as a whole.
pub fn namespace(prefix: &str) -> String {
    bed().install_crd();
    let suffix: u32 = rand_suffix();
    let name = format!("{prefix}-{suffix:08x}");
    kubectl_ok(&["create", "namespace", &name]);
    name
}

fn rand_suffix() -> u32 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(Instant::now()) as u32
}

/// The policy as `kubectl get -o json` shows it.
pub fn get_policy(namespace: &str, name: &str) -> Value {
    serde_json::from_str(&kubectl_ok(&["get", "cgp", name, "-n", namespace, "-o", "json"])).unwrap()
}

/// (status, reason) of a condition.
pub fn condition(policy: &Value, type_: &str) -> Option<(String, String)> {
    let conds = policy["status"]["conditions"].as_array()?;
    let c = conds.iter().find(|c| c["type"] == type_)?;
    Some((c["status"].as_str()?.to_string(), c["reason"].as_str()?.to_string()))
}

/// Waits until the condition has the given status and reason.
pub fn wait_condition(namespace: &str, name: &str, type_: &str, status: &str, reason: &str) -> Value {
    wait_for(&format!("{name} {type_}={status} ({reason})"), Duration::from_secs(60), || {
        let policy = get_policy(namespace, name);
        match condition(&policy, type_) {
            Some((s, r)) if s == status && r == reason => Ok(policy),
            other => {
                let conditions = policy["status"]["conditions"].as_array().cloned().unwrap_or_default();
                let message = conditions.iter().find(|c| c["type"] == "Ready").map(|c| c["message"].to_string());
                Err(format!("{other:?}, Ready message: {}", message.unwrap_or_default()))
            }
        }
    })
}

/// A policy manifest; `extra` is YAML appended under `spec:` (indented by two spaces).
pub fn policy(name: &str, url: &str, stream: &str, group: &str, extra: &str) -> String {
    format!(
        "apiVersion: pelican.io/v1alpha1\nkind: ConsumerGroupPolicy\nmetadata:\n  name: {name}\nspec:\n  redis:\n    url: {url}\n  stream: \"{stream}\"\n  group: {group}\n  startId: \"0\"\n  reclaim:\n    interval: 1s\n  deadLetter:\n    stream: \"{stream}:dlq\"\n{extra}"
    )
}

/// The start of most scenarios: a fresh namespace (`prefix-<random>`), the operator watching it, and `manifest`
/// applied there, with the policy `name` Ready.
pub fn ready_policy(prefix: &str, manifest: &str, name: &str) -> (String, Operator) {
    let ns = namespace(prefix);
    let operator = Operator::start(&ns);
    let (applied, out) = kubectl_apply(&ns, manifest);
    assert!(applied, "kubectl apply failed: {out}");
    wait_condition(&ns, name, "Ready", "True", "Reconciled");
    (ns, operator)
}

/// Waits until `count` policies of the namespace are Ready. Each look lists them all, so for thousands of policies
/// it looks every few seconds rather than every 200 ms, or the listing alone would load the API server.
pub fn wait_all_ready(namespace: &str, count: usize, timeout: Duration) {
    let pause = Duration::from_millis((count as u64).clamp(200, 5_000));
    let start = Instant::now();
    let mut ready = 0;
    while start.elapsed() < timeout {
        let path = "jsonpath={.items[*].status.conditions[?(@.type==\"Ready\")].status}";
        let out = kubectl_ok(&["get", "cgp", "-n", namespace, "-o", path]);
        ready = out.split_whitespace().filter(|s| *s == "True").count();
        if ready == count {
            return;
        }
        std::thread::sleep(pause);
    }
    panic!("timed out after {timeout:?} waiting for {count} policies Ready; {ready} of {count} ready");
}

/// Events of a policy with the given reason, as `kubectl get events` shows them.
pub fn events(namespace: &str, reason: &str) -> Vec<Value> {
    let out =
        kubectl_ok(&["get", "events", "-n", namespace, "--field-selector", &format!("reason={reason}"), "-o", "json"]);
    let list: Value = serde_json::from_str(&out).unwrap();
    list["items"].as_array().cloned().unwrap_or_default()
}

impl Operator {
    /// SIGKILL: no shutdown path runs.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the bed's helm against the bed's API server: (success, stdout + stderr).
pub fn helm(args: &[&str]) -> (bool, String) {
    let out =
        Command::new(bed().var("PELICAN_HELM")).args(args).env("KUBECONFIG", bed().kubeconfig()).output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// Whether a replica's `/metrics` text says it holds the leader Lease `pelican-leader` now (read at scrape time
/// from the Lease state; a replica that lost it shows 0 or is gone).
pub fn leads(metrics: &str) -> bool {
    metrics.contains("pelican_leader{lease=\"pelican-leader\"} 1")
}

/// The commit of the previous release, as `hack/previous-release` names it.
fn previous_commit() -> String {
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/hack/previous-release");
    std::fs::read_to_string(file).unwrap().trim().to_string()
}

/// The previous release's chart, from git history: the commit `hack/previous-release` names (the one that
/// `scripts/image previous` builds the operator of), its `charts/pelican` extracted into a directory that lives as
/// long as the returned guard; with the chart's path.
pub fn previous_chart() -> (tempfile::TempDir, PathBuf) {
    let (root, commit) = (env!("CARGO_MANIFEST_DIR"), previous_commit());
    let dir = tempfile::tempdir().unwrap();
    let archive = Command::new("sh")
        .arg("-c")
        .arg(format!("git -C {root} archive {commit} charts/pelican | tar -x -C {}", dir.path().display()))
        .output()
        .unwrap();
    assert!(archive.status.success(), "{}", String::from_utf8_lossy(&archive.stderr));
    let chart = dir.path().join("charts/pelican");
    (dir, chart)
}

/// A file of the previous release (the commit `hack/previous-release` names), as its users read it.
pub fn previous_file(path: &str) -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let out =
        Command::new("git").args(["-C", root, "show", &format!("{}:{path}", previous_commit())]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}
