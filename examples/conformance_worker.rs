//! The Rust SDK's conformance worker (contract/README.md, "The conformance worker"): the program the conformance
//! suite (tests/conformance.rs) runs for the Rust SDK, as it runs every library's.
//!
//!   REDIS_URL=redis://127.0.0.1:6379/0 STREAM=orders GROUP=billing cargo run --example conformance_worker
//!
//! The handler obeys the message: field `handle` = `done` | `retry` | `fail` | `terminal:<Reason>` | `exit` (the
//! process exits at once with status 3), field `ms` = how long it takes. One JSON line per handler run on stdout.

use std::time::Duration;

use pelican::worker::{BoxError, DEFAULT_SHUTDOWN_GRACE, Message, Outcome, Reason, Worker, WorkerConfig, pod_name};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let var = |name: &str| std::env::var(name).map_err(|_| format!("{name} is required"));
    let client = redis::Client::open(var("REDIS_URL")?)?;
    let consumer = std::env::var("CONSUMER").ok().or_else(pod_name).ok_or("CONSUMER (or POD_NAME) is required")?;
    let grace = std::env::var("SHUTDOWN_GRACE_MS")
        .map_or(Ok(DEFAULT_SHUTDOWN_GRACE), |ms| ms.parse().map(Duration::from_millis))?;
    let config = WorkerConfig { shutdown_grace: grace, ..WorkerConfig::new(var("STREAM")?, var("GROUP")?, &consumer) };
    let worker = Worker::connect(&client, config).await?;
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM");
        term.recv().await;
    };
    worker.run(move |message: Message| handle(message, consumer.clone()), shutdown).await;
    Ok(())
}

async fn handle(message: Message, consumer: String) -> Result<Outcome, BoxError> {
    let asked = message.field_str("handle").unwrap_or("done").to_string();
    let ms: u64 = message.field_str("ms").and_then(|ms| ms.parse().ok()).unwrap_or(0);
    let outcome = asked.split(':').next().unwrap_or_default().to_string();
    let line = serde_json::json!({"id": message.id, "consumer": consumer, "outcome": outcome, "ms": ms});
    if outcome == "exit" {
        println!("{line}");
        std::process::exit(3);
    }
    tokio::time::sleep(Duration::from_millis(ms)).await;
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
