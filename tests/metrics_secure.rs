//! `/metrics` secured (issue 66), as Kubernetes' own components and controller-runtime serve it: over TLS with the
//! certificate of a mounted Secret (re-read when it is renewed), and only to callers whose token the API server
//! authenticates and allows `get` on the non-resource URL `/metrics`. What is asserted is what a scraper sees: the
//! HTTP status and body `curl` gets with each token.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

/// A self-signed certificate for 127.0.0.1 with `name` as its subject, written as a `kubernetes.io/tls` Secret mounts
/// it (`tls.crt`, `tls.key`).
fn certificate(dir: &Path, name: &str) {
    let out = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", &format!("/CN={name}")])
        .args(["-addext", "subjectAltName=IP:127.0.0.1", "-keyout"])
        .arg(dir.join("tls.key"))
        .arg("-out")
        .arg(dir.join("tls.crt"))
        .output()
        .expect("openssl");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `curl` of `/metrics` over TLS trusting `ca`, with `token` as bearer: (HTTP status, body); status 0 when the TLS
/// connection failed.
fn scrape(port: u16, ca: &Path, token: Option<&str>) -> (u16, String) {
    let mut curl = Command::new("curl");
    curl.args(["-s", "-w", "\n%{http_code}", "--cacert"]).arg(ca).arg(format!("https://127.0.0.1:{port}/metrics"));
    if let Some(token) = token {
        curl.args(["-H", &format!("Authorization: Bearer {token}")]);
    }
    let text = String::from_utf8_lossy(&curl.output().expect("curl").stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

#[test]
fn metrics_over_tls_answer_only_callers_allowed_to_get_them_and_follow_a_renewed_certificate() {
    let certs = tempfile::tempdir().unwrap();
    certificate(certs.path(), "pelican-metrics");
    let ca = tempfile::tempdir().unwrap();
    std::fs::copy(certs.path().join("tls.crt"), ca.path().join("first.crt")).unwrap();
    let ns = namespace("metrics-secure");
    let dir = certs.path().to_str().unwrap();
    let operator = Operator::start_with(&ns, &["--metrics-tls-dir", dir, "--metrics-auth"]);
    let role = format!("{ns}-metrics-reader");
    kubectl_ok(&["create", "serviceaccount", "prometheus", "-n", &ns]);
    kubectl_ok(&["create", "serviceaccount", "stranger", "-n", &ns]);
    kubectl_ok(&["create", "clusterrole", &role, "--verb=get", "--non-resource-url=/metrics"]);
    kubectl_ok(&[
        "create",
        "clusterrolebinding",
        &role,
        "--clusterrole",
        &role,
        "--serviceaccount",
        &format!("{ns}:prometheus"),
    ]);
    let token =
        |account: &str| kubectl_ok(&["create", "token", account, "-n", &ns, "--duration=1h"]).trim().to_string();
    let (prometheus, stranger) = (token("prometheus"), token("stranger"));
    let first = ca.path().join("first.crt");

    let (status, body) = wait_for("the metrics port over TLS", Duration::from_secs(30), || {
        match scrape(operator.metrics_port, &first, None) {
            (0, _) => Err("no TLS answer yet".to_string()),
            answer => Ok(answer),
        }
    });
    assert_eq!(status, 401, "no token: {body}");
    let (status, body) = scrape(operator.metrics_port, &first, Some(&stranger));
    assert_eq!(status, 403, "{body}");
    assert!(body.contains(&format!("system:serviceaccount:{ns}:stranger may not get /metrics")), "{body}");
    let (status, body) = scrape(operator.metrics_port, &first, Some("not-a-token"));
    assert_eq!(status, 401, "{body}");
    let (status, body) = scrape(operator.metrics_port, &first, Some(&prometheus));
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("pelican_"), "the metrics: {body}");
    // Plain HTTP is not served.
    let (plain, _) = Operator::http_get(operator.metrics_port, "/metrics");
    assert_ne!(plain, 200, "plain HTTP answered");

    // The Secret renewed (cert-manager): the next connection gets the new certificate, without a restart.
    std::thread::sleep(Duration::from_millis(1_100));
    certificate(certs.path(), "pelican-metrics-renewed");
    let renewed = certs.path().join("tls.crt");
    let (status, body) = scrape(operator.metrics_port, &renewed, Some(&prometheus));
    assert_eq!(status, 200, "the renewed certificate is served: {body}");
    assert_eq!(
        scrape(operator.metrics_port, &first, Some(&prometheus)).0,
        0,
        "the old certificate is no longer served"
    );
}
