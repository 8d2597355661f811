//! A consumer built on Pelican's SDK, as a Deployment would run it: it handles each message (here: waits
//! `HANDLE_MS`) and acknowledges it, until SIGTERM, then lets in-flight messages finish for `SHUTDOWN_GRACE_MS` (20 s by default, below the Pod's 30 s) and
//! gives back the rest. With `EXIT_ON=<field>`, a message carrying that field ends the process (as a handler that
//! crashes it would). The image of the autoscaling and Pod tests (`scripts/image consumer`; tests/keda.rs,
//! tests/node.rs).
//!
//!   REDIS_URL=redis://127.0.0.1:6379/0 STREAM=orders GROUP=billing cargo run --example consumer
//!
//! The consumer's name is the Pod's (`POD_NAME`, else `HOSTNAME`), so each replica has its own PEL and the operator's reclaim
//! passes hand back what a replica scaled away left pending.

use std::time::Duration;

use pelican::worker::{DEFAULT_SHUTDOWN_GRACE, Message, Outcome, Worker, WorkerConfig, pod_name};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_string());
    let client = redis::Client::open(var("REDIS_URL", "redis://127.0.0.1:6379/0"))?;
    let handle = Duration::from_millis(var("HANDLE_MS", "20").parse()?);
    let exit_on = std::env::var("EXIT_ON").ok();
    let grace = std::env::var("SHUTDOWN_GRACE_MS")
        .map_or(Ok(DEFAULT_SHUTDOWN_GRACE), |ms| ms.parse().map(Duration::from_millis))?;
    let consumer = pod_name().unwrap_or_else(|| "consumer".to_string());
    let config = WorkerConfig {
        shutdown_grace: grace,
        ..WorkerConfig::new(var("STREAM", "orders"), var("GROUP", "billing"), consumer)
    };
    let worker = Worker::connect(&client, config).await?;
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM");
        term.recv().await;
    };
    let stats = worker
        .run(
            move |message: Message| {
                let crash = exit_on.as_deref().filter(|field| message.field(field).is_some()).map(str::to_string);
                async move {
                    if let Some(field) = crash {
                        eprintln!("{} carries the field {field} (EXIT_ON): exiting", message.id);
                        std::process::exit(3);
                    }
                    tokio::time::sleep(handle).await;
                    Ok(Outcome::Done)
                }
            },
            shutdown,
        )
        .await?;
    println!("stopped: {stats:?}");
    Ok(())
}
