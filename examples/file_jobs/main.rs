//! An example worker built on Pelican's SDK, processing "file jobs" like the field report it grew from.
//!
//!   cargo run --example file_jobs -- redis://127.0.0.1:6379/0 files converters worker-1
//!
//! Apply examples/file_jobs/policy.yaml first (pointing at the same server): the policy owns the group.
//! Then: `redis-cli XADD files '*' job_id 42` with and without `redis-cli HSET filejob:42 path /tmp/a.pdf`.
//! Stop it with Ctrl-C: it stops reading, lets in-flight jobs finish, and acknowledges nothing unfinished.

mod handler;

use std::sync::Arc;

use handler::{FileJobs, RedisJobStore};
use pelican::worker::{Worker, WorkerConfig};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().json().init();
    let mut args = std::env::args().skip(1);
    let url = args.next().unwrap_or_else(|| "redis://127.0.0.1:6379/0".into());
    let stream = args.next().unwrap_or_else(|| "files".into());
    let group = args.next().unwrap_or_else(|| "converters".into());
    let consumer = args.next().unwrap_or_else(|| "worker-1".into());

    let client = redis::Client::open(url)?;
    // The group belongs to the ConsumerGroupPolicy (examples/file_jobs/policy.yaml), which creates it at its
    // startId; the worker only reads. Until the policy is Ready, reads fail with NOGROUP and are retried.
    let jobs = Arc::new(FileJobs::new(RedisJobStore(client.get_connection_manager().await?)));
    let worker = Worker::connect(&client, WorkerConfig::new(stream, group, consumer)).await?;
    let stats = worker
        .run(
            move |message| {
                let jobs = jobs.clone();
                async move { jobs.handle(message).await }
            },
            async {
                let _ = tokio::signal::ctrl_c().await;
            },
        )
        .await?;
    println!("{stats:?}");
    Ok(())
}
