//! The conformance suite's topic scenarios (SPEC 22, contract/README.md "Topics"): every library's conformance worker
//! in its topic mode (`TOPIC`), side by side, each on a `PerKey` topic of its own under one operator, on Redis 7.0 and
//! on a Cluster of three primaries. What is asserted is what a user sees: the workers' run lines (the partition, the
//! key, when each handler began and returned), the pending lists, the dead-letter stream.
//!
//! The ledger of every scenario: each message done, or dead-lettered once at the cap; per key, no run of a message
//! after a run of a later one (0 inversions) and never two at once; no partition in the hands of two members at
//! once; a message run twice only when the member that ran it first was killed before it could acknowledge.

#[macro_use]
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::*;
use pelican::keys::{KEY_FIELD, owners_key, partition_stream};
use pelican::topic::partition_of;

/// Each scenario on one server and on a Cluster.
macro_rules! on_a_server_and_a_cluster {
    ($($name:ident),* $(,)?) => {
        mod redis_7 { $( #[test] fn $name() { super::$name(super::Place::Server) } )* }
        mod redis_7_cluster { $( #[test] fn $name() { super::$name(super::Place::Cluster) } )* }
    };
}

on_a_server_and_a_cluster!(
    keys_stay_in_order_as_members_join_leave_die_and_roll,
    a_poison_message_is_dead_lettered_at_the_cap_while_its_key_waits,
);

#[derive(Clone, Copy, Debug)]
enum Place {
    Server,
    Cluster,
}

/// How long a membership lives without a heartbeat in these scenarios: a dead member's partitions move within it.
const TTL_MS: &str = "3000";

type Conn = Box<dyn redis::ConnectionLike + Send>;

/// A message of a topic: its partition and its id there (ids of two partitions may be equal).
type Entry = (u32, String);

fn entry_of(run: &Run) -> Entry {
    (run.partition.unwrap_or(u32::MAX), run.id.clone())
}

/// What a scenario gets for one library: its topic (and policy), the server, how to connect.
struct TopicLane {
    library: Library,
    topic: String,
    partitions: u32,
    url: String,
    place: Place,
}

impl TopicLane {
    fn conn(&self) -> Conn {
        match self.place {
            Place::Server => Box::new(redis::Client::open(self.url.as_str()).unwrap().get_connection().unwrap()),
            Place::Cluster => {
                Box::new(redis::cluster::ClusterClient::new(vec![self.url.clone()]).unwrap().get_connection().unwrap())
            }
        }
    }

    /// The library's topic member `consumer`, once the membership names it.
    fn member(&self, conn: &mut Conn, consumer: &str) -> Running {
        let mut env = vec![("TOPIC", self.topic.as_str()), ("MEMBERSHIP_TTL_MS", TTL_MS)];
        if matches!(self.place, Place::Cluster) {
            env.push(("REDIS_CLUSTER", "1"));
        }
        let member = Running::start_with(&self.library, &self.url, &self.topic, consumer, 5_000, &env);
        self.wait_owners(conn, &format!("{} to own a partition", member.what), |owners| {
            owners.values().any(|owner| owner == consumer)
        });
        member
    }

    /// Partition -> its owner, as the membership script keeps it.
    fn owners(&self, conn: &mut Conn) -> BTreeMap<u32, String> {
        let owners: BTreeMap<String, String> =
            redis::cmd("HGETALL").arg(owners_key(&self.topic, GROUP)).query(conn.as_mut()).unwrap();
        owners.into_iter().map(|(p, m)| (p.parse().unwrap(), m)).collect()
    }

    fn wait_owners(&self, conn: &mut Conn, what: &str, want: impl Fn(&BTreeMap<u32, String>) -> bool) {
        wait_for(what, Duration::from_secs(60), || {
            let owners = self.owners(conn);
            if want(&owners) { Ok(()) } else { Err(format!("owners {owners:?}")) }
        });
    }

    /// Waits until exactly `members` own every partition, balanced (each `N / M` or one more).
    fn wait_balanced(&self, conn: &mut Conn, members: &[&str]) {
        let (n, m) = (self.partitions as usize, members.len());
        self.wait_owners(conn, &format!("{} partitions balanced over {members:?}", self.library.name), |owners| {
            let mut shares: BTreeMap<&str, usize> = BTreeMap::new();
            for owner in owners.values() {
                *shares.entry(owner.as_str()).or_default() += 1;
            }
            owners.len() == n
                && shares.len() == m
                && members.iter().all(|member| shares.get(member).is_some_and(|s| *s == n / m || *s == n / m + 1))
        });
    }

    /// Publishes a message of `key` whose handler does `handle` for `ms`, as a producer does (the key first, in the
    /// partition of its hash); where it went.
    fn publish(&self, conn: &mut Conn, key: &str, handle: &str, ms: u64) -> Entry {
        let partition = partition_of(key.as_bytes(), self.partitions);
        let id = redis::cmd("XADD")
            .arg(partition_stream(&self.topic, partition))
            .arg("*")
            .arg(KEY_FIELD)
            .arg(key)
            .arg("handle")
            .arg(handle)
            .arg("ms")
            .arg(ms)
            .query(conn.as_mut())
            .unwrap();
        (partition, id)
    }

    /// Entries pending on every partition.
    fn pending(&self, conn: &mut Conn) -> usize {
        (0..self.partitions)
            .map(|p| {
                let summary: (usize, redis::Value, redis::Value, redis::Value) = redis::cmd("XPENDING")
                    .arg(partition_stream(&self.topic, p))
                    .arg(GROUP)
                    .query(conn.as_mut())
                    .unwrap();
                summary.0
            })
            .sum()
    }

    /// The dead letters of `partition`: the topic's dead-letter stream on one server; on a Cluster, the partition's
    /// own, in its slot (policy.md, "Partitions and ordering").
    fn dead_letters(&self, conn: &mut Conn, partition: u32) -> Vec<RawEntry> {
        let stream = match self.place {
            Place::Server => format!("{}:dlq", self.topic),
            Place::Cluster => format!("{}:{}:dlq", partition_stream(&self.topic, partition), self.topic),
        };
        redis::cmd("XRANGE").arg(stream).arg("-").arg("+").query(conn.as_mut()).unwrap()
    }
}

/// Runs `scenario` for every library side by side: one server (or Cluster), one operator, a `PerKey` policy per
/// library (`extra` added to its spec) on its own topic. Panics naming every library that failed.
fn for_every_library(place: Place, prefix: &str, partitions: u32, extra: &str, scenario: fn(&TopicLane)) {
    let libraries = topic_libraries();
    let (_server, _cluster, url) = match place {
        Place::Server => {
            let server = Server::start(Flavor::Redis);
            let url = server.url();
            (Some(server), None, url)
        }
        Place::Cluster => {
            let cluster = Cluster::start(Flavor::Redis);
            let url = cluster.url();
            (None, Some(cluster), url)
        }
    };
    let namespace = namespace(prefix);
    let _operator = Operator::start(&namespace);
    let mode = if matches!(place, Place::Cluster) { "    mode: Cluster\n  stream:" } else { "  stream:" };
    let manifests: Vec<String> = libraries
        .iter()
        .map(|library| {
            let spec = format!("  partitions: {partitions}\n  ordering: PerKey\n{extra}");
            policy(&format!("c-{}", library.name), &url, &library.name, GROUP, &spec)
                .replacen("  stream:", mode, 1)
                .replace("    interval: 1s\n", "    interval: 1s\n    minIdle: 1s\n")
        })
        .collect();
    let (applied, out) = kubectl_apply(&namespace, &manifests.join("---\n"));
    assert!(applied, "kubectl apply failed: {out}");
    wait_all_ready(&namespace, libraries.len(), Duration::from_secs(60));
    let lanes = libraries.into_iter().map(|library| TopicLane {
        topic: library.name.clone(),
        partitions,
        url: url.clone(),
        place,
        library,
    });
    let lanes = lanes.map(|lane| (lane.library.name.clone(), lane));
    side_by_side(&format!("{prefix} on {place:?}"), lanes, scenario);
}

/// The listed libraries (`conformance/workers.txt`, narrowed by `CONFORMANCE_WORKERS`) whose worker runs topics
/// (`conformance/topics.txt`); the ones left out are named on stderr, so that a run is never taken for all five.
fn topic_libraries() -> Vec<Library> {
    let listed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/conformance/topics.txt")).unwrap();
    let on_topics: Vec<&str> = listed.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    let (run, left): (Vec<Library>, Vec<Library>) =
        libraries().into_iter().partition(|library| on_topics.contains(&library.name.as_str()));
    if !left.is_empty() {
        let names: Vec<&str> = left.iter().map(|l| l.name.as_str()).collect();
        eprintln!("topic scenarios: not yet for {names:?} (no topic mode in conformance/topics.txt)");
    }
    assert!(!run.is_empty(), "no library of conformance/topics.txt is listed (or none of CONFORMANCE_WORKERS)");
    run
}

/// A stream id as a number pair, to order ids.
fn id_order(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
}

/// What the runs show against the contract's promises: per key, a run of a message after a run of a later one
/// (an inversion) or two runs at once; a partition run by two members at once. `killed`: members that died without
/// a word, whose runs may be repeated by the next owner.
fn order_violations(runs: &[Run], killed: &[&str]) -> Vec<String> {
    let mut wrong = vec![];
    let span = |run: &Run| (run.started_at.unwrap_or(0), run.ended_at.unwrap_or(0));
    let mut by_key: BTreeMap<&str, Vec<&Run>> = BTreeMap::new();
    for run in runs {
        if run.started_at.is_none() || run.partition.is_none() {
            wrong.push(format!("a run line without its topic fields: {run:?}"));
        }
        by_key.entry(run.key.as_deref().unwrap_or("")).or_default().push(run);
    }
    for (key, runs) in &mut by_key {
        runs.sort_by_key(|run| (span(run), id_order(&run.id)));
        let mut latest: Option<&Run> = None;
        for (i, run) in runs.iter().enumerate() {
            if let Some(later) = latest.filter(|l| id_order(&l.id) > id_order(&run.id)) {
                wrong.push(format!("key {key}: {} ran after {} (inversion)", show(run), show(later)));
            }
            if latest.is_none_or(|l| id_order(&l.id) < id_order(&run.id)) {
                latest = Some(run);
            }
            if let Some(next) = runs.get(i + 1).filter(|next| span(next).0 < span(run).1) {
                wrong.push(format!("key {key}: {} and {} at once", show(run), show(next)));
            }
        }
    }
    let mut by_partition: BTreeMap<u32, Vec<&Run>> = BTreeMap::new();
    for run in runs {
        by_partition.entry(run.partition.unwrap_or(u32::MAX)).or_default().push(run);
    }
    for (partition, runs) in &by_partition {
        for (i, a) in runs.iter().enumerate() {
            let overlap = runs[i + 1..]
                .iter()
                .find(|b| b.consumer != a.consumer && span(a).0 < span(b).1 && span(b).0 < span(a).1);
            if let Some(b) = overlap {
                wrong.push(format!("partition {partition}: {} and {} at once", show(a), show(b)));
            }
        }
    }
    let mut seen: BTreeMap<Entry, Vec<&Run>> = BTreeMap::new();
    for run in runs.iter().filter(|run| run.outcome == "done") {
        seen.entry(entry_of(run)).or_default().push(run);
    }
    for ((partition, id), runs) in seen.iter_mut().filter(|(_, runs)| runs.len() > 1) {
        runs.sort_by_key(|run| span(run));
        if runs[..runs.len() - 1].iter().any(|run| !killed.contains(&run.consumer.as_str())) {
            wrong.push(format!("{partition}/{id} done {} times, not after a kill: {runs:?}", runs.len()));
        }
    }
    wrong
}

fn show(run: &Run) -> String {
    format!("{} by {} ({}..{})", run.id, run.consumer, run.started_at.unwrap_or(0), run.ended_at.unwrap_or(0))
}

/// Waits until every message of `ids` has a `done` run among `members`' lines, then for an empty pending list.
fn wait_all_done(lane: &TopicLane, conn: &mut Conn, members: &[&Running], ids: &[Entry]) -> Vec<Run> {
    let wanted: BTreeSet<Entry> = ids.iter().cloned().collect();
    let runs = wait_for(&format!("{} messages done", ids.len()), Duration::from_secs(90), || {
        let runs: Vec<Run> = members.iter().flat_map(|m| m.runs()).collect();
        let done: BTreeSet<Entry> = runs.iter().filter(|r| r.outcome == "done").map(entry_of).collect();
        let missing = wanted.difference(&done).count();
        if missing == 0 { Ok(runs) } else { Err(format!("{missing} not done yet")) }
    });
    wait_for("every partition's pending list empty", Duration::from_secs(30), || match lane.pending(conn) {
        0 => Ok(()),
        n => Err(format!("{n} pending")),
    });
    runs
}

/// Eight keys, three messages each, interleaved; their ids.
fn round(lane: &TopicLane, conn: &mut Conn, ms: u64) -> Vec<Entry> {
    (0..3)
        .flat_map(|_| (0..8).map(|k| format!("k{k}")).collect::<Vec<_>>())
        .map(|key| lane.publish(conn, &key, "done", ms))
        .collect()
}

/// Scale-up (one member, then two, then three), a kill -9 while handlers run, scale-down by SIGTERM, and a rolling
/// restart (a new member beside each old one, then the old one stopped): every message done, in order per key.
fn keys_stay_in_order_as_members_join_leave_die_and_roll(place: Place) {
    for_every_library(place, "topic-order", 4, "", |lane| {
        let mut conn = lane.conn();
        let mut ids = vec![];
        let mut gone: Vec<Running> = vec![];
        let w1 = lane.member(&mut conn, "w1");
        lane.wait_balanced(&mut conn, &["w1"]);
        ids.extend(round(lane, &mut conn, 20));
        let w2 = lane.member(&mut conn, "w2");
        lane.wait_balanced(&mut conn, &["w1", "w2"]);
        ids.extend(round(lane, &mut conn, 20));
        let mut w3 = lane.member(&mut conn, "w3");
        lane.wait_balanced(&mut conn, &["w1", "w2", "w3"]);
        // Handlers of 300 ms: w1 dies with some in flight, which the new owners run from the pending list.
        ids.extend(round(lane, &mut conn, 300));
        let mut w1 = w1;
        wait_for("w1 to run a message", Duration::from_secs(30), || {
            if w1.runs().is_empty() { Err("no run yet".to_string()) } else { Ok(()) }
        });
        w1.child.kill().unwrap();
        let _ = w1.child.wait();
        gone.push(w1);
        lane.wait_balanced(&mut conn, &["w2", "w3"]);
        ids.extend(round(lane, &mut conn, 20));
        let mut w2 = w2;
        assert!(w2.terminate().success(), "{} exits 0 after SIGTERM", w2.what);
        gone.push(w2);
        lane.wait_balanced(&mut conn, &["w3"]);
        // The rolling restart.
        let w4 = lane.member(&mut conn, "w4");
        lane.wait_balanced(&mut conn, &["w3", "w4"]);
        ids.extend(round(lane, &mut conn, 20));
        assert!(w3.terminate().success(), "{} exits 0 after SIGTERM", w3.what);
        gone.push(w3);
        lane.wait_balanced(&mut conn, &["w4"]);
        let w5 = lane.member(&mut conn, "w5");
        lane.wait_balanced(&mut conn, &["w4", "w5"]);
        let mut w4 = w4;
        assert!(w4.terminate().success(), "{} exits 0 after SIGTERM", w4.what);
        gone.push(w4);
        lane.wait_balanced(&mut conn, &["w5"]);
        ids.extend(round(lane, &mut conn, 20));
        let members: Vec<&Running> = gone.iter().chain([&w5]).collect();
        let runs = wait_all_done(lane, &mut conn, &members, &ids);
        let wrong = order_violations(&runs, &["w1"]);
        assert!(wrong.is_empty(), "{} runs of {} messages:\n{}", runs.len(), ids.len(), wrong.join("\n"));
        let partitions: BTreeSet<u32> = runs.iter().filter_map(|r| r.partition).collect();
        assert_eq!(partitions.len(), 4, "every partition ran messages: {partitions:?}");
    });
}

/// A message that always fails runs `maxDeliveries` times, in place, while the later messages of its key wait and
/// another key goes on; the operator's pass dead-letters it once; then its key goes on.
fn a_poison_message_is_dead_lettered_at_the_cap_while_its_key_waits(place: Place) {
    for_every_library(place, "topic-poison", 2, "  retry:\n    maxDeliveries: 3\n", |lane| {
        let mut conn = lane.conn();
        let w1 = lane.member(&mut conn, "w1");
        let w2 = lane.member(&mut conn, "w2");
        lane.wait_balanced(&mut conn, &["w1", "w2"]);
        let before = lane.publish(&mut conn, "p", "done", 10);
        let poison = lane.publish(&mut conn, "p", "fail", 10);
        let mut after = vec![];
        let mut others = vec![];
        for _ in 0..3 {
            after.push(lane.publish(&mut conn, "p", "done", 10));
            others.push(lane.publish(&mut conn, "q", "done", 10));
        }
        let ids: Vec<Entry> = [before].into_iter().chain(after.clone()).chain(others.clone()).collect();
        let runs = wait_all_done(lane, &mut conn, &[&w1, &w2], &ids);
        let wrong = order_violations(&runs, &[]);
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        let of = |entry: &Entry| runs.iter().filter(|r| entry_of(r) == *entry).cloned().collect::<Vec<_>>();
        let poisoned = of(&poison);
        assert_eq!(poisoned.len(), 3, "the poison ran maxDeliveries times: {poisoned:?}");
        assert!(poisoned.iter().all(|r| r.outcome == "fail"), "{poisoned:?}");
        let last_failure = poisoned.iter().filter_map(|r| r.ended_at).max().unwrap();
        for id in &after {
            let started = of(id)[0].started_at.unwrap();
            assert!(started >= last_failure, "{id:?} of the poison's key waited for it: {:?}", of(id));
        }
        let first_failure = poisoned.iter().filter_map(|r| r.started_at).min().unwrap();
        let other_done = others.iter().map(|id| of(id)[0].ended_at.unwrap()).max().unwrap();
        assert!(
            other_done < last_failure,
            "key q went on while p waited (q done by {other_done}, p's runs {first_failure}..{last_failure})"
        );
        let letters = lane.dead_letters(&mut conn, poison.0);
        assert_eq!(letters.len(), 1, "dead-lettered once: {letters:?}");
        let field = |name: &str| String::from_utf8(field(&letters[0], name).unwrap_or_default().to_vec()).unwrap();
        assert_eq!(field("pelican-source-id"), poison.1);
        assert_eq!(field("pelican-source-stream"), partition_stream(&lane.topic, poison.0));
        assert_eq!(field("pelican-reason"), "MaxDeliveriesExceeded");
        assert_eq!(field("pelican-deliveries"), "3", "each delivery one its handler saw");
    });
}
