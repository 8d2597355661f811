//! The worker's and the producer's metrics through OpenTelemetry (SPEC 23, docs/src/tracing.md "Metrics") in the
//! Rust SDK, with the OpenTelemetry SDK's in-memory exporter installed as an application would, against a real
//! Redis 7.0 and the operator's pass: the instruments' names, units, attribute sets and values a dashboard reads,
//! and that they agree with the worker's stats (the Prometheus view).
//!
//! One test, in steps: the meter provider is global, so no other test may run beside it in this binary.

#[macro_use]
mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use opentelemetry::global;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};
use pelican::api::ReclaimStrategy;
use pelican::jobs::{self, Cursor, PassSettings};
use pelican::redis::{Conn, GroupKeys, Pools, Target};
use pelican::worker::{BoxError, Message, Outcome, Producer, PublishError, Reason, Worker, WorkerConfig, WorkerStats};

/// A data point: its attributes (sorted) and its value (a histogram's count).
type Points = BTreeMap<Vec<(String, String)>, i64>;

/// The points of the instrument `name` of the meter `pelican`, with its unit.
fn points(metrics: &[ResourceMetrics], name: &str) -> (String, Points) {
    let scope = metrics.iter().flat_map(|m| m.scope_metrics()).filter(|s| s.scope().name() == "pelican");
    let metric = scope.flat_map(|s| s.metrics()).find(|m| m.name() == name);
    let metric = metric.unwrap_or_else(|| panic!("no instrument {name}"));
    let attributes = |kvs: &mut dyn Iterator<Item = &opentelemetry::KeyValue>| {
        let mut kvs: Vec<(String, String)> = kvs.map(|kv| (kv.key.to_string(), kv.value.to_string())).collect();
        kvs.sort();
        kvs
    };
    let points = match metric.data() {
        AggregatedMetrics::U64(MetricData::Sum(sum)) => {
            sum.data_points().map(|p| (attributes(&mut p.attributes()), p.value() as i64)).collect()
        }
        AggregatedMetrics::I64(MetricData::Sum(sum)) => {
            sum.data_points().map(|p| (attributes(&mut p.attributes()), p.value())).collect()
        }
        AggregatedMetrics::F64(MetricData::Histogram(histogram)) => {
            histogram.data_points().map(|p| (attributes(&mut p.attributes()), p.count() as i64)).collect()
        }
        other => panic!("{name} is not a sum or a histogram: {other:?}"),
    };
    (metric.unit().to_string(), points)
}

/// An attribute set, sorted.
fn set(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut set: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    set.sort();
    set
}

#[test]
fn workers_and_producers_record_the_messaging_conventions_metrics_and_nothing_breaks_without_an_sdk() {
    let server = Server::start(Flavor::Redis);
    let mut conn = server.conn();
    for stream in ["orders", "plain"] {
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(stream)
            .arg("billing")
            .arg("0")
            .arg("MKSTREAM")
            .query(&mut conn)
            .unwrap();
    }
    let _: () = redis::cmd("SET").arg("not-a-stream").arg("x").query(&mut conn).unwrap();
    let rt = runtime();
    let client = redis::Client::open(server.url()).unwrap();
    let config = |stream: &str| WorkerConfig {
        block: Duration::from_millis(50),
        shutdown_grace: Duration::from_millis(200),
        ..WorkerConfig::new(stream, "billing", "worker-1")
    };

    // No SDK: a publish and a handler run go through the API's no-op, and the stats count as ever.
    let stats = rt.block_on(async {
        let producer = Producer::connect(&client, "plain").await.unwrap();
        producer.publish(&[("handle", "done")]).await.unwrap();
        let worker = Worker::connect(&client, config("plain")).await.unwrap();
        let live = worker.live_stats();
        let one = async move {
            while live.snapshot().done < 1 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        worker.run(|_| async { Ok::<_, BoxError>(Outcome::Done) }, one).await.unwrap()
    });
    assert_eq!(stats.done, 1);

    // The application installs an SDK (before it makes its producers and workers).
    let exporter = InMemoryMetricExporter::default();
    let provider = SdkMeterProvider::builder().with_reader(PeriodicReader::builder(exporter.clone()).build()).build();
    global::set_meter_provider(provider.clone());

    let handled = Arc::new(AtomicUsize::new(0));
    let counter = handled.clone();
    let handler = move |message: Message| {
        counter.fetch_add(1, Ordering::SeqCst);
        let requeued = message.field("pelican-deliveries").is_some();
        async move {
            match message.field_str("handle") {
                Some("fail") => Err::<Outcome, BoxError>("the card was declined".into()),
                Some("terminal") => Ok(Outcome::Terminal(Reason::new("Gone")?)),
                Some("retry") if !requeued => Ok(Outcome::Retry),
                Some("slow") => {
                    tokio::time::sleep(Duration::from_secs(10)).await;
                    Ok(Outcome::Done)
                }
                _ => Ok(Outcome::Done),
            }
        }
    };
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
    let (stats, not_written) = rt.block_on(async {
        let producer = Producer::connect(&client, "orders").await.unwrap();
        let worker = Worker::connect(&client, config("orders")).await.unwrap();
        let mut operator = Pools::default().get(&Target::new(server.url())).await.unwrap();
        let handled = handled.clone();
        let producer_ = producer.clone();
        // The operator's passes: the failure and the retry are requeued, the failure's copy fails again and is
        // dead-lettered at the cap; then a slow handler is cut off by the shutdown.
        let script = async move {
            for handle in ["done", "fail", "retry", "terminal"] {
                producer_.publish(&[("handle", handle)]).await.unwrap();
            }
            let pass = async |operator: &mut Conn| {
                tokio::time::sleep(Duration::from_millis(200)).await;
                jobs::reclaim_pass(operator, "test", &keys, &settings, &mut Cursor::default(), &|| true).await.unwrap()
            };
            let until = async |n: usize| {
                while handled.load(Ordering::SeqCst) < n {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            };
            until(4).await;
            assert_eq!(pass(&mut operator).await.requeued, 2, "the failure and the retry");
            until(6).await;
            assert_eq!(pass(&mut operator).await.dead_lettered, 1, "the failure's copy, at the cap");
            producer_.publish(&[("handle", "slow")]).await.unwrap();
            until(7).await;
        };
        let stats = worker.run(handler, script).await.unwrap();
        let wrong = Producer::connect(&client, "not-a-stream").await.unwrap();
        let not_written = wrong.publish(&[("handle", "done")]).await.unwrap_err();
        (stats, not_written)
    });
    assert!(matches!(not_written, PublishError::Failed(_)), "{not_written}");
    assert_eq!(stats, WorkerStats { done: 2, terminal: 1, failed: 2, retried: 1, abandoned: 1 });
    provider.force_flush().unwrap();
    let metrics = exporter.get_finished_metrics().unwrap();

    let names = [("messaging.destination.name", "orders"), ("messaging.consumer.group.name", "billing")];
    let messaging = |operation: &'static str, more: &[(&'static str, &'static str)]| {
        let mut pairs = vec![
            ("messaging.system", "redis"),
            ("messaging.operation.name", operation),
            ("messaging.operation.type", operation),
        ];
        pairs.extend(names);
        pairs.extend(more);
        set(&pairs)
    };
    let (unit, consumed) = points(&metrics, "messaging.client.consumed.messages");
    assert_eq!(unit, "{message}");
    assert_eq!(consumed, Points::from([(messaging("receive", &[]), 7)]), "four, two copies and the slow one");

    let (unit, runs) = points(&metrics, "messaging.process.duration");
    assert_eq!(unit, "s");
    let outcome = |outcome| messaging("process", &[("pelican.outcome", outcome)]);
    let failed = messaging("process", &[("pelican.outcome", "failed"), ("error.type", "_OTHER")]);
    let expected = Points::from([(outcome("done"), 2), (outcome("terminal"), 1), (outcome("retried"), 1), (failed, 2)]);
    assert_eq!(runs, expected, "each run by its outcome, as pelican_worker_messages_total counts them");

    let (unit, in_flight) = points(&metrics, "pelican.worker.in_flight");
    assert_eq!(unit, "{message}");
    assert_eq!(in_flight, Points::from([(set(&names), 0)]), "none in flight once the worker stopped");
    let (unit, abandoned) = points(&metrics, "pelican.worker.abandoned");
    assert_eq!(unit, "{message}");
    assert_eq!(abandoned, Points::from([(set(&names), 1)]), "the slow one, given back on shutdown");

    let (unit, sent) = points(&metrics, "messaging.client.sent.messages");
    assert_eq!(unit, "{message}");
    let publish = |stream, error: Option<&'static str>| {
        let mut pairs = vec![
            ("messaging.system", "redis"),
            ("messaging.destination.name", stream),
            ("messaging.operation.name", "publish"),
            ("messaging.operation.type", "send"),
        ];
        pairs.extend(error.map(|error| ("error.type", error)));
        set(&pairs)
    };
    let expected = Points::from([(publish("orders", None), 5), (publish("not-a-stream", Some("failed")), 1)]);
    assert_eq!(sent, expected, "the no-SDK producer's publish is not among them");
}
