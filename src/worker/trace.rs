//! A message's trace through the stream (contract/README.md, "Trace context"): a publish is a `send <stream>` span
//! whose context travels in the entry's fields (`traceparent`, `tracestate`), and each handler run is a
//! `process <stream>` span continuing it. Everything goes through OpenTelemetry's API (the global tracer provider and
//! text-map propagator): a no-op until the application installs an SDK and a propagator.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Mutex;

use futures::FutureExt;
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::{FutureExt as _, Span, SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue, global};

use super::{BoxError, Message, Outcome};

/// The name of the SDK's tracer.
const TRACER: &str = "pelican";

/// The fields a message's trace context is carried in.
pub type TraceFields = Vec<(String, String)>;

/// The global provider's tracer, asked once per span (an application may install its SDK after a worker started).
fn tracer() -> global::BoxedTracer {
    global::tracer(TRACER)
}

/// A publish being sent: its span, and the fields that carry the span's context into the entry.
pub(crate) struct Sending {
    cx: Context,
    pub fields: TraceFields,
}

impl Sending {
    /// Starts `send <stream>` as a child of the current context. `carried`: the fields of an earlier attempt of the
    /// same idempotent publish, sent again instead of this span's (the entry keeps its first context).
    pub fn start(stream: &str, attributes: Vec<KeyValue>, carried: Option<TraceFields>) -> Sending {
        let tracer = tracer();
        let mut span = tracer.span_builder(format!("send {stream}")).with_kind(SpanKind::Producer).start(&tracer);
        // Without an SDK the span records nothing: its attributes are not even built.
        if span.is_recording() {
            let mut attributes = attributes;
            // A topic's partition `{T:i}`.
            let partition = stream.strip_prefix('{').and_then(|s| s.strip_suffix('}'));
            if let Some((topic, _)) = partition.and_then(|s| s.rsplit_once(':')) {
                attributes.push(KeyValue::new("pelican.topic", topic.to_string()));
            }
            attributes.extend([
                KeyValue::new("messaging.system", "redis"),
                KeyValue::new("messaging.destination.name", stream.to_string()),
                KeyValue::new("messaging.operation.type", "send"),
                KeyValue::new("messaging.operation.name", "publish"),
            ]);
            span.set_attributes(attributes);
        }
        let cx = Context::current_with_span(span);
        let fields = carried.unwrap_or_else(|| {
            let mut fields = Fields(Vec::new());
            global::get_text_map_propagator(|propagator| propagator.inject_context(&cx, &mut fields));
            fields.0
        });
        Sending { cx, fields }
    }

    /// Ends the span: the entry's id when there is one (not for a batch).
    pub fn sent(self, id: Option<&str>) {
        let span = self.cx.span();
        if let Some(id) = id {
            span.set_attribute(KeyValue::new("messaging.message.id", id.to_string()));
        }
        span.end();
    }

    /// Ends the span with the error.
    pub fn failed(self, error: &impl std::fmt::Display) {
        let span = self.cx.span();
        span.set_status(Status::error(error.to_string()));
        span.end();
    }
}

/// The trace fields of idempotent publishes whose outcome was unknown or unavailable, by message id, so that a
/// publish of the same message id sends them again; the last [`KEPT`] at most.
#[derive(Default)]
pub(crate) struct Carried {
    fields: Mutex<(HashMap<String, TraceFields>, VecDeque<String>)>,
}

/// How many message ids [`Carried`] keeps.
const KEPT: usize = 1024;

impl Carried {
    pub fn take(&self, message_id: &str) -> Option<TraceFields> {
        self.fields.lock().expect("carried lock").0.remove(message_id)
    }

    pub fn keep(&self, message_id: &str, fields: TraceFields) {
        let mut guard = self.fields.lock().expect("carried lock");
        let (kept, order) = &mut *guard;
        if kept.insert(message_id.to_string(), fields).is_none() {
            order.push_back(message_id.to_string());
        }
        while order.len() > KEPT {
            if let Some(oldest) = order.pop_front() {
                kept.remove(&oldest);
            }
        }
    }
}

/// Where a handler runs: the consumer's names, for the span's attributes.
pub(crate) struct Processing<'a> {
    pub stream: &'a str,
    pub group: &'a str,
    pub consumer: &'a str,
}

impl Processing<'_> {
    /// Runs `handler` on `message` inside `process <stream>`, continuing the trace the entry carries, and ends the
    /// span with the handler's outcome. A panic is caught and answered as the `Err` of the outer result.
    pub async fn run<H, Fut>(&self, handler: &H, message: Message) -> std::thread::Result<Result<Outcome, BoxError>>
    where
        H: Fn(Message) -> Fut,
        Fut: Future<Output = Result<Outcome, BoxError>>,
    {
        let parent = global::get_text_map_propagator(|propagator| propagator.extract(&Entry(&message)));
        let attributes = || {
            let mut attributes = vec![
                KeyValue::new("messaging.system", "redis"),
                KeyValue::new("messaging.destination.name", self.stream.to_string()),
                KeyValue::new("messaging.operation.type", "process"),
                KeyValue::new("messaging.operation.name", "process"),
                KeyValue::new("messaging.message.id", message.id.clone()),
                KeyValue::new("messaging.consumer.group.name", self.group.to_string()),
                KeyValue::new("messaging.client.id", self.consumer.to_string()),
            ];
            if let Some(key) = message.field_str(crate::keys::KEY_FIELD) {
                attributes.push(KeyValue::new("pelican.key", key.to_string()));
            }
            attributes
        };
        let tracer = tracer();
        let mut span = tracer
            .span_builder(format!("process {}", self.stream))
            .with_kind(SpanKind::Consumer)
            .start_with_context(&tracer, &parent);
        // Without an SDK the span records nothing: its attributes are not even built.
        if span.is_recording() {
            span.set_attributes(attributes());
        }
        let cx = parent.with_span(span);
        // Called at the first poll, inside the span's context and the catch: a handler that panics before it
        // returns its future fails its message like any other panic.
        let running = async move { handler(message).await };
        let result = AssertUnwindSafe(running.with_context(cx.clone())).catch_unwind().await;
        let span = cx.span();
        let outcome = match &result {
            Ok(Ok(Outcome::Done)) => "done",
            Ok(Ok(Outcome::Retry)) => "retry",
            Ok(Ok(Outcome::Terminal(reason))) => {
                span.set_attribute(KeyValue::new("pelican.reason", reason.to_string()));
                "terminal"
            }
            Ok(Err(e)) => {
                span.set_status(Status::error(e.to_string()));
                "fail"
            }
            Err(_) => {
                span.set_status(Status::error("the handler panicked"));
                "fail"
            }
        };
        span.set_attribute(KeyValue::new("pelican.outcome", outcome));
        span.end();
        result
    }
}

/// An injector into the fields added to an entry.
struct Fields(TraceFields);

impl Injector for Fields {
    /// An empty value (the W3C propagator's `tracestate` without entries) adds no field.
    fn set(&mut self, key: &str, value: String) {
        if !value.is_empty() {
            self.0.push((key.to_string(), value));
        }
    }
}

/// An extractor from an entry's fields (the first value of a name, as [`Message::field`]).
struct Entry<'a>(&'a Message);

impl Extractor for Entry<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.field_str(key)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.fields.iter().filter_map(|(name, _)| std::str::from_utf8(name).ok()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carried_fields_are_kept_for_the_last_message_ids_only() {
        let carried = Carried::default();
        for n in 0..KEPT + 1 {
            carried.keep(&format!("m-{n}"), vec![("traceparent".into(), n.to_string())]);
        }
        assert_eq!(carried.take("m-0"), None, "the oldest was dropped");
        assert_eq!(carried.take(&format!("m-{KEPT}")), Some(vec![("traceparent".into(), KEPT.to_string())]));
        assert_eq!(carried.take(&format!("m-{KEPT}")), None, "taken once");
    }
}
