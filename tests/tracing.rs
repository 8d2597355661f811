//! A message's trace through the stream (SPEC 23, contract/README.md "Trace context") in the Rust SDK, with the
//! OpenTelemetry SDK's in-memory exporter and the W3C propagator installed as an application would, against a real
//! Redis 7.0: what the entry carries, the spans of the publish and of each handler run, and the operator's passes
//! (a requeue, a dead letter, a redrive) in the same trace.
//!
//! One test, in steps: the tracer provider and the propagator are global, so no other test may run beside it in
//! this binary.

#[macro_use]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, global};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use pelican::api::ReclaimStrategy;
use pelican::jobs::redrive::{self, Destination, Plan, Progress};
use pelican::jobs::{self, Cursor, PassSettings};
use pelican::redis::{Conn, GroupKeys, Pools, Target};
use pelican::worker::{BoxError, Message, Outcome, Producer, Reason, Worker, WorkerConfig};

fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes.iter().find(|kv| kv.key.as_str() == key).map(|kv| kv.value.to_string())
}

#[test]
fn a_message_is_one_trace_from_its_publish_through_each_handler_run_and_nothing_without_an_sdk() {
    let server = Server::start(Flavor::Redis);
    let mut conn = server.conn();
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg("orders")
        .arg("billing")
        .arg("0")
        .arg("MKSTREAM")
        .query(&mut conn)
        .unwrap();
    let rt = runtime();
    let client = redis::Client::open(server.url()).unwrap();
    let producer = rt.block_on(Producer::connect(&client, "orders")).unwrap();

    // No SDK configured: nothing added to the entry.
    let plain = rt.block_on(producer.publish(&[("handle", "done")])).unwrap();
    let fields = xrange(&mut conn, "orders");
    assert!(field(&fields[0], "traceparent").is_none(), "no trace without an SDK: {fields:?}");
    let _: i64 = redis::cmd("XDEL").arg("orders").arg(&plain).query(&mut conn).unwrap();

    // The application installs an SDK and the W3C propagator, and publishes inside a request's span.
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder().with_simple_exporter(exporter.clone()).build();
    global::set_tracer_provider(provider.clone());
    global::set_text_map_propagator(TraceContextPropagator::new());
    let request = global::tracer("shop").start("checkout");
    let request_cx = Context::current_with_span(request);
    let trace_id = request_cx.span().span_context().trace_id();
    let ids: Vec<String> = ["done", "fail", "terminal:Gone"]
        .iter()
        .map(|handle| {
            let _attached = request_cx.clone().attach();
            rt.block_on(producer.publish(&[("handle", *handle)])).unwrap()
        })
        .collect();
    request_cx.span().end();
    let entries = xrange(&mut conn, "orders");
    for entry in &entries {
        let parent = String::from_utf8(field(entry, "traceparent").expect("a traceparent field").to_vec()).unwrap();
        assert!(parent.contains(&trace_id.to_string()), "the request's trace: {parent}");
        assert_eq!(entry.1.last().unwrap().0, b"traceparent", "after the application's fields: {entry:?}");
    }

    // A worker runs each message; the handler obeys `handle`.
    let handled = Arc::new(AtomicUsize::new(0));
    let counter = handled.clone();
    let handler = move |message: Message| {
        counter.fetch_add(1, Ordering::SeqCst);
        async move {
            match message.field_str("handle") {
                Some("fail") => Err::<Outcome, BoxError>("the card was declined".into()),
                Some("terminal:Gone") => Ok(Outcome::Terminal(Reason::new("Gone")?)),
                _ => Ok(Outcome::Done),
            }
        }
    };
    rt.block_on(async {
        let config =
            WorkerConfig { block: Duration::from_millis(100), ..WorkerConfig::new("orders", "billing", "worker-1") };
        let worker = Worker::connect(&client, config).await.unwrap();
        let all = async {
            while handled.load(Ordering::SeqCst) < 3 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        worker.run(handler, all).await.unwrap();
    });
    provider.force_flush().unwrap();

    let spans = exporter.get_finished_spans().unwrap();
    let sends: Vec<&SpanData> = spans.iter().filter(|s| s.name == "send orders").collect();
    let runs: Vec<&SpanData> = spans.iter().filter(|s| s.name == "process orders").collect();
    assert_eq!((sends.len(), runs.len()), (3, 3), "{:?}", spans.iter().map(|s| &s.name).collect::<Vec<_>>());
    let checkout = spans.iter().find(|s| s.name == "checkout").unwrap();
    for (id, send) in ids.iter().zip(&sends) {
        assert_eq!(send.span_kind, SpanKind::Producer);
        assert_eq!(send.parent_span_id, checkout.span_context.span_id(), "a publish is a child of the request");
        assert_eq!(attribute(send, "messaging.message.id").as_deref(), Some(id.as_str()));
        assert_eq!(attribute(send, "messaging.destination.name").as_deref(), Some("orders"));
        let run = runs
            .iter()
            .find(|r| attribute(r, "messaging.message.id").as_deref() == Some(id.as_str()))
            .unwrap_or_else(|| panic!("a process span for {id}"));
        assert_eq!(run.span_kind, SpanKind::Consumer);
        assert_eq!(run.span_context.trace_id(), trace_id, "one trace from the request to the handler");
        assert_eq!(run.parent_span_id, send.span_context.span_id(), "each run continues its publish");
        assert_eq!(attribute(run, "messaging.consumer.group.name").as_deref(), Some("billing"));
        assert_eq!(attribute(run, "messaging.client.id").as_deref(), Some("worker-1"));
    }
    let run_of = |n: usize| runs.iter().find(|r| attribute(r, "messaging.message.id") == Some(ids[n].clone())).unwrap();
    assert_eq!(attribute(run_of(0), "pelican.outcome").as_deref(), Some("done"));
    assert_eq!(run_of(0).status, Status::Unset);
    assert_eq!(attribute(run_of(1), "pelican.outcome").as_deref(), Some("fail"));
    assert_eq!(run_of(1).status, Status::error("the card was declined"));
    assert_eq!(attribute(run_of(2), "pelican.outcome").as_deref(), Some("terminal"));
    assert_eq!(attribute(run_of(2), "pelican.reason").as_deref(), Some("Gone"));

    // The operator's passes join the failed message's trace: requeued once, dead-lettered at the cap, redriven.
    let send_of_failed = sends[1].span_context.span_id();
    exporter.reset();
    pelican::telemetry::traces::install(provider.clone());
    let keys = GroupKeys { stream: "orders", group: "billing", dead_letter: "orders:dlq" };
    let settings = PassSettings {
        min_idle: Duration::from_millis(100),
        max_per_pass: 1000,
        max_deliveries: 2,
        strategy: ReclaimStrategy::Requeue,
        dead_letter_max_len: None,
        backoff: None,
        handover_grace: Duration::ZERO,
        slice: Duration::MAX,
    };
    let pass = |conn: &mut Conn| {
        std::thread::sleep(Duration::from_millis(200));
        let mut cursor = Cursor::default();
        rt.block_on(jobs::reclaim_pass(conn, "test", &keys, &settings, &mut cursor, &|| true)).unwrap()
    };
    let mut operator = rt.block_on(Pools::default().get(&Target::new(server.url()))).unwrap();
    assert_eq!(pass(&mut operator).requeued, 1, "the failed message is retried");
    let copy = read_new(&mut conn, "orders", "billing", "worker-2", 10);
    assert_eq!(copy.len(), 1, "the copy is delivered: {copy:?}");
    assert_eq!(pass(&mut operator).dead_lettered, 1, "its second delivery reached the cap");
    let plan = Plan {
        dead_letter: "orders:dlq".into(),
        progress_key: "orders:dlq:redrive:default/again".into(),
        lock_key: "orders:dlq:redrive-lock".into(),
        full_name: "default/again".into(),
        uid: "uid-1".into(),
        name: "again".into(),
        target: Destination::Stream("orders".into()),
        reasons: Vec::new(),
        from: None,
        to: None,
        max_messages: None,
        cluster: false,
        keys: None,
    };
    let redriven = rt.block_on(async {
        redrive::claim(&mut operator, "test", &plan, None).await.unwrap();
        let mut destinations = Vec::new();
        redrive::step(&mut operator, "test", &plan, "+", &Progress::default(), 100, &mut destinations).await.unwrap()
    });
    assert_eq!(redriven.moved, 1);
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let names: Vec<&str> = spans.iter().map(|s| s.name.as_ref()).collect();
    assert_eq!(names, ["requeue orders", "dead letter orders", "redrive orders"], "in the order they happened");
    for span in &spans {
        assert_eq!(span.span_context.trace_id(), trace_id, "{} is in the message's trace", span.name);
        assert_eq!(span.parent_span_id, send_of_failed, "{} continues the publish", span.name);
        assert_eq!(attribute(span, "messaging.system").as_deref(), Some("redis"));
    }
    assert_eq!(attribute(&spans[0], "messaging.message.id"), Some(ids[1].clone()));
    assert_eq!(attribute(&spans[0], "pelican.new_id"), Some(copy[0].clone()));
    assert_eq!(attribute(&spans[0], "messaging.consumer.group.name").as_deref(), Some("billing"));
    assert_eq!(attribute(&spans[1], "messaging.message.id"), Some(copy[0].clone()));
    assert_eq!(attribute(&spans[1], "pelican.reason").as_deref(), Some("MaxDeliveriesExceeded"));
    assert_eq!(attribute(&spans[1], "pelican.deliveries").as_deref(), Some("2"));
    let letter = attribute(&spans[1], "pelican.new_id").unwrap();
    assert_eq!(attribute(&spans[2], "messaging.message.id"), Some(letter));
    assert_eq!(attribute(&spans[2], "pelican.redrive").as_deref(), Some("default/again"));
    assert_eq!(attribute(&spans[2], "pelican.reason").as_deref(), Some("MaxDeliveriesExceeded"));
    // The redriven entry still carries the trace: its next handler run continues it.
    let back = xrange(&mut conn, "orders");
    let last = back.last().unwrap();
    let parent = String::from_utf8(field(last, "traceparent").unwrap().to_vec()).unwrap();
    assert!(parent.contains(&trace_id.to_string()), "{parent}");
}
