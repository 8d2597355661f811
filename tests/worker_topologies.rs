//! The worker SDK where Redis really runs: on a Redis Cluster, and through Sentinel across a failover (Redis 7.0 and
//! Valkey 9.1). Done messages are acknowledged, terminal ones counted under the stream's key, on whichever node
//! serves the stream.

#[macro_use]
mod common;

use std::time::Duration;

use common::*;
use pelican::worker::{Message, Outcome, Producer, PublishError, Reason, Source, Worker, WorkerConfig};

on_both_servers!(
    a_worker_on_a_cluster_acks_and_counts_on_the_streams_node,
    a_worker_through_sentinel_keeps_working_across_a_failover,
);

const STREAM: &str = "{files}:in";
const GROUP: &str = "converters";

fn config() -> WorkerConfig {
    WorkerConfig { block: Duration::from_millis(100), ..WorkerConfig::new(STREAM, GROUP, "worker-1") }
}

/// Even `n`: done; odd `n`: terminal, `RecordNotFound`.
async fn handle(message: Message) -> Result<Outcome, pelican::worker::BoxError> {
    let n: u64 = message.field_str("n").unwrap_or_default().parse()?;
    Ok(if n.is_multiple_of(2) { Outcome::Done } else { Outcome::Terminal(Reason::new("RecordNotFound")?) })
}

fn a_worker_on_a_cluster_acks_and_counts_on_the_streams_node(flavor: Flavor) {
    let cluster = Cluster::start(flavor);
    let mut conn = cluster.conn();
    let _: () =
        redis::cmd("XGROUP").arg("CREATE").arg(STREAM).arg(GROUP).arg("0").arg("MKSTREAM").query(&mut conn).unwrap();
    let urls: Vec<String> = cluster.nodes.iter().map(|n| n.url()).collect();
    let stats = runtime().block_on(async {
        let source = Source::Cluster(redis::cluster::ClusterClient::new(urls).unwrap());
        // The bounded-publish script on a cluster: its keys share the stream's slot.
        let producer = Producer::connect_to(&source, STREAM).await.unwrap();
        for n in 0..20 {
            producer.publish(&[("n", n)]).await.unwrap();
        }
        let worker = Worker::connect_to(source, config()).await.unwrap();
        worker.run(handle, tokio::time::sleep(Duration::from_secs(3))).await.unwrap()
    });
    assert_eq!((stats.done, stats.terminal, stats.failed), (10, 10, 0), "{stats:?}");
    let pending: (i64, redis::Value, redis::Value, redis::Value) =
        redis::cmd("XPENDING").arg(STREAM).arg(GROUP).query(&mut conn).unwrap();
    assert_eq!(pending.0, 0, "everything acknowledged");
    let counted: i64 = redis::cmd("HGET")
        .arg("{files}:pelican:{files}:in:converters:terminal")
        .arg("RecordNotFound")
        .query(&mut conn)
        .unwrap();
    assert_eq!(counted, 10);
}

/// A worker and a producer on a sentinel source follow a failover. Defect (issue 65.9): the producer asked the sentinel
/// once, at connect; after a failover every publish went to the demoted primary (`READONLY`, "unavailable" for ever:
/// 0 of 29 written in 18-24 s).
fn a_worker_through_sentinel_keeps_working_across_a_failover(flavor: Flavor) {
    let mut sentinels = Sentinels::start(flavor);
    let first = sentinels.primary_port();
    let mut conn = sentinels.server(first).conn();
    let _: () =
        redis::cmd("XGROUP").arg("CREATE").arg(STREAM).arg(GROUP).arg("0").arg("MKSTREAM").query(&mut conn).unwrap();
    for n in 0..10 {
        let _: String = redis::cmd("XADD").arg(STREAM).arg("*").arg("n").arg(n).query(&mut conn).unwrap();
    }
    let sentinel_url = sentinels.url();
    let sentinel_port = sentinels.sentinels[0].0;
    // While the worker runs: a failover (the sentinels' own), then ten more messages on the new primary.
    let failover = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(2));
        let mut admin =
            redis::Client::open(format!("redis://127.0.0.1:{sentinel_port}")).unwrap().get_connection().unwrap();
        let _: () = redis::cmd("SENTINEL").arg("FAILOVER").arg(MASTER_NAME).query(&mut admin).unwrap();
    });
    let stats = runtime().block_on(async {
        let source = Source::Sentinel {
            sentinel: redis::Client::open(sentinel_url).unwrap(),
            master_name: MASTER_NAME.into(),
            primary: redis::RedisConnectionInfo::default(),
        };
        // Connected to the first primary before the failover: it must find the second by itself.
        let producer = Producer::connect_to(&source, STREAM).await.unwrap();
        let worker = Worker::connect_to(source, config()).await.unwrap();
        let run = worker.run(handle, tokio::time::sleep(Duration::from_secs(25)));
        let produce = async {
            failover.join().unwrap();
            // The sentinels agree on a new primary.
            let second = loop {
                let port = sentinels.primary_port();
                if port != first {
                    break port;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            };
            // And the old primary is a replica now (it refuses writes).
            let old = redis::Client::open(format!("redis://127.0.0.1:{first}")).unwrap();
            loop {
                // A connection each time: the sentinels kill the old primary's clients when they reconfigure it.
                let role = old.get_connection().and_then(|mut c| redis::cmd("ROLE").query::<Vec<redis::Value>>(&mut c));
                if matches!(role.as_deref(), Ok([redis::Value::BulkString(r), ..]) if r == b"slave") {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            // Then ten more messages through the producer: each published again while the server is unavailable (the
            // old primary demoted, the new one promoting), within a bounded time.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
            for n in 10..20 {
                loop {
                    match producer.publish(&[("n", n)]).await {
                        Ok(_) => break,
                        // A connection the sentinels killed (broken pipe) is an unknown outcome: on Redis 7.0 no
                        // idempotent publish, and the pipe broke before the command was written.
                        Err(PublishError::Unavailable(_) | PublishError::OutcomeUnknown(_))
                            if tokio::time::Instant::now() < deadline =>
                        {
                            tokio::time::sleep(Duration::from_millis(200)).await
                        }
                        Err(e) => panic!("message {n}: {e} (15 s after the failover)"),
                    }
                }
            }
            second
        };
        let (stats, second) = tokio::join!(run, produce);
        (stats.unwrap(), second)
    });
    let (stats, second) = stats;
    assert_ne!(second, first);
    assert_eq!((stats.done, stats.terminal), (10, 10), "every message of both primaries handled: {stats:?}");
    let mut conn = sentinels.server(second).conn();
    let pending: (i64, redis::Value, redis::Value, redis::Value) =
        redis::cmd("XPENDING").arg(STREAM).arg(GROUP).query(&mut conn).unwrap();
    assert_eq!(pending.0, 0, "everything acknowledged on the new primary");
}
