//! KEDA's external scaler API served by the operator (`--external-scaler-addr`), asked with a gRPC client the way
//! KEDA asks it, against the real API server and real Redis 7.0 / Valkey 9.1: the numbers, the push, the refusals.

#[macro_use]
mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;
use pelican::scaler::proto::external_scaler_client::ExternalScalerClient;
use pelican::scaler::proto::{GetMetricsRequest, ScaledObjectRef};
use tonic::transport::Channel;

on_both_servers!(
    the_backlog_is_served_and_a_first_entry_is_pushed_within_a_second,
    after_an_xdel_of_an_unread_entry_the_backlog_never_reads_zero_while_entries_wait,
    a_bad_trigger_and_a_policy_not_ready_get_errors_never_zero,
);

/// Defect: anyone reaching the port read any namespace's backlog (the caller names the namespace). With
/// `--external-scaler-tls-dir` only a client with a certificate of the given CA is answered, as KEDA is with the
/// trigger's `caCert`, `tlsClientCert` and `tlsClientKey`: without one (or over plain gRPC) nothing is answered.
#[test]
fn with_mutual_tls_only_a_client_with_a_certificate_of_the_ca_is_answered() {
    let server = Server::start(Flavor::Redis);
    let tls = std::path::PathBuf::from(bed().var("PELICAN_TLS_DIR"));
    let secret = tempfile::tempdir().unwrap();
    for (from, to) in [("server.crt", "tls.crt"), ("server.key", "tls.key"), ("ca.crt", "ca.crt")] {
        std::fs::copy(tls.join(from), secret.path().join(to)).unwrap();
    }
    let ns = namespace("scaler-tls");
    let port = free_port();
    let dir = format!("--external-scaler-tls-dir={}", secret.path().display());
    let _operator = Operator::start_with(&ns, &[&format!("--external-scaler-addr=127.0.0.1:{port}"), &dir]);
    assert!(kubectl_apply(&ns, &policy("orders", &server.url(), "orders", "billing", "")).0);
    wait_condition(&ns, "orders", "Ready", "True", "Reconciled");
    xadd(&mut server.conn(), "orders", 1);
    let orders = scaled_object(&ns, &[("policy", "orders")]);
    runtime().block_on(async {
        let start = Instant::now();
        let answered = loop {
            match ask_over_tls(port, &tls, true, &orders).await {
                Ok(value) => break value,
                Err(e) if start.elapsed() < Duration::from_secs(10) => {
                    println!("not answered yet: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("a client with the CA's certificate is not answered: {e}"),
            }
        };
        assert_eq!(answered, 1);
        let refused = ask_over_tls(port, &tls, false, &orders).await;
        println!("without a client certificate: {refused:?}");
        assert!(refused.is_err(), "a client without a certificate was answered");
        let plain = match ExternalScalerClient::connect(format!("http://127.0.0.1:{port}")).await {
            Ok(mut client) => metric(&mut client, &orders).await.map_err(|e| format!("{e:?}")),
            Err(e) => Err(e.to_string()),
        };
        assert!(plain.is_err(), "plain gRPC was answered");
    });
}

/// GetMetrics over TLS with the bed's CA, with the bed's client certificate when `identity`.
async fn ask_over_tls(
    port: u16,
    tls: &std::path::Path,
    identity: bool,
    object: &ScaledObjectRef,
) -> Result<i64, String> {
    let read = |name: &str| std::fs::read(tls.join(name)).unwrap();
    let mut config = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(read("ca.crt")))
        .domain_name("localhost");
    if identity {
        config = config.identity(tonic::transport::Identity::from_pem(read("client.crt"), read("client.key")));
    }
    let endpoint = Channel::from_shared(format!("https://127.0.0.1:{port}")).unwrap().tls_config(config).unwrap();
    let channel = endpoint.connect().await.map_err(|e| format!("connect: {e:?}"))?;
    metric(&mut ExternalScalerClient::new(channel), object).await.map_err(|e| format!("{e:?}"))
}

/// The operator watching a fresh namespace with the scaler on, and `manifest` applied there with `name` Ready.
fn operator_with_scaler(prefix: &str, manifest: &str, name: &str) -> (String, Operator, String) {
    let ns = namespace(prefix);
    let port = free_port();
    let operator = Operator::start_with(&ns, &[&format!("--external-scaler-addr=127.0.0.1:{port}")]);
    let (applied, out) = kubectl_apply(&ns, manifest);
    assert!(applied, "kubectl apply failed: {out}");
    wait_condition(&ns, name, "Ready", "True", "Reconciled");
    (ns, operator, format!("http://127.0.0.1:{port}"))
}

fn scaled_object(namespace: &str, metadata: &[(&str, &str)]) -> ScaledObjectRef {
    let scaler_metadata: HashMap<String, String> =
        metadata.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    ScaledObjectRef { name: "consumers".into(), namespace: namespace.into(), scaler_metadata }
}

/// A client of the scaler at `address`, once it answers for the policy `orders` of `namespace`: the operator's
/// view of the policy follows the API server's by a watch event, so for a moment after `kubectl` shows it Ready the
/// scaler still answers Unavailable (KEDA asks again).
async fn client(address: &str, namespace: &str) -> ExternalScalerClient<Channel> {
    let start = Instant::now();
    let orders = scaled_object(namespace, &[("policy", "orders")]);
    loop {
        let last = match ExternalScalerClient::connect(address.to_string()).await {
            Ok(mut client) => match metric(&mut client, &orders).await {
                Ok(_) => return client,
                Err(refused) => format!("{refused:?}"),
            },
            Err(e) => e.to_string(),
        };
        assert!(start.elapsed() < Duration::from_secs(10), "no answer from the external scaler at {address}: {last}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The value GetMetrics answers for the trigger, or the error's code and message.
async fn metric(
    client: &mut ExternalScalerClient<Channel>,
    object: &ScaledObjectRef,
) -> Result<i64, (tonic::Code, String)> {
    let request = GetMetricsRequest { scaled_object_ref: Some(object.clone()), metric_name: "s0-pelican".into() };
    match client.get_metrics(request).await {
        Ok(reply) => Ok(reply.into_inner().metric_values[0].metric_value),
        Err(status) => Err((status.code(), status.message().to_string())),
    }
}

fn xadd(conn: &mut redis::Connection, stream: &str, n: i64) -> String {
    redis::cmd("XADD").arg(stream).arg("*").arg("n").arg(n).query(conn).unwrap()
}

fn read_one(conn: &mut redis::Connection, stream: &str, group: &str) -> Option<String> {
    let reply: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(group)
        .arg("c1")
        .arg("COUNT")
        .arg(1)
        .arg("STREAMS")
        .arg(stream)
        .arg(">")
        .query(conn)
        .unwrap();
    reply.keys.into_iter().flat_map(|k| k.ids).map(|e| e.id).next()
}

/// A ScaledObject's view while consumers work: `backlog` = lag + pending, `pending`, `lag`, as `kubectl get`
/// shows them; `StreamIsActive` says false while the stream is idle, true within a second of the first entry,
/// false again once it is handled.
fn the_backlog_is_served_and_a_first_entry_is_pushed_within_a_second(flavor: Flavor) {
    let server = Server::start(flavor);
    // interval 1m: the scaler's own reading, not a reconcile's, must notice the entry.
    let manifest = policy("orders", &server.url(), "orders", "billing", "").replace("interval: 1s", "interval: 1m");
    let (ns, _operator, address) = operator_with_scaler("scaler", &manifest, "orders");
    let mut conn = server.conn();
    runtime().block_on(async {
        let mut client = client(&address, &ns).await;
        let backlog = scaled_object(&ns, &[("policy", "orders")]);
        let spec = client.get_metric_spec(backlog.clone()).await.unwrap().into_inner();
        assert_eq!(spec.metric_specs[0].metric_name, "pelican-backlog-orders");
        assert_eq!(spec.metric_specs[0].target_size_float, 5.0, "the default target");

        let mut pushes = client.stream_is_active(backlog.clone()).await.unwrap().into_inner();
        let first = pushes.message().await.unwrap().unwrap();
        assert!(!first.result, "an idle stream is not active");
        assert!(!client.is_active(backlog.clone()).await.unwrap().into_inner().result);
        // Let the idle reading age, as it would between a consumer's bursts.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let published = Instant::now();
        xadd(&mut conn, "orders", 1);
        let pushed = tokio::time::timeout(Duration::from_secs(5), pushes.message()).await.unwrap().unwrap().unwrap();
        let after = published.elapsed();
        println!("{flavor:?}: first entry after idle pushed active={} after {after:.2?}", pushed.result);
        assert!(pushed.result);
        assert!(after < Duration::from_millis(1300), "pushed after {after:?}, not within a second");

        for n in 2..=3 {
            xadd(&mut conn, "orders", n);
        }
        read_one(&mut conn, "orders", "billing").unwrap();
        let pending = scaled_object(&ns, &[("policy", "orders"), ("metric", "pending")]);
        let lag = scaled_object(&ns, &[("policy", "orders"), ("metric", "lag")]);
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let seen =
            (metric(&mut client, &backlog).await, metric(&mut client, &pending).await, metric(&mut client, &lag).await);
        println!("{flavor:?}: 3 entries, 1 read: backlog, pending, lag = {seen:?}");
        assert_eq!(seen, (Ok(3), Ok(1), Ok(2)));

        // Handled: read and acknowledged, all of them.
        let mut ids = vec![];
        while let Some(id) = read_one(&mut conn, "orders", "billing") {
            ids.push(id);
        }
        let pel = pel(&mut conn, "orders", "billing");
        let all: Vec<String> = pel.into_iter().map(|(id, ..)| id).collect();
        let _: i64 = redis::cmd("XACK").arg("orders").arg("billing").arg(&all).query(&mut conn).unwrap();
        let idle = tokio::time::timeout(Duration::from_secs(5), pushes.message()).await.unwrap().unwrap().unwrap();
        assert!(!idle.result, "all handled: inactive");
        assert_eq!(metric(&mut client, &backlog).await, Ok(0));
    });
}

/// KEDA's built-in scaler reads the server's lag, which is unknown once an unread entry is deleted (clients read
/// it as 0): Pelican's backlog counts the stream instead, so a ScaledObject never sees 0 while entries wait, and
/// sees 0 once they are all handled.
fn after_an_xdel_of_an_unread_entry_the_backlog_never_reads_zero_while_entries_wait(flavor: Flavor) {
    let server = Server::start(flavor);
    let manifest = policy("orders", &server.url(), "orders", "billing", "");
    let (ns, _operator, address) = operator_with_scaler("scaler-xdel", &manifest, "orders");
    let mut conn = server.conn();
    let ids: Vec<String> = (1..=4).map(|n| xadd(&mut conn, "orders", n)).collect();
    let _: i64 = redis::cmd("XDEL").arg("orders").arg(&ids[1]).query(&mut conn).unwrap();
    let lag: Option<i64> = group_field(&xinfo_groups(&mut conn, "orders")[0], "lag");
    assert_eq!(lag, None, "the server cannot tell the lag after an XDEL of an unread entry");
    runtime().block_on(async {
        let mut client = client(&address, &ns).await;
        let backlog = scaled_object(&ns, &[("policy", "orders")]);
        let lag = scaled_object(&ns, &[("policy", "orders"), ("metric", "lag")]);
        let mut seen = vec![];
        loop {
            tokio::time::sleep(Duration::from_millis(1100)).await;
            let (value, lag_value) =
                (metric(&mut client, &backlog).await.unwrap(), metric(&mut client, &lag).await.unwrap());
            let unread: Option<i64> = group_field(&xinfo_groups(&mut conn, "orders")[0], "lag");
            seen.push((value, lag_value, unread));
            let Some(id) = read_one(&mut conn, "orders", "billing") else { break };
            assert!(value > 0 && lag_value > 0, "an unread entry ({id}) waits, yet the metric read 0: {seen:?}");
            let _: i64 = redis::cmd("XACK").arg("orders").arg("billing").arg(&id).query(&mut conn).unwrap();
        }
        println!("{flavor:?}: (backlog, lag metric, server's lag) before each read: {seen:?}");
        assert_eq!(seen.len(), 4, "three entries were left to read after the XDEL: {seen:?}");
        assert_eq!(seen[0].0, 3, "the upper bound: every entry of the stream counts as unread");
        assert_eq!(seen.last().unwrap().0, 0, "all handled: {seen:?}");
    });
}

/// A policy that is not Ready answers an error (KEDA logs it and keeps the replicas), never 0, and never the
/// condition's message (the caller is whoever reaches the port); a bad trigger is refused naming what is wrong.
fn a_bad_trigger_and_a_policy_not_ready_get_errors_never_zero(flavor: Flavor) {
    let mut server = Server::start(flavor);
    let manifest = policy("orders", &server.url(), "orders", "billing", "");
    let (ns, operator, address) = operator_with_scaler("scaler-refuse", &manifest, "orders");
    let mut conn = server.conn();
    xadd(&mut conn, "orders", 1);
    runtime().block_on(async {
        let mut client = client(&address, &ns).await;
        assert_eq!(metric(&mut client, &scaled_object(&ns, &[("policy", "orders")])).await, Ok(1));

        let qualified = scaled_object("team-b", &[("policy", &format!("{ns}/orders"))]);
        let (code, message) = metric(&mut client, &qualified).await.unwrap_err();
        assert_eq!(code, tonic::Code::InvalidArgument, "{message}");

        let wrong = scaled_object(&ns, &[("policy", "orders"), ("metric", "depth")]);
        let (code, message) = metric(&mut client, &wrong).await.unwrap_err();
        assert_eq!(code, tonic::Code::InvalidArgument);
        assert!(message.contains("not one of backlog, pending, lag"), "{message}");
    });
    // What was answered, as Prometheus sees it.
    let metrics = operator.metrics();
    for series in [
        "pelican_scaler_answers_total{method=\"GetMetrics\",code=\"Ok\"} 2",
        "pelican_scaler_answers_total{method=\"GetMetrics\",code=\"InvalidArgument\"} 2",
    ] {
        assert!(metrics.contains(series), "{series} missing from:\n{metrics}");
    }
    // Two answers with a number, on a policy whose reconciles (every second) keep its reading fresh: one read, two
    // if the answers spanned a second without a reconcile.
    let reads = metrics.lines().find_map(|l| l.strip_prefix("pelican_scaler_backlog_reads_total ")).unwrap();
    assert!(matches!(reads.parse::<u64>(), Ok(1..=2)), "{reads} backlog reads");

    server.stop();
    wait_condition(&ns, "orders", "Ready", "False", "RedisUnavailable");
    runtime().block_on(async {
        let mut client = ExternalScalerClient::connect(address.clone()).await.unwrap();
        // Until the operator's view of the policy has its new status, the server's refusal itself shows (Unavailable);
        // never a number.
        let start = Instant::now();
        let (code, message) = loop {
            let (code, message) = metric(&mut client, &scaled_object(&ns, &[("policy", "orders")])).await.unwrap_err();
            if code == tonic::Code::FailedPrecondition || start.elapsed() > Duration::from_secs(5) {
                break (code, message);
            }
            assert_eq!(code, tonic::Code::Unavailable, "{message}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        println!("{flavor:?}: server stopped: {code:?}: {message}");
        assert_eq!(code, tonic::Code::FailedPrecondition);
        assert!(message.contains("is not Ready (RedisUnavailable)"), "{message}");
        assert!(
            !message.contains(&server.port.to_string()),
            "the condition's message (the server's address) is echoed: {message}"
        );
    });
}

/// A topic's backlog is its partitions' summed, and never asks for more replicas than partitions (a member beyond
/// them owns nothing): 30 unread entries over 2 partitions read 10 at the default target 5, 30 at a target of 100;
/// activity is judged on the whole count (30 is above an activation of 20, though the capped 10 is not).
#[test]
fn a_topic_reads_its_partitions_summed_and_asks_for_no_more_replicas_than_partitions() {
    let server = Server::start(Flavor::Redis);
    let manifest = policy("orders", &server.url(), "orders", "billing", "  partitions: 2\n");
    let (ns, _operator, address) = operator_with_scaler("scaler-topic", &manifest, "orders");
    let mut conn = server.conn();
    for n in 0..30 {
        xadd(&mut conn, &pelican::keys::partition_stream("orders", n % 2), i64::from(n));
    }
    runtime().block_on(async {
        let mut client = client(&address, &ns).await;
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let backlog = scaled_object(&ns, &[("policy", "orders")]);
        let wide = scaled_object(&ns, &[("policy", "orders"), ("metric", "lag"), ("target", "100")]);
        assert_eq!(metric(&mut client, &backlog).await.unwrap(), 10, "2 partitions x target 5");
        assert_eq!(metric(&mut client, &wide).await.unwrap(), 30, "both partitions' lag, under the cap");
        let active = scaled_object(&ns, &[("policy", "orders"), ("activationTarget", "20")]);
        let reply = client.is_active(active).await.unwrap().into_inner();
        assert!(reply.result, "30 unread entries are above an activation of 20");
    });
}
