//! Logs, metrics and health endpoints.

mod events;
mod http;
mod metrics;
pub mod secure;
pub mod traces;

pub use events::Events;
pub use http::{Readiness, Secure, serve};
pub use metrics::{Metrics, MetricsDetail, PolicyKey, PolicySnapshot, ServerSnapshot};

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Json,
    Text,
}

/// JSON lines by default, human-readable text with `--log-format text`; `RUST_LOG` overrides the level (`info`).
pub fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        // A line logged inside a reconcile or a redrive's task carries that span's `namespace` and `policy` /
        // `redrive` under `span`, so the log sites do not repeat them.
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(true).with_span_list(false).init(),
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
    }
}
