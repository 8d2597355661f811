//! A consumer built on Pelican's SDK, as a Deployment would run it: it handles each message (here: waits
//! `HANDLE_MS`) and acknowledges it, until SIGTERM, then lets in-flight messages finish. The image of the
//! autoscaling test (`scripts/image consumer`), which KEDA scales on the backlog Pelican serves.
//!
//!   REDIS_URL=redis://127.0.0.1:6379/0 STREAM=orders GROUP=billing cargo run --example consumer
//!
//! The consumer's name is the Pod's (`HOSTNAME`), so each replica has its own PEL and the operator's reclaim
//! passes hand back what a replica scaled away left pending.

use std::time::Duration;

use pelican::worker::{Message, Outcome, Worker, WorkerConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_string());
    let client = redis::Client::open(var("REDIS_URL", "redis://127.0.0.1:6379/0"))?;
    let handle = Duration::from_millis(var("HANDLE_MS", "20").parse()?);
    let config = WorkerConfig::new(var("STREAM", "orders"), var("GROUP", "billing"), var("HOSTNAME", "consumer"));
    let worker = Worker::connect(&client, config).await?;
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM");
        term.recv().await;
    };
    let stats = worker
        .run(
            move |_message: Message| async move {
                tokio::time::sleep(handle).await;
                Ok(Outcome::Done)
            },
            shutdown,
        )
        .await;
    println!("stopped: {stats:?}");
    Ok(())
}
