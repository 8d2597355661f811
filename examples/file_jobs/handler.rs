//! Seed 000's "file jobs" handler: a message names a job; the job record decides what happens.
//!
//! - record exists -> do the heavy work -> `Done`;
//! - record gone (the job was cancelled and cleaned up) -> `Terminal(RecordNotFound)`, no heavy work started;
//! - the lookup itself failed (storage down) -> the original error goes back to the dispatch layer: no ACK, retry.
//!
//! The handler never acknowledges anything itself; the SDK's dispatch layer does.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

use pelican::worker::{BoxError, Message, Outcome};
use redis::AsyncCommands;
use redis::aio::ConnectionManager;

/// Where job records live.
pub trait JobStore: Send + Sync {
    /// `Ok(None)` when the record does not exist; `Err` when the store could not answer.
    fn lookup(&self, job_id: &str) -> impl Future<Output = Result<Option<JobRecord>, BoxError>> + Send;
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobRecord {
    pub path: String,
}

/// Records as Redis hashes `filejob:<job id>` with a `path` field.
pub struct RedisJobStore(pub ConnectionManager);

impl JobStore for RedisJobStore {
    async fn lookup(&self, job_id: &str) -> Result<Option<JobRecord>, BoxError> {
        let path: Option<String> = self.0.clone().hget(format!("filejob:{job_id}"), "path").await?;
        Ok(path.map(|path| JobRecord { path }))
    }
}

pub struct FileJobs<S> {
    pub store: S,
    /// How many times the heavy work began; a terminal message must never start it.
    pub heavy_work_started: AtomicU64,
}

impl<S: JobStore> FileJobs<S> {
    pub fn new(store: S) -> Self {
        FileJobs { store, heavy_work_started: AtomicU64::new(0) }
    }

    pub async fn handle(&self, message: Message) -> Result<Outcome, BoxError> {
        let Some(job_id) = message.field_str("job_id") else {
            // A message without a job id will never succeed either.
            return Ok(Outcome::terminal("MalformedMessage"));
        };
        let Some(record) = self.store.lookup(job_id).await? else {
            return Ok(Outcome::terminal("RecordNotFound"));
        };
        self.heavy_work_started.fetch_add(1, Ordering::Relaxed);
        process(&record).await;
        Ok(Outcome::Done)
    }
}

/// Stands in for converting the file: the example has no files to convert.
async fn process(record: &JobRecord) {
    tracing::debug!(path = %record.path, "processing file job");
}
