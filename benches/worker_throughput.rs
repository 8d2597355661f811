//! The SDK's cost per message: a worker with a no-op handler vs a plain XREADGROUP / XACK loop doing the same
//! work on the same server, printed side by side.
//!
//!   scripts/testenv up && cargo bench --bench worker_throughput [-- <messages>]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use opentelemetry::metrics::NoopMeterProvider;
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use pelican::worker::{Outcome, Worker, WorkerConfig};
use redis::aio::ConnectionManager;
use support::{bed_var, fill_stream};

mod support;

const GROUP: &str = "g";

/// The loop a hand-written consumer would run: read a batch, handle each message, acknowledge the batch with one
/// XACK.
async fn plain_loop(conn: &mut ConnectionManager, stream: &str, count: usize, batch: usize) -> Duration {
    let start = Instant::now();
    let mut done = 0;
    while done < count {
        let reply: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(GROUP)
            .arg("plain")
            .arg("COUNT")
            .arg(batch)
            .arg("STREAMS")
            .arg(stream)
            .arg(">")
            .query_async(conn)
            .await
            .unwrap();
        let ids: Vec<String> = reply.keys.into_iter().flat_map(|k| k.ids).map(|entry| entry.id).collect();
        if !ids.is_empty() {
            let _: i64 = redis::cmd("XACK").arg(stream).arg(GROUP).arg(&ids).query_async(conn).await.unwrap();
            done += ids.len();
        }
    }
    start.elapsed()
}

async fn sdk(client: &redis::Client, stream: &str, count: usize, concurrency: usize) -> Duration {
    let config =
        WorkerConfig { concurrency, block: Duration::from_millis(50), ..WorkerConfig::new(stream, GROUP, "sdk") };
    let worker = Worker::connect(client, config).await.unwrap();
    let mut conn = client.get_connection_manager().await.unwrap();
    let handled = Arc::new(AtomicUsize::new(0));
    let counter = handled.clone();
    let watch_stream = stream.to_string();
    let start = Instant::now();
    // Stop once every message was handled and nothing is left pending (all acknowledged).
    let all_acked = async move {
        loop {
            if handled.load(Ordering::Relaxed) >= count {
                let pending: (i64, redis::Value, redis::Value, redis::Value) =
                    redis::cmd("XPENDING").arg(&watch_stream).arg(GROUP).query_async(&mut conn).await.unwrap();
                if pending.0 == 0 {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    let handler = move |_| {
        counter.fetch_add(1, Ordering::Relaxed);
        async { Ok(Outcome::Done) }
    };
    let stats = worker.run(handler, all_acked).await.expect("contract 1");
    assert_eq!(stats.done as usize, count, "{stats:?}");
    start.elapsed()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let count: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(50_000);
    println!("worker throughput, {count} messages, no-op handler; messages per second (microseconds per message)");
    table(count).await;
    // Again with an OpenTelemetry meter provider installed, as an application that reads the workers' metrics through
    // OpenTelemetry would (a periodic reader into the in-memory exporter); the API's no-op is put back after it.
    let meters = SdkMeterProvider::builder()
        .with_reader(PeriodicReader::builder(InMemoryMetricExporter::default()).build())
        .build();
    opentelemetry::global::set_meter_provider(meters.clone());
    println!("the same with metrics on (an OpenTelemetry meter provider recording the workers' metrics)");
    table(count).await;
    opentelemetry::global::set_meter_provider(NoopMeterProvider::new());
    meters.shutdown().unwrap();
    // Again with an OpenTelemetry SDK installed, as an application that traces would: every handler run is a
    // recorded span (a batch processor; the exporter keeps them in memory, emptied after each table).
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter.clone()).build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    println!("the same with tracing on (an OpenTelemetry SDK recording a span per handler run)");
    table(count).await;
    provider.force_flush().unwrap();
    println!("{} spans recorded", exporter.get_finished_spans().unwrap().len());
}

/// One row per server: the plain loop and the SDK, one at a time and 16 at once.
async fn table(count: usize) {
    println!(
        "{:<14} {:>24} {:>24} {:>24} {:>24}",
        "server", "plain loop, batch 1", "SDK, concurrency 1", "plain loop, batch 16", "SDK, concurrency 16"
    );
    for var in ["PELICAN_REDIS_URL", "PELICAN_VALKEY_URL"] {
        let client = redis::Client::open(bed_var(var)).unwrap();
        let mut conn = client.get_connection_manager().await.unwrap();
        let info: String = redis::cmd("INFO").arg("server").query_async(&mut conn).await.unwrap();
        let server = pelican::redis::ServerInfo::parse(&info).to_string();
        let cell = |took: Duration| {
            format!("{:>10.0} ({:>6.1} us)", count as f64 / took.as_secs_f64(), took.as_secs_f64() * 1e6 / count as f64)
        };
        fill_stream(&mut conn, "{bench}:plain", GROUP, count, 100).await;
        let plain_one = plain_loop(&mut conn, "{bench}:plain", count, 1).await;
        fill_stream(&mut conn, "{bench}:plain", GROUP, count, 100).await;
        let plain = plain_loop(&mut conn, "{bench}:plain", count, 16).await;
        fill_stream(&mut conn, "{bench}:sdk1", GROUP, count, 100).await;
        let one = sdk(&client, "{bench}:sdk1", count, 1).await;
        fill_stream(&mut conn, "{bench}:sdk16", GROUP, count, 100).await;
        let sixteen = sdk(&client, "{bench}:sdk16", count, 16).await;
        println!("{:<14} {:>24} {:>24} {:>24} {:>24}", server, cell(plain_one), cell(one), cell(plain), cell(sixteen));
        let _: () = redis::cmd("DEL")
            .arg("{bench}:plain")
            .arg("{bench}:sdk1")
            .arg("{bench}:sdk16")
            .query_async(&mut conn)
            .await
            .unwrap();
    }
}
