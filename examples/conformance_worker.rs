//! The Rust SDK's conformance worker (contract/README.md, "The conformance worker"): the program the conformance
//! suite (tests/conformance.rs) runs for the Rust SDK, as it runs every library's.
//!
//!   REDIS_URL=redis://127.0.0.1:6379/0 STREAM=orders GROUP=billing cargo run --example conformance_worker
//!
//! The handler obeys the message: field `handle` = `done` | `retry` | `fail` | `terminal:<Reason>` | `exit` (the
//! process exits at once with status 3), field `ms` = how long it takes. One JSON line per handler run on stdout;
//! the SDK's logs as JSON lines on stderr (`RUST_LOG`, `info` by default). A worker contract the SDK does not know
//! stops it (after its shutdown) with status 4.
//! With `SENTINEL_MASTER=<name>`, `REDIS_URL` names a sentinel, and the SDK's sentinel source asks it for the primary
//! monitored under that name (again after a failover).
//! With `TOPIC=<T>` instead of `STREAM` it is a member of topic T's group (a `TopicWorker`, its membership ttl
//! `MEMBERSHIP_TTL_MS` when set), and each run line also says the partition, the key and when the handler began and
//! returned. With `REDIS_CLUSTER=1`, `REDIS_URL` names one primary of a Redis Cluster.
//! With `MODE=publish` it is a producer instead: it publishes `MESSAGES` messages idempotently (message ids `m-0`,
//! `m-1`, ...), each retried until it answers an id, one JSON line per attempt.
//! With `OTEL_EXPORTER_OTLP_ENDPOINT` set, the SDK's spans go to it over OTLP (HTTP/protobuf, the standard
//! `OTEL_EXPORTER_OTLP_*` variables), the service named by `OTEL_SERVICE_NAME` (`pelican-conformance-rust` by
//! default); whatever way the program ends, the spans still queued are exported first (for at most 5 s).
//! With `METRICS_PORT` set (a worker of a stream), the worker's Prometheus metrics (`pelican::worker::metrics`) are
//! served at `http://127.0.0.1:<port>/metrics`.

use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;

use pelican::worker::{
    BoxError, DEFAULT_SHUTDOWN_GRACE, Message, Outcome, Producer, PublishError, Reason, Source, TopicWorker,
    TopicWorkerConfig, TopicWorkerError, Worker, WorkerConfig, pod_name,
};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .json()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    export_traces()?;
    let ended = run().await;
    flush_traces();
    ended
}

/// The tracer provider exporting over OTLP, when the program was given an endpoint.
static TRACES: OnceLock<SdkTracerProvider> = OnceLock::new();

/// Installs the OpenTelemetry SDK (a batch processor, the OTLP exporter configured by the standard variables, the
/// W3C propagator) when `OTEL_EXPORTER_OTLP_ENDPOINT` is set; without it nothing is installed.
fn export_traces() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").is_none_or(|endpoint| endpoint.is_empty()) {
        return Ok(());
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder().with_http().build()?;
    let service = std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "pelican-conformance-rust".into());
    let resource = opentelemetry_sdk::Resource::builder().with_service_name(service).build();
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let _ = TRACES.set(provider);
    Ok(())
}

/// Exports the spans still queued and stops the exporter, waiting at most 5 s.
fn flush_traces() {
    if let Some(provider) = TRACES.get()
        && let Err(e) = provider.shutdown_with_timeout(Duration::from_secs(5))
    {
        eprintln!("exporting the last spans: {e}");
    }
}

/// Ends the process with `code` once the queued spans are exported.
fn exit(code: i32) -> ! {
    flush_traces();
    std::process::exit(code)
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let var = |name: &str| std::env::var(name).map_err(|_| format!("{name} is required"));
    let client = redis::Client::open(var("REDIS_URL")?)?;
    let source = match std::env::var("SENTINEL_MASTER") {
        Ok(master_name) => Source::Sentinel { sentinel: client, master_name, primary: Default::default() },
        Err(_) if std::env::var("REDIS_CLUSTER").as_deref() == Ok("1") => {
            Source::Cluster(redis::cluster::ClusterClient::new(vec![var("REDIS_URL")?])?)
        }
        Err(_) => Source::Server(client),
    };
    if std::env::var("MODE").as_deref() == Ok("publish") {
        let messages: usize = var("MESSAGES")?.parse()?;
        return publish(&source, &var("STREAM")?, messages).await;
    }
    let consumer = std::env::var("CONSUMER").ok().or_else(pod_name).ok_or("CONSUMER (or POD_NAME) is required")?;
    let grace = std::env::var("SHUTDOWN_GRACE_MS")
        .map_or(Ok(DEFAULT_SHUTDOWN_GRACE), |ms| ms.parse().map(Duration::from_millis))?;
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM");
        term.recv().await;
    };
    let member = consumer.clone();
    let handler = move |message: Message| handle(message, consumer.clone());
    if let Ok(topic) = std::env::var("TOPIC") {
        let mut config = TopicWorkerConfig::new(topic, var("GROUP")?, member);
        config.worker.shutdown_grace = grace;
        if let Ok(ms) = std::env::var("MEMBERSHIP_TTL_MS") {
            config.ttl = Duration::from_millis(ms.parse()?);
        }
        let stopped = match TopicWorker::connect_to(source, config).await {
            Ok(worker) => worker.run(handler, shutdown).await.err(),
            Err(refused) => Some(refused),
        };
        return match stopped {
            Some(e @ (TopicWorkerError::UnknownContract(_) | TopicWorkerError::NotATopic { .. })) => {
                eprintln!("{e}");
                exit(4);
            }
            Some(other) => Err(other.into()),
            None => Ok(()),
        };
    }
    let config = WorkerConfig { shutdown_grace: grace, ..WorkerConfig::new(var("STREAM")?, var("GROUP")?, &member) };
    let worker = Worker::connect_to(source, config).await?;
    if let Ok(port) = std::env::var("METRICS_PORT") {
        serve_metrics(&worker, port.parse()?).await?;
    }
    if let Err(stopped) = worker.run(handler, shutdown).await {
        eprintln!("{stopped}");
        exit(4);
    }
    Ok(())
}

/// Serves `worker`'s metrics, as an application would: its collector in a registry, encoded at each scrape.
async fn serve_metrics(worker: &Worker, port: u16) -> std::io::Result<()> {
    let mut registry = prometheus_client::registry::Registry::default();
    pelican::worker::metrics::register(&mut registry, worker);
    let registry = std::sync::Arc::new(registry);
    let scrape = move || {
        let registry = registry.clone();
        async move {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, &registry).expect("encoding to a String");
            ([("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")], text)
        }
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let app = axum::Router::new().route("/metrics", axum::routing::get(scrape));
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(())
}

/// The wall clock in ms since the epoch: the run lines of workers on one machine compare.
fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |t| t.as_millis() as u64)
}

async fn handle(message: Message, consumer: String) -> Result<Outcome, BoxError> {
    // `HANDLE` overrides every message's `handle` (a worker that fails whatever it reads).
    let asked = std::env::var("HANDLE").ok().or_else(|| message.field_str("handle").map(str::to_string));
    let asked = asked.unwrap_or_else(|| "done".to_string());
    let ms: u64 = message.field_str("ms").and_then(|ms| ms.parse().ok()).unwrap_or(0);
    let outcome = asked.split(':').next().unwrap_or_default().to_string();
    let mut line = serde_json::json!({"id": message.id, "consumer": consumer, "outcome": outcome, "ms": ms});
    let started_at = now_ms();
    // On a topic: the partition, the key and the handler's span, so that the suite sees order per key.
    let topic_line = |line: &mut serde_json::Value, ended_at: u64| {
        if let Some(partition) = message.partition {
            line["partition"] = partition.into();
            line["key"] = message.field_str("pelican-key").into();
            line["startedAt"] = started_at.into();
            line["endedAt"] = ended_at.into();
        }
    };
    if outcome == "exit" {
        topic_line(&mut line, started_at);
        println!("{line}");
        exit(3);
    }
    tokio::time::sleep(Duration::from_millis(ms)).await;
    topic_line(&mut line, now_ms());
    println!("{line}");
    match asked.split_once(':') {
        Some(("terminal", reason)) => Ok(Outcome::Terminal(Reason::new(reason)?)),
        _ => match asked.as_str() {
            "retry" => Ok(Outcome::Retry),
            "fail" => Err(format!("asked to fail ({})", message.id).into()),
            _ => Ok(Outcome::Done),
        },
    }
}

/// Publishes `m-0` .. `m-<messages-1>` idempotently; an attempt whose outcome is unknown (the reply was lost) or that
/// found the server unavailable is tried again with the same message id, as the contract says.
async fn publish(source: &Source, stream: &str, messages: usize) -> Result<(), Box<dyn std::error::Error>> {
    let producer_id = pod_name().unwrap_or_else(|| "conformance".to_string());
    for n in 0..messages {
        let message = format!("m-{n}");
        loop {
            // A connection of its own per attempt: a lost reply leaves the last one broken.
            let producer = Producer::connect_to(source, stream).await?.idempotent(&producer_id).await?;
            match producer.publish(&message, &[("n", n.to_string())]).await {
                Ok(id) => {
                    println!("{}", serde_json::json!({"message": message, "outcome": "published", "id": id}));
                    break;
                }
                Err(PublishError::OutcomeUnknown(_) | PublishError::Unavailable(_)) => {
                    println!("{}", serde_json::json!({"message": message, "outcome": "unknown"}));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(other) => return Err(other.into()),
            }
        }
    }
    Ok(())
}
