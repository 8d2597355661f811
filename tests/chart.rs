//! The Helm chart against the real API server and helm built from its Go module: lint, schema, server-side dry
//! run, and the operator running with exactly the chart's RBAC as the chart's ServiceAccount.

#[macro_use]
mod common;

use std::time::Duration;

use common::*;

const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/pelican");

fn render(release: &str, namespace: &str, sets: &[&str]) -> String {
    let mut args = vec!["template", release, CHART, "--namespace", namespace];
    for set in sets {
        args.extend(["--set", set]);
    }
    let (ok, out) = helm(&args);
    assert!(ok, "helm template failed: {out}");
    out
}

/// `helm package` (what an internal registry or an air-gapped cluster receives) carries the CRDs and renders exactly
/// what the chart's directory renders.
#[test]
fn the_packaged_chart_renders_what_the_directory_renders() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().to_str().unwrap();
    let (ok, out) = helm(&["package", CHART, "--destination", out_dir]);
    assert!(ok, "helm package failed: {out}");
    let package = std::fs::read_dir(dir.path()).unwrap().next().unwrap().unwrap().path();
    let name = package.file_name().unwrap().to_str().unwrap().to_string();
    assert!(name.starts_with("pelican-") && name.ends_with(".tgz"), "{name}");
    let listing = std::process::Command::new("tar").arg("tzf").arg(&package).output().unwrap();
    let listing = String::from_utf8_lossy(&listing.stdout).to_string();
    for crd in ["consumergrouppolicies", "deadletterredrives", "groupseeks", "redisservers"] {
        assert!(listing.contains(&format!("pelican/crds/pelican.io_{crd}.yaml")), "{crd} missing: {listing}");
    }
    let (ok, packaged) = helm(&["template", "x", package.to_str().unwrap(), "--namespace", "pelican-system"]);
    assert!(ok, "helm template of the package failed: {packaged}");
    assert_eq!(packaged, render("x", "pelican-system", &[]));
}

#[test]
fn helm_lint_passes() {
    let (ok, out) = helm(&["lint", CHART, "--strict"]);
    assert!(ok && out.contains("0 chart(s) failed"), "{out}");
}

#[test]
fn default_manifests_pass_a_server_side_dry_run() {
    let ns = namespace("chart-dry");
    let manifests = render("dry", &ns, &[]);
    let out = kubectl(&["apply", "--dry-run=server", "-n", &ns, "-f", "-"], Some(&manifests));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for kind in [
        "serviceaccount/",
        "clusterrole.",
        "clusterrolebinding.",
        "role.",
        "rolebinding.",
        "service/",
        "deployment.apps/",
    ] {
        assert!(text.contains(kind), "{kind} missing from:\n{text}");
    }
    // The optional objects render too.
    let all =
        render("dry", &ns, &["podDisruptionBudget.enabled=true", "networkPolicy.enabled=true", "watchNamespace=apps"]);
    for kind in ["kind: PodDisruptionBudget", "kind: NetworkPolicy", "kind: RoleBinding"] {
        assert!(all.contains(kind), "{kind} missing");
    }
}

#[test]
fn unknown_values_are_refused_by_the_schema() {
    let (ok, out) = helm(&["template", "x", CHART, "--set", "bogus=1"]);
    assert!(!ok && out.contains("additional properties 'bogus' not allowed"), "{out}");
    let (ok, out) = helm(&["template", "x", CHART, "--set", "leaderElection.enabeld=true"]);
    assert!(!ok && out.contains("enabeld"), "{out}");
    let (ok, out) = helm(&["template", "x", CHART, "--set", "maxConcurrentReconciles=-1"]);
    assert!(!ok && out.contains("maxConcurrentReconciles"), "{out}");
}

/// `autoscaling.externalScaler.enabled`: the operator serves on the port, a Service selects the replica that serves
/// (per shard when sharded), only KEDA's namespace may reach the port, and the operator may label its Pods; all of
/// it accepted by the API server.
#[test]
fn the_external_scaler_gets_a_service_a_network_policy_and_the_right_to_label_its_pod() {
    let ns = namespace("chart-scaler");
    let sets = ["autoscaling.externalScaler.enabled=true", "autoscaling.externalScaler.kedaNamespace=autoscalers"];
    let manifests = render("scaled", &ns, &sets);
    assert!(manifests.contains("--external-scaler-addr=0.0.0.0:9090"), "{manifests}");
    let out = kubectl(&["apply", "--dry-run=server", "-n", &ns, "-f", "-"], Some(&manifests));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for object in [
        "service/scaled-pelican-scaler",
        "networkpolicy.networking.k8s.io/scaled-pelican-scaler",
        "role.rbac.authorization.k8s.io/scaled-pelican-scaler",
    ] {
        assert!(text.contains(object), "{object} missing from:\n{text}");
    }
    let service =
        manifests.split("---").find(|m| m.contains("name: scaled-pelican-scaler\n") && m.contains("kind: Service\n"));
    assert!(service.unwrap().contains("pelican.io/scaler: serving"), "the Service selects the serving replica");
    assert!(manifests.contains("kubernetes.io/metadata.name: autoscalers"), "KEDA's namespace admitted");
    let sharded = render("scaled", &ns, &["autoscaling.externalScaler.enabled=true", "sharding.shards={a}"]);
    for service in ["name: scaled-pelican-scaler-a\n", "name: scaled-pelican-scaler-unlabelled\n"] {
        assert!(sharded.contains(service), "{service} missing");
    }
    let (ok, out) = helm(&["template", "x", CHART, "--set", "autoscaling.externalScaler.port=0"]);
    assert!(!ok && out.contains("port"), "{out}");
}

#[test]
fn reconcile_concurrency_reaches_the_operator() {
    let (ok, out) = helm(&["template", "x", CHART]);
    assert!(ok && out.contains("- --max-concurrent-reconciles=32"), "{out}");
    let (ok, out) = helm(&["template", "x", CHART, "--set", "maxConcurrentReconciles=8"]);
    assert!(ok && out.contains("- --max-concurrent-reconciles=8"), "{out}");
}

#[test]
fn the_chart_crds_are_the_generated_ones() {
    for file in CRD_FILES {
        let chart = std::fs::read_to_string(format!("{CHART}/crds/{file}")).unwrap();
        let generated = std::fs::read_to_string(format!("{}/crds/{file}", env!("CARGO_MANIFEST_DIR"))).unwrap();
        assert!(chart == generated, "charts/pelican/crds/{file} is stale: cp crds/*.yaml charts/pelican/crds/");
    }
}

const CRD_FILES: [&str; 4] = [
    "pelican.io_consumergrouppolicies.yaml",
    "pelican.io_deadletterredrives.yaml",
    "pelican.io_groupseeks.yaml",
    "pelican.io_redisservers.yaml",
];

#[test]
fn pods_are_restricted_and_labelled() {
    let manifests = render("sec", "pelican-system", &[]);
    for needle in [
        "runAsNonRoot: true",
        "readOnlyRootFilesystem: true",
        "allowPrivilegeEscalation: false",
        "drop: [\"ALL\"]",
        "type: RuntimeDefault",
        "replicas: 2",
        "- --leader-elect",
        "app.kubernetes.io/name: pelican",
        "app.kubernetes.io/instance: sec",
    ] {
        assert!(manifests.contains(needle), "{needle} missing from the rendered chart");
    }
    assert!(!manifests.contains("\"*\""), "no wildcard in RBAC");
}

/// Issue 66: OpenShift's restricted-v2 SCC assigns the user and group from the namespace's range and refuses a Pod
/// that fixes them. Where the API group security.openshift.io is served the chart sets neither (the rest of the
/// restricted profile stays); elsewhere the image's 65532, or none when the values say null.
#[test]
fn on_openshift_the_pod_leaves_its_user_and_group_to_the_scc() {
    let plain = render("sec", "pelican-system", &[]);
    assert!(plain.contains("runAsUser: 65532") && plain.contains("runAsGroup: 65532"), "{plain}");
    let args =
        ["template", "sec", CHART, "--namespace", "pelican-system", "--api-versions", "security.openshift.io/v1"];
    let (ok, openshift) = helm(&args);
    assert!(ok, "helm template failed: {openshift}");
    assert!(
        !openshift.contains("runAsUser") && !openshift.contains("runAsGroup"),
        "a fixed user on OpenShift: {openshift}"
    );
    for needle in ["runAsNonRoot: true", "allowPrivilegeEscalation: false", "drop: [\"ALL\"]", "type: RuntimeDefault"] {
        assert!(openshift.contains(needle), "{needle} missing on OpenShift");
    }
    let unset =
        render("sec", "pelican-system", &["podSecurityContext.runAsUser=null", "podSecurityContext.runAsGroup=null"]);
    assert!(!unset.contains("runAsUser") && !unset.contains("runAsGroup"), "null leaves them to the image: {unset}");
}

/// Issue 66: `metrics.secure` serves /metrics over TLS to authorized callers only: the flags and the mounted Secret,
/// the cluster-wide right to review tokens, a reader role to bind Prometheus to, and a ServiceMonitor that scrapes over
/// https with its token; without a Secret named it is refused, naming the value.
#[test]
fn secure_metrics_mount_their_certificate_review_tokens_and_scrape_over_https() {
    let secure = render(
        "sec",
        "pelican-system",
        &[
            "metrics.secure.enabled=true",
            "metrics.secure.tlsSecretName=metrics-cert",
            "metrics.serviceMonitor.enabled=true",
        ],
    );
    let docs = documents(&secure);
    let deployment = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    let pod = &deployment["spec"]["template"]["spec"];
    let args: Vec<&str> = pod["containers"][0]["args"].as_array().unwrap().iter().filter_map(|a| a.as_str()).collect();
    assert!(
        args.contains(&"--metrics-tls-dir=/etc/pelican/metrics-tls") && args.contains(&"--metrics-auth"),
        "{args:?}"
    );
    assert_eq!(pod["volumes"][0]["secret"]["secretName"], "metrics-cert");
    assert_eq!(pod["containers"][0]["volumeMounts"][0]["mountPath"], "/etc/pelican/metrics-tls");
    let cluster =
        docs.iter().find(|d| d["kind"] == "ClusterRole" && d["metadata"]["name"] == "sec-pelican-cluster").unwrap();
    let rules = cluster["rules"].to_string();
    assert!(
        rules.contains("tokenreviews") && rules.contains("subjectaccessreviews") && rules.contains("kube-system"),
        "{rules}"
    );
    let reader = docs.iter().find(|d| d["metadata"]["name"] == "sec-pelican-metrics-reader").expect("the reader role");
    assert_eq!(reader["rules"][0]["nonResourceURLs"][0], "/metrics");
    let monitor = docs.iter().find(|d| d["kind"] == "ServiceMonitor").unwrap();
    assert_eq!(monitor["spec"]["endpoints"][0]["scheme"], "https");
    assert_eq!(monitor["spec"]["endpoints"][0]["tlsConfig"]["ca"]["secret"]["name"], "metrics-cert");

    let plain = render("sec", "pelican-system", &[]);
    assert!(!plain.contains("metrics-auth") && !plain.contains("tokenreviews"), "off by default");
    let (ok, out) =
        helm(&["template", "sec", CHART, "--namespace", "pelican-system", "--set", "metrics.secure.enabled=true"]);
    assert!(!ok && out.contains("metrics.secure.tlsSecretName"), "{out}");
}

/// Installs the chart's RBAC for a release that watches `watched`, and returns a kubeconfig holding a token of the
/// chart's ServiceAccount.
fn install_rbac(release: &str, watched: &str, edit: impl Fn(String) -> String) -> (String, tempfile::TempDir) {
    install_rbac_with(release, watched, &[], edit)
}

/// The same, with values set.
fn install_rbac_with(
    release: &str,
    watched: &str,
    sets: &[&str],
    edit: impl Fn(String) -> String,
) -> (String, tempfile::TempDir) {
    let system = format!("{watched}-system");
    kubectl_ok(&["create", "namespace", &system]);
    let watch = format!("watchNamespace={watched}");
    let manifests = edit(render(release, &system, &[&[watch.as_str()], sets].concat()));
    let out = kubectl(&["apply", "-f", "-"], Some(&manifests));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let token = kubectl_ok(&["create", "token", &format!("{release}-pelican"), "-n", &system, "--duration=1h"]);
    let admin: serde_json::Value =
        serde_json::from_str(&kubectl_ok(&["config", "view", "--raw", "--minify", "-o", "json"])).unwrap();
    let cluster = &admin["clusters"][0]["cluster"];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    let config = serde_json::json!({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "bed", "cluster": cluster}],
        "users": [{"name": "sa", "user": {"token": token.trim()}}],
        "contexts": [{"name": "sa", "context": {"cluster": "bed", "user": "sa", "namespace": system}}],
    });
    std::fs::write(&path, config.to_string()).unwrap();
    (path.to_string_lossy().to_string(), dir)
}

fn operator_as_service_account(kubeconfig: &str, watched: &str) -> Operator {
    let lease_ns = format!("{watched}-system");
    Operator::launch(&["--namespace", watched, "--leader-elect", "--leader-election-namespace", &lease_ns], kubeconfig)
}

#[test]
fn operator_reconciles_end_to_end_with_exactly_the_charts_rbac() {
    let server = Server::start_with(Flavor::Redis, &["--requirepass", "rbac-pw"]);
    let ns = namespace("rbac");
    let (kubeconfig, _dir) = install_rbac("ok", &ns, |m| m);
    let operator = operator_as_service_account(&kubeconfig, &ns);
    let secret = "apiVersion: v1\nkind: Secret\nmetadata:\n  name: redis-auth\nstringData:\n  password: rbac-pw\n";
    let manifest = policy("p", &server.url(), "s", "g", "  deletionPolicy: Delete\n").replacen(
        "  stream:",
        "    passwordSecretRef: {name: redis-auth, key: password}\n  stream:",
        1,
    );
    assert!(kubectl_apply(&ns, &format!("{secret}---\n{manifest}")).0);
    let p = wait_condition(&ns, "p", "Ready", "True", "Reconciled");
    assert_eq!(p["metadata"]["finalizers"], serde_json::json!(["pelican.io/cleanup"]));
    wait_for("a Ready event", Duration::from_secs(10), || {
        if events(&ns, "Ready").is_empty() { Err("none".into()) } else { Ok(()) }
    });
    // A redrive: watched, its status written, deleted after its TTL, all with the chart's rules.
    let redrive = "apiVersion: pelican.io/v1alpha1\nkind: DeadLetterRedrive\nmetadata:\n  name: r\nspec:\n  policyRef: {name: p}\n  ttlSecondsAfterFinished: 1\n";
    assert!(kubectl_apply(&ns, redrive).0);
    wait_for("the finished redrive deleted by its TTL", Duration::from_secs(30), || {
        let seen = events(&ns, "Succeeded").iter().any(|e| e["involvedObject"]["kind"] == "DeadLetterRedrive");
        let gone = !kubectl(&["get", "dlr", "r", "-n", &ns], None).status.success();
        if seen && gone { Ok(()) } else { Err(format!("succeeded event {seen}, deleted {gone}")) }
    });
    kubectl_ok(&["delete", "cgp", "p", "-n", &ns, "--timeout=30s"]);
    let logs = operator.logs();
    assert!(!logs.contains("forbidden"), "the chart's RBAC is missing a permission:\n{logs}");
}

#[test]
fn a_missing_rbac_rule_fails_with_a_message_naming_it() {
    let server = Server::start(Flavor::Redis);
    let ns = namespace("norbac");
    // The chart without the status rule.
    let without_status = |m: String| {
        m.replace("  - apiGroups: [\"pelican.io\"]\n    resources: [\"consumergrouppolicies/status\"]\n    verbs: [\"patch\"]\n", "")
    };
    let (kubeconfig, _dir) = install_rbac("broken", &ns, without_status);
    let operator = operator_as_service_account(&kubeconfig, &ns);
    assert!(kubectl_apply(&ns, &policy("p", &server.url(), "s", "g", "")).0);
    let logs = wait_for("a forbidden error in the log", Duration::from_secs(30), || {
        let logs = operator.logs();
        if logs.contains("forbidden") { Ok(logs) } else { Err("not yet".into()) }
    });
    assert!(logs.contains("consumergrouppolicies/status") && logs.contains("cannot patch"), "{logs}");
    let status = get_policy(&ns, "p")["status"].clone();
    assert!(status.is_null(), "no status can be written without the rule: {status}\n{logs}");
}

/// Issue 57: with `rbac.consumerPods=false` the operator may not watch Pods. A policy that sets
/// `spec.consumers.pods` says so in its Ready condition, naming the right and the value to set; its passes go on.
#[test]
fn without_the_pod_rule_a_policy_naming_pods_says_which_right_and_value_it_lacks() {
    let server = Server::start(Flavor::Redis);
    let ns = namespace("nopods");
    let (kubeconfig, _dir) = install_rbac_with("nopods", &ns, &["rbac.consumerPods=false"], |m| m);
    let operator = operator_as_service_account(&kubeconfig, &ns);
    let pods = "  consumers:\n    pods:\n      matchLabels:\n        app: workers\n";
    assert!(kubectl_apply(&ns, &policy("p", &server.url(), "s", "g", pods)).0);
    let p = wait_condition(&ns, "p", "Ready", "False", "PodsForbidden");
    let conditions = p["status"]["conditions"].as_array().unwrap();
    let ready = conditions.iter().find(|c| c["type"] == "Ready").unwrap();
    let message = ready["message"].as_str().unwrap();
    println!("Ready False PodsForbidden: {message}");
    for needle in ["the consumer-pods job failed", "cannot list resource \"pods\"", "rbac.consumerPods: true"] {
        assert!(message.contains(needle), "{needle:?} missing from the Ready message: {message}");
    }
    // The condition can be written before the first pass reports: the passes go on, so a pass time follows.
    wait_for("a pass reported while Pods are forbidden", Duration::from_secs(30), || {
        let p = get_policy(&ns, "p");
        if p["status"]["lastPassTime"].is_string() { Ok(()) } else { Err(p["status"].to_string()) }
    });
    let logs = operator.logs();
    assert!(logs.contains("watching Pods for spec.consumers.pods failed"), "{logs}");
}

#[test]
fn sharding_renders_one_deployment_per_shard_with_its_own_lease_and_selector() {
    let manifests = render("sh", "pelican-system", &["sharding.shards={a,b}"]);
    let deployments: Vec<&str> = manifests.split("\n---").filter(|m| m.contains("kind: Deployment")).collect();
    assert_eq!(deployments.len(), 3, "{manifests}");
    for (name, selector, lease) in [
        (
            "sh-pelican-unlabelled\n",
            "--watch-label-selector=!sharding.pelican.io/key",
            "--leader-election-lease=pelican-leader\n",
        ),
        (
            "sh-pelican-a\n",
            "--watch-label-selector=sharding.pelican.io/key=a",
            "--leader-election-lease=pelican-leader-a",
        ),
        (
            "sh-pelican-b\n",
            "--watch-label-selector=sharding.pelican.io/key=b",
            "--leader-election-lease=pelican-leader-b",
        ),
    ] {
        let deployment = deployments.iter().find(|d| d.contains(&format!("name: {name}"))).expect(name);
        assert!(deployment.contains(selector) && deployment.contains(lease), "{deployment}");
        // The shard-down runbook finds it with `kubectl get deploy -l pelican.io/shard=<shard>` (issue 66.6).
        let manifest: serde_yaml::Value = serde_yaml::from_str(deployment).unwrap();
        let shard = name.trim_end().trim_start_matches("sh-pelican-");
        assert_eq!(manifest["metadata"]["labels"]["pelican.io/shard"].as_str(), Some(shard), "{deployment}");
    }
    let unsharded = render("one", "pelican-system", &[]);
    assert!(!unsharded.contains("--watch-label-selector") && !unsharded.contains("pelican.io/shard"));
    let (ok, out) = helm(&["template", "x", CHART, "--set", "sharding.shards={Bad_Name}"]);
    assert!(!ok && out.contains("/sharding/shards/0"), "{out}");
    let (ok, out) = helm(&["template", "x", CHART, "--set", "sharding.shards={unlabelled}"]);
    assert!(!ok && out.contains("/sharding/shards/0"), "the rest's own name: {out}");
}

#[test]
fn secret_namespaces_grant_secrets_there_only() {
    let manifests = render("sn", "pelican-system", &["rbac.secretNamespaces={team-a,team-b}"]);
    let documents: Vec<&str> = manifests.split("\n---").collect();
    let cluster_role = documents.iter().find(|d| d.contains("kind: ClusterRole\n")).unwrap();
    assert!(!cluster_role.contains("secrets"), "the ClusterRole grants no Secret:\n{cluster_role}");
    for namespace in ["team-a", "team-b"] {
        for kind in ["Role", "RoleBinding"] {
            let found = documents.iter().any(|d| {
                d.contains(&format!("kind: {kind}\n"))
                    && d.contains("name: sn-pelican-secrets\n")
                    && d.contains(&format!("namespace: {namespace}\n"))
            });
            assert!(found, "no {kind} sn-pelican-secrets in {namespace}:\n{manifests}");
        }
    }
    assert!(manifests.contains("- --secret-namespaces=team-a,team-b"), "{manifests}");
    // With watchNamespace the operator reads Secrets in that namespace only already: the two do not combine.
    let (ok, out) =
        helm(&["template", "x", CHART, "--set", "watchNamespace=apps", "--set", "rbac.secretNamespaces={team-a}"]);
    assert!(!ok && out.contains("rbac.secretNamespaces is for an operator watching all namespaces"), "{out}");
}

/// The rendered objects of a chart, as JSON.
/// Issue 66.6: the shard-down runbook selected Deployments by a label only their Pods carried ("No resources
/// found" for a shard scaled to 0). Every `kubectl ... -n pelican-system -l <selector>` of the runbooks (the
/// operator's; others select the user's consumers), with `<shard>` a shard of a
/// sharded release named `pelican` (the runbooks' name), finds a rendered Deployment where it gets Deployments, and
/// its Pods where it gets or reads Pods.
#[test]
fn the_runbooks_selectors_find_the_charts_deployments_and_pods() {
    let manifests = render("pelican", "pelican-system", &["sharding.shards={a}"]);
    let deployments: Vec<_> = documents(&manifests).into_iter().filter(|d| d["kind"] == "Deployment").collect();
    let runbooks = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/src/runbooks")).unwrap();
    let mut checked = 0;
    for runbook in runbooks {
        let text = std::fs::read_to_string(runbook.unwrap().path()).unwrap();
        for line in text
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with("kubectl ") && l.contains(" -l ") && l.contains("-n pelican-system"))
        {
            let selector =
                line.split(" -l ").nth(1).unwrap().split_whitespace().next().unwrap().replace("<shard>", "a");
            let selects = |labels: &serde_json::Value| {
                selector.split(',').all(|pair| pair.split_once('=').is_some_and(|(key, value)| labels[key] == value))
            };
            let deployment = deployments.iter().find(|d| selects(&d["spec"]["template"]["metadata"]["labels"]));
            assert!(deployment.is_some(), "`{line}` finds no Pod of the chart");
            if line.contains("deploy") {
                assert!(deployments.iter().any(|d| selects(&d["metadata"]["labels"])), "`{line}` finds no Deployment");
            }
            checked += 1;
        }
    }
    assert!(checked >= 3, "the runbooks' selectors: {checked}");
}

fn documents(manifests: &str) -> Vec<serde_json::Value> {
    manifests
        .split("\n---")
        .filter_map(|d| serde_yaml::from_str::<serde_json::Value>(d).ok())
        .filter(|d| d.is_object())
        .collect()
}

/// Issue 57: `list` and `watch` on Pods (for `spec.consumers.pods`) are the value `rbac.consumerPods`: granted by
/// default, bound cluster-wide only where the install watches every namespace (with `watchNamespace`, by the
/// RoleBinding in that namespace), and not granted at all when the value is off.
#[test]
fn the_pod_watch_is_a_value_bound_where_the_install_watches() {
    let pod_rules = |docs: &[serde_json::Value]| -> Vec<serde_json::Value> {
        let role = docs.iter().find(|d| d["kind"] == "ClusterRole" && d["metadata"]["name"] == "pw-pelican");
        let rules = role.expect("the operator's ClusterRole")["rules"].as_array().unwrap().clone();
        rules.into_iter().filter(|r| r["resources"].as_array().unwrap().iter().any(|r| r == "pods")).collect()
    };
    let bindings = |docs: &[serde_json::Value], kind: &str| -> Vec<serde_json::Value> {
        docs.iter().filter(|d| d["kind"] == kind && d["roleRef"]["name"] == "pw-pelican").cloned().collect()
    };

    let default = documents(&render("pw", "pelican-system", &[]));
    assert_eq!(
        pod_rules(&default),
        [serde_json::json!({"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]})]
    );
    assert_eq!(bindings(&default, "ClusterRoleBinding").len(), 1, "bound cluster-wide");

    let off = documents(&render("pw", "pelican-system", &["rbac.consumerPods=false"]));
    assert_eq!(pod_rules(&off), Vec::<serde_json::Value>::new(), "no Pod rule with rbac.consumerPods=false");
    assert_eq!(bindings(&off, "ClusterRoleBinding").len(), 1, "the other rules stay bound");

    let one = documents(&render("pw", "pelican-system", &["watchNamespace=apps"]));
    assert_eq!(pod_rules(&one).len(), 1);
    assert!(bindings(&one, "ClusterRoleBinding").is_empty(), "no ClusterRoleBinding with watchNamespace");
    let role_bindings = bindings(&one, "RoleBinding");
    assert_eq!(role_bindings.len(), 1, "{role_bindings:?}");
    assert_eq!(role_bindings[0]["metadata"]["namespace"], "apps");
    assert_eq!(role_bindings[0]["roleRef"]["kind"], "ClusterRole");

    let (ok, out) = helm(&["template", "x", CHART, "--set", "rbac.consumerPods=maybe"]);
    assert!(!ok && out.contains("consumerPods"), "the schema takes a boolean only: {out}");
}

#[test]
fn the_notes_point_the_first_policy_at_a_server_the_pod_can_reach() {
    let ns = namespace("chart-notes");
    let (ok, out) = helm(&["install", "notes", CHART, "--namespace", &ns, "--dry-run=client"]);
    assert!(ok, "{out}");
    let notes = out.split("NOTES:").nth(1).expect("helm prints the NOTES");
    assert!(!notes.contains("examples/notifications.yaml"), "{notes}");
    assert!(notes.contains("redis://redis.<namespace>.svc:6379/0"), "{notes}");
    // The policy in the NOTES is one the API server admits (with the namespace and Service filled in).
    let manifest: String = notes
        .lines()
        .skip_while(|l| !l.contains("apiVersion: pelican.io"))
        .take_while(|l| !l.trim_start().starts_with("EOF"))
        .map(|l| format!("{}\n", l.strip_prefix("  ").unwrap_or(l)))
        .collect();
    let manifest = manifest.replace("<namespace>", &ns);
    let applied = kubectl(&["apply", "--dry-run=server", "-n", &ns, "-f", "-"], Some(&manifest));
    assert!(applied.status.success(), "{manifest}\n{}", String::from_utf8_lossy(&applied.stderr));
}

/// Without leader election the operator still takes its Lease (a second copy exits instead of writing beside the
/// first), so the chart still grants Leases and names the Lease.
#[test]
fn without_leader_election_the_lease_is_still_granted_and_named() {
    let manifests = render("solo", "pelican-system", &["leaderElection.enabled=false"]);
    assert!(!manifests.contains("- --leader-elect\n"), "{manifests}");
    assert!(manifests.contains("- --leader-election-lease=pelican-leader\n"), "{manifests}");
    let role = manifests
        .split("\n---")
        .find(|m| m.contains("name: solo-pelican-leader-election") && m.contains("kind: Role\n"));
    let role = role.expect("the Lease Role");
    assert!(role.contains("resources: [\"leases\"]") && role.contains("\"delete\""), "{role}");
}

/// High availability by default: one PodDisruptionBudget per Deployment selecting exactly that Deployment's Pods
/// (none with one replica, where it would block every drain), replicas spread over nodes, and a warning in the NOTES
/// when more than one replica runs without leader election.
#[test]
fn each_deployment_gets_a_disruption_budget_and_spreads_over_nodes() {
    let documents = |manifests: &str| -> Vec<serde_json::Value> {
        manifests
            .split("\n---")
            .filter_map(|d| serde_yaml::from_str::<serde_json::Value>(d).ok())
            .filter(|d| d.is_object())
            .collect()
    };
    let of_kind = |docs: &[serde_json::Value], kind: &str| -> Vec<serde_json::Value> {
        docs.iter().filter(|d| d["kind"] == kind).cloned().collect()
    };
    for sets in [&[][..], &["sharding.shards={a,b}"][..]] {
        let docs = documents(&render("ha", "pelican-system", sets));
        let (deployments, budgets) = (of_kind(&docs, "Deployment"), of_kind(&docs, "PodDisruptionBudget"));
        assert_eq!(budgets.len(), deployments.len(), "{sets:?}: one budget per Deployment");
        for deployment in &deployments {
            let selector = &deployment["spec"]["selector"]["matchLabels"];
            let name = &deployment["metadata"]["name"];
            let budget = budgets.iter().find(|b| b["metadata"]["name"] == *name).expect("a budget named as it");
            assert_eq!(budget["spec"]["selector"]["matchLabels"], *selector, "{name}");
            assert_eq!(budget["spec"]["minAvailable"], 1);
            let spread = &deployment["spec"]["template"]["spec"]["topologySpreadConstraints"][0];
            assert_eq!(spread["topologyKey"], "kubernetes.io/hostname", "{name}");
            assert_eq!(spread["whenUnsatisfiable"], "ScheduleAnyway", "{name}");
            assert_eq!(spread["labelSelector"]["matchLabels"], *selector, "{name}");
        }
    }
    let single = documents(&render("one", "pelican-system", &["replicaCount=1"]));
    assert!(of_kind(&single, "PodDisruptionBudget").is_empty(), "a budget for one replica blocks every drain");
    let ns = namespace("chart-ha");
    let (ok, out) = helm(&[
        "install",
        "solo",
        CHART,
        "--namespace",
        &ns,
        "--dry-run=client",
        "--set",
        "leaderElection.enabled=false",
    ]);
    assert!(ok, "{out}");
    let notes = out.split("NOTES:").nth(1).expect("helm prints the NOTES");
    assert!(notes.contains("WARNING: leaderElection.enabled is false with replicaCount 2"), "{notes}");
    let (ok, out) = helm(&["install", "pair", CHART, "--namespace", &ns, "--dry-run=client"]);
    assert!(ok && !out.contains("WARNING"), "{out}");
}

/// The roles for people aggregate into Kubernetes' own: `edit` and `admin` may write policies, redrives and seeks,
/// `view` may read them and the servers; no aggregated role writes RedisServers. (That a user bound to `edit` gets
/// them needs the controller-manager's aggregation: tests/node.rs.)
#[test]
fn the_roles_for_people_aggregate_into_edit_and_view_without_servers() {
    let manifests = render("people", "pelican-system", &[]);
    let roles: Vec<serde_json::Value> = manifests
        .split("\n---")
        .filter_map(|d| serde_yaml::from_str::<serde_json::Value>(d).ok())
        .filter(|d| d["kind"] == "ClusterRole")
        .collect();
    let role = |name: &str| roles.iter().find(|r| r["metadata"]["name"] == name).unwrap_or_else(|| panic!("{name}"));
    let labels = |name: &str| role(name)["metadata"]["labels"].clone();
    assert_eq!(labels("people-pelican-edit")["rbac.authorization.k8s.io/aggregate-to-edit"], "true");
    assert_eq!(labels("people-pelican-edit")["rbac.authorization.k8s.io/aggregate-to-admin"], "true");
    assert_eq!(labels("people-pelican-view")["rbac.authorization.k8s.io/aggregate-to-view"], "true");
    for name in ["people-pelican-edit", "people-pelican-view"] {
        for rule in role(name)["rules"].as_array().unwrap() {
            let writes = rule["verbs"].as_array().unwrap().iter().any(|v| v != "get" && v != "list" && v != "watch");
            let servers =
                rule["resources"].as_array().unwrap().iter().any(|r| r.as_str().unwrap().starts_with("redisservers"));
            assert!(!(writes && servers), "{name} writes RedisServers: {rule}");
        }
    }
    let off = render("people", "pelican-system", &["rbac.aggregateToDefaultRoles=false"]);
    assert!(!off.contains("aggregate-to-edit"), "{off}");
}

/// Defect (issue 48.13): the upgrade as installing.md wrote it (`helm upgrade ... --reuse-values`) failed from the
/// 0.1 chart: the old release's values lack `topologySpread` (`nil pointer evaluating interface {}.enabled`), and
/// past that the 0.1 default image repository would have been kept. The test takes the command from the page as
/// written, installs the 0.1 chart from git history (`hack/previous-release`) with one value of the user's own, and
/// upgrades: the new defaults apply, the user's value stays. (tests/node.rs runs the same upgrade with the 0.1
/// operator's pods and a policy running through it.)
#[test]
fn the_documented_upgrade_from_the_previous_chart_keeps_the_users_values_and_takes_the_new_defaults() {
    let (_old, old_chart) = previous_chart();
    let ns = namespace("chart-upgrade");
    let release = format!("up{}", &ns[ns.len() - 8..]);
    let (ok, out) = helm(&["install", &release, old_chart.to_str().unwrap(), "-n", &ns, "--set", "logLevel=debug"]);
    assert!(ok, "{out}");

    let (documented, args) = documented_upgrade(&release, &ns);
    let (ok, out) = helm(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "`{documented}` failed from the 0.1 chart: {out}");

    let deployment = release_deployment(&release, &ns);
    let pod = &deployment["items"][0]["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(container["image"], format!("localhost/pelican:{version}"), "the new default image");
    let env = container["env"].as_array().unwrap();
    let log = env.iter().find(|e| e["name"] == "RUST_LOG").unwrap();
    assert_eq!(log["value"], "debug", "the user's logLevel kept");
    assert!(pod["topologySpreadConstraints"].is_array(), "the new default spread: {pod}");
    let (ok, out) = helm(&["uninstall", &release, "-n", &ns]);
    assert!(ok, "{out}");
}

/// The upgrade command of installing.md ("Upgrade"), as `helm` arguments for `release` in `namespace`.
fn documented_upgrade(release: &str, namespace: &str) -> (String, Vec<String>) {
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/src/installing.md")).unwrap();
    let documented =
        page.lines().map(str::trim).find(|l| l.starts_with("helm upgrade pelican charts/pelican")).unwrap();
    let args = documented
        .split_whitespace()
        .skip(1)
        .map(|word| match word {
            "pelican" => release.to_string(),
            "charts/pelican" => CHART.to_string(),
            "pelican-system" => namespace.to_string(),
            other => other.to_string(),
        })
        .collect();
    (documented.to_string(), args)
}

fn release_deployment(release: &str, namespace: &str) -> serde_json::Value {
    let selector = format!("app.kubernetes.io/instance={release}");
    serde_json::from_str(&kubectl_ok(&["get", "deploy", "-n", namespace, "-l", &selector, "-o", "json"])).unwrap()
}

/// Issue 66.3: an `image.tag` pinned at install is a value the user set, so `--reset-then-reuse-values` kept it and
/// the new chart ran the old binary with flags it does not know (it exits on them, the rollout never completes).
/// The upgrade is refused at render, before anything changes, with the value and both ways out named; the first of
/// them (`--set image.tag=`) then runs the chart's own version.
#[test]
fn the_documented_upgrade_over_a_pinned_tag_is_refused_naming_the_value_and_the_fix() {
    let (_old, old_chart) = previous_chart();
    let ns = namespace("chart-pinned");
    let release = format!("pin{}", &ns[ns.len() - 8..]);
    // The image pushed to a registry of one's own, both values pinned (installing.md, "Distributing").
    let pinned = ["--set", "image.repository=localhost/pelican", "--set", "image.tag=0.1.0"];
    let mut install = vec!["install", &release, old_chart.to_str().unwrap(), "-n", &ns];
    install.extend(pinned);
    let (ok, out) = helm(&install);
    assert!(ok, "{out}");
    let image = |deployment: serde_json::Value| {
        deployment["items"][0]["spec"]["template"]["spec"]["containers"][0]["image"].clone()
    };
    assert_eq!(image(release_deployment(&release, &ns)), "localhost/pelican:0.1.0");

    let (documented, mut args) = documented_upgrade(&release, &ns);
    let (ok, out) = helm(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let version = env!("CARGO_PKG_VERSION");
    assert!(!ok, "`{documented}` over a pinned 0.1.0 upgraded: {out}");
    assert!(out.contains("image.tag is \"0.1.0\""), "names the value: {out}");
    assert!(out.contains(&format!("add --set image.tag= to run {version}")), "names the fix: {out}");
    assert_eq!(image(release_deployment(&release, &ns)), "localhost/pelican:0.1.0", "nothing changed");

    args.extend(["--set".to_string(), "image.tag=".to_string()]);
    let (ok, out) = helm(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(ok, "the named fix failed: {out}");
    assert_eq!(image(release_deployment(&release, &ns)), format!("localhost/pelican:{version}"));
    let (ok, out) = helm(&["uninstall", &release, "-n", &ns]);
    assert!(ok, "{out}");
}

/// A tag other than the appVersion renders only when `image.tagFor` says it was set for this appVersion (a build of
/// the same version named otherwise); a `tagFor` left from another version is refused like no `tagFor` at all.
#[test]
fn a_tag_of_another_name_runs_only_when_tag_for_is_this_version() {
    let version = env!("CARGO_PKG_VERSION");
    let image = |manifests: &str| -> Vec<String> {
        documents(manifests)
            .iter()
            .filter(|d| d["kind"] == "Deployment")
            .map(|d| d["spec"]["template"]["spec"]["containers"][0]["image"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(image(&render("t", "s", &[])), [format!("localhost/pelican:{version}")]);
    assert_eq!(image(&render("t", "s", &[&format!("image.tag={version}")])), [format!("localhost/pelican:{version}")]);
    let ours = render("t", "s", &["image.tag=hotfix-1", &format!("image.tagFor={version}"), "sharding.shards={a}"]);
    assert_eq!(image(&ours), ["localhost/pelican:hotfix-1", "localhost/pelican:hotfix-1"]);
    for sets in [vec!["image.tag=hotfix-1".to_string()], vec!["image.tag=hotfix-1".into(), "image.tagFor=0.1.0".into()]]
    {
        let mut args = vec!["template", "t", CHART];
        for set in &sets {
            args.extend(["--set", set]);
        }
        let (ok, out) = helm(&args);
        assert!(!ok && out.contains("image.tag is \"hotfix-1\""), "{sets:?}: {out}");
        assert!(out.contains(&format!("--set image.tag=hotfix-1 --set image.tagFor={version}")), "{out}");
    }
}

/// The supported Kubernetes range is the chart's `kubeVersion` (1.29 and later: the CRDs' CEL validation rules with
/// `fieldPath`): an older cluster is refused before anything is applied, with the range named.
#[test]
fn a_cluster_older_than_the_crds_need_is_refused() {
    let (ok, out) = helm(&["template", "x", CHART, "--kube-version", "1.28.9"]);
    assert!(!ok && out.contains("chart requires kubeVersion: >=1.29.0-0"), "{out}");
    let (ok, out) = helm(&["template", "x", CHART, "--kube-version", "1.29.0"]);
    assert!(ok, "{out}");
}

/// Issue 51.2: turning sharding on or off failed in `helm upgrade` (a Deployment kept its name and gained
/// `pelican.io/shard` in its selector, which Kubernetes refuses to change). No Deployment or PodDisruptionBudget
/// keeps its name across the switch with another selector: the switch replaces them.
#[test]
fn switching_sharding_never_changes_the_selector_of_a_deployment_that_keeps_its_name() {
    let selectors = |sets: &[&str]| -> std::collections::BTreeMap<(String, String), String> {
        let manifests = render("sw", "pelican-system", sets);
        manifests
            .split("\n---")
            .filter_map(|m| serde_yaml::from_str::<serde_json::Value>(m).ok())
            .filter(|m| m["kind"] == "Deployment" || m["kind"] == "PodDisruptionBudget")
            .map(|m| {
                let key =
                    (m["kind"].as_str().unwrap().to_string(), m["metadata"]["name"].as_str().unwrap().to_string());
                (key, m["spec"]["selector"].to_string())
            })
            .collect()
    };
    let off = selectors(&[]);
    let on = selectors(&["sharding.shards={a,b}"]);
    assert_eq!(on.len(), 6, "{on:?}");
    for (object, selector) in &off {
        if let Some(other) = on.get(object) {
            assert_eq!(selector, other, "{object:?} keeps its name and changes its selector");
        }
    }
    assert!(off.keys().all(|object| !on.contains_key(object)), "{off:?} {on:?}");
}

/// IPv6-only and dual-stack clusters (issue 51.6): `listenAddress: "::"` binds every listener to `[::]`, which
/// answers on IPv6 and, where the node allows mapped addresses (Linux's default), on IPv4 too; the default stays
/// IPv4's `0.0.0.0`. The rendered flags, then the operator binary listening as the chart tells it to.
#[test]
fn listeners_bind_the_listen_address_and_ipv6_in_brackets() {
    let scaler = "autoscaling.externalScaler.enabled=true";
    let v4 = render("x", "pelican-system", &[scaler]);
    for flag in ["--metrics-addr=0.0.0.0:8080", "--health-addr=0.0.0.0:8081", "--external-scaler-addr=0.0.0.0:9090"] {
        assert!(v4.contains(flag), "{flag} missing:\n{v4}");
    }
    let v6 = render("x", "pelican-system", &[scaler, "listenAddress=::"]);
    for flag in ["--metrics-addr=[::]:8080", "--health-addr=[::]:8081", "--external-scaler-addr=[::]:9090"] {
        assert!(v6.contains(flag), "{flag} missing:\n{v6}");
    }
    let ns = namespace("listen-v6");
    let operator = Operator::launch_listening("[::]", &["--namespace", &ns], bed().kubeconfig());
    for host in ["[::1]", "127.0.0.1"] {
        let url = format!("http://{host}:{}/metrics", operator.metrics_port);
        wait_for(&format!("{url} to answer"), Duration::from_secs(30), || {
            let out = std::process::Command::new("curl").args(["-sf", "--max-time", "2", &url]).output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            if text.contains("pelican_passes_total") { Ok(()) } else { Err(format!("{:?}", out.status)) }
        });
    }
}

/// Defect (issue 48.15): with leader election off and one replica a rolling update never completed: the new pod
/// found the Lease held by the old one and exited, and the old one was never replaced. The Deployment is
/// `Recreate` then; with election on it rolls (the old leader lets go of the Lease on SIGTERM).
#[test]
fn without_leader_election_the_deployment_is_recreated_not_rolled() {
    let off = render("x", "pelican-system", &["leaderElection.enabled=false", "replicaCount=1"]);
    assert!(off.contains("strategy:\n    type: Recreate"), "{off}");
    let on = render("x", "pelican-system", &[]);
    assert!(!on.contains("type: Recreate"), "{on}");
}
