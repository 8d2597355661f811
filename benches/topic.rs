//! A topic beside one stream, on a Redis Cluster of three primaries started here: publish and consume rates with
//! topics of 1, 3 and 12 partitions and with one plain stream (the same SDK, the same Cluster), the share of each
//! shard's commands and CPU while a 12-partition topic is consumed, and a rebalance's time (a member joining, a
//! member dying) until every moved partition's messages are handled again.
//!
//!   cargo bench --bench topic [-- <messages>]
//!
//! The topic's settings are written here as the operator writes them (no API server needed).

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pelican::keys::{owners_key, partition_stream, settings_key, topic_key};
use pelican::worker::{
    Message, Outcome, Producer, Source, TopicProducer, TopicWorker, TopicWorkerConfig, Worker, WorkerConfig,
};
use redis::cluster::ClusterClient;

const GROUP: &str = "g";
const KEYS: usize = 1_000;
const CONCURRENCY: usize = 16;

/// Three primaries on free loopback ports, each in a directory of its own, killed when dropped.
struct Cluster {
    nodes: Vec<(u16, Child)>,
    _dir: tempfile::TempDir,
}

impl Cluster {
    fn start() -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let nodes: Vec<(u16, Child)> = (0..3)
            .map(|i| {
                let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
                let node_dir = dir.path().join(format!("n{i}"));
                std::fs::create_dir(&node_dir).unwrap();
                let child = Command::new("redis-server")
                    .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                    .args(["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"])
                    .current_dir(&node_dir)
                    .stdout(Stdio::null())
                    .spawn()
                    .expect("redis-server on the PATH");
                (port, child)
            })
            .collect();
        for (port, _) in &nodes {
            let url = format!("redis://127.0.0.1:{port}/");
            let started = Instant::now();
            while redis::Client::open(url.as_str()).unwrap().get_connection().is_err() {
                assert!(started.elapsed() < Duration::from_secs(10), "node {port} did not start");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let addrs: Vec<String> = nodes.iter().map(|(port, _)| format!("127.0.0.1:{port}")).collect();
        let out = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .unwrap();
        assert!(out.status.success(), "redis-cli --cluster create: {}", String::from_utf8_lossy(&out.stdout));
        let cluster = Cluster { nodes, _dir: dir };
        let started = Instant::now();
        while !cluster
            .each_node(|conn| redis::cmd("CLUSTER").arg("INFO").query::<String>(conn).unwrap())
            .iter()
            .all(|(_, info)| info.contains("cluster_state:ok"))
        {
            assert!(started.elapsed() < Duration::from_secs(30), "the cluster did not become ok");
            std::thread::sleep(Duration::from_millis(100));
        }
        cluster
    }

    fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|(port, _)| format!("redis://127.0.0.1:{port}/")).collect()
    }

    fn each_node<T>(&self, f: impl Fn(&mut redis::Connection) -> T) -> Vec<(u16, T)> {
        self.nodes
            .iter()
            .map(|(port, _)| {
                let url = format!("redis://127.0.0.1:{port}/");
                (*port, f(&mut redis::Client::open(url).unwrap().get_connection().unwrap()))
            })
            .collect()
    }

    /// Per node: commands served so far (INFO commandstats) and CPU seconds (user + sys).
    fn load(&self) -> Vec<(u16, (u64, f64))> {
        self.each_node(|conn| {
            let stats: String = redis::cmd("INFO").arg("commandstats").query(conn).unwrap();
            let calls = stats
                .lines()
                .filter_map(|l| l.split("calls=").nth(1))
                .filter_map(|rest| rest.split(',').next()?.parse::<u64>().ok())
                .sum();
            let cpu: String = redis::cmd("INFO").arg("cpu").query(conn).unwrap();
            let seconds = cpu
                .lines()
                .filter(|l| l.starts_with("used_cpu_user:") || l.starts_with("used_cpu_sys:"))
                .filter_map(|l| l.split(':').nth(1)?.trim().parse::<f64>().ok())
                .sum();
            (calls, seconds)
        })
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, child) in &mut self.nodes {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The settings the operator writes for a topic of `partitions` (or, with `None`, a plain stream `stream`), and the
/// group on every stream.
fn declare(conn: &mut redis::cluster::ClusterConnection, stream: &str, partitions: Option<u32>, ordering: &str) {
    let common = [("minIdleMs", "30000"), ("retryAfterMs", "1000"), ("maxDeliveries", "5")];
    let hset = |conn: &mut redis::cluster::ClusterConnection, key: String, fields: &[(&str, String)]| {
        let mut cmd = redis::cmd("HSET");
        cmd.arg(key);
        for (field, value) in common.iter().map(|(f, v)| (*f, v.to_string())).chain(fields.iter().cloned()) {
            cmd.arg(field).arg(value);
        }
        let _: () = cmd.query(conn).unwrap();
    };
    let Some(n) = partitions else {
        hset(conn, settings_key(stream, GROUP), &[("contractVersion", "1".into())]);
        let _: () =
            redis::cmd("XGROUP").arg("CREATE").arg(stream).arg(GROUP).arg("0").arg("MKSTREAM").query(conn).unwrap();
        return;
    };
    let topic_fields = [
        ("contractVersion", "2".to_string()),
        ("partitions", n.to_string()),
        ("ordering", ordering.to_string()),
        ("backoffFactor", "1".into()),
        ("backoffMaxMs", "0".into()),
    ];
    hset(conn, settings_key(stream, GROUP), &topic_fields);
    for p in 0..n {
        hset(conn, settings_key(&partition_stream(stream, p), GROUP), &topic_fields);
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(partition_stream(stream, p))
            .arg(GROUP)
            .arg("0")
            .arg("MKSTREAM")
            .query(conn)
            .unwrap();
    }
    let _: () = redis::cmd("HSET")
        .arg(topic_key(stream))
        .arg("partitions")
        .arg(n)
        .arg("contractVersion")
        .arg(2)
        .query(conn)
        .unwrap();
}

/// Publishes `count` messages one after another (a key each, of [`KEYS`]); messages per second.
async fn publish(source: &Source, stream: &str, partitions: Option<u32>, count: usize) -> f64 {
    let started = Instant::now();
    match partitions {
        Some(_) => {
            let producer = TopicProducer::connect_to(source, stream).await.unwrap();
            for n in 0..count {
                let key = format!("key-{}", n % KEYS);
                producer.publish(Some(key.as_bytes()), &[("n", n.to_string())]).await.unwrap();
            }
        }
        None => {
            let producer = Producer::connect_to(source, stream).await.unwrap();
            for n in 0..count {
                let key = format!("key-{}", n % KEYS);
                producer.publish(&[("pelican-key", key), ("n", n.to_string())]).await.unwrap();
            }
        }
    }
    count as f64 / started.elapsed().as_secs_f64()
}

/// Consumes `count` messages with one member (a topic) or one worker (a stream), no-op handler; messages per second.
async fn consume(source: &Source, stream: &str, partitions: Option<u32>, count: usize) -> f64 {
    let handled = Arc::new(AtomicUsize::new(0));
    let counter = handled.clone();
    let handler = move |_: Message| {
        counter.fetch_add(1, Ordering::Relaxed);
        async { Ok(Outcome::Done) }
    };
    let all_handled = async move {
        while handled.load(Ordering::Relaxed) < count {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let config = WorkerConfig {
        concurrency: CONCURRENCY,
        block: Duration::from_millis(50),
        ..WorkerConfig::new(stream, GROUP, "m1")
    };
    let started = Instant::now();
    match partitions {
        Some(_) => {
            let worker = TopicWorker::connect_to(
                source.clone(),
                TopicWorkerConfig { worker: config, ttl: Duration::from_secs(3) },
            )
            .await
            .unwrap();
            worker.run(handler, all_handled).await.unwrap();
        }
        None => {
            let worker = Worker::connect_to(source.clone(), config).await.unwrap();
            worker.run(handler, all_handled).await.unwrap();
        }
    }
    count as f64 / started.elapsed().as_secs_f64()
}

/// A member joining beside another, then the other dying (its run aborted, no leave): how long until every partition
/// that moved has a message handled by its new owner. Markers go into every partition every 20 ms meanwhile.
async fn rebalance(
    source: &Source,
    conn: &mut redis::cluster::ClusterConnection,
    topic: &str,
    n: u32,
) -> (Duration, Duration) {
    // partition -> (member, when) of each marker handled.
    let handled: Arc<Mutex<Vec<(u32, String, Instant)>>> = Arc::default();
    let member = |name: &'static str| {
        let handled = handled.clone();
        let config = TopicWorkerConfig {
            worker: WorkerConfig { block: Duration::from_millis(50), ..WorkerConfig::new(topic, GROUP, name) },
            ttl: Duration::from_secs(3),
        };
        let source = source.clone();
        async move {
            let worker = TopicWorker::connect_to(source, config).await.unwrap();
            tokio::spawn(worker.run(
                move |message: Message| {
                    let partition = message.partition.unwrap_or(u32::MAX);
                    handled.lock().unwrap().push((partition, name.to_string(), Instant::now()));
                    async { Ok(Outcome::Done) }
                },
                std::future::pending::<()>(),
            ))
            .abort_handle()
        }
    };
    let owners = |conn: &mut redis::cluster::ClusterConnection| -> BTreeMap<u32, String> {
        let owners: BTreeMap<String, String> = redis::cmd("HGETALL").arg(owners_key(topic, GROUP)).query(conn).unwrap();
        owners.into_iter().map(|(p, m)| (p.parse().unwrap(), m)).collect()
    };
    let publisher = {
        let (source, topic) = (source.clone(), topic.to_string());
        tokio::spawn(async move {
            let Source::Cluster(client) = source else { unreachable!("a Cluster") };
            let mut conn = client.get_async_connection().await.unwrap();
            loop {
                for p in 0..n {
                    let _: String = redis::cmd("XADD")
                        .arg(partition_stream(&topic, p))
                        .arg("*")
                        .arg("marker")
                        .arg(1)
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    // How long after `since` each of `partitions` had a marker handled by `by`: the longest.
    let settled = |by: &'static str, partitions: Vec<u32>, since: Instant| {
        let handled = handled.clone();
        async move {
            loop {
                let firsts: Option<Vec<Instant>> = {
                    let seen = handled.lock().unwrap();
                    partitions
                        .iter()
                        .map(|p| {
                            seen.iter()
                                .filter(|(q, m, at)| q == p && m == by && *at >= since)
                                .map(|(_, _, at)| *at)
                                .min()
                        })
                        .collect()
                };
                if let Some(firsts) = firsts {
                    return firsts.into_iter().max().map_or(Duration::ZERO, |at| at - since);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    let a = member("a").await;
    while owners(conn).len() < n as usize {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let joined = Instant::now();
    let _b = member("b").await;
    while owners(conn).values().filter(|m| *m == "b").count() < (n / 2) as usize {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let moved: Vec<u32> = owners(conn).into_iter().filter(|(_, m)| m == "b").map(|(p, _)| p).collect();
    let join = settled("b", moved, joined).await;
    let orphaned: Vec<u32> = owners(conn).into_iter().filter(|(_, m)| m == "a").map(|(p, _)| p).collect();
    let died = Instant::now();
    a.abort();
    let death = settled("b", orphaned, died).await;
    publisher.abort();
    (join, death)
}

fn main() {
    let count: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(20_000);
    let cluster = Cluster::start();
    let source = Source::Cluster(ClusterClient::new(cluster.urls()).unwrap());
    let mut conn = ClusterClient::new(cluster.urls()).unwrap().get_connection().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    println!(
        "{count} messages, {KEYS} keys, one member / worker at concurrency {CONCURRENCY}, a Cluster of 3 primaries"
    );
    println!("{:<28} {:>14} {:>14}", "", "publish msg/s", "consume msg/s");
    let cases: [(&str, Option<u32>, &str); 5] = [
        ("one stream", None, "None"),
        ("topic, 1 partition", Some(1), "None"),
        ("topic, 3 partitions", Some(3), "None"),
        ("topic, 12 partitions", Some(12), "None"),
        ("topic, 12 partitions PerKey", Some(12), "PerKey"),
    ];
    for (i, (label, partitions, ordering)) in cases.into_iter().enumerate() {
        let stream = format!("s{i}");
        declare(&mut conn, &stream, partitions, ordering);
        let published = rt.block_on(publish(&source, &stream, partitions, count));
        let before = cluster.load();
        let consumed = rt.block_on(consume(&source, &stream, partitions, count));
        let after = cluster.load();
        println!("{label:<28} {published:>14.0} {consumed:>14.0}");
        if partitions == Some(12) && ordering == "None" {
            let calls: Vec<u64> = before.iter().zip(&after).map(|((_, b), (_, a))| a.0 - b.0).collect();
            let cpu: Vec<f64> = before.iter().zip(&after).map(|((_, b), (_, a))| a.1 - b.1).collect();
            let (all_calls, all_cpu) = (calls.iter().sum::<u64>() as f64, cpu.iter().sum::<f64>());
            // A node holds the partitions whose slot it serves (the keys of a slot are counted only there).
            let owned: BTreeMap<u16, usize> = cluster
                .each_node(|node| {
                    let mut has = |p: u32| {
                        let slot: i64 =
                            redis::cmd("CLUSTER").arg("KEYSLOT").arg(partition_stream(&stream, p)).query(node).unwrap();
                        redis::cmd("CLUSTER").arg("COUNTKEYSINSLOT").arg(slot).query::<i64>(node).unwrap_or(0) > 0
                    };
                    (0..12).filter(|p| has(*p)).count()
                })
                .into_iter()
                .collect();
            for (j, (port, _)) in after.iter().enumerate() {
                println!(
                    "  shard :{port}: {} of 12 partitions, {:.0}% of the commands, {:.0}% of the CPU",
                    owned[port],
                    100.0 * calls[j] as f64 / all_calls,
                    100.0 * cpu[j] / all_cpu.max(f64::MIN_POSITIVE)
                );
            }
        }
    }
    declare(&mut conn, "r", Some(12), "None");
    let (join, death) = rt.block_on(rebalance(&source, &mut conn, "r", 12));
    println!(
        "rebalance of 12 partitions (ttl 3 s): a member joins -> its 6 handled {:.2} s later; the other dies -> its 6 \
         handled {:.2} s later",
        join.as_secs_f64(),
        death.as_secs_f64()
    );
}
