//! The Rust SDK's topic worker (SPEC 22) with the real operator and Redis 7.0: members of a topic's group share its
//! partitions, each message handled once by the owner of its partition; a member that leaves or dies hands its
//! partitions, pending lists included, to the others; topics it cannot serve are refused by name.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use pelican::keys::{KEY_FIELD, owners_key, partition_stream};
use pelican::topic::partition_of;
use pelican::worker::{
    BoxError, Message, Outcome, Source, TopicProducer, TopicWorker, TopicWorkerConfig, TopicWorkerError,
};

const PARTITIONS: u32 = 4;

type Conn = dyn redis::ConnectionLike;

/// Topic `t`, group `g`, passes every second on entries idle 1 s.
fn topic_policy(server: &Server, extra: &str) -> String {
    policy("t", &server.url(), "t", "g", extra).replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n")
}

/// The members run on the runtime's own threads while the test waits on its thread.
fn threaded() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn source(server: &Server) -> Source {
    Source::Server(redis::Client::open(server.url()).unwrap())
}

/// A handler run: the member, the message's key and id.
#[derive(Clone, Debug)]
struct Run {
    member: String,
    key: String,
    id: String,
}

type Runs = Arc<Mutex<Vec<Run>>>;

/// Member `name` running on its own task until `stop` is sent (or the task is aborted: a crash, nothing said to
/// anyone); its handler records each run, and never returns for the key `hang`.
fn member(
    rt: &tokio::runtime::Runtime,
    source: &Source,
    name: &str,
    runs: &Runs,
) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<Result<pelican::worker::WorkerStats, TopicWorkerError>>)
{
    let mut config = TopicWorkerConfig::new("t", "g", name);
    config.ttl = Duration::from_secs(3);
    config.worker.block = Duration::from_millis(200);
    config.worker.shutdown_grace = Duration::from_secs(2);
    let worker = rt.block_on(TopicWorker::connect_to(source.clone(), config)).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (runs, name) = (runs.clone(), name.to_string());
    let handler = move |message: Message| {
        let (runs, member) = (runs.clone(), name.clone());
        async move {
            let key = message.field_str(KEY_FIELD).unwrap_or_default().to_string();
            runs.lock().unwrap().push(Run { member, key: key.clone(), id: message.id.clone() });
            if key == "hang" {
                std::future::pending::<()>().await;
            }
            Ok::<_, BoxError>(Outcome::Done)
        }
    };
    let task = rt.spawn(worker.run(handler, async move {
        let _ = stopped.await;
    }));
    (stop, task)
}

/// Partition -> its owner, as `membership.lua` keeps it.
fn owners(conn: &mut Conn) -> BTreeMap<u32, String> {
    let owners: HashMap<String, String> = redis::cmd("HGETALL").arg(owners_key("t", "g")).query(conn).unwrap();
    owners.into_iter().map(|(p, m)| (p.parse().unwrap(), m)).collect()
}

fn wait_owners(conn: &mut Conn, want: impl Fn(&BTreeMap<u32, String>) -> bool) -> BTreeMap<u32, String> {
    wait_for("the partitions' owners", Duration::from_secs(30), || {
        let now = owners(conn);
        if want(&now) { Ok(now) } else { Err(format!("{now:?}")) }
    })
}

fn publish(rt: &tokio::runtime::Runtime, producer: &TopicProducer, keys: &[String]) -> Vec<String> {
    keys.iter()
        .map(|key| rt.block_on(producer.publish(Some(key.as_bytes()), &[("n", key.as_str())])).unwrap().1)
        .collect()
}

fn wait_runs(runs: &Runs, count: usize) -> Vec<Run> {
    wait_for(&format!("{count} runs"), Duration::from_secs(30), || {
        let now = runs.lock().unwrap().clone();
        if now.len() >= count { Ok(now) } else { Err(format!("{} runs", now.len())) }
    })
}

fn pending(conn: &mut Conn, partitions: u32) -> usize {
    (0..partitions)
        .map(|p| {
            let summary: (usize, redis::Value, redis::Value, redis::Value) =
                redis::cmd("XPENDING").arg(partition_stream("t", p)).arg("g").query(conn).unwrap();
            summary.0
        })
        .sum()
}

#[test]
fn members_share_the_partitions_and_the_owner_of_each_handles_its_messages_once() {
    let server = Server::start(Flavor::Redis);
    let (_ns, _operator) = ready_policy("topic-members", &topic_policy(&server, "  partitions: 4\n"), "t");
    members_share_the_partitions(&source(&server), &mut server.conn(), PARTITIONS);
}

/// On a Cluster of three shards: the partitions live on all three, the membership in the topic's own slot.
#[test]
fn on_a_cluster_members_share_the_partitions_over_its_shards() {
    let cluster = Cluster::start(Flavor::Redis);
    let manifest = policy("t", &cluster.url(), "t", "g", "  partitions: 8\n")
        .replacen("  stream:", "    mode: Cluster\n  stream:", 1)
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n");
    let (_ns, _operator) = ready_policy("topic-cluster-members", &manifest, "t");
    let urls: Vec<String> = cluster.nodes.iter().map(|node| format!("redis://127.0.0.1:{}/", node.port)).collect();
    let source = Source::Cluster(redis::cluster::ClusterClient::new(urls).unwrap());
    members_share_the_partitions(&source, &mut cluster.conn(), 8);
}

/// Members `a` and `b` share `partitions`; 40 keyed messages are each handled once, by the owner of the key's
/// partition; `a` leaves and `b` takes every partition and what comes next.
fn members_share_the_partitions(source: &Source, conn: &mut Conn, partitions: u32) {
    let rt = threaded();
    let runs: Runs = Arc::default();
    let (stop_a, a) = member(&rt, source, "a", &runs);
    let (stop_b, b) = member(&rt, source, "b", &runs);
    let half = partitions as usize / 2;
    let shared =
        wait_owners(conn, |o| o.len() == partitions as usize && o.values().filter(|m| *m == "a").count() == half);
    let producer = rt.block_on(TopicProducer::connect_to(source, "t")).unwrap();
    assert_eq!(producer.partitions(), partitions);
    let keys: Vec<String> = (0..40).map(|i| format!("order-{i}")).collect();
    let ids = publish(&rt, &producer, &keys);
    let handled = wait_runs(&runs, keys.len());
    for (key, id) in keys.iter().zip(&ids) {
        let of_it: Vec<&Run> = handled.iter().filter(|r| &r.id == id && &r.key == key).collect();
        assert_eq!(of_it.len(), 1, "{key} handled once: {handled:?}");
        let owner = &shared[&partition_of(key.as_bytes(), partitions)];
        assert_eq!(&of_it[0].member, owner, "{key} handled by its partition's owner");
    }
    wait_for("every message acknowledged", Duration::from_secs(10), || match pending(conn, partitions) {
        0 => Ok(()),
        n => Err(format!("{n} pending")),
    });

    // `a` leaves: its partitions go to `b`, which handles what comes next.
    stop_a.send(()).unwrap();
    let stats = rt.block_on(a).unwrap().unwrap();
    assert!(stats.done >= 1, "{stats:?}");
    wait_owners(conn, |o| o.len() == partitions as usize && o.values().all(|m| m == "b"));
    let later: Vec<String> = (0..8).map(|i| format!("later-{i}")).collect();
    publish(&rt, &producer, &later);
    let handled = wait_runs(&runs, keys.len() + later.len());
    for key in &later {
        let of_it: Vec<&Run> = handled.iter().filter(|r| &r.key == key).collect();
        assert_eq!(of_it.len(), 1, "{key} handled once: {of_it:?}");
        assert_eq!(of_it[0].member, "b", "{key}");
    }
    stop_b.send(()).unwrap();
    rt.block_on(b).unwrap().unwrap();
    assert!(owners(conn).is_empty(), "both left: nothing owned");
}

#[test]
fn a_member_that_dies_hands_its_partitions_and_their_pending_lists_to_the_others() {
    let server = Server::start(Flavor::Redis);
    // The pass would requeue the hung entry once idle past minIdle: far later than the take-over, here.
    let manifest = policy("t", &server.url(), "t", "g", "  partitions: 4\n")
        .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 60s\n");
    let (_ns, _operator) = ready_policy("topic-dies", &manifest, "t");
    let mut conn = server.conn();
    let rt = threaded();
    let runs: Runs = Arc::default();
    let (_stop_a, a) = member(&rt, &source(&server), "a", &runs);
    wait_owners(&mut conn, |o| o.len() == 4);
    let producer = rt.block_on(TopicProducer::connect_to(&source(&server), "t")).unwrap();
    // `a` alone: it reads the message and its handler never returns.
    let [hung] = &publish(&rt, &producer, &["hang".to_string()])[..] else { unreachable!() };
    wait_runs(&runs, 1);
    let (_stop_b, _b) = member(&rt, &source(&server), "b", &runs);
    wait_owners(&mut conn, |o| o.values().filter(|m| *m == "b").count() == 2);
    // `a` crashes: no leave, no give-back; its membership expires within the ttl.
    a.abort();
    let taken = wait_owners(&mut conn, |o| o.len() == 4 && o.values().all(|m| m == "b"));
    assert_eq!(taken.len(), 4);
    let handled = wait_runs(&runs, 2);
    let of_it: Vec<&Run> = handled.iter().filter(|r| &r.id == hung).collect();
    assert_eq!(of_it.len(), 2, "read by a, then by b from a's pending list: {handled:?}");
    assert_eq!((of_it[0].member.as_str(), of_it[1].member.as_str()), ("a", "b"));
    let partition = partition_stream("t", partition_of(b"hang", PARTITIONS));
    let owned: Vec<(String, String, u64, u64)> =
        redis::cmd("XPENDING").arg(&partition).arg("g").arg("-").arg("+").arg(10).query(&mut conn).unwrap();
    let deliveries = owned.iter().find(|p| &p.0 == hung).map(|p| (p.1.clone(), p.3));
    assert_eq!(deliveries, Some(("b".to_string(), 2)), "b's, its take-over counted as a delivery");
}

#[test]
fn topics_it_cannot_serve_are_refused_by_name() {
    let server = Server::start(Flavor::Redis);
    let rt = runtime();
    let extra = "  partitions: 4\n  ordering: PerKey\n";
    let (ns, _operator) = ready_policy("topic-refused", &topic_policy(&server, extra), "t");
    let connect =
        |topic: &str| rt.block_on(TopicWorker::connect_to(source(&server), TopicWorkerConfig::new(topic, "g", "a")));
    let error = connect("t").err().expect("PerKey refused").to_string();
    assert!(error.contains("\"t\"") && error.contains("PerKey") && error.contains("ordering None"), "{error}");
    let (applied, out) = kubectl_apply(&ns, &policy("plain", &server.url(), "s", "g", ""));
    assert!(applied, "{out}");
    wait_condition(&ns, "plain", "Ready", "True", "Reconciled");
    let error = connect("s").err().expect("a stream is no topic").to_string();
    assert!(
        error.contains("\"s\"") && error.contains("describe no topic") && error.contains("spec.partitions"),
        "{error}"
    );
    let mut config = TopicWorkerConfig::new("t", "g", "a");
    config.ttl = Duration::from_millis(500);
    let error = rt.block_on(TopicWorker::connect_to(source(&server), config)).err().expect("ttl").to_string();
    assert!(error.contains("ttl must be 1 s .. 1 day"), "{error}");
}
