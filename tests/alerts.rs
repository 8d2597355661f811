//! The chart's alerts and dashboard: `promtool test rules` on series that must fire and series that must not, and
//! every series the rules and the dashboard query checked against what a live operator exports.

#[macro_use]
mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::Value;

const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/pelican");

/// One template of the chart rendered with alerts and dashboard on (release `pelican`, so the job is
/// `pelican-metrics`) and one shard, `shard1` (so that every alert renders), as JSON.
fn render(template: &str) -> Value {
    render_with(template, &["sharding.shards={shard1}"])
}

/// The same with the values `sets` instead of the shard.
fn render_with(template: &str, sets: &[&str]) -> Value {
    let mut helm = Command::new(bed().var("PELICAN_HELM"));
    helm.args(["template", "pelican", CHART, "--set", "alerts.enabled=true", "--set", "dashboard.enabled=true"]);
    for set in sets {
        helm.args(["--set", set]);
    }
    let out = helm.args(["--show-only", template]).output().expect("run helm");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_yaml::from_slice(&out.stdout).unwrap()
}

fn rule_groups() -> Value {
    render("templates/prometheusrule.yaml")["spec"].clone()
}

fn dashboard() -> Value {
    let config = render("templates/dashboard.yaml");
    serde_json::from_str(config["data"]["pelican.json"].as_str().unwrap()).unwrap()
}

/// Series that must fire each alert, next to series that must not (healthy, or not for long enough), one minute
/// per sample.
const TESTS: &str = r#"
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # 700 s and growing: past 600 s for more than 5 minutes.
      - series: 'pelican_group_oldest_pending_age_seconds{namespace="apps",policy="stuck",stream="s",group="g",job="pelican-metrics"}'
        values: '700+60x20'
      - series: 'pelican_group_oldest_pending_age_seconds{namespace="apps",policy="fine",stream="s",group="g",job="pelican-metrics"}'
        values: '30x20'
      # Over the threshold for 3 minutes only.
      - series: 'pelican_group_oldest_pending_age_seconds{namespace="apps",policy="blip",stream="s",group="g",job="pelican-metrics"}'
        values: '30x5 900x2 30x13'
      - series: 'pelican_dead_lettered_total{namespace="apps",policy="poison",stream="s",group="g",job="pelican-metrics"}'
        values: '0x5 1 2 3x13'
      - series: 'pelican_dead_lettered_total{namespace="apps",policy="fine",stream="s",group="g",job="pelican-metrics"}'
        values: '5x20'
      - series: 'pelican_policy_ready{namespace="apps",policy="broken",stream="s",group="g",job="pelican-metrics"}'
        values: '0x20'
      - series: 'pelican_policy_ready{namespace="apps",policy="flaky",stream="s",group="g",job="pelican-metrics"}'
        values: '1x10 0x10'
      - series: 'pelican_policy_ready{namespace="apps",policy="fine",stream="s",group="g",job="pelican-metrics"}'
        values: '1x20'
      - series: 'pelican_redis_server_ready{namespace="platform",server="shared",job="pelican-metrics"}'
        values: '1x5 0x15'
      - series: 'pelican_redis_server_ready{namespace="platform",server="blip",job="pelican-metrics"}'
        values: '1x5 0x3 1x12'
      - series: 'pelican_group_backlog{namespace="apps",policy="full",stream="s",group="g",job="pelican-metrics"}'
        values: '950x20'
      - series: 'pelican_group_backlog_max_length{namespace="apps",policy="full",stream="s",group="g",job="pelican-metrics"}'
        values: '1000x20'
      - series: 'pelican_group_backlog{namespace="apps",policy="roomy",stream="s",group="g",job="pelican-metrics"}'
        values: '100x20'
      - series: 'pelican_group_backlog_max_length{namespace="apps",policy="roomy",stream="s",group="g",job="pelican-metrics"}'
        values: '1000x20'
      - series: 'pelican_publish_rejected_total{namespace="apps",policy="full",stream="s",group="g",job="pelican-metrics"}'
        values: '0x15 4 9 9x3'
      - series: 'pelican_publish_rejected_total{namespace="apps",policy="roomy",stream="s",group="g",job="pelican-metrics"}'
        values: '0x20'
      # Consuming verdicts: one that holds, and a FallingBehind that lasts one minute only.
      - series: 'pelican_group_consuming{namespace="apps",policy="stopped",stream="s",group="g",reason="NotProgressing",job="pelican-metrics"}'
        values: '1x20'
      - series: 'pelican_group_consuming{namespace="apps",policy="orphan",stream="s",group="g",reason="NoConsumers",job="pelican-metrics"}'
        values: '1x20'
      - series: 'pelican_group_consuming{namespace="apps",policy="slow",stream="s",group="g",reason="FallingBehind",job="pelican-metrics"}'
        values: '1x20'
      - series: 'pelican_group_consuming{namespace="apps",policy="spike",stream="s",group="g",reason="FallingBehind",job="pelican-metrics"}'
        values: '_x3 1 1 stale'
      - series: 'pelican_group_consuming{namespace="apps",policy="fine",stream="s",group="g",reason="Progressing",job="pelican-metrics"}'
        values: '1x20'
      - series: 'pelican_group_lag_seconds{namespace="apps",policy="behind",stream="s",group="g",job="pelican-metrics"}'
        values: '500+60x20'
      - series: 'pelican_group_lag_seconds{namespace="apps",policy="fine",stream="s",group="g",job="pelican-metrics"}'
        values: '2x20'
      # Both replicas down from minute 8 on; replica b never leads, a leads until it goes down.
      - series: 'up{job="pelican-metrics",instance="a"}'
        values: '1x7 0x13'
      - series: 'up{job="pelican-metrics",instance="b"}'
        values: '1x7 0x13'
      - series: 'pelican_leader{job="pelican-metrics",instance="a",lease="pelican-leader"}'
        values: '1x7'
      - series: 'pelican_leader{job="pelican-metrics",instance="b",lease="pelican-leader"}'
        values: '0x7'
      # A second shard's Lease that nobody holds although both replicas of that shard are up.
      - series: 'pelican_leader{job="pelican-metrics",instance="d",lease="pelican-leader-shard1"}'
        values: '0x20'
      - series: 'pelican_leader{job="pelican-metrics",instance="e",lease="pelican-leader-shard1"}'
        values: '0x20'
      # Another install (another job) that is fine must not matter.
      - series: 'up{job="other-pelican-metrics",instance="c"}'
        values: '1x20'
    alert_rule_test:
      - eval_time: 12m
        alertname: PelicanOldestPendingTooOld
        exp_alerts:
          - exp_labels: {severity: warning, namespace: apps, policy: stuck, stream: s, group: g}
            exp_annotations:
              summary: 'apps/stuck: a message has waited 23m 40s unacknowledged'
              description: 'The oldest pending entry of group g on stream s is older than the threshold: consumers are stuck or too slow. kubectl pelican status stuck -n apps shows the oldest entries and their consumers.'
              runbook_url: 'http://localhost:3000/runbooks/oldest-pending-too-old.html'
      - eval_time: 3m
        alertname: PelicanOldestPendingTooOld
        exp_alerts: []
      - eval_time: 10m
        alertname: PelicanDeadLettersGrowing
        exp_alerts:
          - exp_labels: {severity: warning, namespace: apps, policy: poison, stream: s, group: g}
            exp_annotations:
              summary: 'apps/poison: 3 messages dead-lettered recently'
              description: 'Messages of group g reached their delivery cap and were moved to the dead-letter stream. kubectl pelican dlq poison -n apps groups them by reason; once fixed, kubectl pelican redrive moves them back.'
              runbook_url: 'http://localhost:3000/runbooks/dead-letters-growing.html'
      - eval_time: 4m
        alertname: PelicanDeadLettersGrowing
        exp_alerts: []
      - eval_time: 12m
        alertname: PelicanPolicyNotReady
        exp_alerts:
          - exp_labels: {severity: warning, namespace: apps, policy: broken}
            exp_annotations:
              summary: 'ConsumerGroupPolicy apps/broken is not Ready'
              description: 'kubectl describe cgp broken -n apps shows the reason (Secret missing, server unreachable, conflict ...).'
              runbook_url: 'http://localhost:3000/runbooks/policy-not-ready.html'
      - eval_time: 17m
        alertname: PelicanRedisServerNotReady
        exp_alerts:
          - exp_labels: {severity: critical, namespace: platform, server: shared}
            exp_annotations:
              summary: 'RedisServer platform/shared is not Ready'
              description: 'It does not answer with the credentials of its spec, so no policy that names it is served. kubectl describe redisserver shared -n platform shows the reason.'
              runbook_url: 'http://localhost:3000/runbooks/redis-server-not-ready.html'
      - eval_time: 12m
        alertname: PelicanRedisServerNotReady
        exp_alerts: []
      - eval_time: 8m
        alertname: PelicanBacklogNearlyFull
        exp_alerts:
          - exp_labels: {severity: warning, namespace: apps, policy: full, stream: s, group: g}
            exp_annotations:
              summary: 'apps/full: backlog at 95% of spec.backlog.maxLength'
              description: 'Group g is falling behind its producers; bounded publishes will be refused when the backlog is full.'
              runbook_url: 'http://localhost:3000/runbooks/backlog-nearly-full.html'
      - eval_time: 17m
        alertname: PelicanPublishesRefused
        exp_alerts:
          - exp_labels: {severity: critical, namespace: apps, policy: full, stream: s, group: g}
            exp_annotations:
              summary: 'apps/full: 9 publishes refused (backlog full)'
              description: 'Producers of stream s are being refused because group g reached spec.backlog.maxLength.'
              runbook_url: 'http://localhost:3000/runbooks/publishes-refused.html'
      - eval_time: 14m
        alertname: PelicanPublishesRefused
        exp_alerts: []
      - eval_time: 6m
        alertname: PelicanGroupNotProgressing
        exp_alerts:
          - exp_labels: {severity: critical, namespace: apps, policy: stopped, stream: s, group: g}
            exp_annotations:
              summary: 'apps/stopped: consumers of group g read and acknowledge nothing'
              description: 'Group g on stream s has a backlog and consumers, and none of them read or acknowledged anything over the last window. kubectl pelican status stopped -n apps shows who holds the oldest entries.'
              runbook_url: 'http://localhost:3000/runbooks/group-not-progressing.html'
      - eval_time: 1m
        alertname: PelicanGroupNotProgressing
        exp_alerts: []
      - eval_time: 6m
        alertname: PelicanGroupNoConsumers
        exp_alerts:
          - exp_labels: {severity: warning, namespace: apps, policy: orphan, stream: s, group: g}
            exp_annotations:
              summary: 'apps/orphan: group g has a backlog and no consumer'
              description: 'Entries of stream s wait for group g, which has no consumer to read them.'
              runbook_url: 'http://localhost:3000/runbooks/group-no-consumers.html'
      - eval_time: 6m
        alertname: PelicanGroupFallingBehind
        exp_alerts:
          - exp_labels: {severity: warning, namespace: apps, policy: slow, stream: s, group: g}
            exp_annotations:
              summary: 'apps/slow: group g falls behind its producers'
              description: 'The backlog of group g on stream s grew at every sample of the last window while its consumers read: they are slower than the producers.'
              runbook_url: 'http://localhost:3000/runbooks/group-falling-behind.html'
      - eval_time: 8m
        alertname: PelicanGroupLagTooOld
        exp_alerts:
          - exp_labels: {severity: warning, namespace: apps, policy: behind, stream: s, group: g}
            exp_annotations:
              summary: 'apps/behind: the oldest unread entry has waited 16m 20s'
              description: 'Group g has not read entries of stream s that are older than the threshold.'
              runbook_url: 'http://localhost:3000/runbooks/group-lag-too-old.html'
      - eval_time: 4m
        alertname: PelicanGroupLagTooOld
        exp_alerts: []
      - eval_time: 7m
        alertname: PelicanOperatorDown
        exp_alerts: []
      - eval_time: 14m
        alertname: PelicanOperatorDown
        exp_alerts:
          - exp_labels: {severity: critical}
            exp_annotations:
              summary: 'No Pelican operator replica is up (job pelican-metrics)'
              description: 'No replica answers its metrics scrape: reclaim, dead-letter and retention jobs are not running.'
              runbook_url: 'http://localhost:3000/runbooks/operator-down.html'
      # Every replica down is PelicanOperatorDown's, not one more alert per shard.
      - eval_time: 14m
        alertname: PelicanShardDown
        exp_alerts: []
      - eval_time: 4m
        alertname: PelicanNotLeading
        exp_alerts: []
      - eval_time: 7m
        alertname: PelicanNotLeading
        exp_alerts:
          - exp_labels: {severity: critical, lease: pelican-leader-shard1}
            exp_annotations:
              summary: 'No Pelican replica holds the leader Lease pelican-leader-shard1'
              description: 'Replicas are up but none leads: no policy is reconciled. Check the operator logs and the Lease.'
              runbook_url: 'http://localhost:3000/runbooks/not-leading.html'
  # Sharded (shards [shard1]): shard1's two replicas go down at minute 5 while the unlabelled shard's stay up.
  # PelicanOperatorDown and PelicanNotLeading stay silent (some replica is up; no replica reports shard1's Lease at
  # all): only PelicanShardDown tells.
  - interval: 1m
    input_series:
      - series: 'up{job="pelican-metrics",instance="a"}'
        values: '1x20'
      - series: 'up{job="pelican-metrics",instance="b"}'
        values: '1x20'
      - series: 'pelican_leader{job="pelican-metrics",instance="a",lease="pelican-leader"}'
        values: '1x20'
      - series: 'pelican_leader{job="pelican-metrics",instance="b",lease="pelican-leader"}'
        values: '0x20'
      - series: 'up{job="pelican-metrics",instance="d"}'
        values: '1x4 0x16'
      - series: 'up{job="pelican-metrics",instance="e"}'
        values: '1x4 0x16'
      - series: 'pelican_leader{job="pelican-metrics",instance="d",lease="pelican-leader-shard1"}'
        values: '1x4 stale'
      - series: 'pelican_leader{job="pelican-metrics",instance="e",lease="pelican-leader-shard1"}'
        values: '0x4 stale'
      # Another install (another job) whose replicas are down must not matter.
      - series: 'up{job="other-pelican-metrics",instance="f"}'
        values: '0x20'
    alert_rule_test:
      - eval_time: 4m
        alertname: PelicanShardDown
        exp_alerts: []
      # Down for 3 minutes (a rollout, a Pod rescheduled): not yet.
      - eval_time: 8m
        alertname: PelicanShardDown
        exp_alerts: []
      - eval_time: 12m
        alertname: PelicanShardDown
        exp_alerts:
          - exp_labels: {severity: critical, job: pelican-metrics, lease: pelican-leader-shard1, shard: shard1}
            exp_annotations:
              summary: 'No Pelican replica of shard shard1 is up (Lease pelican-leader-shard1)'
              description: 'Shard shard1 serves the policies labelled sharding.pelican.io/key=shard1 (the shard unlabelled: those without that label). None of them is reconciled or swept (no reclaim, dead-letter or retention jobs, no status) while the other shards run. kubectl get pods -n default -l pelican.io/shard=shard1 shows why.'
              runbook_url: 'http://localhost:3000/runbooks/shard-down.html'
      - eval_time: 12m
        alertname: PelicanOperatorDown
        exp_alerts: []
      - eval_time: 12m
        alertname: PelicanNotLeading
        exp_alerts: []
"#;

#[test]
fn promtool_test_rules_fire_what_must_fire_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("rules.yaml"), serde_yaml::to_string(&rule_groups()).unwrap()).unwrap();
    std::fs::write(dir.path().join("tests.yaml"), format!("rule_files: [rules.yaml]\n{TESTS}")).unwrap();
    let check = Command::new("promtool").arg("check").arg("rules").arg(dir.path().join("rules.yaml")).output().unwrap();
    assert!(
        check.status.success(),
        "{}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let out = Command::new("promtool")
        .args(["test", "rules", "tests.yaml"])
        .current_dir(dir.path())
        .output()
        .expect("promtool must be installed: scripts/testenv up installs Debian's prometheus");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("$ promtool test rules tests.yaml\n{text}");
    assert!(out.status.success(), "{text}");
    // Every alert of the chart is exercised.
    let alerts: BTreeSet<String> = rule_groups()["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().iter().map(|r| r["alert"].as_str().unwrap().to_string()))
        .collect();
    for alert in &alerts {
        assert!(TESTS.contains(&format!("alertname: {alert}\n")), "{alert} has no test");
    }
}

/// Issue 57: with sharding, one shard's replicas all down fired nothing (`PelicanOperatorDown` looks at the whole
/// job, `PelicanNotLeading` at the Leases replicas report). `PelicanShardDown` renders with sharding only (unsharded,
/// the one Deployment is the whole job), with one term per Deployment: each shard's Lease, and the unlabelled one.
#[test]
fn the_shard_alert_renders_with_sharding_only_and_watches_every_deployment() {
    let rules = |sets: &[&str]| -> Vec<Value> {
        let groups = render_with("templates/prometheusrule.yaml", sets)["spec"]["groups"].clone();
        groups.as_array().unwrap().iter().flat_map(|g| g["rules"].as_array().unwrap().clone()).collect()
    };
    let unsharded = rules(&[]);
    assert!(unsharded.len() >= 12, "{unsharded:?}");
    assert!(unsharded.iter().all(|r| r["alert"] != "PelicanShardDown"), "{unsharded:?}");
    let sharded = rules(&["sharding.shards={a,b}"]);
    let alert = sharded.iter().find(|r| r["alert"] == "PelicanShardDown").expect("PelicanShardDown with shards");
    let expr = alert["expr"].as_str().unwrap();
    for (lease, shard) in [("pelican-leader", "unlabelled"), ("pelican-leader-a", "a"), ("pelican-leader-b", "b")] {
        let term = format!(r#"absent(pelican_leader{{job="pelican-metrics",lease="{lease}"}}), "shard", "{shard}""#);
        assert!(expr.contains(&term), "{term} missing from {expr}");
    }
    assert_eq!(expr.matches("absent(").count(), 3, "one term per Deployment: {expr}");
}

/// Metric names in a PromQL expression (ours, and the controller-runtime ones).
fn series_in(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("pelican_").or_else(|| rest.find("controller_runtime_")) {
        let tail = &rest[at..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        names.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    names
}

fn collect_exprs(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("expr" | "query", Value::String(s)) => out.push(s.clone()),
                    _ => collect_exprs(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| collect_exprs(v, out)),
        _ => {}
    }
}

#[test]
fn the_dashboard_and_the_alerts_query_only_series_the_operator_exports() {
    // A live operator with a bounded policy that has passed, so every family has a sample.
    let server = Server::start(Flavor::Redis);
    let bounded =
        policy("p", &server.url(), "s", "g", "  backlog:\n    maxLength: 100\n  retention:\n    mode: Acknowledged\n");
    let (ns, operator) = ready_policy("alerts", &bounded, "p");
    // And a RedisServer: its series exist only where servers do.
    let server_object = format!(
        "apiVersion: pelican.io/v1alpha1\nkind: RedisServer\nmetadata:\n  name: shared\nspec:\n  url: {}\n",
        server.url()
    );
    assert!(kubectl_apply(&ns, &server_object).0);
    // One entry read and not acknowledged: the oldest-pending series exists only while something is pending.
    let mut conn = server.conn();
    let _: String = redis::cmd("XADD").arg("s").arg("*").arg("n").arg(1).query(&mut conn).unwrap();
    assert_eq!(read_new(&mut conn, "s", "g", "worker-1", 10).len(), 1);
    let exported: BTreeSet<String> =
        wait_for("a pass and a pending entry in the metrics", Duration::from_secs(30), || {
            let text = operator.metrics();
            let names: BTreeSet<String> = text
                .lines()
                .filter(|l| !l.starts_with('#') && !l.is_empty())
                .map(|l| l.split(['{', ' ']).next().unwrap().to_string())
                .collect();
            let ready = [
                "pelican_pass_delay_seconds_bucket",
                "pelican_group_oldest_pending_age_seconds",
                "pelican_redis_server_ready",
            ];
            if ready.iter().all(|n| names.contains(*n)) { Ok(names) } else { Err(text) }
        });
    let mut exprs = Vec::new();
    collect_exprs(&dashboard(), &mut exprs);
    let panels = exprs.len();
    collect_exprs(&rule_groups(), &mut exprs);
    assert!(panels >= 10 && exprs.len() > panels, "{exprs:#?}");
    let mut unknown = BTreeSet::new();
    let mut used = BTreeSet::new();
    for expr in &exprs {
        for name in series_in(expr) {
            used.insert(name.clone());
            if !exported.contains(&name) {
                unknown.insert(name);
            }
        }
    }
    println!("series used by the dashboard and the alerts: {used:?}");
    assert!(unknown.is_empty(), "queried but not exported: {unknown:?}\nexported: {exported:?}");
    // The check itself can tell: a misspelt name is caught.
    assert!(!exported.contains("pelican_dead_letters_total"));
    // Every panel has a title, and the ConfigMap carries the sidecar's label.
    let dashboard = dashboard();
    assert!(dashboard["panels"].as_array().unwrap().iter().all(|p| p["title"].as_str().is_some_and(|t| !t.is_empty())));
    assert_eq!(render("templates/dashboard.yaml")["metadata"]["labels"]["grafana_dashboard"], "1");
}

/// `--metrics-detail essential` (for many policies) keeps per policy every series the alerts and the dashboard read
/// per policy: a series a query reads with a `policy` label in full detail still has it.
#[test]
fn essential_metrics_keep_per_policy_what_the_alerts_and_the_dashboard_read() {
    use pelican::api::{ConsumerGroupPolicyStatus, Totals};
    use pelican::telemetry::{Metrics, MetricsDetail, PolicySnapshot};
    let metrics = Metrics::default();
    let status = ConsumerGroupPolicyStatus {
        pending: Some(1),
        lag: Some(1),
        lag_seconds: Some(1),
        stream_length: Some(1),
        dead_letter_length: Some(1),
        backlog: Some(1),
        consumers: Some(1),
        totals: Some(Totals::default()),
        ..Default::default()
    };
    let snapshot = PolicySnapshot {
        stream: "s".into(),
        group: "g".into(),
        ready: true,
        status,
        oldest_pending_age_seconds: Some(1),
        backlog_max_length: Some(10),
    };
    metrics.observe_policy(("apps".into(), "p".into()), snapshot);
    let per_policy = |text: String| -> BTreeSet<String> {
        text.lines()
            .filter(|l| l.contains("policy=\"p\""))
            .map(|l| l.split(['{', ' ']).next().unwrap().to_string())
            .collect()
    };
    let full = per_policy(metrics.render());
    metrics.set_detail(MetricsDetail::Essential);
    let essential = per_policy(metrics.render());
    let mut exprs = Vec::new();
    collect_exprs(&dashboard(), &mut exprs);
    collect_exprs(&rule_groups(), &mut exprs);
    let read: BTreeSet<String> = exprs.iter().flat_map(|e| series_in(e)).filter(|n| full.contains(n)).collect();
    assert!(read.len() >= 10, "{read:?}");
    let lost: Vec<&String> = read.iter().filter(|n| !essential.contains(*n)).collect();
    assert!(lost.is_empty(), "read per policy but summed per namespace with essential detail: {lost:?}");
    println!(
        "{} per-policy series in full detail, {} in essential; the queries read {read:?}",
        full.len(),
        essential.len()
    );
}

#[test]
fn alerts_and_dashboard_are_off_by_default() {
    let out = Command::new(bed().var("PELICAN_HELM")).args(["template", "pelican", CHART]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(!text.contains("kind: PrometheusRule") && !text.contains("grafana_dashboard"), "{text}");
}

/// A real Prometheus scrapes a live operator the way Prometheus Operator configures it from the chart's
/// ServiceMonitor: the target gets `namespace` = the release's namespace, and `honor_labels` is the ServiceMonitor's
/// `honorLabels`. The policy's series must keep the policy's namespace in `namespace` (what the alerts and the
/// dashboard group by), never as `exported_namespace`.
#[test]
fn prometheus_keeps_the_policy_namespace_in_namespace() {
    let rendered = Command::new(bed().var("PELICAN_HELM"))
        .args(["template", "pelican", CHART, "--namespace", "pelican-system"])
        .args(["--set", "metrics.serviceMonitor.enabled=true", "--show-only", "templates/servicemonitor.yaml"])
        .output()
        .expect("run helm");
    assert!(rendered.status.success(), "{}", String::from_utf8_lossy(&rendered.stderr));
    let monitor: Value = serde_yaml::from_slice(&rendered.stdout).unwrap();
    let endpoint = &monitor["spec"]["endpoints"][0];
    let honor = endpoint["honorLabels"].as_bool().unwrap_or(false);

    let server = Server::start(Flavor::Redis);
    let (ns, operator) = ready_policy("scraped", &policy("orders", &server.url(), "orders", "billing", ""), "orders");

    // The scrape configuration Prometheus Operator generates for a ServiceMonitor endpoint, reduced to what sets
    // labels: honor_labels from the endpoint, and the target's namespace, service and job from the Service.
    let dir = tempfile::tempdir().unwrap();
    let web = free_port();
    let config = format!(
        "global: {{scrape_interval: 1s}}\nscrape_configs:\n  - job_name: serviceMonitor/pelican-system/pelican/0\n    \
         honor_labels: {honor}\n    metrics_path: {path}\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n        \
         labels: {{namespace: pelican-system, service: pelican-metrics, job: pelican-metrics}}\n",
        path = endpoint["path"].as_str().unwrap(),
        port = operator.metrics_port,
    );
    std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
    let mut prometheus = Command::new("prometheus")
        .arg(format!("--config.file={}", dir.path().join("prometheus.yml").display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{web}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start prometheus");
    let labels = wait_for("Prometheus to scrape the policy's series", Duration::from_secs(60), || {
        let url = "/api/v1/query?query=pelican_policy_ready%7Bpolicy%3D%22orders%22%7D";
        let (_, body) = Operator::http_get(web, url);
        let reply: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        reply["data"]["result"][0]["metric"].as_object().cloned().ok_or(body)
    });
    let _ = prometheus.kill();
    let _ = prometheus.wait();
    assert_eq!(labels.get("namespace").and_then(Value::as_str), Some(ns.as_str()), "{labels:?}");
    assert!(!labels.contains_key("exported_namespace"), "{labels:?}");
}

/// Every alert links its runbook: a page of the book under `runbooks/` that exists and that the runbooks' index
/// lists next to the alert's name.
#[test]
fn every_alert_links_a_runbook_page_of_the_book() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/src/runbooks");
    let index = std::fs::read_to_string(root.join("index.md")).unwrap();
    let mut alerts = 0;
    for group in rule_groups()["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            let alert = rule["alert"].as_str().unwrap();
            let url = rule["annotations"]["runbook_url"].as_str().unwrap_or_else(|| panic!("{alert}: no runbook_url"));
            let page = url
                .strip_prefix("http://localhost:3000/runbooks/")
                .and_then(|p| p.strip_suffix(".html"))
                .unwrap_or_else(|| panic!("{alert}: {url} is not <runbookBaseUrl>/runbooks/<page>.html"));
            let markdown = std::fs::read_to_string(root.join(format!("{page}.md")))
                .unwrap_or_else(|e| panic!("{alert}: docs/src/runbooks/{page}.md: {e}"));
            assert!(markdown.contains(&format!("`{alert}`")), "{page}.md does not name {alert}");
            let row = index
                .lines()
                .find(|l| l.contains(&format!("`{alert}`")))
                .unwrap_or_else(|| panic!("{alert} not in the index"));
            assert!(row.contains(&format!("({page}.md)")), "the index row of {alert} links elsewhere: {row}");
            alerts += 1;
        }
    }
    assert!(alerts >= 11, "only {alerts} alerts: did the rules' shape change?");
}
