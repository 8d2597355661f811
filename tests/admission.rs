//! Bad input is refused by the real API server at `kubectl apply`, with a message that names the field.

mod common;

use common::*;

fn refused(namespace: &str, manifest: &str) -> String {
    let (ok, out) = kubectl_apply(namespace, manifest);
    assert!(!ok, "the API server accepted:\n{manifest}");
    out
}

const URL: &str = "redis://127.0.0.1:6379/0";

#[test]
fn max_deliveries_zero_is_refused() {
    let ns = namespace("adm");
    let out = refused(&ns, &policy("p", URL, "s", "g", "  retry:\n    maxDeliveries: 0\n"));
    assert!(out.contains("spec.retry.maxDeliveries"), "{out}");
}

#[test]
fn min_idle_zero_is_refused() {
    let ns = namespace("adm");
    let out = refused(
        &ns,
        &policy("p", URL, "s", "g", "").replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 0s\n"),
    );
    assert!(out.contains("spec.reclaim.minIdle") && out.contains("at least 1s"), "{out}");
}

#[test]
fn duration_in_prose_is_refused() {
    let ns = namespace("adm");
    let out = refused(&ns, &policy("p", URL, "s", "g", "").replace("interval: 1s", "interval: 5 minutes"));
    assert!(out.contains("spec.reclaim.interval"), "{out}");
}

#[test]
fn dead_letter_stream_equal_to_stream_is_refused() {
    let ns = namespace("adm");
    let out = refused(&ns, &policy("p", URL, "s", "g", "").replace("stream: \"s:dlq\"", "stream: \"s\""));
    assert!(out.contains("spec.deadLetter.stream must differ from spec.stream"), "{out}");
}

#[test]
fn password_in_url_is_refused() {
    let ns = namespace("adm");
    let out = refused(&ns, &policy("p", "redis://:hunter2@127.0.0.1:6379/0", "s", "g", ""));
    assert!(out.contains("spec.redis.url must not contain credentials"), "{out}");
    let out = refused(&ns, &policy("p", "http://127.0.0.1:6379", "s", "g", ""));
    assert!(out.contains("spec.redis.url"), "{out}");
}

#[test]
fn changing_stream_group_or_url_is_refused() {
    let ns = namespace("adm");
    let original = policy("p", URL, "s", "g", "");
    assert!(kubectl_apply(&ns, &original).0);
    let out = refused(&ns, &original.replace("stream: \"s\"", "stream: \"t\""));
    assert!(out.contains("spec.stream is immutable"), "{out}");
    let out = refused(&ns, &original.replace("group: g", "group: h"));
    assert!(out.contains("spec.group is immutable"), "{out}");
    let out = refused(&ns, &original.replace(URL, "redis://127.0.0.1:6380/0"));
    assert!(out.contains("spec.redis.url is immutable"), "{out}");
    // Moving to a RedisServer is allowed once; coming back to another url through it is not (the field rules on url
    // and on serverRef each see their field absent on one side, so only the rule on spec.redis can tell).
    let moved = original.replace(&format!("url: {URL}"), "serverRef: {name: shared}");
    assert!(moved != original, "the policy's url line: {original}");
    assert!(kubectl_apply(&ns, &moved).0, "url -> serverRef is a documented move");
    let out = refused(&ns, &original.replace(URL, "redis://127.0.0.1:6380/0"));
    assert!(out.contains("spec.redis.serverRef cannot be removed"), "{out}");
    assert_eq!(get_policy(&ns, "p")["spec"]["redis"]["serverRef"]["name"], "shared");
}

#[test]
fn defaults_are_filled_in_by_the_api_server() {
    let ns = namespace("adm");
    let minimal = format!(
        "apiVersion: pelican.io/v1alpha1\nkind: ConsumerGroupPolicy\nmetadata:\n  name: m\nspec:\n  redis:\n    url: {URL}\n  stream: s\n  group: g\n  deadLetter:\n    stream: s:dlq\n"
    );
    assert!(kubectl_apply(&ns, &minimal).0);
    let spec = get_policy(&ns, "m")["spec"].clone();
    assert_eq!(spec["startId"], "$");
    assert_eq!(spec["reclaim"]["minIdle"], "5m");
    assert_eq!(spec["reclaim"]["interval"], "1m");
    assert_eq!(spec["reclaim"]["maxPerPass"], 1000);
    assert_eq!(spec["reclaim"]["strategy"], "Requeue");
    assert_eq!(spec["retry"]["maxDeliveries"], 3);
    assert_eq!(spec["deletionPolicy"], "Retain");
    assert_eq!(spec["redis"]["mode"], "Standalone");
    assert_eq!(spec["suspend"], false);
}

#[test]
fn tls_settings_that_would_be_ignored_are_refused() {
    let ns = namespace("adm");
    let tls = |url: &str, refs: &str| {
        policy("p", url, "s", "g", "").replacen("  stream:", &format!("    tls:\n{refs}  stream:"), 1)
    };
    let ca = "      caSecretRef: {name: redis-tls, key: ca.crt}\n";
    let out = refused(&ns, &tls(URL, ca));
    assert!(out.contains("spec.redis.tls is set but spec.redis.url is redis://"), "{out}");
    let cert_only = "      certSecretRef: {name: redis-tls, key: tls.crt}\n";
    let out = refused(&ns, &tls("rediss://127.0.0.1:6380/0", cert_only));
    assert!(out.contains("tls.certSecretRef and tls.keySecretRef go together"), "{out}");
    let both = format!("{cert_only}      keySecretRef: {{name: redis-tls, key: tls.key}}\n");
    assert!(kubectl_apply(&ns, &tls("rediss://127.0.0.1:6380/0", &both)).0);
}

#[test]
fn dead_letter_max_len_has_a_maximum() {
    let ns = namespace("adm");
    let out = refused(
        &ns,
        &policy("p", URL, "s", "g", "").replace("stream: \"s:dlq\"", "stream: \"s:dlq\"\n    maxLen: 1000000000001"),
    );
    assert!(out.contains("spec.deadLetter.maxLen"), "{out}");
    assert!(
        kubectl_apply(
            &ns,
            &policy("p", URL, "s", "g", "")
                .replace("stream: \"s:dlq\"", "stream: \"s:dlq\"\n    maxLen: 1000000000000")
        )
        .0
    );
}

#[test]
fn backlog_and_retention_are_checked_at_admission() {
    let ns = namespace("adm");
    let out = refused(&ns, &policy("p", URL, "s", "g", "  backlog:\n    maxLength: 0\n"));
    assert!(out.contains("spec.backlog.maxLength") && out.contains("greater than or equal to 1"), "{out}");
    let out = refused(&ns, &policy("p", URL, "s", "g", "  backlog: {}\n"));
    assert!(out.contains("spec.backlog.maxLength") && out.contains("Required"), "{out}");
    let out = refused(&ns, &policy("p", URL, "s", "g", "  retention:\n    mode: Forever\n"));
    assert!(out.contains("spec.retention.mode") && out.contains("\"Acknowledged\""), "{out}");
    let out =
        refused(&ns, &policy("p", URL, "s", "g", "  retention:\n    mode: Acknowledged\n    minAge: ten minutes\n"));
    assert!(out.contains("spec.retention.minAge"), "{out}");
    let ok = policy(
        "p",
        URL,
        "s",
        "g",
        "  backlog:\n    maxLength: 1\n  retention:\n    mode: Acknowledged\n    minAge: 1h30m\n",
    );
    assert!(kubectl_apply(&ns, &ok).0);
}

/// Defect: `filter.to: "99999999999999999999"` (beyond 64 bits) was admitted and every step of the redrive failed
/// on the server, retried for good. Ids whose parts do not fit in 64 bits are refused at `kubectl apply`; the
/// largest that fits is admitted.
#[test]
fn redrive_ids_beyond_64_bits_are_refused() {
    let ns = namespace("adm");
    let redrive = |filter: &str| {
        format!(
            "apiVersion: pelican.io/v1alpha1\nkind: DeadLetterRedrive\nmetadata:\n  name: r\nspec:\n  policyRef:\n    \
             name: p\n  dryRun: true\n  filter:\n{filter}"
        )
    };
    for filter in ["    to: \"99999999999999999999\"\n", "    from: \"1-18446744073709551616\"\n"] {
        let out = refused(&ns, &redrive(filter));
        let field = if filter.contains("to:") { "spec.filter.to" } else { "spec.filter.from" };
        assert!(out.contains(&format!("{field} must be a stream id")) && out.contains("64 bits"), "{out}");
    }
    let (ok, out) =
        kubectl_apply(&ns, &redrive("    from: \"0-1\"\n    to: \"18446744073709551615-18446744073709551615\"\n"));
    assert!(ok, "{out}");
}
