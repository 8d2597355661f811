//! What KEDA's polling costs the Redis server: N policies (default 1,000, interval 1m) on one Redis 7.0, the
//! operator serving the external scaler, and a gRPC client asking as KEDA's operator does for each ScaledObject
//! (`IsActive` and `GetMetrics` every polling interval). Printed side by side, from the server's own
//! `total_commands_processed`: commands per second with nobody asking (the operator's reconciles and passes, over
//! one whole interval), with every policy asked once per second, and asked as fast as the client can. The contract: however often KEDA asks,
//! at most one backlog read (`XINFO GROUPS` + `XLEN`) per policy per second.
//!
//!   scripts/testenv up && cargo bench --bench scaler_cost [-- <policies>]

#[path = "../tests/common/mod.rs"]
#[allow(unused_macros)]
mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use pelican::scaler::proto::external_scaler_client::ExternalScalerClient;
use pelican::scaler::proto::{GetMetricsRequest, ScaledObjectRef};

fn commands(server: &Server) -> u64 {
    let info: String = redis::cmd("INFO").arg("stats").query(&mut server.conn()).unwrap();
    info.lines().find_map(|l| l.strip_prefix("total_commands_processed:")).unwrap().trim().parse().unwrap()
}

/// Commands per second the server processed over `window`, less this function's own two INFO calls.
fn command_rate(server: &Server, window: Duration) -> f64 {
    let before = commands(server);
    std::thread::sleep(window);
    (commands(server) - before - 1) as f64 / window.as_secs_f64()
}

/// `pelican_scaler_backlog_reads_total` of the operator.
fn backlog_reads(operator: &Operator) -> f64 {
    let metrics = operator.metrics();
    let line =
        metrics.lines().find(|l| l.starts_with("pelican_scaler_backlog_reads_total ")).expect("the reads counter");
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

fn main() {
    let count: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(1000);
    let server = Server::start(Flavor::Redis);
    let ns = namespace("scaler-cost");
    let port = free_port();
    let operator = Operator::start_with(&ns, &[&format!("--external-scaler-addr=127.0.0.1:{port}")]);
    let manifests: Vec<String> = (0..count)
        .map(|i| policy(&format!("p{i}"), &server.url(), &format!("s{i}"), "g", "").replace("    interval: 1s\n", ""))
        .collect();
    for chunk in manifests.chunks(500) {
        let (ok, out) = kubectl_apply(&ns, &chunk.join("---\n"));
        assert!(ok, "{out}");
    }
    wait_all_ready(&ns, count, Duration::from_secs(1800));
    // The start's burst of reconciles is over once every policy is Ready; let the first passes end too.
    std::thread::sleep(Duration::from_secs(5));
    // One whole interval: every policy's reconcile and pass once.
    let quiet = command_rate(&server, Duration::from_secs(60));
    let window = Duration::from_secs(20);

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let objects: Vec<ScaledObjectRef> = (0..count)
        .map(|i| ScaledObjectRef {
            name: format!("consumers-{i}"),
            namespace: ns.clone(),
            scaler_metadata: HashMap::from([("policy".to_string(), format!("p{i}"))]),
        })
        .collect();
    let mut rows = vec![("nobody asks".to_string(), quiet, 0.0, 0.0)];
    for per_second in [1u32, 1000] {
        let period = Duration::from_secs(1) / per_second;
        let objects = objects.clone();
        let address = format!("http://127.0.0.1:{port}");
        let answers = Arc::new(AtomicU64::new(0));
        let counted = answers.clone();
        let asked = runtime.spawn(async move {
            let client = ExternalScalerClient::connect(address).await.unwrap();
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let asks = objects.iter().map(|object| {
                    let mut client = client.clone();
                    let request =
                        GetMetricsRequest { scaled_object_ref: Some(object.clone()), metric_name: "m".into() };
                    async move {
                        let active = client.is_active(object.clone()).await.unwrap().into_inner().result;
                        let metric = client.get_metrics(request).await.unwrap().into_inner();
                        assert!(!active && metric.metric_values[0].metric_value == 0);
                    }
                });
                futures::future::join_all(asks).await;
                counted.fetch_add(2 * objects.len() as u64, Ordering::Relaxed);
            }
        });
        // The first second fills the readings; measure after it.
        std::thread::sleep(Duration::from_secs(3));
        let (before, reads_before) = (answers.load(Ordering::Relaxed), backlog_reads(&operator));
        let rate = command_rate(&server, window);
        let asks = (answers.load(Ordering::Relaxed) - before) as f64 / window.as_secs_f64();
        let reads = (backlog_reads(&operator) - reads_before) / window.as_secs_f64() / count as f64;
        asked.abort();
        rows.push((format!("{count} asked every {period:?}"), rate, asks, reads));
        std::thread::sleep(Duration::from_secs(2));
    }
    println!("{count} policies on one Redis 7.0 (interval 1m), KEDA's asks (IsActive + GetMetrics) by a gRPC client");
    println!("{:<24} {:>10} {:>14} {:>26}", "", "asks/s", "commands/s", "backlog reads/policy/s");
    for (label, rate, asks, reads) in &rows {
        println!("{label:<24} {asks:>10.0} {rate:>14.0} {reads:>26.2}");
    }
    println!(
        "SUMMARY scaler-cost quiet={quiet:.0}/s asked-each-second={:.0}/s asked-flat-out={:.0}/s reads-per-policy-per-s={:.2}",
        rows[1].1, rows[2].1, rows[2].3
    );
}
