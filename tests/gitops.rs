//! How GitOps tools and Prometheus read Pelican: Argo CD's health script under Lua 5.1 and kstatus (Flux, kpt) on
//! real objects from the bed, `promtool check metrics` on the real endpoint, and an apply-twice round trip.

#[macro_use]
mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::Value;

const ARGOCD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/gitops/argocd");

/// A JSON value as a Lua table literal, the shape Argo CD hands to health scripts.
fn to_lua(value: &Value) -> String {
    match value {
        Value::Null => "nil".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => format!("{s:?}"),
        Value::Array(items) => format!("{{{}}}", items.iter().map(to_lua).collect::<Vec<_>>().join(", ")),
        Value::Object(map) => {
            let fields: Vec<String> = map.iter().map(|(k, v)| format!("[{k:?}] = {}", to_lua(v))).collect();
            format!("{{{}}}", fields.join(", "))
        }
    }
}

/// (status, message) from health.lua for a fixture file.
fn argocd_health(fixture: &Path) -> (String, String) {
    run_health("health.lua", fixture)
}

/// (status, message) from one of the health scripts for a fixture file.
fn run_health(script: &str, fixture: &Path) -> (String, String) {
    let out = Command::new("lua5.1")
        .arg(format!("{ARGOCD}/run_health.lua"))
        .arg(format!("{ARGOCD}/{script}"))
        .arg(fixture)
        .output()
        .expect("lua5.1 must be installed: scripts/testenv up installs it");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let (status, message) = text.trim_end().split_once('\t').unwrap();
    (status.to_string(), message.to_string())
}

fn kstatus(object: &Value) -> String {
    let mut child = Command::new(bed().var("PELICAN_KSTATUS"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(object.to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap().split('\t').next().unwrap().to_string()
}

/// Live objects of the bed in each state the operator reports.
fn objects_in_every_state() -> Vec<(&'static str, Value)> {
    let server = Server::start(Flavor::Redis);
    let ns = namespace("gitops");
    let _operator = Operator::start(&ns);
    let with_secret = policy("stalled", &server.url(), "b", "g", "").replacen(
        "  stream:",
        "    passwordSecretRef: {name: missing, key: password}\n  stream:",
        1,
    );
    let manifests = [
        policy("ready", &server.url(), "a", "g", ""),
        with_secret,
        policy("retrying", "redis://127.0.0.1:1/0", "c", "g", ""),
    ];
    assert!(kubectl_apply(&ns, &manifests.join("---\n")).0);
    let ready = wait_condition(&ns, "ready", "Ready", "True", "Reconciled");
    let stalled = wait_condition(&ns, "stalled", "Stalled", "True", "SecretNotFound");
    let retrying = wait_condition(&ns, "retrying", "Reconciling", "True", "RedisUnavailable");
    vec![("ready", ready), ("stalled", stalled), ("retrying", retrying)]
}

#[test]
fn argocd_health_and_kstatus_read_real_objects_right() {
    let objects = objects_in_every_state();
    let dir = tempfile::tempdir().unwrap();
    let expected =
        [("ready", "Healthy", "Current"), ("stalled", "Degraded", "Failed"), ("retrying", "Progressing", "InProgress")];
    for ((name, object), (expected_name, health, kstatus_status)) in objects.iter().zip(expected) {
        assert_eq!(*name, expected_name);
        let fixture = dir.path().join(format!("{name}.lua"));
        std::fs::write(&fixture, format!("return {}\n", to_lua(object))).unwrap();
        if std::env::var_os("PELICAN_UPDATE_FIXTURES").is_some() {
            std::fs::write(format!("{ARGOCD}/testdata/{name}.lua"), format!("return {}\n", to_lua(object))).unwrap();
        }
        let (status, message) = argocd_health(&fixture);
        assert_eq!(status, health, "{name}: {message}");
        assert_eq!(kstatus(object), kstatus_status, "kstatus of {name}");
    }
    let (_, message) = argocd_health(&dir.path().join("stalled.lua"));
    assert!(message.starts_with("SecretNotFound: "), "{message}");
}

/// DeadLetterRedrives in each phase, live from the bed, read by Argo CD's script and by kstatus.
#[test]
fn redrive_health_and_kstatus_read_real_redrives_right() {
    let server = Server::start(Flavor::Redis);
    let (ns, _operator) = ready_policy("gitops-dlr", &policy("p", &server.url(), "s", "g", ""), "p");
    let mut conn = server.conn();
    for n in 0..1000 {
        let _: String = redis::cmd("XADD").arg("s:dlq").arg("*").arg("n").arg(n).query(&mut conn).unwrap();
    }
    let redrive = |name: &str, extra: &str| {
        format!(
            "apiVersion: pelican.io/v1alpha1\nkind: DeadLetterRedrive\nmetadata:\n  name: {name}\nspec:\n  policyRef: {{name: p}}\n{extra}"
        )
    };
    let phase = |name: &str, phase: &str| {
        wait_for(&format!("{name} {phase}"), Duration::from_secs(30), || {
            let object: Value =
                serde_json::from_str(&kubectl_ok(&["get", "dlr", name, "-n", &ns, "-o", "json"])).unwrap();
            if object["status"]["phase"] == phase { Ok(object) } else { Err(object["status"].to_string()) }
        })
    };
    assert!(kubectl_apply(&ns, &redrive("counted", "  dryRun: true\n")).0);
    let succeeded = phase("counted", "Succeeded");
    assert!(kubectl_apply(&ns, &redrive("broken", "  target: \"s:dlq\"\n")).0);
    let failed = phase("broken", "Failed");
    assert!(kubectl_apply(&ns, &redrive("paused", "  suspend: true\n")).0);
    let suspended = phase("paused", "Suspended");
    assert!(kubectl_apply(&ns, &redrive("slow", "  ratePerSecond: 10\n")).0);
    let running = phase("slow", "Running");
    assert!(kubectl_apply(&ns, &redrive("next", "")).0);
    let pending = phase("next", "Pending");
    let dir = tempfile::tempdir().unwrap();
    for (object, health, kstatus_status) in [
        (&succeeded, "Healthy", "Current"),
        (&failed, "Degraded", "Failed"),
        (&suspended, "Suspended", "Current"),
        (&running, "Progressing", "InProgress"),
        (&pending, "Progressing", "InProgress"),
    ] {
        let name = object["metadata"]["name"].as_str().unwrap();
        let fixture = dir.path().join(format!("{name}.lua"));
        std::fs::write(&fixture, format!("return {}\n", to_lua(object))).unwrap();
        let (status, message) = run_health("redrive_health.lua", &fixture);
        println!("{name}: Argo CD {status} ({message}); kstatus {}", kstatus(object));
        assert_eq!(status, health, "{name}: {message}");
        assert_eq!(kstatus(object), kstatus_status, "kstatus of {name}");
    }
    let (_, message) = run_health("redrive_health.lua", &dir.path().join("broken.lua"));
    assert!(message.starts_with("InvalidSpec: "), "{message}");
}

/// The ConfigMap example carries the very scripts the tests run.
#[test]
fn the_argocd_example_embeds_the_tested_scripts() {
    let example =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/gitops/argocd-cm-health.yaml")).unwrap();
    let config: Value = serde_yaml::from_str(&example).unwrap();
    for (key, script) in [
        ("resource.customizations.health.pelican.io_ConsumerGroupPolicy", "health.lua"),
        ("resource.customizations.health.pelican.io_DeadLetterRedrive", "redrive_health.lua"),
        ("resource.customizations.health.pelican.io_RedisServer", "health.lua"),
        ("resource.customizations.health.pelican.io_GroupSeek", "redrive_health.lua"),
    ] {
        let file = std::fs::read_to_string(format!("{ARGOCD}/{script}")).unwrap();
        // The file starts with a comment header the ConfigMap leaves out.
        let code: String = file.lines().skip_while(|l| l.starts_with("--")).collect::<Vec<_>>().join("\n");
        let embedded = config["data"][key].as_str().unwrap_or_else(|| panic!("{key} missing"));
        assert_eq!(embedded.trim_end(), code.trim_end(), "{key} differs from gitops/argocd/{script}");
    }
}

#[test]
fn argocd_health_of_the_committed_fixtures() {
    for (name, expected) in [
        ("ready", "Healthy"),
        ("stalled", "Degraded"),
        ("retrying", "Progressing"),
        ("new", "Progressing"),
        ("outdated", "Progressing"),
    ] {
        let (status, message) = argocd_health(Path::new(&format!("{ARGOCD}/testdata/{name}.lua")));
        assert_eq!(status, expected, "{name}: {message}");
    }
}

#[test]
fn metrics_pass_promtool_and_agree_with_status() {
    let server = Server::start(Flavor::Valkey);
    let (ns, operator) = ready_policy("promtool", &policy("m", &server.url(), "s", "g", ""), "m");
    let mut conn = server.conn();
    for _ in 0..3 {
        let _: String = redis::cmd("XADD").arg("s").arg("*").arg("k").arg("v").query(&mut conn).unwrap();
    }
    read_new(&mut conn, "s", "g", "c", 2);
    let status = wait_for("status with 2 pending", Duration::from_secs(20), || {
        let p = get_policy(&ns, "m");
        if p["status"]["pending"] == 2 { Ok(p["status"].clone()) } else { Err(p["status"].to_string()) }
    });
    let metrics = wait_for("metrics with 2 pending", Duration::from_secs(10), || {
        let m = operator.metrics();
        if m.contains("pelican_group_pending{") && m.contains("} 2\n") { Ok(m) } else { Err(m) }
    });
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool must be installed: scripts/testenv up installs Debian's prometheus");
    use std::io::Write;
    promtool.stdin.take().unwrap().write_all(metrics.as_bytes()).unwrap();
    let out = promtool.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let labels = format!(r#"namespace="{ns}",policy="m",stream="s",group="g""#);
    for (series, field) in [
        ("pelican_group_pending", "pending"),
        ("pelican_stream_length", "streamLength"),
        ("pelican_group_lag", "lag"),
        ("pelican_group_consumers", "consumers"),
    ] {
        let line = format!("{series}{{{labels}}} {}", status[field]);
        assert!(metrics.lines().any(|l| l == line), "missing {line}\n{metrics}");
    }
}

#[test]
fn applying_the_same_manifests_twice_changes_nothing() {
    let server = Server::start(Flavor::Redis);
    let ns = namespace("roundtrip");
    let _operator = Operator::start(&ns);
    let manifest = policy("p", &server.url(), "s", "g", "");
    let apply =
        || kubectl(&["apply", "--server-side", "--field-manager=argocd", "-n", &ns, "-f", "-"], Some(&manifest));
    assert!(apply().status.success());
    wait_condition(&ns, "p", "Ready", "True", "Reconciled");
    let before = get_policy(&ns, "p");
    assert!(apply().status.success());
    let diff = kubectl(&["diff", "--server-side", "--field-manager=argocd", "-n", &ns, "-f", "-"], Some(&manifest));
    assert_eq!(diff.status.code(), Some(0), "perpetual diff:\n{}", String::from_utf8_lossy(&diff.stdout));
    let after = get_policy(&ns, "p");
    assert_eq!(before["metadata"]["generation"], after["metadata"]["generation"], "the spec never changes");

    // The operator's field manager owns the status and nothing of the spec.
    let shown = kubectl_ok(&["get", "cgp", "p", "-n", &ns, "-o", "json", "--show-managed-fields"]);
    let shown: Value = serde_json::from_str(&shown).unwrap();
    let managers = shown["metadata"]["managedFields"].as_array().unwrap();
    assert!(managers.iter().any(|m| m["manager"] == "pelican"), "{managers:?}");
    for entry in managers {
        let fields = entry["fieldsV1"].to_string();
        if entry["manager"] != "argocd" {
            assert!(!fields.contains("\"f:spec\""), "{} manages spec fields: {fields}", entry["manager"]);
        }
        if entry["manager"] == "pelican" {
            assert_eq!(entry["subresource"], "status", "{entry}");
        }
    }
}

/// `RedisServer`s in each state, live from the bed, read by Argo CD's `health.lua` (the policy's script: a server has
/// the same three conditions) and by kstatus.
#[test]
fn server_health_and_kstatus_read_real_servers_right() {
    let server = Server::start(Flavor::Redis);
    let ns = namespace("gitops-rs");
    let selector = format!("pelican-test={ns}");
    let _operator = Operator::launch(&["--watch-label-selector", &selector], bed().kubeconfig());
    let manifest = |name: &str, url: &str, extra: &str| {
        format!(
            "apiVersion: pelican.io/v1alpha1\nkind: RedisServer\nmetadata:\n  name: {name}\n  labels: {{pelican-test: {ns}}}\nspec:\n  url: {url}\n{extra}"
        )
    };
    let manifests = [
        manifest("ready", &server.url(), ""),
        manifest("stalled", &server.url(), "  passwordSecretRef: {name: missing, key: password}\n"),
        manifest("retrying", &format!("redis://127.0.0.1:{}/0", free_port()), ""),
    ];
    assert!(kubectl_apply(&ns, &manifests.join("---\n")).0);
    let dir = tempfile::tempdir().unwrap();
    for (name, condition, reason, health, kstatus_status) in [
        ("ready", "Ready", "Reconciled", "Healthy", "Current"),
        ("stalled", "Stalled", "SecretNotFound", "Degraded", "Failed"),
        ("retrying", "Reconciling", "RedisUnavailable", "Progressing", "InProgress"),
    ] {
        let object = wait_for(&format!("{name}: {condition} {reason}"), Duration::from_secs(60), || {
            let object: Value =
                serde_json::from_str(&kubectl_ok(&["get", "redisservers", name, "-n", &ns, "-o", "json"])).unwrap();
            let conditions = object["status"]["conditions"].as_array().cloned().unwrap_or_default();
            let found =
                conditions.iter().any(|c| c["type"] == condition && c["status"] == "True" && c["reason"] == reason);
            if found { Ok(object) } else { Err(object["status"].to_string()) }
        });
        let fixture = dir.path().join(format!("{name}.lua"));
        std::fs::write(&fixture, format!("return {}\n", to_lua(&object))).unwrap();
        let (status, message) = argocd_health(&fixture);
        println!("RedisServer {name}: Argo CD {status} ({message}); kstatus {}", kstatus(&object));
        assert_eq!(status, health, "{name}: {message}");
        assert_eq!(kstatus(&object), kstatus_status, "kstatus of {name}");
    }
}

/// Issue 66.1: the Flux example's policies waited for ever: their Kustomization `dependsOn` the HelmRelease, and Flux
/// resolves `dependsOn` among Kustomizations only. Every `dependsOn` of a Kustomization in the example names a
/// Kustomization the example defines (in its namespace, when none is given).
#[test]
fn the_flux_example_depends_only_on_kustomizations_it_defines() {
    use serde::Deserialize;
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/gitops/flux.yaml")).unwrap();
    let documents: Vec<serde_yaml::Value> =
        serde_yaml::Deserializer::from_str(&text).map(|d| serde_yaml::Value::deserialize(d).unwrap()).collect();
    let kustomizations: Vec<&serde_yaml::Value> = documents.iter().filter(|d| d["kind"] == "Kustomization").collect();
    let defined: Vec<(String, String)> = kustomizations
        .iter()
        .map(|k| (k["metadata"]["namespace"].as_str().unwrap().into(), k["metadata"]["name"].as_str().unwrap().into()))
        .collect();
    let mut dependencies = 0;
    for kustomization in &kustomizations {
        let namespace = kustomization["metadata"]["namespace"].as_str().unwrap();
        for dependency in kustomization["spec"]["dependsOn"].as_sequence().into_iter().flatten() {
            let wanted = (
                dependency["namespace"].as_str().unwrap_or(namespace).to_string(),
                dependency["name"].as_str().unwrap().to_string(),
            );
            assert!(defined.contains(&wanted), "dependsOn {wanted:?}, not a Kustomization of the example: {defined:?}");
            dependencies += 1;
        }
    }
    assert!(dependencies >= 1, "the policies wait for the operator");
}
