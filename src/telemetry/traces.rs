//! The operator's passes in a message's trace (SPEC 23): a requeue, a hand-over, a dead letter and a redrive are
//! spans of the trace the message carries in its fields (`traceparent` / `tracestate`, contract/README.md "Trace
//! context"), children of the context the producer put there, beside the workers' `process` spans.
//!
//! Off unless the operator exports traces ([`install`]: `OTEL_EXPORTER_OTLP_ENDPOINT` set, the chart's
//! `tracing.otlpEndpoint`); then the reclaim script says, per message it moved, its trace context (a few short
//! strings per entry of a page it already reads), and each becomes a span handed to the SDK's batch processor, whose
//! queue is bounded and drops what it cannot hold: a page of dead letters costs a page of span objects, never an
//! exporter call held by the pass.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

use opentelemetry::global;
use opentelemetry::trace::{Span, SpanKind, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;

static ON: AtomicBool = AtomicBool::new(false);

/// Whether the operator records its passes into messages' traces.
pub fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Makes `provider` the process's tracer provider, with the W3C propagator, and turns the operator's spans on.
pub fn install(provider: SdkTracerProvider) {
    global::set_tracer_provider(provider);
    global::set_text_map_propagator(TraceContextPropagator::new());
    ON.store(true, Ordering::Relaxed);
}

/// An OTLP exporter (HTTP/protobuf) configured by the standard `OTEL_EXPORTER_OTLP_*` variables, when
/// `OTEL_EXPORTER_OTLP_ENDPOINT` (or its traces variant) is set; the service is named by `OTEL_SERVICE_NAME`,
/// `pelican-operator` by default.
pub fn from_env() -> anyhow::Result<Option<SdkTracerProvider>> {
    let set = |name: &str| std::env::var_os(name).is_some_and(|v| !v.is_empty());
    if !set("OTEL_EXPORTER_OTLP_ENDPOINT") && !set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
        return Ok(None);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder().with_http().build()?;
    let service = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "pelican-operator".into());
    let resource = opentelemetry_sdk::Resource::builder().with_service_name(service).build();
    Ok(Some(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build()))
}

/// What the operator did to one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// A copy at the end of the stream; the original acknowledged.
    Requeued,
    /// Claimed for another consumer (Reassign).
    Reassigned,
    /// Moved to the dead-letter stream.
    DeadLettered,
    /// Put back from the dead-letter stream (a redrive).
    Redriven,
}

impl Action {
    fn name(self) -> &'static str {
        match self {
            Action::Requeued => "requeue",
            Action::Reassigned => "hand over",
            Action::DeadLettered => "dead letter",
            Action::Redriven => "redrive",
        }
    }

    /// The messaging conventions' operation type: a new entry written is a `send`, the rest settle the delivery.
    fn operation_type(self) -> &'static str {
        match self {
            Action::Requeued | Action::Redriven => "send",
            Action::Reassigned | Action::DeadLettered => "settle",
        }
    }

    /// The reclaim script's name for it.
    pub fn from_script(what: &str) -> Option<Action> {
        match what {
            "requeued" => Some(Action::Requeued),
            "reassigned" => Some(Action::Reassigned),
            "deadLettered" => Some(Action::DeadLettered),
            _ => None,
        }
    }
}

/// One message the operator moved, with the trace context it carries (empty when it carries none).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Move {
    pub action: Action,
    /// The entry moved.
    pub id: String,
    /// Where to: the copy's or the dead letter's id, or the consumer it was handed to.
    pub to: String,
    pub traceparent: String,
    pub tracestate: String,
    /// A dead letter's reason; empty otherwise.
    pub reason: String,
    /// The deliveries it had (counting the hand-over's).
    pub deliveries: u64,
}

/// Where the moves happened: the stream written to, and the group whose pass moved them or the redrive
/// (`namespace/name`) that did.
pub struct Place<'a> {
    pub stream: &'a str,
    pub group: Option<&'a str>,
    pub redrive: Option<&'a str>,
}

/// Records one span per move of a message that carries a trace, as a child of its context, spanning the script call
/// that moved it (`sent`: when the call was sent; ended now, at its reply): the move happened atomically somewhere
/// in it, so the span starts before anything a worker does with the copy. Moves of messages without a trace are left
/// out: there is no trace to join.
pub fn record(place: &Place<'_>, moves: &[Move], sent: SystemTime) {
    if !on() {
        return;
    }
    let tracer = global::tracer("pelican-operator");
    let now = SystemTime::now();
    for m in moves.iter().filter(|m| !m.traceparent.is_empty()) {
        let mut carrier = HashMap::from([("traceparent".to_string(), m.traceparent.clone())]);
        if !m.tracestate.is_empty() {
            carrier.insert("tracestate".to_string(), m.tracestate.clone());
        }
        let parent = global::get_text_map_propagator(|p| p.extract_with_context(&Context::new(), &carrier));
        if !parent.span().span_context().is_valid() {
            continue;
        }
        let mut attributes = vec![
            KeyValue::new("messaging.system", "redis"),
            KeyValue::new("messaging.destination.name", place.stream.to_string()),
            KeyValue::new("messaging.operation.type", m.action.operation_type()),
            KeyValue::new("messaging.operation.name", m.action.name().replace(' ', "_")),
            KeyValue::new("messaging.message.id", m.id.clone()),
            KeyValue::new("pelican.deliveries", m.deliveries as i64),
        ];
        let to = match m.action {
            Action::Reassigned => "pelican.consumer",
            _ => "pelican.new_id",
        };
        attributes.push(KeyValue::new(to, m.to.clone()));
        if let Some(group) = place.group {
            attributes.push(KeyValue::new("messaging.consumer.group.name", group.to_string()));
        }
        if let Some(redrive) = place.redrive {
            attributes.push(KeyValue::new("pelican.redrive", redrive.to_string()));
        }
        if !m.reason.is_empty() {
            attributes.push(KeyValue::new("pelican.reason", m.reason.clone()));
        }
        let mut span = tracer
            .span_builder(format!("{} {}", m.action.name(), place.stream))
            .with_kind(SpanKind::Internal)
            .with_start_time(sent)
            .with_attributes(attributes)
            .start_with_context(&tracer, &parent);
        span.end_with_timestamp(now);
    }
}
