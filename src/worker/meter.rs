//! The worker's and the producer's metrics through OpenTelemetry's API (SPEC 23; docs/src/tracing.md, "Metrics"):
//! the messaging conventions' instruments and Pelican's own, the same names, units and attributes in every library.
//! They are recorded where the stats are counted, so that they agree with the Prometheus names of [`super::metrics`].
//! A no-op until the application installs an SDK's meter provider, before it makes its workers and producers (their
//! instruments are made with them).

use std::time::Duration;

use opentelemetry::metrics::{Counter, Histogram, Meter, UpDownCounter};
use opentelemetry::{KeyValue, global};

use super::producer::PublishError;

/// The name of the SDK's meter (its tracer's).
const METER: &str = "pelican";

/// `messaging.process.duration`'s buckets, in seconds: the conventions' advice.
const DURATION_BUCKETS: [f64; 14] = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0];

fn meter() -> Meter {
    global::meter(METER)
}

/// How a handler run ended, as the stats count it: `pelican.outcome` (the Prometheus `outcome` label), and
/// `error.type` when the handler failed.
#[derive(Clone, Copy)]
pub(crate) enum Ended {
    Done,
    Terminal,
    Retried,
    /// The handler answered an error (its type is not known here: `_OTHER`, as the conventions say).
    Errored,
    Panicked,
    /// The handler's outcome could not be written: the message stays pending, failed.
    NotWritten,
}

/// A worker's instruments, with their attribute sets made once (a handler run allocates none).
pub(crate) struct WorkerMeter {
    consumed: Counter<u64>,
    duration: Histogram<f64>,
    in_flight: UpDownCounter<i64>,
    abandoned: Counter<u64>,
    /// The stream and the group (`pelican.worker.in_flight`, `pelican.worker.abandoned`).
    names: Vec<KeyValue>,
    /// `messaging.client.consumed.messages`'.
    receive: Vec<KeyValue>,
    /// `messaging.process.duration`'s, by [`Ended`] in its order.
    process: [Vec<KeyValue>; 6],
}

impl WorkerMeter {
    pub fn new(stream: &str, group: &str) -> WorkerMeter {
        let meter = meter();
        let names = vec![
            KeyValue::new("messaging.destination.name", stream.to_string()),
            KeyValue::new("messaging.consumer.group.name", group.to_string()),
        ];
        let messaging = |operation: &'static str, more: &[(&'static str, &'static str)]| {
            let mut attributes = vec![
                KeyValue::new("messaging.system", "redis"),
                KeyValue::new("messaging.operation.name", operation),
                KeyValue::new("messaging.operation.type", operation),
            ];
            attributes.extend(names.iter().cloned());
            attributes.extend(more.iter().map(|(key, value)| KeyValue::new(*key, *value)));
            attributes
        };
        let outcome = |outcome| messaging("process", &[("pelican.outcome", outcome)]);
        let failed = |error| messaging("process", &[("pelican.outcome", "failed"), ("error.type", error)]);
        WorkerMeter {
            consumed: meter
                .u64_counter("messaging.client.consumed.messages")
                .with_unit("{message}")
                .with_description("Messages delivered to the worker's handlers")
                .build(),
            duration: meter
                .f64_histogram("messaging.process.duration")
                .with_unit("s")
                .with_description("Handler runs, by how they ended (pelican.outcome)")
                .with_boundaries(DURATION_BUCKETS.to_vec())
                .build(),
            in_flight: meter
                .i64_up_down_counter("pelican.worker.in_flight")
                .with_unit("{message}")
                .with_description("Messages being handled by the worker now")
                .build(),
            abandoned: meter
                .u64_counter("pelican.worker.abandoned")
                .with_unit("{message}")
                .with_description("Messages given back unfinished on shutdown, their delivery not counted")
                .build(),
            receive: messaging("receive", &[]),
            process: [
                outcome("done"),
                outcome("terminal"),
                outcome("retried"),
                failed("_OTHER"),
                failed("panic"),
                outcome("failed"),
            ],
            names,
        }
    }

    /// A message handed to a handler.
    pub fn started(&self) {
        self.consumed.add(1, &self.receive);
        self.in_flight.add(1, &self.names);
    }

    /// Messages out of flight: settled, or left to the give-back on shutdown.
    pub fn landed(&self, count: usize) {
        self.in_flight.add(-(count as i64), &self.names);
    }

    /// A handler run that took `ran`, counted as `ended`.
    pub fn ended(&self, ended: Ended, ran: Duration) {
        self.duration.record(ran.as_secs_f64(), &self.process[ended as usize]);
    }

    /// Messages given back on shutdown.
    pub fn abandoned(&self, count: u64) {
        self.abandoned.add(count, &self.names);
    }
}

/// A producer's instrument, with its attribute sets made once.
pub(crate) struct ProducerMeter {
    sent: Counter<u64>,
    /// Written; then not written (or not known to be), by `error.type`: refused, unavailable, unknown, failed.
    attributes: [Vec<KeyValue>; 5],
}

impl ProducerMeter {
    pub fn new(stream: &str) -> ProducerMeter {
        let attributes = |error: Option<&'static str>| {
            let mut attributes = vec![
                KeyValue::new("messaging.system", "redis"),
                KeyValue::new("messaging.destination.name", stream.to_string()),
                KeyValue::new("messaging.operation.name", "publish"),
                KeyValue::new("messaging.operation.type", "send"),
            ];
            attributes.extend(error.map(|error| KeyValue::new("error.type", error)));
            attributes
        };
        ProducerMeter {
            sent: meter()
                .u64_counter("messaging.client.sent.messages")
                .with_unit("{message}")
                .with_description("Entries published, with error.type when not written (or not known to be)")
                .build(),
            attributes: [
                attributes(None),
                attributes(Some("refused")),
                attributes(Some("unavailable")),
                attributes(Some("unknown")),
                attributes(Some("failed")),
            ],
        }
    }

    /// `count` entries written.
    pub fn sent(&self, count: usize) {
        self.add(count, 0);
    }

    /// `count` entries not written, or not known to be: `error.type` is the publish's outcome.
    pub fn not_sent(&self, count: usize, error: &PublishError) {
        let set = match error {
            PublishError::Refused { .. } => 1,
            PublishError::Unavailable(_) => 2,
            PublishError::OutcomeUnknown(_) => 3,
            PublishError::Failed(_) => 4,
        };
        self.add(count, set);
    }

    /// `count` entries of a batch the backlog bound refused (the others were written).
    pub fn refused(&self, count: usize) {
        self.add(count, 1);
    }

    fn add(&self, count: usize, set: usize) {
        if count > 0 {
            self.sent.add(count as u64, &self.attributes[set]);
        }
    }
}
