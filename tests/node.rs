//! The chart as pods on the bed's node (`scripts/testenv node up`: kubelet, containerd, runc, CNI, kube-proxy,
//! kube-controller-manager, kube-scheduler): the operator image built without a registry (`scripts/image pelican`),
//! `helm install` into a namespace enforcing the restricted Pod Security level, a policy against Redis running as a
//! pod behind a Service, `/metrics` from the pods, the leader pod deleted, `helm upgrade`, `helm uninstall` and
//! namespace deletion.
//!
//! The main run has no node (it would change what the other tests see: garbage collection, namespace deletion), so
//! these tests are ignored there and `scripts/test` runs them afterwards with `--ignored`, the node up and the
//! image imported.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;

const LEASE: &str = "pelican-leader";

/// helm, failing the test when it fails.
fn helm_ok(args: &[&str]) -> String {
    let (ok, text) = helm(args);
    assert!(
        ok,
        "helm {args:?} failed:
{text}"
    );
    text
}

fn restricted_namespace(prefix: &str) -> String {
    let ns = namespace(prefix);
    kubectl_ok(&[
        "label",
        "namespace",
        &ns,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
    ]);
    // The controller-manager creates the namespace's `default` ServiceAccount a moment later; pods wait for it.
    wait_for("the default ServiceAccount", Duration::from_secs(60), || {
        let out = kubectl(&["get", "serviceaccount", "default", "-n", &ns], None);
        if out.status.success() { Ok(()) } else { Err(String::from_utf8_lossy(&out.stderr).to_string()) }
    });
    ns
}

/// (name, pod IP, Ready) of the namespace's running pods with `selector`.
fn pods(namespace: &str, selector: &str) -> Vec<(String, String, bool)> {
    let out: serde_json::Value =
        serde_json::from_str(&kubectl_ok(&["get", "pods", "-n", namespace, "-l", selector, "-o", "json"])).unwrap();
    let items = out["items"].as_array().cloned().unwrap_or_default();
    items
        .iter()
        .filter(|p| p["status"]["phase"] == "Running" && p["metadata"]["deletionTimestamp"].is_null())
        .map(|p| {
            let ready = p["status"]["conditions"]
                .as_array()
                .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready" && c["status"] == "True"));
            let ip = p["status"]["podIP"].as_str().unwrap_or_default().to_string();
            (p["metadata"]["name"].as_str().unwrap().to_string(), ip, ready)
        })
        .collect()
}

/// `/metrics` of a pod, scraped from inside the node's network, as Prometheus would.
fn scrape(ip: &str) -> Option<String> {
    let out = in_node(&["curl", "-sf", "--max-time", "2", &format!("http://{ip}:8080/metrics")]);
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).to_string())
}

/// The pods whose `/metrics` say they lead. Two seen at once are scraped again in the other order before they
/// count, so a hand-over between two scrapes is not mistaken for two leaders.
fn leaders(namespace: &str, selector: &str) -> Vec<String> {
    let running = pods(namespace, selector);
    let mut leading: Vec<(String, String)> = running
        .iter()
        .filter(|(_, ip, _)| !ip.is_empty() && scrape(ip).is_some_and(|m| leads(&m)))
        .map(|(name, ip, _)| (name.clone(), ip.clone()))
        .collect();
    if leading.len() > 1 {
        leading.reverse();
        leading.retain(|(_, ip)| scrape(ip).is_some_and(|m| leads(&m)));
    }
    leading.into_iter().map(|(name, _)| name).collect()
}

/// A container's log, read from the node's log directory (the API server cannot reach the kubelet: the node's
/// network is its own).
fn pod_log(namespace: &str, pod: &str) -> String {
    let dir = format!("{}/node/var-log/pods", bed().var("PELICAN_TESTENV"));
    let mut text = String::new();
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        if entry.file_name().to_string_lossy().starts_with(&format!("{namespace}_{pod}_")) {
            for file in files_below(&entry.path(), "") {
                text += &std::fs::read_to_string(file).unwrap_or_default();
            }
        }
    }
    text
}

fn show(args: &[&str]) {
    println!("$ kubectl {}\n{}", args.join(" "), kubectl_ok(args));
}

fn redis_in_pod(ip: &str, args: &[&str]) -> String {
    let mut all = vec!["redis-cli", "-h", ip, "-a", "node-pw", "--no-auth-warning"];
    all.extend_from_slice(args);
    let out = in_node(&all);
    assert!(out.status.success(), "redis-cli {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Who the policy `orders` connects to Redis as.
enum Auth {
    /// The server's default user, by the password in the Secret `redis-auth`.
    Default,
    /// The ACL user `pelican` with these rules (`ACL SETUSER` arguments), its name and password in the Secret
    /// `pelican-redis`.
    Acl(Vec<String>),
}

/// The password of the ACL user `pelican`.
const PELICAN_PW: &str = "pelican-pw";

/// The `user pelican ...` line of an ACL file as the docs write it, filled in for the policy `orders` as its comments
/// say (STREAM, DEAD_LETTER_STREAM, the hash tags {T} and {D}, the password): the rules `ACL SETUSER` takes.
fn documented_acl(file: &str) -> Vec<String> {
    let line = file.lines().find(|l| l.starts_with("user pelican ")).expect("a `user pelican` line");
    line.split_whitespace()
        .skip(2)
        .map(|rule| match rule {
            ">CHANGE-ME" => format!(">{PELICAN_PW}"),
            "~STREAM" => "~orders".to_string(),
            "~DEAD_LETTER_STREAM" => "~orders:dlq".to_string(),
            other => other.replace("{T}", "{orders}").replace("{D}", "{orders:dlq}"),
        })
        .collect()
}

/// The chart installed by `helm install` into a fresh namespace enforcing `restricted`, beside a namespace `apps`
/// (restricted too) for the workloads; with a policy, Redis runs there as a pod behind a Service, its password
/// in a Secret the chart lets the operator read, and the policy `orders` (dead-letters after one delivery left idle
/// a second) is Ready. Dropped without `uninstall`, it uninstalls the release and deletes both namespaces, so no
/// operator watching every namespace is left behind for the next test.
struct Installed {
    system: String,
    apps: String,
    release: String,
    selector: String,
    chart: String,
    /// The Service's address of the Redis pod, with a policy.
    redis_ip: String,
    orders: String,
    uninstalled: bool,
}

impl Installed {
    fn new(with_policy: bool) -> Installed {
        let values = |apps: &str| {
            vec![format!("rbac.secretNamespaces={{{apps}}}"), "autoscaling.externalScaler.enabled=true".to_string()]
        };
        let policy = with_policy.then_some(Auth::Default);
        Installed::install(concat!(env!("CARGO_MANIFEST_DIR"), "/charts/pelican"), values, policy)
    }

    /// `chart` installed with the `values` (`--set`) given for the workloads' namespace; with a `policy`, Redis and
    /// the policy `orders` connecting as it says.
    fn install(chart: &str, values: impl Fn(&str) -> Vec<String>, policy: Option<Auth>) -> Installed {
        let system = restricted_namespace("pelican-system");
        let apps = restricted_namespace("apps");
        let release = system.replace("-system", "");
        let mut installed = Installed {
            selector: format!("app.kubernetes.io/instance={release}"),
            chart: chart.to_string(),
            system,
            apps,
            release,
            redis_ip: String::new(),
            orders: String::new(),
            uninstalled: false,
        };
        if let Some(auth) = &policy {
            installed.start_redis();
            if let Auth::Acl(rules) = auth {
                installed.set_acl_user(rules);
            }
        }
        let start = Instant::now();
        let values = values(&installed.apps);
        // The chart's default image, localhost/pelican:<appVersion>, as installing.md says: imported into the node's
        // containerd (`scripts/testenv node import`), so IfNotPresent never pulls.
        let mut args =
            vec!["install", &installed.release, &installed.chart, "-n", &installed.system, "--wait", "--timeout=180s"];
        for value in &values {
            args.extend(["--set", value]);
        }
        helm_ok(&args);
        println!("helm install: both replicas Ready after {:.1}s", start.elapsed().as_secs_f64());
        if let Some(auth) = &policy {
            let credentials = match auth {
                Auth::Default => "passwordSecretRef: {name: redis-auth, key: password}",
                Auth::Acl(_) => {
                    "usernameSecretRef: {name: pelican-redis, key: username}\n    passwordSecretRef: {name: pelican-redis, key: password}"
                }
            };
            installed.orders = format!(
                "apiVersion: pelican.io/v1alpha1\nkind: ConsumerGroupPolicy\nmetadata:\n  name: orders\nspec:\n  redis:\n    url: redis://{}:6379\n    {credentials}\n  stream: orders\n  group: billing\n  startId: \"0\"\n  reclaim: {{minIdle: 1s, interval: 1s}}\n  retry: {{maxDeliveries: 1}}\n  deadLetter: {{stream: \"orders:dlq\"}}\n  deletionPolicy: Delete\n",
                installed.redis_ip
            );
            let (ok, out) = kubectl_apply(&installed.apps, &installed.orders);
            assert!(ok, "{out}");
            wait_condition(&installed.apps, "orders", "Ready", "True", "Reconciled");
        }
        installed
    }

    /// Redis as a pod, its password from a Secret, behind a Service.
    fn start_redis(&mut self) {
        let (ok, out) = kubectl_apply(&self.apps, include_str!("node/redis.yaml"));
        assert!(ok, "{out}");
        kubectl_ok(&["rollout", "status", "deployment/redis", "-n", &self.apps, "--timeout=120s"]);
        self.redis_ip = kubectl_ok(&["get", "service", "redis", "-n", &self.apps, "-o", "jsonpath={.spec.clusterIP}"]);
        // kube-proxy writes the Service's rules a moment after the pod is Ready.
        let ip = self.redis_ip.clone();
        wait_for("Redis through its Service", Duration::from_secs(20), || {
            let out = in_node(&["redis-cli", "-h", &ip, "-a", "node-pw", "--no-auth-warning", "PING"]);
            let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if text == "PONG" { Ok(()) } else { Err(format!("{text} {}", String::from_utf8_lossy(&out.stderr))) }
        });
    }

    /// The ACL user `pelican` given exactly `rules` (`ACL SETUSER pelican reset ...`: an ACL file's line replaced
    /// whole), and the Secret `pelican-redis` naming it.
    fn set_acl_user(&self, rules: &[String]) {
        let mut args = vec!["ACL", "SETUSER", "pelican", "reset"];
        args.extend(rules.iter().map(String::as_str));
        assert_eq!(redis_in_pod(&self.redis_ip, &args), "OK");
        let secret = format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: pelican-redis\nstringData:\n  username: pelican\n  password: {PELICAN_PW}\n"
        );
        let (ok, out) = kubectl_apply(&self.apps, &secret);
        assert!(ok, "{out}");
    }

    /// The release's Pods: (name, IP, Ready).
    fn pods(&self) -> Vec<(String, String, bool)> {
        pods(&self.system, &self.selector)
    }

    fn leaders(&self) -> Vec<String> {
        leaders(&self.system, &self.selector)
    }

    /// The one leader, waited for; (name, IP).
    fn leader(&self, other_than: Option<&str>) -> (String, String) {
        let name = wait_for("one leader", Duration::from_secs(30), || match self.leaders()[..] {
            [ref one] if Some(one.as_str()) != other_than => Ok(one.clone()),
            ref other => Err(format!("{other:?}")),
        });
        let ip = self.pods().into_iter().find(|(pod, _, _)| *pod == name).unwrap().1;
        (name, ip)
    }

    /// The ServiceAccount the chart made for the operator, as `kubectl auth can-i --as` names it.
    fn account(&self) -> String {
        format!("system:serviceaccount:{}:{}", self.system, self.release)
    }

    fn uninstall(&mut self) {
        self.uninstalled = true;
        helm_ok(&["uninstall", &self.release, "-n", &self.system, "--wait", "--timeout=120s"]);
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        if !self.uninstalled {
            let _ = helm(&["uninstall", &self.release, "-n", &self.system, "--wait", "--timeout=60s"]);
        }
        let _ = kubectl(&["delete", "namespace", &self.system, &self.apps, "--ignore-not-found", "--wait=false"], None);
    }
}

#[test]
#[ignore = "needs the node: scripts/test runs it (scripts/testenv node up, then --ignored)"]
fn a_restricted_namespace_refuses_a_pod_that_may_run_as_root() {
    let ns = restricted_namespace("restricted");
    let root_pod = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: root\nspec:\n  containers:\n    - name: c\n      image: localhost/redis:7.0.15\n";
    let (ok, out) = kubectl_apply(&ns, root_pod);
    assert!(!ok && out.contains("violates PodSecurity \"restricted:latest\""), "{out}");
    kubectl_ok(&["delete", "namespace", &ns, "--wait=false"]);
}

/// Two replicas run as restricted Pods with the chart's ServiceAccount, may read Secrets in the served namespace
/// only, reconcile a policy against Redis through its Service with the password read with that RBAC, and the
/// leader (only) reports it on `/metrics`. The API server refused none of their requests.
#[test]
#[ignore = "needs the node and the operator image: scripts/test runs it (scripts/testenv node up, then --ignored)"]
fn installed_pods_reconcile_a_policy_through_a_service_with_only_the_charts_rbac() {
    let installed = Installed::new(true);
    let (system, apps) = (&installed.system, &installed.apps);
    show(&["get", "pods", "-n", system, "-o", "wide"]);
    let running = installed.pods();
    assert_eq!(running.len(), 2, "{running:?}");
    assert!(running.iter().all(|(_, _, ready)| *ready), "{running:?}");
    let pod: serde_json::Value =
        serde_json::from_str(&kubectl_ok(&["get", "pod", &running[0].0, "-n", system, "-o", "json"])).unwrap();
    assert_eq!(pod["spec"]["serviceAccountName"], installed.release.as_str());
    assert_eq!(pod["spec"]["containers"][0]["image"], format!("localhost/pelican:{}", env!("CARGO_PKG_VERSION")));
    let volumes = pod["spec"]["volumes"].as_array().cloned().unwrap_or_default();
    assert!(
        volumes.iter().any(|v| v["name"].as_str().is_some_and(|n| n.starts_with("kube-api-access-"))),
        "the ServiceAccount token is mounted: {volumes:?}"
    );

    // The chart's RBAC and nothing more: Secrets readable in the served namespace only.
    let account = installed.account();
    let can = |args: &[&str]| {
        let mut all = vec!["auth", "can-i"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--as", &account]);
        String::from_utf8_lossy(&kubectl(&all, None).stdout).trim().to_string()
    };
    assert_eq!(can(&["get", "secrets", "-n", apps]), "yes");
    assert_eq!(can(&["get", "secrets", "-n", system]), "no");
    assert_eq!(can(&["list", "secrets", "--all-namespaces"]), "no");
    assert_eq!(can(&["create", "pods", "-n", apps]), "no");

    show(&["get", "cgp", "-n", apps, "-o", "wide"]);
    assert!(redis_in_pod(&installed.redis_ip, &["XINFO", "GROUPS", "orders"]).contains("billing"));

    // The README's quick start, as a reader would follow it: its policy, as written but for the Service's address
    // (the bed has no cluster DNS) and the namespace, with the Secret it names (tests/node/redis.yaml's), is Ready.
    let readme = include_str!("../README.md");
    let start = readme.find("```yaml\n").expect("the README's quick start has a YAML policy") + "```yaml\n".len();
    let quick_start = readme[start..][..readme[start..].find("```").unwrap()]
        .replace("name: orders, namespace: apps}", "name: quick-start}")
        .replace("redis://redis.apps.svc:6379/0", &format!("redis://{}:6379/0", installed.redis_ip))
        .replace("stream: orders\n", "stream: quick-start\n")
        .replace("\"orders:dlq\"", "\"quick-start:dlq\"");
    let (ok, out) = kubectl_apply(apps, &quick_start);
    assert!(ok, "{out}\n{quick_start}");
    wait_condition(apps, "quick-start", "Ready", "True", "Reconciled");
    println!("the README's quick-start policy is Ready on the node");

    // /metrics from the pods: exactly one leads, and it reports the policy.
    let (leader, leader_ip) = installed.leader(None);
    let metrics = scrape(&leader_ip).unwrap();
    let ready = format!("pelican_policy_ready{{namespace=\"{apps}\",policy=\"orders\",");
    let line = metrics.lines().find(|l| l.starts_with(&ready));
    assert!(line.is_some_and(|l| l.ends_with(" 1")), "{ready}... 1 missing:\n{metrics}");
    let standby = running.iter().find(|(name, _, _)| *name != leader).unwrap();
    assert!(scrape(&standby.1).unwrap().contains(&format!("pelican_leader{{lease=\"{LEASE}\"}} 0")));
    println!("leader {leader} ({leader_ip}); standby {} ({})", standby.0, standby.1);
    // installing.md, "Verify": the Lease names the leading pod (`<pod>-<pid>`), and the default disruption budget
    // lets one of the two replicas go at a time.
    let holder = kubectl_ok(&["get", "lease", LEASE, "-n", system, "-o", "jsonpath={.spec.holderIdentity}"]);
    assert!(holder.starts_with(&format!("{leader}-")), "the Lease holder {holder:?} is not the leader {leader}");
    let allowed = wait_for("the disruption budget to count both replicas", Duration::from_secs(30), || {
        let budget = kubectl_ok(&[
            "get",
            "pdb",
            &installed.release,
            "-n",
            system,
            "-o",
            "jsonpath={.status.disruptionsAllowed}",
        ]);
        if budget == "1" { Ok(budget) } else { Err(budget) }
    });
    println!("Lease {LEASE} held by {holder}; PodDisruptionBudget {}: {allowed} disruption allowed", installed.release);

    // Everything the pods did, with exactly the chart's RBAC: the API server refused none of their requests. (The
    // bed also holds the namespaces and policies of every earlier test, which this cluster-wide operator serves too.)
    let refusal = format!("User \\\"{account}\\\" cannot");
    for (pod, _, _) in &running {
        let log = pod_log(system, pod);
        assert!(!log.is_empty(), "no log for {pod}");
        let refused: Vec<&str> = log.lines().filter(|l| l.contains(&refusal)).collect();
        assert!(refused.is_empty(), "the chart's RBAC refused requests of {pod}:\n{}", refused.join("\n"));
    }
}

/// A policy in a namespace whose Secrets the chart does not let the operator read is Stalled and says which
/// namespaces it may read and which value to change.
#[test]
#[ignore = "needs the node and the operator image: scripts/test runs it (scripts/testenv node up, then --ignored)"]
fn a_policy_whose_secret_the_operator_may_not_read_says_which_value_allows_it() {
    let installed = Installed::new(false);
    let elsewhere = namespace("elsewhere");
    let orders = policy("orders", "redis://127.0.0.1:6379", "orders", "billing", "").replace(
        "    url: redis://127.0.0.1:6379\n",
        "    url: redis://127.0.0.1:6379\n    passwordSecretRef: {name: redis-auth, key: password}\n",
    );
    let secret = "apiVersion: v1\nkind: Secret\nmetadata:\n  name: redis-auth\nstringData:\n  password: node-pw\n";
    let (ok, out) = kubectl_apply(&elsewhere, &format!("{secret}---\n{orders}"));
    assert!(ok, "{out}");
    let refused = wait_condition(&elsewhere, "orders", "Ready", "False", "SecretNamespaceNotAllowed");
    let message = condition_message(&refused, "Ready");
    assert!(message.contains(&installed.apps) && message.contains("rbac.secretNamespaces"), "{message}");
    kubectl_ok(&["delete", "namespace", &elsewhere, "--wait=false"]);
}

/// The leader Pod deleted: the other one leads within the lease, KEDA's scaler Service follows it (it selects the
/// leader only, and answers gRPC through it), and the new leader dead-letters what the old one would have.
#[test]
#[ignore = "needs the node and the operator image: scripts/test runs it (scripts/testenv node up, then --ignored)"]
fn the_leader_pod_deleted_another_leads_the_scaler_service_follows_and_passes_go_on() {
    let installed = Installed::new(true);
    let system = &installed.system;
    let (leader, leader_ip) = installed.leader(None);
    let scaler = kubectl_ok(&["get", "services", "-n", system, "-o", "name"]);
    let scaler = scaler.lines().find_map(|s| s.strip_prefix("service/").filter(|s| s.ends_with("-scaler"))).unwrap();
    let serving = |ip: &str| {
        let ip = ip.to_string();
        move || {
            let path = "jsonpath={.items[*].endpoints[*].addresses[*]}";
            let label = format!("kubernetes.io/service-name={scaler}");
            let out = kubectl_ok(&["get", "endpointslices", "-n", system, "-l", &label, "-o", path]);
            if out.split_whitespace().collect::<Vec<_>>() == [ip.as_str()] { Ok(()) } else { Err(out) }
        }
    };
    wait_for("the scaler Service to select the leader only", Duration::from_secs(30), serving(&leader_ip));
    let cluster_ip = kubectl_ok(&["get", "service", scaler, "-n", system, "-o", "jsonpath={.spec.clusterIP}"]);
    // The EndpointSlice names the leader before kube-proxy has written the Service's rules on the node (it syncs on
    // its own schedule): a connection refused until then is the node catching up, not the Service selecting wrong.
    let asked = Instant::now();
    let code = wait_for("a gRPC answer through the scaler Service", Duration::from_secs(30), || {
        let answer = in_node(&[
            "curl",
            "-s",
            "--max-time",
            "2",
            "--http2-prior-knowledge",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            &format!("http://{cluster_ip}:9090/externalscaler.ExternalScaler/IsActive"),
        ]);
        let code = String::from_utf8_lossy(&answer.stdout).to_string();
        if answer.status.success() && code == "200" { Ok(code) } else { Err(format!("{answer:?}")) }
    });
    println!(
        "the scaler Service {scaler} ({cluster_ip}:9090) selects the leader {leader_ip}; gRPC over it: HTTP {code} \
         ({:.1} s after the EndpointSlice named it)",
        asked.elapsed().as_secs_f64()
    );

    let deleted = Instant::now();
    kubectl_ok(&["delete", "pod", &leader, "-n", system, "--wait=false"]);
    let (successor, successor_ip) = installed.leader(Some(&leader));
    let takeover = deleted.elapsed();
    println!("leader pod {leader} deleted: {successor} leads after {:.1}s", takeover.as_secs_f64());
    assert!(takeover < Duration::from_secs(15), "takeover took {takeover:?}, longer than the 15 s lease");
    wait_for("the scaler Service to follow the new leader", Duration::from_secs(30), serving(&successor_ip));
    let redis_ip = &installed.redis_ip;
    redis_in_pod(redis_ip, &["XADD", "orders", "*", "order", "1"]);
    redis_in_pod(redis_ip, &["XREADGROUP", "GROUP", "billing", "w1", "COUNT", "1", "STREAMS", "orders", ">"]);
    // The new leader starts every reconcile of this cluster-wide operator at once, and the bed holds the policies
    // of every earlier test (hundreds, most on servers long gone, each failing and retrying): 60 s, not 30, is
    // what a bed reused for several suites needed for this policy's first pass.
    let dead_lettered = Instant::now();
    wait_for("the unacknowledged message dead-lettered by the new leader", Duration::from_secs(60), || {
        match redis_in_pod(redis_ip, &["XLEN", "orders:dlq"]).as_str() {
            "1" => Ok(()),
            other => Err(format!("XLEN orders:dlq = {other}")),
        }
    });
    println!(
        "the new leader dead-lettered the message {:.1}s after it was read",
        dead_lettered.elapsed().as_secs_f64()
    );
}

/// `helm upgrade` with a changed value rolls both Pods, with the new flag, and never two leaders at once.
#[test]
#[ignore = "needs the node and the operator image: scripts/test runs it (scripts/testenv node up, then --ignored)"]
fn helm_upgrade_rolls_the_pods_with_never_two_leaders_at_once() {
    let installed = Installed::new(false);
    let (system, selector) = (&installed.system, &installed.selector);
    installed.leader(None);
    let before: BTreeSet<String> = installed.pods().into_iter().map(|p| p.0).collect();
    let (stop, seen) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(Vec::<Vec<String>>::new())));
    let sampler = {
        let (stop, seen, system, selector) = (stop.clone(), seen.clone(), system.clone(), selector.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                seen.lock().unwrap().push(leaders(&system, &selector));
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let start = Instant::now();
    let deployment = format!("deployment/{}", installed.release);
    helm_ok(&[
        "upgrade",
        &installed.release,
        &installed.chart,
        "-n",
        system,
        "--reset-then-reuse-values",
        "--set",
        "maxConcurrentReconciles=16",
    ]);
    kubectl_ok(&["rollout", "status", &deployment, "-n", system, "--timeout=180s"]);
    installed.leader(None);
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    let samples = seen.lock().unwrap().clone();
    let most = samples.iter().map(Vec::len).max().unwrap_or(0);
    let holders: BTreeSet<&String> = samples.iter().flatten().collect();
    println!(
        "helm upgrade rolled in {:.1}s; {} samples of every pod's pelican_leader, at most {most} leader at once, leaders seen {holders:?}",
        start.elapsed().as_secs_f64(),
        samples.len()
    );
    assert_eq!(most, 1, "two leaders at once during the upgrade: {samples:?}");
    let after = installed.pods();
    assert_eq!(after.len(), 2, "{after:?}");
    assert!(after.iter().all(|(name, _, ready)| *ready && !before.contains(name)), "{before:?} -> {after:?}");
    let args = kubectl_ok(&["get", "pod", &after[0].0, "-n", system, "-o", "jsonpath={.spec.containers[0].args}"]);
    assert!(args.contains("--max-concurrent-reconciles=16"), "{args}");
    show(&["get", "pods", "-n", system, "-o", "wide"]);
    // Rolling back (installing.md, "Upgrade"): revision 1's values again, as a new revision, one leader after it.
    helm_ok(&["rollback", &installed.release, "1", "-n", system, "--wait", "--timeout=180s"]);
    kubectl_ok(&["rollout", "status", &deployment, "-n", system, "--timeout=180s"]);
    installed.leader(None);
    let history = helm_ok(&["history", &installed.release, "-n", system]);
    println!("$ helm history {}\n{history}", installed.release);
    assert!(history.contains("Rollback to 1"), "{history}");
    let pods = installed.pods();
    let args = kubectl_ok(&["get", "pod", &pods[0].0, "-n", system, "-o", "jsonpath={.spec.containers[0].args}"]);
    assert!(args.contains("--max-concurrent-reconciles=32"), "after the rollback: {args}");
}

/// Issue 48.13: the upgrade from the previous release (0.1.0: its chart from git history and its operator built from
/// the same commit, `scripts/image previous`) with a policy running through it, as installing.md's "Upgrade" writes
/// it: the CRDs server-side applied, `helm upgrade ... --reset-then-reuse-values`, `kubectl rollout status`. Poison
/// messages (read, never acknowledged) arrive every 300 ms before, during and after the rollout. Every one ends in
/// the dead-letter stream exactly once, whichever version moved it; the 0.1 counts are carried over to the 0.2
/// keys (Event `CountersCarriedOver`), so `status.totals.deadLettered` counts them all; no `AnotherPelican`. The
/// operator connects as the ACL user each release documents (`examples/acl/pelican.acl`): 0.1's line, replaced whole
/// by 0.2's between the CRDs and the chart as the CHANGELOG's step 2 says; the server refuses none of its commands.
#[test]
#[ignore = "needs the node and both operator images: scripts/test runs it (scripts/testenv node up, then --ignored)"]
fn the_previous_release_upgraded_as_documented_dead_letters_every_message_once_and_keeps_its_counts() {
    let (_old, old_chart) = previous_chart();
    // The operator connects as the ACL user its release documents: 0.1's line first, replaced whole by 0.2's during
    // the upgrade (the CHANGELOG's step 2).
    let old_acl = documented_acl(&previous_file("examples/acl/pelican.acl"));
    let mut installed = Installed::install(
        old_chart.to_str().unwrap(),
        // 0.1's default image is a registry's; here it is the one `scripts/image previous` built, imported. It
        // watches the test's namespace only (0.1 has no `rbac.secretNamespaces`): cluster-wide, it would first work
        // through the thousands of policies the suite left on the bed, whose servers are gone.
        |apps| vec!["image.repository=localhost/pelican".to_string(), format!("watchNamespace={apps}")],
        Some(Auth::Acl(old_acl)),
    );
    let (system, apps, ip) = (installed.system.clone(), installed.apps.clone(), installed.redis_ip.clone());
    let old_image = kubectl_ok(&["get", "deploy", &installed.release, "-n", &system, "-o", "jsonpath={..image}"]);
    assert_eq!(old_image, "localhost/pelican:0.1.0");

    // A worker that reads every message and dies with it: each one is dead-lettered after `minIdle` (1 s).
    let (stop, sent) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(Vec::<String>::new())));
    let producer = {
        let (stop, sent, ip) = (stop.clone(), sent.clone(), ip.clone());
        std::thread::spawn(move || {
            let redis = |args: &[&str]| {
                let mut all = vec!["redis-cli", "-h", &ip, "-a", "node-pw", "--no-auth-warning"];
                all.extend_from_slice(args);
                let out = in_node(&all);
                assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
                String::from_utf8_lossy(&out.stdout).trim().to_string()
            };
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let id = redis(&["XADD", "orders", "*", "n", &n.to_string()]);
                let read = redis(&["XREADGROUP", "GROUP", "billing", "w", "COUNT", "1", "STREAMS", "orders", ">"]);
                assert!(read.contains(&id), "{id} not read: {read}");
                sent.lock().unwrap().push(id);
                std::thread::sleep(Duration::from_millis(300));
            }
        })
    };
    let dead_lettered = || get_policy(&apps, "orders")["status"]["totals"]["deadLettered"].as_i64().unwrap_or(0);
    wait_for("0.1 to dead-letter three messages", Duration::from_secs(60), || {
        if dead_lettered() >= 3 { Ok(()) } else { Err(format!("{}", dead_lettered())) }
    });
    let old_counters = "{orders}:pelican:billing:totals";
    assert_eq!(redis_in_pod(&ip, &["EXISTS", old_counters]), "1", "0.1 counts under its own key names");
    println!("0.1 dead-lettered {} of {} messages", dead_lettered(), sent.lock().unwrap().len());

    // installing.md, "Upgrade", its commands as written but for the release's names and the repository's paths.
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/src/installing.md")).unwrap();
    let command = |prefix: &str| -> Vec<String> {
        let line = page.lines().map(str::trim).find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("{prefix}"));
        line.split_whitespace()
            .skip(1)
            .map(|word| match word {
                "charts/pelican" => concat!(env!("CARGO_MANIFEST_DIR"), "/charts/pelican").to_string(),
                "charts/pelican/crds/" => concat!(env!("CARGO_MANIFEST_DIR"), "/charts/pelican/crds/").to_string(),
                "pelican" => installed.release.clone(),
                "deploy/pelican" => format!("deploy/{}", installed.release),
                "pelican-system" => system.clone(),
                other => other.to_string(),
            })
            .collect()
    };
    let start = Instant::now();
    let crds = command("kubectl apply --server-side");
    kubectl_ok(&crds.iter().map(String::as_str).collect::<Vec<_>>());
    // The CHANGELOG's step 2: the operator's ACL line replaced with examples/acl/pelican.acl whole, the 0.1
    // operator still running under it.
    redis_in_pod(&ip, &["ACL", "LOG", "RESET"]);
    installed.set_acl_user(&documented_acl(include_str!("../examples/acl/pelican.acl")));
    let upgrade = command("helm upgrade pelican charts/pelican");
    helm_ok(&upgrade.iter().map(String::as_str).collect::<Vec<_>>());
    let mut rollout = command("kubectl rollout status");
    rollout.push("--timeout=180s".into());
    kubectl_ok(&rollout.iter().map(String::as_str).collect::<Vec<_>>());
    let (leader, _) = installed.leader(None);
    println!("upgraded and rolled out in {:.1}s; {leader} leads", start.elapsed().as_secs_f64());
    let image = kubectl_ok(&["get", "deploy", &installed.release, "-n", &system, "-o", "jsonpath={..image}"]);
    assert_eq!(image, format!("localhost/pelican:{}", env!("CARGO_PKG_VERSION")), "the new default image");

    // Messages keep arriving under 0.2 for a while, then every one is dead-lettered once.
    std::thread::sleep(Duration::from_secs(5));
    stop.store(true, Ordering::Relaxed);
    producer.join().unwrap();
    let sent = sent.lock().unwrap().clone();
    wait_for("every message dead-lettered", Duration::from_secs(60), || {
        let pending = redis_in_pod(&ip, &["XPENDING", "orders", "billing"]);
        let dlq = redis_in_pod(&ip, &["XLEN", "orders:dlq"]);
        if pending.starts_with('0') && dlq == sent.len().to_string() {
            Ok(())
        } else {
            Err(format!("pending {pending:?}, dead letters {dlq} of {}", sent.len()))
        }
    });
    let entries = redis_in_pod(&ip, &["XRANGE", "orders:dlq", "-", "+"]);
    let lines: Vec<&str> = entries.lines().collect();
    let mut origins: Vec<&str> =
        lines.windows(2).filter(|pair| pair[0] == "pelican-source-id").map(|pair| pair[1]).collect();
    origins.sort();
    let mut expected: Vec<&str> = sent.iter().map(String::as_str).collect();
    expected.sort();
    assert_eq!(origins, expected, "each message in the dead-letter stream exactly once");
    wait_for("the counts of both versions in the status", Duration::from_secs(30), || {
        let counted = dead_lettered();
        if counted == sent.len() as i64 { Ok(()) } else { Err(format!("deadLettered {counted} of {}", sent.len())) }
    });
    assert_eq!(redis_in_pod(&ip, &["EXISTS", old_counters]), "0", "the 0.1 counters carried over and removed");
    let carried = events(&apps, "CountersCarriedOver");
    assert_eq!(carried.len(), 1, "{carried:?}");
    println!("{}", carried[0]["message"]);
    assert!(events(&apps, "AnotherPelican").is_empty(), "the upgrade is a hand-over, not a second install");
    // The 0.2 operator connects as the ACL user, and since the line was replaced the server refused nothing of
    // either version (0.1 ran as the user before: its policy names it and dead-lettered under it).
    assert!(redis_in_pod(&ip, &["CLIENT", "LIST"]).contains(" user=pelican "), "the operator connects as pelican");
    assert_eq!(redis_in_pod(&ip, &["ACL", "LOG"]), "", "commands the documented ACL refused");
    wait_condition(&apps, "orders", "Ready", "True", "Reconciled");
    println!(
        "{} messages, {} dead-lettered once each, status.totals.deadLettered {}",
        sent.len(),
        origins.len(),
        dead_lettered()
    );
    show(&["get", "cgp", "-n", &apps, "-o", "wide"]);
    installed.uninstall();
}

/// Issue 51.2: sharding turned on and off again on a running release as installing.md writes it (the operator
/// stopped with `replicaCount=0`, then the shape changed), with a policy in each shard: after each switch both are
/// served (a poison message dead-lettered each), each by its own shard (`status.operator`), the old Deployments gone,
/// and no `AnotherPelican` ever said.
#[test]
#[ignore = "needs the node and the operator image: scripts/test runs it (scripts/testenv node up, then --ignored)"]
fn sharding_turned_on_and_off_on_a_running_release_serves_each_policy_once() {
    let installed = Installed::new(true);
    let (system, apps, release, ip) =
        (installed.system.clone(), installed.apps.clone(), installed.release.clone(), installed.redis_ip.clone());
    let invoices = installed
        .orders
        .replace("name: orders\n", "name: invoices\n  labels: {sharding.pelican.io/key: a}\n")
        .replace("stream: orders", "stream: invoices")
        .replace("\"orders:dlq\"", "\"invoices:dlq\"");
    let (ok, out) = kubectl_apply(&apps, &invoices);
    assert!(ok, "{out}");
    wait_condition(&apps, "invoices", "Ready", "True", "Reconciled");
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/src/installing.md")).unwrap();
    assert!(page.contains("--set replicaCount=0") && page.contains("kubectl wait --for=delete pod"), "the procedure");
    let chart = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/pelican");
    let upgrade = |sets: &[&str]| {
        let mut args = vec!["upgrade", &release, chart, "-n", &system, "--reset-then-reuse-values"];
        args.extend(sets);
        helm_ok(&args);
    };
    let deployments = || -> BTreeSet<String> {
        let names = kubectl_ok(&[
            "get",
            "deploy",
            "-n",
            &system,
            "-l",
            &installed.selector,
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ]);
        names.split_whitespace().map(String::from).collect()
    };
    let mut poisoned = 0;
    let mut serve = |shards: &str| {
        // A poison message in each stream, dead-lettered by whichever shard serves its policy.
        poisoned += 1;
        for stream in ["orders", "invoices"] {
            let id = redis_in_pod(&ip, &["XADD", stream, "*", "n", &poisoned.to_string()]);
            let read =
                redis_in_pod(&ip, &["XREADGROUP", "GROUP", "billing", "w", "COUNT", "10", "STREAMS", stream, ">"]);
            assert!(read.contains(&id), "{read}");
        }
        for (policy, lease) in [
            ("orders", "pelican-leader"),
            ("invoices", if shards.is_empty() { "pelican-leader" } else { "pelican-leader-a" }),
        ] {
            let dlq = format!("{policy}:dlq");
            wait_for(&format!("{policy}'s poison dead-lettered ({shards:?})"), Duration::from_secs(60), || {
                let dead = redis_in_pod(&ip, &["XLEN", &dlq]);
                if dead == poisoned.to_string() { Ok(()) } else { Err(dead) }
            });
            let writer = wait_for(&format!("{policy} served by {lease}"), Duration::from_secs(30), || {
                let operator = get_policy(&apps, policy)["status"]["operator"].as_str().unwrap_or_default().to_string();
                if operator == format!("{system}/{lease}") { Ok(operator) } else { Err(operator) }
            });
            println!("{policy}: {poisoned} dead-lettered, status written by {writer}");
        }
    };
    serve("");
    assert_eq!(deployments(), [release.clone()].into());

    for (shards, expected) in [
        ("sharding.shards={a}", vec![format!("{release}-a"), format!("{release}-unlabelled")]),
        ("sharding.shards=[]", vec![release.clone()]),
    ] {
        let start = Instant::now();
        upgrade(&["--set", "replicaCount=0"]);
        kubectl_ok(&["wait", "--for=delete", "pod", "-l", &installed.selector, "-n", &system, "--timeout=120s"]);
        let set = if shards.ends_with("[]") { "--set-json" } else { "--set" };
        upgrade(&["--set", "replicaCount=2", set, shards]);
        for deployment in &expected {
            kubectl_ok(&["rollout", "status", &format!("deploy/{deployment}"), "-n", &system, "--timeout=180s"]);
        }
        println!("{shards}: switched in {:.1}s", start.elapsed().as_secs_f64());
        assert_eq!(deployments(), expected.iter().cloned().collect());
        serve(if shards.ends_with("[]") { "" } else { "a" });
    }
    let another = events(&apps, "AnotherPelican");
    assert!(another.is_empty(), "{another:?}");
    show(&["get", "deploy,lease", "-n", &system]);
}

/// The SDK's example consumer (`scripts/image consumer`) as a Deployment of two Pods on the node, a policy of the
/// default `minIdle` (5 minutes) with `spec.consumers.pods` selecting them (issue 49):
/// - 16 messages in flight (handlers of 15 s), the Pod holding most of them deleted: its worker gives back what its
///   grace (1 s) cut off and the next pass retries it; a live Pod reads every one again within seconds, not minutes;
/// - a Pod's process killed with SIGKILL: the container restarts under the same name and its worker reads its own
///   PEL first; every message handled;
/// - a message that makes the process exit, every time it is read: the Pod crash-loops, and the message is
///   dead-lettered once its deliveries pass `maxDeliveries` (counted: a Pod that dies of a message is no excuse).
#[test]
#[ignore = "needs the node and the operator and consumer images: scripts/test runs it (scripts/testenv node up, then --ignored)"]
fn worker_pods_deleted_killed_or_crashing_have_their_messages_retried_in_seconds() {
    let installed = Installed::new(false);
    let apps = installed.apps.clone();
    let server = Server::start(Flavor::Redis);
    let _forward = NodeForward::to_loopback(server.port);
    let mut conn = server.conn();
    let url = format!("redis://{NODE_IP}:{}/0", server.port);
    let extra = "  consumers:\n    pods:\n      matchLabels: {app: workers}\n  retry: {maxDeliveries: 2}\n";
    let (ok, out) = kubectl_apply(&apps, &policy("jobs", &url, "jobs", "workers", extra));
    assert!(ok, "{out}");
    wait_condition(&apps, "jobs", "Ready", "True", "Reconciled");
    let env = [
        ("REDIS_URL", url.as_str()),
        ("STREAM", "jobs"),
        ("GROUP", "workers"),
        ("HANDLE_MS", "15000"),
        ("SHUTDOWN_GRACE_MS", "1000"),
        ("EXIT_ON", "crash"),
    ];
    let deployment = consumer_deployment("workers", 2, 10, &env);
    let (ok, out) = kubectl_apply(&apps, &deployment);
    assert!(ok, "{out}");
    kubectl_ok(&["rollout", "status", "deployment/workers", "-n", &apps, "--timeout=120s"]);
    let consumers = |conn: &mut redis::Connection| -> BTreeSet<String> {
        let infos: Vec<HashMap<String, redis::Value>> =
            redis::cmd("XINFO").arg("CONSUMERS").arg("jobs").arg("workers").query(conn).unwrap();
        infos.iter().map(|c| redis::from_redis_value(c["name"].clone()).unwrap()).collect()
    };
    let running = |apps: &str| -> BTreeSet<String> { pods(apps, "app=workers").into_iter().map(|p| p.0).collect() };
    wait_for("both workers reading", Duration::from_secs(30), || {
        let (reading, running) = (consumers(&mut conn), running(&apps));
        if running.len() == 2 && running.is_subset(&reading) { Ok(()) } else { Err(format!("{reading:?}")) }
    });
    let publish = |conn: &mut redis::Connection, fields: &[(&str, &str)]| -> String {
        redis::cmd("XADD").arg("jobs").arg("*").arg(fields).query(conn).unwrap()
    };
    // Every message in flight, and by whom.
    let in_flight = |conn: &mut redis::Connection, count: usize| {
        wait_for(&format!("{count} messages in flight"), Duration::from_secs(30), || {
            let pending = pel(conn, "jobs", "workers");
            if pending.len() == count { Ok(pending) } else { Err(format!("{pending:?}")) }
        })
    };

    // A Pod deleted with messages in flight.
    for n in 0..16 {
        publish(&mut conn, &[("n", &n.to_string())]);
    }
    let pending = in_flight(&mut conn, 16);
    let mut held: HashMap<String, Vec<String>> = HashMap::new();
    for (id, owner, _, _) in &pending {
        held.entry(owner.clone()).or_default().push(id.clone());
    }
    let (victim, ids) = held.iter().max_by_key(|(_, ids)| ids.len()).unwrap();
    let deleted = Instant::now();
    kubectl_ok(&["delete", "pod", victim, "-n", &apps, "--wait=false"]);
    // Read again by a live worker: a copy of each (requeued) is pending with another consumer, or already handled.
    let took = wait_for("the deleted Pod's messages read again", Duration::from_secs(60), || {
        let copies: Vec<String> = xrange(&mut conn, "jobs")
            .iter()
            .filter_map(|e| field(e, "pelican-origin-id").map(|o| String::from_utf8_lossy(o).to_string()))
            .collect();
        let undelivered = xinfo_groups(&mut conn, "jobs").iter().map(|g| group_field::<i64>(g, "lag")).sum::<i64>();
        let all = ids.iter().all(|id| copies.contains(id));
        if all && undelivered == 0 {
            Ok(deleted.elapsed())
        } else {
            Err(format!("copies {copies:?}, lag {undelivered}"))
        }
    });
    println!(
        "a Pod deleted with {} messages in flight: all read again by a live worker {took:.1?} after (minIdle 5 min)",
        ids.len()
    );
    wait_for("every message handled", Duration::from_secs(60), || {
        let pending = pel(&mut conn, "jobs", "workers");
        if pending.is_empty() { Ok(()) } else { Err(format!("{pending:?}")) }
    });
    wait_for("the deleted Pod's consumer removed", Duration::from_secs(30), || {
        let reading = consumers(&mut conn);
        if reading.contains(victim) { Err(format!("{reading:?}")) } else { Ok(()) }
    });

    // A Pod's process killed with SIGKILL: the container restarts, its worker reads its own PEL first.
    kubectl_ok(&["rollout", "status", "deployment/workers", "-n", &apps, "--timeout=120s"]);
    for n in 0..8 {
        publish(&mut conn, &[("n", &n.to_string())]);
    }
    let pending = in_flight(&mut conn, 8);
    let victim = pending[0].1.clone();
    let ids: Vec<String> = pending.iter().filter(|p| p.1 == victim).map(|p| p.0.clone()).collect();
    let process = consumer_process(&victim);
    let killed = Instant::now();
    assert!(std::process::Command::new("kill").args(["-9", &process.to_string()]).status().unwrap().success());
    let took = wait_for("the killed worker's messages read again", Duration::from_secs(60), || {
        let pending = pel(&mut conn, "jobs", "workers");
        let again = pending.iter().filter(|p| ids.contains(&p.0) && p.3 == 2).count();
        if again == ids.len() { Ok(killed.elapsed()) } else { Err(format!("{pending:?}")) }
    });
    println!(
        "a worker killed with {} messages in flight: all read again after its restart, {took:.1?} after",
        ids.len()
    );
    wait_for("every message handled", Duration::from_secs(60), || {
        let pending = pel(&mut conn, "jobs", "workers");
        if pending.is_empty() { Ok(()) } else { Err(format!("{pending:?}")) }
    });

    // A message that kills whoever reads it.
    let poison = publish(&mut conn, &[("crash", "1")]);
    let published = Instant::now();
    let dead = wait_for("the poison message dead-lettered", Duration::from_secs(180), || {
        let dead = xrange(&mut conn, "jobs:dlq");
        if dead.is_empty() { Err(format!("{:?}", pel(&mut conn, "jobs", "workers"))) } else { Ok(dead) }
    });
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(field(&dead[0], "pelican-source-id"), Some(poison.as_bytes()));
    assert_eq!(field(&dead[0], "pelican-reason"), Some(&b"MaxDeliveriesExceeded"[..]));
    let restarts: i64 = pods(&apps, "app=workers")
        .iter()
        .map(|(pod, _, _)| {
            kubectl_ok(&["get", "pod", pod, "-n", &apps, "-o", "jsonpath={.status.containerStatuses[0].restartCount}"])
                .parse::<i64>()
                .unwrap()
        })
        .sum();
    println!(
        "a message that ends the process: dead-lettered {:.1?} after it was published, with {} deliveries; the Pods restarted {restarts} times",
        published.elapsed(),
        String::from_utf8_lossy(field(&dead[0], "pelican-deliveries").unwrap())
    );
    assert!(restarts >= 3, "the crash loop: {restarts} restarts (one SIGKILL, then the poison message)");
    wait_for("the dead letter counted", Duration::from_secs(30), || {
        let counted = get_policy(&apps, "jobs")["status"]["totals"]["deadLettered"].as_i64().unwrap_or(0);
        if counted == 1 { Ok(()) } else { Err(counted.to_string()) }
    });
    show(&["get", "pods", "-n", &apps]);
    show(&["get", "cgp", "-n", &apps, "-o", "wide"]);
}

/// The pid of the consumer process of `pod` (its HOSTNAME), seen from the machine: the node shares its process
/// namespace.
fn consumer_process(pod: &str) -> u32 {
    wait_for(&format!("{pod}'s consumer process"), Duration::from_secs(10), || {
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let environ = std::fs::read(entry.path().join("environ")).unwrap_or_default();
            let host = format!("HOSTNAME={pod}");
            if cmdline.starts_with(b"/usr/local/bin/consumer\0")
                && environ.split(|b| *b == 0).any(|var| var == host.as_bytes())
            {
                return Ok(pid);
            }
        }
        Err("not found".to_string())
    })
}

/// RBAC for people (installing.md, "Teams"): a user bound to Kubernetes' own `edit` in a namespace creates a policy,
/// a redrive and a seek there through the chart's aggregated role, and may not create a RedisServer; one bound to
/// `view` reads them and writes nothing.
#[test]
#[ignore = "needs the node and the operator image: scripts/test runs it (scripts/testenv node up, then --ignored)"]
fn a_user_bound_to_edit_creates_policies_and_redrives_but_no_server() {
    let installed = Installed::new(false);
    let team = installed.apps.clone();
    for (user, role) in [("alice", "edit"), ("bob", "view")] {
        kubectl_ok(&[
            "create",
            "rolebinding",
            &format!("{user}-{role}"),
            "-n",
            &team,
            "--clusterrole",
            role,
            "--user",
            user,
        ]);
    }
    // The controller-manager aggregates the chart's roles into edit and view a moment after the install.
    let can = |user: &str, verb: &str, resource: &str| {
        let out = kubectl(&["auth", "can-i", verb, resource, "-n", &team, "--as", user], None);
        String::from_utf8_lossy(&out.stdout).trim() == "yes"
    };
    wait_for("edit and view to carry the chart's rules", Duration::from_secs(60), || {
        match (can("alice", "create", "consumergrouppolicies.pelican.io"), can("bob", "list", "groupseeks.pelican.io"))
        {
            (true, true) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    let as_user = |user: &str, manifest: &str| {
        let out = kubectl(&["apply", "-n", &team, "--as", user, "-f", "-"], Some(manifest));
        (
            out.status.success(),
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        )
    };
    let policy = "apiVersion: pelican.io/v1alpha1\nkind: ConsumerGroupPolicy\nmetadata: {name: orders}\nspec:\n  redis: {url: \"redis://redis:6379/0\"}\n  stream: orders\n  group: billing\n  deadLetter: {stream: \"orders:dlq\"}\n";
    let redrive = "apiVersion: pelican.io/v1alpha1\nkind: DeadLetterRedrive\nmetadata: {name: again}\nspec:\n  policyRef: {name: orders}\n";
    let seek = "apiVersion: pelican.io/v1alpha1\nkind: GroupSeek\nmetadata: {name: skip}\nspec:\n  policyRef: {name: orders}\n  to: {position: Latest}\n";
    let server = "apiVersion: pelican.io/v1alpha1\nkind: RedisServer\nmetadata: {name: mine}\nspec:\n  url: \"redis://redis:6379/0\"\n  tenants:\n  - namespaces: [\"*\"]\n    keys: [\"*\"]\n";
    for (what, manifest) in [("policy", policy), ("redrive", redrive), ("seek", seek)] {
        let (ok, out) = as_user("alice", manifest);
        assert!(ok, "alice (edit) could not create the {what}: {out}");
        println!("alice (edit): {}", out.trim());
    }
    let (ok, out) = as_user("alice", server);
    assert!(!ok && out.contains("forbidden"), "alice (edit) created a RedisServer: {out}");
    println!("alice (edit), a RedisServer: {}", out.trim());
    let listed = kubectl(&["get", "cgp,dlr,seek", "-n", &team, "--as", "bob"], None);
    assert!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
    let (ok, out) = as_user("bob", &policy.replace("name: orders", "name: bobs"));
    assert!(!ok && out.contains("forbidden"), "bob (view) created a policy: {out}");
    assert!(!can("bob", "delete", "consumergrouppolicies.pelican.io"));
    assert!(!can("alice", "create", "redisservers.pelican.io"));
}

/// Deleting the namespace of a policy (with its finalizer, its Secret and its Redis) finishes, the policy letting go
/// on purpose and saying what it left in Redis; `helm uninstall` leaves no cluster-wide RBAC behind.
#[test]
#[ignore = "needs the node and the operator image: scripts/test runs it (scripts/testenv node up, then --ignored)"]
fn deleting_the_namespace_and_uninstalling_finish_and_leave_nothing_behind() {
    let mut installed = Installed::new(true);
    let (system, apps) = (installed.system.clone(), installed.apps.clone());
    let start = Instant::now();
    kubectl_ok(&["delete", "namespace", &apps, "--timeout=120s"]);
    println!("namespace {apps} deleted in {:.1}s", start.elapsed().as_secs_f64());
    // The policy let go of its finalizer on purpose, saying what it left in Redis (its Redis went with the namespace).
    let logs: String = installed.pods().iter().map(|(pod, _, _)| pod_log(&system, pod)).collect();
    let skipped: Vec<&str> = logs.lines().filter(|l| l.contains("CleanupSkipped") && l.contains(&apps)).collect();
    assert!(!skipped.is_empty(), "no CleanupSkipped for {apps}/orders in the operator's logs:\n{logs}");
    println!("{}", skipped[0]);
    let start = Instant::now();
    installed.uninstall();
    kubectl_ok(&["delete", "namespace", &system, "--timeout=120s"]);
    println!("helm uninstall and namespace {system} deleted in {:.1}s", start.elapsed().as_secs_f64());
    for kind in ["clusterrole", "clusterrolebinding"] {
        let out = kubectl(&["get", kind, &installed.release], None);
        assert!(!out.status.success(), "{kind} {} left behind", installed.release);
    }
}

/// installing.md, "Uninstall", as written (but for one namespace: the bed is shared): a dead letter made first;
/// policies deleted while the operator runs (the `Delete` policy's group goes), `helm uninstall` (its ClusterRoles
/// for the operator and for people go), and in Redis only what the page says stays: the streams and Pelican's keys
/// (found here with `--scan --pattern`; the page's `scripts/uninstall-keys sweep` that then deletes them is
/// `tests/uninstall.rs`'s).
#[test]
#[ignore = "needs the node and the operator image: scripts/test runs it (scripts/testenv node up, then --ignored)"]
fn uninstalling_as_written_leaves_only_what_the_page_says() {
    let mut installed = Installed::new(true);
    let apps = installed.apps.clone();
    let id = redis_in_pod(&installed.redis_ip, &["XADD", "orders", "*", "n", "1"]);
    redis_in_pod(&installed.redis_ip, &["XREADGROUP", "GROUP", "billing", "w-1", "STREAMS", "orders", ">"]);
    wait_for("the entry dead-lettered", Duration::from_secs(30), || {
        match redis_in_pod(&installed.redis_ip, &["XLEN", "orders:dlq"]).as_str() {
            "1" => Ok(()),
            other => Err(other.to_string()),
        }
    });
    kubectl_ok(&["delete", "cgp", "--all", "-n", &apps, "--timeout=60s"]);
    assert_eq!(redis_in_pod(&installed.redis_ip, &["XINFO", "GROUPS", "orders"]), "", "the Delete policy's group");
    installed.uninstall();
    for role in ["", "-edit", "-view"] {
        let out = kubectl(&["get", "clusterrole", &format!("{}{role}", installed.release)], None);
        assert!(!out.status.success(), "ClusterRole {}{role} left behind", installed.release);
    }
    let left = redis_in_pod(&installed.redis_ip, &["--scan", "--pattern", "*:pelican:*"]);
    println!("after uninstalling, Pelican's keys left in Redis (redis-cli --scan --pattern '*:pelican:*'):\n{left}");
    assert!(left.lines().all(|k| k.starts_with("{orders}:pelican:orders:")), "{left}");
    assert!(left.lines().any(|k| k.ends_with(":totals")), "{left}");
    let dead_letter = redis_in_pod(&installed.redis_ip, &["XRANGE", "orders:dlq", "-", "+"]);
    assert!(dead_letter.contains(&id), "the dead letter stays: {dead_letter}");
}

fn condition_message(object: &serde_json::Value, type_: &str) -> String {
    let conditions = object["status"]["conditions"].as_array().cloned().unwrap_or_default();
    let found = conditions.iter().find(|c| c["type"] == type_).cloned().unwrap_or_default();
    found["message"].as_str().unwrap_or_default().to_string()
}
