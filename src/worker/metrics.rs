//! The worker's stats as Prometheus metrics (`prometheus-client`, feature `metrics`), read at each scrape under the
//! schema every Pelican library exports (contract/README.md, "Stats"):
//!
//!   pelican_worker_messages_total{stream, group, outcome}   done | terminal | failed | retried | abandoned
//!   pelican_worker_in_flight{stream, group}
//!
//! ```no_run
//! # async fn example(worker: pelican::worker::Worker) {
//! let mut registry = prometheus_client::registry::Registry::default();
//! pelican::worker::metrics::register(&mut registry, &worker);
//! // serve `prometheus_client::encoding::text::encode(&mut text, &registry)` on /metrics
//! # }
//! ```

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use super::{LiveStats, Worker};

/// Registers a collector of `worker`'s stats in `registry` (one per worker: their series differ by stream and group).
pub fn register(registry: &mut Registry, worker: &Worker) {
    registry.register_collector(Box::new(WorkerCollector {
        stream: worker.config.stream.clone(),
        group: worker.config.group.clone(),
        stats: worker.live_stats(),
    }));
}

struct WorkerCollector {
    stream: String,
    group: String,
    stats: LiveStats,
}

impl std::fmt::Debug for WorkerCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerCollector").field("stream", &self.stream).field("group", &self.group).finish()
    }
}

impl Collector for WorkerCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stats = self.stats.snapshot();
        let (stream, group) = (("stream", self.stream.as_str()), ("group", self.group.as_str()));
        let mut messages = encoder.encode_descriptor(
            "pelican_worker_messages",
            "Messages handled by the worker, by outcome (abandoned: given back on shutdown)",
            None,
            ConstCounter::new(0u64).metric_type(),
        )?;
        let outcomes = [
            ("done", stats.done),
            ("terminal", stats.terminal),
            ("failed", stats.failed),
            ("retried", stats.retried),
            ("abandoned", stats.abandoned),
        ];
        for (outcome, count) in outcomes {
            let labels = [stream, group, ("outcome", outcome)];
            ConstCounter::new(count).encode(messages.encode_family(&labels)?)?;
        }
        let mut in_flight = encoder.encode_descriptor(
            "pelican_worker_in_flight",
            "Messages being handled by the worker now",
            None,
            ConstGauge::new(0i64).metric_type(),
        )?;
        ConstGauge::new(self.stats.in_flight() as i64).encode(in_flight.encode_family(&[stream, group])?)
    }
}
